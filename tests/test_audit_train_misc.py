"""Audit of the training run's side outputs (mutation testing of dlrm/train/graphed_step.py, trace_summary.py,
profiling.py, export.py, reporting.py): the numbers a profiled step's summary shows, which trace is read, the
profiler's settings, the exported program's inputs and outputs, what the run's report files hold, and the
CUDA-graph step's host-side bookkeeping (which batches replay, the warm-up count, the learning rates and
inputs the graph reads), driven with stand-ins for the CUDA parts so it runs on any machine."""

from __future__ import annotations

import gzip
import json
import os
import socket

import pytest
import torch

from dlrm.config import Config, KernelsConfig, ProfileConfig
from dlrm.data.loader import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model.dlrm import build_model
from dlrm.train import graphed_step as gs_mod
from dlrm.train import trace_summary as ts
from dlrm.train.optim import FusedSparseOptimizer


def ev(name: str, cat: str, ts_: float, dur: float, tid: int = 1, corr=None, pid: int = 1) -> dict:
    e = {"name": name, "cat": cat, "ph": "X", "ts": ts_, "dur": dur, "pid": pid, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


# ---- trace_summary: the numbers of the step ---------------------------------------------------------


def test_an_op_starting_with_its_caller_is_nested_in_it_and_one_starting_at_its_end_is_not():
    """Self time: aten::linear and the aten::addmm it calls often start in the same microsecond (the longer one
    is the caller), and an op starting exactly when the previous one ends is its sibling, not its child."""
    ops = [ev("aten::linear", "cpu_op", 10, 300), ev("aten::addmm", "cpu_op", 10, 250),
           ev("aten::relu", "cpu_op", 310, 40)]  # fmt: skip
    assert ts.self_times(ops) == {0: 50, 1: 250, 2: 40}
    assert ts.self_times(list(reversed(ops))) == {0: 40, 1: 250, 2: 50}  # the order of the events is no matter
    trace = {"traceEvents": [ev("ProfilerStep#1", "user_annotation", 0, 1000), *ops]}
    assert [(t.name, t.calls, t.ms) for t in ts.summarize_step(trace).top] == [
        ("aten::addmm", 1, 0.25), ("aten::linear", 1, 0.05), ("aten::relu", 1, 0.04)]  # fmt: skip


def test_ops_of_different_processes_are_not_nested_in_each_other():
    """Self time is per (pid, tid): the same thread id in two processes is two threads."""
    ops = [ev("a", "cpu_op", 0, 100, pid=1), ev("b", "cpu_op", 10, 50, pid=2)]
    assert ts.self_times(ops) == {0: 100, 1: 50}


def test_the_top_tables_hold_exactly_top_rows():
    """`top` rows, not one fewer: the top kernels/ops and the host calls."""
    named = [("a", 5000), ("b", 4000), ("c", 3000), ("d", 2000)]
    assert [(t.name, t.ms) for t in ts.ranked(named, top=3)] == [("a", 5.0), ("b", 4.0), ("c", 3.0)]
    trace = {"traceEvents": [ev("ProfilerStep#1", "user_annotation", 0, 1000),
                             *(ev(n, "cpu_op", 100 * i, us / 100) for i, (n, us) in enumerate(named))]}
    s = ts.summarize_step(trace, top=2)
    assert [t.name for t in s.top] == ["a", "b"] and [t.name for t in s.host_calls] == ["a", "b"]


def linked_trace_with_driver_launches() -> dict:
    """A CUDA step whose Triton kernels were launched through the driver API (cuLaunchKernel, category
    cuda_driver), with a memset and a memcpy (µs)."""
    return {"traceEvents": [
        ev("ProfilerStep#3", "user_annotation", 0, 1000),
        ev("SparseArch", "user_annotation", 0, 300), ev("optimizer", "user_annotation", 600, 300),
        ev("cuLaunchKernel", "cuda_driver", 50, 10, corr=1),
        ev("cudaMemsetAsync", "cuda_runtime", 100, 4, corr=2),
        ev("cudaMemcpyAsync", "cuda_runtime", 700, 6, corr=3),
        ev("cuLaunchKernel", "cuda_driver", 800, 10, corr=4),
        ev("embedding_fwd", "kernel", 70, 40, corr=1),
        ev("Memset (Device)", "gpu_memset", 120, 3, corr=2),
        ev("Memcpy HtoD", "gpu_memcpy", 720, 8, corr=3),
        ev("adam", "kernel", 820, 60, corr=4),
    ]}  # fmt: skip


def test_driver_api_launches_attribute_kernels_and_count_as_host_calls():
    """Triton launches its kernels with cuLaunchKernel (cuda_driver): those kernels count in the range that
    launched them, and the driver calls are among the host calls."""
    s = ts.summarize_step(linked_trace_with_driver_launches())
    assert s.kernels == 2 and s.device_busy_ms == pytest.approx(0.1)
    assert [(r.name, r.host_ms, r.device_ms) for r in s.ranges] == [
        ("SparseArch", 0.3, pytest.approx(0.043)), ("optimizer", 0.3, pytest.approx(0.068)), ("other", 0.4, 0.0)]
    assert ("cuLaunchKernel", 2, pytest.approx(0.02)) in [(t.name, t.calls, t.ms) for t in s.host_calls]


def test_memsets_count_as_copies_not_kernels():
    """The step line's memcpy/memset time holds the gpu_memset ops as well as the copies."""
    s = ts.summarize_step(linked_trace_with_driver_launches())
    assert s.copy_ms == pytest.approx(0.011)  # the 3 µs memset and the 8 µs memcpy
    assert ", memcpy/memset 0.011 ms" in ts.step_line(s)


def test_a_host_gap_under_half_a_microsecond_is_no_other_row():
    """The trace's rounding leaves sub-microsecond gaps between ranges: no "other" row for those, one above 0.5 µs."""
    trace = {"traceEvents": [ev("ProfilerStep#1", "user_annotation", 0, 1000.3),
                             ev("DenseArch", "user_annotation", 0, 1000)]}  # fmt: skip
    assert [r.name for r in ts.summarize_step(trace).ranges] == ["DenseArch"]
    trace["traceEvents"][0]["dur"] = 1000.6
    assert [(r.name, r.host_ms) for r in ts.summarize_step(trace).ranges] == [
        ("DenseArch", 1.0), ("other", pytest.approx(0.0006))]


def test_a_range_with_device_time_only_has_a_row_and_the_step_span_is_no_range():
    """Without correlation ids each range's device time is its profiler device span: a span of a range whose host
    part lies outside the step (the optimizer's kernels still running) is a row of its own; the profiler's
    ``ProfilerStep#N`` device span is not a range (neither a row nor a bar in the device lane)."""
    trace = {"traceEvents": [
        ev("ProfilerStep#5", "user_annotation", 0, 1000), ev("backward", "user_annotation", 400, 500),
        ev("k1", "kernel", 500, 100),
        ev("ProfilerStep#5", "gpu_user_annotation", 450, 1200),
        ev("backward", "gpu_user_annotation", 500, 300), ev("optimizer", "gpu_user_annotation", 1100, 200),
    ]}  # fmt: skip
    s = ts.summarize_step(trace)
    assert [(r.name, r.host_ms, r.device_ms) for r in s.ranges] == [
        ("backward", 0.5, 0.3), ("optimizer", 0.0, 0.2), ("other", 0.5, None)]
    spans = dict(ts.lanes(ts.collect(trace)))["device: profiler spans per range"]
    assert [(e["name"], name) for e, name in spans] == [("backward", "backward"), ("optimizer", "optimizer")]


def test_the_cpu_lane_keeps_an_op_that_starts_when_the_previous_one_ends():
    """The CPU timeline's outermost ops: a sibling that starts as the previous op ends is drawn, a nested one not."""
    ops = [{"ts": 0, "dur": 10}, {"ts": 10, "dur": 5}, {"ts": 12, "dur": 1}]
    assert [e["ts"] for e in ts.outermost(ops)] == [0, 10]


def test_a_name_of_exactly_the_cell_width_is_kept_whole():
    """Kernel names are cut only when longer than NAME_WIDTH."""
    assert ts.cell("k" * ts.NAME_WIDTH) == "`" + "k" * ts.NAME_WIDTH + "`"
    assert ts.cell("k" * (ts.NAME_WIDTH + 1)) == "`" + "k" * (ts.NAME_WIDTH - 1) + "…`"


def test_a_backward_starting_at_a_steps_end_is_not_in_that_step():
    """A step range is half-open: a backward starting at its end does not make it the profiled training step."""
    anno = lambda name, ts_, dur: ev(name, "user_annotation", ts_, dur)
    events = [anno("ProfilerStep#1", 0, 100), anno("backward", 50, 10), anno("ProfilerStep#2", 200, 100),
              anno("backward", 300, 10)]  # fmt: skip
    assert ts.profiled_step(events)["name"] == "ProfilerStep#1"


# ---- trace_summary and profiling: which trace -------------------------------------------------------


def write_trace(path, trace: dict, mtime: float, gz: bool = True):
    data = json.dumps(trace).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    os.utime(path, (mtime, mtime))
    return path


def cpu_step(n: int) -> dict:
    return {"traceEvents": [ev(f"ProfilerStep#{n}", "user_annotation", 0, 100)]}


def test_the_newest_trace_is_the_last_written_not_the_last_named(tmp_path):
    """Trace names start with the host name: the newest trace under a directory is found by its time."""
    new = write_trace(tmp_path / "a_1.1.pt.trace.json.gz", cpu_step(9), 2_000_000_000)
    write_trace(tmp_path / "z_1.1.pt.trace.json.gz", cpu_step(1), 1_000_000_000)
    assert ts.find_trace(tmp_path) == new
    assert ts.summarize_step(ts.load_trace(tmp_path)).step == "ProfilerStep#9"


def test_an_uncompressed_trace_is_read_too(tmp_path):
    """``*.pt.trace.json`` (benchmarks/trace_timeline.py's input, a profiler run without gzip) loads as JSON."""
    path = write_trace(tmp_path / "h_1.1.pt.trace.json", cpu_step(4), 1_000_000_000, gz=False)
    assert ts.load_trace(path) == cpu_step(4) and ts.load_trace(tmp_path) == cpu_step(4)


def test_own_trace_is_this_process_newest(tmp_path):
    """Rank 0 summarizes the newest of its own traces (one per profiler cycle), never another rank's; trace_files
    lists every rank's, by name."""
    from dlrm.train.profiling import own_trace, trace_files

    mine = f"{socket.gethostname()}_{os.getpid()}"
    newest = write_trace(tmp_path / f"{mine}.200.pt.trace.json.gz", cpu_step(2), 2_000_000_000)
    write_trace(tmp_path / f"{mine}.300.pt.trace.json.gz", cpu_step(1), 1_000_000_000)
    write_trace(tmp_path / "otherhost_1.400.pt.trace.json.gz", cpu_step(3), 3_000_000_000)
    assert own_trace(tmp_path) == newest
    names = [f"{mine}.200.pt.trace.json.gz", f"{mine}.300.pt.trace.json.gz", "otherhost_1.400.pt.trace.json.gz"]
    assert [p.name for p in trace_files(tmp_path)] == sorted(names)  # every rank's, by name


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_profiler_gets_the_configured_schedule_and_options(tmp_path, device):
    """make_profiler builds the profiler only (no device work): a "cuda" device is given on any machine."""
    from torch.profiler import ProfilerAction, ProfilerActivity

    from dlrm.train.profiling import make_profiler

    cfg = ProfileConfig(enabled=True, wait=1, warmup=1, active=2, repeat=2, record_shapes=False,
                        profile_memory=True, with_stack=True)
    prof = make_profiler(cfg, tmp_path, torch.device(device))
    assert (prof.record_shapes, prof.profile_memory, prof.with_stack) == (False, True, True)
    expected = {ProfilerActivity.CPU} | ({ProfilerActivity.CUDA} if device == "cuda" else set())
    assert set(prof.activities) == expected
    A = ProfilerAction
    cycle = [A.NONE, A.WARMUP, A.RECORD, A.RECORD_AND_SAVE]
    assert [prof.schedule(i) for i in range(10)] == cycle + cycle + [A.NONE, A.NONE]  # two cycles, then nothing
    cfg.record_shapes, cfg.profile_memory, cfg.with_stack = True, False, False
    prof = make_profiler(cfg, tmp_path, torch.device(device))
    assert (prof.record_shapes, prof.profile_memory, prof.with_stack) == (True, False, False)


# ---- reporting ----------------------------------------------------------------------------------------


def test_profile_step_md_is_the_whole_report(tmp_path):
    """profile_step.md holds the per-range table, the top kernels and the host calls, titled with the run and device."""
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.train.reporting import device_name, log_profile

    trace = linked_trace_with_driver_launches()
    write_trace(tmp_path / f"{socket.gethostname()}_{os.getpid()}.1.pt.trace.json.gz", trace, 1_000_000_000)
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        summary = log_profile(writer, tmp_path, torch.device("cpu"), 7)
    run_step = summary.run_step  # the trace's ProfilerStep#N in a session started at step 7: the run's step 7 + N + 1
    assert run_step == 7 + ts.session_step(summary.step) + 1
    title = f"{tmp_path.name}: training step {run_step} of the run on {device_name(torch.device('cpu'))}"
    md = (tmp_path / "profile_step.md").read_text()
    assert md == ts.report(ts.summarize_step(trace, start_step=7), title)
    assert summary == ts.summarize_step(trace, start_step=7)
    assert md.startswith(f"# {title}\n") and "| `adam` | 1 | 0.060 | 60.0 |" in md
    assert "| `cuLaunchKernel` | 2 | 0.020 |" in md


def test_the_profile_image_is_stored_as_rgba_with_its_size(tmp_path):
    """TensorBoard's image summary holds the PNG's own bytes, its width and height and RGBA's colorspace."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.train.reporting import add_png

    png = ts.timeline_png(linked_trace_with_driver_launches(), "t")
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert png[25] == 6  # matplotlib writes RGBA (colour type 6)
    with SummaryWriter(str(tmp_path)) as writer:
        add_png(writer, "profile/timeline", png, 5)
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    (image,) = acc.Images("profile/timeline")
    assert (image.width, image.height, image.step, image.encoded_image_string) == (width, height, 5, png)
    # the accumulator drops the colorspace field: read it from the event file itself
    events = [e for path in tmp_path.glob("events.out.tfevents*") for e in LegacyEventFileLoader(str(path)).Load()]
    colorspaces = [v.image.colorspace for e in events for v in e.summary.value if v.HasField("image")]
    assert colorspaces == [4]  # RGBA


def test_other_ranks_write_no_summaries():
    """Ranks other than 0 hold a NoWriter: reporting to it is a no-op, never an error."""
    from dlrm.train.reporting import NoWriter, add_markdown, add_png, log_hparams

    png = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + (3).to_bytes(4, "big") + (2).to_bytes(4, "big")
    assert log_hparams(NoWriter(), Config(), 32, {"auc": 0.8, "logloss": 0.45, "accuracy": 0.79}, 3) is None
    assert add_markdown(NoWriter(), "t", "x", 1) is None and add_png(NoWriter(), "i", png, 1) is None


def test_a_best_one_step_before_the_end_is_named():
    """The final line names a best evaluation at any step but the last (here the one before), and a known oracle
    AUC even when it is 0."""
    from dlrm.train.reporting import final_line

    summary = {"split": "test", "auc": 0.8, "logloss": 0.45, "accuracy": 0.79, "steps": 1200, "samples": 1000,
               "samples_per_sec": 10.0, "wall_s": 1.0, "oracle_auc": 0.0,
               "best": {"step": 1199, "metric": "auc", "auc": 0.81, "checkpoint": "best.pt"}}
    line = final_line(summary)
    assert line.endswith("; best auc 0.8100 at step 1199, kept as best.pt") and "(oracle AUC 0.0000)" in line


def test_a_rate_of_zero_is_logged_and_versions_name_each_library():
    """A measured 0 samples/s is a number, not "no rate"; summary.json's versions trace numbers to their libraries."""
    import sys

    import triton

    from dlrm.train.reporting import log_train, versions

    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    w = Writer()
    log_train(w, 4, 0.5, (0.1, 0.2), 0.0, None)
    assert ("train/samples_per_sec", 0.0, 4) in w.scalars and len(w.scalars) == 4
    want = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__}
    if torch.version.cuda:
        want["cuda"] = torch.version.cuda
    assert versions() == want


