"""A run that fails (a diverged loss, an error in a step) closes its TensorBoard writer: its event-writer thread and
open event file outlived the run, one more a failed trial in a sweep's process (a learning-rate sweep's diverged
trials), and the thread could still write into a directory the failure's cleanup removed."""

from __future__ import annotations

import threading

import pytest

from dlrm.config import config_from_dict
from dlrm.errors import NonFiniteLoss
from dlrm.train import trainer
from dlrm.train.trainer import train
from tests.conftest import make_dataset


def _writer_threads() -> int:
    return sum(1 for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread" and t.is_alive())


def _config(data, tb, name, **train_overrides):
    return config_from_dict({
        "data": {"path": str(data), "batch_size": 16},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "optim": {"dense": {"name": "sgd", "lr": 1e30}},
        "train": {"max_steps": 6, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False, "compile": False,
                  **train_overrides},
        "log": {"tb_dir": str(tb), "run_name": name},
    }, "test")


def test_a_diverged_run_closes_its_writer(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 96, "validation": 32}, row_group_size=16)
    before = _writer_threads()
    for i in range(2):  # as a sweep's trials, one process
        with pytest.raises(NonFiniteLoss):
            train(_config(tmp_path / "ds", tmp_path / "tb", f"r{i}"))
        assert _writer_threads() == before, f"trial {i}: its writer thread lives on"


def test_a_run_failing_before_its_first_step_closes_its_writer(tmp_path, monkeypatch):
    make_dataset(tmp_path / "ds", {"train": 96, "validation": 32}, row_group_size=16)

    def failing(*args, **kwargs):
        raise RuntimeError("profiler unavailable")

    monkeypatch.setattr(trainer, "make_profiler", failing)
    before = _writer_threads()
    with pytest.raises(RuntimeError, match="profiler unavailable"):
        train(_config(tmp_path / "ds", tmp_path / "tb", "r"))
    assert _writer_threads() == before
    assert not (tmp_path / "tb" / "r").exists()  # no step ran: the directory went, and no thread writes into it
