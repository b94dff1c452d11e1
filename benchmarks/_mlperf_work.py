"""benchmarks/mlperf_dcnv2.py's arithmetic: the MLPerf model's work per sample and the floors it gives at measured
rates. Moved out of mlperf_dcnv2.py unchanged (the 600-line rule)."""

from __future__ import annotations


def mlp_macs(in_features: int, widths: list[int]) -> int:
    macs = 0
    for w in widths:
        macs += in_features * w
        in_features = w
    return macs


def work_per_sample(cfg) -> dict:
    """Forward multiply-adds of the dense part, FLOP fwd + bwd (3 x 2 x MACs) and the embedding bytes
    (bf16 rows: read fwd, read + written by the update; fp32 row-wise state read + written; bf16
    output gradient read) per sample, from the config's shapes."""
    m = cfg.model
    num_dense = 13
    F, D, L = len(m.cardinalities), m.embedding_dim, sum(m.multi_hot_sizes)
    n = (F + 1) * D  # the cross network's width: the bottom MLP's output and the F embeddings
    bottom = mlp_macs(num_dense, m.bottom_mlp)
    cross = m.cross_layers * 2 * n * m.cross_rank
    top = mlp_macs(n, m.top_mlp)
    macs = bottom + cross + top
    row = D * 2  # bf16
    emb_bytes = L * row + L * 2 * row + L * 2 * 4 + F * D * 2
    return {"bottom_macs": bottom, "cross_macs": cross, "top_macs": top, "macs": macs, "flop": 6 * macs,
            "emb_bytes": emb_bytes, "lookups": L, "features": F, "width": n}


def floors(work: dict, peaks: dict) -> dict:
    """samples/s at the GEMM rate (compute) and at the copy bandwidth (embedding traffic), and both in
    series (no overlap): the floor the step time cannot beat if the two do not overlap; with a sustained GEMM rate
    (``peaks["gemm_tflops_sustained"]``), the compute and series floors at that rate too (else None)."""
    compute = peaks["gemm_tflops"] * 1e12 / work["flop"]
    memory = peaks["copy_gbps"] * 1e9 / work["emb_bytes"]
    sustained = peaks.get("gemm_tflops_sustained")
    compute_s = sustained * 1e12 / work["flop"] if sustained else None
    return {"flop_per_sample": work["flop"], "emb_bytes_per_sample": work["emb_bytes"],
            "gemm_tflops": peaks["gemm_tflops"], "copy_gbps": peaks["copy_gbps"], "compute_floor_sps": compute,
            "memory_floor_sps": memory, "floor_sps": 1.0 / (1.0 / compute + 1.0 / memory),
            "gemm_tflops_sustained": sustained, "compute_floor_sustained_sps": compute_s,
            "floor_sustained_sps": 1.0 / (1.0 / compute_s + 1.0 / memory) if compute_s else None}
