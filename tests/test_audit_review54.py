"""Review of the day's commits (output_lock by real path, early stopping's grid best, the early stop's last
logging window, signals_deferred, the evaluation loaders' buffers, the bare --export's refusals, the multi-hot
checks): each bug found there, as a small reproducer."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.data import preprocess as pp
from dlrm.train.trainer import Trainer
from tests.conftest import make_dataset
from tests.test_preprocess_cli_errors import raw_lines


def _unwritable(monkeypatch, directory: Path) -> None:
    """`directory` reads as not writable (root writes anywhere): a mount point's parent."""
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path) == directory and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def test_preprocess_into_a_symlinked_output_whose_parent_is_not_writable(tmp_path, monkeypatch):
    """`--output link` (link -> mnt/out, mnt not writable: a mount point). output_lock, now keyed on the real path,
    holds mnt/out/.out.lock inside the output; preprocess's check for foreign entries only knew `.link.lock` (the name
    as given) and refused the run: "link is not empty (.out.lock) and holds no unfinished run". The same output
    named by its own path went through."""
    src = tmp_path / "in" / "a.tsv"
    src.parent.mkdir()
    src.write_text(raw_lines(60))
    mnt = tmp_path / "mnt"
    (mnt / "out").mkdir(parents=True)
    (tmp_path / "link").symlink_to(mnt / "out")
    _unwritable(monkeypatch, mnt)
    result = CliRunner().invoke(pp.build_cli(), ["-i", str(src), "-o", str(tmp_path / "link"), "--no-progress",
                                                 "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert (mnt / "out" / "metadata.json").is_file()
    assert not list(mnt.glob("**/.*.lock")) and not list(tmp_path.glob(".*.lock"))  # the lock went with the run


# -- early stopping: a resume at a run's end on another data.eval_split ------------------------------------------

BASE = {
    "data": {"batch_size": 16},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 4, "device": "cpu", "seed": 3, "baseline": False},
}


def _config(tmp_path, dataset, name, split, **train):
    raw = json.loads(json.dumps(BASE))
    raw["data"].update(path=str(dataset), eval_split=split)
    raw["train"].update(train)
    (tmp_path / f"{name}-{split}.json").write_text(json.dumps(raw))
    return load_config(tmp_path / f"{name}-{split}.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


def _scripted(monkeypatch, aucs: dict[int, float]) -> list[int]:
    """The evaluations' AUC by step (logloss 0.5), and the steps evaluated."""
    from dlrm.train import evaluator as evaluator_mod

    seen: list[int] = []
    monkeypatch.setattr(evaluator_mod, "evaluate", lambda forward, loader, env=None: {})

    def log_eval(writer, metrics, step, tag="eval"):  # (tag: another split's curve, eval/<split>)
        seen.append(step)
        return {"auc": aucs[step], "logloss": 0.5, "accuracy": 0.75}
    monkeypatch.setattr(evaluator_mod, "log_eval", log_eval)
    return seen


def test_a_resume_at_the_end_on_another_split_counts_that_split_s_evaluation(tmp_path, monkeypatch):
    """Early stopping (auc, patience 1, eval_every 2). A run of 4 steps killed before its summary, resumed at its end
    on data.eval_split test (allowed): the best starts afresh, and step 4's test evaluation, on the grid, is the
    first of that split. It was taken for the checkpoint's own evaluation made again (`again`: the checkpoint held
    step 4's *validation* evaluation), not counted, so recorded as an off-grid best with no grid best
    (grid_best {}): extended to 8 steps, step 6's worse evaluation then counted as a gain over "no grid best", and
    the run went on to 8 where patience 1 stops it at 6 (as a run evaluating test from step 4 on does)."""
    dataset = tmp_path / "ds"
    make_dataset(dataset, {"train": 160, "validation": 32, "test": 32}, row_group_size=16)
    early = {"eval_every": 2, "early_stopping": {"metric": "auc", "patience": 1}}
    _scripted(monkeypatch, {2: 0.60, 4: 0.62})
    first = Trainer(_config(tmp_path, dataset, "r", "validation", max_steps=4, **early)).fit()
    assert (first["steps"], first["best"]["step"]) == (4, 4)
    (tmp_path / "tb" / "r" / "summary.json").unlink()  # killed before its summary
    _scripted(monkeypatch, {4: 0.70})
    again = Trainer(_config(tmp_path, dataset, "r", "test", max_steps=4, **early), resume="latest",
                    allow_config_change=["data.eval_split"]).fit()
    assert (again["steps"], again["best"]["step"], again["best"]["auc"]) == (4, 4, 0.70)
    stats = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1])["run_stats"]
    assert "grid_best" not in stats  # step 4 is on the grid: it is the grid's best (was {})
    seen = _scripted(monkeypatch, {6: 0.65, 8: 0.66})
    longer = Trainer(_config(tmp_path, dataset, "r", "test", max_steps=8, **early), resume="latest").fit()
    assert seen == [6] and (longer["steps"], longer["early_stopped"]) == (6, True)  # was [6, 8], (8, False)
