"""The per-step host work around a CUDA-graphed step kept small without changing what it computes (PERF.md "Next"
9, session 69): the schedulers' step sets exactly LambdaLR's learning rates and state, writing a group's lr only
when it changes; the fused sparse optimizer copies its lr into the kernel's tensor only when it changes; the
data-wait timer's events name their stream (no device lookup a fetch)."""

from __future__ import annotations

import copy
import types
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlrm.config import ScheduleConfig
from dlrm.train.meter import DataWaitTimer
from dlrm.train.optim import FusedSparseOptimizer, ScheduledLR, build_schedulers, lr_multiplier


class _Ops(TorchDispatchMode):
    """The aten ops run inside the block (a fill of a device tensor is a kernel launch on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func)] += 1
        return func(*args, **(kwargs or {}))


SCHEDULES = {
    "warm-up, hold, linear": ScheduleConfig(warmup_steps=5, decay="linear", decay_start_step=9, end_factor=0.1,
                                            decay_steps=7),
    "cosine from 0": ScheduleConfig(decay="cosine", decay_start_step=0, end_factor=0.0),
    "warm-up only": ScheduleConfig(warmup_steps=3),
    "one-step run": ScheduleConfig(warmup_steps=1, decay="linear", decay_start_step=0),
}


def two_groups() -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.5},
                            {"params": [torch.nn.Parameter(torch.ones(3))], "lr": 0.03}])


def to_tensor_lrs(opt: torch.optim.Optimizer) -> None:
    """A CUDA-graphed step's dense groups read their lr from a tensor, made at its first step, after the schedulers
    were built (`graphed_step._load_dense_lrs`)."""
    for group in opt.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))


def lr_values(opt) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_scheduled_lr_sets_lambdalrs_learning_rates_and_state(name, tensor_lr):
    """Step by step (past a decay's end), every group's lr equals torch's own LambdaLR's on the same multiplier, value
    for value, and so do the state_dict's entries (last_epoch, _step_count, base_lrs, _last_lr)."""
    cfg, total = SCHEDULES[name], 20
    ours_opt, ref_opt = two_groups(), two_groups()
    [ours] = build_schedulers([ours_opt], cfg, total_steps=total)
    assert isinstance(ours, ScheduledLR)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: lr_multiplier(s, cfg, total))
    if tensor_lr:
        to_tensor_lrs(ours_opt), to_tensor_lrs(ref_opt)
    assert lr_values(ours_opt) == lr_values(ref_opt)
    for step in range(total + 5):
        ours_opt.step(), ref_opt.step()
        ours.step(), ref.step()
        assert lr_values(ours_opt) == lr_values(ref_opt), step
        assert all(isinstance(g["lr"], torch.Tensor) == tensor_lr for g in ours_opt.param_groups)
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert set(mine) == set(theirs)
    for key in ("last_epoch", "_step_count", "base_lrs"):
        assert mine[key] == theirs[key], key
    # (LambdaLR keeps copies of tensor lrs, fp32; this the values written into them)
    f32 = [torch.tensor(float(v), dtype=torch.float32).item() for v in mine["_last_lr"]]
    assert f32 == [torch.tensor(float(v), dtype=torch.float32).item() for v in theirs["_last_lr"]]
    assert all(type(v) is float for v in mine["_last_lr"])  # no device tensor in a checkpoint


def test_a_hold_at_the_full_rate_writes_no_tensor_lr():
    """A tensor lr is filled (a kernel launch on CUDA) at each step of a warm-up or a decay, and not at all while the
    multiplier holds (between them, and after the decay's end)."""
    cfg = SCHEDULES["warm-up, hold, linear"]  # warm-up 0-4, hold 5-8, decay 9-15, end 16-
    opt = two_groups()
    [sched] = build_schedulers([opt], cfg, total_steps=30)
    to_tensor_lrs(opt)
    fills = []
    for _ in range(24):
        opt.step()
        with _Ops() as ops:
            sched.step()
        fills.append(ops.names["aten.fill_.Scalar"])
    # scheduler steps 1-4 reach multipliers 0.4-1.0 (warm-up), 5-9 hold 1.0 (the decay's first step, 9, too), 10-16
    # decay to 0.1, 17-24 stay there
    assert fills == [2] * 4 + [0] * 5 + [2] * 7 + [0] * 8, fills


