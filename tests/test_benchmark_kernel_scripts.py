"""The kernel and probe benchmark scripts' own logic (not their timings): the Triton kernels', MLP's, embeddings',
cross layer's, GEMM layouts' and FP8 probes' smoke runs and the files each writes, their launch parsing, forced launches
restored, and the probes' refusals without a GPU. (Split from test_benchmark_scripts.py, which keeps the training,
loader and profiling scripts and the helpers other test files import.)"""

from __future__ import annotations

import collections
import csv
import math
import os
import sys

import pytest
import torch

from tests.test_benchmark_scripts import REPO, load_script, read_csv, small_mlperf_config


def test_kernels_append_replaces_only_the_cases_measured_again(tmp_path):
    """--append keeps every earlier (kernel, batch, dtype) case not measured in this run. Both runs call the script's
    main() in this process (the merge is what is checked, not an exit status: two interpreter start-ups and torch and
    Triton imports saved); the process-wide settings it changes (loguru's sinks, the fp32 matmul precision, dynamo's
    recompile limits) are put back after it, as a fresh process would have left them."""
    from loguru import logger

    precision = torch.get_float32_matmul_precision()
    limits = {n: getattr(torch._dynamo.config, n) for n in ("cache_size_limit", "recompile_limit")
              if hasattr(torch._dynamo.config, n)}

    base = ["--out", str(tmp_path)]
    if torch.cuda.is_available():  # compiled kernels, short timings (the GPU image's Triton 3.6 interpreter
        # fails on the loss kernel with its numpy: not a configuration that runs kernels)
        base += ["--device", "cuda", "--dtypes", "fp32", "--impls", "triton,eager", "--warmup-ms", "1", "--rep-ms", "2"]
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1"  # the conftest's: the interpreter the subprocesses were given
        base += ["--device", "cpu", "--cpu-reps", "1"]
    kb = load_script("kernels")  # by path: benchmarks/kernels.py must not shadow the `kernels` package
    try:
        # batches of 2 and 4 (the CPU's default 8 and 16: more interpreted programs, the same merge)
        assert kb.main(base + ["--kernels", "loss", "--batch-sizes", "2,4"]) == 0
        assert kb.main(base + ["--kernels", "loss,interaction_d16", "--batch-sizes", "4", "--append"]) == 0
    finally:
        logger.remove()  # main() replaces loguru's sinks with its own tqdm one: the default stderr sink back
        logger.add(sys.stderr)
        torch.set_float32_matmul_precision(precision)
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
    with open(tmp_path / "kernels.csv") as f:
        rows = list(csv.DictReader(f))
    cases = collections.Counter((r["kernel"], r["batch"]) for r in rows)
    assert cases[("copy", "")] == 1
    assert cases[("loss", "2")] == cases[("loss", "4")] == cases[("interaction_d16", "4")] > 0
    assert set(cases) == {("copy", ""), ("loss", "2"), ("loss", "4"), ("interaction_d16", "4")}
    errors = [(r["kernel"], r["batch"], r["error"]) for r in rows if r["error"]]
    assert not errors, errors


