"""Hostile review of the day's changes (audit helper): each test failed before its fix.

1. ``python -m dlrm.sweep``: a SIGTERM outside a trial's training steps (after sweep.json was written, before or between
   trials) killed the process by the default action: the sweep directory stayed with its sweep.json and nothing trained,
   so the same --run-name was refused from then on ("already exists"), where Ctrl-C at the same point removed it
   (train.py got `StopAtOnce`; the sweep's own entry point did not).
2. ``--resume --allow-config-change optim.dense`` (or ``optim.sparse``) with another optimizer name: the README lets it,
   and the other optimizer's state was loaded whole: a KeyError/RuntimeError traceback at the first step. Now one line.
3. A branch whose source run's best.pt still held the best step recorded that file (another run's, which it replaces
   later) as its best; a resume in place from another working directory (a best.pt recorded relatively) dropped the
   record of the run's own best ("its model not kept").
4. A checkpoint with one optimizer state over all parameters passed the new optimizer check and failed in torch's load.
5. ``python -m dlrm.distributed.merge`` killed by SIGTERM left its temporary file (the checkpoint's size) beside OUT.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output



def tiny_config(tmp_path: Path, **sections) -> Path:
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16, "test": 16})
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False},
           "checkpoint": {"every": 2, "keep": 10}, "log": {"tb_dir": str(tmp_path / "tb")}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    (tmp_path / "c.json").write_text(json.dumps(raw))
    return tmp_path / "c.json"


SWEEP_SIGTERM = """
import os, signal, sys
import dlrm.sweep as sweep
real = sweep._run_trials
def run_trials(*args, **kwargs):  # sweep.json written, no trial started: SIGTERM arrives
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
sweep._run_trials = run_trials
sweep.main(sys.argv[1:])
"""


def test_sweep_sigterm_before_a_trial_leaves_no_sweep_directory(tmp_path):
    config = tiny_config(tmp_path)
    result = subprocess.run([sys.executable, "-c", SWEEP_SIGTERM, "--config", str(config), "--seeds", "1",
                             "--tb-dir", str(tmp_path / "tb"), "--run-name", "sw", "--device", "cpu"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=CHILD_ENV)
    assert result.returncode == 143, process_output(result)  # was -15: killed by the default action
    assert "SIGTERM" in result.stderr
    assert not (tmp_path / "tb" / "sw").exists(), sorted(p.name for p in (tmp_path / "tb" / "sw").iterdir())


@pytest.mark.parametrize("section,first,second", [
    ("dense", {"name": "adam"}, {"name": "adagrad"}),  # was KeyError 'sum' at the first step
    ("dense", {"name": "adagrad"}, {"name": "sgd", "momentum": 0.9}),  # was KeyError 'dampening'
    ("sparse", {"name": "adagrad"}, {"name": "rowwise_adagrad"}),  # was an index_add_ RuntimeError
])
def test_resume_with_another_optimizer_starts_it_afresh(tmp_path, section, first, second):
    """README: ``--allow-config-change`` lets a resume change the optimizer; its saved state then is another
    optimizer's, which torch's load took whole and the first step failed on with a traceback (KeyError 'sum' or
    'dampening', an index_add_ shape error). Now the new optimizer starts afresh, said in the log; the other
    optimizer and the model continue from the checkpoint."""
    config = tiny_config(tmp_path, optim={section: first})
    train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))
    raw = json.loads(config.read_text())
    raw["optim"][section] = second
    config.write_text(json.dumps(raw))
    cfg = load_config(config, {"log.run_name": "r", "train.max_steps": 4})
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        summary = train(cfg, resume="latest", allow_config_change=[f"optim.{section}"])
    finally:
        logger.remove(handle)
    assert summary["steps"] == 4 and summary["resumed_at_step"] == 2
    assert any(f"optim.{section}.name changed from {first['name']!r} to {second['name']!r}" in m and "afresh" in m
               for m in seen), seen
    state = torch.load(ckpt.list_checkpoints(tmp_path / "tb" / "r")[-1], map_location="cpu", weights_only=True)
    index = 0 if section == "dense" else 1
    saved_keys = {k for st in state["optimizers"][index]["state"].values() for k in st}
    expected = {"adagrad": {"sum", "step"}, "sgd": {"momentum_buffer"}, "rowwise_adagrad": {"sum"}}[second["name"]]
    assert expected <= saved_keys and not ({"exp_avg", "exp_avg_sq"} & saved_keys), saved_keys


def _scripted(monkeypatch, aucs):
    """Evaluations whose AUCs are `aucs`, in turn (logloss and accuracy fixed)."""
    from dlrm.train import evaluator as evaluator_mod

    queue = list(aucs)
    monkeypatch.setattr(evaluator_mod, "evaluate",
                        lambda forward, loader, env=None: {"auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75})


def test_a_branch_keeps_its_best_model_when_the_source_best_is_still_that_step(tmp_path, monkeypatch):
    """A branch (``--resume step-4.pt --run-name NEW``) whose source run's best.pt still held the best step's model
    recorded that file, another run's best.pt, as its own best: the source run, continued, replaced it with a later
    best, and the branch's summary and checkpoints then named another step's model (`_keep_best_model` linked the
    best into the branch only when the source's best.pt had already changed); ``--checkpoint tb/branch`` took its
    newest step instead of its best."""
    config = tiny_config(tmp_path, train={"epochs": 2, "eval_every": 2})
    _scripted(monkeypatch, [0.60, 0.55])
    assert train(load_config(config, {"log.run_name": "full", "train.max_steps": 4}))["best"]["step"] == 2
    _scripted(monkeypatch, [0.50])
    step4 = tmp_path / "tb" / "full" / "checkpoints" / "step-00000004.pt"
    branch = train(load_config(config, {"log.run_name": "branch", "train.max_steps": 5}), resume=str(step4))
    assert branch["best"]["step"] == 2
    own = tmp_path / "tb" / "branch" / "checkpoints" / "best.pt"
    assert branch["best_checkpoint"] == str(own), branch["best_checkpoint"]  # was tb/full/checkpoints/best.pt
    # the source run goes on and finds a later best: the branch's best is still step 2's model
    _scripted(monkeypatch, [0.70, 0.65, 0.62])
    assert train(load_config(config, {"log.run_name": "full", "train.max_steps": 10}),
                 resume="latest")["best"]["step"] == 6
    assert ckpt.load_checkpoint(branch["best_checkpoint"])["position"]["step"] == 2


def test_an_in_place_resume_from_another_directory_keeps_the_runs_best(tmp_path, monkeypatch):
    """A run whose --tb-dir was relative records its best.pt relatively (tb/r/checkpoints/best.pt). Resumed in place
    from another working directory (--tb-dir given absolute), `_keep_best_model` found no file at that relative path,
    nor a step checkpoint of the best step (pruned, checkpoint.keep 1), and dropped the record: "no best checkpoint is
    named", the summary said "its model not kept", though the run's own best.pt held the best step's model."""
    config = tiny_config(tmp_path, train={"epochs": 2, "eval_every": 2}, checkpoint={"every": 2, "keep": 1})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _scripted(monkeypatch, [0.60, 0.55])
    first = train(load_config(config, {"log.tb_dir": "tb", "log.run_name": "r", "train.max_steps": 4}))
    # a checkpoint of an earlier version recorded it as the run saw it (relative; since session 59 absolute, as
    # summary.json's paths): written so here, the resume from elsewhere must still find the run's own best.pt
    last = ckpt.list_checkpoints(tmp_path / "a" / "tb" / "r")[-1]
    state = ckpt.load_checkpoint(last)
    assert first["best"]["step"] == 2 and Path(state["run_stats"]["best"]["checkpoint"]).is_absolute()
    state["run_stats"]["best"]["checkpoint"] = str(Path("tb") / "r" / "checkpoints" / "best.pt")
    ckpt.write_atomic(last, state)
    monkeypatch.chdir(tmp_path / "b")
    _scripted(monkeypatch, [0.50])
    resumed = train(load_config(config, {"log.tb_dir": str(tmp_path / "a" / "tb"), "log.run_name": "r",
                                         "train.max_steps": 6}), resume="latest")
    assert resumed["best"]["step"] == 2
    assert resumed["best_checkpoint"] is not None  # was None: "its model not kept"
    assert ckpt.load_checkpoint(resumed["best_checkpoint"])["position"]["step"] == 2


def test_a_checkpoint_with_one_optimizer_over_all_parameters_is_one_line(tmp_path):
    """`_check_optimizer_state` accepted one optimizer state over every parameter ("or one optimizer over them all"),
    which this program never writes nor loads: the resume then failed in torch's load_state_dict with a ValueError
    traceback ("loaded state dict has a different number of parameter groups")."""
    config = tiny_config(tmp_path, optim={"dense": {"name": "sgd"}, "sparse": {"name": "sgd"}})
    path = Path(train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))["checkpoint"])
    disk = torch.load(path, weights_only=True)
    dense, sparse = disk["optimizers"]
    count = len(dense["param_groups"][0]["params"])
    disk["optimizers"] = [{"state": {}, "param_groups": [dense["param_groups"][0],
                                                          {**sparse["param_groups"][0], "params": [count]}]}]
    torch.save(disk, path)
    with pytest.raises(ConfigError) as e:
        train(load_config(config, {"log.run_name": "r", "train.max_steps": 4}), resume="latest")
    assert "\n" not in str(e.value) and path.name in str(e.value) and "optimizers" in str(e.value)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "tb" / "r")] == [path.name]