def test_a_learning_rate_put_there_by_another_is_written_again():
    """The skip trusts only values this scheduler wrote: an lr replaced by an optimizer's load (or a tensor of
    another value, as a captured step's conversion could leave) is set to the schedule's at the next step, also
    during a hold."""
    cfg = ScheduleConfig(warmup_steps=2, decay="linear", decay_start_step=50)
    opt = two_groups()
    [sched] = build_schedulers([opt], cfg, total_steps=60)
    for _ in range(5):
        opt.step(), sched.step()
    assert lr_values(opt) == [0.5, 0.03]
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 9.0
    opt.load_state_dict(saved)
    opt.param_groups[1]["lr"] = torch.tensor(7.0)
    opt.step(), sched.step()
    assert lr_values(opt) == [0.5, pytest.approx(0.03)] and isinstance(opt.param_groups[1]["lr"], torch.Tensor)


def test_a_scheduler_state_round_trip_stands_at_the_saved_step():
    """load_state_dict (a resume) sets every group at once, skip record or not, and the state_dict has no record of
    the written objects."""
    cfg = SCHEDULES["warm-up, hold, linear"]
    opt = two_groups()
    [sched] = build_schedulers([opt], cfg, total_steps=30)
    to_tensor_lrs(opt)
    for _ in range(11):
        opt.step(), sched.step()
    state = sched.state_dict()
    assert "_written" not in state and state["last_epoch"] == 11
    other_opt = two_groups()
    [other] = build_schedulers([other_opt], cfg, total_steps=30)
    to_tensor_lrs(other_opt)
    with _Ops() as ops:
        other.load_state_dict(state)
    assert ops.names["aten.fill_.Scalar"] == 2 and lr_values(other_opt) == lr_values(opt)
    for _ in range(3):
        opt.step(), sched.step(), other_opt.step(), other.step()
        assert lr_values(other_opt) == lr_values(opt)


def fused_stand_in(lr: float) -> FusedSparseOptimizer:
    """A FusedSparseOptimizer without an embedding: its param group and the kernel's lr tensor, as its __init__ sets
    them (only `load_lr` is exercised)."""
    opt = FusedSparseOptimizer.__new__(FusedSparseOptimizer)
    torch.optim.Optimizer.__init__(opt, [torch.nn.Parameter(torch.zeros(2))], {"lr": lr})
    opt.fused = types.SimpleNamespace(lr=torch.tensor([lr], dtype=torch.float32))
    opt._loaded_lr = lr
    return opt


def test_the_fused_optimizers_lr_is_copied_only_when_it_changes():
    """Unchanged, `load_lr` launches nothing; changed, one fill with the new value; `force` (a checkpoint's load)
    fills in any case."""
    opt = fused_stand_in(0.05)
    fills = []
    for lr in (0.05, 0.05, 0.025, 0.025, 0.01):
        opt.param_groups[0]["lr"] = lr
        with _Ops() as ops:
            opt.load_lr()
        fills.append(ops.names["aten.fill_.Scalar"])
        assert opt.fused.lr.tolist() == [pytest.approx(lr)]
    assert fills == [0, 0, 1, 0, 1]
    with _Ops() as ops:
        opt.load_lr(force=True)
    assert ops.names["aten.fill_.Scalar"] == 1


def test_a_fused_optimizers_load_writes_the_loaded_lr():
    """A real fused optimizer (Triton embedding, in the interpreter here) whose lr a checkpoint changes: the kernel's
    tensor holds the loaded lr after load_state_dict, and the next unchanged `load_lr` writes nothing."""
    from kernels.embedding import TritonSparseEmbedding

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    emb = TritonSparseEmbedding([5, 3], 4).to(device)
    opt = FusedSparseOptimizer(emb, "rowwise_adagrad", lr=0.1, eps=1e-8, deterministic=True)
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0]["lr"] = 0.25
    opt.load_state_dict(state)
    assert opt.fused.lr.tolist() == [0.25]
    with _Ops() as ops:
        opt.load_lr()
    assert ops.names["aten.fill_.Scalar"] == 0


