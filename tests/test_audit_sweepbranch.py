"""Where a command writes (audit "sweepbranch"), each confirmed before it was fixed:

1. A branch of a sweep trial (``train.py --config <trial>/config.json --resume <trial>/checkpoints/step-N.pt
   --run-name NEW``) was written into the trial's setting directory, beside ``seed-<k>``, where no record of the
   sweep lists it: refused in one line naming a free --tb-dir/--run-name outside the sweep, as `check_outside_sweep`
   refuses a new run there; ``--resume`` of the trial itself (no --run-name, or the trial's) still continues it in
   place. ``--resume --run-name NEW`` of a run that does not exist (a new run from step 0) landed there too: refused
   alike. (--eval-only and --compare from a trial's config were refused already: covered by test_audit_sweeprest.)
2. ``--tb-dir <a file>`` said "log.tb_dir: cannot create ... (File exists)" (train.py, default run name) or "--tb-dir:
   cannot create ... (File exists)" (the sweep): now "... is a file, not a directory", one line, exit 2.
3. A --tb-dir inside another run's directory (its checkpoints/ folder too) or inside the dataset the run reads put
   the new run (or sweep) there without a word: refused in one line naming a place outside it. The data tools
   (synthetic, preprocess, relayout, mlperf_import) wrote a dataset inside another dataset (replaced with it by that
   one's --overwrite), inside or (--overwrite) over a run's directory, or inside a sweep: refused alike.

Fake trainers keep it fast (nothing here trains a step)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrm.sweep import parse_set, run_sweep, slug
from tests.test_audit_sweeprest import SETS, config, fake_trainer  # noqa: F401 - the fixture


@pytest.fixture
def trial(tmp_path, config):  # noqa: F811 - the fixture imported above
    """A finished fake sweep under tmp_path/tb/sw: (its first trial's directory, the sweep directory)."""
    run_sweep(str(config), [parse_set(s) for s in SETS], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
              train_fn=fake_trainer([]))
    sweep = tmp_path / "tb" / "sw"
    return sweep / slug(0, {"optim.sparse.lr": 0.01}) / "seed-0", sweep


@pytest.fixture
def landed(monkeypatch):
    """train.py's trainer replaced by the run directory a resume opens (`RunDirectory.for_resume`, what the real
    one does first) or a new run's: where each call would write, nothing trained."""
    import dlrm.train.trainer as trainer
    from dlrm.train.run_dir import RunDirectory

    places: list[Path] = []

    def train(cfg, resume=None, **kwargs):
        from dlrm.train.resume_policy import checkpoint_to_resume

        checkpoint, latest = checkpoint_to_resume(cfg, resume) if resume is not None else (None, None)
        if checkpoint is not None:
            run, _ = RunDirectory.for_resume(cfg, checkpoint, latest)
        else:
            run = RunDirectory.create(cfg)
        places.append(run.path)
        run.close()
        return {"checkpoint": "x"}

    monkeypatch.setattr(trainer, "train", train)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return places


def _main(args):
    import dlrm.cli as cli

    return CliRunner().invoke(cli.main, args)


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.output)
    return lines[0]


# -- 1: a branch of a trial -------------------------------------------------------------------------------------------


def test_a_branch_of_a_trial_is_not_written_into_the_sweep(tmp_path, trial, landed):
    directory, sweep = trial
    setting, checkpoint = directory.parent, str(directory / "checkpoints" / "step-00000002.pt")
    before = sorted(p.name for p in setting.iterdir())
    result = _main(["--config", str(directory / "config.json"), "--resume", checkpoint, "--run-name", "branch"])
    line = _one_error_line(result)
    assert f"the branch 'branch' from {checkpoint} would be written into the sweep {sweep}" in line, line
    assert f"add --tb-dir {tmp_path / 'tb'} --run-name sw-00-branch (free) to branch outside it" in line, line
    assert landed == [] and sorted(p.name for p in setting.iterdir()) == before  # (it used to land in setting/branch)
    # a --tb-dir naming the sweep itself or its setting, with any config: refused alike
    result = _main(["--config", str(directory / "config.json"), "--resume", checkpoint, "--run-name", "b",
                    "--tb-dir", str(sweep)])
    assert "would be written into the sweep" in _one_error_line(result)
    # `--resume --run-name NEW` of no run yet starts a new one from step 0: it landed in the setting directory too
    result = _main(["--config", str(directory / "config.json"), "--resume", "--run-name", "newone"])
    line = _one_error_line(result)
    assert f"the run would be written into the sweep {sweep}" in line and "--run-name sw-00-newone (free)" in line
    # the advice works: the branch outside the sweep
    result = _main(["--config", str(directory / "config.json"), "--resume", checkpoint, "--tb-dir",
                    str(tmp_path / "tb"), "--run-name", "sw-00-branch"])
    assert result.exit_code == 0, result.output
    assert landed == [tmp_path / "tb" / "sw-00-branch"]
    # the trial itself continues in place: by its checkpoint, by its checkpoint and its own name, by its name
    for args in (["--resume", checkpoint], ["--resume", checkpoint, "--run-name", "seed-0"], ["--resume"]):
        result = _main(["--config", str(directory / "config.json"), *args])
        assert result.exit_code == 0, (args, result.output)
        assert landed[-1] == directory, args
    assert sorted(p.name for p in setting.iterdir()) == before