# ---- export -------------------------------------------------------------------------------------------


def portable_model(multi_hot_sizes=None):
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    torch.manual_seed(0)
    model = build_model(cfg.model, [7] * NUM_SPARSE, None, KernelsConfig("torch", "torch", "torch", "torch"), "cpu",
                        multi_hot_sizes=multi_hot_sizes)
    return model.eval()


def raw_inputs(batch: int, fmt: str, width: int = NUM_SPARSE):
    g = torch.Generator().manual_seed(3)
    dense = (torch.randint(-2, 5000, (batch, NUM_DENSE), generator=g) if fmt == "counts"
             else torch.randn(batch, NUM_DENSE, generator=g, dtype=torch.float64).mul(30).float())
    return dense, torch.randint(-1, 2**32, (batch, width), generator=g)


@pytest.mark.parametrize("fmt", ["counts", "float"])
def test_the_inference_wrapper_returns_probabilities_of_the_raw_inputs(fmt):
    """RawInputDLRM (what the exported program runs): counts are log1p-transformed as the loaders do, float values
    taken as they are, and the output is the click probability, not the logit."""
    from dlrm.train.export import RawInputDLRM

    model = portable_model()
    dense, raw = raw_inputs(5, fmt)
    with torch.no_grad():
        got = RawInputDLRM(model, fmt)(dense, raw)
        model_in = torch.log1p(dense.double().clamp(min=0)).float() if fmt == "counts" else dense
        want = torch.sigmoid(model(model_in, raw).double())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    assert got.dtype == torch.float32 and got.shape == (5,) and bool(((got > 0) & (got < 1)).all())
    with pytest.raises(RuntimeError, match="dtype"):
        RawInputDLRM(model, fmt)(dense, raw.to(torch.int32))
    with pytest.raises(RuntimeError, match="dtype"):
        RawInputDLRM(model, fmt)(dense.double(), raw)


