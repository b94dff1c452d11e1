"""The training loop's logging windows, read one step after their logging step (`Trainer._queue_window`): every
window's mean loss, learning rates and step are those of its own steps, not the step after: ``train/lr_*`` at step
s is the rate step s trained with."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import load_config
from dlrm.train import meter as meter_mod
from dlrm.train import optim as optim_mod
from dlrm.train import step as step_mod
from dlrm.train.trainer import train
from tests.conftest import make_dataset

CONFIG = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
              "schedule": {"warmup_steps": 6, "decay": "linear"}},
    "train": {"epochs": 1, "log_every": 4, "device": "cpu", "seed": 5},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("logwin") / "ds"
    make_dataset(root, {"train": 16 * 11, "validation": 32, "test": 16}, row_group_size=16)
    return root


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("eval_every", [None, 8])
def test_each_window_logs_its_own_steps_losses_and_learning_rates(tmp_path, dataset, monkeypatch, eval_every, device):
    """11 steps, a window every 4 (the last one of 3 steps), read one step late or, at an evaluation step, at once:
    the logged mean is the mean of the window's own losses; the learning rates are those its last step trained with
    (they move every step here, so the next step's rate, which the schedulers have set by the logging step, would
    differ). On CUDA the step is one CUDA graph, whose dense learning rate is a device tensor."""
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(dataset)
    raw["train"].update({"eval_every": eval_every, "device": device})
    if device == "cuda":
        raw["train"].update({"cuda_graph": True, "compile": {"enabled": False}})
        raw["kernels"] = {"embedding": "triton"}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path / "c.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "w"})
    losses = []
    original = meter_mod.StepMeter.step

    def recorded(self, loss, samples, data_wait_s):
        losses.append(float(loss))  # a host sync a step: the test's, not the trainer's
        original(self, loss, samples, data_wait_s)

    monkeypatch.setattr(meter_mod.StepMeter, "step", recorded)
    rates = record_trained_lrs(monkeypatch)
    summary = train(cfg)
    trained = pairs(rates)
    assert summary["steps"] == 11 and len(losses) == 11
    # the rates the steps trained with: this schedule's, worked out by hand
    # flattened: pytest.approx compares a list of tuples exactly (a captured step's dense rate is a float32 tensor)
    assert flat(trained) == pytest.approx(flat([(0.01 * m, 0.05 * m) for m in MULTIPLIERS]), rel=1e-6)
    events = EventAccumulator(str(tmp_path / "tb" / "w"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    windows = {4: losses[0:4], 8: losses[4:8], 11: losses[8:11]}
    assert sorted(logged) == sorted(windows)
    for step, own in windows.items():
        assert logged[step] == pytest.approx(sum(own) / len(own), rel=1e-6), step
    for k, tag in enumerate(("train/lr_dense", "train/lr_sparse")):
        by_step = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(by_step) == sorted(windows)
        for step in windows:  # step s (1-based) trained with the rate of schedule step s - 1 (0-based)
            assert by_step[step] == pytest.approx(trained[step - 1][k], rel=1e-6), (tag, step)


# optim.schedule of CONFIG over its 11 steps, worked out by hand (not with dlrm.train.optim): step k (0-based) of the
# 6-step warm-up trains at (k + 1) / 6; the linear decay from step 0 (decay_start_step) to the run's end, end factor
# 0, is at 1 - k / 11 from the warm-up's end on. Every step's differs from the next one's.
MULTIPLIERS = [1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 6 / 6, 1 - 6 / 11, 1 - 7 / 11, 1 - 8 / 11, 1 - 9 / 11, 1 - 10 / 11]


def record_trained_lrs(monkeypatch) -> list[float]:
    """Each step's learning rates, read from each optimizer's group just before its scheduler steps after the step
    (the rate the step trained with; a captured step's dense one is a device tensor, read here with a sync of the
    test's own). The trainer steps the dense then the sparse scheduler: `pairs` makes them (dense, sparse)."""
    rates = []
    original = optim_mod.ScheduledLR.step

    def recorded(self, epoch=None):
        if self._step_count:  # (0: the step LambdaLR takes as it is built, before any training step)
            rates.append(float(self.optimizer.param_groups[0]["lr"]))
        original(self, epoch)

    monkeypatch.setattr(optim_mod.ScheduledLR, "step", recorded)
    return rates


def pairs(rates: list[float]) -> list[tuple[float, float]]:
    assert len(rates) % 2 == 0
    return list(zip(rates[0::2], rates[1::2]))


def flat(pairs: list[tuple[float, float]]) -> list[float]:
    return [value for pair in pairs for value in pair]


def test_a_resumed_session_continues_the_learning_rate_curve(tmp_path, dataset, monkeypatch):
    """A run stopped at step 5 (train.max_steps) and resumed to its end logs the rates steps 6-11 trained with at
    steps 6-11: every step's point once, the uninterrupted run's curve, none doubled or skipped at the resume. (The
    decay's length is its own, 11 steps, as CONFIG's to the run's end: the run's length may then change.)"""
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(dataset)
    raw["train"]["log_every"] = 1
    raw["optim"]["schedule"]["decay_steps"] = 11
    (tmp_path / "c.json").write_text(json.dumps(raw))
    overrides = {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r"}
    assert train(load_config(tmp_path / "c.json", {**overrides, "train.max_steps": 5}))["steps"] == 5
    rates = record_trained_lrs(monkeypatch)
    assert train(load_config(tmp_path / "c.json", overrides), resume="latest")["steps"] == 11
    assert flat(pairs(rates)) == pytest.approx(flat([(0.01 * m, 0.05 * m) for m in MULTIPLIERS[5:]]), rel=1e-6)
    events = EventAccumulator(str(tmp_path / "tb" / "r"))
    events.Reload()
    for base, tag in ((0.01, "train/lr_dense"), (0.05, "train/lr_sparse")):
        points = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in points] == list(range(1, 12)), tag
        assert [value for _, value in points] == pytest.approx([base * m for m in MULTIPLIERS], rel=1e-6), tag


def test_windows_are_read_after_the_next_step_is_queued(tmp_path, dataset, monkeypatch):
    """The read of a logging window happens after the next step was launched (one step late), except at the end."""
    from dlrm.train import trainer as trainer_mod

    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(dataset)
    (tmp_path / "c.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path / "c.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "late"})
    order = []
    step, log = step_mod.TrainStep.__call__, trainer_mod.Trainer._log_window
    monkeypatch.setattr(step_mod.TrainStep, "__call__", lambda self, b: (order.append("step"), step(self, b))[1])
    monkeypatch.setattr(trainer_mod.Trainer, "_log_window",
                        lambda self, bar: (order.append(f"read {self._pending[0].step}"), log(self, bar))[1])
    train(cfg)
    reads = [(i, e) for i, e in enumerate(order) if e.startswith("read")]
    assert [e for _, e in reads] == ["read 4", "read 8", "read 11"]
    steps_before = [order[:i].count("step") for i, _ in reads]
    assert steps_before == [5, 9, 11]
