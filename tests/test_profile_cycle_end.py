"""A profiler cycle that the run's end cuts short (profile.repeat 0, or > 1): a cycle that would record none of the
session's steps is not started, so the windows of the steps before the end keep their rate; one that records some of
them is said at the start, as the first cycle is.

The schedule here: wait 4, warmup 1, active 2 (a cycle of 7 steps), repeat 0; the loop's step k is the profiler's
step k - 1. Cycle 1 prepares in the prof.step() after step 4, warms up at step 5 and records steps 6-7; cycle 2 would
prepare after step 11, warm up at step 12 and record steps 13-14."""

from __future__ import annotations

import pytest
import torch
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import ProfileConfig, load_config
from dlrm.train import profiling
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset

SCHEDULE = {"profile.enabled": True, "profile.wait": 4, "profile.warmup": 1, "profile.active": 2,
            "profile.repeat": 0}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle_end") / "ds"
    make_dataset(root, {"train": 640, "validation": 64}, row_group_size=80)
    return root


def _run(dataset, tmp_path, monkeypatch, steps: int):
    """Train `steps` steps under SCHEDULE; returns (the TensorBoard samples/s points, the kineto prepares, the
    run's warnings and infos about profiling)."""
    prepares = []
    real = profiling._StepProfile.prepare_trace
    monkeypatch.setattr(profiling._StepProfile, "prepare_trace", lambda self: (prepares.append(self.step_num),
                                                                              real(self))[1])
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    try:
        base = {"data.path": str(dataset), "log.tb_dir": str(tmp_path), "log.run_name": "r", "data.batch_size": 32,
                "train.max_steps": steps, "train.log_every": 4, "train.eval_every": None, "train.device": "cpu",
                "train.baseline": False}
        train(load_config(REPO / "configs" / "sample.json", {**base, **SCHEDULE}))
    finally:
        logger.remove(handle)
    ea = EventAccumulator(str(tmp_path / "r"))
    ea.Reload()
    # (no point at all where every window was left out)
    points = ea.Scalars("train/samples_per_sec") if "train/samples_per_sec" in ea.Tags()["scalars"] else []
    rates = {e.step: e.value for e in points}
    return rates, prepares, [m for m in seen if m.startswith("profiling: this run")]


def test_a_cycle_the_last_step_would_start_is_not_started_and_its_window_keeps_its_rate(dataset, tmp_path,
                                                                                      monkeypatch):
    """--max-steps 11: the prof.step() after the last step started cycle 2 (kineto's prepare, then its exit: no
    trace), inside the last window (steps 9-11), which was marked profiled: no TensorBoard point, left out of
    summary.json's samples/s, though its steps ran with no profiler."""
    rates, prepares, said = _run(dataset, tmp_path, monkeypatch, 11)
    assert prepares == [4]  # cycle 1's only (was [4, 11])
    assert sorted(rates) == [11], rates  # windows 4 and 8 hold cycle 1's steps; 11 is training's
    assert len(list((tmp_path / "r").glob("*.pt.trace.json.gz"))) == 1
    assert said == []  # the run ends in cycle 2's wait: no cycle cut short


def test_a_cycle_that_would_only_warm_up_before_the_end_is_not_started_and_said_once(dataset, tmp_path, monkeypatch):
    """--max-steps 12: step 12 is cycle 2's warmup, and the run ends before it records: it slowed step 12 (its
    window 9-12 left out of samples/s) for no trace, said nowhere. As a first cycle that short is not started, this
    one is not, said at the start."""
    rates, prepares, said = _run(dataset, tmp_path, monkeypatch, 12)
    assert prepares == [4]
    assert sorted(rates) == [12], rates
    assert len(list((tmp_path / "r").glob("*.pt.trace.json.gz"))) == 1
    assert said == [("profiling: this run trains 12 steps, ending 5 steps into the profiler's cycle 2 (profile.wait 4 "
                     "+ profile.warmup 1 = 5 steps before it records): that cycle would record no step, so it is not "
                     "started")]


def test_a_later_cycle_cut_short_is_said_at_the_start_as_the_first_is(tmp_path):
    """steps 13: cycle 2 records step 13 only, its trace (the newest, the one the step breakdown reads) 1 of the 2
    active steps: the first cycle cut so is warned at the start; a later one was not."""
    cfg = ProfileConfig(enabled=True, wait=4, warmup=1, active=2, repeat=0)
    seen: list[str] = []
    handle = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        profiling.make_profiler(cfg, tmp_path, torch.device("cpu"), steps=13)
        assert [s.strip() for s in seen] == [(
            "profiling: this run trains 13 steps, ending 6 steps into the profiler's cycle 2 (profile.wait 4 + "
            "profile.warmup 1 + profile.active 2 = 7): its trace, the one the step breakdown reads, will hold only 1 "
            "of the 2 active step(s); 1 step more would make it whole")]
        seen.clear()
        # repeat 2: the same; repeat 1 ends the cycles before step 13, whole cycles (14 steps) or the end in a wait
        # (11): nothing to say
        profiling.make_profiler(ProfileConfig(enabled=True, wait=4, warmup=1, active=2, repeat=2), tmp_path,
                                torch.device("cpu"), steps=13)
        assert len(seen) == 1 and "cycle 2" in seen[0]
        seen.clear()
        profiling.make_profiler(ProfileConfig(enabled=True, wait=4, warmup=1, active=2, repeat=1), tmp_path,
                                torch.device("cpu"), steps=13)
        profiling.make_profiler(cfg, tmp_path, torch.device("cpu"), steps=14)
        profiling.make_profiler(cfg, tmp_path, torch.device("cpu"), steps=11)
        assert seen == []
    finally:
        logger.remove(handle)


def test_the_session_schedule_leaves_only_cycles_that_record_a_step():
    """wait 1, warmup 1, active 2, repeat 0 over 9 steps: cycles 1 and 2 whole, cycle 3 (steps 8-) would warm up at
    the session's step 9 (index 9, past its end) and record nothing: NONE; under no session length, torch's own."""
    from torch.profiler import ProfilerAction as A

    cfg = ProfileConfig(enabled=True, wait=1, warmup=1, active=2, repeat=0)
    fn = profiling.session_schedule(cfg, 9)
    cycle = [A.NONE, A.WARMUP, A.RECORD, A.RECORD_AND_SAVE]
    assert [fn(n) for n in range(12)] == cycle * 2 + [A.NONE] * 4
    # 11 steps: cycle 3 records index 10 (its trace cut short, said at the start), and its index 11 is the tail
    assert [fn(n) for n in range(12)] != [profiling.session_schedule(cfg, 11)(n) for n in range(12)]
    assert [profiling.session_schedule(cfg, 11)(n) for n in range(12)] == cycle * 3
    assert [profiling.session_schedule(cfg, None)(n) for n in range(12)] == cycle * 3
