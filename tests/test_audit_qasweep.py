"""QA pass over ``python -m dlrm.sweep`` (2026-12-04): a key swept both alone and inside a swept section's value, and
a sweep stopped while it writes its report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from dlrm.config import ConfigError
from dlrm.sweep import parse_set, run_sweep
from tests.conftest import REPO, make_dataset
from tests.test_sweep import BASE


@pytest.fixture
def config(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def fake_trial(cfg, run_dir=None, resume=None):
    return {"auc": 0.6 + cfg.optim.sparse.lr, "logloss": 0.5, "steps": 4, "run_dir": str(run_dir)}


@pytest.mark.parametrize("sets, named", [
    # every setting trained lr 0.1 (the key is applied after the section), labelled optim.sparse={"lr": 0.2} too
    (["optim.sparse.lr=0.1", 'optim.sparse={"lr": 0.2}'], 'optim.sparse={"lr": 0.2} sets optim.sparse.lr'),
    (['optim.sparse={"name": "adagrad"},{"lr": 0.2}', "optim.sparse.lr=0.1,0.3"],
     'optim.sparse={"lr": 0.2} sets optim.sparse.lr'),
    (['optim={"sparse": {"lr": 1}}', "optim.sparse.lr=0.1"], 'optim={"sparse": {"lr": 1}} sets optim.sparse.lr'),
    (["train.compile=true,false", "train.compile.enabled=false"], "train.compile=true sets train.compile.enabled"),
])
def test_a_key_swept_alone_and_inside_a_swept_section_is_refused_before_anything_trains(tmp_path, config, sets,
                                                                                         named):
    with pytest.raises(ConfigError) as err:
        run_sweep(str(config), [parse_set(s) for s in sets], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
                  train_fn=fake_trial)
    assert named in str(err.value) and "in one --set only" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "tb" / "sw").exists()


def test_a_section_value_that_leaves_the_swept_key_out_is_a_product(tmp_path, config):
    trained = []

    def trial(cfg, run_dir=None, resume=None):
        trained.append((cfg.optim.sparse.name, cfg.optim.sparse.lr))
        return fake_trial(cfg, run_dir)

    sets = [parse_set('optim.sparse={"name": "adagrad"},{"name": "rowwise_adagrad"}'), parse_set("optim.sparse.lr=0.1")]
    directory, _ = run_sweep(str(config), sets, 1, tb_dir=str(tmp_path), run_name="sw", train_fn=trial)
    assert trained == [("adagrad", 0.1), ("rowwise_adagrad", 0.1)] and (directory / "sweep.md").is_file()


def test_the_command_refuses_it_in_one_line_with_exit_2(tmp_path, config):
    res = subprocess.run([sys.executable, "-m", "dlrm.sweep", "--config", str(config), "--set", "optim.sparse.lr=0.1",
                          "--set", 'optim.sparse={"lr": 0.2}', "--seeds", "1", "--tb-dir", str(tmp_path / "tb")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "sets optim.sparse.lr, which --set" in lines[0], res.stderr
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())


# -- a sweep stopped while it writes its report ------------------------------------------------------------------


def summary_trial(cfg, run_dir=None, resume=None):
    """A trainer writing summary.json as a run does (so --resume gathers it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {**fake_trial(cfg, run_dir), "config": cfg.to_dict()}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def not_trained(cfg, run_dir=None, resume=None):
    raise AssertionError(f"trained again: {run_dir or resume}")


class Stopped(Exception):
    pass


@pytest.fixture
def sigterm_raises():
    """SIGTERM raises where it arrives, as `dlrm.stop_signal.StopAtOnce` makes it in the sweep command."""
    def handler(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_while_the_report_is_written_says_how_to_finish_it(tmp_path, config, monkeypatch):
    """Every trial had finished; a Ctrl-C while TensorBoard's HParams were written ended the sweep with "interrupted
    (Ctrl-C)" alone: no report and no word of the --resume that writes it (a stop during a trial names it)."""
    from dlrm import sweep_report
    from dlrm.sweep import stopped_line
    from dlrm.sweep_resume import resume_sweep

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_report, "write_hparams", interrupted)
    with pytest.raises(KeyboardInterrupt) as err:
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=summary_trial)
    directory = tmp_path / "sw"
    line = stopped_line(err.value)
    assert line is not None and f"python -m dlrm.sweep --resume {directory}` writes it" in line, line
    assert not (directory / "sweep.md").exists()
    monkeypatch.undo()
    resume_sweep(directory, train_fn=not_trained)  # the report, of the trials as they finished
    assert (directory / "sweep.md").is_file() and len(list((directory / "hparams").iterdir())) == 2


