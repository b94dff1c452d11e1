"""What TensorBoard shows without internet (#19): a profiled run's step breakdown, top kernels and
timeline (dlrm.train.trace_summary, dlrm.train.reporting.log_profile), a --compare run's table and
plot in the parent run, and HParams sessions that are the runs themselves (no ``<run>/hparams``)."""

from __future__ import annotations

import io
import json
import re

import matplotlib.image
import pytest

from dlrm.config import load_config
from dlrm.train import trace_summary as ts
from dlrm.train.compare import run_comparison
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset

STEP_RANGES = ["data", "SparseArch", "DenseArch", "InteractionArch", "OverArch", "loss", "backward", "optimizer"]


# ---- the trace analysis on hand-made traces --------------------------------------------------------


def ev(name: str, cat: str, ts_: float, dur: float, tid: int = 1, corr=None) -> dict:
    e = {"name": name, "cat": cat, "ph": "X", "ts": ts_, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def gpu_trace() -> dict:
    """One CUDA step (µs): kernels found through their launches' correlation ids, one launched from the
    autograd thread (tid 2), one finishing after the step, one launched by the step before."""
    return {"traceEvents": [
        ev("ProfilerStep#4", "user_annotation", 1000, 1000),
        ev("SparseArch", "user_annotation", 1000, 200),
        ev("backward", "user_annotation", 1300, 400),
        ev("optimizer", "user_annotation", 1700, 200),
        ev("cudaLaunchKernel", "cuda_runtime", 1050, 10, corr=1),
        ev("cudaLaunchKernel", "cuda_runtime", 1350, 10, tid=2, corr=2),
        ev("cudaGraphLaunch", "cuda_runtime", 1750, 20, corr=3),
        ev("cudaMemcpyAsync", "cuda_runtime", 1950, 5, corr=4),  # outside every named range
        ev("cudaLaunchKernel", "cuda_runtime", 900, 10, corr=9),  # the step before
        ev("embedding_fwd", "kernel", 1100, 30, corr=1),
        ev("gemm", "kernel", 2200, 100, corr=2),
        ev("adam", "kernel", 2400, 20, corr=3),
        ev("adam", "kernel", 2420, 20, corr=3),
        ev("Memcpy HtoD", "gpu_memcpy", 2500, 5, corr=4),
        ev("late_kernel", "kernel", 1010, 50, corr=9),
        ev("backward", "gpu_user_annotation", 2200, 100),
    ]}  # fmt: skip


def test_device_time_follows_the_launch_correlation_ids():
    s = ts.summarize_step(gpu_trace())
    assert s.step == "ProfilerStep#4" and s.on_device
    got = {r.name: (r.host_ms, r.device_ms) for r in s.ranges}
    assert got == {"SparseArch": (0.2, 0.03), "backward": (0.4, 0.1), "optimizer": (0.2, 0.04),
                   "other": (pytest.approx(0.2), 0.005)}  # fmt: skip
    assert s.device_busy_ms == pytest.approx(0.17) and s.kernels == 4 and s.copy_ms == pytest.approx(0.005)
    assert [(t.name, t.calls) for t in s.top] == [("gemm", 1), ("adam", 2), ("embedding_fwd", 1)]


def test_gpu_tables_have_device_columns_and_kernels():
    s = ts.summarize_step(gpu_trace())
    table = ts.step_table(s)
    assert "ProfilerStep#4: host 1.000 ms, device kernels busy 0.170 ms (4 kernels), memcpy/memset 0.005 ms" in table
    assert "| range | host ms | device ms | host % of step |" in table
    assert "| backward | 0.400 | 0.100 | 40.0 |" in table
    top = ts.top_table(s)
    assert "| `gemm` | 1 | 0.100 | 58.8 |" in top and "| `adam` | 2 | 0.040 | 23.5 |" in top
    assert "late_kernel" not in top


def cpu_trace() -> dict:
    """One CPU step (µs): nested ops on the step's thread, one op on another thread."""
    return {"traceEvents": [
        ev("ProfilerStep#2", "user_annotation", 0, 1000),
        ev("DenseArch", "user_annotation", 0, 400),
        ev("aten::linear", "cpu_op", 10, 300), ev("aten::addmm", "cpu_op", 20, 250),
        ev("backward", "user_annotation", 400, 500), ev("aten::mm", "cpu_op", 450, 100),
        ev("aten::mm", "cpu_op", 600, 100, tid=2),
    ]}  # fmt: skip


def test_cpu_trace_reports_host_time_and_cpu_ops_by_self_time_not_zero_columns():
    s = ts.summarize_step(cpu_trace())
    assert not s.on_device and s.device_busy_ms is None
    assert all(r.device_ms is None for r in s.ranges)
    assert [(t.name, t.calls, t.ms) for t in s.top] == [("aten::addmm", 1, 0.25), ("aten::mm", 2, 0.2),
                                                        ("aten::linear", 1, 0.05)]  # fmt: skip
    table, top = ts.step_table(s), ts.top_table(s)
    assert "device" not in table.split("\n", 2)[2] and "0.000" not in table
    assert "| DenseArch | 0.400 | 40.0 |" in table and "| other | 0.100 | 10.0 |" in table
    assert "| CPU op | calls | self ms | % of step |" in top and "| `aten::addmm` | 1 | 0.250 | 25.0 |" in top


def test_host_calls_are_ranked_by_inclusive_time_runtime_calls_included():
    gpu, cpu = ts.summarize_step(gpu_trace()), ts.summarize_step(cpu_trace())
    assert [(t.name, t.calls, t.ms) for t in gpu.host_calls] == [  # equal totals: by name
        ("cudaGraphLaunch", 1, pytest.approx(0.02)), ("cudaLaunchKernel", 2, pytest.approx(0.02)),
        ("cudaMemcpyAsync", 1, pytest.approx(0.005))]  # fmt: skip
    assert [(t.name, t.calls, t.ms) for t in cpu.host_calls] == [
        ("aten::linear", 1, 0.3), ("aten::addmm", 1, 0.25), ("aten::mm", 2, 0.2)]  # fmt: skip
    assert "| `cudaLaunchKernel` | 2 | 0.020 |" in ts.host_calls_table(gpu)
    assert "| `aten::mm` | 2 | 0.200 |" in ts.report(cpu, "t")


def test_device_time_goes_to_the_innermost_range_and_nested_ranges_count_once():
    """A kernel launched inside ``loss`` nested in ``OverArch`` is the loss's; the step's host time outside every
    range is the step less the union of the ranges; a launch at the step's end belongs to the next step."""
    trace = {"traceEvents": [
        ev("ProfilerStep#3", "user_annotation", 0, 1000),
        ev("OverArch", "user_annotation", 100, 400), ev("loss", "user_annotation", 300, 100),
        ev("cudaLaunchKernel", "cuda_runtime", 150, 5, corr=1), ev("cudaLaunchKernel", "cuda_runtime", 350, 5, corr=2),
        ev("cudaLaunchKernel", "cuda_runtime", 1000, 5, corr=3),
        ev("mlp", "kernel", 160, 10, corr=1), ev("bce", "kernel", 360, 20, corr=2),
        ev("next", "kernel", 1010, 40, corr=3),
    ]}  # fmt: skip
    s = ts.summarize_step(trace)
    assert [(r.name, r.host_ms, r.device_ms) for r in s.ranges] == [
        ("OverArch", 0.4, 0.01), ("loss", 0.1, 0.02), ("other", 0.6, 0.0)]  # fmt: skip
    assert s.kernels == 2 and s.device_busy_ms == pytest.approx(0.03)


def test_the_profiled_step_is_the_last_that_holds_a_backward():
    anno = lambda name, ts_, dur: ev(name, "user_annotation", ts_, dur)
    events = [anno("ProfilerStep#1", 0, 100), anno("backward", 50, 10), anno("ProfilerStep#2", 100, 100),
              anno("backward", 150, 10), anno("ProfilerStep#3", 200, 50)]  # fmt: skip
    assert ts.profiled_step(events)["name"] == "ProfilerStep#2"


def test_without_correlation_ids_device_time_comes_from_the_profilers_device_spans():
    """Kernels without correlation ids count for the step when they start in it or up to a step's length after it,
    and each range's device time is its gpu_user_annotation span."""
    trace = {"traceEvents": [
        ev("ProfilerStep#5", "user_annotation", 0, 1000), ev("backward", "user_annotation", 400, 500),
        ev("k1", "kernel", 500, 100), ev("k2", "kernel", 1500, 50), ev("k3", "kernel", 2100, 10),
        ev("backward", "gpu_user_annotation", 1200, 300),
    ]}  # fmt: skip
    s = ts.summarize_step(trace)
    assert s.on_device and s.kernels == 2 and s.device_busy_ms == pytest.approx(0.15)
    assert [(r.name, r.host_ms, r.device_ms) for r in s.ranges] == [("backward", 0.5, 0.3), ("other", 0.5, None)]
    assert [label for label, _ in ts.lanes(ts.collect(trace))][-1] == "device: kernels"


def test_a_device_op_without_a_correlation_id_in_a_linked_trace_is_left_out():
    trace = gpu_trace()
    trace["traceEvents"].append(ev("Memset (Device)", "gpu_memset", 1500, 7))
    assert ts.summarize_step(trace) == ts.summarize_step(gpu_trace())


def test_the_cpu_timeline_lane_holds_the_steps_threads_outermost_ops():
    (_, ranges), (label, ops) = ts.lanes(ts.collect(cpu_trace()))
    assert label == "host: CPU ops (outermost)"
    assert [(e["name"], e["ts"], name) for e, name in ops] == [("aten::linear", 10, "DenseArch"),
                                                               ("aten::mm", 450, "backward")]
    assert [name for _, name in ranges] == ["DenseArch", "backward"]


def test_table_cells_are_cut_and_escaped():
    long = ts.cell("k" * 500)
    assert len(long) == ts.NAME_WIDTH + 2 and long.endswith("…`") and long.startswith("`kkk")
    assert ts.cell("a`b|c") == "`a'b\\|c`" and ts.cell("short") == "`short`"


def test_a_trace_without_a_profiled_step_is_a_trace_error(tmp_path):
    with pytest.raises(ts.TraceError, match="no ProfilerStep"):
        ts.summarize_step({"traceEvents": [ev("aten::mm", "cpu_op", 0, 1)]})
    with pytest.raises(ts.TraceError, match="train with --profile"):
        ts.load_trace(tmp_path)


def test_timeline_png_has_a_lane_per_kind_of_event():
    assert [label for label, _ in ts.lanes(ts.collect(gpu_trace()))] == [
        "host: named ranges", "device: profiler spans per range", "device: kernels, by launching range"]
    image = matplotlib.image.imread(io.BytesIO(ts.timeline_png(gpu_trace(), "t")), format="png")
    assert image.shape[1] > 1000 and image.shape[0] > 150


# ---- the events of real runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("tbs") / "ds"
    make_dataset(root, {"train": 320, "validation": 64}, row_group_size=80)
    return root


def tiny_config(dataset, tb, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tb), "data.batch_size": 32, "train.max_steps": 6,
            "train.log_every": 3, "train.device": "cpu", "train.baseline": False}
    return load_config(REPO / "configs" / "sample.json", {**base, **overrides})