MERGE_SIGTERM = """
import os, signal, sys
import torch
import dlrm.distributed.merge as merge_mod
from dlrm.checkpoint import load_checkpoint
state = load_checkpoint(sys.argv[1])
merge_mod.merge = lambda path: state  # the shards' merge (its result: a one-process state)
merge_mod.check_same_run = lambda path: None
real = torch.save
def save(*args, **kwargs):  # OUT's temporary file written, not yet renamed: SIGTERM arrives
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
torch.save = save
merge_mod.main(sys.argv[1:])
"""


def test_merge_sigterm_leaves_no_temporary_file_beside_out(tmp_path):
    """``python -m dlrm.distributed.merge`` killed by SIGTERM (its default action) while it wrote OUT left the hidden
    temporary file (``.OUT.<pid>-*.tmp``, as large as the merged checkpoint: 50 GB for MLPerf) beside OUT, which no
    later run removes (it is no run's checkpoints/ directory); train.py's --export got `StopAtOnce` for the same."""
    config = tiny_config(tmp_path)
    path = train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))["checkpoint"]
    (tmp_path / "out").mkdir()
    result = subprocess.run([sys.executable, "-c", MERGE_SIGTERM, path, str(tmp_path / "out" / "merged.pt")],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=CHILD_ENV)
    assert result.returncode == 143, process_output(result)  # was -15
    assert "SIGTERM" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # was ['.merged.pt.<pid>-....tmp']