def test_a_signal_while_the_report_is_published_leaves_all_of_it_or_none(tmp_path, config, monkeypatch,
                                                                          sigterm_raises):
    """The tables' renames deferred a signal to their end, where it stopped the sweep before ``hparams/`` was put in
    place: new tables without their HParams (on a --resume, beside the earlier session's ``hparams/``)."""
    real_replace = os.replace

    def replace_then_signal(src, dst):
        real_replace(src, dst)
        if os.path.basename(dst) == "sweep.csv":  # the first table in place
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "replace", replace_then_signal)
    with pytest.raises(Stopped):  # the signal still acts, once the report is published
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=summary_trial)
    directory = tmp_path / "sw"
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith("0")) == [
        "hparams", "sweep.csv", "sweep.json", "sweep.md", "trials.csv"]
    assert len(list((directory / "hparams").iterdir())) == 2
    # a --resume's report over an earlier one: the new tables with the new hparams/, and the old one gone
    from dlrm.sweep_resume import resume_sweep

    (directory / "hparams" / "mark").write_text("the earlier session's")
    with pytest.raises(Stopped):
        resume_sweep(directory, train_fn=not_trained)
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith("0")) == [
        "hparams", "sweep.csv", "sweep.json", "sweep.md", "trials.csv"]
    assert not (directory / "hparams" / "mark").exists() and len(list((directory / "hparams").iterdir())) == 2


# -- a --set of a whole section that is not an object -------------------------------------------------------------


@pytest.mark.parametrize("option, shown", [("train=5", "got 5"), ("train=null", "got None")])
def test_a_set_section_that_is_no_object_is_blamed_on_the_command_line_not_the_file(tmp_path, config, option, shown):
    """Every trial sets train.seed (and log.*) inside it: the error came from that key's parent, and named the config
    file ("tiny.json: train: expected an object, got 5"), whose train section is fine."""
    with pytest.raises(ConfigError) as err:
        run_sweep(str(config), [parse_set(option)], 1, tb_dir=str(tmp_path / "tb"), run_name="sw", train_fn=fake_trial)
    assert str(err.value) == f"--set {option}: command line: train: expected an object, {shown}"
    assert not (tmp_path / "tb" / "sw").exists()


def test_a_file_section_that_is_no_object_is_still_the_files(tmp_path):
    from dlrm.config import load_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": 5}))
    with pytest.raises(ConfigError, match=rf"^{path}: train: expected an object, got 5$"):
        load_config(path, {"train.seed": 1})


# -- --resume of what is not a sweep's directory ------------------------------------------------------------------


def test_resume_of_a_trial_or_a_file_names_what_to_resume(tmp_path, config):
    """A trial's directory (the one its stop's log line names) was "holds no sweep.json: not the directory of a
    sweep", and a file "no such sweep directory"."""
    from dlrm.sweep_resume import resume_sweep

    directory, _ = run_sweep(str(config), [parse_set("optim.sparse.lr=0.01")], 1, tb_dir=str(tmp_path),
                             run_name="sw", train_fn=summary_trial)
    trial = directory / "00-sparse.lr=0.01" / "seed-0"
    for inside in (trial, trial.parent, directory / "hparams"):
        with pytest.raises(ConfigError) as err:
            resume_sweep(inside, train_fn=not_trained)
        assert str(err.value) == f"--resume: {inside} is inside the sweep {directory}; a sweep is resumed as a " \
                                 f"whole: --resume {directory}"
    with pytest.raises(ConfigError, match=rf"^--resume: {config}: a file, not a sweep directory$"):
        resume_sweep(config, train_fn=not_trained)
    with pytest.raises(ConfigError, match=r"holds no sweep.json: not the directory of a sweep"):
        resume_sweep(tmp_path, train_fn=not_trained)  # (above the sweep: not inside one)


