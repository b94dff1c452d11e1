"""Integration review of session 59's merged patches, where they meet: warnings that patches added while another made
torchrun's other ranks leave out the ones every rank makes alike (`run_logger`) were still said once a rank; the
HParams replacement's message gave an integer setting read back from the event file as a float; a sharded (torchrun)
checkpoint was never named in the log; a sweep's resumed trial said (and recorded in summary.json's sessions) a
change of its own run directory's name that nobody made."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from loguru import logger

from dlrm.config import Config
from dlrm.logging_setup import configure_logging
from dlrm.train.resume_policy import check_resume_config


@pytest.fixture(autouse=True)
def _restore_logging():
    """Tests here point loguru at their own streams: back to the process's stderr afterwards."""
    yield
    configure_logging()


def _rank_console(monkeypatch, rank: int) -> io.StringIO:
    """configure_logging as a torchrun rank of two starts it (RANK, WORLD_SIZE); what it writes."""
    out = io.StringIO()
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging(ranks=True)  # (train.py's)
    return out


@pytest.fixture
def messages():
    """The text of every record logged during the test (any level)."""
    seen: list[str] = []
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="DEBUG")
    yield seen
    logger.remove(sink)


# -- (1) run-wide warnings said again by rank 1 ---------------------------------------------------------------------


def test_a_resumes_less_frequent_checkpoints_are_said_by_rank_0_only(monkeypatch):
    """`torchrun ... --resume` without the first command line's --checkpoint-every: every rank checks the same configs,
    and rank 1 said the warning again (`[rank 1] ... WARNING --resume: checkpoint.every 30 -> null ...`)."""
    saved = Config().to_dict()
    saved["checkpoint"]["every"] = 30
    current = Config().to_dict()
    for rank in (1, 0):
        out = _rank_console(monkeypatch, rank)
        check_resume_config(saved, current, (), "step-00000060.pt")
        said = out.getvalue().count("checkpoint.every 30 -> null: this session checkpoints only at a signal")
        assert said == (rank == 0), (rank, out.getvalue())
        assert "[rank 1]" not in out.getvalue()


def test_a_loader_run_out_is_said_by_rank_0_only(monkeypatch):
    """The training loader ending before the run's last step: every rank's ends alike, and each said it."""
    from dlrm.train.trainer import Trainer

    for rank in (1, 0):
        out = _rank_console(monkeypatch, rank)
        queued = []
        trainer = SimpleNamespace(pos=SimpleNamespace(step=7, epoch=0), data=SimpleNamespace(total_steps=10),
                                  meter=SimpleNamespace(steps_done=7), cfg=SimpleNamespace(train=SimpleNamespace(
                                      log_every=5)), _queue_window=queued.append)
        Trainer._ran_out(trainer, "stop")
        assert queued == ["stop"]  # its last steps logged as a window, on every rank (the ranks agree through it)
        assert out.getvalue().count("the training loader ended at step 7") == (rank == 0), (rank, out.getvalue())


def test_an_optimizer_change_on_resume_is_said_by_rank_0_only(monkeypatch):
    """`--allow-config-change optim.dense.name`: every rank restores its shard, and each said the state starts
    afresh."""
    from dlrm.train.checkpointer import Checkpointer

    cfg = Config()
    cfg.optim.dense.name = "sgd"
    state = {"optimizers": [{}, {}], "config": {"optim": {"dense": {"name": "adam"}}}}
    for rank in (1, 0):
        out = _rank_console(monkeypatch, rank)
        holder = SimpleNamespace(cfg=cfg)
        assert Checkpointer._fresh_optimizers(holder, state, Path("step-00000060.pt"), 2) == {0}
        assert out.getvalue().count("optim.dense.name changed from 'adam' to 'sgd'") == (rank == 0), out.getvalue()


# -- (2) the HParams replacement's message ---------------------------------------------------------------------------


