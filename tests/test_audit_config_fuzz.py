"""Audit by config-combination fuzzing (random valid configs trained, evaluated, exported and resumed through
train.py; invalid values at every key): each case found there, minimised to a small reproducer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import cli
from dlrm.config import load_config
from dlrm.logging_setup import configure_logging
from dlrm.train.trainer import Trainer
from tests.conftest import REPO, make_dataset

BASE = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 4, "device": "cpu", "seed": 3, "baseline": False},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_fuzz") / "ds"
    make_dataset(root, {"train": 160, "validation": 40}, row_group_size=16)
    return root


def config(tmp_path, dataset, name, **sections):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    (tmp_path / f"{name}.json").write_text(json.dumps(raw))
    return load_config(tmp_path / f"{name}.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


def test_an_early_stop_off_the_logging_grid_logs_its_last_window_as_the_end_of_training_does(tmp_path, dataset):
    """A run that stops early (here at its quality target, at step 6) between two logging steps (every 4) ended with
    the losses of steps 5-6 never logged: summary.json's final_train_loss was step 4's window (null when the stop
    came before the first logging step), and TensorBoard's train/loss stopped at 4, where the same run ending at
    train.max_steps 6 logs its partial last window at 6."""
    early = config(tmp_path, dataset, "early", train={"eval_every": 6, "max_steps": 9, "early_stopping": {
        "metric": "logloss", "patience": None, "target": 100.0}})
    summary = Trainer(early).fit()
    assert summary["steps"] == 6 and summary["target_reached"] is True
    assert [s for s, _ in summary["train_losses"]] == [4, 6]
    assert summary["final_train_loss"] == summary["train_losses"][-1][1]
    events = EventAccumulator(str(tmp_path / "tb" / "early"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 6]
    # the same 6 steps as a run of that length: the same windows, the same losses
    plain = Trainer(config(tmp_path, dataset, "plain", train={"max_steps": 6})).fit()
    assert summary["train_losses"] == plain["train_losses"]


def test_an_early_stop_before_the_first_logging_step_reports_its_training_loss(tmp_path, dataset):
    """Stopped at step 2 with train.log_every 50: final_train_loss was null (no window logged) for a run that trained."""
    cfg = config(tmp_path, dataset, "first", train={"eval_every": 2, "log_every": 50, "early_stopping": {
        "metric": "logloss", "patience": None, "target": 100.0}})
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2
    assert [s for s, _ in summary["train_losses"]] == [2]
    assert isinstance(summary["final_train_loss"], float)


@pytest.fixture
def exports(monkeypatch):
    """Record evaluate_checkpoint / export_checkpoint instead of running them; loguru pointed back afterwards."""
    from dlrm.train import checkpointer, export

    calls: list[str] = []
    monkeypatch.setattr(checkpointer, "checkpoint_for", lambda path: Path(path))
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda *a: calls.append("eval"))
    monkeypatch.setattr(export, "export_checkpoint", lambda *a: calls.append("export"))
    yield calls
    configure_logging()  # main() pointed loguru at CliRunner's stderr, closed now


@pytest.mark.parametrize("flag, value", [("--split", "test"), ("--run-name", "r2")])
def test_a_bare_export_refuses_the_options_of_the_evaluation_and_run_it_does_not_make(tmp_path, exports, flag, value):
    """`--checkpoint C --export M --split test` (or --run-name r2) exported C, exit 0: an export of a --checkpoint
    evaluates nothing and writes no run directory, so the option was ignored without a word (as --profile or
    --max-steps were before `cli.TRAINING_ONLY`). With --eval-only both act, and stay accepted."""
    common = ["--config", str(REPO / "configs" / "sample.json"), "--checkpoint", str(tmp_path / "c.pt"),
              "--export", str(tmp_path / "m.pt2"), flag, value]
    result = CliRunner().invoke(cli.main, common)
    assert result.exit_code == 2, result.output
    errors = [line.split(" ERROR ", 1)[1].strip() for line in result.output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].startswith(f"{flag}: ") and "--export of a --checkpoint" in errors[0]
    assert exports == [] and not (tmp_path / "m.pt2").exists()
    result = CliRunner().invoke(cli.main, [*common, "--eval-only", "--tb-dir", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    assert exports == ["eval", "export"]


def test_an_off_grid_best_does_not_make_a_longer_resume_stop_before_the_uninterrupted_run(tmp_path, dataset,
                                                                                          monkeypatch):
    """Early stopping, patience 1, eval_every 2. Uninterrupted: 0.60 at 2, 0.62 at 4 (a gain), 0.61 at 6: stops at 6.
    Trained to max_steps 3 first, the run's own last evaluation at 3 (off the grid: 0.70) became the best, kept as
    best.pt; resumed to the same length, step 4's 0.62 was compared with it, counted as no gain, and the run stopped
    at 4 (the fuzzer's r218: stopped at 2 where the uninterrupted run reached its target at 4). The grid's evaluations
    now count against the grid's best, as in the uninterrupted run; the better off-grid model stays the best."""
    from dlrm.train import evaluator as evaluator_mod
    from tests.test_audit_best_resume import scripted

    early = {"eval_every": 2, "max_steps": 8, "early_stopping": {"metric": "auc", "patience": 1}}
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.62, 0.61]))
    full = Trainer(config(tmp_path, dataset, "full", train=early)).fit()
    assert (full["steps"], full["early_stopped"], full["best"]["step"]) == (6, True, 4)
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.70]))
    first = Trainer(config(tmp_path, dataset, "r", train={**early, "max_steps": 3})).fit()
    assert (first["steps"], first["best"]["step"], first["early_stopped"]) == (3, 3, False)
    monkeypatch.setattr(evaluator_mod, "evaluate", ev := scripted([0.62, 0.61]))
    resumed = Trainer(config(tmp_path, dataset, "r", train=early), resume="latest").fit()
    assert ev.queue == [] and (resumed["steps"], resumed["early_stopped"]) == (6, True)  # was (4, True)
    assert (resumed["best"]["step"], resumed["best"]["auc"]) == (3, 0.70)


@pytest.mark.parametrize("seed", ["0", "7"])
@pytest.mark.parametrize("mode", ["--eval-only", "--export"])
def test_a_seed_is_refused_where_nothing_is_drawn(tmp_path, seed, mode):
    """--seed with --eval-only or a bare --export of a --checkpoint acted on nothing (an evaluation and an export draw
    nothing at random), exit 0; --seed 0 too (0 == False slipped through the check of the flags left out)."""
    args = ["--config", str(REPO / "configs" / "sample.json"), "--checkpoint", str(tmp_path / "c.pt"), "--seed", seed]
    args += ["--eval-only"] if mode == "--eval-only" else ["--export", str(tmp_path / "m.pt2")]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    assert "--seed: acts only on training" in result.output
    assert not (tmp_path / "m.pt2").exists()
