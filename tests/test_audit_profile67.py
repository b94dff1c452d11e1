"""Profiling as a user meets it (audit helper, profile67): the profiled steps kept out of samples/s, a trace file
never seen half-written under its final name, and the named ranges costing nothing while no profiler records."""

from __future__ import annotations

import json
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.profiler import ProfilerAction

from dlrm.config import ProfileConfig, load_config
from dlrm.train import profiling
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile67") / "ds"
    make_dataset(root, {"train": 640, "validation": 64}, row_group_size=80)
    return root


def tiny_config(dataset, tb, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tb), "data.batch_size": 32, "train.max_steps": 20,
            "train.log_every": 4, "train.eval_every": None, "train.device": "cpu", "train.baseline": False,
            "profile.enabled": False}
    return load_config(REPO / "configs" / "sample.json", {**base, **overrides})


# ---- the profiled steps are not the run's throughput ------------------------------------------------------


def test_the_windows_of_profiled_steps_are_left_out_of_samples_per_sec(dataset, tmp_path, monkeypatch):
    """The profiler's warmup and recording slow a step (a CPU step of the sample: 235 ms profiled against ~4 ms);
    here each such step sleeps 0.5 s more. Its window (steps 5-8) gets no TensorBoard rate, and summary.json's
    samples/s is the other windows'."""
    real_step = profiling._StepProfile.step

    def slow_step(self):
        if self.current_action in (ProfilerAction.WARMUP, ProfilerAction.RECORD):
            time.sleep(0.5)  # the profiler's overhead on the step just trained, as the loop times it
        return real_step(self)

    monkeypatch.setattr(profiling._StepProfile, "step", slow_step)
    prof = {"profile.enabled": True, "profile.wait": 4, "profile.warmup": 1, "profile.active": 2}
    s = train(tiny_config(dataset, tmp_path, **{"log.run_name": "p"}, **prof))
    run = tmp_path / "p"
    assert len(list(run.glob("*.pt.trace.json.gz"))) == 1
    ea = EventAccumulator(str(run))
    ea.Reload()
    rates = {e.step: e.value for e in ea.Scalars("train/samples_per_sec")}
    # the profiled window (steps 5-8): no point; nor step 4's, whose prof.step() starts the profiler (kineto's prepare,
    # `profiling.profiles_step`)
    assert set(rates) == {12, 16, 20}, rates
    # the steady state is the unprofiled windows' samples over their seconds (4 steps a window), not over the profiled
    # window's too (512 samples over 1 s and more)
    samples = {12: 128, 16: 128, 20: 128}
    expected = sum(samples.values()) / sum(n / rates[k] for k, n in samples.items())
    assert s["samples_per_sec"] == pytest.approx(expected, rel=1e-5)
    assert json.loads((run / "summary.json").read_text())["samples_per_sec"] == s["samples_per_sec"]


def test_a_run_too_short_to_record_a_step_starts_no_profiler(dataset, tmp_path, monkeypatch):
    """--max-steps 5 under the default schedule (wait 5, warmup 3, active 5): the profiler would record no step, yet it
    started, prepared in the prof.step() after step 5 (kineto's warm-up), and that step marked the run's one logging
    window profiled: the run said "it will profile no step", then "this session's samples/s is the profiler's" (no
    step was profiled: training's rate, without a TensorBoard point) and "this run wrote no trace". Now no profiler
    starts: one warning says so, and the window's rate is training's, a TensorBoard point and summary.json's."""
    from loguru import logger

    started = []
    real_start = profiling._StepProfile.start
    monkeypatch.setattr(profiling._StepProfile, "start", lambda self: (started.append(self), real_start(self))[1])
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        s = train(tiny_config(dataset, tmp_path, **{"log.run_name": "short", "train.max_steps": 5,
                                                    "train.log_every": 20, "profile.enabled": True}))
    finally:
        logger.remove(handle)
    assert s["steps"] == 5 and not started
    # (the sample's schedule warns of a run this short too: not the profiler's)
    assert [m for m in seen if "profil" in m or "samples/s" in m] == ["profiling: this run trains 5 steps, no more than the steps before the profiler records "
                    "(profile.wait 5 + profile.warmup 3 = 8): the profiler is not started and writes no trace; train "
                    "longer or shorten those"]
    run = tmp_path / "short"
    assert not list(run.glob("*.pt.trace.json*")) and not (run / "profile_step.md").exists()
    ea = EventAccumulator(str(run))
    ea.Reload()
    rates = {e.step: e.value for e in ea.Scalars("train/samples_per_sec")}
    assert list(rates) == [5]  # steps 4-5, after the 3 warm-up steps: training's rate, not kept apart as profiled
    assert s["samples_per_sec"] == pytest.approx(rates[5], rel=1e-6)


