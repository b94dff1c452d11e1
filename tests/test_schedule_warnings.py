"""A learning-rate schedule whose decay starts at or after the run's last step, or whose warm-up is longer than the
run, is said at the start (`dlrm.train.optim.build_schedulers`): accepted, it had no effect (the decay never began;
the warm-up never reached the configured rate), without a word."""

from __future__ import annotations

import pytest
import torch
from loguru import logger

from dlrm.config import ScheduleConfig
from dlrm.train.optim import build_schedulers


@pytest.fixture
def warnings():
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handle)


def _optimizers():
    return [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)]


@pytest.mark.parametrize("start", [100, 150])
def test_a_decay_that_never_starts_is_said(warnings, start):
    build_schedulers(_optimizers(), ScheduleConfig(decay="linear", decay_start_step=start), 100)
    assert warnings == [f"optim.schedule.decay_start_step {start} is at or after this run's end (step 100): the "
                        "linear decay never starts"]


def test_a_warm_up_longer_than_the_run_is_said(warnings):
    build_schedulers(_optimizers(), ScheduleConfig(warmup_steps=400), 100)
    assert warnings == ["optim.schedule.warmup_steps 400 is longer than this run (100 steps): it ends at 25% of the "
                        "learning rate"]


@pytest.mark.parametrize("schedule", [ScheduleConfig(decay="cosine", decay_start_step=99), ScheduleConfig(warmup_steps=100),
                                      ScheduleConfig()])
def test_a_schedule_that_acts_is_not_warned_about(warnings, schedule):
    build_schedulers(_optimizers(), schedule, 100)
    assert warnings == []


@pytest.mark.parametrize("warmup, steps, share", [(200, 1, "0.5%"), (201, 200, "99.5%"), (3000, 2, "0.1%"), (30000, 2, "0.01%")])
def test_a_warm_up_share_is_never_rounded_to_0_or_100_percent(warnings, warmup, steps, share):
    """The share was formatted with no decimals: a 1-step run of MLPerf's 200-step warm-up (the README's DCN config on
    a tiny split) was told its warm-up "ends at 0% of the learning rate", as if it trained at none."""
    build_schedulers(_optimizers(), ScheduleConfig(warmup_steps=warmup), steps)
    assert warnings == [f"optim.schedule.warmup_steps {warmup} is longer than this run ({steps} step"
                        f"{'s' if steps > 1 else ''}): it ends at {share} of the learning rate"]
