"""Edges of a run's reporting and its run directory (audit helper): a profile summary that is this session's own, a
trace that cannot be read, throughput across the warm-up's last step, run names that collide or name a file, and a
--resume of a checkpoint that is not in a run's checkpoints/ directory."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from dlrm.config import ConfigError, load_config
from dlrm.train import meter as meter_mod
from dlrm.train import run_dir as run_dir_mod
from dlrm.train import trace_summary as ts
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.reporting import log_profile
from dlrm.train.run_dir import RunDirectory
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_tb") / "ds"
    make_dataset(root, {"train": 320, "validation": 64}, row_group_size=80)
    return root


def tiny_config(dataset, tb, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tb), "data.batch_size": 32, "train.max_steps": 6,
            "train.log_every": 3, "train.device": "cpu", "train.baseline": False}
    return load_config(REPO / "configs" / "sample.json", {**base, **overrides})


def tensor_steps(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors(tag)] if tag in acc.Tags()["tensors"] else []


def cpu_trace(step: str = "ProfilerStep#2") -> dict:
    ev = lambda name, cat, ts_, dur: {"name": name, "cat": cat, "ph": "X", "ts": ts_, "dur": dur, "pid": 1, "tid": 1}
    return {"traceEvents": [ev(step, "user_annotation", 0, 1000), ev("backward", "user_annotation", 100, 500),
                            ev("aten::addmm", "cpu_op", 150, 300)]}


# ---- the profile summary is this session's step --------------------------------------------------


def test_a_resumed_session_that_profiled_no_step_does_not_report_the_earlier_sessions(dataset, tmp_path):
    prof = {"profile.enabled": True, "profile.wait": 1, "profile.warmup": 1, "profile.active": 2}
    train(tiny_config(dataset, tmp_path, **{"log.run_name": "r", "checkpoint.every": 3}, **prof))
    run = tmp_path / "r"
    before = (run / "profile_step.md").read_text()
    # its profiled step, not its last: ProfilerStep#2 (#3 holds step 3's evaluation, `trace_summary.AWAY`), step 3
    assert tensor_steps(run, "profile/step_breakdown") == [3]
    # one more step: fewer than the profiler's cycle, so this session profiles nothing (said at its start)
    train(tiny_config(dataset, tmp_path, **{"log.run_name": "r", "train.max_steps": 7}, **prof), resume="latest")
    assert tensor_steps(run, "profile/step_breakdown") == [3]  # not the first session's step again, at step 7
    assert (run / "profile_step.md").read_text() == before


def test_log_profile_never_reads_another_process_trace(tmp_path):
    """This process wrote no trace (it profiled no step): another process's trace in the run directory (an earlier
    session's, another rank's) is not this run's step."""
    other = tmp_path / "otherhost_1.1.pt.trace.json.gz"
    other.write_bytes(gzip.compress(json.dumps(cpu_trace()).encode()))
    with SummaryWriter(str(tmp_path / "events")) as writer:
        assert log_profile(writer, tmp_path, torch.device("cpu"), 9) is None
    assert not (tmp_path / "profile_step.md").exists()


# ---- unreadable traces are one TraceError line ----------------------------------------------------


@pytest.mark.parametrize("content", [b"", b'{"foo": 1}', b'{"traceEvents": 3}', b"[1, 2]", b"\x1f\x8b\x08\x00abc"])
def test_an_unreadable_trace_is_a_trace_error(tmp_path, content):
    path = tmp_path / "x.pt.trace.json"
    path.write_bytes(content)
    with pytest.raises(ts.TraceError, match="x.pt.trace.json"):
        ts.summarize_step(ts.load_trace(path))


def test_a_truncated_gzipped_trace_is_a_trace_error_and_trace_timeline_says_one_line(tmp_path):
    path = tmp_path / "h_1.5.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(cpu_trace()).encode() * 50)[:60])  # a trace cut off while written
    with pytest.raises(ts.TraceError, match="h_1.5.pt.trace.json.gz"):
        ts.load_trace(tmp_path)
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "trace_timeline.py"), str(path), "--out",
                        str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "h_1.5.pt.trace.json.gz" in r.stderr


def test_a_chrome_trace_in_the_json_array_format_is_read(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(cpu_trace()["traceEvents"]))  # Chrome's other trace format: the events alone
    assert ts.summarize_step(ts.load_trace(path)).step == "ProfilerStep#2"


# ---- throughput across the warm-up's last step ---------------------------------------------------