# -- --data / --device beside a --set of the key they set ----------------------------------------------------------


@pytest.mark.parametrize("option, dotted, values", [
    ("--data", "data.path", "{other}"), ("--data", "data", '{{"path": "{other}"}}'),
    ("--device", "train.device", "cpu,auto"),
])
def test_an_option_beside_a_set_of_its_key_is_refused(tmp_path, config, option, dotted, values):
    """``--data A --set data.path=B`` trained every setting on B: --data, which "overrides data.path in every trial",
    was dropped without a word."""
    other = tmp_path / "other"
    make_dataset(other, {"train": 16, "validation": 8}, row_group_size=8)
    base = {"data.path": str(tmp_path / "ds")} if option == "--data" else {"train.device": "cpu"}
    with pytest.raises(ConfigError) as err:
        run_sweep(str(config), [parse_set(f"{dotted}={values.format(other=other)}")], 1, base,
                  tb_dir=str(tmp_path / "tb"), run_name="sw", train_fn=fake_trial)
    key = "data.path" if option == "--data" else "train.device"
    assert str(err.value).startswith(f"{option} and --set {dotted}=") and str(err.value).endswith(
        f"both set {key}; give one of them")
    assert not (tmp_path / "tb" / "sw").exists()


def test_an_option_beside_a_section_that_leaves_its_key_out_is_accepted(tmp_path, config):
    trained = []

    def trial(cfg, run_dir=None, resume=None):
        trained.append((cfg.data.path, cfg.data.batch_size))
        return fake_trial(cfg, run_dir)

    run_sweep(str(config), [parse_set('data={"batch_size": 8}')], 1, {"data.path": str(tmp_path / "ds")},
              tb_dir=str(tmp_path), run_name="sw", train_fn=trial)
    assert trained == [(str(tmp_path / "ds"), 8)]


def test_too_many_seeds_are_named_as_seeds(tmp_path, config):
    """It was "command line: train.seed: 9223372036854775808 is out of range", a key the user never gave."""
    with pytest.raises(ConfigError, match=r"^--seeds: 9223372036854775809 must be <= 2\*\*63 "):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.1")], 2**63 + 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trial)
    assert not (tmp_path / "sw").exists()


def test_a_setting_that_evaluates_a_split_its_dataset_lacks_is_refused_before_the_first_trial(tmp_path, config):
    """``--set data.eval_split=validation,test`` of a dataset without a test split: the test setting's every trial
    failed once it read the dataset, after the other settings had trained, and the sweep exited 2 only then."""
    from dlrm.errors import DatasetError
    from dlrm.sweep_checks import check_datasets

    nosplit = tmp_path / "notest"
    make_dataset(nosplit, {"train": 16, "validation": 8}, row_group_size=8)
    settings = [{"data.eval_split": "validation"}, {"data.eval_split": "test"}]
    with pytest.raises(DatasetError) as err:
        check_datasets(str(config), {"data.path": str(nosplit)}, settings, str(tmp_path))
    assert str(err.value) == (f'--set data.eval_split="test": {nosplit}/metadata.json: splits: has no \'test\' split '
                              "(it has: train, validation)")
    check_datasets(str(config), {"data.path": str(nosplit)}, settings[:1], str(tmp_path))  # (validation: there)


# -- a dataset replaced between a sweep's sessions -----------------------------------------------------------------


