"""`dlrm.train.profiling.detach_cupti_after_cycles`: after a --profile cycle Kineto keeps CUPTI subscribed to every CUDA
call unless ``TEARDOWN_CUPTI=1`` (an H200's host-bound steps after the trace at 26-77% of an unprofiled run's rate to
its end; `benchmarks/results/profile_cupti_teardown_h200.md`)."""

import os

import pytest
import torch

from dlrm.config import ProfileConfig
from dlrm.train import profiling


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    return monkeypatch


@pytest.mark.parametrize("cuda", ["12.6", "12.8", "13.0"])
def test_a_cuda_build_from_12_6_detaches_cupti(env, cuda):
    env.setattr(torch.version, "cuda", cuda)
    profiling.detach_cupti_after_cycles()
    assert os.environ["TEARDOWN_CUPTI"] == "1"


@pytest.mark.parametrize("cuda", ["11.8", "12.4", "12.5"])
def test_older_or_no_cuda_keeps_kinetos_default(env, cuda):
    """Before 12.6 a CUPTI re-init after a teardown crashed with CUDA graphs: left as it was, and said."""
    env.setattr(torch.version, "cuda", cuda)
    lines = []
    handle = profiling.logger.add(lines.append, format="{message}")
    try:
        profiling.detach_cupti_after_cycles()
    finally:
        profiling.logger.remove(handle)
    assert "TEARDOWN_CUPTI" not in os.environ
    assert any("CUPTI stays attached" in line for line in lines)


@pytest.mark.parametrize("users", ["0", "1", ""])
def test_the_users_setting_stands(env, users):
    env.setenv("TEARDOWN_CUPTI", users)
    env.setattr(torch.version, "cuda", "13.0")
    profiling.detach_cupti_after_cycles()
    assert os.environ["TEARDOWN_CUPTI"] == users


@pytest.mark.parametrize("device,detached", [("cuda", True), ("cpu", False)])
def test_the_profiler_of_a_cuda_run_detaches_cupti_and_a_cpu_runs_leaves_it(env, tmp_path, device, detached):
    env.setattr(torch.version, "cuda", "13.0")
    made = {}

    class Recorder:  # stands in for torch's profiler (no CUDA here)
        def __init__(self, **kwargs):
            made.update(kwargs)
    env.setattr(profiling, "_StepProfile", Recorder)
    profiling.make_profiler(ProfileConfig(enabled=True), tmp_path, torch.device(device), steps=100)
    assert (os.environ.get("TEARDOWN_CUPTI") == "1") is detached
    assert (profiling.ProfilerActivity.CUDA in made["activities"]) is detached
