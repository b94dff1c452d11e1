"""A GPU that CUDA cannot start under this process's ``ulimit -v`` (measured on an H200, session 83: CUDA's start maps
~23 GiB of address space; under 16 GB cudaGetDeviceCount failed with "out of memory" and ``--device cuda`` said only
"train.device: 'cuda' was requested but CUDA is not available", exit 2, while "auto" trained on the CPU unsaid). Now
'cuda' is one line naming the limit, exit 4, nothing written; 'auto' warns and trains on the CPU.

The CPU machines here have no CUDA build of torch: the child process runs under a real RLIMIT_AS with CUDA's three
answers patched (built, a device node, not available), as the H200 gave them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dlrm import errors
from dlrm.config import ConfigError
from dlrm.train import setup
from dlrm.train.setup import resolve_device
from tests.conftest import CHILD_ENV, REPO

LIMITED = "ulimit -v 16.0 GiB (RLIMIT_AS)"


@pytest.fixture
def gpu_held(monkeypatch):
    """A CUDA build on a host with a GPU whose start failed: what the H200 gave under ulimit -v 16 GB."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl" or exists(p))


def test_cuda_asked_for_under_a_limit_names_the_limit_exit_4(gpu_held, monkeypatch):
    monkeypatch.setattr(errors, "address_limits", lambda: LIMITED)
    with pytest.raises(MemoryError) as got:
        resolve_device("cuda")
    text = str(got.value)
    assert getattr(got.value, "dlrm_refused", False) and "\n" not in text
    assert text == (f"train.device 'cuda': CUDA could not start under this process's limit, {LIMITED} (its start maps "
                    f"address space: {setup.CUDA_START_GIB} GiB for configs/sample.json on an H200): raise it (ulimit "
                    "-v unlimited), or set train.device cpu")


def test_auto_under_a_limit_warns_and_trains_on_the_cpu(gpu_held, monkeypatch):
    monkeypatch.setattr(errors, "address_limits", lambda: LIMITED)
    said = []
    monkeypatch.setattr(setup.logger, "warning", said.append)
    assert resolve_device("auto") == torch.device("cpu")
    assert len(said) == 1 and said[0].startswith(
        f"train.device auto: a GPU is present but CUDA could not start under this process's limit, {LIMITED}")
    assert said[0].endswith("training on the CPU; raise the limit (ulimit -v unlimited) to train on the GPU")
    assert resolve_device("cpu") == torch.device("cpu") and len(said) == 1  # cpu asked for: nothing to say


@pytest.mark.parametrize("case", ["no limit", "no GPU", "CPU build"])
def test_without_a_limit_a_gpu_or_a_cuda_build_nothing_changes(gpu_held, monkeypatch, case):
    monkeypatch.setattr(errors, "address_limits", lambda: "" if case == "no limit" else LIMITED)
    if case == "no GPU":
        monkeypatch.setattr(os.path, "exists", lambda p: False)
    if case == "CPU build":
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    said = []
    monkeypatch.setattr(setup.logger, "warning", said.append)
    assert resolve_device("auto") == torch.device("cpu") and said == []
    with pytest.raises(ConfigError, match=r"^train.device: 'cuda' was requested but CUDA is not available$"):
        resolve_device("cuda")


def test_a_cuda_available_under_a_limit_is_used(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(errors, "address_limits", lambda: LIMITED)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda") == torch.device("cuda")


CHILD = """
import os, resource, sys
import torch
resource.setrlimit(resource.RLIMIT_AS, (64 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
torch.cuda.is_available = lambda: False
torch.backends.cuda.is_built = lambda: True
exists = os.path.exists
os.path.exists = lambda p: p == "/dev/nvidiactl" or exists(p)
from dlrm.cli import main
main(sys.argv[1:])
"""


def test_train_py_with_device_cuda_under_ulimit_v_is_one_line_exit_4_nothing_written(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, "--config", str(REPO / "configs" / "sample.json"),
                           "--device", "cuda", "--tb-dir", str(tmp_path / "tb")], cwd=tmp_path, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr[-2000:]
    errors_said = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors_said) == 1, done.stderr[-2000:]
    assert "train.device 'cuda': CUDA could not start under this process's limit, ulimit -v 64.0 GiB (RLIMIT_AS)" \
        in errors_said[0]
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())