def test_a_resume_on_a_dataset_replaced_since_the_sweep_began_is_refused(tmp_path, config):
    """The sweep stopped after its first trial; the dataset was regenerated (other rows, other positives); the resume
    gathered that trial and trained the rest on the new data: one table and verdict over two datasets, without a
    word. The same dataset made again (the same metadata) resumes."""
    import shutil

    from dlrm.sweep_resume import resume_sweep

    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=stopped_at_second)
    directory, data = tmp_path / "sw", tmp_path / "ds"
    shutil.move(data, tmp_path / "ds.first")
    make_dataset(data, {"train": 16, "validation": 8}, row_group_size=8, seed=1)
    with pytest.raises(ConfigError) as err:
        resume_sweep(directory, train_fn=summary_trial)
    assert str(err.value).startswith(f"--resume: the dataset {data} is not the one the sweep in {directory} began on")
    assert "\n" not in str(err.value) and not (directory / "sweep.md").exists()
    shutil.rmtree(data)
    shutil.move(tmp_path / "ds.first", data)
    resume_sweep(directory, train_fn=summary_trial)
    assert (directory / "sweep.md").is_file()


def test_the_stop_line_claims_no_checkpoint_a_stopped_trial_never_wrote(tmp_path, config):
    """A stop between two trials (or before a trial's first checkpoint) said "the stopped one resumes from its
    checkpoint": there was none; --resume trains such a trial afresh."""
    from dlrm.sweep import stopped_line

    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt  # (before the trial's first step: no checkpoint)
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt) as err:
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=stopped_at_second)
    assert stopped_line(err.value).endswith("(the finished trials are kept; a stopped one resumes from its last "
                                            "checkpoint, or starts again if it wrote none)")


def test_a_resume_whose_config_file_moved_says_to_name_it(tmp_path, config):
    """It said "<path>: config file not found", of a --config never given: the one sweep.json records."""
    from dlrm.sweep_resume import resume_sweep

    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=stopped_at_second)
    moved = config.rename(tmp_path / "moved.json")
    directory = tmp_path / "sw"
    with pytest.raises(ConfigError) as err:
        resume_sweep(directory, train_fn=summary_trial)
    assert str(err.value) == (f"--resume: {config}: the config file {directory / 'sweep.json'} records is not found "
                              "(or not a regular file); give --config with its path now")
    resume_sweep(directory, str(moved), train_fn=summary_trial)
    assert (directory / "sweep.md").is_file()


def test_the_help_names_every_exit_code_a_sweep_ends_with():
    """A stopped sweep exits 130 (Ctrl-C) or 143 (SIGTERM), which --help left out of its list of exit codes."""
    from click.testing import CliRunner

    from dlrm.sweep import main

    text = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    assert "130 Ctrl-C, 143 SIGTERM (--resume SWEEP_DIR finishes the sweep)" in text


@pytest.mark.parametrize("option", ['train={"seed": 5}', 'train={"max_steps": 4},{"seed": 1, "max_steps": 4}'])
def test_a_train_section_value_that_sets_the_seed_is_refused(option):
    """``--set train.seed=...`` is refused (the seeds come from --seeds); ``--set 'train={"seed": 5}'`` was accepted,
    and every trial trained its --seeds seed under a label saying seed 5."""
    with pytest.raises(ConfigError, match=r"^--set train: a value sets train.seed; the seeds come from --seeds"):
        parse_set(option)
    assert parse_set('train={"max_steps": 4}') == ("train", [{"max_steps": 4}])


def test_a_bad_key_inside_a_set_section_is_blamed_on_the_command_line(tmp_path, config):
    """``--set 'model={..., "cardinalities": [5]}'`` replaces the file's model section; its error named the file
    ("tiny.json: model.cardinalities: has 1 entries"), whose model section holds no such key."""
    section = '{"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], "cardinalities": [5]}'
    with pytest.raises(ConfigError) as err:
        run_sweep(str(config), [parse_set(f"model={section}")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=fake_trial)
    assert str(err.value).endswith(": command line: model.cardinalities: has 1 entries, expected 26"), str(err.value)
    from dlrm.config import load_config

    raw = json.loads(config.read_text())
    raw["model"]["cardinalities"] = [5]
    config.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"^{config}: model.cardinalities: has 1 entries"):  # (the file's: its own)
        load_config(config, {"model.dropout": 0.1})