@pytest.fixture(scope="module")
def profiled_run(dataset, tmp_path_factory):
    tb = tmp_path_factory.mktemp("tbs") / "tb"
    train(tiny_config(dataset, tb, **{"log.run_name": "prof", "profile.enabled": True, "profile.wait": 1,
                                      "profile.warmup": 1, "profile.active": 2}))
    return tb / "prof"


def accumulator(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def text(acc, tag: str) -> str:
    (event,) = acc.Tensors(tag)
    return event.tensor_proto.string_val[0].decode()


def decoded(acc, tag: str):
    (event,) = acc.Images(tag)
    image = matplotlib.image.imread(io.BytesIO(event.encoded_image_string), format="png")
    assert image.shape[:2] == (event.height, event.width)
    return image


def table_rows(markdown: str) -> dict[str, list[str]]:
    """{first cell: other cells} of a Markdown table's body rows."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")]
    return {r[0]: r[1:] for r in rows[1:]}


def test_profiled_run_shows_step_breakdown_kernels_and_timeline(profiled_run):
    acc = accumulator(profiled_run)
    tags = acc.Tags()
    assert "profile/top_ops" not in tags["tensors"]  # the raw profiler table is gone
    breakdown = text(acc, "profile/step_breakdown")
    assert re.match(r"step \d+ \(the trace's ProfilerStep#\d+\): host \d+\.\d{3} ms \(a CPU run", breakdown)
    rows = table_rows(breakdown)
    assert set(STEP_RANGES) <= set(rows)
    host_ms = {name: float(cells[0]) for name, cells in rows.items()}
    step_ms = float(re.search(r"host (\d+\.\d+) ms", breakdown)[1])
    assert all(ms > 0 for ms in host_ms.values())
    assert sum(host_ms.values()) == pytest.approx(step_ms, rel=0.01)
    kernels = text(acc, "profile/top_kernels")
    ops = table_rows(kernels)
    assert "CPU ops" in kernels and any(name.startswith("`aten::") for name in ops)
    assert all(int(cells[0]) >= 1 and float(cells[1]) >= 0 for cells in ops.values())
    image = decoded(acc, "profile/timeline")
    assert image.shape[1] > 800 and image[..., :3].std() > 0.05  # a picture, not a blank
    assert (profiled_run / "profile_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| backward |" in (profiled_run / "profile_step.md").read_text()


def test_hparams_are_in_the_run_itself_and_the_plugin_lists_the_run(profiled_run, dataset):
    assert not (profiled_run / "hparams").exists()
    assert set(profiled_run.rglob("events.out.tfevents*")) == set(profiled_run.glob("events.out.tfevents*"))
    acc = accumulator(profiled_run)
    assert {"hparam/auc", "hparam/logloss", "hparam/accuracy"} <= set(acc.Tags()["scalars"])
    groups = hparams_session_groups(profiled_run.parent)
    assert [g["name"] for g in groups] == ["prof"]
    (group,) = groups
    cfg = tiny_config(dataset, profiled_run.parent)  # the run's model and optimizer settings
    summary = json.loads((profiled_run / "summary.json").read_text())
    assert group["hparams"] == pytest.approx({
        "batch_size": 32, "precision": "fp32", "embedding_dim": cfg.model.embedding_dim,
        "dense_lr": cfg.optim.dense.lr, "sparse_lr": cfg.optim.sparse.lr, "interaction": cfg.model.interaction,
        "cross_layers": 0, "cross_rank": 0, "multi_hot_values": 26,  # no cross network, one-hot data
        "kernels": "torch", "compile": "off",  # as trained ("auto" resolved on the CPU)
        "steps": summary["steps"], "seed": str(summary["resolved"]["seed"])})
    assert cfg.optim.dense.lr != cfg.optim.sparse.lr
    metrics = {m["name"]["tag"]: m["value"] for m in group["sessions"][0]["metricValues"]}
    assert metrics == pytest.approx({f"hparam/{k}": summary[k] for k in ("auc", "logloss", "accuracy")}, abs=1e-6)
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in metrics}
    assert scalars == {tag: [pytest.approx(value, abs=1e-6)] for tag, value in metrics.items()}


def hparams_session_groups(logdir) -> list[dict]:
    """The session groups TensorBoard's HParams dashboard asks its plugin for."""
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import hparams_plugin
    from werkzeug.test import Client
    from werkzeug.wrappers import Response

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    context = base_plugin.TBContext(logdir=str(logdir), multiplexer=mux,
                                    data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)))
    app = hparams_plugin.HParamsPlugin(context).get_plugin_apps()["/session_groups"]
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 100,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]}
    response = Client(app, Response).post("/session_groups", data=json.dumps(request),
                                          content_type="application/json")
    assert response.status_code == 200, response.get_data(as_text=True)
    return json.loads(response.get_data(as_text=True))["sessionGroups"]