def test_hparams_replacement_says_an_integer_setting_as_an_integer(tmp_path, messages):
    """A resume with another batch size said `batch_size 256.0 -> 128`: the earlier session's value read back from its
    event file (a float there, as every HParams number is)."""
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.train.reporting import log_hparams

    metrics = {"auc": 0.7, "logloss": 0.5, "accuracy": 0.75}
    cfg = Config()
    cfg.optim.dense.lr = 0.002
    with SummaryWriter(str(tmp_path)) as w:
        log_hparams(w, cfg, 256, metrics, 100)
    cfg.optim.dense.lr = 0.001
    with SummaryWriter(str(tmp_path), filename_suffix=".2") as w:
        log_hparams(w, cfg, 128, metrics, 200)
    said = [m for m in messages if m.startswith("TensorBoard HParams: the run shows this session's")]
    assert len(said) == 1 and "batch_size 256 -> 128" in said[0] and "dense_lr 0.002 -> 0.001" in said[0], said
    assert "256.0" not in said[0]


# -- (3) a sharded checkpoint named in the log -----------------------------------------------------------------------


def test_a_sharded_checkpoint_is_named_in_the_log_once(tmp_path, messages):
    """`torchrun --nproc-per-node 2 train.py --checkpoint-every 30`: a one-process run logs `checkpoint: <path>` at
    each save; a sharded run logged none (the user could not see a save happen, nor where it went)."""
    from tests.test_audit_checkpoint_files import save_sharded, tiny_state

    manifest = save_sharded(tmp_path, tiny_state(step=3))
    assert manifest.is_file()
    assert [m for m in messages if m.startswith("checkpoint: ")] == [f"checkpoint: {manifest}"], messages


# -- (4) a sweep's resumed trial: its own run directory said as a changed setting -----------------------------------


def test_a_sweep_trial_names_its_run_directory_in_its_config_from_its_first_session(tmp_path, messages):
    """A sweep stopped during a trial, then `--resume`d: the trial's first session recorded log.tb_dir "tb_logs" and
    log.run_name null, its resume named its directory, and the resume said "this session's own settings differ from
    the run's: log.run_name: null -> 'seed-0'; log.tb_dir: 'tb_logs' -> ..." (a change nobody made; in summary.json's
    sessions too). Both sessions now name the trial's directory alike, absolute."""
    from dlrm.sweep import run_sweep
    from dlrm.train.resume_policy import config_changes

    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
                                "train": {"device": "cpu", "max_steps": 2, "baseline": False}}))
    seen: list = []

    def stopped_trial(cfg, run_dir=None, resume=None):
        from dlrm.errors import TrainingStopped

        seen.append((cfg, run_dir, resume))
        (Path(run_dir) / "checkpoints").mkdir(parents=True)  # as the trainer leaves a trial stopped after a save
        (Path(run_dir) / "checkpoints" / "step-00000001.pt").write_bytes(b"")
        raise TrainingStopped(130, "stopped by signal at step 1")

    from dlrm.errors import TrainingStopped

    with pytest.raises(TrainingStopped):
        run_sweep(str(path), [("optim.dense.lr", [0.01])], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
                  train_fn=stopped_trial)

    def resumed_trial(cfg, run_dir=None, resume=None):
        seen.append((cfg, run_dir, resume))
        raise TrainingStopped(130, "stopped again")

    from dlrm.sweep_resume import resume_sweep
    (first, first_dir, _), = seen
    directory = tmp_path / "tb" / "sw" / first_dir.parent.name / "seed-0"
    assert first_dir == directory
    assert first.log.tb_dir == str(directory.parent.resolve()) and first.log.run_name == "seed-0"
    with pytest.raises(TrainingStopped):
        resume_sweep(str(tmp_path / "tb" / "sw"), train_fn=resumed_trial)
    again, _, resume = seen[1]
    assert resume is not None and resume.endswith("step-00000001.pt")
    assert [k for k, _, _ in config_changes(first.to_dict(), again.to_dict())] == []
    messages.clear()
    check_resume_config(first.to_dict(), again.to_dict(), (), resume)
    assert not [m for m in messages if "own settings differ" in m], messages