# -- 2: a --tb-dir that is a file -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [[], ["--run-name", "r"]])
@pytest.mark.parametrize("below", [False, True])
def test_a_tb_dir_that_is_a_file_is_said_so(tmp_path, config, landed, name, below):  # noqa: F811
    (tmp_path / "notes").write_text("mine")
    tb_dir = tmp_path / "notes" / "sub" if below else tmp_path / "notes"
    line = _one_error_line(_main(["--config", str(config), "--tb-dir", str(tb_dir), *name]))
    where = f"{tb_dir}: {tmp_path / 'notes'} is" if below else f"{tb_dir} is"
    assert f"--tb-dir: {where} a file, not a directory; pick another --tb-dir" in line, line
    assert "File exists" not in line and landed == [] and (tmp_path / "notes").read_text() == "mine"


@pytest.mark.parametrize("name", [[], ["--run-name", "sw"]])
def test_a_sweep_tb_dir_that_is_a_file_is_said_so(tmp_path, config, name):  # noqa: F811
    from dlrm import sweep

    (tmp_path / "notes").write_text("mine")
    result = CliRunner().invoke(sweep.main, ["--config", str(config), "--set", SETS[0], "--seeds", "1",
                                             "--tb-dir", str(tmp_path / "notes"), *name])
    line = _one_error_line(result)
    assert f"--tb-dir: {tmp_path / 'notes'} is a file, not a directory; pick another --tb-dir" in line, line
    assert (tmp_path / "notes").read_text() == "mine"


# -- 3: a --tb-dir that belongs to something else ---------------------------------------------------------------------