def test_a_logging_step_at_the_warm_ups_end_keeps_the_next_steps_time(monkeypatch):
    """The trainer's order on the CPU: step, read the last window, cut at a logging step. With the warm-up's last step
    a logging step (train.log_every 1 or 3), closing that warm-up window must not restart the first steady window
    after the next step ran: every step takes 1 s, so the steady state is one batch a second."""
    clock = [100.0]
    monkeypatch.setattr(meter_mod.time, "perf_counter", lambda: clock[0])
    for log_every, total in ((3, 12), (1, 10)):
        m = StepMeter(torch.device("cpu"), 0, RunStats(), window=log_every, warmup_steps=3)
        pending = None
        for step in range(1, total + 1):
            clock[0] += 1.0
            m.step(torch.tensor(0.5), samples=100, data_wait_s=0.0)
            if pending is not None:
                m.close_window(pending, 0.5)
                pending = None
            if step % log_every == 0 or step == total:
                pending = m.cut_window(step)
        clock[0] += 0.001  # the loop's end (the loader's close) before the last window's read
        m.close_window(pending, 0.5)
        assert m.samples_per_sec == pytest.approx(100.0, rel=1e-3), log_every


# ---- run names ------------------------------------------------------------------------------------


def test_a_run_name_that_is_a_file_is_one_config_error_and_the_file_stays(dataset, tmp_path):
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(ConfigError, match="taken.*not a directory"):
        RunDirectory.create(tiny_config(dataset, tmp_path, **{"log.run_name": "taken"}))
    assert (tmp_path / "taken").read_text() == "mine"  # (the CLI says a ConfigError in one line, exit code 2)


def test_two_runs_started_in_the_same_second_get_two_directories(dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_mod.time, "strftime", lambda fmt, *a: "20260101-120000")
    cfg = tiny_config(dataset, tmp_path)
    first = RunDirectory.create(cfg)
    (first.path / "events.out.tfevents.1").write_text("first run's")
    second = RunDirectory.create(cfg)  # the same default name: the first run's directory is not for it
    third = RunDirectory.create(cfg)
    assert len({first.path, second.path, third.path}) == 3
    assert first.path.name == "sample-20260101-120000" and second.path.name.startswith(first.path.name)
    assert (first.path / "events.out.tfevents.1").read_text() == "first run's"
    for run in (first, second, third):
        run.close()
    # a name given by the user is never changed: an occupied one is refused
    with pytest.raises(ConfigError, match="already exists"):
        RunDirectory.create(tiny_config(dataset, tmp_path, **{"log.run_name": first.path.name}))


# ---- --resume of a checkpoint outside a run -------------------------------------------------------


def test_resume_of_a_checkpoint_outside_a_run_does_not_write_into_its_folder(dataset, tmp_path):
    train(tiny_config(dataset, tmp_path / "tb", **{"log.run_name": "src"}))
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    shutil.copy(tmp_path / "tb" / "src" / "checkpoints" / "step-00000006.pt", home / "models" / "mine.pt")
    (home / "summary.json").write_text('{"mine": true}')
    cfg = tiny_config(dataset, tmp_path / "tb", **{"train.max_steps": 7})
    with pytest.raises(ConfigError, match="mine.pt.*--run-name"):
        train(cfg, resume=str(home / "models" / "mine.pt"))
    assert sorted(p.name for p in home.iterdir()) == ["models", "summary.json"]
    assert (home / "summary.json").read_text() == '{"mine": true}'
    # with --run-name it continues in a new run of that name
    summary = train(tiny_config(dataset, tmp_path / "tb", **{"train.max_steps": 7, "log.run_name": "home"}),
                    resume=str(home / "models" / "mine.pt"))
    assert summary["steps"] == 7 and summary["run_dir"] == str(tmp_path / "tb" / "home")
    assert sorted(p.name for p in home.iterdir()) == ["models", "summary.json"]


# ---- the HParams metrics of an extended run --------------------------------------------------------


def test_the_hparams_metrics_of_each_session_are_at_its_last_step(dataset, tmp_path):
    """The run's `hparam/*` scalars (the HParams dashboard's metrics) were written at step 0: an extended run (--resume
    with a larger train.max_steps) then held two values at step 0, and which one the dashboard showed was arbitrary."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tiny_config(dataset, tmp_path, **{"log.run_name": "hp"}))
    second = train(tiny_config(dataset, tmp_path, **{"log.run_name": "hp", "train.max_steps": 9}), resume="latest")
    acc = EventAccumulator(str(tmp_path / "hp"), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("hparam/auc")
    assert [e.step for e in events] == [6, 9]
    assert events[-1].value == pytest.approx(second["auc"], abs=1e-6)


def test_resume_of_best_pt_in_place_when_it_is_the_latest_checkpoint(dataset, tmp_path):
    """best.pt is a hard link to its step's checkpoint; when that is the run's latest one, resuming best.pt in place
    continues the run (it was refused as "not the latest checkpoint": the paths were compared, not the files)."""
    cfg = tiny_config(dataset, tmp_path, **{"log.run_name": "b", "train.eval_every": 6})
    train(cfg)
    best = tmp_path / "b" / "checkpoints" / "best.pt"
    assert best.samefile(tmp_path / "b" / "checkpoints" / "step-00000006.pt")
    summary = train(tiny_config(dataset, tmp_path, **{"log.run_name": "b", "train.eval_every": 6, "train.max_steps": 9}),
                    resume=str(best))
    assert summary["resumed_at_step"] == 6 and summary["steps"] == 9