def test_mlp_benchmark_smoke_times_every_implementation(tmp_path):
    """benchmarks/mlp.py --smoke: every MLP case x (eager, compiled, fused) measured at tiny shapes, the
    speed-ups relative to eager, and the CSV / Markdown / PNG written (CUDA: graph-replay timing); the
    opt-in fp8 and on-chip tail impls, the tail with a forced launch too."""
    mb = load_script("mlp")
    one = ["--steps", "1"]  # a step a window (2 by default): every case still warmed up and timed in 2 windows
    assert mb.main(["--smoke", "--out", str(tmp_path), *one]) == 0
    rows = read_csv(tmp_path / "mlp.csv")
    assert [(r["mlp"], r["impl"]) for r in rows] == [(m, i) for m in mb.CASES for i in mb.DEFAULT_IMPLS]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and r["batch"] == "8" and r["steps_per_window"] == "1"
               for r in rows), rows
    assert all(float(r["speedup_vs_eager"]) == 1.0 for r in rows if r["impl"] == "eager")
    assert {"device", "torch", "triton", "date"} <= set(rows[0])
    md = (tmp_path / "mlp.md").read_text()
    assert md.count("| fused | ") == len(mb.CASES) and (tmp_path / "mlp.png").stat().st_size > 0
    # the FP8 try is opt-in and runs under bf16 autocast only: a tf32 row says so, and the run succeeds
    assert mb.main(["--smoke", "--mlps", "kaggle_top", "--impls", "eager,fp8", "--out", str(tmp_path / "fp8"),
                    *one]) == 0
    fp8 = [r for r in read_csv(tmp_path / "fp8" / "mlp.csv") if r["impl"] == "fp8"]
    assert [r["status"] for r in fp8] == ["skipped: fp8 runs under bf16 autocast"]
    # the on-chip tail (kernels/mlp_tail.py) is opt-in too; each forced launch adds a tail[...] row
    assert mb.main(["--smoke", "--mlps", "kaggle_bottom,mlperf_top", "--impls", "eager,fused,tail",
                    "--tail-launches", "16x4/16x4x2rh", "--out", str(tmp_path / "tail"), *one]) == 0
    tail = read_csv(tmp_path / "tail" / "mlp.csv")
    assert [(r["mlp"], r["impl"]) for r in tail] == [(m, i) for m in ("kaggle_bottom", "mlperf_top")
                                                     for i in ("eager", "fused", "tail", "tail[16x4/16x4x2rh]")]
    # --smoke runs tf32 rows: on CUDA the tail refuses fp32 inputs, and its rows say so
    skipped = "skipped: the on-chip tail runs 16-bit on CUDA"
    assert all((r["status"] == "ok" and float(r["ms"]) > 0) or (torch.cuda.is_available() and r["impl"].startswith("tail")
               and r["status"] == skipped) for r in tail), tail
    assert "the on-chip layers: kaggle_bottom 1-16-8-2-1, mlperf_top 32-32-16-8-1" in (tmp_path / "tail" / "mlp.md").read_text()
    with pytest.raises(SystemExit):
        mb.main(["--smoke", "--impls", "tail", "--tail-launches", "16x4", "--out", str(tmp_path / "bad")])


def test_pooled_embedding_smoke_times_every_mode_and_dtype(tmp_path):
    """benchmarks/pooled_embedding.py --smoke: the pooled Triton lookup, fused row-wise Adagrad update and
    both together, bf16 and fp32, and the embedding_bag references, at tiny tables (batch 2, `small_mlperf_config`'s
    42 lookups a sample); the bytes
    that must move counted from the shapes and the batch's distinct rows (CUDA: graph-replay timing)."""
    pe = load_script("pooled_embedding")
    config = small_mlperf_config(tmp_path)
    m = pe.load_config(config).model
    lookups, features = sum(m.multi_hot_sizes), len(m.multi_hot_sizes)
    assert pe.main(["--smoke", "--out", str(tmp_path), "--config", config]) == 0
    rows = read_csv(tmp_path / "pooled_embedding.csv")
    per_dtype = [("triton", "fwd"), ("torch-bag", "fwd"), ("torch-bag-rows", "fwd"), ("triton", "bwd"),
                 ("triton", "fwd+bwd")]
    assert [(r["impl"], r["mode"], r["dtype"]) for r in rows] == [(i, m, d) for d in ("bf16", "fp32")
                                                                  for i, m in per_dtype]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and r["batch"] == "2" for r in rows), rows
    for r in rows:
        e, unique = 2 if r["dtype"] == "bf16" else 4, int(r["unique_rows"])
        assert 0 < unique < int(r["lookups"]) == 2 * lookups  # rows repeated in the tables of 3 and 4 rows
        fwd = 2 * (lookups + features) * 128 * e
        bwd = 2 * features * 128 * e + unique * (2 * 128 * e + 2 * 4)
        assert int(r["bytes"]) == {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[r["mode"]]
        assert r["meets_target"] in (("True", "False") if r["impl"] == "triton" and r["mode"] != "fwd+bwd" else ("",))
    md = (tmp_path / "pooled_embedding.md").read_text()
    assert md.count("| triton | bwd |") == 2 and "copy bandwidth" in md
    assert (tmp_path / "pooled_embedding.png").stat().st_size > 0


def test_pooled_embedding_lookup_launches_add_forward_rows_and_restore_the_picked_launch(tmp_path):
    """--lookup-launches: one more triton fwd row per forced launch (SAMPLESxWARPS[xUNROLL[xMAXNREG]]), the override
    reset after."""
    pe = load_script("pooled_embedding")
    import kernels.embedding.pooled as pooled

    assert pe.main(["--smoke", "--out", str(tmp_path), "--dtypes", "bf16", "--modes", "fwd", "--impls", "triton",
                    "--lookup-launches", "16x2,8x4x4,8x4x2x128", "--config", small_mlperf_config(tmp_path)]) == 0
    rows = read_csv(tmp_path / "pooled_embedding.csv")
    assert [r["impl"] for r in rows] == ["triton", "triton 16x2x1", "triton 8x4x4", "triton 8x4x2x128"]
    assert all(r["status"] == "ok" and int(r["bytes"]) == int(rows[0]["bytes"]) for r in rows)
    assert pooled.POOLED_LOOKUP_OVERRIDE is None
    with pytest.raises(SystemExit):
        pe.main(["--smoke", "--out", str(tmp_path), "--lookup-launches", "12x4"])  # rows not a power of two
    with pytest.raises(SystemExit):
        pe.main(["--smoke", "--out", str(tmp_path), "--lookup-launches", "16x4x2x8"])  # a register cap below 24


def test_onehot_embedding_sweep_smoke_times_each_launch_and_update(tmp_path):
    """benchmarks/onehot_embedding_sweep.py --smoke: each lookup launch, the deterministic update and (fp32) the
    atomic one with the lookup ahead of it and the update that hashes the raw values, for D=16 and 128, with
    kernels.py's byte counts; the forced launch is reset afterwards."""
    sw = load_script("onehot_embedding_sweep")
    import kernels.embedding.lookup as lookup

    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "s", "--launches", "picked,16x2"]) == 0
    rows = read_csv(tmp_path / "s.csv")
    want = [(d, t, op, la) for d in ("16", "128") for t in ("bfloat16", "float32")
            for op, la in [("fwd", "picked"), ("fwd", "16x2"), ("bwd", "picked")]
            + ([("fwd_atomic", "picked"), ("bwd_atomic", "picked"), ("bwd_atomic_hashed", "picked")]
               if t == "float32" else [])]
    assert [(r["dim"], r["dtype"], r["op"], r["launch"]) for r in rows] == want
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and r["batch"] == "8" for r in rows), rows
    assert lookup.LOOKUP_LAUNCH_OVERRIDE is None and (tmp_path / "s.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--launches", "100x3"])


