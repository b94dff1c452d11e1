"""torchrun's grace after a SIGTERM against a sharded checkpoint's write (`dlrm.distributed.shutdown_grace`).

On two H200s MLPerf DLRM-DCNv2's full tables made shards of 10.5 and 42.8 GB, written in 65-99 s; a SIGTERM to
torchrun as the run ended had its ranks SIGKILLed 30 s later, inside the last checkpoint, and none of the run's 100
steps was saved (2026-12-04, benchmarks/results/nccl_resume_2026-12-04_s79.md). The run now says so beforehand."""

import json
import os
import subprocess
import sys

import pytest
import torch
from loguru import logger

from dlrm.distributed.env import DistEnv
from dlrm.distributed.shutdown_grace import (DEFAULT_GRACE_S, StopGrace, grace_configurable, state_bytes,
                                             torchrun_grace_s)
from tests.conftest import REPO, make_dataset, process_output
from tests.prewarm.launch import real_python

UNDER = {"TORCHELASTIC_RUN_ID": "r"}
TWO = DistEnv(rank=0, world_size=2)


@pytest.fixture
def warnings():
    lines = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    yield lines
    logger.remove(sink)


def test_no_grace_outside_torchrun():
    assert torchrun_grace_s({}, ["torchrun", "--shutdown-timeout", "600"], configurable=True) is None


@pytest.mark.parametrize("argv, environ, grace", [
    (["torchrun", "--shutdown-timeout", "600", "train.py"], {}, 600.0),
    (["torchrun", "--shutdown_timeout=45", "train.py"], {}, 45.0),
    (["torchrun", "--shutdown-timeout=5", "--shutdown-timeout", "7"], {}, 7.0),  # the last wins, as argparse's
    (["torchrun", "--shutdown-timeout", "9"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}, 9.0),  # the flag over the env
    (["torchrun", "train.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}, 300.0),
    (["torchrun", "train.py"], {}, DEFAULT_GRACE_S),
    (["torchrun", "train.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, DEFAULT_GRACE_S),  # torchrun refuses it
    (["torchrun", "--shutdown-timeout", "-1"], {}, DEFAULT_GRACE_S),
    (["torchrun", "--shutdown-timeout"], {}, DEFAULT_GRACE_S),  # no value after it
])
def test_grace_where_torchrun_takes_one(argv, environ, grace):
    assert torchrun_grace_s({**UNDER, **environ}, argv, configurable=True) == grace


def test_grace_is_fixed_where_torchrun_takes_none():
    # torch 2.11's torchrun has neither --shutdown-timeout nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT: its 30 s, whatever they say
    environ = {**UNDER, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}
    assert torchrun_grace_s(environ, ["torchrun", "--shutdown-timeout", "600"], configurable=False) == DEFAULT_GRACE_S


def test_grace_is_read_from_the_parents_command_line(tmp_path):
    # the rank's parent is torchrun's agent: a parent started as `python -c CODE --shutdown-timeout 77` stands for it
    # (the real interpreter for both: the suite's prewarmed one forks its children from a server, their parent)
    child = ("import os; from dlrm.distributed.shutdown_grace import torchrun_grace_s; "
             "print(torchrun_grace_s({'TORCHELASTIC_RUN_ID': 'r'}, configurable=True))")
    parent = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {child!r}]).returncode)"
    out = subprocess.run([real_python(), "-c", parent, "--shutdown-timeout", "77"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "77.0"


def test_grace_configurable_follows_this_torchs_launch_config():
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    assert grace_configurable() == any(f.name == "shutdown_timeout" for f in dataclasses.fields(LaunchConfig))


def test_state_bytes_counts_the_model_and_its_optimizers_state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)).to(torch.float64)
    buffer = torch.zeros(7, dtype=torch.bfloat16)
    model.register_buffer("counts", buffer)
    opt = torch.optim.Adagrad(model.parameters())  # a "sum" a parameter, at once; "step" a scalar
    params = (3 * 5 + 5 + 5 * 1 + 1) * 8
    optimizer_state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor))
    assert optimizer_state >= params  # (the sums, in float64)
    assert state_bytes(model, [opt]) == params + 7 * 2 + optimizer_state
    assert state_bytes(model, []) == params + 7 * 2


@pytest.mark.parametrize("make, moments", [
    (lambda ps: torch.optim.Adam(ps), 2),
    (lambda ps: torch.optim.AdamW(ps), 2),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
])
def test_state_made_at_the_first_step_is_counted_before_it(make, moments):
    # Adam's moments (SGD's momentum buffer) appear at the first step, after the start's weighing: counted ahead, so
    # the start weighs the checkpoints the run will write, and after the step the same bytes (+ Adam's step counters)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    params = (3 * 5 + 5 + 5 * 1 + 1) * 4
    opt = make(model.parameters())
    assert state_bytes(model, [opt]) == params + moments * params
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    made = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    assert made >= moments * params
    assert state_bytes(model, [opt]) == params + made


