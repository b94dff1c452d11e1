"""Sweeps' loose ends (audit "sweeprest"), each confirmed before it was fixed:

1. `Verdict.beyond_noise` was True where no seed noise had been measured: per-seed differences all equal (a standard
   error of 0, while `text` said "no spread to compare with"), or a Verdict made through the API with one seed and a
   noise of 0 (its text then claimed "the per-seed differences are all equal" of a single difference). Now None.
2. The verdict said "AUC 0.7034 mean of 1 seeds": one value is no mean. Now "AUC 0.7034, one seed".
3. ``--resume`` of a sweep one of whose trials another process writes (a ``train.py --resume`` of it) was refused only
   when the sweep reached that trial, after the trials before it had trained. Now refused before anything trains, in
   one line naming the trial's directory and its holder; a sweep held by another sweep process names it too.
4. ``train.py --config <sweep>/<setting>/seed-<k>/config.json`` with the ``--run-name`` its refusal advised (or any)
   wrote the new run into the sweep's setting directory, among its trials. Now refused in one line naming a free
   place outside the sweep.
5. A sweep whose --tb-dir lies inside another sweep was written among that sweep's trials: refused alike.

Fake trainers keep it fast."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrm.config import ConfigError
from dlrm.errors import NonFiniteLoss
from dlrm.sweep import parse_set, run_sweep, slug
from dlrm.sweep_results import SettingResult, Verdict, verdict
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.test_sweep import BASE


def _result(index, aucs):
    return SettingResult(index, {"x": index}, [{"auc": a, "logloss": 1 - a} for a in aucs])


# -- 1, 2: the verdict -------------------------------------------------------------------------------------------------


def test_equal_per_seed_differences_are_not_beyond_a_noise_never_measured():
    a, b = _result(0, [0.5, 0.625]), _result(1, [0.75, 0.875])  # exact in binary: both differences 0.25
    v = verdict([a, b])
    assert v.noise == 0.0 and v.margin == 0.25
    assert v.beyond_noise is None  # it was True (0.25 >= 2 x 0)
    assert "no spread to compare with" in v.text() and "beyond" not in v.text()


@pytest.mark.parametrize("noise", [0.0, 0.001, math.nan])
def test_one_seed_through_the_api_claims_nothing_of_the_noise(noise):
    a, b = _result(0, [0.8]), _result(1, [0.7])
    v = Verdict(a, b, 0.1, noise)
    assert v.beyond_noise is None  # True for 0.0 and 0.001 (one difference has no spread), False for NaN
    assert v.text().endswith("; one seed: no estimate of the seed noise (use --seeds 3 or more)"), v.text()
    assert "all equal" not in v.text()


def test_a_non_finite_noise_of_several_seeds_is_no_estimate():
    a, b = _result(0, [0.8, 0.81]), _result(1, [0.7, 0.72])
    v = Verdict(a, b, 0.095, math.nan)
    assert v.beyond_noise is None and v.text().endswith("; no estimate of the seed noise"), v.text()
    assert Verdict(a, b, 0.095, 0.01).beyond_noise is True and Verdict(a, b, 0.015, 0.01).beyond_noise is False


def test_one_seed_is_not_called_a_mean_of_1_seeds():
    one = verdict([_result(0, [0.8]), _result(1, [0.7])])
    assert one.text().startswith("best: x=0 (AUC 0.8000, one seed), +0.1000 AUC over x=1 (0.7000)"), one.text()
    tie = verdict([_result(0, [0.75]), _result(1, [0.75])])
    assert tie.text() == "no winner: x=0 and x=1 tie at AUC 0.7500 (one seed)"
    alone = verdict([_result(0, [0.8])])
    assert alone.text() == "best: x=0 (AUC 0.8000, one seed); the only setting"
    three = verdict([_result(0, [0.8, 0.81, 0.82]), _result(1, [0.7, 0.71, 0.73])])
    assert three.text().startswith("best: x=0 (AUC 0.8100 mean of 3 seeds), ")
    assert "mean of 1 " not in one.text() + tie.text() + alone.text()


# -- 3: a trial another process writes --------------------------------------------------------------------------------


@pytest.fixture
def config(tmp_path):
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path / "tiny.json"


def fake_trainer(calls, outcomes=None):
    """Writes what a run writes (config.json, a checkpoint, summary.json); `outcomes[(lr, seed)]` is raised instead
    of finishing, after the trial's first checkpoint."""

    def train(cfg, run_dir=None, resume=None):
        key = (cfg.optim.sparse.lr, cfg.train.seed)
        calls.append((key, resume))
        run_dir = run_dir or Path(resume).parent.parent  # (a resume: <run>/checkpoints/<file>)
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
        (run_dir / "checkpoints" / "step-00000002.pt").write_bytes(b"x")
        if outcomes and key in outcomes:
            raise outcomes[key]
        summary = {"auc": 0.7, "logloss": 0.3, "steps": 4, "run_dir": str(run_dir), "config": cfg.to_dict()}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    return train


SETS = ["optim.sparse.lr=0.01,0.03"]


def _stopped_sweep(tmp_path, config):
    """A sweep whose first trial failed (NaN, checkpoint kept) and whose second was stopped by Ctrl-C."""
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trainer([], {(0.01, 0): NonFiniteLoss("loss became NaN at step 3"),
                                             (0.03, 0): KeyboardInterrupt()}))
    directory = tmp_path / "sw"
    return directory, [directory / slug(i, {"optim.sparse.lr": lr}) / "seed-0" for i, lr in enumerate((0.01, 0.03))]


