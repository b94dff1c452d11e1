"""cuBLASLt's ReLU epilogues against the fused MLP's mask kernel, at MLPerf DLRM-DCNv2's MLP layers (a probe).

    python benchmarks/cublaslt_drelu_probe.py --out benchmarks/results --name cublaslt_drelu_probe   # a CUDA GPU

Needs ``nvmath-python`` (NVIDIA's Python bindings of cuBLASLt, ``pip install nvmath-python``): PyTorch exposes only
the forward epilogue (``torch._addmm_activation``, cuBLASLt's ``RELU_BIAS``), not the backward ones.

The fused MLP's backward (`kernels.mlp`) runs, per ReLU layer, one Triton kernel over the incoming gradient
(``gm = g * (out > 0)`` and the bias gradient's column sums) and then cuBLAS's data-gradient GEMM ``gm @ W``. In the
MLPerf step those mask kernels take ~0.68 ms (`results/step_ops_mlperf_thirtysixth.md`). cuBLASLt can do the same
work in GEMM epilogues: the forward GEMM with ``RELU_AUX_BIAS`` writes the ReLU's bitmask beside its output (1 bit
an element), and the layer above's data-gradient GEMM with ``DRELU_BGRAD`` applies that mask to its own output and
sums the bias gradient, so the masked gradient is written once and never re-read. This times, per layer and summed:

- forward: ``torch._addmm_activation`` (shipped) against ``RELU_AUX_BIAS`` (output + bitmask);
- backward of each layer whose input came out of a ReLU layer: ``torch.mm`` + `kernels.mlp.mask_bias_grad`
  (shipped) against one ``DRELU_BGRAD`` GEMM (cuBLASLt rejects K = 1: the top MLP's logit layer keeps the kernel).

Layout: cuBLASLt's ReLU epilogues want a column-major result whose bias runs along its rows, so each layer is
computed transposed, ``out^T [N, B] = W [N, K] @ x^T [K, B]``: a column-major [N, B] result is the row-major [B, N]
activation PyTorch uses, with no copy. Checks: forward outputs against the shipped ones (bf16), the bitmask against
``out > 0``, the masked gradient against ``(g @ W) * (out > 0)`` from the same forward, the bias gradient against
the shipped kernel's. CUDA graphs (`_common.graph_replay_ms`) where nvmath's calls capture; event-timed loops where
they do not (the table says which).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import env_line, environment, graph_replay_ms, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from kernels import mlp  # noqa: E402

KEYS = ["part", "layer", "shape", "shipped_ms", "epilogue_ms", "saved_ms", "timing", "max_diff", "status"]
TOP = (3456, [1024, 1024, 512, 256])  # MLPerf DLRM-DCNv2's top MLP's ReLU layers (its logit layer has no ReLU)
BOTTOM = (16, [512, 256, 128])  # the bottom MLP (13 dense features, K padded to 16 as the step does)


def unpack_bits(aux: torch.Tensor, n: int, batch: int) -> torch.Tensor:
    """cuBLASLt's ReLU bitmask (uint8 [ceil(n/8) padded, batch], column-major, bit i of a column's byte i // 8)
    -> bool [batch, n]."""
    shifts = torch.arange(8, device=aux.device, dtype=torch.uint8)
    bits = (aux.t().unsqueeze(-1) >> shifts) & 1  # [batch, bytes, 8]
    return bits.reshape(batch, -1)[:, :n].bool()


class Epilogues:
    """Planned nvmath Matmul objects, one per (layer, epilogue), their operands fixed (the benchmark's tensors)."""

    def __init__(self):
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        self.Matmul, self.Epilog = Matmul, MatmulEpilog

    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
        """relu(x @ w^T + b) [B, N] row-major and its bitmask: a planned call."""
        mm = self.Matmul(w, x.t(), stream=torch.cuda.current_stream())
        mm.plan(epilog=self.Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": b}, stream=torch.cuda.current_stream())
        return mm

    def backward(self, g: torch.Tensor, w: torch.Tensor, aux: torch.Tensor):
        """(g @ w) * mask [B, K] and its column sums, mask = the layer below's bitmask ``aux``: a planned call."""
        mm = self.Matmul(w.t(), g.t(), stream=torch.cuda.current_stream())
        mm.plan(epilog=self.Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": aux}, stream=torch.cuda.current_stream())
        return mm


def call(mm):
    out, aux = mm.execute(stream=torch.cuda.current_stream())
    return out, aux


def timed(step, args) -> tuple[float, str]:
    """ms a call: a CUDA graph's replays if the calls capture, else an event-timed loop."""
    try:
        return graph_replay_ms(step, args.calls, args.windows, args.warmup), "graph"
    except Exception as e:  # noqa: BLE001 -- nvmath's calls may not capture; time them another way
        print(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); loop-timed",
              flush=True)
        torch.cuda.synchronize()
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.windows):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.calls):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / args.calls)
        # the median window, as the graph path's (times[len // 2] was the upper middle one for an even --windows)
        return statistics.median(times), "loop"


