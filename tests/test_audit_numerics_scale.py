"""Audit of large-count arithmetic: buffers sized by a count, index dtypes chosen by a size. Each expectation is
computed here.

* `train.log_every` has no upper bound (any positive int): a run that logs only at its end sets it beyond the run's
  length (1e9, 1e12). The logging window's device buffer (`dlrm.train.meter.LossWindow`) held one float32 slot for
  each step of `log_every`, allocated at once: 4 GB of device memory at 1e9 for a run of a few steps, and at 1e12 a
  4 TB allocation that stopped the run before its first step with "out of host memory ... retry with a smaller
  data.batch_size", the wrong cause.
* (The sorted update's rows past 2**31: tests/kernels/test_update_wide_rows.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from dlrm.config import load_config
from dlrm.train.meter import LossWindow, RunStats, StepMeter
from dlrm.train.trainer import train
from tests.conftest import make_dataset

HUGE = 10**12  # a log_every no run reaches: 4 TB as one float32 a step


def test_a_loss_window_beyond_the_run_allocates_only_the_steps_it_holds():
    w = LossWindow(torch.device("cpu"), capacity=HUGE, first_step=7)
    losses = [0.25 + (i % 7) / 8 for i in range(3000)]  # past any first allocation: the buffer grows
    losses[2500] = float("nan")
    for x in losses:
        w.add(torch.tensor(x))
    assert w.n == 3000 and w.buf.numel() < 2 * 3000  # not HUGE floats
    assert w.values()[:2500] == losses[:2500] and w.values()[2501:] == losses[2501:]
    assert int(w.first_nonfinite_step()) == 7 + 2501
    w.reset(3007)
    w.preload([0.5, 0.75], 3009)  # a resumed run's carried losses
    w.add(torch.tensor(1.0))
    assert float(w.total()) == 2.25 and w.first_step == 3007


def test_a_step_meter_with_a_huge_log_every_logs_the_window_mean():
    meter = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=HUGE, warmup_steps=1)
    for x in (0.5, 0.25, 0.75):
        meter.step(torch.tensor(x), samples=8, data_wait_s=0.0)
    assert float(meter.losses.total()) / meter.losses.n == pytest.approx(0.5)
    meter.log_window(step=3, mean_loss=0.5)
    assert meter.stats.train_losses == [[3, 0.5]] and meter.stats.samples == 24


def test_a_run_with_log_every_beyond_its_length_trains_and_logs_its_end(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 64, "validation": 16}, row_group_size=16)
    raw = {
        "data": {"path": str(root), "batch_size": 16},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "optim": {"dense": {"name": "sgd", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.01}},
        "train": {"epochs": 1, "log_every": HUGE, "eval_every": None, "device": "cpu", "seed": 1},
        "checkpoint": {"every": None},
    }
    (tmp_path / "c.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path / "c.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "huge"})
    summary = train(cfg)
    assert summary["steps"] == 4
    (step, loss), = summary["train_losses"]  # one window: the run's end
    assert step == 4 and loss == pytest.approx(summary["final_train_loss"]) and 0 < loss < 10
