"""A run owns its directory: one writer, resumes that never clobber another run, failed starts cleaned up,
and summary.json that counts the whole run across resumes (issue #17)."""

import hashlib
import json
import shutil
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from loguru import logger

from dlrm.config import ConfigError, load_config
from dlrm.train.run_dir import RunDirectory, RunLock
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset
from tests.prewarm.launch import real_python

BASE = {
    "data": {"batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    # baseline off: no test here reads it, and its fit at each run's end cost more CPU than the run's 10 steps
    "train": {"epochs": 1, "max_steps": 10, "log_every": 5, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 5, "keep": 5},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("rundir") / "ds"
    make_dataset(root, {"train": 200, "validation": 32}, row_group_size=50)
    return root


def config(tmp_path, dataset, run_name="victim", **overrides):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    raw["log"] = {"tb_dir": str(tmp_path / "tb"), "run_name": run_name}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return load_config(path, overrides)


def snapshot(directory):
    """{relative path: sha256} of every file under `directory`."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def messages():
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    return seen, handle


def test_second_writer_is_refused_with_the_holders_pid(tmp_path, dataset):
    train(config(tmp_path, dataset))
    run = tmp_path / "tb" / "victim"
    holder = RunLock.acquire(run)  # stands for a first `--resume` still running
    try:
        with pytest.raises(ConfigError, match=r"in use by pid \d+"):
            train(config(tmp_path, dataset, **{"train.max_steps": 20}), resume="latest")
    finally:
        holder.release()
    train(config(tmp_path, dataset, **{"train.max_steps": 20}), resume="latest")  # free again: runs


def test_lock_held_by_another_process_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from dlrm.train.run_dir import RunLock
        lock = RunLock.acquire(Path({str(run)!r}))
        print("locked", flush=True)
        sys.stdin.read()
    """)
    # the real interpreter: the lock names the holder's pid, this process's (tests/prewarm/launch.py)
    proc = subprocess.Popen([real_python(), "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"in use by pid {proc.pid} "):
            RunLock.acquire(run)
    finally:
        proc.kill()
        proc.wait()
    # the holder died without releasing: its lock is stale, taken over with a warning
    seen, handle = messages()
    try:
        RunLock.acquire(run).release()
    finally:
        logger.remove(handle)
    assert any(f"stale lock of pid {proc.pid}" in m for m in seen), seen


def test_resume_into_another_existing_run_is_refused_and_changes_nothing(tmp_path, dataset):
    train(config(tmp_path, dataset))
    train(config(tmp_path, dataset, run_name="other"))
    victim = tmp_path / "tb" / "victim"
    before = snapshot(victim)
    with pytest.raises(ConfigError, match="names another existing run"):
        train(config(tmp_path, dataset, run_name="other", **{"train.max_steps": 20}),
              resume=str(victim / "checkpoints" / "step-00000005.pt"))
    assert snapshot(victim) == before


def test_resume_of_an_earlier_checkpoint_in_place_is_refused(tmp_path, dataset):
    train(config(tmp_path, dataset))
    victim = tmp_path / "tb" / "victim"
    before = snapshot(victim)
    with pytest.raises(ConfigError, match="not the latest checkpoint"):
        train(config(tmp_path, dataset, run_name=None), resume=str(victim / "checkpoints" / "step-00000005.pt"))
    assert snapshot(victim) == before


def test_resume_of_an_earlier_checkpoint_under_a_new_name_branches_without_touching_the_source(tmp_path, dataset):
    train(config(tmp_path, dataset))
    victim = tmp_path / "tb" / "victim"
    before = snapshot(victim)
    summary = train(config(tmp_path, dataset, run_name="branch"), resume=str(victim / "checkpoints" / "step-00000005.pt"))
    assert snapshot(victim) == before
    assert summary["run_dir"] == str(tmp_path / "tb" / "branch")
    assert summary["steps"] == 10 and summary["samples"] == 10 * 8  # counts the source's first 5 steps too
    assert (tmp_path / "tb" / "branch" / "checkpoints" / "step-00000010.pt").is_file()


def test_config_change_that_alters_training_is_refused_unless_allowed(tmp_path, dataset):
    train(config(tmp_path, dataset))
    victim = tmp_path / "tb" / "victim"
    before = snapshot(victim)
    for key, value in [("data.batch_size", 16), ("optim.dense.lr", 0.1), ("model.top_mlp", [4, 1]),
                       ("train.seed", 4)]:
        # a model key the checkpoint's tensors fix is named as fixed, not advised for the flag
        refusal = rf"\({key}: fixed by the checkpoint" if key.startswith("model.") else f"--allow-config-change {key}"
        with pytest.raises(ConfigError, match=refusal):
            train(config(tmp_path, dataset, **{key: value, "train.max_steps": 20}), resume="latest")
        assert snapshot(victim) == before
    # observation-only keys and the run's length are free; an allowed key goes through
    summary = train(config(tmp_path, dataset, **{"train.max_steps": 20, "train.log_every": 2, "optim.dense.lr": 0.02}),
                    resume="latest", allow_config_change=["optim.dense.lr"])
    assert summary["steps"] == 20


def test_resume_of_a_finished_run_says_so_and_writes_nothing(tmp_path, dataset):
    first = train(config(tmp_path, dataset))
    victim = tmp_path / "tb" / "victim"
    before = snapshot(victim)
    seen, handle = messages()
    try:
        again = train(config(tmp_path, dataset), resume="latest")
    finally:
        logger.remove(handle)
    assert snapshot(victim) == before
    assert again["finished"] is True and again["samples"] == first["samples"] == 80
    assert any("nothing to train, nothing written" in m for m in seen)


def test_summary_counts_the_whole_run_across_resumes(tmp_path, dataset):
    uninterrupted = train(config(tmp_path, dataset, run_name="whole", **{"train.max_steps": 20}))
    train(config(tmp_path, dataset, run_name="parts"))
    resumed = train(config(tmp_path, dataset, run_name="parts", **{"train.max_steps": 20}), resume="latest")
    assert resumed["resumed_at_step"] == 10  # this session trained steps 11-20 only
    assert resumed["samples"] == uninterrupted["samples"] == 20 * 8
    assert [s for s, _ in resumed["train_losses"]] == [5, 10, 15, 20]
    assert [l for _, l in resumed["train_losses"]] == pytest.approx([l for _, l in uninterrupted["train_losses"]], rel=1e-5)
    on_disk = json.loads((tmp_path / "tb" / "parts" / "summary.json").read_text())
    assert on_disk["samples"] == 160 and on_disk["train_s"] > 0


def test_failed_start_removes_the_directory_it_made(tmp_path, dataset, monkeypatch):
    from dlrm.train import trainer as trainer_mod

    def broken_fit(self, *args):
        raise RuntimeError("boom before the first step")

    monkeypatch.setattr(trainer_mod.Trainer, "_fit", broken_fit)
    with pytest.raises(RuntimeError, match="boom"):
        train(config(tmp_path, dataset, run_name="fails"))
    assert not (tmp_path / "tb" / "fails").exists()
    monkeypatch.undo()
    train(config(tmp_path, dataset, run_name="fails"))  # the name is free again


def test_failure_after_the_first_step_keeps_the_directory(tmp_path, dataset, monkeypatch):
    from dlrm.train import trainer as trainer_mod

    original = trainer_mod.Trainer._log_window

    def fail_at_log(self, bar):
        original(self, bar)
        raise RuntimeError("fails at step 5")

    monkeypatch.setattr(trainer_mod.Trainer, "_log_window", fail_at_log)
    with pytest.raises(RuntimeError, match="step 5"):
        train(config(tmp_path, dataset, run_name="kept"))
    run = tmp_path / "tb" / "kept"
    assert list(run.glob("events.out.tfevents.*")), "the history of a run that trained is kept"
    RunLock.acquire(run).release()  # and its lock was released


def test_new_run_refuses_a_non_empty_directory(tmp_path, dataset):
    (tmp_path / "tb" / "victim").mkdir(parents=True)
    (tmp_path / "tb" / "victim" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        train(config(tmp_path, dataset))
    assert (tmp_path / "tb" / "victim" / "notes.txt").read_text() == "mine"


def test_symlinked_tb_dir_is_logged_with_where_it_resolves(tmp_path, dataset):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (tmp_path / "tb").symlink_to(real)
    seen, handle = messages()
    try:
        run = RunDirectory.create(config(tmp_path, dataset, run_name="linked"))
        run.close()
    finally:
        logger.remove(handle)
    assert any(f"resolves to {real / 'linked'}" in m for m in seen), seen
    assert (real / "linked" / "config.json").is_file()


def test_cli_resume_with_other_name_and_batch_size_is_one_line_error(tmp_path, dataset):
    """The issue's reproduction: --resume victim's checkpoint --run-name new --batch-size 128."""
    train(config(tmp_path, dataset))
    victim = tmp_path / "tb" / "victim"
    before = snapshot(victim)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "cfg.json"),
                          "--resume", str(victim / "checkpoints" / "step-00000005.pt"), "--run-name", "new",
                          "--batch-size", "128"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "data.batch_size: 8 -> 128" in out.stderr and "Traceback" not in out.stderr
    assert snapshot(victim) == before
    assert not (tmp_path / "tb" / "new").exists()


def test_best_evaluation_is_kept_as_best_pt_and_early_stopping_stops(tmp_path, dataset):
    """Early stopping after `patience` evaluations without improvement; best.pt holds the best one."""
    from dlrm.train.checkpointer import checkpoint_for
    from dlrm import checkpoint as ckpt

    # lr 3.0 makes the dense model diverge after a few steps: AUC peaks early, then does not improve
    cfg = config(tmp_path, dataset, run_name="early", **{
        "train.max_steps": 100, "train.epochs": 4, "train.eval_every": 2,
        "train.early_stopping": {"metric": "logloss", "patience": 2}, "optim.dense.lr": 3.0})
    summary = train(cfg)
    best = summary["best"]
    assert summary["early_stopped"] is True and summary["steps"] < 100
    assert summary["steps"] == best["step"] + 2 * 2  # two evaluations after the best one
    assert best["logloss"] <= summary["logloss"]
    run = tmp_path / "tb" / "early"
    assert checkpoint_for(run) == run / "checkpoints" / "best.pt" == Path(summary["best_checkpoint"])
    state = ckpt.load_checkpoint(run / "checkpoints" / "best.pt")
    assert state["position"]["step"] == best["step"]
    final = ckpt.load_checkpoint(Path(summary["checkpoint"]))
    assert final["position"]["step"] == summary["steps"] != best["step"]


def test_best_survives_a_resume(tmp_path, dataset):
    cfg = config(tmp_path, dataset, run_name="b", **{"train.eval_every": 5})
    first = train(cfg)
    resumed = train(config(tmp_path, dataset, run_name="b", **{"train.eval_every": 5, "train.max_steps": 20}),
                    resume="latest")
    assert first["best"] is not None
    assert resumed["best"]["step"] in (5, 10, 15, 20)
    if resumed["best"]["step"] <= 10:
        assert resumed["best"] == first["best"]


def test_best_at_a_checkpointed_step_is_a_link_not_a_second_copy(tmp_path, dataset):
    """The final evaluation's best.pt is the final checkpoint's file linked (MLPerf's checkpoint is
    50 GB: two copies filled the GPU machine's 64 GB disk), and it outlives the step file."""
    from dlrm import checkpoint as ckpt

    summary = train(config(tmp_path, dataset, run_name="link", **{"train.eval_every": None, "checkpoint.keep": 1}))
    final, best = Path(summary["checkpoint"]), Path(summary["best_checkpoint"])
    assert best.name == "best.pt" and summary["best"]["step"] == summary["steps"]
    assert os.path.samefile(final, best) and os.stat(best).st_nlink == 2
    final.unlink()
    assert ckpt.load_checkpoint(best)["position"]["step"] == summary["steps"]


def test_min_steps_adds_epochs_on_a_small_split(tmp_path, dataset):
    """200 rows at batch 8 are 25 steps an epoch: min_steps 60 trains 3 epochs' worth (capped at 60)."""
    summary = train(config(tmp_path, dataset, run_name="min", **{"train.max_steps": None, "train.min_steps": 60}))
    assert summary["steps"] == 60 and summary["samples"] == 60 * 8
    capped = train(config(tmp_path, dataset, run_name="cap", **{"train.max_steps": 40, "train.min_steps": 60}))
    assert capped["steps"] == 40


def test_resume_with_the_dataset_named_another_way_is_the_same_dataset(tmp_path, dataset, monkeypatch):
    """data.path relative instead of absolute, or through a symlink, names the same directory: not a config change;
    another directory with the same files is one."""
    train(config(tmp_path, dataset))
    monkeypatch.chdir(dataset.parent)
    link = tmp_path / "link"
    link.symlink_to(dataset)
    summary = train(config(tmp_path, dataset, **{"data.path": dataset.name, "train.max_steps": 15}), resume="latest")
    assert summary["steps"] == 15 and summary["resumed_at_step"] == 10
    summary = train(config(tmp_path, dataset, **{"data.path": str(link), "train.max_steps": 20}), resume="latest")
    assert summary["steps"] == 20 and summary["resumed_at_step"] == 15
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    with pytest.raises(ConfigError, match=r"\(data.path: .*--allow-config-change data.path$"):
        train(config(tmp_path, dataset, **{"data.path": str(copy), "train.max_steps": 25}), resume="latest")