def test_pooled_update_sweep_smoke_times_every_plan_row(tmp_path):
    """benchmarks/pooled_update_sweep.py --smoke: every (dtype, rounding, launch) of its plan runs and is
    written (tiny tables, batch 2, `small_mlperf_config`'s 42 lookups a sample; the interpreter on the CPU), forced
    launches restored afterwards."""
    import torch

    sw = load_script("pooled_update_sweep")
    from kernels import heuristics
    from kernels.embedding import update

    shipped = update.SR_RNG
    small = ["--config", small_mlperf_config(tmp_path)]
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "s", *small]) == 0
    rows = read_csv(tmp_path / "s.csv")
    assert [(r["dtype"], r["rounding"]) for r in rows] == [(d, r) for d, r, _ in sw.PLAN]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    assert heuristics.SPARSE_UPDATE_OVERRIDE is None and update.SR_RNG == shipped == "hash1hi"
    assert "(picked)" in rows[0]["launch"] and (tmp_path / "s.png").stat().st_size > 0
    assert {r["row_loads"] for r in rows} == {update.ROW_LOADS}
    # --row-loads times each kept row in each order, --repeats runs the plan again, interleaved
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "o", "--dtypes", "bf16", "--roundings", "nearest",
                    "--row-loads", "after_sums,with_gradients", "--repeats", "2", *small]) == 0
    rows = read_csv(tmp_path / "o.csv")
    launches = [c for d, r, c in sw.PLAN if d == "bf16" and r == "nearest"]
    assert [r["row_loads"] for r in rows] == ["after_sums", "with_gradients"] * 2 * len(launches)
    assert all(r["status"] == "ok" for r in rows) and update.ROW_LOADS == "prefetch_l2"
    # --evictions times each kept row with each L2 eviction setting, the shipped one restored afterwards
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "e", "--dtypes", "bf16", "--launches", "picked",
                    "--evictions", "none,rows_first_grad_last", *small]) == 0
    rows = read_csv(tmp_path / "e.csv")
    assert [r["eviction"] for r in rows] == ["none", "rows_first_grad_last"]
    assert all(r["status"] == "ok" for r in rows) and update.EVICTION == "grad_last"
    # --carry-chunks times each kept row with each carry-kernel block of chunks, the shipped one restored afterwards
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "c", "--dtypes", "bf16", "--launches", "picked",
                    "--carry-chunks", "1,8", *small]) == 0
    rows = read_csv(tmp_path / "c.csv")
    assert [r["carry_chunks"] for r in rows] == ["1", "8"] and all(r["status"] == "ok" for r in rows)
    assert update.CARRY_CHUNKS is None and "| 8 |" in (tmp_path / "c.md").read_text()
    # by default each launch's own carry_chunks, written as the number it is
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "d", "--dtypes", "bf16", "--launches",
                    "picked,16:32:1:1:4", *small]) == 0
    picked = heuristics.sparse_update_config(128, torch.bfloat16, multi_hot=True).carry_chunks
    assert [r["carry_chunks"] for r in read_csv(tmp_path / "d.csv")] == [str(picked), "4"]
    # --picks times each kept row with each way of writing the chunk partials, the shipped one restored afterwards
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "p", "--dtypes", "bf16", "--launches", "picked",
                    "--picks", "sum,store", *small]) == 0
    rows = read_csv(tmp_path / "p.csv")
    assert [r["pick"] for r in rows] == ["sum", "store"] and all(r["status"] == "ok" for r in rows)
    assert update.PARTIAL_PICK == "store" and "| sum |" in (tmp_path / "p.md").read_text()
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--picks", "both"])
    # --maxnregs times each kept row with each register cap of the chunk kernel (the interpreter ignores it), the
    # override reset after
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "r", "--dtypes", "bf16", "--launches", "picked",
                    "--maxnregs", "launch,none,120", *small]) == 0
    rows = read_csv(tmp_path / "r.csv")
    own = heuristics.sparse_update_config(128, torch.bfloat16, multi_hot=True).chunk_maxnreg
    assert [r["maxnreg"] for r in rows] == [str(own or "none"), "none", "120"]
    assert all(r["status"] == "ok" for r in rows)
    assert update.CHUNK_MAXNREG is None and "| 120 |" in (tmp_path / "r.md").read_text()
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--maxnregs", "8"])
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--row-loads", "sideways"])
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--evictions", "evict_sometimes"])
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--carry-chunks", "12"])
    # a launch's sixth and seventh numbers: group sums (0/1) and the chunk kernel's register cap (0: none)
    assert sw.parse_launches("16:32:4:1:8:1:0,16:32:1:1:8:0:96,16:32:1:1") == [
        heuristics.SparseUpdateConfig(16, 32, 4, 1, 8, True, None),
        heuristics.SparseUpdateConfig(16, 32, 1, 1, 8, False, 96), heuristics.SparseUpdateConfig(16, 32, 1, 1)]
    for bad in ("16:32:4:1:8:2", "16:32:4:1:0", "16:32:4", "16:32:4:1:8:1:0:5", "16:x:4:1"):
        with pytest.raises(ValueError, match="is not chunk:carry_block"):
            sw.parse_launches(bad)