def test_a_multi_hot_models_raw_input_has_a_column_per_slot():
    """The exported program's sparse input: one column per multi-hot slot, 26 for a one-hot model."""
    from dlrm.train.export import _sparse_width

    sizes = [1] * (NUM_SPARSE - 2) + [3, 2]
    assert _sparse_width(portable_model(sizes)) == NUM_SPARSE + 3
    assert _sparse_width(portable_model()) == NUM_SPARSE


def test_the_exported_program_takes_any_batch_size_from_one(tmp_path):
    """A real torch.export of a tiny float-input model: batch sizes 1 and 3 give the wrapper's probabilities."""
    from dlrm.train.export import RawInputDLRM, export_model

    model = portable_model()
    program = torch.export.load(str(export_model(model, tmp_path / "m.pt2", "float"))).module()
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt2"]
    for batch in (1, 3):
        dense, raw = raw_inputs(batch, "float")
        with torch.no_grad():
            torch.testing.assert_close(program(dense, raw), RawInputDLRM(model, "float")(dense, raw), rtol=1e-6,
                                       atol=1e-7)


def test_the_checkpoints_model_comes_back_in_eval_mode_with_its_weights(tmp_path):
    """model_from_checkpoint (evaluation, export): the stored weights, in eval mode (a Triton or fused embedding in
    training mode updates its rows in the backward)."""
    from dlrm import checkpoint as ckpt
    from dlrm.train.export import model_from_checkpoint
    from dlrm.train.setup import Tables
    from tests.test_audit_checkpoint_files import CARDS, tiny_config, tiny_state

    cfg = tiny_config()
    state = tiny_state(cfg=cfg)
    ckpt.write_atomic(tmp_path / "c.pt", state)
    model = model_from_checkpoint(cfg, tmp_path / "c.pt", Tables(list(CARDS), None, "modulus"), torch.device("cpu"),
                                  portable=True)
    assert not model.training and not any(m.training for m in model.modules())
    got = model.state_dict()
    assert got.keys() == state["model"].keys() and all(torch.equal(got[k], v) for k, v in state["model"].items())


