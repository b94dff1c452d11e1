"""The numbers a user looks at (audit helper): a short session's samples/s without the final evaluation's and
checkpoint's seconds, and a profile summary that is a trained step, not the loop's tail after it."""

from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import record_function

from dlrm.config import ProfileConfig, load_config
from dlrm.train import evaluator as evaluator_mod
from dlrm.train import trace_summary as ts
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.profiling import make_profiler, own_trace
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbers52") / "ds"
    make_dataset(root, {"train": 320, "validation": 64}, row_group_size=80)
    return root


def tiny_config(dataset, tb, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tb), "data.batch_size": 32, "train.max_steps": 2,
            "train.log_every": 3, "train.device": "cpu", "train.baseline": False, "profile.enabled": False}
    return load_config(REPO / "configs" / "sample.json", {**base, **overrides})


# ---- samples/s of a session too short for a steady window ------------------------------------------


def test_a_short_sessions_rate_leaves_out_pauses_and_the_time_after_the_loop(clock):
    """No window closes after the warm-up: samples/s is the session's own training, not its evaluations,
    checkpoints, nor the final evaluation and checkpoint made after `finish` (summary.json is written after them).
    The pauses are jumps of the clock the meter reads, far longer than the steps on any machine."""
    meter = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=10)
    meter.step(torch.tensor(0.5), samples=32, data_wait_s=0.0)
    with meter.paused():  # a mid-run evaluation
        clock(200)
    meter.step(torch.tensor(0.5), samples=32, data_wait_s=0.0)
    meter.finish()
    clock(300)  # the last evaluation, checkpoint and profile summary, before summary.json
    # 64 samples in well under 10 s of training (was 64 / 500 s, about 0.13 samples/s)
    assert meter.samples_per_sec > 64 / 10


def test_a_two_step_runs_summary_rate_is_not_its_final_evaluation(dataset, tmp_path, monkeypatch):
    real = evaluator_mod.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(0.6)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluator_mod, "evaluate", slow_evaluate)
    s = train(tiny_config(dataset, tmp_path, **{"log.run_name": "short"}))
    assert s["steps"] == 2 and s["samples"] == 64
    # the training loop took s["train_s"] (frozen when it ended); the final evaluation's 0.6 s came after
    assert s["samples_per_sec"] >= 0.9 * s["samples"] / s["train_s"]  # was 64 / (0.6 s + ...): ~95 samples/s


# ---- the profiled step is a trained step --------------------------------------------------------------


def profiled_loop(run_dir, steps: int, cfg: ProfileConfig, planned: int | None = None):
    """`steps` steps as the trainer runs them (data, forward, backward, then prof.step()), then a tail of work after
    the loop inside the profiler (the trainer's last window read, bar.close, meter.finish). `planned`: the steps the
    session was to train (`steps` unless it stopped early)."""
    model = torch.nn.Linear(8, 1)
    with make_profiler(cfg, run_dir, torch.device("cpu"), planned or steps) as prof:
        for _ in range(steps):
            with record_function("data"):
                x = torch.randn(4, 8)
            loss = model(x).sum()
            with record_function("backward"):
                loss.backward()
            prof.step()
        torch.ones(64, 64).mm(torch.ones(64, 64))  # the loop's tail: no training step
    return own_trace(run_dir)


def test_a_run_of_wait_plus_warmup_steps_writes_no_trace_of_its_tail(tmp_path):
    """Two steps with wait 1, warmup 1, of a run planned longer (stopped early: a signal, early stopping; one planned
    so short gets no profiler, `make_profiler`): the profiler's last step() opened ProfilerStep#2 on the loop's tail,
    and its exit saved it: log_profile reported that tail as "one training step" (100% "other")."""
    assert profiled_loop(tmp_path, 2, ProfileConfig(enabled=True, wait=1, warmup=1, active=3), planned=10) is None


def test_a_short_runs_trace_still_holds_its_active_steps(tmp_path):
    trace = profiled_loop(tmp_path, 3, ProfileConfig(enabled=True, wait=1, warmup=1, active=3))
    assert trace is not None and ts.summarize_step(ts.load_trace(trace)).step == "ProfilerStep#2"


