"""What a run writes, and its interruption (audit helper).

1. A run continued from an earlier checkpoint in a new run (``--resume step-N.pt --run-name NEW``, the documented way
   to branch) recorded as its best the original run's best.pt, which by then held a later best of the original run:
   the branch's summary.json named another step's model (of another run) as its best, and ``--export`` exported it.
2. SIGTERM while a run started (before its first step: a checkpoint restored, the writer opened) killed the process
   before the new run directory was given up: it stayed, config.json and all, and its --run-name was refused from
   then on ("already exists"); Ctrl-C at the same point removed it. --eval-only's new directory stayed the same way, and an
   --export's temporary file beside the path asked for.
3. ``--resume tb/r1/checkpoints/step-N.pt --tb-dir other --run-name r1`` (the same name in another TensorBoard root,
   a new run) continued tb/r1 in place: the run's own name was taken for the run, wherever --tb-dir pointed; from an
   earlier checkpoint it was refused as "not the latest" though the new run was named.
4. ``--resume models/checkpoints/mine.pt`` (a copy, in a folder of the user's that is called checkpoints/) was taken
   for a run's checkpoint: the run continued "in place" in models/, writing .lock, events, checkpoints and summary.json
   (over the one there); a copy needs --run-name NEW (README). (A copy that keeps a run's file name, step-N.pt, in
   such a folder still reads as a run's: fabricated runs of other tests hold nothing else.)
5. ``python -m dlrm.sweep --tb-dir ""`` wrote the sweep into the working directory and ``--run-name ""`` took the
   default name, silently (an unset shell variable; train.py refuses both in one line).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.sweep import sweep_directory
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.reporting import final_line
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output

# the checkout first, the caller's path kept (the GPU machine's packages live on PYTHONPATH)


def scripted(monkeypatch, aucs):
    """Evaluations whose AUCs are `aucs`, in turn (logloss and accuracy fixed)."""
    queue = list(aucs)
    monkeypatch.setattr(evaluator_mod, "evaluate",
                        lambda forward, loader, env=None: {"auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75})
    return queue


def tiny_config(tmp_path: Path, **train_keys) -> Path:
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16})
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 2, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False,
                     **train_keys},
           "checkpoint": {"every": 2, "keep": 10}, "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    return tmp_path / "c.json"


def test_a_branch_from_an_earlier_checkpoint_names_its_own_best_model(tmp_path, monkeypatch):
    """10 steps, evaluations at 2, 4, ..., 10 (AUC 0.60, 0.55, 0.70, 0.65, 0.62): the run's best.pt ends as step 6's
    model. A branch from step 4 (its best: step 2, AUC 0.60) that stops at step 5 without a better evaluation must name
    a checkpoint holding step 2's model; it named the original's best.pt (step 6's), and --export took that."""
    config = tiny_config(tmp_path)
    scripted(monkeypatch, [0.60, 0.55, 0.70, 0.65, 0.62])
    full = train(load_config(config, {"log.run_name": "full"}))
    assert full["best"]["step"] == 6
    step4 = tmp_path / "tb" / "full" / "checkpoints" / "step-00000004.pt"
    scripted(monkeypatch, [0.50])
    branch = train(load_config(config, {"log.run_name": "branch", "train.max_steps": 5}), resume=str(step4))
    assert (branch["best"]["step"], branch["best"]["auc"]) == (2, 0.60)
    held = ckpt.load_checkpoint(branch["best_checkpoint"])["position"]["step"]
    assert held == 2, f"{branch['best_checkpoint']} holds step {held}'s model, not the best's (step 2)"
    # in the branch's own directory (a link to step 2's checkpoint): what `--checkpoint tb/branch` takes too
    assert Path(branch["best_checkpoint"]) == tmp_path / "tb" / "branch" / "checkpoints" / "best.pt"
    last = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "branch")[-1])
    assert last["run_stats"]["best"]["checkpoint"] == branch["best_checkpoint"]
    # the original run is not written
    assert ckpt.load_checkpoint(tmp_path / "tb" / "full" / "checkpoints" / "best.pt")["position"]["step"] == 6


def test_a_best_whose_model_is_gone_is_named_as_not_kept(tmp_path, monkeypatch):
    """The same branch, with the original's step 2 checkpoint pruned: no file holds the best's model, and none is
    named (the final line says so) rather than another step's."""
    config = tiny_config(tmp_path)
    scripted(monkeypatch, [0.60, 0.55, 0.70, 0.65, 0.62])
    train(load_config(config, {"log.run_name": "full"}))
    (tmp_path / "tb" / "full" / "checkpoints" / "step-00000002.pt").unlink()
    scripted(monkeypatch, [0.50])
    branch = train(load_config(config, {"log.run_name": "branch", "train.max_steps": 5}),
                   resume=str(tmp_path / "tb" / "full" / "checkpoints" / "step-00000004.pt"))
    assert branch["best"]["step"] == 2 and branch["best_checkpoint"] is None
    assert "its model not kept" in final_line(branch) and "kept as None" not in final_line(branch)