# ---- graphed_step: the host-side bookkeeping ----------------------------------------------------------


class FakeStep:
    """Stands in for TrainStep: records which path ran; its device is CUDA's when available (the lr tensors
    go there), else the CPU, after the GraphedTrainStep was built for "cuda"."""

    def __init__(self, optimizers):
        self.device = torch.device("cuda")
        self.optimizers = optimizers
        self.autocast_cache = True
        self.calls: list[str] = []

    def __call__(self, batch):
        self.calls.append(f"ordinary {len(batch)}")
        return torch.tensor(1.0)

    def load_lrs(self):
        self.calls.append("load_lrs")


class FakeGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


class FakeFused(FusedSparseOptimizer):
    """A fused sparse optimizer without an embedding (only its type and param group matter here)."""

    def __init__(self, params, lr):
        torch.optim.Optimizer.__init__(self, params, {"lr": lr})


def graphed(monkeypatch, optimizers=(), warmup_steps=0):
    monkeypatch.setattr(gs_mod, "capture_stream", lambda device: None)  # a CUDA stream: not needed here
    step = FakeStep(list(optimizers))
    g = gs_mod.GraphedTrainStep(step, warmup_steps)
    step.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(g, "_side_stream_step", lambda batch: step.calls.append(f"warm-up {len(batch)}") or 0)

    def capture(batch):
        step.calls.append(f"capture {len(batch)}")
        g.static = Batch(batch.dense.clone(), batch.sparse.clone(), batch.labels.clone(), batch.global_size)
        g.static_loss = torch.tensor(0.5)
        g.graph = FakeGraph(step.calls)
        return g.static_loss

    monkeypatch.setattr(g, "_capture", capture)
    return g, step


