"""Two processes on the same files at once: what one decided before taking a lock must still hold under it, and a
lock must keep the second writer off for real (audit: concurrency)."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dlrm.config import ConfigError, load_config
from dlrm.train import trainer as trainer_mod
from dlrm.train.run_dir import RunLock
from tests.conftest import make_dataset

BASE = {
    "data": {"batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "max_steps": 10, "log_every": 5, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 5, "keep": 5},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrent") / "ds"
    make_dataset(root, {"train": 200, "validation": 32}, row_group_size=50)
    return root


def write_config(tmp_path: Path, dataset: Path, run_name: str = "r") -> Path:
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    raw["log"] = {"tb_dir": str(tmp_path / "tb"), "run_name": run_name}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resume_refuses_a_checkpoint_written_after_it_looked(tmp_path, dataset, monkeypatch):
    """A --resume looks for the run's latest checkpoint, builds the data and the model (seconds), and only then takes
    the run's lock. Another process that held the run meanwhile (a stopped job saving its last checkpoint, a run
    finishing) may have written a later checkpoint and summary.json: resumed from the older one in place, they were
    trained over (here with another learning rate: the finished run's final model and summary replaced)."""
    cfg_path = write_config(tmp_path, dataset)
    trainer_mod.train(load_config(cfg_path, {}))  # the other process's run: steps 5 and 10, summary.json
    run = tmp_path / "tb" / "r"
    later, summary = run / "checkpoints" / "step-00000010.pt", run / "summary.json"
    before = {p: sha(p) for p in (later, summary)}
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in (later, summary):  # as the run stood when the resume looked: at step 5, still training
        shutil.move(p, aside / p.name)
    real_build_run = trainer_mod.build_run

    def build_run_while_the_other_finishes(*args, **kwargs):
        for p in (later, summary):  # the other process's last save and summary, then its exit (lock released)
            shutil.move(aside / p.name, p)
        return real_build_run(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "build_run", build_run_while_the_other_finishes)
    with pytest.raises(ConfigError, match=r"got a later checkpoint \(step-00000010\.pt\) since this resume looked"):
        trainer_mod.train(load_config(cfg_path, {"optim.dense.lr": 0.5}), resume="latest",
                          allow_config_change=["optim.dense.lr"])
    assert {p: sha(p) for p in (later, summary)} == before  # the other process's results, untouched
    RunLock.acquire(run).release()  # the refused resume released the run's lock


def test_two_sweeps_of_one_name_started_together_do_not_share_the_directory(tmp_path, dataset):
    """Both sweeps check that <tb-dir>/<run-name> is new or empty, then write sweep.json and lock it. Checked before
    either wrote, the second's record replaced the first's (renamed over it) and its lock was on the new file, beside
    the first's lock on the replaced one: both ran, in one directory, and a --resume trained the second's grid."""
    from dlrm.sweep import sweep_directory
    from dlrm.sweep_resume import RECORD, SweepLock, write_record

    cfg_path = str(write_config(tmp_path, dataset))
    first, _ = sweep_directory(str(tmp_path / "tb"), "sw", cfg_path)
    second, _ = sweep_directory(str(tmp_path / "tb"), "sw", cfg_path)  # looked before the first wrote its record
    assert first == second
    lock = write_record(first, cfg_path, [("optim.dense.lr", [0.01, 0.02])], 1, {})
    try:
        with pytest.raises(ConfigError, match="was taken by another sweep started at the same time"):
            write_record(second, cfg_path, [("model.dropout", [0.0, 0.5])], 1, {})
        assert json.loads((first / RECORD).read_text())["sets"] == [["optim.dense.lr", [0.01, 0.02]]]
        assert sorted(p.name for p in first.iterdir()) == [RECORD]  # no staging file of the refused one left
        with pytest.raises(ConfigError, match="in use by another sweep process"):
            SweepLock.acquire(first)  # the first sweep's lock is on the record that is there
    finally:
        lock.release()


def test_a_dataset_a_run_reads_is_not_replaced_under_it(tmp_path, monkeypatch):
    """The generator's --overwrite of the dataset a training run was reading replaced it under the run: its later
    epochs trained on the new dataset's rows without a word (seen with two processes: train.py --epochs 30 and
    `python -m dlrm.data.synthetic --out D --seed 2 --overwrite`; its evaluation then failed on a validation file
    "that cannot be read"). The writer is refused now, naming the run's process; the run reads its own data."""
    import click

    from dlrm.data.synthetic import generate

    data = tmp_path / "D"
    generate(data, rows=600, seed=1)
    before = (data / "metadata.json").read_text()
    refusals = []
    real_build_run = trainer_mod.build_run

    def build_run_while_the_data_is_regenerated(*args, **kwargs):
        try:
            generate(data, rows=600, seed=2, overwrite=True)  # (another process, in the test this one)
        except click.ClickException as e:
            refusals.append(e.format_message())
        return real_build_run(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "build_run", build_run_while_the_data_is_regenerated)
    trainer_mod.train(load_config(write_config(tmp_path, data), {"train.max_steps": 2}))
    assert (data / "metadata.json").read_text() == before  # the dataset the run trained on, still there
    assert len(refusals) == 1 and f"in use by pid {__import__('os').getpid()} on " in refusals[0]
    assert not list(tmp_path.glob(".D.lock"))  # the run's lock went with it
    generate(data, rows=600, seed=2, overwrite=True)  # free again once the run ended


def test_a_run_is_refused_while_a_tool_writes_its_dataset(tmp_path, dataset):
    """... and a run started while a tool writes the dataset is refused in one line (it read the old one, which the
    tool then replaced under it)."""
    from dlrm.data.output_dirs import output_lock

    with output_lock(dataset, "--out"):
        with pytest.raises(ConfigError, match=r"data\.path .*: being written by pid \d+ on .* wait for it to finish"):
            trainer_mod.train(load_config(write_config(tmp_path, dataset), {"train.max_steps": 2}))
    assert not (tmp_path / "tb" / "r").exists()


def test_a_new_run_refused_a_running_runs_directory_is_not_told_to_resume_it(tmp_path, dataset):
    """Two `train.py --run-name same` started together: the one that lost was refused with "it holds a run stopped
    before its first checkpoint: --resume starts it again" (seen with two processes), of a run that was running, and
    whose lock a --resume is refused by. It is told that a run is writing it, and by whom."""
    import os

    from dlrm.train.run_dir import RunDirectory

    cfg = load_config(write_config(tmp_path, dataset), {})
    running = RunDirectory.create(cfg)  # the other process's run, started a moment earlier: config.json, its lock
    try:
        with pytest.raises(ConfigError) as refused:
            RunDirectory.create(cfg)
        message = str(refused.value)
        assert "already exists and is not empty" in message
        assert f"a run is writing it now (pid {os.getpid()} on " in message and "--resume" not in message
    finally:
        running.close()
    with pytest.raises(ConfigError, match="stopped before its first checkpoint: --resume starts it again"):
        RunDirectory.create(cfg)  # stopped now: --resume is the advice that works


def test_eval_only_and_export_hold_the_dataset_too(tmp_path, dataset):
    """--eval-only and --export of a --checkpoint read the dataset as training does (its tables, its splits)."""
    from dlrm import cli
    from dlrm.data.output_dirs import output_lock

    cfg_path = write_config(tmp_path, dataset, run_name="ev")
    for eval_only, export in ((True, None), (False, str(tmp_path / "m.pt2"))):
        with output_lock(dataset, "--out"):
            with pytest.raises(ConfigError, match=r"data\.path .*: being written by pid \d+ on "):
                cli.run(config_path=str(cfg_path), overrides={}, eval_only=eval_only, compare=None, resume=None,
                        checkpoint_path=str(tmp_path / "none.pt"), export_path=export, allowed_changes=[], loaded=[])
    assert not (tmp_path / "tb").exists() and not (tmp_path / "m.pt2").exists()


def test_relayout_holds_its_data_while_it_copies_it(tmp_path, dataset):
    """relayout's --data is read file by file: a tool replacing it meanwhile gave the copy the new dataset's files."""
    import click

    from dlrm.data.output_dirs import output_lock
    from dlrm.data.relayout import relayout

    with output_lock(dataset, "--out"):
        with pytest.raises(click.ClickException, match=r"--data .*: being written by pid \d+ on "):
            relayout(dataset, tmp_path / "copy", "lists")
    assert not (tmp_path / "copy").exists()
    relayout(dataset, tmp_path / "copy", "lists")  # once the writer is gone
    assert (tmp_path / "copy" / "metadata.json").is_file()


def test_a_nested_hold_of_one_dataset_takes_one_lock_and_keeps_it_until_the_outer_ends(tmp_path, monkeypatch):
    """`dlrm.cli.run` holds the dataset around `train`, which holds it too: the inner hold is counted, not a second
    flock (on NFS, whose flock is a POSIX lock per process, the inner release dropped the outer hold and removed the
    file), and the lock file stays until the outer hold ends."""
    from dlrm.data import output_dirs

    data = tmp_path / "D"
    data.mkdir()
    flocks: list[int] = []
    real = output_dirs.try_lock_named
    monkeypatch.setattr(output_dirs, "try_lock_named", lambda *a, **k: flocks.append(1) or real(*a, **k))
    lock = tmp_path / ".D.lock"
    with output_dirs.dataset_read_lock(data, "data.path"):
        with output_dirs.dataset_read_lock(data, "data.path"):
            assert lock.exists()
        assert lock.exists(), "the inner hold's release removed the outer hold's lock file"
        assert len(flocks) == 1
    assert not lock.exists() and output_dirs._READING == {}