def test_stream_overlap_smoke_times_each_pair_alone_in_series_and_side_by_side(tmp_path):
    """benchmarks/stream_overlap.py --smoke: each pair's parts alone, one after the other and on two streams
    (on the CPU: one after the other, a check of the script), written as CSV, Markdown and a plot; unknown
    pairs refused."""
    so = load_script("stream_overlap")
    pairs = "update||wgrads,sort||fwd_gemms,sort||update_presorted"
    small = ["--config", small_mlperf_config(tmp_path)]
    assert so.main(["--smoke", "--out", str(tmp_path), "--pairs", pairs, *small]) == 0
    rows = read_csv(tmp_path / "stream_overlap.csv")
    assert [(r["a"], r["b"]) for r in rows] == [("update", "wgrads"), ("sort", "fwd_gemms"), ("sort", "update_presorted")]
    for r in rows:
        par = ("par_ms", "par_a_hi_ms", "par_b_hi_ms")
        assert all(float(r[k]) > 0 for k in ("a_ms", "b_ms", "seq_ms", *par)), r
        assert math.isclose(float(r["gain_ms"]), float(r["seq_ms"]) - min(float(r[k]) for k in par),
                            rel_tol=1e-6, abs_tol=1e-9)
        assert int(r["batch"]) == 2 and r["device"]
    assert "update \\|\\| wgrads" in (tmp_path / "stream_overlap.md").read_text()
    assert (tmp_path / "stream_overlap.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        so.main(["--smoke", "--out", str(tmp_path), "--pairs", "update||lookup", "--overwrite"])
    # the collectives' pairs: without torchrun a local copy of the same bytes, and the Markdown says so
    assert so.main(["--smoke", "--out", str(tmp_path), "--pairs", "a2a||sort,allreduce||update", "--overwrite",
                    *small]) == 0
    rows = read_csv(tmp_path / "stream_overlap.csv")
    assert [(r["a"], r["b"], r["world"]) for r in rows] == [("a2a", "sort", "1"), ("allreduce", "update", "1")]
    assert all(float(r["a_ms"]) > 0 for r in rows)
    assert "local copies" in (tmp_path / "stream_overlap.md").read_text()


def test_stream_overlap_repeats_each_pair_at_each_sm_carveout(tmp_path):
    """--sm-carveouts: every pair once per carve-out, each row's gain against the uncarved "A then B" of the same
    pair (on the CPU the carve-out changes nothing: a check of the bookkeeping); bad lists refused."""
    so = load_script("stream_overlap")
    assert so.main(["--smoke", "--out", str(tmp_path), "--pairs", "sort||fwd_gemms", "--sm-carveouts", "0,8",
                    "--config", small_mlperf_config(tmp_path)]) == 0
    rows = read_csv(tmp_path / "stream_overlap.csv")
    assert [(r["pair"], r["sm_carveout"]) for r in rows] == [("sort||fwd_gemms", "0"), ("sort||fwd_gemms", "8")]
    uncarved_seq = float(rows[0]["seq_ms"])
    for r in rows:
        best = min(float(r[k]) for k in ("par_ms", "par_a_hi_ms", "par_b_hi_ms"))
        assert math.isclose(float(r["gain_vs_uncarved_ms"]), uncarved_seq - best, rel_tol=1e-6, abs_tol=1e-9)
    assert "| sort \\|\\| fwd_gemms | 8 |" in (tmp_path / "stream_overlap.md").read_text()
    assert not hasattr(torch._C, "_get_sm_carveout_experimental") or torch._C._get_sm_carveout_experimental() is None
    for bad in ("-1", "a", ","):
        with pytest.raises(SystemExit):
            so.main(["--smoke", "--out", str(tmp_path), "--pairs", "sort||fwd_gemms", "--sm-carveouts", bad])


def test_stream_overlap_collectives_match_the_exchange_and_ddp_sizes():
    """`Collectives` sends what a two-rank MLPerf step's all_to_all sends (a rank's samples of half the features,
    for every rank) and `dense_params` counts what DDP all-reduces: the bottom MLP's, cross network's and top MLP's
    parameters, as the modules hold them."""
    import torch

    from dlrm.model.archs import LowRankCrossNet

    so = load_script("stream_overlap")
    cfg = {"cross_rank": 4, "cross_layers": 2, "bottom_mlp": [8, 4], "top_mlp": [6, 1]}
    width = 3 * 4
    bottom = torch.nn.Sequential(torch.nn.Linear(13, 8), torch.nn.Linear(8, 4))
    top = torch.nn.Sequential(torch.nn.Linear(width, 6), torch.nn.Linear(6, 1))
    cross = LowRankCrossNet(width, num_layers=2, low_rank=4)
    assert so.dense_params(cfg, width) == sum(p.numel() for m in (bottom, cross, top) for p in m.parameters())
    comm = so.Collectives(batch=5, features=3, dim=4, params=7, device=torch.device("cpu"))
    assert tuple(comm.send.shape) == (1 * 5 * 3, 4) and comm.send.dtype == torch.bfloat16
    comm.a2a()
    comm.allreduce()
    assert torch.equal(comm.recv, comm.send) and torch.equal(comm.grads_copy, comm.grads)


def test_cross_layer_smoke_times_the_network_and_each_forward_tile(tmp_path):
    """benchmarks/cross_layer.py --smoke: the 3-layer network (eager and Triton) and one layer's forward (cuBLAS +
    elementwise, the Triton kernel per tile, with and without the saved pre-activation) all run and are written;
    the forced tile is restored and a malformed tile refused."""
    cl = load_script("cross_layer")
    from kernels import heuristics

    assert cl.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "cross_layer.csv")
    torch_impl = "inductor" if torch.cuda.is_available() else "eager"  # compiled on a GPU
    assert [(r["case"], r["impl"]) for r in rows[:4]] == [("net fwd+bwd", torch_impl), ("net fwd", torch_impl),
                                                          ("net fwd+bwd", "triton"), ("net fwd", "triton")]
    fused = [(r["tile"], r["store_pre"]) for r in rows if r["impl"] == "triton fused"]
    assert fused == [("picked", "True"), ("picked", "False"), ("64x128x64s4w4", "True"), ("64x128x64s4w4", "False")]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    assert heuristics.CROSS_TILE_OVERRIDE is None
    assert cl.parse_tile("64x128x64s4w4") == heuristics.GemmTile(64, 128, 64, 4, 4) and cl.parse_tile("picked") is None
    assert (tmp_path / "cross_layer.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        cl.main(["--smoke", "--out", str(tmp_path), "--tiles", "64x128"])


def test_wgrad_benchmark_smoke_times_torch_and_the_kernel(tmp_path):
    """benchmarks/wgrad.py --smoke: each smoke shape timed with PyTorch and the fused weight-gradient kernel, the
    results checked against float64 (no WRONG rows), and the CSV / Markdown / PNG written."""
    wb = load_script("wgrad")
    assert wb.main(["--smoke", "--out", str(tmp_path), "--name", "w"]) == 0
    rows = read_csv(tmp_path / "w.csv")
    impls = ["torch", "triton"] if not torch.cuda.is_available() else ["torch", "inductor", "triton"]
    assert [(r["layer"], r["impl"]) for r in rows] == [(s[1], i) for s in wb.SMOKE_SHAPES for i in impls]
    assert all(r["status"] == "" and float(r["ms"]) > 0 for r in rows), rows
    assert {"device", "torch", "triton", "date"} <= set(rows[0])
    assert "Sum over a model's layers" in (tmp_path / "w.md").read_text() and (tmp_path / "w.png").stat().st_size > 0


def test_cross_tma_probe_smoke_checks_and_times_every_variant(tmp_path):
    """benchmarks/cross_tma_probe.py --smoke: cuBLAS + elementwise, kernels.cross and the persistent TMA kernel
    (TMA and pointer epilogues, with and without the saved pre-activation) all run, match a float64 reference
    element by element, and are written; variant names parse to their launch keywords."""
    ctp = load_script("cross_tma_probe")
    assert ctp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "cross_tma_probe.csv")
    persistent = [(r["tile"], r["epi"], r["store_pre"]) for r in rows if r["impl"] == "persistent TMA"]
    assert persistent == [("32x32x16s2w4", "tma", "True"), ("32x32x16s2w4", "tma", "False"),
                          ("32x32x16s2w4-ptr", "ptr", "True"), ("32x32x16s2w4-ptr", "ptr", "False")]
    assert len(rows) == 7 and all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    tol = 1e-4 if not torch.cuda.is_available() else 0.1  # fp32 in the interpreter; bf16 outputs on a GPU
    assert all(float(r["max_abs_err"]) < tol for r in rows), rows
    assert ctp.parse_variant("128x256x64s3w8-flat-ws-ptr") == dict(
        bm=128, bn=256, bk=64, stages=3, warps=8, flatten=True, ws=True, epi_tma=False)
    assert "persistent TMA" in (tmp_path / "cross_tma_probe.md").read_text()


