"""Checkpoints, exact resume after SIGKILL, clean stops, NaN guard, eval-only and export."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm import checkpoint as ckpt
from dlrm.train.trainer import NonFiniteLoss, train
from tests.conftest import REPO, make_dataset
from tests.prewarm.launch import real_python

BASE = {
    "data": {"batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
              "schedule": {"warmup_steps": 5, "decay": "linear"}},
    # baseline off: no test here reads it, and its fit was ~40% of each run's CPU (2.7 of 6.4 s for 75 steps)
    "train": {"epochs": 3, "log_every": 10, "device": "cpu", "deterministic": True, "seed": 3, "baseline": False},
    "checkpoint": {"every": 20, "keep": 2},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "ds"
    make_dataset(root, {"train": 600, "validation": 64, "test": 40}, row_group_size=50)
    return root


def write_config(tmp_path, dataset, **sections):
    raw = json.loads(json.dumps(BASE))
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    raw["data"]["path"] = str(dataset)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return path


def cli(*args, cwd, real: bool = False, **kw):
    """train.py started with `args`; `real`: by the real interpreter, not the prewarmed one's wrapper (a process to be
    SIGKILLed: a served program dies just after its client, not before `wait()` returns; tests/prewarm/launch.py)."""
    return subprocess.Popen([real_python() if real else sys.executable, str(REPO / "train.py"), *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def final_state(run_dir):
    return ckpt.load_checkpoint(ckpt.list_checkpoints(run_dir)[-1])


def assert_same_training_state(a, b):
    assert a["position"] == b["position"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        for pid, st in oa["state"].items():
            for name, value in st.items():
                if torch.is_tensor(value):
                    assert torch.equal(value, ob["state"][pid][name]), name


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, dataset):
    cfg = write_config(tmp_path, dataset)
    tb = tmp_path / "tb"
    full = cli("--config", str(cfg), "--tb-dir", str(tb), "--run-name", "full", cwd=tmp_path)
    assert full.wait(timeout=180) == 0, full.stdout.read()

    victim = cli("--config", str(cfg), "--tb-dir", str(tb), "--run-name", "killed", cwd=tmp_path, real=True)
    first = tb / "killed" / "checkpoints" / ckpt.checkpoint_name(40)
    assert wait_for(first.exists), victim.stdout.read() if victim.poll() is not None else "no checkpoint appeared"
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    done = {p.name for p in ckpt.list_checkpoints(tb / "killed")}
    assert ckpt.checkpoint_name(225) not in done  # it really was killed mid-training (225 = 3 epochs of 75)
    latest = max(ckpt.load_checkpoint(p)["position"]["step"] for p in ckpt.list_checkpoints(tb / "killed"))

    resumed = cli("--config", str(cfg), "--tb-dir", str(tb), "--run-name", "killed", "--resume", cwd=tmp_path)
    out = resumed.communicate(timeout=180)[0]
    assert resumed.returncode == 0, out
    assert re.search(rf"resumed from \S+ at step {latest} ", out), out  # from the last checkpoint, not step 0
    assert json.loads((tb / "killed" / "summary.json").read_text())["resumed_at_step"] == latest >= 40
    assert_same_training_state(final_state(tb / "full"), final_state(tb / "killed"))
    assert len(ckpt.list_checkpoints(tb / "killed")) == 2  # keep = 2
    assert not list((tb / "killed" / "checkpoints").glob(".*"))  # no temporary files left


def test_sigterm_finishes_step_checkpoints_and_exits_143(tmp_path, dataset):
    cfg = write_config(tmp_path, dataset, train={"epochs": 200}, checkpoint={"every": 50})
    tb = tmp_path / "tb"
    proc = cli("--config", str(cfg), "--tb-dir", str(tb), "--run-name", "t", cwd=tmp_path)
    assert wait_for(lambda: bool(ckpt.list_checkpoints(tb / "t"))), "training never checkpointed"
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out
    assert "stopped by signal at step" in out
    state = final_state(tb / "t")
    step = state["position"]["step"]
    assert f"stopped by signal at step {step}" in out
    assert list((tb / "t").glob("events.out.tfevents.*"))


def test_nan_loss_stops_and_names_last_good_checkpoint(tmp_path, dataset, monkeypatch):
    cfg = load_config(write_config(tmp_path, dataset, checkpoint={"every": 5}, train={"log_every": 4}),
                      {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "nan"})
    from dlrm.train import step as step_mod

    original = step_mod.TrainStep.__call__
    calls = {"n": 0}

    def poisoned(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        return loss * float("nan") if calls["n"] == 7 else loss

    monkeypatch.setattr(step_mod.TrainStep, "__call__", poisoned)
    with pytest.raises(NonFiniteLoss, match=r"at step 7; stopped; the last good checkpoint is .*step-00000005.pt"):
        train(cfg)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "tb" / "nan")]
    assert names == [ckpt.checkpoint_name(5)]  # the good one stays; nothing after the NaN was saved
    assert torch.isfinite(ckpt.load_checkpoint(tmp_path / "tb/nan/checkpoints" / names[0])["model"]["sparse_arch.weight"]).all()


def test_incompatible_checkpoint_names_what_differs(tmp_path, dataset):
    cfg_path = write_config(tmp_path, dataset, train={"epochs": 1})
    cfg = load_config(cfg_path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "a", "train.max_steps": 3})
    path = train(cfg)["checkpoint"]
    other = load_config(cfg_path, {"log.tb_dir": str(tmp_path / "tb"), "model.embedding_dim": 8, "model.bottom_mlp": [8, 8]})
    # the resume policy names the config keys first; allowed, the checkpoint check names what cannot load
    with pytest.raises(ConfigError, match=r"model.embedding_dim: 4 -> 8"):
        train(other, resume=path)
    with pytest.raises(ConfigError, match=r"model.embedding_dim differs: checkpoint 4, this run 8"):
        train(other, resume=path, allow_config_change=["model"])
    capped = load_config(cfg_path, {"log.tb_dir": str(tmp_path / "tb"), "data.max_rows_per_table": 5})
    with pytest.raises(ConfigError, match=r"table sizes differ .*\[0\] 11 vs 5"):
        train(capped, resume=path, allow_config_change=["data.max_rows_per_table"])
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        (tmp_path / "junk.pt").write_text("junk")
        train(cfg, resume=str(tmp_path / "junk.pt"))


def test_unwritable_output_fails_before_training(tmp_path, dataset):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = cli("--config", str(write_config(tmp_path, dataset)), "--tb-dir", str(blocker / "tb"), cwd=tmp_path)
    out = proc.communicate(timeout=120)[0]
    # a path under a file: said as such since session 60 (it was "log.tb_dir: cannot create ... (Not a directory)")
    assert proc.returncode == 2 and "train:" not in out, out
    assert re.search(rf"--tb-dir: \S*{blocker.name}/tb: \S*{blocker.name} is a file, not a directory; pick another "
                     r"--tb-dir", out), out


def test_eval_only_and_export(tmp_path, dataset):
    cfg_path = write_config(tmp_path, dataset, train={"epochs": 1})
    tb = tmp_path / "tb"
    cfg = load_config(cfg_path, {"log.tb_dir": str(tb), "log.run_name": "t", "train.max_steps": 10})
    summary = train(cfg)
    proc = cli("--config", str(cfg_path), "--tb-dir", str(tb), "--run-name", "ev", "--eval-only",
               "--checkpoint", summary["checkpoint"], "--split", "validation", "--export", str(tmp_path / "m.pt2"),
               cwd=tmp_path)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0, out
    ev = json.loads((tb / "ev" / "summary.json").read_text())
    for k in ("auc", "logloss", "accuracy"):
        assert ev[k] == pytest.approx(summary[k], abs=1e-6)

    from dlrm.train.export import model_from_checkpoint
    from dlrm.train.trainer import build_for_data
    from dlrm.data.loader import transform_dense

    device, _, _, tables = build_for_data(cfg)
    model = model_from_checkpoint(cfg, summary["checkpoint"], tables, device)
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    rng = np.random.default_rng(0)
    for batch in (1, 3, 33):
        counts = torch.from_numpy(rng.integers(-2, 5000, (batch, 13)))
        raw = torch.from_numpy(rng.integers(-1, 2**32, (batch, 26)))
        expected = model.predict(transform_dense(counts), raw)
        torch.testing.assert_close(program(counts, raw), expected, rtol=1e-6, atol=1e-7)
    # int32 sparse input would wrap raw hashes >= 2**31: the program refuses any dtype but int64
    with pytest.raises(RuntimeError, match="dtype"):
        program(counts, raw.to(torch.int32))
    again = cli("--config", str(cfg_path), "--checkpoint", summary["checkpoint"],
                "--export", str(tmp_path / "m.pt2"), cwd=tmp_path)
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 2 and "already exists" in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_second_signal_stops_at_once(sig):
    from dlrm.train.signals import GracefulStop

    before = signal.getsignal(sig)
    with GracefulStop() as stop:
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert stop.requested and stop.exit_code == 128 + sig
        with pytest.raises(SystemExit) as exc:
            os.kill(os.getpid(), sig)
            time.sleep(1)
        assert exc.value.code == 128 + sig
    assert signal.getsignal(sig) is before  # the previous handlers are back