def test_a_session_whose_every_window_is_profiled_reports_those_windows_not_its_warmup(clock):
    """profile.repeat 0 with a cycle shorter than a window: no unprofiled window; samples/s is the profiled windows'
    (the rate a user gets from such a run, said in the log), not the whole loop's with its warm-up in. The warm-up is
    a 500 s jump of the clock the meter reads (a real 0.5 s sleep left the 4 real steps 0.25 s: a loaded machine's
    margin)."""
    meter = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=4, warmup_steps=1)
    clock(500)  # a warm-up step (compiling)
    meter.step(torch.tensor(0.5), samples=32, data_wait_s=0.0)
    for step in range(2, 6):
        meter.step(torch.tensor(0.5), samples=32, data_wait_s=0.0)
        meter.mark_profiled()
        if step == 4:
            meter.log_window(step, 0.5)
    meter.log_window(5, 0.5)
    meter.finish()
    assert meter.samples_per_sec > 96 / 250  # 4 steps in well under 250 s (was 160 samples over the 500 s too)
    assert meter.data_wait_fraction == 0.0


# ---- a trace file is whole under its name -----------------------------------------------------------------


class _Interrupted(Exception):
    pass


def _handler(tmp_path):
    prof = profiling.make_profiler(ProfileConfig(enabled=True, wait=0, warmup=1, active=1), tmp_path,
                                   torch.device("cpu"))
    return prof.on_trace_ready


def test_a_trace_save_interrupted_leaves_no_file_named_as_a_trace(tmp_path):
    """torch's handler gzips the trace straight into its final name (a long trace: seconds to half a minute); a second
    Ctrl-C then (the stop "at once"), or a full disk, left a truncated ``*.pt.trace.json.gz`` that TensorBoard's
    profiler tab and benchmarks/trace_timeline.py (the newest trace) read as the run's and failed on; TensorBoard
    polling meanwhile saw it half-written."""

    class Stub:
        def export_chrome_trace(self, path, use_python_export=False):
            with open(path, "wb") as f:
                f.write(b"\x1f\x8b partial")
            raise _Interrupted()

    with pytest.raises(_Interrupted):
        _handler(tmp_path)(Stub())
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_saved_trace_keeps_torchs_name(tmp_path):
    """The name TensorBoard's profiler plugin and `own_trace` read: ``<host>_<pid>.<ns>.pt.trace.json.gz``, whole."""
    seen = []

    class Stub:
        def export_chrome_trace(self, path, use_python_export=False):
            seen.append(path)
            with open(path, "wb") as f:
                f.write(b"{}")

    _handler(tmp_path)(Stub())
    (trace,) = tmp_path.iterdir()
    assert trace.name.endswith(".pt.trace.json.gz") and profiling.own_trace(tmp_path) == trace
    assert not seen[0].endswith(".pt.trace.json.gz")  # written under another name first
    assert trace.read_bytes() == b"{}"


# ---- the named ranges cost nothing while no profiler records ----------------------------------------------