def test_wgrad_tma_probe_smoke_runs_both_kernels_and_restores_the_switches(tmp_path):
    """benchmarks/wgrad_tma_probe.py --smoke: each smoke layer through the pointer kernel and the TMA kernel, checked
    against float64 and written; kernels.wgrad's switches are restored after each call."""
    import kernels.wgrad as wg

    wtp = load_script("wgrad_tma_probe")
    assert wtp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "wgrad_tma_probe.csv")
    assert [(r["layer"], r["impl"]) for r in rows] == [("a", "pointer loads"), ("a", "TMA"), ("b", "pointer loads"),
                                                       ("b", "TMA")]
    assert all(r["status"] == "ok" and float(r["max_abs_err"]) < 1e-4 and float(r["ms"]) > 0 for r in rows), rows
    assert (wg.TMA_OPERANDS, wg.TMA_STAGES) == (None, 3)


def test_gemm_layout_probe_smoke_times_eight_layouts_of_every_step_gemm(tmp_path):
    """benchmarks/gemm_layout_probe.py --smoke: each GEMM of the DCNv2 step (cross V and W, the top MLP's layers but
    the 1-wide one; forward, data and weight gradient) in the eight (A, B, C) layouts, each checked against float64,
    exactly one 'as run' row per GEMM, the summary and chart written."""
    glp = load_script("gemm_layout_probe")
    assert glp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "gemm_layout_probe.csv")
    gemms = {(r["gemm"], r["pass"]) for r in rows}
    assert gemms == {(g, p) for g in ("cross V", "cross W", "top.0", "top.1") for p in ("fwd", "dgrad", "wgrad")}
    for key in gemms:
        mine = [r for r in rows if (r["gemm"], r["pass"]) == key]
        assert len({(r["a"], r["b"], r["c"]) for r in mine}) == 8 and sum(r["as_run"] == "True" for r in mine) == 1
    # Against float64 of the same inputs, relative to the output's largest value: fp32 on the CPU. On CUDA, bf16:
    # the output rounded to bf16 (2**-9) and, for outputs this small, cuBLAS's split-K partial sums, which PyTorch
    # lets it reduce in bf16 (allow_bf16_reduced_precision_reduction): up to ~2 x 2**-9 a split, 2**-5 for 8 splits;
    # FP8 rows: e4m3 operands (3 mantissa bits, 2**-4 each at worst). A wrong layout (a transposed operand) is off
    # by the output's own size. The quantization row has no error of its own.
    tolerance = {"fp32": 1e-5, "bf16": 2**-5, "fp8 tensorwise": 2**-3, "fp8 rowwise": 2**-3}
    for r in rows:
        assert r["status"] == "ok" and float(r["ms"]) > 0, r
        assert r["impl"] not in tolerance or float(r["max_rel_err"]) < tolerance[r["impl"]], r
    assert "bf16" in {r["impl"] for r in rows} if torch.cuda.is_available() else {r["impl"] for r in rows} == {"fp32"}
    fwd = next(r for r in rows if r["gemm"] == "cross V" and r["pass"] == "fwd")
    assert (fwd["M"], fwd["N"], fwd["K"]) == ("64", "16", "48")
    assert "best layout" in (tmp_path / "gemm_layout_probe.md").read_text()
    assert (tmp_path / "gemm_layout_probe.png").stat().st_size > 0


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("source", ["row", "col"])
@pytest.mark.parametrize("major", ["row", "col"])
def test_gemm_layout_probe_tensorwise_fp8_operands_are_in_the_layout_scaled_mm_takes(major, source):
    """The probe's tensorwise FP8 operands (A row-major, B column-major for ``torch._scaled_mm``) have the layout
    asked for and the input's values within e4m3's rounding (half an ulp: 2**-4 relative for normals, 2**-10 absolute
    below the smallest normal 2**-6, in units of the scale); the
    probe once built B row-major from a row-major input, and every tensorwise row failed on the GPU. Odd shapes; the
    input row-major or column-major (non-contiguous)."""
    glp = load_script("gemm_layout_probe")
    x = torch.randn(5, 7, dtype=torch.float64) if source == "row" else torch.randn(7, 5, dtype=torch.float64).t()
    q, scale = glp.tensorwise_fp8(x, major)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.dtype == torch.float32
    assert q.stride() == ((7, 1) if major == "row" else (1, 5))
    assert float(q.float().abs().max()) == torch.finfo(torch.float8_e4m3fn).max  # the largest value maps to e4m3's max
    back = q.double() * scale.double()
    torch.testing.assert_close(back, x, rtol=2**-4, atol=2**-10 * float(scale))


