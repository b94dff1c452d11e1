"""Probe: the MLPerf DLRM-DCNv2 dense part (cross network + top MLP) with rowwise FP8 GEMMs, against bf16.

    python benchmarks/fp8_dense_probe.py --out benchmarks/results/fp8_dense_probe
    python benchmarks/fp8_dense_probe.py --smoke --out /tmp/fdp     # tiny shapes (CPU: eager, a check of the script)

`benchmarks/gemm_layout_probe.py` timed the step's GEMMs alone: rowwise-scaled e4m3 GEMMs took 20-43% less time
than bf16 for the forward and input-gradient GEMMs, but quantizing a [65536, 3456] operand as its own kernel cost
more than it saved. This probe asks what is left when Inductor fuses each rowwise quantization (amax over the row,
scale, cast) into the kernel that produces the operand. It times, compiled (mode default) under bf16 autocast,
the forward + backward of the dense part that follows the embeddings: ``x0`` [B, 3456] -> a 3-layer rank-512
`LowRankCrossNet` -> the top MLP 3456-1024-1024-512-256-1 (ReLU) -> the logits, backward from a fixed logit
gradient into ``x0`` and every parameter. Variants: every GEMM in bf16 (as the step runs); the forward and
input-gradient GEMMs of the cross network, the top MLP, or both, as `kernels.fp8_linear.fp8_rowwise_linear`
(weight gradients stay bf16; the 1-wide logit layer stays bf16).

Accuracy, at ``--check-batch`` rows: the logits, ``x0``'s gradient and the first cross layer's V gradient against
float64 eager (relative Frobenius error), for each variant. Timing: CUDA graphs of ``--calls`` calls replayed in
``--windows`` windows (`_common.graph_replay_ms`). Writes fp8_dense_probe.csv / .md / .png under ``--out``.
``--profile`` adds fp8_dense_probe_kernels.md: each variant's kernels (compiled, 3 calls under torch.profiler, no
graph) summed by kind (FP8 GEMMs, bf16 GEMMs, Inductor's fused kernels, the rest), then its longest kernels: where
the FP8 GEMMs' saving goes.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F_

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line, environment, graph_replay_ms, int_list, markdown, md_row, pyplot, save_figure, write_csv,
)

from dlrm.model.archs import LowRankCrossNet  # noqa: E402
from kernels.fp8_linear import fp8_rowwise_linear  # noqa: E402

# name: (cross network in FP8, top MLP in FP8)
VARIANTS = {"bf16": (False, False), "fp8 cross": (True, False), "fp8 top": (False, True),
            "fp8 cross + top": (True, True)}
KEYS = ["variant", "batch", "ms", "vs_bf16", "err_logits", "err_dx0", "err_dV0", "status"]
# --profile: kernel kinds, the first pattern that matches a kernel's name wins (cuBLASLt's FP8 kernels on an H200 with
# CUDA 13 are "nvjet_sm90_qqtst_...", older ones carry "e4m3" / "f8"; its bf16 ones "nvjet_sm90_tst_..." / "gemm")
KINDS = [("FP8 GEMMs", r"e4m3|e5m2|f8|fp8|_qqtst_"), ("bf16 GEMMs", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|splitKreduce"),
         ("Inductor fused kernels", r"^triton_"), ("other", r"")]


def kernel_kind(name: str) -> str:
    """The `KINDS` label of a kernel name.

        >>> kernel_kind("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128"), kernel_kind("triton_red_fused_0")
        ('FP8 GEMMs', 'Inductor fused kernels')
    """
    return next(label for label, pattern in KINDS if re.search(pattern, name))


def profile_kernels(step, calls: int = 3) -> list[tuple[str, float, int]]:
    """``(kernel name, device ms a call, launches a call)`` of `step`, longest first, from ``calls`` calls under
    torch.profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if us and str(getattr(e, "device_type", "")).endswith("CUDA"):
            out.append((e.key, float(us) / 1e3 / calls, round(int(e.count) / calls)))
    return sorted(out, key=lambda r: -r[1])