def test_the_same_run_name_under_another_tb_dir_is_a_new_run(tmp_path):
    config = tiny_config(tmp_path, max_steps=4)
    train(load_config(config, {"log.run_name": "r1"}))
    source = tmp_path / "tb" / "r1"
    before = {p.name: p.stat().st_mtime_ns for p in source.rglob("*")}
    resumed = train(load_config(config, {"log.run_name": "r1", "log.tb_dir": str(tmp_path / "other"),
                                         "train.max_steps": 6}), resume=str(source / "checkpoints" / "step-00000004.pt"))
    assert Path(resumed["run_dir"]) == tmp_path / "other" / "r1"  # was tb/r1
    assert resumed["steps"] == 6 and resumed["resumed_at_step"] == 4
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "other" / "r1")] == ["step-00000006.pt"]
    assert {p.name: p.stat().st_mtime_ns for p in source.rglob("*")} == before  # the original run is not written
    # from an earlier checkpoint: the new run too (it was refused: "resuming it in place would overwrite the later ones")
    branch = train(load_config(config, {"log.run_name": "r1", "log.tb_dir": str(tmp_path / "third")}),
                   resume=str(source / "checkpoints" / "step-00000002.pt"))
    assert Path(branch["run_dir"]) == tmp_path / "third" / "r1" and branch["steps"] == 4


def test_a_copy_in_a_users_checkpoints_folder_is_not_resumed_in_place(tmp_path):
    config = tiny_config(tmp_path, max_steps=2)
    train(load_config(config, {"log.run_name": "r1"}))
    models = tmp_path / "models"
    (models / "checkpoints").mkdir(parents=True)
    copy = models / "checkpoints" / "mine.pt"
    shutil.copy(tmp_path / "tb" / "r1" / "checkpoints" / "step-00000002.pt", copy)
    (models / "summary.json").write_text("the user's own")
    with pytest.raises(ConfigError, match="is not in a run's checkpoints/ directory; add --run-name NEW"):
        train(load_config(config, {"train.max_steps": 4}), resume=str(copy))
    assert (models / "summary.json").read_text() == "the user's own"  # was replaced by this run's summary
    assert sorted(str(p.relative_to(models)) for p in models.rglob("*")) == ["checkpoints", "checkpoints/mine.pt",
                                                                             "summary.json"]
    # with --run-name NEW it continues in a new run, as the README says
    branch = train(load_config(config, {"train.max_steps": 4, "log.run_name": "new"}), resume=str(copy))
    assert Path(branch["run_dir"]) == tmp_path / "tb" / "new" and branch["resumed_at_step"] == 2


SIGTERM_AT_START = """
import os, signal, sys
from dlrm.train import trainer
real = trainer.Trainer._log_start
def log_start(self):  # the run's directory is open, no step ran: SIGTERM arrives
    os.kill(os.getpid(), signal.SIGTERM)
    real(self)
trainer.Trainer._log_start = log_start
from dlrm.cli import main
main(sys.argv[1:])
"""


def test_sigterm_before_the_first_step_leaves_no_run_directory(tmp_path):
    config = tiny_config(tmp_path)
    result = subprocess.run([sys.executable, "-c", SIGTERM_AT_START, "--config", str(config), "--run-name", "r"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=CHILD_ENV)
    assert result.returncode == 143, process_output(result)  # was -15: killed by the default action
    assert "SIGTERM" in result.stderr
    assert not (tmp_path / "tb" / "r").exists(), sorted(p.name for p in (tmp_path / "tb" / "r").iterdir())


SIGTERM_IN = """
import os, signal, sys
import torch
from dlrm.train import trainer
def killing(real):
    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives as the call returns
        return out
    return call
trainer.evaluate = killing(trainer.evaluate)  # --eval-only's evaluation
torch.export.save = killing(torch.export.save)  # --export's temporary file written, not yet renamed
from dlrm.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("mode", ["eval-only", "export"])
def test_sigterm_during_eval_only_or_export_leaves_nothing_behind(tmp_path, mode):
    """--eval-only's new run directory was kept (config.json, its name taken); --export's temporary file stayed beside
    the path asked for: SIGTERM's default action killed the process before either was cleaned up."""
    config = tiny_config(tmp_path, max_steps=2)
    train(load_config(config, {"log.run_name": "r"}))
    (tmp_path / "out").mkdir()
    args = (["--eval-only", "--run-name", "ev"] if mode == "eval-only" else ["--export", str(tmp_path / "out" / "m.pt2")])
    result = subprocess.run([sys.executable, "-c", SIGTERM_IN, "--config", str(config), "--checkpoint",
                             str(tmp_path / "tb" / "r"), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=CHILD_ENV)
    assert result.returncode == 143, process_output(result)  # was -15
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["r"]  # no "ev"
    assert list((tmp_path / "out").iterdir()) == []  # no .m.pt2.<pid>-<hex>.tmp.pt2


@pytest.mark.parametrize("tb_dir, run_name, key", [("", None, "--tb-dir"), ("tb", "", "--run-name")])
def test_a_sweep_refuses_an_empty_tb_dir_or_run_name(tmp_path, monkeypatch, tb_dir, run_name, key):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"^{key}: "):
        sweep_directory(tb_dir, run_name, "configs/sample.json")
    assert list(tmp_path.iterdir()) == []  # was a sweep directory in the working directory, or tb/<default name>