def test_fp8_dense_probe_smoke_runs_each_variant_and_measures_its_error(tmp_path):
    """benchmarks/fp8_dense_probe.py --smoke: bf16 and the three FP8 variants run forward + backward, their errors
    against float64 are finite, bf16's the smallest; unknown variants are refused."""
    fdp = load_script("fp8_dense_probe")
    assert fdp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "fp8_dense_probe.csv")
    assert [r["variant"] for r in rows] == list(fdp.VARIANTS)
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    err = {r["variant"]: float(r["err_dx0"]) for r in rows}
    assert 0 < err["bf16"] < min(err["fp8 cross"], err["fp8 top"], err["fp8 cross + top"]) < 1
    assert "rowwise FP8" in (tmp_path / "fp8_dense_probe.md").read_text()
    with pytest.raises(SystemExit):
        fdp.main(["--smoke", "--out", str(tmp_path), "--variants", "fp4"])


def test_fp8_dense_probe_kernel_report_sums_each_kind_per_variant():
    """--profile's table: a kernel counted once, under the first kind its name matches (an FP8 GEMM is not counted
    as a bf16 one), each variant's column summing to its kernels' total."""
    fdp = load_script("fp8_dense_probe")
    assert fdp.kernel_kind("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n") == "FP8 GEMMs"
    assert fdp.kernel_kind("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "FP8 GEMMs"
    assert fdp.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "bf16 GEMMs"
    assert fdp.kernel_kind("triton_per_fused_abs_amax_0") == "Inductor fused kernels"
    assert fdp.kernel_kind("Memset (Device)") == "other"
    lines = fdp.kernel_report({"bf16": [("nvjet_a", 1.25, 2), ("triton_poi_1", 0.5, 1)],
                               "fp8": [("gemm_e4m3_b", 0.75, 2), ("triton_red_2", 0.25, 3), ("memcpy", 0.125, 1)]})
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in lines[2:7]}
    assert rows["FP8 GEMMs"] == ["0.000", "0.750"] and rows["bf16 GEMMs"] == ["1.250", "0.000"]
    assert rows["Inductor fused kernels"] == ["0.500", "0.250"] and rows["other"] == ["0.000", "0.125"]
    assert rows["all kernels"] == ["1.750", "1.125"]
    assert "| triton_red_2 | Inductor fused kernels | 3 | 0.250 |" in lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cross_ws_probe_refuses_to_run_without_cuda(tmp_path, capsys):
    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_probe")
    assert probe.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cublaslt_drelu_probe_refuses_to_run_without_cuda(tmp_path, capsys):
    probe = load_script("cublaslt_drelu_probe")
    assert probe.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cublaslt_drelu_probe_unpacks_a_column_major_bitmask():
    """Bit i of column j in byte [i // 8, j] (LSB first), rows padded to 16 bytes: the layout the probe reads."""
    probe = load_script("cublaslt_drelu_probe")
    gen = torch.Generator().manual_seed(0)
    n, batch = 19, 5  # 19 rows -> 3 bytes, padded to 16
    mask = torch.rand(batch, n, generator=gen) > 0.5
    aux = torch.zeros(16, batch, dtype=torch.uint8)
    for j in range(batch):
        for i in range(n):
            aux[i // 8, j] |= int(mask[j, i]) << (i % 8)
    assert torch.equal(probe.unpack_bits(aux, n, batch), mask)


def test_cross_ws_probe_parses_both_schedules():
    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_probe")
    coop = probe.parse_config("coop:128x128x64s4u32q2m8r160e4")
    assert (coop.schedule, coop.bm, coop.stages, coop.sub, coop.epi_stages, coop.mma_regs) == ("coop", 128, 4, 32, 2, 160)
    ping = probe.parse_config("64x128x64s3r200")
    assert (ping.schedule, ping.bm, ping.stages, ping.consumer_regs) == ("pingpong", 64, 3, 200)
    for text in probe.DEFAULT_CONFIGS.split(","):
        probe.parse_config(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cross_bwd_passes_refuses_to_run_without_cuda(tmp_path, capsys):
    bench = load_script("cross_bwd_passes")
    with pytest.raises(SystemExit) as info:
        bench.main(["--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_cross_bwd_passes_parses_every_default_launch():
    bench = load_script("cross_bwd_passes")
    assert bench.parse_launch("64x128r512w8") == (64, 128, 512, 8)
    assert all(len(bench.parse_launch(t)) == 4 for t in bench.LAUNCHES.split(","))


def test_cross_ws_head_probe_parses_launches_and_refuses_without_hopper(tmp_path):
    """benchmarks/cross_ws_head_probe.py: the launch syntax, and a clear error (exit 2) where no Hopper GPU is."""
    pytest.importorskip("kernels.cross_ws_head", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_head_probe")
    cfg = probe.parse_config("128x128x64s3e4")
    assert (cfg.bm, cfg.bn, cfg.bk, cfg.stages, cfg.epi_stages, cfg.schedule) == (128, 128, 64, 3, 4, "coop")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("a Hopper GPU is here: the probe would run")
    with pytest.raises(SystemExit) as e:
        probe.main(["--out", str(tmp_path)])
    assert e.value.code == 2


def test_mask_bias_launches_smoke_times_each_launch_and_checks_it_against_the_shipped_one(tmp_path):
    """benchmarks/mask_bias_launches.py --smoke: every launch timed over the seven ReLU layers, its masked gradients
    equal to the shipped launch's, CSV and Markdown written, the module's launch constants put back; a malformed
    launch refused."""
    from kernels import mlp

    mb = load_script("mask_bias_launches")
    assert mb.main(["--smoke", "--out", str(tmp_path), "--launches", "32x4p4,16x2p8"]) == 0
    assert mlp.MASK_LAUNCH_OVERRIDE is None
    rows = read_csv(tmp_path / "mask_bias_launches.csv")
    assert [r["launch"].split()[0] for r in rows] == ["32x4p4", "16x2p8"]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and float(r["max_bias_diff"]) < 1e-4 for r in rows), rows
    assert "| 16x2p8 |" in (tmp_path / "mask_bias_launches.md").read_text()
    with pytest.raises(SystemExit):
        mb.main(["--smoke", "--out", str(tmp_path), "--launches", "32x4"])


def test_gluon_mutants_still_apply_to_the_kernels():
    """Each mutant of benchmarks/gluon_mutants.py names text that is in its kernel at that occurrence, and changes
    it: a kernel edit that moves the text fails here, not on the GPU after a device call."""
    gm = load_script("gluon_mutants")
    assert len({m[0].split()[0] for m in gm.MUTANTS}) == len(gm.MUTANTS)
    for name, path, old, new, occurrence, tests in gm.MUTANTS:
        source = (REPO / path).read_text()
        mutated = gm.mutate(source, old, new, occurrence)
        assert mutated != source and len(mutated) == len(source) - len(old) + len(new), name
        assert (REPO / tests[0]).exists(), name
    with pytest.raises(ValueError, match="occurrence 3 of 'pred=k > 0' not found"):
        gm.mutate((REPO / gm.FWD).read_text(), "pred=k > 0", "", 3)
    assert [gm.verdict(rc) for rc in (0, 1, 2, "timeout")] == ["survived", "killed", "killed", "killed (hang)"]