def kernel_report(profiles: dict, top_n: int = 12) -> list[str]:
    """Markdown lines: a table of ms a call by kernel kind and variant, then each variant's `top_n` longest kernels."""
    names = list(profiles)
    lines = [md_row(["kind", *names]), md_row(["---", *["---:" for _ in names]])]
    for label, _ in KINDS:
        lines.append(md_row([label, *[f"{sum(ms for k, ms, _ in profiles[v] if kernel_kind(k) == label):.3f}"
                                      for v in names]]))
    lines.append(md_row(["all kernels", *[f"{sum(ms for _, ms, _ in profiles[v]):.3f}" for v in names]]))
    for v in names:
        lines += ["", f"**{v}**, the {top_n} longest kernels:", "",
                  md_row(["kernel", "kind", "launches a call", "ms a call"]), md_row(["---", "---", "---:", "---:"])]
        lines += [md_row([k[:110], kernel_kind(k), n, f"{ms:.3f}"]) for k, ms, n in profiles[v][:top_n]]
    return lines


class DensePart(nn.Module):
    """``x0`` [B, N] -> logits [B]: the cross network, then the top MLP; ``fp8_cross`` / ``fp8_top`` route the
    layers' GEMMs through `fp8_rowwise_linear` (the top MLP's last, 1-wide layer always in bf16)."""

    def __init__(self, width: int, layers: int, rank: int, top: list[int]) -> None:
        super().__init__()
        self.cross = LowRankCrossNet(width, layers, rank)
        dims = [width, *top]
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.fp8_cross = self.fp8_top = False

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        c = self.cross
        lin = fp8_rowwise_linear if self.fp8_cross else F_.linear
        x = x0
        for v, w, b in zip(c.V_kernels, c.W_kernels, c.bias):
            y = lin(lin(x, v), w)
            x = x0 * (y + b.to(y.dtype)) + x
        last = len(self.top) - 1
        for i, layer in enumerate(self.top):
            f = fp8_rowwise_linear if self.fp8_top and i < last else F_.linear
            x = f(x, layer.weight, layer.bias)
            if i < last:
                x = torch.relu(x)
        return x.squeeze(-1)


