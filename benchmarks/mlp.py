"""The fused MLP (kernels/mlp.py) against the eager and the torch.compile'd MLP: forward + backward.

    python benchmarks/mlp.py --out benchmarks/results/mlp
    python benchmarks/mlp.py --smoke --out /tmp/mlp          # tiny shapes, a few steps (CPU: interpreter)

Cases: the Kaggle bottom (13-512-256-64-16, input data: no input gradient) and top (367-512-256-1,
input gradient) MLPs, the Terabyte/MLPerf bottom (13-512-256-128) and top (3456-1024-1024-512-256-1);
at batch 2048 and 65536, in tf32 (fp32 parameters, TF32 cuBLAS GEMMs) and bf16 (fp32 parameters under
bf16 autocast, as the trainer's ``train.precision: bf16``). Implementations:

* ``eager``: ``dlrm.model.archs.MLP`` (nn.Linear + ReLU per layer),
* ``compiled``: the same module under ``torch.compile`` (inductor, default mode),
* ``fused``: ``kernels.mlp.FusedMLP`` (one autograd node; bias+ReLU in cuBLASLt's epilogue; one Triton
  mask + bias-gradient kernel per layer; weight-gradient GEMMs on a second stream).
* ``fp8`` (opt-in, ``--impls ...,fp8``; bf16 rows only): the ``compiled`` MLP with every layer whose
  widths are multiples of 16 an FP8 GEMM (``kernels.fp8_linear``, issue #20's measured try of FP8).
* ``tail`` (opt-in, ``--impls ...,tail``; bf16 rows only on CUDA): ``kernels.mlp_tail_module.OnChipTailMLP``, the ``fused`` MLP whose
  narrow tail (input and widths <= 256: Kaggle bottom 256-64-16, the tops' 256-1, MLPerf bottom
  256-128) runs as ONE Triton kernel per direction with the activations on chip (issue #20).
  ``--tail-launches`` adds one ``tail[...]`` row per forced launch config (a sweep of the heuristic
  ``kernels.heuristics.tail_launch``): ``FWD_BMxWARPS/BWD_BMxWARPS``, the backward's optionally
  followed by ``xPROGRAMS_PER_SM``, ``r`` (RELOAD) and ``h`` (HOIST_W), all with num_stages 1, e.g.
  ``128x8/32x8h,64x8/32x8rh,64x8/32x8r,128x8/64x8x2h``.

    python benchmarks/mlp.py --impls eager,compiled,fused,tail --out benchmarks/results/mlp_tail

One step = parameter grads set to None, forward, ``backward`` of a fixed output gradient. On CUDA the
steps are captured in a CUDA graph (n steps per graph, after warm-up steps on a side stream) and the
graph is replayed in `--windows` timed windows (CUDA events): device time without host launch cost,
as in a training step run under CUDA graphs; the median window's ms per step is reported. On the CPU
(``--smoke``) perf_counter times plain calls.
Writes mlp.csv / mlp.md / mlp.png (GPU name, torch / triton versions, date) under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the fused MLP's Triton kernel runs under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line, environment, graph_replay_windows, int_list, markdown, md_row, pyplot, save_figure, wall_windows,
    write_csv,
)

from dlrm.model.archs import MLP  # noqa: E402
from dlrm.train.step import autocast_context, set_matmul_precision  # noqa: E402
from kernels import mlp_tail  # noqa: E402
from kernels.fp8_linear import fp8_mlp  # noqa: E402
from kernels.mlp import FusedMLP  # noqa: E402
from kernels.mlp_tail import TailLaunch  # noqa: E402
from kernels.mlp_tail_module import OnChipTailMLP, split_tail  # noqa: E402

# name: (in_features, widths, activate_last, input needs a gradient)
CASES = {
    "kaggle_bottom": (13, [512, 256, 64, 16], True, False),
    "kaggle_top": (367, [512, 256, 1], False, True),
    "mlperf_bottom": (13, [512, 256, 128], True, False),
    "mlperf_top": (3456, [1024, 1024, 512, 256, 1], False, True),
}
IMPLS = ("eager", "compiled", "fused", "fp8", "tail")
DEFAULT_IMPLS = ("eager", "compiled", "fused")
KEYS = ["mlp", "shape", "precision", "batch", "impl", "ms", "min_ms", "max_ms", "speedup_vs_eager",
        "samples_per_sec", "steps_per_window", "status"]


def smoke_shape(in_features: int, widths: list[int]) -> tuple[int, list[int]]:
    """The case's chain cut down 32x (widths >= 1; the logit stays 1) for --smoke."""
    return max(1, in_features // 32), [max(1, w // 32) for w in widths]


def parse_tail_launch(spec: str) -> tuple[TailLaunch, TailLaunch]:
    """``FWD_BMxWARPS/BWD_BMxWARPS[xPROGRAMS_PER_SM][r][h]`` -> (forward, backward) launches
    (num_stages 1; r: RELOAD, h: HOIST_W)."""
    try:
        fwd, bwd = spec.split("/")
        flags = bwd[len(bwd.rstrip("rh")):]
        f = [int(v) for v in fwd.split("x")]
        b = [int(v) for v in bwd.rstrip("rh").split("x")]
        if len(f) != 2 or len(b) not in (2, 3) or flags not in ("", "r", "h", "rh"):
            raise ValueError
    except ValueError:
        raise ValueError(f"tail launch {spec!r} is not FWD_BMxWARPS/BWD_BMxWARPS[xPROGRAMS_PER_SM][r][h]") from None
    return TailLaunch(f[0], f[1]), TailLaunch(b[0], b[1], 1, b[2] if len(b) == 3 else 1, "r" in flags, "h" in flags)


def build(impl: str, in_features: int, widths: list[int], activate_last: bool, device: torch.device, backend: str):
    torch.manual_seed(0)
    if impl == "fused":
        return FusedMLP(in_features, widths, "relu", activate_last=activate_last).to(device)
    if impl == "tail" or impl.startswith("tail["):
        return OnChipTailMLP(in_features, widths, "relu", activate_last=activate_last).to(device)
    model = MLP(in_features, widths, "relu", activate_last=activate_last).to(device)
    if impl == "fp8":
        return torch.compile(fp8_mlp(model), backend=backend)
    if impl == "compiled":
        return torch.compile(model, backend=backend)
    return model


def make_step(model, params: list[torch.Tensor], x: torch.Tensor, g: torch.Tensor, precision: str, device):
    """One forward + backward (autocast without its weight cache: the casts run in every step, also
    when replayed from a CUDA graph, as in the trainer's graphed step)."""
    def step():
        for p in params:
            p.grad = None
        with autocast_context(device, precision, cache=False):
            out = model(x)
        out.backward(g.to(out.dtype))

    return step


def measure(name: str, impl: str, precision: str, batch: int, device: torch.device, args) -> dict:
    in_features, widths, activate_last, input_grad = CASES[name]
    if args.smoke:
        in_features, widths = smoke_shape(in_features, widths)
    row = {"mlp": name, "shape": "-".join(str(d) for d in [in_features, *widths]), "precision": precision,
           "batch": batch, "impl": impl}
    if impl == "fp8" and precision != "bf16":
        return {**row, "status": "skipped: fp8 runs under bf16 autocast"}
    if impl.startswith("tail") and precision != "bf16" and torch.cuda.is_available():
        return {**row, "status": "skipped: the on-chip tail runs 16-bit on CUDA"}
    # tail[SPEC]: the on-chip tail with a forced launch (read at every launch: captured as forced)
    forced = parse_tail_launch(impl[len("tail["):-1]) if impl.startswith("tail[") else None
    try:
        mlp_tail.TAIL_LAUNCH_OVERRIDE = forced
        set_matmul_precision("tf32" if precision == "tf32" else "fp32")
        model = build(impl, in_features, widths, activate_last, device, args.compile_backend)
        params = list(model.parameters())
        gen = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(batch, in_features, generator=gen).to(device).requires_grad_(input_grad)
        g = torch.randn(batch, widths[-1], generator=gen).to(device)
        if input_grad:
            params.append(x)
        step = make_step(model, params, x, g, precision, device)
        timer = graph_replay_windows if device.type == "cuda" else wall_windows
        times, steps = timer(step, args.steps, args.windows, args.warmup)
        ms = statistics.median(times)
        row.update(ms=ms, min_ms=min(times), max_ms=max(times), samples_per_sec=batch / ms * 1e3,
                   steps_per_window=steps, status="ok")
    except Exception as e:  # noqa: BLE001 -- one failing case must not hide the others' numbers
        traceback.print_exc()
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        row["status"] = f"failed: {type(e).__name__}: {msg}"
    finally:
        mlp_tail.TAIL_LAUNCH_OVERRIDE = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


def add_speedups(rows: list[dict]) -> None:
    eager = {(r["mlp"], r["precision"], r["batch"]): r.get("ms") for r in rows if r["impl"] == "eager"}
    for r in rows:
        base = eager.get((r["mlp"], r["precision"], r["batch"]))
        if base and r.get("ms"):
            r["speedup_vs_eager"] = base / r["ms"]


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "n/a"


def markdown_table(rows: list[dict]) -> list[str]:
    lines = ["| MLP | shape | precision | batch | impl | ms / step (median) | min | max | vs eager | status |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(md_row([r["mlp"], r["shape"], r["precision"], r["batch"], r["impl"], fmt(r.get("ms"), ".4f"),
                             fmt(r.get("min_ms"), ".4f"), fmt(r.get("max_ms"), ".4f"),
                             fmt(r.get("speedup_vs_eager"), ".2f") + ("x" if r.get("speedup_vs_eager") else ""),
                             r["status"]]))  # fmt: skip
    return lines


