"""Audit of multi-process training on the CPU (gloo): torchrun's environment read by `dlrm.distributed.env`
(malformed or out-of-range WORLD_SIZE / RANK / LOCAL_RANK / MASTER_PORT are one-line ConfigErrors, never a
ValueError traceback nor a rank that waits 30 minutes for peers that never come)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dlrm.config import ConfigError, DistributedConfig
from dlrm.distributed.env import DistEnv, init_distributed
from tests.conftest import REPO, make_dataset, process_output

CPU = torch.device("cpu")
REAL_INIT = dist.init_process_group
LAUNCH_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launch(monkeypatch):
    """Set torchrun's variables (the others unset); init_process_group must not be reached."""

    def never(*args, **kwargs):
        raise AssertionError("init_process_group was called (it waits for the other ranks)")

    monkeypatch.setattr(dist, "init_process_group", never)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def set_env(**values: str) -> None:
        for key in LAUNCH_KEYS:
            monkeypatch.delenv(key, raising=False)
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


@pytest.mark.parametrize("values,named", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}, "RANK='x'"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "a", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "LOCAL_RANK='a'"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "port"}, "MASTER_PORT='port'"),
])
def test_malformed_launch_variable_is_one_line_naming_it(launch, values, named):
    """Was ``ValueError: invalid literal for int() with base 10: 'two'`` (a traceback, reported as a bug)."""
    launch(**values)
    with pytest.raises(ConfigError, match=f"environment variable {named} is not an integer"):
        init_distributed(DistributedConfig(), CPU)


def test_empty_world_size_is_one_process_as_the_cli_reads_it(launch):
    """dlrm.cli.check_modes takes an empty WORLD_SIZE for one process; init_distributed crashed on int('')."""
    launch(WORLD_SIZE="")
    assert init_distributed(DistributedConfig(), CPU) == (DistEnv(), CPU)


@pytest.mark.parametrize("rank,local_rank,named", [("2", "0", "RANK 2"), ("-1", "0", "RANK -1"),
                                                   ("5", "0", "RANK 5"), ("1", "-1", "LOCAL_RANK -1")])
def test_rank_outside_the_world_is_refused_before_joining(launch, rank, local_rank, named):
    """RANK 5 of WORLD_SIZE 2 went into init_process_group, which waits for ranks 0..1 until its store times out
    (30 minutes), instead of saying what is wrong."""
    launch(WORLD_SIZE="2", RANK=rank, LOCAL_RANK=local_rank, MASTER_ADDR="localhost", MASTER_PORT="29500")
    with pytest.raises(ConfigError, match=f"{named} is not in \\[0, WORLD_SIZE 2\\)"):
        init_distributed(DistributedConfig(), CPU)


@pytest.mark.parametrize("port,message", [(None, "MASTER_PORT is not set"),
                                          ("99999", "MASTER_PORT=99999 is not a port")])
def test_missing_or_bad_master_port_is_one_line(launch, monkeypatch, port, message):
    """torch's env:// rendezvous raised ValueError("... MASTER_PORT expected, but not set" / "port must have value
    from 0 to 65535"): a traceback. (The real init_process_group: it fails at once on these.)"""
    monkeypatch.setattr(dist, "init_process_group", REAL_INIT)
    launch(WORLD_SIZE="2", RANK="1", MASTER_ADDR="localhost", **({} if port is None else {"MASTER_PORT": port}))
    with pytest.raises(ConfigError, match=message):
        init_distributed(DistributedConfig(), CPU)


def test_malformed_world_size_through_the_cli_is_one_error_line(tmp_path):
    """The command: exit status 2, one ERROR line naming the variable, no traceback, nothing written."""
    make_dataset(tmp_path / "ds", {"train": 20, "validation": 8, "test": 8})
    cfg = tmp_path / "c.json"
    cfg.write_text('{"train": {"device": "cpu"}, "data": {"path": "%s"}}' % (tmp_path / "ds"))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(cfg), "--tb-dir",
                             str(tmp_path / "tb")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**env, "WORLD_SIZE": "2x"}, check=False)
    assert result.returncode == 2, process_output(result)
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "WORLD_SIZE='2x'" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "tb").exists()