def batch_of(n: int, seed: int = 0, global_size=None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.rand(n, NUM_DENSE, generator=g), torch.randint(0, 100, (n, NUM_SPARSE), generator=g),
                 torch.rand(n, generator=g).round(), global_size)


def test_only_batches_of_the_captured_size_replay_and_warm_up_counts_exactly(monkeypatch):
    """The first full batch fixes the graph's size; warm-up_steps ordinary side-stream steps come first; a batch of
    any other size, smaller or larger, runs the ordinary step (a replay would read the wrong number of rows)."""
    g, step = graphed(monkeypatch, warmup_steps=2)
    for b in (batch_of(8), batch_of(8), batch_of(5), batch_of(8), batch_of(12), batch_of(8)):
        g(b)
    assert step.calls == ["warm-up 8", "warm-up 8", "ordinary 5", "load_lrs", "capture 8", "ordinary 12",
                          "load_lrs", "replay"]  # fmt: skip


def test_the_graphs_size_is_the_global_batch_size(monkeypatch):
    """In a distributed run every rank decides from the global batch size, which all ranks share (a rank's own slice
    may have fewer rows than another's)."""
    g, step = graphed(monkeypatch)
    g(batch_of(8, global_size=16))
    g(batch_of(8, global_size=16))
    g(batch_of(7, global_size=15))
    assert g.batch_size == 16 and step.calls == ["load_lrs", "capture 8", "load_lrs", "replay", "ordinary 7"]


