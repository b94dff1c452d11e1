"""`--resume` (latest) of a run that has no checkpoint yet: a run killed (SIGKILL, out of memory, a pre-empted job)
before its first checkpoint left config.json, its TensorBoard events and its released lock; `--resume` said "no
checkpoint" and a new start "already exists and is not empty ... (or --resume it)": the user had to delete the
directory by hand, and a requeued job could never run. Now `--resume` starts such a run (or a missing one) from step 0
in its directory, as the uninterrupted run, bit for bit; another config or anything else there is refused."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import ConfigError, load_config
from dlrm.train.run_dir import RunLock
from dlrm.train.trainer import train
from tests.conftest import REPO
from tests.test_run_dir import dataset  # noqa: F401 (a fixture)

BASE = {
    "data": {"batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "max_steps": 10, "log_every": 5, "eval_every": 5, "device": "cpu", "seed": 3},
    "checkpoint": {"every": 5, "keep": 5},
}
METRICS = ("auc", "logloss", "accuracy", "steps", "samples", "final_train_loss", "resumed_from", "resumed_at_step")


def config(tmp_path, dataset, run_name="victim", **overrides):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    raw["log"] = {"tb_dir": str(tmp_path / "tb"), "run_name": run_name}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return load_config(path, overrides)


def killed_before_first_checkpoint(tmp_path, dataset, run_name="victim"):
    """What a run SIGKILLed before its first checkpoint leaves: config.json, its events, the (released) lock, a
    temporary file of its first save; made by a whole run whose checkpoints and summary are then taken away."""
    train(config(tmp_path, dataset, run_name))
    run = tmp_path / "tb" / run_name
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / ".step-00000005.pt.999-abc.tmp").write_bytes(b"half a checkpoint")
    (run / ".lock").touch()  # (a finished run's release removed it; a killed one's stays)
    assert {p.name for p in run.iterdir()} >= {"config.json", ".lock", "checkpoints"}
    assert list(run.glob("events.out.tfevents.*"))
    return run


def weights(run):
    state = torch.load(run / "checkpoints" / "step-00000010.pt", map_location="cpu", weights_only=False)
    return state["model"]


def scalar_steps(run):
    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_killed_before_first_checkpoint_resumes_to_the_uninterrupted_result(tmp_path, dataset):
    reference = train(config(tmp_path, dataset, "reference"))
    run = killed_before_first_checkpoint(tmp_path, dataset)
    summary = train(config(tmp_path, dataset), resume="latest")
    assert {k: summary[k] for k in METRICS} == {k: reference[k] for k in METRICS}
    assert summary["resumed_from"] is None and summary["steps"] == 10
    mine, theirs = weights(run), weights(tmp_path / "tb" / "reference")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the killed session's events are gone: TensorBoard shows each step once, as the uninterrupted run's
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert scalar_steps(run) == scalar_steps(tmp_path / "tb" / "reference")
    assert json.loads((run / "summary.json").read_text())["auc"] == reference["auc"]
    RunLock.acquire(run).release()


def test_resume_of_a_missing_run_starts_it(tmp_path, dataset):
    summary = train(config(tmp_path, dataset, "fresh"), resume="latest")
    run = tmp_path / "tb" / "fresh"
    assert summary["steps"] == 10 and summary["resumed_from"] is None
    assert (run / "checkpoints" / "step-00000010.pt").is_file() and (run / "config.json").is_file()


def test_another_config_is_refused_naming_the_keys_unless_allowed(tmp_path, dataset):
    run = killed_before_first_checkpoint(tmp_path, dataset)
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(ConfigError, match=r"optim\.dense\.lr: 0\.01 -> 0\.02.*--allow-config-change optim\.dense\.lr"):
        train(config(tmp_path, dataset, **{"optim.dense.lr": 0.02}), resume="latest")
    assert sorted(p.name for p in run.rglob("*")) == before, "a refused resume changes nothing"
    summary = train(config(tmp_path, dataset, **{"optim.dense.lr": 0.02}), resume="latest",
                    allow_config_change=["optim.dense.lr"])
    assert summary["steps"] == 10
    assert json.loads((run / "config.json").read_text())["optim"]["dense"]["lr"] == 0.02


@pytest.mark.parametrize("extra", ["notes.txt", "summary.json", "checkpoints/best.pt"])
def test_a_directory_holding_anything_else_is_refused_and_kept(tmp_path, dataset, extra):
    """(A best.pt there is the state a run killed before its first step checkpoint goes on from,
    `tests/test_resume_from_best_only.py`: one that is no checkpoint is refused as such, naming it.)"""
    run = killed_before_first_checkpoint(tmp_path, dataset)
    (run / extra).write_text("mine")
    before = {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as refused:
        train(config(tmp_path, dataset), resume="latest")
    text = str(refused.value)
    assert "\n" not in text
    if extra.endswith("best.pt"):
        assert f"{run / extra}: not a readable checkpoint" in text
    else:
        assert "holds no checkpoint" in text and extra in text and "move it away or pick another --run-name" in text
    assert {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_new_start_on_a_killed_run_advises_what_works(tmp_path, dataset):
    run = killed_before_first_checkpoint(tmp_path, dataset)
    with pytest.raises(ConfigError, match="already exists and is not empty") as refused:
        train(config(tmp_path, dataset))
    assert "--resume starts it again from step 0" in str(refused.value)
    assert train(config(tmp_path, dataset), resume="latest")["steps"] == 10  # which it does
    (tmp_path / "tb" / "other").mkdir()
    (tmp_path / "tb" / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty") as refused:
        train(config(tmp_path, dataset, "other"))
    assert "(or --resume it)" not in str(refused.value), "--resume of a directory without a checkpoint is refused"
    assert run.is_dir()


def test_cli_refusal_is_one_line(tmp_path, dataset):
    run = killed_before_first_checkpoint(tmp_path, dataset)
    (run / "notes.txt").write_text("mine")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "cfg.json"), "--resume"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in (out.stdout + out.stderr).splitlines() if "holds no checkpoint" in line]
    assert len(errors) == 1 and "notes.txt" in errors[0]


def test_a_run_still_writing_its_directory_is_refused_and_its_events_kept(tmp_path, dataset):
    run = killed_before_first_checkpoint(tmp_path, dataset)
    events = sorted(run.glob("events.out.tfevents.*"))
    held = RunLock.acquire(run)  # the run, still before its first checkpoint, in another process
    try:
        with pytest.raises(ConfigError, match="in use by pid"):
            train(config(tmp_path, dataset), resume="latest")
    finally:
        held.release()
    assert sorted(run.glob("events.out.tfevents.*")) == events
