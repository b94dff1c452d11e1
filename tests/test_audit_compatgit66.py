"""Artifacts of older versions, as their own code wrote them (audit helper compatgit66: old commits checked out,
their datasets, runs, exports and sweeps driven with this version). Each test writes the old artifact's layout here.

1. A run finished by ``train.max_steps`` off the ``train.eval_every`` grid by a version before 2026-11-30 (e4c1c73;
   seen with eff595d, 2026-11-29): its last checkpoint was written before the run's last evaluation, which was a new
   best; that version then linked best.pt to the checkpoint without recording it there (its ``run_stats.best`` names
   the grid's older best, no ``evaluated_step``, no ``grid_best``); its summary.json names the new best. A
   ``--resume`` with a larger ``train.max_steps`` looked for a file holding the older best, warned that best.pt "no
   longer holds the best evaluation's model", and reported the older best (``its model not kept``, best_checkpoint
   null) while best.pt held the better one; a step checkpoint of the older best, where one was kept, became best.pt.
2. A run stopped between two logging steps by a version before 2026-11-30 (329723e; seen with 59a7a17 and eff595d,
   stopped at steps 7 and 5 with train.log_every 2): its checkpoint holds no ``window_losses``, so the first loss the
   resume logs averages the resumed steps only. Every other logged loss, and the training, are the uninterrupted
   run's bit for bit; that one differed without a word (the README promises a bit-for-bit resume): it is said now.
3. A sweep of a version before 2026-11-30 (no sweep.json) given to ``--resume``: refused as "not the directory of a
   sweep"; it is one, which cannot be resumed: said so, with what to do.
4. An export of a version before 2026-11-30 returns probabilities with an autograd graph: README's
   ``.module()(dense, raw).numpy()`` raised; the README says what works for those.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.errors import TrainingStopped
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.test_audit_resume_edges import one_hot, signal_at

# the run: best at step 8 (its last, off the grid of 6) over step 6's with train.seed 1
RUN = {"train.max_steps": 8, "train.eval_every": 6, "train.seed": 1}
# keys of run_stats that versions before 2026-11-30 did not write
NEWER_STATS = ("evaluated_step", "grid_best", "eval_s", "wall_s", "eval_curve_split", "target")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("compatgit66")
    make_dataset(root / "one", {"train": 100, "validation": 32}, row_group_size=30)
    return root


def as_written_before_evaluated_step(run, six_best, every):
    """Rewrite `run` (finished at step 8, best at 8) as eff595d wrote it: the step-8 checkpoint saved before the last
    evaluation (its best step 6's, absolute path to best.pt), best.pt a hard link to it; summary.json as it is."""
    checkpoints = run / "checkpoints"
    last = checkpoints / "step-00000008.pt"
    raw = torch.load(last, map_location="cpu", weights_only=True)
    stats = raw["run_stats"]
    for key in NEWER_STATS:
        stats.pop(key, None)
    stats["best"] = {**six_best, "checkpoint": str(checkpoints / "best.pt")}
    stats["evals_since_best"] = 0
    torch.save(raw, last)
    (checkpoints / "best.pt").unlink()
    os.link(last, checkpoints / "best.pt")
    if every == 2:  # a step checkpoint of the older best kept beside it (checkpoint.every 2, keep 5)
        assert (checkpoints / "step-00000006.pt").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best"]["step"] == 8


@pytest.mark.parametrize("every", [4, 2])
def test_an_unrecorded_last_best_of_an_old_run_survives_a_longer_resume(data, tmp_path, every):
    over = {**RUN, "checkpoint.every": every, "checkpoint.keep": 5}
    six = train(one_hot(data, tmp_path, "six", **{**over, "train.max_steps": 6}))["best"]
    assert six["step"] == 6
    full = train(one_hot(data, tmp_path, "full", **over))
    assert full["best"]["step"] == 8 and full["best"]["auc"] > six["auc"]
    shutil.copytree(tmp_path / "tb" / "full", tmp_path / "tb" / "old")
    shutil.rmtree(tmp_path / "tb" / "old" / "checkpoints")
    shutil.copytree(tmp_path / "tb" / "full" / "checkpoints", tmp_path / "tb" / "old" / "checkpoints")
    (tmp_path / "tb" / "old" / ".lock").unlink(missing_ok=True)
    six_best = {k: v for k, v in six.items() if k != "checkpoint"}
    as_written_before_evaluated_step(tmp_path / "tb" / "old", six_best, every)
    longer = {**over, "train.max_steps": 12}
    expected = train(one_hot(data, tmp_path, "full", **longer), resume="latest")
    resumed = train(one_hot(data, tmp_path, "old", **longer), resume="latest")
    assert resumed["train_losses"] == expected["train_losses"]
    drop = ("checkpoint",)
    assert {k: v for k, v in resumed["best"].items() if k not in drop} == \
        {k: v for k, v in expected["best"].items() if k not in drop}
    best = tmp_path / "tb" / "old" / "checkpoints" / "best.pt"
    assert resumed["best"]["checkpoint"] == str(best)  # was None: "its model not kept"
    assert ckpt.load_checkpoint(best)["position"]["step"] == expected["best"]["step"]


def test_an_old_checkpoint_between_logging_steps_says_which_logged_loss_differs(data, tmp_path, monkeypatch):
    over = {"train.max_steps": 12, "train.log_every": 4}
    full = train(one_hot(data, tmp_path, "full", **over))
    for name in ("old", "new"):
        with monkeypatch.context() as m:
            signal_at(m, 6)
            with pytest.raises(TrainingStopped):
                train(one_hot(data, tmp_path, name, **over))
    stopped = ckpt.list_checkpoints(tmp_path / "tb" / "old")[-1]
    raw = torch.load(stopped, map_location="cpu", weights_only=True)
    assert raw["position"]["step"] == 6 and len(raw["run_stats"].pop("window_losses")) == 2
    torch.save(raw, stopped)  # as versions before 2026-11-30 wrote it: no window_losses
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        new = train(one_hot(data, tmp_path, "new", **over), resume="latest")
        assert not [line for line in seen if "logging step" in line]  # this version's checkpoint: exact, no word
        old = train(one_hot(data, tmp_path, "old", **over), resume="latest")
    finally:
        logger.remove(handle)
    assert new["train_losses"] == full["train_losses"]
    differs = [a[0] for a, b in zip(old["train_losses"], full["train_losses"]) if a != b]
    assert differs == [8] and old["auc"] == full["auc"]
    said = [line for line in seen if "logging step" in line]
    assert said == ["--resume at step 6: the checkpoint holds the losses of 0 of the 2 steps since the last logging "
                    "step (4; one written before 2026-11-30 holds none): the loss logged at step 8 averages only the "
                    "steps from here, not train.log_every's 4 as the uninterrupted run's does"]


@pytest.mark.parametrize("left", ["finished", "stopped"])
def test_a_sweep_of_a_version_before_its_record_is_named_so(tmp_path, left):
    """A sweep directory as 96e29d9..eff595d (2026-11-23..29) wrote it: trials and, once finished, its report, but no
    sweep.json. Its --resume was refused as "not the directory of a sweep"; it is one, of an older version."""
    from dlrm.config import ConfigError
    from dlrm.sweep_resume import resume_sweep

    sweep = tmp_path / "sweep"
    trial = sweep / "00-sparse.lr=0.05" / "seed-0"
    (trial / "checkpoints").mkdir(parents=True)
    (trial / "config.json").write_text(json.dumps({"data": {"path": str(tmp_path / "syn1")}}))
    if left == "finished":
        (trial / "summary.json").write_text(json.dumps({"auc": 0.5384, "steps": 30}))
        (sweep / "trials.csv").write_text("setting,seed,auc,logloss,best_auc,baseline_auc,steps,run_dir\n"
                                          f"optim.sparse.lr=0.05,0,0.5384,0.6020,0.6307,0.6747,30,{trial}\n")
        (sweep / "sweep.md").write_text("| setting | AUC |\n| --- | --- |\n| optim.sparse.lr=0.05 | 0.5384 |\n")
    before = sorted(p.relative_to(sweep) for p in sweep.rglob("*"))
    with pytest.raises(ConfigError) as e:
        resume_sweep(sweep)
    assert str(e.value) == (f"--resume: {sweep} is a sweep made by a version before 2026-11-30, which recorded no "
                            "sweep.json (its grid): it cannot be resumed; run the sweep again under another --run-name "
                            "(its trials and report stay where they are)")
    assert sorted(p.relative_to(sweep) for p in sweep.rglob("*")) == before


def test_an_export_of_a_version_before_frozen_parameters_loads_as_the_readme_says(data, tmp_path, monkeypatch):
    """An export written before 2026-11-30 (def42a0; seen with 96e29d9..eff595d) saved its parameters trainable: the
    README's ``torch.export.load(path).module()(dense, raw).numpy()`` raised ("Can't call numpy() on Tensor that
    requires grad"). The README now says so and what works: the call under torch.no_grad(), or a new --export."""
    import contextlib
    from pathlib import Path

    from dlrm.train import export

    cfg = one_hot(data, tmp_path, "run", **{"train.max_steps": 2})
    train(cfg)
    checkpoint = ckpt.list_checkpoints(tmp_path / "tb" / "run")[-1]
    with monkeypatch.context() as m:  # the old program: parameters saved as trained (requires_grad)
        m.setattr(export, "_frozen", lambda module: contextlib.nullcontext())
        export.export_checkpoint(cfg, checkpoint, tmp_path / "old.pt2")
    dense, raw = torch.zeros(3, 13, dtype=torch.int64), torch.zeros(3, 26, dtype=torch.int64)
    program = torch.export.load(tmp_path / "old.pt2").module()
    assert program(dense, raw).requires_grad  # what the old file gives: .numpy() refuses it
    with torch.no_grad():
        old = program(dense, raw).numpy()
    export.export_checkpoint(cfg, checkpoint, tmp_path / "new.pt2")
    assert (torch.export.load(tmp_path / "new.pt2").module()(dense, raw).numpy() == old).all()
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert ("a program written before 2026-11-30 gives them with one, so `.numpy()` refuses them: call it under "
            "`torch.no_grad()`, or `--export` its checkpoint again") in readme