def test_a_run_of_wait_plus_warmup_steps_in_a_second_cycle_writes_no_tail_trace(tmp_path):
    """repeat 2, wait 0 and warmup 0: the first cycle's trace is saved; a run ending as the second cycle starts
    recorded only the tail there."""
    cfg = ProfileConfig(enabled=True, wait=0, warmup=0, active=1, repeat=2)
    profiled_loop(tmp_path, 1, cfg)
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 1  # step 0's, not a second one of the tail


def ev(name, cat, ts_, dur):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts_, "dur": dur, "pid": 1, "tid": 1}


def test_without_a_backward_range_the_profiled_step_is_the_last_that_holds_a_named_range():
    """A captured CUDA graph step (train.cuda_graph) shows no backward range, only the trainer's data range: a run
    ending inside the active steps leaves the loop's tail as the last ProfilerStep, which was taken as the step."""
    events = [ev("ProfilerStep#8", "user_annotation", 0, 100), ev("data", "user_annotation", 0, 10),
              ev("cudaGraphLaunch", "cuda_runtime", 20, 5),
              ev("ProfilerStep#9", "user_annotation", 100, 100), ev("data", "user_annotation", 100, 10),
              ev("cudaGraphLaunch", "cuda_runtime", 120, 5),
              ev("ProfilerStep#10", "user_annotation", 200, 900), ev("aten::item", "cpu_op", 300, 50)]
    assert ts.profiled_step(events)["name"] == "ProfilerStep#9"  # was ProfilerStep#10, the tail
    assert ts.summarize_step({"traceEvents": events}).ranges[0].name == "data"


def test_a_profiled_run_of_wait_plus_warmup_steps_writes_no_step_breakdown(dataset, tmp_path):
    prof = {"profile.enabled": True, "profile.wait": 1, "profile.warmup": 1, "profile.active": 2}
    train(tiny_config(dataset, tmp_path, **{"log.run_name": "p"}, **prof))
    run = tmp_path / "p"
    assert (run / "summary.json").is_file()
    assert not list(run.glob("*.pt.trace.json*")) and not (run / "profile_step.md").exists()  # was a tail "step"


# ---- an evaluation split without rows -----------------------------------------------------------------


def test_an_empty_evaluation_split_is_one_dataset_error_before_training(tmp_path):
    """It was torch.cat's ValueError traceback at the run's last evaluation, after all the training, before the
    last checkpoint (the training since the last checkpoint lost)."""
    from dlrm.errors import DatasetError

    root = tmp_path / "ds"
    make_dataset(root, {"train": 128, "validation": 0}, row_group_size=64)
    with pytest.raises(DatasetError, match=r"validation.*holds no rows"):
        train(tiny_config(root, tmp_path / "tb", **{"log.run_name": "e", "train.max_steps": 4}))
    assert not (tmp_path / "tb" / "e").exists()  # no step trained: the run directory removed


def test_evaluating_an_empty_loader_is_a_dataset_error():
    from dlrm.errors import DatasetError
    from dlrm.train.evaluator import evaluate

    forward = lambda batch: batch  # never called
    forward.model = torch.nn.Linear(1, 1)
    with pytest.raises(DatasetError, match="holds no rows"):
        evaluate(forward, [])


# ---- a trace that is JSON but not a profiler's -----------------------------------------------------------


@pytest.mark.parametrize("event", [
    {"name": "aten::mm", "ph": "X", "cat": "cpu_op", "ts": 5},  # no dur
    {"name": "ProfilerStep#1", "ph": "X", "cat": "user_annotation", "ts": "0", "dur": "10"},  # strings
    {"name": "k", "ph": "X", "cat": "kernel", "ts": 0, "dur": 10, "args": [1]},  # args not an object
])
def test_a_foreign_trace_is_a_trace_error_naming_the_file(tmp_path, event):
    """trace_timeline.py said a KeyError, TypeError or AttributeError traceback for these (it catches TraceError)."""
    import json

    path = tmp_path / "f.pt.trace.json"
    step = {"name": "ProfilerStep#2", "ph": "X", "cat": "user_annotation", "ts": 0, "dur": 100}
    path.write_text(json.dumps({"traceEvents": [step, event]}))
    with pytest.raises(ts.TraceError, match="f.pt.trace.json"):
        ts.summarize_step(ts.load_trace(path))
