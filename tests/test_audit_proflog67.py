"""A profiled run's report as a resumed run keeps it (audit helper, proflog67): each session's profile_step.md and
profile_timeline.png kept (a resumed session's named by its profiled step), and the TensorBoard `profile/*` entries
logged at the run's step of the profiled step, which the report's heading names, not at the session's last step nor
as the trace's ProfilerStep#N (counted from 0 in every session)."""

from __future__ import annotations

import gzip
import json
import os
import socket

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from dlrm.config import load_config
from dlrm.train.reporting import log_profile
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("proflog67") / "ds"
    make_dataset(root, {"train": 640, "validation": 64}, row_group_size=80)
    return root


def tiny_config(dataset, tb, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tb), "data.batch_size": 32, "train.max_steps": 6,
            "train.log_every": 3, "train.eval_every": None, "train.device": "cpu", "train.baseline": False,
            "profile.enabled": True, "profile.wait": 1, "profile.warmup": 1, "profile.active": 2}
    return load_config(REPO / "configs" / "sample.json", {**base, **overrides})


def profile_entries(run_dir) -> dict[str, list[tuple[int, object]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    out = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
           for tag in ("profile/step_breakdown", "profile/top_kernels")}
    out["profile/timeline"] = [(e.step, e.encoded_image_string) for e in acc.Images("profile/timeline")]
    return out


def cpu_trace(step: str) -> dict:
    ev = lambda name, cat, ts_, dur: {"name": name, "cat": cat, "ph": "X", "ts": ts_, "dur": dur, "pid": 1, "tid": 1}
    return {"traceEvents": [ev(step, "user_annotation", 0, 1000), ev("backward", "user_annotation", 100, 500),
                            ev("aten::addmm", "cpu_op", 150, 300)]}


def test_a_resumed_profiled_session_keeps_the_earlier_report_and_logs_at_the_profiled_step(dataset, tmp_path):
    """wait 1, warmup 1, active 2: each session records its ProfilerStep#2 and #3 and reports #3, the session's 4th
    step: the run's step 4 in the first session (steps 1-6), 10 in the resumed one (7-12). The second session wrote
    profile_step.md and profile_timeline.png over the first's, and both sessions' TensorBoard entries sat at their
    last steps (6 and 12), each titled "ProfilerStep#3"."""
    train(tiny_config(dataset, tmp_path, **{"log.run_name": "r"}))
    run = tmp_path / "r"
    first_md, first_png = (run / "profile_step.md").read_text(), (run / "profile_timeline.png").read_bytes()
    assert first_md.startswith("# r: training step 4 of the run on ")
    train(tiny_config(dataset, tmp_path, **{"log.run_name": "r", "train.max_steps": 12}), resume="latest")
    # the first session's pair as it was; the resumed session's beside it, named by its profiled step
    assert (run / "profile_step.md").read_text() == first_md
    assert (run / "profile_timeline.png").read_bytes() == first_png
    second_md = (run / "profile_step_10.md").read_text()
    assert second_md.startswith("# r: training step 10 of the run on ")
    assert (run / "profile_timeline_10.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    entries = profile_entries(run)
    for tag, logged in entries.items():
        assert [step for step, _ in logged] == [4, 10], tag
    assert entries["profile/timeline"][0][1] == first_png
    assert entries["profile/timeline"][1][1] == (run / "profile_timeline_10.png").read_bytes()
    (_, text4), (_, text10) = entries["profile/step_breakdown"]
    assert text4.startswith("step 4 (the trace's ProfilerStep#3): host ")
    assert text10.startswith("step 10 (the trace's ProfilerStep#3): host ")
    assert "CPU ops in step 10 (the trace's ProfilerStep#3)" in entries["profile/top_kernels"][1][1]


def test_log_profile_logs_at_the_run_step_of_the_traced_step_and_never_replaces_a_report(tmp_path):
    """ProfilerStep#N is the session's step N (from 0): a session that started at run step 20 reports its
    ProfilerStep#2 as the run's step 23. A report of that step already there (a resume from an earlier checkpoint
    that profiled it again) is kept too."""
    own = tmp_path / f"{socket.gethostname()}_{os.getpid()}.1.pt.trace.json.gz"
    own.write_bytes(gzip.compress(json.dumps(cpu_trace("ProfilerStep#2")).encode()))
    (tmp_path / "profile_step.md").write_text("first session")
    (tmp_path / "profile_timeline.png").write_bytes(b"first png")
    names = []
    for _ in range(2):
        with SummaryWriter(str(tmp_path)) as writer:
            summary = log_profile(writer, tmp_path, torch.device("cpu"), 20)
        assert summary.run_step == 23
        names.append(sorted(p.name for p in tmp_path.glob("profile_*")))
    assert names == [["profile_step.md", "profile_step_23.md", "profile_timeline.png", "profile_timeline_23.png"],
                     ["profile_step.md", "profile_step_23.1.md", "profile_step_23.md", "profile_timeline.png",
                      "profile_timeline_23.1.png", "profile_timeline_23.png"]]
    assert (tmp_path / "profile_step.md").read_text() == "first session"
    assert (tmp_path / "profile_step_23.md").read_text().startswith(f"# {tmp_path.name}: training step 23 of the run")
    assert [s for s, _ in profile_entries(tmp_path)["profile/step_breakdown"]] == [23, 23]