def test_compare_writes_table_and_plot_into_the_parent_run(dataset, tmp_path):
    cfg = tiny_config(dataset, tmp_path / "tb", **{"log.run_name": "cmp", "profile.enabled": False})
    run_comparison(cfg, ["eager"], train)
    acc = accumulator(tmp_path / "tb" / "cmp")
    table = text(acc, "compare/table")
    assert table == (tmp_path / "tb" / "cmp" / "compare.md").read_text()
    row = table_rows(table)["eager"]
    assert float(row[0].replace(",", "")) > 0 and row[-1] == "ok"
    image = decoded(acc, "compare/plot")
    assert image.shape[1] > 500
    # the variant is a run of its own, with its hparams in it
    assert not (tmp_path / "tb" / "cmp" / "eager" / "hparams").exists()
    assert "hparam/auc" in accumulator(tmp_path / "tb" / "cmp" / "eager").Tags()["scalars"]


def test_log_profile_reads_this_process_trace_and_survives_an_unreadable_one(tmp_path):
    """In a distributed run every rank writes a trace into the run dir; rank 0 summarizes its own, and a
    trace it cannot read costs the summary (a warning), never the finished run."""
    import gzip
    import os
    import socket

    import torch
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.train.reporting import log_profile

    own = tmp_path / f"{socket.gethostname()}_{os.getpid()}.1.pt.trace.json.gz"
    own.write_bytes(gzip.compress(json.dumps(gpu_trace()).encode()))
    other = tmp_path / "otherhost_1.2.pt.trace.json.gz"
    other.write_bytes(gzip.compress(b'{"traceEvents": [')[:20])  # another rank's, half written
    os.utime(other, (own.stat().st_mtime + 10,) * 2)  # and newer
    with SummaryWriter(str(tmp_path)) as writer:
        summary = log_profile(writer, tmp_path, torch.device("cpu"), 3)
    assert summary.step == "ProfilerStep#4" and summary.run_step == 8 and "| `gemm` | 1 | 0.100 |" in (tmp_path / "profile_step.md").read_text()
    acc = accumulator(tmp_path)
    assert "| `gemm` | 1 | 0.100 |" in text(acc, "profile/top_kernels")
    steps = [e.step for tag in ("profile/step_breakdown", "profile/top_kernels") for e in acc.Tensors(tag)]
    # the run's step of the trace's ProfilerStep#4 in a session started at step 3: its 5th step
    assert steps + [e.step for e in acc.Images("profile/timeline")] == [8, 8, 8]
    own.unlink()
    with SummaryWriter(str(tmp_path / "b")) as writer:
        assert log_profile(writer, tmp_path, torch.device("cpu"), 3) is None