@pytest.mark.parametrize("configurable, advice", [
    (True, "start torchrun with a longer grace (--shutdown-timeout 300, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"),
    (False, "this torch's torchrun waits a fixed 30 s"),
])
def test_start_line_names_the_biggest_shard_and_what_to_do(configurable, advice):
    g = StopGrace(TWO, grace_s=30.0, configurable=configurable)
    line = g.start_line([42.8e9, 10.5e9])
    assert line.startswith("rank 0's checkpoint shard is about 42.8 GB: 43 s to write at 1 GB/s")
    assert "more than the 30 s torchrun waits after a SIGTERM before it SIGKILLs the ranks" in line
    assert "pkill -TERM -P <torchrun's pid>" in line and advice in line
    assert g.start_line([30e9, 29e9]) is None  # 30 s at 1 GB/s: within the grace
    assert StopGrace(TWO, grace_s=600.0, configurable=True).start_line([42.8e9, 10.5e9]) is None


def test_save_over_the_grace_warns_once(warnings):
    g = StopGrace(TWO, grace_s=30.0, configurable=True)
    g.check_save(29.9, "step-00000050.pt")
    assert warnings == []
    g.check_save(90.2, "step-00000060.pt")
    assert len(warnings) == 1
    assert warnings[0].startswith("checkpoint step-00000060.pt took 90 s to write, more than the 30 s torchrun waits")
    assert "--shutdown-timeout 300" in warnings[0]
    g.check_save(95.0, "step-00000070.pt")
    assert len(warnings) == 1


def test_only_rank_0_says_it_and_nothing_outside_torchrun(warnings, monkeypatch):
    StopGrace(DistEnv(rank=1, world_size=2), grace_s=30.0, configurable=True).check_save(90.0, "step-1.pt")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    alone = StopGrace(DistEnv(), configurable=True)  # not under torchrun: no SIGKILL to come, no grace
    assert alone.grace_s is None and not alone.active
    alone.check_save(1e6, "step-1.pt")
    assert warnings == []


def test_one_process_under_torchrun_is_weighed_too(warnings, monkeypatch):
    # `torchrun --nproc-per-node 1` (many SLURM scripts) SIGKILLs its one process 30 s after a SIGTERM all the same;
    # before, only a run of several ranks was weighed: MLPerf's 53 GB checkpoint in one process was lost unsaid
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    one = StopGrace(DistEnv(), configurable=True)
    assert one.active and one.grace_s == 45.0
    assert one.start_line([53.3e9]).startswith("the run's checkpoint is about 53.3 GB: 53 s to write at 1 GB/s")
    assert one.start_line([44e9]) is None
    one.check_save(70.0, "step-00000100.pt")
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint step-00000100.pt took 70 s to write, more than "
                                                         "the 45 s torchrun waits")


def test_a_start_warning_is_not_repeated_after_a_save(warnings):
    g = StopGrace(TWO, grace_s=0.0, configurable=True)
    g.warned = True  # (`check_start` said it)
    g.check_save(5.0, "step-00000010.pt")
    assert warnings == []


def _two_rank_run(tmp_path, name, environ, ranks=2):
    data = tmp_path / "ds"
    if not data.is_dir():
        make_dataset(data, {"train": 60, "validation": 20, "test": 10})
    cfg = {"data": {"path": str(data), "batch_size": 10}, "model": {"embedding_dim": 4, "bottom_mlp": [8, 4],
           "top_mlp": [8, 1]}, "train": {"max_steps": 4, "log_every": 2, "device": "cpu", "baseline": False},
           "kernels": {"embedding": "torch"}, "checkpoint": {"every": 2}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           str(REPO / "train.py"), "--config", str(tmp_path / "c.json"), "--run-name", name,
                           "--tb-dir", str(tmp_path / "tb")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **environ})


def test_under_torchrun_a_grace_shorter_than_the_checkpoint_is_said_at_the_start(tmp_path):
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT=0 (where this torch's torchrun reads it): any shard outlasts it, said once by rank
    # 0 at the start; at the default 30 s this model's few KB are not
    zero = _two_rank_run(tmp_path, "zero", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"})
    assert zero.returncode == 0, process_output(zero)
    said = [ln for ln in zero.stderr.splitlines() if "torchrun waits after a SIGTERM" in ln]
    if grace_configurable():
        assert len(said) == 1, process_output(zero)
        assert "rank " in said[0] and "more than the 0 s torchrun waits" in said[0] and "[rank 1]" not in said[0]
    else:  # torch 2.11's fixed 30 s: the variable is not torchrun's, and nothing is said
        assert said == [], process_output(zero)
    default = _two_rank_run(tmp_path, "default", {})
    assert default.returncode == 0, process_output(default)
    assert "torchrun waits after a SIGTERM" not in default.stderr


def test_one_process_under_torchrun_says_it_at_the_start(tmp_path):
    one = _two_rank_run(tmp_path, "one", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"}, ranks=1)
    assert one.returncode == 0, process_output(one)
    said = [ln for ln in one.stderr.splitlines() if "torchrun waits after a SIGTERM" in ln]
    if grace_configurable():
        assert len(said) == 1, process_output(one)
        assert "the run's checkpoint is about" in said[0] and "more than the 0 s torchrun waits" in said[0]
    else:
        assert said == [], process_output(one)