def test_a_replay_reads_every_input_of_the_new_batch(monkeypatch):
    """Before each replay the new batch's dense, sparse and labels are copied into the graph's static inputs."""
    g, step = graphed(monkeypatch)
    g(batch_of(6, seed=1))
    new = batch_of(6, seed=2)
    assert g(new) is g.static_loss and step.calls[-1] == "replay"
    for static, fresh in ((g.static.dense, new.dense), (g.static.sparse, new.sparse), (g.static.labels, new.labels)):
        assert torch.equal(static, fresh)


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def test_scheduled_learning_rates_reach_the_tensors_the_graph_reads(monkeypatch):
    """The dense groups' lr becomes a device tensor before the capture; a scheduler that then sets a float has it
    copied into that same tensor (the graph keeps reading it) before each replay; a fused sparse optimizer's lr is
    left to TrainStep.load_lrs."""
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    dense = torch.optim.SGD([p], lr=0.1)
    sparse = FakeFused([q], lr=0.05)
    g, step = graphed(monkeypatch, [dense, sparse])
    g(batch_of(4))
    lr = dense.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and float(lr) == f32(0.1)
    assert sparse.param_groups[0]["lr"] == 0.05 and not isinstance(sparse.param_groups[0]["lr"], torch.Tensor)
    dense.param_groups[0]["lr"] = 0.025  # what an LR scheduler's step does
    g(batch_of(4))
    assert dense.param_groups[0]["lr"] is lr and float(lr) == f32(0.025) and step.calls[-1] == "replay"
    with torch.no_grad():
        lr.fill_(0.5)  # a scheduler that fills the tensor in place (newer torch): kept as it is
    g(batch_of(4))
    assert dense.param_groups[0]["lr"] is lr and float(lr) == 0.5