def test_a_run_is_not_written_into_another_run_nor_the_dataset(tmp_path, config, landed):  # noqa: F811
    result = _main(["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--run-name", "r1"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "tb" / "r1"
    (run / "checkpoints").mkdir()  # (what a run writes: a fake trainer wrote config.json only)
    before = sorted(p.name for p in run.iterdir())
    for tb_dir in (run, run / "checkpoints", run / "checkpoints" / "deeper"):
        for args in (["--run-name", "r2"], [], ["--eval-only", "--checkpoint", str(run)]):
            line = _one_error_line(_main(["--config", str(config), "--tb-dir", str(tb_dir), *args]))
            assert f"--tb-dir: {tb_dir} is inside the run directory {run}, which holds that run's files only; pick " \
                   f"a --tb-dir outside it (--tb-dir {tmp_path / 'tb'})" in line, (tb_dir, args, line)
    assert sorted(p.name for p in run.iterdir()) == before and list((run / "checkpoints").iterdir()) == []
    dataset = tmp_path / "ds"
    files = sorted(p.name for p in dataset.iterdir())
    for tb_dir in (dataset, dataset / "tb"):
        line = _one_error_line(_main(["--config", str(config), "--tb-dir", str(tb_dir), "--run-name", "r3"]))
        assert f"--tb-dir: {tb_dir} is inside the dataset {dataset}, which a tool's --overwrite replaces whole" in line
    assert sorted(p.name for p in dataset.iterdir()) == files and landed == [run]
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "other", {"train": 8, "validation": 8})  # any dataset, not the run's own
    line = _one_error_line(_main(["--config", str(config), "--tb-dir", str(tmp_path / "other" / "tb")]))
    assert f"--tb-dir: {tmp_path / 'other' / 'tb'} is inside the dataset {tmp_path / 'other'}" in line, line
    # a branch of r1 into r1 is refused too; beside it, and r1 --resume'd in place, are fine
    (run / "checkpoints" / "step-00000002.pt").write_bytes(b"x")
    line = _one_error_line(_main(["--config", str(run / "config.json"), "--resume",
                                  str(run / "checkpoints" / "step-00000002.pt"), "--tb-dir", str(run),
                                  "--run-name", "b"]))
    assert f"is inside the run directory {run}" in line
    for args in (["--run-name", "b"], []):
        result = _main(["--config", str(run / "config.json"), "--resume", str(run / "checkpoints" /
                                                                             "step-00000002.pt"), *args])
        assert result.exit_code == 0, result.output
    assert landed[1:] == [tmp_path / "tb" / "b", run]


def test_a_sweep_is_not_written_into_a_run_nor_its_dataset(tmp_path, config, landed):  # noqa: F811
    from dlrm import sweep

    assert _main(["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--run-name", "r1"]).exit_code == 0
    (tmp_path / "tb" / "r1" / "summary.json").write_text("{}")
    for tb_dir, said in ((tmp_path / "tb" / "r1", f"inside the run directory {tmp_path / 'tb' / 'r1'}"),
                         (tmp_path / "ds" / "x", f"inside the dataset {tmp_path / 'ds'}")):
        result = CliRunner().invoke(sweep.main, ["--config", str(config), "--set", SETS[0], "--seeds", "1",
                                                 "--tb-dir", str(tb_dir), "--run-name", "sw"])
        line = _one_error_line(result)
        assert f"--tb-dir: {tb_dir} is {said}" in line, line
        assert not (tb_dir / "sw").exists()


# -- 3 (the data tools): a dataset written into a dataset, a run or a sweep ---------------------------------------------


def test_a_dataset_is_not_written_into_another_dataset_a_run_or_a_sweep(tmp_path, trial, landed):
    """synthetic, relayout, mlperf_import and preprocess wrote their dataset there: inside another dataset (whose
    --overwrite, a tool's, replaces it whole, the inner one with it), inside a run (or over it, with --overwrite),
    inside a sweep. Refused in one line, nothing written."""
    from dlrm.data import mlperf_import, relayout, synthetic
    from tests.test_preprocess_cli_errors import assert_one_line_error, raw_lines, run_cli

    _, sweep = trial
    assert _main(["--config", str(tmp_path / "tiny.json"), "--tb-dir", str(tmp_path / "tb"),
                  "--run-name", "r1"]).exit_code == 0
    run = tmp_path / "tb" / "r1"
    (run / "summary.json").write_text("{}")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.tsv").write_text(raw_lines(20))
    cases = ((tmp_path / "ds" / "inner", f"the dataset {tmp_path / 'ds'}"), (run / "data", f"the run directory {run}"),
             (run, f"the run directory {run}"), (sweep / "data", f"the sweep {sweep}"))
    for out, owner in cases:
        before = sorted(p.name for p in out.parent.iterdir())
        result = CliRunner().invoke(synthetic.main, ["--rows", "50", "--out", str(out), "--overwrite"])
        assert result.exit_code != 0 and f"--out {out} is inside {owner}, which belongs to it" in result.output, \
            (out, result.output)
        assert_one_line_error(run_cli("-i", tmp_path / "in" / "a.tsv", "-o", out, "--overwrite"),
                              f"--output {out} is inside {owner}, which belongs to it")
        if out.parent != tmp_path / "ds":  # (relayout of ds into ds: its own --data check says so)
            result = CliRunner().invoke(relayout.main, ["--data", str(tmp_path / "ds"), "--output", str(out),
                                                        "--overwrite"])
            assert result.exit_code == 2 and f"--output {out} is inside {owner}, which belongs" in result.output
        result = CliRunner().invoke(mlperf_import.main, ["--input", str(tmp_path / "in"), "--output", str(out),
                                                         "--train-days", "0", "--num-embeddings", ",".join(["5"] * 26),
                                                         "--overwrite"])
        assert result.exit_code == 2 and f"--output {out} is inside {owner}, which belongs" in result.output, \
            result.output
        assert sorted(p.name for p in out.parent.iterdir()) == before, out
