"""`distributed.timeout_s`: how long a rank of a distributed run (gloo ranks on the CPU, started as torchrun starts
them) waits for the others, to join and in a collective, before it stops in one line with exit 5.

Before it, a rank whose peers never started waited torch's 30 minutes and then printed a DistStoreError traceback
as "a bug in dlrm" (exit 1), and a peer that hung (SIGSTOP, a deadlock) gave gloo's "Timed out waiting" traceback,
also as a bug, after the same half hour; no setting shortened either wait."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from loguru import logger

from dlrm import cli
from dlrm.config import ConfigError, load_config
from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, make_dataset
from tests.test_audit_killfuzz import CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rank 1 stops itself (SIGSTOP: a hung process, alive, its sockets open) at its 5th training step
SCRIPT = """
import os, signal, sys
if os.environ["RANK"] == "1":
    from dlrm.train import meter
    real, calls = meter.StepMeter.step, []
    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, *args, **kwargs)
    meter.StepMeter.step = step
from dlrm.cli import main
main(sys.argv[1:])
"""


def write_config(tmp_path, timeout_s, dataset=None):
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(dataset or tmp_path / "missing")
    cfg["distributed"]["timeout_s"] = timeout_s
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return path


def rank_env(rank: int, port: int) -> dict:
    return {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "TRITON_INTERPRET": "1"}


@pytest.mark.parametrize("value", [0, -3, "10", 1e9, 1e-4, 0.5])
def test_a_bad_timeout_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match=r"distributed\.timeout_s"):
        load_config(write_config(tmp_path, value))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_peers_never_start_stops_in_one_line_after_the_timeout(tmp_path, rank):
    """Rank 0 alone (its store waits for rank 1), or rank 1 alone (no store to connect to)."""
    dataset = tmp_path / "ds"
    make_dataset(dataset, {"train": 40, "validation": 20}, row_group_size=20)
    # (held, not listened on, while the rank runs: rank 1 alone finds nobody there, as before, and no other test's
    # store can be given the port for it to join: tests/_ports.py)
    with reserved_port() as port:
        start = time.monotonic()
        p = subprocess.run([sys.executable, "train.py", "--config", str(write_config(tmp_path, 2, dataset)),
                            "--run-name", "r", "--tb-dir", str(tmp_path / "tb")], cwd=ROOT, capture_output=True,
                           text=True, env=rank_env(rank, port), timeout=120)
    assert p.returncode == 5, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "this is a bug" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, p.stderr[-3000:]
    assert (f"rank {rank}: the other ranks of this distributed run did not join it at 127.0.0.1:{port} within 2 s "
            "(distributed.timeout_s)") in errors[0]
    assert time.monotonic() - start < 60  # torch's default waits 30 minutes
    assert not (tmp_path / "tb" / "r").exists()  # no run directory left behind


def test_a_hung_peer_stops_the_other_rank_in_one_line_after_the_timeout(tmp_path):
    dataset = tmp_path / "ds"
    make_dataset(dataset, {"train": 120, "validation": 40}, row_group_size=20)
    args = ["--config", str(write_config(tmp_path, 4, dataset)), "--run-name", "r", "--tb-dir", str(tmp_path / "tb")]
    with reserved_port() as port:  # (held until both ranks are done: tests/_ports.py)
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *args], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=rank_env(r, port)) for r in range(2)]
        try:
            code0 = procs[0].wait(timeout=120)  # torch's default: 30 minutes
            out0 = procs[0].stdout.read()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                p.wait()
                p.stdout.close()
    assert code0 == 5, out0[-3000:]
    assert "Traceback" not in out0 and "this is a bug" not in out0, out0[-3000:]
    assert ("rank 0: another rank of this distributed run did not answer within the process group's timeout "
            "(distributed.timeout_s; it hangs, or is gone): Timed out waiting 4000ms for") in out0, out0[-3000:]
    # the step-3 checkpoint the run wrote before rank 1 hung is there for --resume
    assert (tmp_path / "tb" / "r" / "checkpoints" / "step-00000003.pt").exists()


def test_gloo_timeout_text_is_a_lost_peer_and_other_text_stays_a_bug(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), format="{message}")
    try:
        timed_out = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                                 "Timed out waiting 1800000ms for recv operation to complete")
        assert cli.report_failure(timed_out, None) == 5
        assert messages == ["rank 1: another rank of this distributed run did not answer within the process group's "
                            "timeout (distributed.timeout_s; it hangs, or is gone): Timed out waiting 1800000ms for "
                            "recv operation to complete; stopped; --resume continues the run from its last "
                            "checkpoint, if it wrote one"]
        # a timeout that is no collective's (no gloo, no NCCL in it) is still reported as a bug
        assert cli.report_failure(RuntimeError("Timed out waiting 5ms for recv operation"), None) == 1
    finally:
        logger.remove(sink)