@pytest.mark.gpu
def test_the_data_wait_timer_records_in_the_current_stream_without_a_device_lookup(monkeypatch):
    """On CUDA each fetch records its event in the current stream, named by the device's index: no
    `torch.cuda.is_available()` a fetch (a device count from the driver); a blocked fetch's span still measures the
    device's idle time, in the stream that was current."""
    timer = DataWaitTimer(torch.device("cuda"))
    calls = []
    real = torch.cuda.is_available
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or real())
        batch, waited = timer.fetch(lambda: "batch")  # (only the fetch counted: entering a stream context asks too)
        monkeypatch.setattr(torch.cuda, "is_available", real)
    assert (batch, waited) == ("batch", 0.0) and calls == []
    import time

    monkeypatch.setattr("dlrm.train.meter.BLOCKED_FETCH_S", 0.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or real())
    timer.fetch(lambda: time.sleep(0.01))
    monkeypatch.setattr(torch.cuda, "is_available", real)
    torch.cuda.synchronize()
    assert calls == [] and 0.005 < timer.take() < 5.0


def test_the_host_step_benchmark_times_each_call_of_a_real_run(tmp_path):
    """`benchmarks/host_step_costs.py` on the sample (one short run on the CPU): every per-step call the loop makes is
    timed once a step, the window's calls once a logging window, the tables and plot written; a bad --runs is one
    line and exit 2, before anything runs."""
    import csv
    import subprocess
    import sys

    from tests.conftest import REPO

    script = str(REPO / "benchmarks" / "host_step_costs.py")
    # on the CPU wherever the suite runs: on CUDA the steps are "graphed step" calls, and only the warm-up's go
    # through the ordinary step (the benchmark's GPU run: benchmarks/results/host_step_costs_h200.md)
    done = subprocess.run([sys.executable, script, "--runs", "1", "--out", str(tmp_path), "--name", "h", "--",
                           "--max-steps", "40", "--device", "cpu"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["call"]: r for r in csv.DictReader(open(tmp_path / "h.csv"))}
    for call, calls in (("ordinary step", 40), ("meter step", 40), ("load_lrs", 40), ("fetch", 40)):
        assert int(rows[call]["calls"]) == calls and float(rows[call]["mean_us"]) > 0, call
        assert int(rows[call]["later_calls"]) == 32, call  # those made after the first fifth of the 40 steps
    assert int(rows["scheduler step"]["calls"]) == 2 * 40 + 2  # two schedulers, each also stepped once when built
    assert int(rows["queue window"]["calls"]) == 2  # log_every 20 over 40 steps
    assert float(rows["fetch"]["interval_median_us"]) > 0 and float(rows["fetch"]["samples_per_s"]) > 0
    assert "| run | interval median us |" in (tmp_path / "h.md").read_text() and (tmp_path / "h.png").stat().st_size
    bad = subprocess.run([sys.executable, script, "--runs", "0", "--out", str(tmp_path / "x")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "--runs: 0 must be at least 1" in bad.stderr and not (tmp_path / "x").exists()


def test_the_host_step_summary_cuts_by_time_and_leaves_a_warm_up_only_call_out():
    """Calls are kept by when they were made (after the first fifth of the run's steps), not by their own count: a call
    made only in the warm-up (a graphed run's ordinary step: seconds of compiling) has no later calls and costs the
    steady step nothing, instead of its last calls spread over every step."""
    from tests.test_benchmark_scripts import load_script

    summarize = load_script("host_step_costs").summarize
    stamps = [float(i + 1) for i in range(10)]  # step i ends at i + 1 s
    raw = {"steps": 10, "stamps": stamps, "durations": {
        "warm-up only": [(0.1, 3.0), (1.1, 2.0)],  # steps 1 and 2 (the first fifth)
        "every step": [(i + 0.5, 1e-6 * (i + 1)) for i in range(10)],  # 1..10 us
        "never": [],
    }}
    loop, rows = summarize(raw)
    by = {r["call"]: r for r in rows}
    assert set(by) == {"warm-up only", "every step"}
    assert by["warm-up only"]["calls"] == 2 and by["warm-up only"]["later_calls"] == 0
    assert by["warm-up only"]["us_per_step"] == 0.0 and by["warm-up only"]["mean_us"] != by["warm-up only"]["mean_us"]
    every = by["every step"]
    assert every["later_calls"] == 8 and every["calls_per_step"] == 1.0  # steps 3..10: 3..10 us
    assert every["mean_us"] == pytest.approx(6.5) and every["median_us"] == pytest.approx(6.5)
    assert every["us_per_step"] == pytest.approx(6.5)
    assert loop["interval_median_us"] == pytest.approx(1e6) and loop["interval_mean_us"] == pytest.approx(1e6)