# -- (5) a signal's stop, agreed by the ranks, said by each ---------------------------------------------------------


def test_an_agreed_stop_is_said_by_rank_0_only(monkeypatch):
    """Ctrl-C on `torchrun --nproc-per-node 2 train.py`: the ranks agree on the signal and stop alike, and each said
    "stopped by signal at step 150; checkpoint ...", rank 1's as `[rank 1] ...` after rank 0's. A stop of one rank
    alone (not agreed) is still that rank's to say."""
    import torch

    from dlrm.cli import report_failure
    from dlrm.errors import TrainingStopped
    from dlrm.train.signals import agreed_stop

    # a rank got SIGINT (the agreement's MAX of [signal, got none, -signal]: every rank got SIGINT)
    env = SimpleNamespace(distributed=True, is_main=True, all_reduce_max=lambda t: torch.tensor([2, 0, -2]))
    with pytest.raises(TrainingStopped) as stopped:
        with agreed_stop(env, torch.device("cpu"), "before the first step", lambda name: f"{name}: stopped before "
                         "the first step, on every rank"):
            pass
    assert stopped.value.agreed and stopped.value.exit_code == 130
    for rank in (1, 0):
        out = _rank_console(monkeypatch, rank)
        assert report_failure(stopped.value, None) == 130
        assert out.getvalue().count("SIGINT: stopped before the first step") == (rank == 0), (rank, out.getvalue())
    out = _rank_console(monkeypatch, 1)
    assert report_failure(TrainingStopped(143, "SIGTERM: stopped at once"), None) == 143
    assert "[rank 1]" in out.getvalue() and "SIGTERM: stopped at once" in out.getvalue()


# -- (6) summary.json's config_changes after a session that wrote no summary ----------------------------------------


def test_a_sessions_config_changes_are_from_the_checkpoint_it_resumed(tmp_path):
    """Session 1 trains 4 steps at lr 0.002 (its summary.json); session 2 resumes at lr 0.001 (allowed) and is stopped
    by a signal after its step-6 checkpoint (no summary: summary.json is still session 1's); session 3 resumes from
    step 6 at lr 0.001. Session 3's `config_changes` said `optim.dense.lr: [0.002, 0.001]` (compared with the
    summary.json's config): a change it did not make, the checkpoint it resumed trained at 0.001 already."""
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 80, "validation": 20})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "data": {"path": str(tmp_path / "ds"), "batch_size": 8},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "optim": {"dense": {"lr": 0.002}},
        "train": {"device": "cpu", "max_steps": 4, "log_every": 2, "baseline": False, "seed": 0},
        "checkpoint": {"every": 2},
        "log": {"tb_dir": str(tmp_path / "tb"), "run_name": "r"}}))
    run = tmp_path / "tb" / "r"
    train(load_config(str(path)))
    first = (run / "summary.json").read_text()
    train(load_config(str(path), {"optim.dense.lr": 0.001, "train.max_steps": 6}), resume="latest",
          allow_config_change=["optim.dense.lr"])
    (run / "summary.json").write_text(first)  # as a signal leaves it: session 2 wrote its checkpoints, no summary
    train(load_config(str(path), {"optim.dense.lr": 0.001, "train.max_steps": 8}), resume="latest",
          allow_config_change=["optim.dense.lr"])
    sessions = json.loads((run / "summary.json").read_text())["sessions"]
    assert [(s["start_step"], s["end_step"], s["recorded"]) for s in sessions] == [(0, 4, True), (4, 6, False),
                                                                                    (6, 8, True)]
    assert sessions[-1]["config_changes"] == {"train.max_steps": [6, 8]}, sessions[-1]["config_changes"]
    assert sessions[-1]["hparams"]["dense_lr"] == 0.001