def mlp_rows(name: str, k0: int, widths: list[int], batch: int, ep: Epilogues, args, gen) -> list[dict]:
    dt, dev = torch.bfloat16, torch.device("cuda")
    ks = [k0, *widths[:-1]]
    ws = [(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(dt) for k, n in zip(ks, widths)]
    bs = [(torch.randn(n, generator=gen, device=dev) * 0.1).to(dt) for n in widths]
    x = torch.randn(batch, k0, generator=gen, device=dev).to(dt)
    rows = []
    # Forward, layer by layer, the epilogue's outputs feeding the next layer (and the backward's masks).
    h, outs, auxes = x, [], []
    for i, (w, b) in enumerate(zip(ws, bs)):
        shipped = torch._addmm_activation(b, h, w.t())
        fwd = ep.forward(h, w, b)
        out_t, aux = call(fwd)
        out_t, aux = out_t, aux["relu_aux"]
        out = out_t.t()
        diff = float((out.float() - shipped.float()).abs().max())
        bits_ok = torch.equal(unpack_bits(aux, w.shape[0], batch), out > 0)
        contiguous = out.is_contiguous()
        status = "ok" if bits_ok and contiguous and diff <= 0.05 * float(shipped.float().abs().max()) else (
            f"failed: bits {'ok' if bits_ok else 'differ'}, contiguous {contiguous}, diff {diff:.3g}")
        hh = h
        t_ship, how_a = timed(lambda: torch._addmm_activation(b, hh, w.t()), args)
        t_epi, how_b = timed(lambda: call(fwd), args)
        rows.append(dict(part=f"{name} forward", layer=i + 1, shape=f"[{batch},{w.shape[1]}]x[{w.shape[1]},{w.shape[0]}]",
                         shipped_ms=t_ship, epilogue_ms=t_epi, saved_ms=t_ship - t_epi, timing=f"{how_a}/{how_b}",
                         max_diff=diff, status=status))
        print(rows[-1], flush=True)
        outs.append(out)
        auxes.append(aux)
        h = out
    # Backward: layer i's data gradient masked by layer i-1's ReLU (i >= 1), from a random incoming gradient.
    for i in range(1, len(ws)):
        w = ws[i]
        g = torch.randn(batch, w.shape[0], generator=gen, device=dev).to(dt)
        below = outs[i - 1]

        def shipped_step(g=g, w=w, below=below):
            return mlp.mask_bias_grad(torch.mm(g, w), below, True)

        bwd = ep.backward(g, w, auxes[i - 1])
        gm_t, extra = call(bwd)
        gm, gb = gm_t.t(), extra["drelu_bgrad"]
        ref_gm, ref_gb = shipped_step()
        exact = (torch.mm(g.float(), w.float()) * (below > 0)).to(dt)
        gm_diff = float((gm.float() - exact.float()).abs().max())
        gb_diff = float((gb.float().flatten() - ref_gb.float()).abs().max())
        scale = float(ref_gb.float().abs().max())
        status = "ok" if gm.is_contiguous() and gm_diff <= 0.02 * float(exact.float().abs().max()) and \
            gb_diff <= 0.02 * scale else f"failed: gm diff {gm_diff:.3g}, gb diff {gb_diff:.3g} (scale {scale:.3g})"
        t_ship, how_a = timed(shipped_step, args)
        t_epi, how_b = timed(lambda bwd=bwd: call(bwd), args)
        rows.append(dict(part=f"{name} backward", layer=i + 1,
                         shape=f"[{batch},{w.shape[0]}]x[{w.shape[0]},{w.shape[1]}]", shipped_ms=t_ship,
                         epilogue_ms=t_epi, saved_ms=t_ship - t_epi, timing=f"{how_a}/{how_b}",
                         max_diff=max(gm_diff, gb_diff), status=status))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="cublaslt_drelu_probe")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])
    if not torch.cuda.is_available():
        print("cublaslt_drelu_probe.py needs a CUDA GPU (cuBLASLt)", file=sys.stderr)
        return 2
    try:
        ep = Epilogues()
    except ImportError as e:
        print(f"cublaslt_drelu_probe.py needs nvmath-python (pip install nvmath-python): {e}", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = mlp_rows("top", *TOP, args.batch, ep, args, gen) + mlp_rows("bottom", *BOTTOM, args.batch, ep, args, gen)
    env = environment(torch.device("cuda"))
    import nvmath

    env["nvmath"] = nvmath.__version__
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows, KEYS, extra=env)
    total = {k: sum(r[k] for r in rows if k in r) for k in ("shipped_ms", "epilogue_ms", "saved_ms")}
    # timing is text, max_diff a number
    table = [md_row(KEYS), md_row(["---"] * 3 + ["---:"] * 3 + ["---", "---:", "---"])]
    for r in rows:
        table.append(md_row([r["part"], r["layer"], r["shape"], f"{r['shipped_ms']:.4f}", f"{r['epilogue_ms']:.4f}",
                             f"{r['saved_ms']:+.4f}", r["timing"], f"{r['max_diff']:.3g}", r["status"]]))
    table.append(md_row(["all", "", "", f"{total['shipped_ms']:.4f}", f"{total['epilogue_ms']:.4f}",
                         f"{total['saved_ms']:+.4f}", "", "", ""]))
    text = markdown("cuBLASLt's ReLU epilogues against the fused MLP's mask kernel (MLPerf DLRM-DCNv2's MLPs)",
                    [env_line(env),
                     f"batch {args.batch}, bf16; ms a call, median of {args.windows} windows of {args.calls} calls "
                     "(timing: graph = CUDA-graph replays, loop = event-timed loop; shipped/epilogue)."], table)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
