"""The training loop's logging windows, read one step after their logging step (`Trainer._queue_window`): every
window's mean loss, learning rates and step are those of its own steps, not the step after."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import load_config
from dlrm.train import meter as meter_mod
from dlrm.train import step as step_mod
from dlrm.train.optim import lr_multiplier
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
    the logged mean is the mean of the window's own losses; the learning rates are those the schedulers set after its
    last step (they move every step here, so a rate read a step late would differ). On CUDA the step is one CUDA
    graph, whose learning rates are device tensors copied with the window."""
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
    summary = train(cfg)
    assert summary["steps"] == 11 and len(losses) == 11
    events = EventAccumulator(str(tmp_path / "tb" / "w"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    windows = {4: losses[0:4], 8: losses[4:8], 11: losses[8:11]}
    assert sorted(logged) == sorted(windows)
    for step, own in windows.items():
        assert logged[step] == pytest.approx(sum(own) / len(own), rel=1e-6), step
    schedule = cfg.optim.schedule
    for tag, group in (("train/lr_dense", "dense"), ("train/lr_sparse", "sparse")):
        by_step = {e.step: e.value for e in events.Scalars(tag)}
        for step in windows:
            want = CONFIG["optim"][group]["lr"] * lr_multiplier(step, schedule, 11)
            assert by_step[step] == pytest.approx(want, rel=1e-6, abs=1e-9), (tag, step)
    assert all(lr_multiplier(s, schedule, 11) != pytest.approx(lr_multiplier(s + 1, schedule, 11)) for s in (4, 8))


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