def test_the_captured_step_readies_adam_and_autocast_for_capture(monkeypatch):
    """Adam's step counters must live on the device (capturable) and autocast must not cache casts across the
    capture; other optimizers are left as they are."""
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    adam, sgd = torch.optim.Adam([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    _, step = graphed(monkeypatch, [adam, sgd])
    assert adam.param_groups[0]["capturable"] is True and "capturable" not in sgd.param_groups[0]
    assert step.autocast_cache is False


@pytest.mark.parametrize("fused, backend, error", [(True, "nccl", None),
                                                   (False, "nccl", 'needs kernels.embedding "triton"'),
                                                   (True, "gloo", "needs the nccl backend, not 'gloo'")])
def test_a_distributed_captured_step_warms_up_ddp_and_needs_triton_tables_and_nccl(monkeypatch, fused, backend, error):
    """Several processes: DDP needs DDP_WARMUP_STEPS (11) eager iterations before the capture, the sharded tables
    must update in the backward (no sparse gradients) and only NCCL's collectives can be captured."""
    from types import SimpleNamespace

    from dlrm.config import ConfigError

    monkeypatch.setattr(gs_mod, "capture_stream", lambda device: None)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *args: backend)
    step = FakeStep([])
    step.model = SimpleNamespace(sparse_arch=SimpleNamespace(fused_optimizer=fused))
    if error:
        with pytest.raises(ConfigError, match=r"train\.cuda_graph: with several processes " + error):
            gs_mod.graph_train_step(step, True, distributed=True)
        return
    assert gs_mod.DDP_WARMUP_STEPS == 11
    g = gs_mod.graph_train_step(step, True, distributed=True)
    assert isinstance(g, gs_mod.GraphedTrainStep) and g.warmup_steps == g.warmup_left == 11
    one = gs_mod.graph_train_step(step, True, distributed=False)
    from dlrm.train.meter import WARMUP_STEPS

    assert one.warmup_steps == WARMUP_STEPS != 11
    assert gs_mod.graph_train_step(step, False, distributed=True) is step


def test_a_run_resumed_at_an_epochs_partial_batch_captures_the_full_batch_size(monkeypatch):
    """Bug fixed: the graph was for the first batch's size whatever it was. A run resumed just before an epoch's
    partial last batch sees that batch first: every full batch after it ran the ordinary step (no graph) for the
    rest of the run. A larger batch before the capture now takes over (partial batches are the smaller ones), with
    its own warm-up."""
    g, step = graphed(monkeypatch, warmup_steps=1)
    for b in (batch_of(5), batch_of(8), batch_of(8), batch_of(8), batch_of(5), batch_of(8)):
        g(b)
    assert g.batch_size == 8
    assert step.calls == ["warm-up 5", "warm-up 8", "load_lrs", "capture 8", "load_lrs", "replay", "ordinary 5",
                          "load_lrs", "replay"]  # fmt: skip
