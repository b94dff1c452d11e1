"""The GPU's SM clock, power draw and clock-limit reasons while it trains, and while it runs one large GEMM alone.

    python benchmarks/step_clocks.py --config configs/mlperf-dcnv2.json --seconds 20 \
        --out benchmarks/results --name step_clocks_mlperf

A floor computed from the tensor cores' peak rate assumes the boost clock. A step whose GEMMs draw the board to its
power limit runs them at a lower clock, and a GEMM timed alone in short bursts (CUDA graphs of a few calls) may not
see that. This script samples ``nvidia-smi`` every ``--interval-ms`` (a subprocess: no NVML binding needed) through
five phases: idle, ``--windows`` windows of 20 steps timed as the benchmarks time them (CUDA events, the median),
``--seconds`` of training steps (the run `train.py` builds for ``--variant``, the whole-step CUDA graph included, on
synthetic batches; a host sync every ``--sync-every`` steps), idle again, then ``--seconds`` of one GEMM back to back
(``--gemm M,N,K``, bf16; by default the MLPerf top MLP's first data gradient) for each ``--gemm-operands`` kind of
A operand (normal random values, half of them zeroed, zeros; B normal), idle between them, then ``--seconds`` of each
``--kernels`` kernel back to back (`KERNELS`: a 1 GiB ``copy_``, DRAM traffic alone; one MLPerf DLRM-DCNv2 cross layer's
Gluon forward, ``out = x0 * (u W^T + b) + x`` with ``pre`` stored, tensor-core math and DRAM traffic at once). For each
phase: the median and range of the SM clock and the power draw, the share of samples with each clock-limit reason
active (power cap, thermal, ...), and the work's rate (samples/s, TFLOP/s).

Writes ``<name>.md`` / ``.csv`` (every sample) / ``.png`` (the timeline) under ``--out``. CUDA only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_overwrite,
    claim_outputs,
    env_line,
    environment,
    markdown,
    md_row,
    pyplot,
    run_config_or_error,
    save_figure,
    synthetic_batches,
    train_steps,
    write_csv,
)

from dlrm.config import load_config, validate  # noqa: E402
from dlrm.train.builder import build_run, tables_from_config  # noqa: E402
from dlrm.train.compare import variant_config  # noqa: E402

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
# clocks_event_reasons bits (nvidia-smi --help-query-gpu), the ones that lower the clock under load
REASONS = {0x1: "idle", 0x4: "power cap (software)", 0x8: "hardware slowdown", 0x20: "thermal (software)",
           0x40: "thermal (hardware)", 0x80: "power brake (hardware)"}
KEYS = ["t", "phase", "sm_mhz", "mem_mhz", "power_w", "temp_c", "reasons"]


def parse_samples(lines: list[str]) -> list[dict]:
    """``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` lines -> dicts with ``t`` (POSIX seconds) and
    numbers; lines that do not parse (a header, "[N/A]") are skipped.

        >>> s = parse_samples(["2026/11/29 10:45:01.250, 1980, 3201, 512.34, 45, 0x0000000000000004", "junk"])
        >>> [(r["sm_mhz"], r["power_w"], r["reasons"]) for r in s], s[0]["t"] % 1
        ([(1980.0, 512.34, 4)], 0.25)
    """
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            sm, mem, power, temp = (float(p) for p in parts[1:5])
            reasons = int(parts[5], 16)
        except ValueError:
            continue
        out.append(dict(t=t, sm_mhz=sm, mem_mhz=mem, power_w=power, temp_c=temp, reasons=reasons))
    return out


def label_phases(samples: list[dict], phases: list[tuple[str, float, float]]) -> list[dict]:
    """Each sample with the ``phase`` whose [start, end) host-clock interval holds its time (or "between")."""
    for s in samples:
        s["phase"] = next((name for name, t0, t1 in phases if t0 <= s["t"] < t1), "between")
    return samples


def summarize(samples: list[dict], phase: str) -> Optional[dict]:
    """Median / min / max SM clock and power of `phase`'s samples, and the share of them with each reason active.

        >>> s = [dict(phase="steps", sm_mhz=m, power_w=p, reasons=r) for m, p, r in [(1700, 690, 4), (1800, 650, 0)]]
        >>> r = summarize(s, "steps"); (r["samples"], r["sm_mhz"], r["power_w"], r["power cap (software)"])
        (2, 1750.0, 670.0, 0.5)
    """
    mine = [s for s in samples if s["phase"] == phase]
    if not mine:
        return None
    row = dict(phase=phase, samples=len(mine), sm_mhz=statistics.median(s["sm_mhz"] for s in mine),
               sm_min=min(s["sm_mhz"] for s in mine), sm_max=max(s["sm_mhz"] for s in mine),
               power_w=statistics.median(s["power_w"] for s in mine), power_max=max(s["power_w"] for s in mine))
    for bit, name in REASONS.items():
        row[name] = sum(1 for s in mine if s["reasons"] & bit) / len(mine)
    return row


class Sampler:
    """``cmd``'s output lines, read as they come. On a pseudo-terminal where there is one (Linux): there nvidia-smi
    writes each sample when it takes it, while into a pipe its output is block-buffered, and stopping it lost the
    last 10-13 s of samples (seen three times until 2026-11-29, ``stdbuf -oL`` or not). A thread drains the output,
    so a full pty buffer never stalls the child."""

    def __init__(self, cmd: list[str]) -> None:
        import threading

        self.chunks: list[str] = []
        try:
            import pty

            master, slave = pty.openpty()
        except (ImportError, OSError):
            master = slave = None
        if master is None:  # no pty: a pipe (its last block may be lost when the child is stopped)
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self.fd = os.dup(self.proc.stdout.fileno())
            self.proc.stdout.close()
        else:
            self.proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, close_fds=True)
            os.close(slave)
            self.fd = master
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the pty's other side closed (EIO)
                return
            if not data:
                return
            self.chunks.append(data.decode(errors="replace"))

    def stop(self) -> list[str]:
        """Stop the child; every line it wrote (a pty turns "\n" into "\r\n": stripped)."""
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=10)
        try:
            os.close(self.fd)
        except OSError:
            pass
        return [line.rstrip("\r") for line in "".join(self.chunks).split("\n") if line.strip()]


def start_sampler(index: int, interval_ms: int) -> Sampler:
    """nvidia-smi sampling every `interval_ms`; drivers before the "event reasons" name take the older alias."""
    query = QUERY
    if subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", f"-i={index}"],
                      capture_output=True).returncode != 0:
        query = QUERY.replace("clocks_event_reasons", "clocks_throttle_reasons")
    return Sampler(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", f"-lms={interval_ms}",
                    f"-i={index}"])


GEMM_OPERANDS = ("normal", "relu", "zeros")
# --kernels: name -> what its phase runs, for the report
KERNELS = {"copy": "copy_ of 1 GiB (bf16)",
           "cross_fwd": "Gluon cross forward, later layer, pre stored (65536 x 3456, rank 512, bf16)",
           "gemm_bf16": "GEMM 65536x1024x3456, bf16 (the top MLP's first forward)",
           "gemm_fp8": "GEMM 65536x1024x3456, rowwise-scaled e4m3, bf16 out (torch._scaled_mm)"}
# the shape of the gemm_bf16 / gemm_fp8 phases: the top MLP's first forward GEMM, M x N x K
FP8_GEMM_SHAPE = (65536, 1024, 3456)


def kernel_phase(name: str, device, copy_numel: int = 2**29, gemm_shape: tuple = FP8_GEMM_SHAPE) -> tuple:
    """``(fn, bytes a call, FLOP a call)`` of a ``--kernels`` phase, its tensors made on ``device`` (the copy:
    ``copy_numel`` bf16 values, 1 GiB by default; the GEMMs: ``gemm_shape``, M x N x K)."""
    if name == "copy":
        src = torch.randn(copy_numel, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), 2 * src.numel() * 2, 0
    if name in ("gemm_bf16", "gemm_fp8"):
        # the same product in both precisions, A row-major and B column-major (what torch._scaled_mm takes), so that
        # the two phases' TFLOP/s and watts give the energy a FLOP costs in each under the power cap
        M, N, K = gemm_shape
        a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=device, dtype=torch.bfloat16).t()
        out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        if name == "gemm_bf16":
            return (lambda: torch.mm(a, b, out=out)), (M * K + K * N + M * N) * 2, 2 * M * N * K
        from kernels.fp8_linear import quantize_rows

        aq, sa = quantize_rows(a)  # [M, K] e4m3, [M, 1] fp32
        bq, sb = quantize_rows(b.t())  # [N, K], [N, 1]: one scale per output column
        bq, sb = bq.t(), sb.t()
        return ((lambda: torch._scaled_mm(aq, bq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)),
                M * K + K * N + M * N * 2, 2 * M * N * K)
    from kernels.cross_ws import cross_forward_ws

    M, N, K = 65536, 3456, 512
    x0, x = (torch.randn(M, N, device=device, dtype=torch.bfloat16) for _ in range(2))
    u = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=device) * K ** -0.5).to(torch.bfloat16)
    b = torch.randn(N, device=device)
    return (lambda: cross_forward_ws(x0, x, u, w, b, store_pre=True)), 4 * M * N * 2 + (M + N) * K * 2, 2 * M * N * K


def gemm_operand(kind: str, shape: tuple, device) -> torch.Tensor:
    """The GEMM phase's A operand (bf16): "normal" random values, "relu" the same with the negative half zeroed (as
    the gradients behind a ReLU mask), "zeros". The tensor cores' power, hence the clock under a cap, depends on the
    operands' bits.

        >>> a = gemm_operand("relu", (1000, 8), "cpu"); 0.4 < float((a == 0).float().mean()) < 0.6
        True
    """
    if kind == "zeros":
        return torch.zeros(shape, device=device, dtype=torch.bfloat16)
    a = torch.randn(shape, device=device, dtype=torch.bfloat16)
    return a.clamp_(min=0) if kind == "relu" else a


def run_for(seconds: float, fn, device, check_every: int = 10) -> int:
    """Call `fn` until `seconds` have passed (checked every `check_every` calls, each check a host sync that drains
    the queue); returns the calls."""
    calls, t0 = 0, time.time()
    while True:
        for _ in range(check_every):
            fn()
        calls += check_every
        torch.cuda.synchronize(device)
        if time.time() - t0 >= seconds:
            return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/mlperf-dcnv2.json")
    ap.add_argument("--variant", default="auto")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--max-rows", type=int, default=None, help="cap every table at this many rows")
    ap.add_argument("--precision", default=None, choices=["fp32", "tf32", "bf16"],
                    help="default: the config's train.precision")
    ap.add_argument("--seconds", type=float, default=20.0, help="of training steps, and of the GEMM")
    ap.add_argument("--idle", type=float, default=2.0, help="idle seconds before and after the steps")
    ap.add_argument("--gemm", default="65536,3456,1024", help="M,N,K of the GEMM phase (bf16; '' skips it)")
    ap.add_argument("--windows", type=int, default=5, help="timed windows of 20 steps before the sustained steps")
    ap.add_argument("--gemm-operands", default="normal",
                    help=f"comma list of {', '.join(GEMM_OPERANDS)}: one GEMM phase each (its A operand's values)")
    ap.add_argument("--kernels", default="",
                    help=f"comma list of {', '.join(KERNELS)}: one phase each after the GEMM phases ('' none)")
    ap.add_argument("--interval-ms", type=int, default=50)
    ap.add_argument("--tail-s", type=float, default=1.0, help="idle seconds after the last phase, still sampled")
    ap.add_argument("--sync-every", type=int, default=50,
                    help="steps between the host syncs that check the time (each drains the queue: the rate counts "
                         "them, the benchmarks' timed windows of 20 steps one)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first (compilation, graph capture)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="step_clocks")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.md", f"{args.name}.csv", f"{args.name}.png"])
    # the options and the config first: one argparse line for a bad one, before the CUDA check (they were checked
    # after it, and a bad config was a traceback there, only on a GPU)
    if args.windows < 1 or args.sync_every < 1 or args.seconds <= 0:
        ap.error(f"--windows {args.windows}, --sync-every {args.sync_every}, --seconds {args.seconds}: each must be > 0")
    run_config_or_error(ap, args.config, {"data.batch_size": args.batch_size, "train.precision": args.precision,
                                          "data.max_rows_per_table": args.max_rows}, args.variant)
    operand_kinds = [k.strip() for k in args.gemm_operands.split(",") if k.strip()]
    if not operand_kinds or set(operand_kinds) - set(GEMM_OPERANDS):
        ap.error(f"--gemm-operands: {args.gemm_operands!r} is not a comma list of {', '.join(GEMM_OPERANDS)}")
    kernel_names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if set(kernel_names) - set(KERNELS):
        ap.error(f"--kernels: {args.kernels!r} is not a comma list of {', '.join(KERNELS)}")
    try:
        gemm = [int(v) for v in args.gemm.split(",")] if args.gemm else None
        assert gemm is None or (len(gemm) == 3 and min(gemm) > 0)
    except (ValueError, AssertionError):
        ap.error(f"--gemm: {args.gemm!r} is not M,N,K (positive integers)")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (and nvidia-smi)")
    device = torch.device("cuda")
    env = environment(device)
    cfg = variant_config(load_config(args.config), args.variant)
    cfg.data.batch_size = args.batch_size
    if args.precision is not None:
        cfg.train.precision = args.precision
    if args.max_rows is not None:
        cfg.data.max_rows_per_table = args.max_rows
    validate(cfg)
    torch.manual_seed(0)
    batches = synthetic_batches(8, args.batch_size, device, multi_hot_sizes=cfg.model.multi_hot_sizes)
    run = build_run(cfg, tables_from_config(cfg), device, total_steps=args.warmup + 100_000)
    train_steps(run, batches, args.warmup)
    torch.cuda.synchronize(device)
    step_no = [args.warmup]

    def step():
        train_steps(run, batches, 1, start=step_no[0])
        step_no[0] += 1

    sampler = start_sampler(device.index or 0, args.interval_ms)
    phases, rates = [], {}
    try:
        time.sleep(args.idle)
        tw = time.time()
        phases.append(("idle before", 0.0, tw))
        # the benchmarks' own timing first (mlperf_dcnv2.py: windows of 20 steps, CUDA events, the median), from idle
        window_ms = []
        for _ in range(args.windows):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                step()
            end.record()
            end.synchronize()
            window_ms.append(start.elapsed_time(end) / 20)
        t0 = time.time()
        phases.append(("windows of 20 steps", tw, t0))
        rates[phases[-1][0]] = (f"{args.batch_size / statistics.median(window_ms) / 1e3:.2f}M samples/s (median of "
                                f"{args.windows}; " + ", ".join(f"{args.batch_size / ms / 1e3:.2f}" for ms in window_ms)
                                + ")")
        calls = run_for(args.seconds, step, device, args.sync_every)
        t1 = time.time()
        phases.append(("steps", t0, t1))
        rates["steps"] = (f"{calls * args.batch_size / (t1 - t0) / 1e6:.2f}M samples/s ({calls} steps, a host sync "
                          f"every {args.sync_every})")
        run = None  # frees the model before the GEMM phases; rebinding, not del: step() closes over the name
        torch.cuda.empty_cache()
        time.sleep(args.idle)
        t2 = time.time()
        phases.append(("idle after", t1, t2))
        for i, kind in enumerate(operand_kinds if gemm else []):
            M, N, K = gemm
            a = gemm_operand(kind, (M, K), device)
            b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
            c = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            torch.cuda.synchronize(device)
            t2 = time.time()
            calls = run_for(args.seconds, lambda: torch.mm(a, b, out=c), device)
            t3 = time.time()
            repeat = operand_kinds[:i].count(kind)  # a kind named again gets its own phase, as a kernel does
            phases.append((f"GEMM {M}x{N}x{K}, A {kind}" + (f" #{repeat + 1}" if repeat else ""), t2, t3))
            rates[phases[-1][0]] = f"{2 * M * N * K * calls / (t3 - t2) / 1e12:.0f} TFLOP/s ({calls} calls)"
            a = b = c = None  # frees the operands; rebinding, not del: the timed lambda closes over these names
            time.sleep(args.idle)
            t2 = time.time()
        for i, name in enumerate(kernel_names):
            fn, nbytes, flop = kernel_phase(name, device)
            fn()
            torch.cuda.synchronize(device)
            t2 = time.time()
            calls = run_for(args.seconds, fn, device)
            t3 = time.time()
            repeat = kernel_names[:i].count(name)  # a kernel named again gets its own phase
            phases.append((KERNELS[name] + (f" #{repeat + 1}" if repeat else ""), t2, t3))
            per = (t3 - t2) / calls
            rates[phases[-1][0]] = (f"{per * 1e3:.3f} ms a call, {nbytes / per / 1e9:,.0f} GB/s"
                                    + (f", {flop / per / 1e12:.0f} TFLOP/s" if flop else "") + f" ({calls} calls)")
            del fn
            torch.cuda.empty_cache()
            time.sleep(args.idle)
        time.sleep(max(0.5, args.tail_s))
    finally:
        lines = sampler.stop()
    samples = label_phases(parse_samples(lines), phases)
    rows = [r for r in (summarize(samples, p) for p, _, _ in phases) if r]
    lost = phases[-1][2] - samples[-1]["t"] if samples else 0.0
    table = ["| phase | samples | SM MHz (median, min-max) | power W (median, max) | "
             + " | ".join(f"{n} share" for n in REASONS.values()) + " | rate |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in REASONS) + " | --- |"]
    table += [md_row([r["phase"], r["samples"], f"{r['sm_mhz']:.0f} ({r['sm_min']:.0f}-{r['sm_max']:.0f})",
                      f"{r['power_w']:.0f} ({r['power_max']:.0f})"] + [f"{100 * r[n]:.0f}%" for n in REASONS.values()]
                     + [rates.get(r["phase"], "")]) for r in rows]
    note = (f"{Path(args.config).name}, variant {args.variant}, {cfg.train.precision}, batch {args.batch_size}, "
            "synthetic uniform batches; "
            f"nvidia-smi every {args.interval_ms} ms ({len(samples)} samples"
            + (f"; the last {lost:.1f} s of the last phase not sampled" if lost > 1.0 else "")
            + "). Reasons: the share of samples with "
            "each clocks_event_reasons bit set.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(f"SM clock and power while training ({Path(args.config).name}) and in one GEMM",
                    [env_line(env), note], table)
    (out / f"{args.name}.md").write_text(text)
    t_first = samples[0]["t"] if samples else 0.0
    write_csv(out / f"{args.name}.csv", [dict(s, t=round(s["t"] - t_first, 3)) for s in samples], KEYS, env)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [s["t"] - t_first for s in samples]
    ax.plot(ts, [s["sm_mhz"] for s in samples], label="SM MHz", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(ts, [s["power_w"] for s in samples], label="power W", color="tab:red", alpha=0.7)
    for name, a, b in phases[1:]:
        ax.axvspan(a - t_first, b - t_first, alpha=0.08, color="gray")
        ax.text((a + b) / 2 - t_first, ax.get_ylim()[0], name, ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("s")
    ax.set_ylabel("SM MHz")
    ax2.set_ylabel("W")
    ax.set_title(f"{env['device']}, torch {env['torch']}, {env['date']}", fontsize=9)
    save_figure(fig, out / f"{args.name}.png")
    print(text, end="")
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