@pytest.mark.parametrize("checkpoint", [True, False])
def test_resume_refuses_a_trial_another_process_writes_before_anything_trains(tmp_path, config, checkpoint):
    from dlrm.sweep_resume import resume_sweep
    from dlrm.train.run_dir import RunLock

    directory, (first, second) = _stopped_sweep(tmp_path, config)
    if not checkpoint:  # (killed before its first checkpoint: trained afresh, what it left moved aside first)
        (second / "checkpoints" / "step-00000002.pt").unlink()
    held = RunLock.acquire(second)  # another process: `train.py --resume` of that trial, say
    calls = []
    try:
        with pytest.raises(ConfigError) as refused:
            resume_sweep(directory, train_fn=fake_trainer(calls))
    finally:
        held.release()
    text = str(refused.value)
    assert f"trial {second} is in use by pid {os.getpid()} on " in text and "\n" not in text, text
    # nothing trained, nothing moved: the first trial used to be retrained before the second was refused
    assert calls == [] and first.is_dir() and not list(first.parent.glob("seed-0.*"))
    resume_sweep(directory, train_fn=fake_trainer(calls))  # once free, the sweep finishes
    assert sorted(k for k, _ in calls) == [(0.01, 0), (0.03, 0)] and (directory / "sweep.md").is_file()


def test_a_sweep_held_by_another_sweep_process_names_it(tmp_path, config):
    from dlrm.sweep_resume import SweepLock, resume_sweep
    from dlrm.train.run_dir import RunLock

    directory, (_, second) = _stopped_sweep(tmp_path, config)
    sweep_lock, trial_lock = SweepLock.acquire(directory), RunLock.acquire(second)  # another sweep training it
    try:
        with pytest.raises(ConfigError) as refused:
            resume_sweep(directory, train_fn=fake_trainer([]))
    finally:
        trial_lock.release(), sweep_lock.release()
    text = str(refused.value)
    assert text.startswith(f"--resume: {directory} is in use by another sweep process (pid {os.getpid()} on ")
    assert f", training {second})" in text, text


# -- 4: a trial's config.json given back to train.py --------------------------------------------------------------------


def test_a_trials_config_never_writes_a_new_run_into_the_sweep(tmp_path, config, monkeypatch):
    import dlrm.cli as cli
    import dlrm.train.trainer as trainer

    run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
              train_fn=fake_trainer([]))
    setting = tmp_path / "tb" / "sw" / slug(0, {"optim.sparse.lr": 0.01})
    trial_config = str(setting / "seed-0" / "config.json")
    calls: list = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kwargs: calls.append(cfg) or {"checkpoint": "x"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = sorted(p.name for p in setting.iterdir())
    for args in ([], ["--run-name", "again"], ["--eval-only", "--checkpoint", str(setting / "seed-0")],
                 ["--tb-dir", str(tmp_path / "tb" / "sw")]):
        result = CliRunner().invoke(cli.main, ["--config", trial_config, *args])
        assert result.exit_code == 2, (args, result.output)
        assert "the run would be written into the sweep " + str(tmp_path / "tb" / "sw") in result.stderr, args
        # (the --run-name it used to advise, seed-0-2, and any other, put the run among the sweep's trials)
    assert calls == [] and sorted(p.name for p in setting.iterdir()) == before
    result = CliRunner().invoke(cli.main, ["--config", trial_config, "--run-name", "again"])
    assert f"add --tb-dir {tmp_path / 'tb'} --run-name sw-00-again (free)" in result.stderr, result.stderr
    # the advice works: a run of its own, outside the sweep
    result = CliRunner().invoke(cli.main, ["--config", trial_config, "--tb-dir", str(tmp_path / "tb"),
                                           "--run-name", "sw-00-again"])
    assert result.exit_code == 0, result.output
    (cfg,) = calls
    assert (cfg.log.tb_dir, cfg.log.run_name) == (str(tmp_path / "tb"), "sw-00-again")
    # a --resume of the trial continues it in place, as before
    result = CliRunner().invoke(cli.main, ["--config", trial_config, "--resume", "latest"])
    assert result.exit_code == 0, result.output
    assert calls[1].log.tb_dir == str(setting) and calls[1].log.run_name == "seed-0"


def test_a_sweep_is_not_written_into_another_sweep(tmp_path, config):
    """A sweep's --tb-dir inside another sweep put its settings and trials among that sweep's (accepted, as a run of
    a trial's config was): refused in one line naming a place outside it, nothing created."""
    run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
              train_fn=fake_trainer([]))
    outer = tmp_path / "tb" / "sw"
    before = sorted(p.name for p in outer.iterdir())
    for tb_dir, name in ((outer, "inner"), (outer / slug(0, {"optim.sparse.lr": 0.01}), None)):
        with pytest.raises(ConfigError) as refused:
            run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tb_dir), run_name=name,
                      train_fn=fake_trainer([]))
        assert f"is inside the sweep {outer}, which holds that sweep's trials only; pick a --tb-dir outside it " \
               f"(--tb-dir {tmp_path / 'tb'})" in str(refused.value)
    assert sorted(p.name for p in outer.iterdir()) == before
    assert [p.name for p in (outer / slug(0, {"optim.sparse.lr": 0.01})).iterdir()] == ["seed-0"]
