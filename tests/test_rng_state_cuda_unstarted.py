"""A CPU run on a GPU host started CUDA at its first checkpoint: `dlrm.checkpoint.rng_state` asked
`torch.cuda.is_available()` (cudaGetDeviceCount, which starts the driver) to save the CUDA generators' states, which a
CPU run never uses. Measured on an H200 host (session 83, benchmarks/address_space_margin.py): the CPU run mapped 15.9
GiB of address space after its host-memory check against ~3 GiB predicted, where a `ulimit -v` run is weighed; under
`ulimit -v` 16 GB the same start failed in CUDA ("Error 2: out of memory", torch's warning). Now CUDA's states are
saved and restored only where this process started CUDA (a CUDA run has, by its first checkpoint and its restore).

No GPU here: CUDA's answers are patched, and any question dlrm asks that would start it fails the test. torch's own
are left out: Adam's per-step check for a CUDA graph capture asks `torch.cuda.is_available()` where torch is built with
CUDA (2.11, the GPU machine's: this test failed there in Adam's step, session 87; 2.13 asks `torch.accelerator`, which
is not patched), and the autograd engine counts the devices in C++ at the first backward, which no patch sees. That
count is what starts CUDA's driver in a CPU training run on a GPU host (session 87, H200, torch 2.11: +4.1 GiB of
address space at the first backward, 4 MiB of GPU memory where a context takes hundreds; peak 21.0 GiB against 16.7
with the GPU hidden, as in session 86, which had this fix):
`benchmarks/results/gpu_tests_2026-12-05_s87.md`."""

from __future__ import annotations

import pytest
import torch

import dlrm.checkpoint as ckpt
from tests.conftest import REPO
from tests.test_cli_errors import invoke


def _never(*a, **k):
    raise AssertionError("CUDA asked about in a process that never started it: this starts the driver")


@pytest.fixture
def unstarted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):  # torch's (above)
        if hasattr(torch.optim.Optimizer, name):
            monkeypatch.setattr(torch.optim.Optimizer, name, lambda self: None)
    for name in ("is_available", "get_rng_state_all", "set_rng_state_all", "device_count"):
        monkeypatch.setattr(torch.cuda, name, _never)


def test_a_process_that_never_started_cuda_saves_and_restores_no_cuda_state_without_starting_it(unstarted):
    state = ckpt.rng_state()
    assert state["cuda"] is None
    before = torch.rand(3)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), before)  # the CPU streams restored
    ckpt.set_rng_state({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)]})  # a GPU run's checkpoint on the CPU


def test_a_process_that_started_cuda_saves_and_restores_its_generators(monkeypatch):
    saved = [torch.arange(16, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = ckpt.rng_state()
    assert state["cuda"] is saved
    ckpt.set_rng_state(state)
    assert restored == [saved]


def test_a_cpu_run_checkpoints_and_resumes_without_starting_cuda(unstarted, tmp_path):
    config = REPO / "configs" / "sample.json"
    done = invoke(tmp_path, config, "--device", "cpu", "--run-name", "r", "--max-steps", "4",
                  "--checkpoint-every", "2")
    assert done.exit_code == 0, done.output
    assert ckpt.load_checkpoint(tmp_path / "tb" / "r" / "checkpoints" / "step-00000004.pt")["rng"]["cuda"] is None
    resumed = invoke(tmp_path, config, "--device", "cpu", "--run-name", "r", "--resume", "latest", "--max-steps", "6")
    assert resumed.exit_code == 0, resumed.output