def plot(rows: list[dict], env: dict, path: Path, title: str) -> None:
    """Grouped bars: ms per step of each implementation, one group per (MLP, precision, batch)."""
    plt = pyplot()
    groups = list(dict.fromkeys((r["mlp"], r["precision"], r["batch"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        ms = {(r["mlp"], r["precision"], r["batch"]): r.get("ms") for r in rows if r["impl"] == impl}
        ax.bar([i + k * width for i in range(len(groups))], [ms.get(gk) or 0.0 for gk in groups], width, label=impl)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{p} B={b}" for m, p, b in groups], fontsize=7, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per forward + backward (median)")
    ax.set_title(f"{title}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_results(rows: list[dict], env: dict, out: Path, title: str, note: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "mlp.csv", rows, KEYS, env)
    text = markdown(title, [env_line(env), note], markdown_table(rows))
    (out / "mlp.md").write_text(text)
    plot(rows, env, out / "mlp.png", title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (mlp.csv, mlp.md, mlp.png)")
    ap.add_argument("--mlps", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--batch-sizes", default="2048,65536")
    ap.add_argument("--precisions", default="tf32,bf16", help="comma list of fp32 (IEEE), tf32, bf16 (autocast)")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--tail-launches", default="",
                    help="comma list of forced launches of the tail kernels, one tail[...] row each "
                         "(FWD_BMxWARPS/BWD_BMxWARPS[xPROGRAMS_PER_SM][r][h]; see the docstring)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; --smoke: aot_eager)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before capture (compilation)")
    ap.add_argument("--steps", type=int, default=0, help="steps per timed window (0: ~20 ms of work)")
    ap.add_argument("--windows", type=int, default=7, help="timed windows; the median is reported")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (widths / 32), batch 8, few steps: a check that it runs")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, ["mlp.csv", "mlp.md", "mlp.png"])

    if args.smoke:
        if args.batch_sizes == ap.get_default("batch_sizes"):
            args.batch_sizes = "8"
        if args.precisions == ap.get_default("precisions"):
            args.precisions = "tf32"
        args.warmup, args.steps, args.windows = 2, args.steps or 2, 2
        args.compile_backend = args.compile_backend or "aot_eager"
    args.compile_backend = args.compile_backend or "inductor"
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    names = args.mlps.split(",")
    impls = args.impls.split(",")
    for n in names:
        if n not in CASES:
            ap.error(f"unknown MLP {n!r} (choose from {', '.join(CASES)})")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown impl {i!r} (choose from {', '.join(IMPLS)})")
    for spec in filter(None, args.tail_launches.split(",")):
        try:
            parse_tail_launch(spec)
        except ValueError as e:
            ap.error(str(e))
        impls.append(f"tail[{spec}]")
    precisions = args.precisions.split(",")
    batches = int_list(ap, "--batch-sizes", args.batch_sizes)  # one argparse line for a bad value, not a traceback
    if device.type != "cuda" and "bf16" in precisions:
        ap.error("bf16 is measured on CUDA only (the Triton interpreter is fp32-only)")

    env = environment(device)
    title = "Fused MLP vs eager and compiled torch: forward + backward" + (" (smoke)" if args.smoke else "")
    if any(i.startswith("tail") for i in impls):
        def tail_layers(name: str) -> str:
            dims = CASES[name][:2] if not args.smoke else smoke_shape(*CASES[name][:2])
            dims = [dims[0], *dims[1]]
            start = split_tail(dims)
            return f"{name} " + ("-".join(str(d) for d in dims[start:]) if start < len(dims) - 1 else "none")

        note_tail = (" tail: OnChipTailMLP (kernels/mlp_tail_module.py), the on-chip layers: "
                     + ", ".join(tail_layers(n) for n in names) + "; the others as fused.")
    else:
        note_tail = ""
    timing = ("CUDA-graph replay, device time" if device.type == "cuda" else "CPU wall time")
    note = (f"{timing}; median of {args.windows} windows; compile backend {args.compile_backend}. tf32: fp32 "
            "parameters and TF32 GEMMs; bf16: fp32 parameters under bf16 autocast. bottom MLPs: no input gradient."
            + note_tail)
    rows = []
    for name in names:
        for batch in batches:
            for precision in precisions:
                for impl in impls:
                    r = measure(name, impl, precision, batch, device, args)
                    rows.append(r)
                    add_speedups(rows)
                    print(f"{name:>14} {precision:>4} B={batch:>6} {impl:>9}: "
                          + (f"{r['ms']:.4f} ms" if r.get("ms") else r["status"]), flush=True)
                    torch._dynamo.reset()
                    # rewritten after every case: a run cut short keeps what it measured
                    write_results(rows, env, Path(args.out), title, note)
    print(markdown(title, [env_line(env), note], markdown_table(rows)), end="")
    outputs.report()
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