def errors(model: DensePart, x0: torch.Tensor, glog: torch.Tensor, device) -> dict:
    """Relative Frobenius errors of the logits, x0's gradient and V_0's gradient against float64 eager."""
    ref = copy.deepcopy(model).double()
    ref.fp8_cross = ref.fp8_top = False
    xr = x0.detach().double().requires_grad_()
    out_r = ref(xr)
    out_r.backward(glog.double())
    xm = x0.detach().clone().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(xm)
    out.backward(glog.to(out.dtype))
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    res = {"err_logits": rel(out, out_r), "err_dx0": rel(xm.grad, xr.grad),
           "err_dV0": rel(model.cross.V_kernels[0].grad, ref.cross.V_kernels[0].grad)}
    model.zero_grad(set_to_none=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--check-batch", type=int, default=4096)
    ap.add_argument("--width", type=int, default=3456)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--top", default="1024,1024,512,256,1")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="untimed replays before the windows: the power-capped clock of a sustained run, where the "
                         "energy a FLOP costs sets the time (an H200 trains MLPerf at its 700 W cap: PERF.md, "
                         "thirty-sixth run); 0 in --smoke")
    ap.add_argument("--profile", action="store_true",
                    help="also write fp8_dense_probe_kernels.md: each variant's kernels by kind (CUDA only)")
    ap.add_argument("--smoke", action="store_true", help="batch 64, width 96, rank 32, top 64,32,1; eager on the CPU")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out,
                            ["fp8_dense_probe.csv", "fp8_dense_probe.md", "fp8_dense_probe_kernels.md", "fp8_dense_probe.png"])
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.batch, args.check_batch, args.width, args.rank, args.top = 64, 32, 96, 32, "64,32,1"
        args.calls, args.windows, args.settle_s = 1, 1, 0.0
    device = torch.device("cuda" if cuda else "cpu")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not names or set(names) - set(VARIANTS):
        ap.error(f"--variants: {args.variants!r} is not a comma list of {', '.join(VARIANTS)}")
    top = int_list(ap, "--top", args.top)  # a bad width: one argparse line, not a traceback
    torch.manual_seed(0)
    base = DensePart(args.width, args.layers, args.rank, top).to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    x0 = (torch.randn(args.batch, args.width, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    x0.requires_grad_()
    glog = torch.randn(args.batch, generator=gen, device=device) / args.batch
    rows, profiles = [], {}
    for name in names:
        model = copy.deepcopy(base)
        model.fp8_cross, model.fp8_top = VARIANTS[name]
        row = {"variant": name, "batch": args.batch}
        try:
            row.update(errors(model, x0[: args.check_batch].float(), glog[: args.check_batch] * args.batch
                              / args.check_batch, device))
            fn = torch.compile(model) if cuda else model

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
                    out = fn(x0)
                out.backward(glog.to(out.dtype))

            if cuda:
                row["ms"] = graph_replay_ms(step, args.calls, args.windows, 3, args.settle_s)
                if args.profile:
                    profiles[name] = profile_kernels(step)
            else:
                t0 = time.perf_counter()
                step()
                row["ms"] = (time.perf_counter() - t0) * 1e3
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded in the row
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        x0.grad = None
        rows.append(row)
        print(md_row([row.get(k, "") for k in KEYS]), flush=True)
        torch._dynamo.reset()
    bf = next((r.get("ms") for r in rows if r["variant"] == "bf16"), None)
    for r in rows:
        if bf and r.get("ms"):
            r["vs_bf16"] = bf / r["ms"]
    env = environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "fp8_dense_probe.csv", rows, KEYS, env)
    table = [md_row(["variant", "ms fwd+bwd", "vs bf16", "rel. error logits", "x0 grad", "V_0 grad", "status"]),
             md_row(["---", "---:", "---:", "---:", "---:", "---:", "---"])]
    fmt = lambda v, f: format(v, f) if isinstance(v, float) else ""  # noqa: E731
    for r in rows:
        table.append(md_row([r["variant"], fmt(r.get("ms"), ".3f"), fmt(r.get("vs_bf16"), ".3f"),
                             fmt(r.get("err_logits"), ".2e"), fmt(r.get("err_dx0"), ".2e"),
                             fmt(r.get("err_dV0"), ".2e"),
                             r["status"]]))
    (out / "fp8_dense_probe.md").write_text(markdown(
        "MLPerf DLRM-DCNv2 dense part: rowwise FP8 GEMMs against bf16",
        [env_line(env), f"batch {args.batch} (errors at {args.check_batch}), width {args.width}, rank {args.rank}, "
         f"{args.layers} cross layers, top {args.top}; compiled, bf16 autocast, forward + backward; CUDA graphs of "
         f"{args.calls} calls, median of {args.windows} windows after {args.settle_s:g} s of untimed replays. Errors: "
         "relative Frobenius norm against float64 eager."], table))
    if profiles:
        (out / "fp8_dense_probe_kernels.md").write_text(markdown(
            "MLPerf DLRM-DCNv2 dense part: kernels by kind, rowwise FP8 against bf16",
            [env_line(env), f"batch {args.batch}, compiled, bf16 autocast, forward + backward, device ms a call from 3 "
             "calls under torch.profiler (no CUDA graph, so launch gaps are not counted)."],
            kernel_report(profiles)))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ok = [r for r in rows if r.get("ms")]
    ax.barh([r["variant"] for r in ok][::-1], [r["ms"] for r in ok][::-1])
    ax.set_xlabel("ms per forward + backward")
    ax.set_title(f"DCNv2 dense part, rowwise FP8 vs bf16\n{env_line(env)}", fontsize=8)
    save_figure(fig, out / "fp8_dense_probe.png")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