# -- a hand-edited sweep.json ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, message", [
    # each was refused as the command line's ("command line: optim.sparse.lrr: unknown key", "--set: a key is given
    # twice") though the command was `--resume DIR` alone; the nested and seed ones trained under a misleading label
    (lambda r: r["sets"].__setitem__(0, ["optim.sparse.lrr", [0.01, 0.03]]),
     "sets: 'optim.sparse.lrr' is not a config key"),
    (lambda r: r["sets"].append(["optim.sparse.lr", [0.2]]), "sets: 'optim.sparse.lr' is given twice"),
    (lambda r: r["base"].__setitem__("model.foo", 1), "base: 'model.foo' is not a config key"),
    (lambda r: r["sets"].append(["optim.sparse", [{"lr": 0.3}]]),
     'sets: --set optim.sparse={"lr": 0.3} sets optim.sparse.lr'),
    (lambda r: r["sets"].append(["train", [{"seed": 3}]]), "sets: 'train': a value sets train.seed"),
    # a value of a wrong type, in the first setting, a later one, the base; seeds past int64: "command line: ..."
    (lambda r: r["sets"][0].__setitem__(1, ["a", "b"]), "sets: optim.sparse.lr: expected a number, got 'a'"),
    (lambda r: r["sets"][0].__setitem__(1, [0.01, "b"]), "sets: optim.sparse.lr: expected a number, got 'b'"),
    (lambda r: r["base"].__setitem__("train.device", "cpux"), "base: train.device: 'cpux' is not one of"),
    (lambda r: r.__setitem__("seeds", 2**70), f"seeds: {2**70} must be <= 2**63"),
])
def test_a_hand_edited_record_is_refused_naming_it(tmp_path, config, edit, message):
    from dlrm.sweep_resume import resume_sweep

    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=stopped_at_second)
    record = tmp_path / "sw" / "sweep.json"
    raw = json.loads(record.read_text())
    edit(raw)
    record.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        resume_sweep(tmp_path / "sw", train_fn=not_trained)
    assert str(err.value).startswith(f"--resume: {record}: {message}"), str(err.value)


def test_a_bad_value_the_resume_command_gives_is_still_the_command_lines(tmp_path, config):
    """Only what sweep.json alone gives is blamed on it: a bad --device, or a --set that repeats the record's bad
    values, is the command line's."""
    from dlrm.sweep_resume import resume_sweep

    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=stopped_at_second)
    with pytest.raises(ConfigError, match=r"^command line: train.device: 'cpux' is not one of"):
        resume_sweep(tmp_path / "sw", base={"train.device": "cpux"}, train_fn=not_trained)
    record = tmp_path / "sw" / "sweep.json"
    raw = json.loads(record.read_text())
    raw["sets"][0][1] = ["a", "b"]
    record.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"^command line: optim.sparse.lr: expected a number, got 'a'$"):
        resume_sweep(tmp_path / "sw", sets=[parse_set("optim.sparse.lr=a,b")], train_fn=not_trained)
    res = subprocess.run([sys.executable, "-m", "dlrm.sweep", "--resume", str(tmp_path / "sw")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].endswith(f"--resume: {record}: sets: optim.sparse.lr: expected a number, got 'a'"), res.stderr


def test_resume_with_data_beside_the_recorded_set_of_data_path_is_refused(tmp_path, config):
    """``--resume DIR --data X`` of a sweep of ``--set data.path=...`` was accepted and X ignored (the record's
    settings set data.path over it: no difference was seen)."""
    from dlrm.sweep_resume import resume_sweep

    def stopped_at_second(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt
        return summary_trial(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(config), [parse_set(f"data.path={tmp_path / 'ds'}"), parse_set("optim.sparse.lr=0.01,0.03")], 1,
                  tb_dir=str(tmp_path), run_name="sw", train_fn=stopped_at_second)
    with pytest.raises(ConfigError) as err:
        resume_sweep(tmp_path / "sw", base={"data.path": str(tmp_path / "elsewhere")}, train_fn=summary_trial)
    assert str(err.value) == (f'--resume: --data and --set data.path="{tmp_path / "ds"}" both set data.path; the sweep '
                              f'({tmp_path / "sw" / "sweep.json"}) sweeps it: leave --data out')
    resume_sweep(tmp_path / "sw", train_fn=summary_trial)
    assert (tmp_path / "sw" / "sweep.md").is_file()