def _ranges_entered(monkeypatch, run) -> list[str]:
    entered = []
    real_enter = torch.autograd.profiler.record_function.__enter__

    def counting_enter(self):
        entered.append(self.name)
        return real_enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", counting_enter)
    run()
    return entered


@pytest.fixture(scope="module")
def model():
    from dlrm.config import ModelConfig
    from dlrm.model.dlrm import build_model

    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
    return build_model(cfg, [11] * 26, log_kernels=False)


def test_an_unprofiled_forward_enters_no_named_range(model, monkeypatch):
    """Each record_function entered costs 5-9 us of host time with no profiler at all: nine a training step, in every
    run (the trainer already named its "data" range only for --profile)."""
    dense, sparse = torch.randn(8, 13), torch.randint(0, 11, (8, 26))
    assert _ranges_entered(monkeypatch, lambda: model(dense, sparse)) == []  # was SparseArch, DenseArch, ...


def test_a_recorded_forward_still_names_every_arch(model):
    dense, sparse = torch.randn(8, 13), torch.randint(0, 11, (8, 26))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(dense, sparse)
    names = {e.name for e in prof.events()}
    assert {"SparseArch", "DenseArch", "InteractionArch", "OverArch"} <= names


def test_a_trace_temporary_left_by_a_kill_does_not_block_a_restart(tmp_path):
    """A session killed while it saved its first trace (before any checkpoint) leaves the trace's temporary file: a
    --resume restarts such a run from step 0, as it does with a whole trace there."""
    from dlrm.train.run_dir import restart_leftovers

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / ".vm_12.1796210237128390482.pt.trace.json.gz.ab_c1234.tmp.gz").write_bytes(b"\x1f\x8b")
    assert restart_leftovers(tmp_path) is not None


# ---- an evaluation inside the profiled steps is not the step reported ------------------------------------------


def test_the_reported_step_is_not_one_holding_an_evaluation():
    from dlrm.train.trace_summary import profiled_step

    def ev(name, ts, dur):
        return {"name": name, "cat": "user_annotation", "ph": "X", "ts": ts, "dur": dur}

    events = [ev("ProfilerStep#1", 0, 10), ev("backward", 2, 3),
              ev("ProfilerStep#2", 10, 500), ev("evaluation", 11, 480), ev("backward", 495, 3)]
    assert profiled_step(events)["name"] == "ProfilerStep#1"  # was ProfilerStep#2: the evaluation and a step
    only = [ev("ProfilerStep#2", 10, 500), ev("evaluation", 11, 480), ev("backward", 495, 3)]
    assert profiled_step(only)["name"] == "ProfilerStep#2"  # none without one: the last, as before


def test_a_profiled_run_evaluating_among_its_recorded_steps_reports_a_training_step(dataset, tmp_path):
    """train.eval_every inside the recorded steps (the defaults' steps 9-13 with eval_every 10, say): the evaluation
    after step 5 here runs inside ProfilerStep#5 with step 6's training, and profile_step.md and TensorBoard's
    profile/step_breakdown reported that as "one training step" (the sample's: 380 ms against 9-18 ms, the
    evaluation's forwards as InteractionArch and OverArch). The trace names the evaluation; the report is of step 5."""
    prof = {"profile.enabled": True, "profile.wait": 2, "profile.warmup": 1, "profile.active": 3}
    train(tiny_config(dataset, tmp_path, **{"log.run_name": "e", "train.eval_every": 5, "train.max_steps": 8},
                      **prof))
    report = (tmp_path / "e" / "profile_step.md").read_text()
    assert "step 5 (the trace's ProfilerStep#4):" in report, report[:300]  # was ProfilerStep#5, the evaluation's
    (trace,) = (tmp_path / "e").glob("*.pt.trace.json.gz")
    import gzip

    names = {e.get("name") for e in json.load(gzip.open(trace))["traceEvents"]}
    assert "evaluation" in names
