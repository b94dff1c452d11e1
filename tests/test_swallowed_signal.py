"""A SIGTERM whose `TrainingStopped` a library swallowed, during a run's start-up, still stops the run.

`StopAtOnce` raises `TrainingStopped` (an Exception) where the signal arrives. During the start-up that is often inside
a library's import or call, and code there that catches every error drops it: a SIGTERM to torchrun (a scheduler's)
that reached the ranks while they imported torch (torch's C init imports numpy and drops its failure; found with
`kill -TERM <torchrun>` 3.5 s after launch, 4 of 5 tries, and with `kill -TERM` of one process) was lost without a
line, and every rank trained on: a short run to its end (its summary written, exit 0), a long one until torchrun's
SIGKILL 30 s later, every step since its last checkpoint lost. Now the signal is remembered where it arrives
(`dlrm.stop_signal.take_pending`): one process stops at its start-up's end (no checkpoint, its new directory removed),
as a signal that was not swallowed does; several ranks agree on it with the start-up's agreement (`agreed_stop`),
also when one rank alone lost it; `--eval-only` stops before its summary (it evaluated, wrote its results and exited 0).

The library is stood in for by a wrapper around the trainer's first call (`build_for_data`, before the ranks meet)
that raises the signal and swallows whatever it raises: deterministic, where a real import's moment is not.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dlrm.config import load_config
from dlrm.errors import TrainingStopped
from dlrm.train import trainer as trainer_mod
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.fastdist_ranks import call_on_ranks

CONFIG = {
    "data": {"batch_size": 8, "shuffle": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 4, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}


def _config(root: Path, name: str, rank: int = 0):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(root / "ds")
    path = root / f"{name}.rank{rank}.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(root / "tb"), "log.run_name": name})


def _swallowing(build):
    """`build` as a library that swallows every error would run it, the SIGTERM arriving inside."""

    def wrapped(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGTERM)  # the handler runs here (the main thread), raising into the `try`
        except Exception:  # noqa: BLE001 - the library's catch-all: the stop's exception dropped
            pass
        return build(*args, **kwargs)

    return wrapped


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 48, "validation": 16}, row_group_size=16)
    return tmp_path


def test_one_process_stops_at_its_start_when_a_library_swallowed_the_sigterm(root, monkeypatch):
    """Before the fix the run trained all its steps and wrote its summary, as if no signal had come."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (StopAtOnce installs its handler over the default)
    monkeypatch.setattr(trainer_mod, "build_for_data", _swallowing(trainer_mod.build_for_data))
    with pytest.raises(TrainingStopped) as stopped:
        train(_config(root, "one"))
    assert (stopped.value.exit_code, str(stopped.value)) == (
        143, "SIGTERM: stopped before the first step (no checkpoint written now)")
    assert not (root / "tb" / "one").exists()  # a new run stopped before its first step leaves no directory
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers put back, nothing left pending
    monkeypatch.undo()
    assert train(_config(root, "after"))["steps"] == 6  # the next run in this process is not stopped by it


def _train_on_rank(rank: int, root: str, swallowed_on: tuple, results: dict) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    if rank in swallowed_on:
        trainer_mod.build_for_data = _swallowing(trainer_mod.build_for_data)
    try:
        train(_config(Path(root), "dist", rank))
        results[(rank, "outcome")] = "trained"
    except TrainingStopped as e:
        results[(rank, "outcome")] = (e.exit_code, str(e))


def _outcomes(root: Path, swallowed_on: tuple) -> dict:
    got, codes = call_on_ranks(_train_on_rank_worker, (str(root), swallowed_on), 2, root, timeout=300)
    assert codes == [0, 0], (codes, got)
    return got


def _train_on_rank_worker(rank: int, root: str, swallowed_on: tuple, results: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    try:
        _train_on_rank(rank, root, swallowed_on, results)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("swallowed_on", [(0, 1), (1,)], ids=["every-rank", "rank-1-alone"])
def test_ranks_agree_on_a_sigterm_a_library_swallowed_before_they_met(root, swallowed_on):
    """Before the fix every rank trained to the end (the SIGTERM lost: torchrun's SIGKILL would come 30 s later)."""
    got = _outcomes(root, swallowed_on)
    stopped = (143, "SIGTERM: stopped before the first step, on every rank (no checkpoint written now)")
    assert [got.get((rank, "outcome")) for rank in (0, 1)] == [stopped, stopped], got
    assert not (root / "tb" / "dist").exists()


def test_eval_only_is_stopped_by_a_sigterm_a_library_swallowed(root, monkeypatch):
    """`--eval-only` (`evaluate_checkpoint`): before the fix it evaluated, wrote its run directory and summary and
    returned (exit 0) as if no signal had come; now it stops as a signal that was not swallowed stops it."""
    from dlrm.stop_signal import StopAtOnce
    from dlrm.train.export import evaluate_checkpoint

    trained = train(_config(root, "src"))
    monkeypatch.setattr(trainer_mod, "build_for_data", _swallowing(trainer_mod.build_for_data))
    cfg = _config(root, "eval")
    with pytest.raises(TrainingStopped) as stopped, StopAtOnce():  # (train.py's guard, `dlrm.cli.main`)
        evaluate_checkpoint(cfg, Path(trained["checkpoint"]), "validation")
    assert (stopped.value.exit_code, str(stopped.value)) == (
        143, f"--eval-only: SIGTERM stopped the evaluation of {trained['checkpoint']}; nothing written")
    assert sorted(p.name for p in (root / "tb").iterdir()) == ["src"]  # no evaluation's run directory left


def test_one_process_stops_at_its_first_step_when_the_sigterm_was_swallowed_after_its_start(root, monkeypatch):
    """Swallowed between the start-up and the training loop (the run's event file opened: TensorBoard's writer): the
    loop's guard takes it (`GracefulStop`), the first step is checkpointed and the run stops, 143. Before the fix the
    loop's guard set its signal from the run's held one (none, in one process) and the run trained to its end."""
    from dlrm.stop_signal import StopAtOnce

    monkeypatch.setattr(trainer_mod, "open_writer", _swallowing(trainer_mod.open_writer))
    with pytest.raises(TrainingStopped) as stopped, StopAtOnce():
        train(_config(root, "loop"))
    assert stopped.value.exit_code == 143, str(stopped.value)
    assert sorted(p.name for p in (root / "tb" / "loop" / "checkpoints").glob("step-*.pt")) == ["step-00000001.pt"]
