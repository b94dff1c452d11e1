"""Audit (by mutation) of the kernel micro-benchmark scripts' arithmetic and bookkeeping, checked on the CPU against
fake timers, clocks, kernels and inputs (exact values, no real timings, no GPU):

* kernels.py: the bytes / FLOPs of every case builder, the embedding tables' caps and offsets, `bench_ms` (the CPU
  median after an untimed call; the CUDA paths' do_bench arguments and graph replay per call), the copy bandwidth,
  `run_case`'s rates, work columns and notes, the target verdicts, the pivot table, the Markdown header,
  `select_specs` / `resolve_options`, and main's --append merge of kernels.csv;
* mlp.py: the smoke shapes, the tail launch parser, the speed-ups, a measured row from fake windows, the Markdown
  cells, main's option defaults, tail note and exit code;
* wgrad.py: the reference, the split count of a swept launch, a row's bytes, GB/s and correctness check, which swept
  launches are skipped (and the forced launch put back), main's per-model totals;
* cross_layer.py: the bytes of every forward row, the summed step, the forced tiles, the tile parser, the Markdown
  cells, main's smoke options;
* mask_bias_launches.py: the launch parser, the bytes and GB/s, the shipped launch's name and reference, the checks
  against it, the override put back, main's options.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import types
from unittest import mock

import pytest
import torch

from kernels.heuristics import GemmTile, TailLaunch, WgradLaunch
from tests.test_audit_benchmark_numbers import FakeClock, read_csv
from tests.test_benchmark_scripts import load_script

NS = types.SimpleNamespace
CPU = torch.device("cpu")


@functools.cache
def script(name: str):
    """Each script loaded once (by path): the tests patch its attributes, and monkeypatch puts them back."""
    return load_script(name)


def fake_dynamo(monkeypatch) -> NS:
    """A stand-in for torch._dynamo during a main(): the scripts raise its recompile limits for the whole process (and
    mlp.py resets it after every case); the stand-in keeps the process's settings and spares Dynamo's import (seconds
    when nothing imported it yet)."""
    dynamo = NS(config=NS(cache_size_limit=8), reset=lambda: None)
    monkeypatch.setitem(torch.__dict__, "_dynamo", dynamo)
    return dynamo


def fake_pyplot():
    plt = mock.MagicMock()
    plt.subplots.return_value = (mock.MagicMock(), mock.MagicMock())
    return plt


# ---- kernels.py -----------------------------------------------------------------------------------------------------


def kctx(impls=("eager",), tf32=True, max_rows=None):
    return script("kernels").Ctx(device=CPU, impls=impls, tf32=tf32, max_rows=max_rows)


def test_kernels_work_of_every_case_builder_by_hand(monkeypatch):
    """The bytes (GB/s kernels) and FLOPs (TFLOP/s kernels) of each builder, by hand from small shapes."""
    kb = script("kernels")
    monkeypatch.setattr(kb, "free_memory", lambda device: None)
    # embedding: n=10 ids, 4 distinct rows, D=2, fp32: fwd 80 + 4*8 + 10*8; bwd 80 + 10*8 + 2*4*8
    assert kb.embedding_bytes(10, 4, 2, 4) == {"fwd": 192, "bwd": 224, "fwd+bwd": 416}
    hr = kb.build_hash_rows(kctx(), 3, torch.float32)
    assert hr.work == {"fwd": 3 * 26 * 16} and list(hr.impls) == ["eager"]  # int64 read + int64 written
    assert kb.build_hash_rows(kctx(), 3, torch.bfloat16).work == {}  # measured once, under fp32
    # interaction [2, 27, 4] fp32: in 216 elements, out 2 * (4 + 351) = 710; bwd reads grad_out and x, writes grad_x
    assert kb.build_interaction(4)(kctx(), 2, torch.float32).work == {"fwd": 3704, "bwd": 4568, "fwd+bwd": 8272}
    lin = kb.build_linear(8, 4)(kctx(), 2, torch.float32)  # 2 * B N K = 128 forward, two GEMMs backward
    assert lin.work == {"fwd": 128.0, "bwd": 256.0, "fwd+bwd": 384.0} and lin.note == "fp32 with TF32 on both sides"
    assert kb.build_linear(8, 4)(kctx(), 2, torch.bfloat16).note == ""
    assert kb.build_linear(8, 4)(kctx(tf32=False), 2, torch.float32).note == ""
    cross = kb.build_cross(6, 3)(kctx(), 2, torch.float32)  # 2 * B * n * rank
    assert cross.work == {"fwd": 72.0, "bwd": 144.0, "fwd+bwd": 216.0} and cross.note == "fp32 with TF32 on both sides"
    # loss over B=5: fwd reads logits and fp32 labels; bwd also writes grad_logits
    assert kb.build_loss(kctx(), 5, torch.float32).work == {"fwd": 40, "bwd": 60, "fwd+bwd": 100}
    assert kb.build_loss(kctx(), 5, torch.bfloat16).work == {"fwd": 30, "bwd": 40, "fwd+bwd": 70}


def test_kernels_embedding_tables_caps_offsets_and_case_bytes(monkeypatch):
    """Every table capped at min(variant cap, --max-rows), offsets exclusive prefix sums; the case's bytes count the
    distinct rows its note reports; the atomic variant is fp32 only."""
    kb = script("kernels")
    cases = sys.modules[kb.embedding_tables.__module__]  # the module whose globals embedding_tables reads
    monkeypatch.setattr(cases, "free_memory", lambda device: None)
    monkeypatch.setattr(cases, "_TABLES", {})
    weight, cards, offs = kb.embedding_tables(kctx(max_rows=50), "t", 4, 30, torch.float32)
    capped = [30, 30, 30, 30, 30, 24, 30, 30, 3, 30, 30, 30, 30, 27, 30, 30, 10, 30, 30, 4, 30, 18, 15, 30, 30, 30]
    assert cards.tolist() == capped and tuple(weight.shape) == (671, 4)
    assert offs[:10].tolist() == [0, 30, 60, 90, 120, 150, 174, 204, 234, 237]
    _, cards, _ = kb.embedding_tables(kctx(max_rows=20), "u", 4, 30, torch.float32)  # --max-rows below the cap
    assert cards.sum().item() == 21 * 20 + 3 + 10 + 4 + 18 + 15

    build = kb.build_embedding(4, 30, "t")
    built = build(kctx(impls=("eager", "triton_atomic"), max_rows=50), 4, torch.float32)
    assert set(built.impls) == {"eager", "triton_atomic"} and set(built.impls["triton_atomic"]) == {"bwd", "fwd+bwd"}
    n = 4 * 26
    head, tail = built.note.split("/")
    unique = int(head.split(", ")[1])
    assert head.startswith("R=671 rows") and tail == f"{n} distinct rows looked up"
    fwd, bwd = n * 8 + unique * 16 + n * 16, n * 8 + n * 16 + 2 * unique * 16
    assert built.work == {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}
    assert set(build(kctx(impls=("eager", "triton_atomic"), max_rows=50), 4, torch.bfloat16).impls) == {"eager"}


def test_kernels_bench_ms_cpu_median_after_an_untimed_call(monkeypatch):
    """CPU: one untimed call (compilation), then the median of `cpu_reps` timed calls in ms; grads reset every call."""
    kb = script("kernels")
    clock = FakeClock()
    monkeypatch.setattr(kb, "time", clock)
    durations = [9.0, 0.0625, 0.25, 0.125]  # s: untimed, then 62.5, 250, 125 ms
    leaf, seen = torch.zeros(1, requires_grad=True), []

    def fn():
        seen.append(leaf.grad)
        leaf.grad = torch.ones(1)
        clock.now += durations.pop(0)

    assert kb.bench_ms(fn, [leaf], CPU, 25, 100, 3) == 125.0
    assert durations == [] and seen == [None] * 4


def test_kernels_bench_ms_cuda_do_bench_arguments_and_graph_replay_per_call(monkeypatch):
    """CUDA launch timing: do_bench gets warmup / rep in that order, its median is returned. Graph timing: n calls a
    graph (rep_ms / one call's replay, at most 1000), each window's replay divided by n."""
    kb = script("kernels")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    got = {}

    def do_bench(fn, warmup, rep, grad_to_none, **kw):
        got.update(warmup=warmup, rep=rep, grad_to_none=grad_to_none, **kw)
        return [0.75]

    monkeypatch.setattr(kb.triton.testing, "do_bench", do_bench)
    assert kb.bench_ms(lambda: None, [], torch.device("cuda"), 25, 100, 3) == 0.75
    assert got == {"warmup": 25, "rep": 100, "grad_to_none": None, "quantiles": [0.5]}

    clock, capturing, graphs = [0.0], [], []

    class Graph:
        def __init__(self):
            self.calls = 0
            graphs.append(self)

        def replay(self):
            clock[0] += 0.25 * self.calls  # 0.25 ms a call

    @contextlib.contextmanager
    def graph(g, stream=None):
        capturing.append(g)
        yield
        capturing.pop()

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(kb, "torch", NS(cuda=NS(current_stream=lambda: "s", CUDAGraph=Graph, graph=graph, Event=Event)))
    leaf = torch.zeros(1, requires_grad=True)

    def fn():
        leaf.grad = torch.ones(1)
        capturing[-1].calls += 1

    assert kb.bench_graph_ms(fn, [], 100) == 0.25
    assert [g.calls for g in graphs] == [1, 400]  # 100 ms / 0.25 ms
    graphs.clear()
    assert kb.bench_graph_ms(fn, [leaf], 1000) == 0.25 and [g.calls for g in graphs] == [1, 1000]  # capped


def test_kernels_time_mode_passes_the_timing_options_and_falls_back_from_a_failed_capture(monkeypatch):
    """Launch timing: bench_ms gets --warmup-ms, --rep-ms and --cpu-reps. Graph timing: set up and captured on the
    graph stream; a capture that fails is timed launched from Python (a fresh setup) and says why."""
    kb = script("kernels")
    calls, setups, streams = [], [], []

    def bench_ms(fn, grads, device, warmup, rep, reps, timing="launch"):
        calls.append((fn, grads, device.type, warmup, rep, reps, timing))
        if timing == "graph":
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return 1.5

    def factory():
        setups.append(streams[-1] if streams else None)
        return f"fn{len(setups)}", ["g"]

    @contextlib.contextmanager
    def stream(s):
        streams.append(s)
        try:
            yield
        finally:
            streams.pop()

    monkeypatch.setattr(kb, "bench_ms", bench_ms)
    args = NS(timing="launch", warmup_ms=1, rep_ms=2, cpu_reps=3)
    assert kb.time_mode(factory, kctx(), args) == (1.5, "")
    assert calls == [("fn1", ["g"], "cpu", 1, 2, 3, "launch")]
    calls.clear()
    setups.clear()
    reset = []
    monkeypatch.setattr(kb, "reset_cuda_rng_after_failed_capture", reset.append)
    monkeypatch.setattr(kb, "torch", NS(cuda=NS(stream=stream, synchronize=lambda device: None)))
    ctx = kb.Ctx(device=torch.device("cuda"), impls=("triton",), tf32=True, max_rows=None, graph_stream="side")
    ms, why = kb.time_mode(factory, ctx, NS(timing="graph", warmup_ms=1, rep_ms=2, cpu_reps=3))
    assert (ms, why) == (1.5, "RuntimeError: operation not permitted when stream is capturing")
    assert [c[0] for c in calls] == ["fn1", "fn2"] and [c[-1] for c in calls] == ["graph", "launch"]
    assert setups == ["side", None] and reset == [torch.device("cuda")]


def test_kernels_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    """(GB/s, ms, bytes): 16 MiB copied on the CPU moves 32 MiB; GB/s = bytes / ms / 1e6."""
    kb = script("kernels")
    monkeypatch.setattr(kb, "free_memory", lambda device: None)
    seen = []
    monkeypatch.setattr(kb, "bench_ms", lambda fn, grads, device, w, r, c: seen.append((grads, w, r, c)) or 4.0)
    assert kb.copy_bandwidth(CPU, NS(warmup_ms=25, rep_ms=100, cpu_reps=3)) == (8.388608, 4.0, 2**25)
    assert seen == [([], 25, 100, 3)]


def test_kernels_run_case_rates_work_columns_and_notes(monkeypatch):
    """One row per impl and mode (MODES order): GB/s = bytes / ms / 1e6 and TFLOP/s = flops / ms / 1e9 in `value`,
    the work in `bytes` or `flops`, a graph fallback appended to the note, a failing mode recorded, not raised."""
    kb = script("kernels")
    monkeypatch.setattr(kb, "free_memory", lambda device: None)
    timed = {"t": (2.0, ""), "tf": (4.0, "RuntimeError: sync")}

    def time_mode(factory, ctx, args):
        if factory == "eb":
            raise RuntimeError("boom\nmore")
        return timed[factory]

    monkeypatch.setattr(kb, "time_mode", time_mode)
    impls = {"triton": {"fwd+bwd": "tf", "fwd": "t"}, "eager": {"bwd": "eb"}}
    work = {"fwd": 3e6, "bwd": 1e6, "fwd+bwd": 8e6}
    gbs = kb.Spec("fake", "fam", "GB/s", "[B]", lambda ctx, b, d: kb.Built(impls, work, "n1"))
    rows = kb.run_case(gbs, 8, "fp32", kctx(), NS())
    common = {"kernel": "fake", "family": "fam", "shape": "[B]", "batch": 8, "dtype": "fp32", "metric": "GB/s",
              "flops": None}
    assert rows == [
        {**common, "mode": "fwd", "impl": "triton", "ms": 2.0, "value": 1.5, "bytes": 3e6, "note": "n1", "error": ""},
        {**common, "mode": "fwd+bwd", "impl": "triton", "ms": 4.0, "value": 2.0, "bytes": 8e6,
         "note": "n1; launch-timed: not capturable in a CUDA graph", "error": ""},
        {**common, "mode": "bwd", "impl": "eager", "ms": None, "value": None, "bytes": 1e6, "note": "n1",
         "error": "RuntimeError: boom"},
    ]
    tf = kb.Spec("g", "fam", "TFLOP/s", "[B]",
                 lambda ctx, b, d: kb.Built({"triton": {"fwd+bwd": "tf"}}, {"fwd+bwd": 6e9}))
    (row,) = kb.run_case(tf, 8, "bf16", kctx(), NS())
    assert (row["value"], row["flops"], row["bytes"]) == (1.5, 6e9, None)
    assert row["note"] == "launch-timed: not capturable in a CUDA graph"
    bad = kb.Spec("h", "fam", "GB/s", "[B]", lambda ctx, b, d: 1 / 0)
    assert [(r["mode"], r["impl"], r["error"]) for r in kb.run_case(bad, 8, "fp32", kctx(), NS())] == [
        ("*", "(setup)", "ZeroDivisionError: division by zero")]


def krow(kernel, batch, impl, ms, mode="fwd+bwd", value=None, dtype="fp32", error=""):
    return {"kernel": kernel, "batch": batch, "impl": impl, "ms": ms, "mode": mode, "value": value, "dtype": dtype,
            "error": error, "note": ""}


def test_kernels_target_verdicts_at_the_largest_measured_batch():
    """A speed-up target is ref ms / triton ms, a copy target value / copy GB/s; the verdict is the largest batch whose
    triton row has a time (>= threshold passes); every measured batch is listed."""
    kb = script("kernels")
    rows = [krow("copy", "", "torch", 1.0, mode="fwd", value=100.0),
            krow("loss", 8, "eager", 2.0), krow("loss", 8, "triton", 1.0),
            krow("loss", 16, "eager", 3.0), krow("loss", 16, "triton", 1.0),
            krow("loss", 32, "eager", 3.0), krow("loss", 32, "triton", None, error="E"),  # failed: not a measurement
            krow("embedding_d16", 4, "triton", 1.0, mode="fwd", value=10.0),
            krow("embedding_d16", 8, "triton", 1.0, mode="fwd", value=80.0)]
    verdicts = kb.evaluate_targets(rows, 100.0)
    emb_fwd, emb_bwd, loss = verdicts
    assert emb_fwd == {"target": "embedding forward >= 80% of copy bandwidth", "kernel": "embedding_d16",
                       "dtype": "fp32", "batch": 8, "ratio": 0.8, "threshold": 0.8, "unit": "of copy BW",
                       "verdict": "PASS", "all": "4: 0.1, 8: 0.8"}
    assert (emb_bwd["verdict"], emb_bwd["batch"], emb_bwd["ratio"], emb_bwd["all"]) == ("n/a", None, None, "")
    assert loss == {"target": "loss fwd+bwd >= 3x eager", "kernel": "loss", "dtype": "fp32", "batch": 16,
                    "ratio": 3.0, "threshold": 3.0, "unit": "x eager", "verdict": "PASS", "all": "8: 2, 16: 3"}
    assert kb.verdict_table([loss]).splitlines()[2] == (
        "| loss fwd+bwd >= 3x eager | loss | fp32 | 16 | 3 x eager | >= 3 | **PASS** | 8: 2, 16: 3 |")
    assert kb.evaluate_targets(rows, 0.0)[0]["verdict"] == "n/a"  # no copy bandwidth: no copy ratio


def test_kernels_table_cells_speedups_and_mode_order():
    """The pivot: modes in MODES order, 'ms / value (% of copy BW)' per impl, 'error' for a failed row, triton's
    speed-up as ref ms / triton ms; no speed-up columns without a triton row; fmt's rounding."""
    kb = script("kernels")
    rows = [krow("k", 8, "triton", 4.0, mode="bwd", value=12.5), krow("k", 8, "eager", None, mode="bwd", error="E"),
            krow("k", 8, "triton", 1.0, mode="fwd", value=50.0), krow("k", 8, "eager", 2.0, mode="fwd", value=30.0),
            krow("k", 8, "compile", 0.5, mode="fwd", value=100.0), krow("k", 8, "eager", None, mode="*", error="E")]
    unit = "[ms / GB/s (% of copy BW)]"
    assert kb.kernel_table(rows, "k", "GB/s", 200.0).splitlines() == [
        (f"| mode | dtype | B | triton {unit} | eager {unit} | compile {unit} | triton speedup vs eager | "
         "triton speedup vs compile |"),
        "|---|---|---|---|---|---|---|---|",
        "| fwd | fp32 | 8 | 1 ms / 50 (25%) | 2 ms / 30 (15%) | 0.5 ms / 100 (50%) | 2x | 0.5x |",
        "| bwd | fp32 | 8 | 4 ms / 12.5 (6%) | error |  |  |  |",
    ]
    eager_only = [krow("e", 8, "eager", 2.0, mode="fwd", value=1.5)]
    assert kb.kernel_table(eager_only, "e", "TFLOP/s", 200.0).splitlines() == [
        "| mode | dtype | B | eager [ms / TFLOP/s] |", "|---|---|---|---|", "| fwd | fp32 | 8 | 2 ms / 1.5 |"]
    assert [kb.fmt(v) for v in (None, "", 0, 1234.4, 0.012345, 99.94)] == ["", "", "0", "1234", "0.0123", "99.9"]


def test_kernels_markdown_copy_line_and_graph_file_names(tmp_path):
    """The copy line gives the copied size (half the bytes moved) in MiB; graph timing titles and names the plots."""
    kb = script("kernels")
    rows = [krow("loss", 8, "triton", 1.0, value=2.0)]
    text = kb.write_markdown(tmp_path / "k.md", rows, [], {"device": "cpu"}, (8.5, 4.0, 2**25), True, "_graph")
    assert "- **copy bandwidth**: 8.5 GB/s (`dst.copy_(src)`, 16 MiB, 4 ms; bytes read + written / time)" in text
    assert text.startswith("# Triton kernel benchmarks, CUDA-graph timing (device time)\n\n> **CPU smoke run")
    assert "![loss](loss_graph.png)" in text and (tmp_path / "k.md").read_text() == text


def test_kernels_select_specs_and_resolve_options(monkeypatch):
    """--quick keeps the quick variants, --kernels takes names or families; the CPU and CUDA defaults of batches,
    dtypes, impls and --max-rows, explicit options kept."""
    kb = script("kernels")
    assert [s.name for s in kb.select_specs(None, True)] == [
        "embedding_d16", "interaction_d16", "linear_512x256", "loss", "cross_432x128"]
    assert len(kb.select_specs(None, False)) == len(kb.SPECS) == 11
    families = kb.select_specs("loss, interaction", False)
    assert [s.name for s in families] == ["interaction_d16", "interaction_d128", "loss"]
    with pytest.raises(SystemExit):
        kb.select_specs("loss,nope", False)

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def resolve(*argv):
        args = kb.parse_args(list(argv))
        device, batches, dtypes, impls = kb.resolve_options(args)
        return device.type, batches, dtypes, impls, args.max_rows

    assert resolve("--device", "cpu") == ("cpu", [8, 16], ["fp32"], ("triton", "triton_atomic", "eager"), 2000)
    assert resolve("--device", "cpu", "--quick")[1] == [8]
    assert resolve("--device", "cpu", "--quick", "--batch-sizes", "4,32")[1] == [4, 32]
    assert resolve("--device", "cpu", "--max-rows", "7")[4] == 7
    with pytest.raises(SystemExit):
        resolve("--device", "cpu", "--timing", "graph")
    with pytest.raises(SystemExit):
        resolve("--device", "cpu", "--dtypes", "fp16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve() == ("cuda", [2048, 16384, 65536], ["fp32", "bf16"], kb.IMPLS, None)
    assert resolve("--quick")[1] == [2048, 16384]


def test_kernels_main_append_replaces_only_the_cases_measured_again(monkeypatch, tmp_path, capsys):
    """--append: this run's copy row first, then the earlier rows of every (kernel, batch, dtype) not measured now
    (also another dtype at the same batch), then this run's rows; without --append the file is rewritten."""
    kb = script("kernels")
    dynamo = fake_dynamo(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    precision = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precision.append)
    monkeypatch.setattr(kb, "logger", mock.MagicMock())
    monkeypatch.setattr(kb, "signal", NS(signal=lambda *a: None, SIGTERM=signal.SIGTERM))
    monkeypatch.setattr(kb, "ProgressBar", lambda it, **k: it)
    env = {"device": "cpu", "torch": "t", "triton": "t", "CUDA": "none"}
    monkeypatch.setattr(kb, "environment", lambda device, args: env)
    monkeypatch.setattr(kb, "plot_kernel", lambda *a: False)
    monkeypatch.setattr(kb, "free_memory", lambda device: None)
    run = {}

    def run_case(spec, batch, dtype, ctx, args):
        return [{**kb.base_row(spec, batch, dtype), "mode": "fwd", "impl": "eager", "ms": 2.0, "value": 5.0,
                 "bytes": 10.0, "note": run["tag"]}]

    monkeypatch.setattr(kb, "run_case", run_case)

    def main(tag, copy, *argv):
        run["tag"] = tag
        monkeypatch.setattr(kb, "copy_bandwidth", lambda device, args: copy)
        assert kb.main(["--device", "cpu", "--out", str(tmp_path), "--kernels", "loss", *argv]) == 0
        rows = read_csv(tmp_path / "kernels.csv")
        return [(r["kernel"], r["batch"], r["dtype"], r["note"], r["ms"], r["value"]) for r in rows]

    main("one", (100.0, 1.0, 2**25), "--batch-sizes", "8,16", "--dtypes", "fp32,bf16")
    rows = main("two", (50.0, 4.0, 2**25), "--batch-sizes", "16", "--dtypes", "fp32", "--append", "--no-tf32")
    assert rows == [("copy", "", "fp32", "dst.copy_(src)", "4.0", "50.0"),
                    ("loss", "8", "fp32", "one", "2.0", "5.0"), ("loss", "8", "bf16", "one", "2.0", "5.0"),
                    ("loss", "16", "bf16", "one", "2.0", "5.0"), ("loss", "16", "fp32", "two", "2.0", "5.0")]
    assert precision == ["high", "highest"]
    copy = read_csv(tmp_path / "kernels.csv")[0]
    assert (copy["shape"], copy["bytes"], copy["metric"]) == ("16777216 bytes", "33554432", "GB/s")
    assert "| fwd | bf16 | 16 | 2 ms / 5 (10%) |" in (tmp_path / "kernels.md").read_text()  # kept rows tabled too
    assert main("three", (50.0, 4.0, 2**25), "--batch-sizes", "8", "--overwrite")[1:] == [("loss", "8", "fp32", "three", "2.0", "5.0")]
    assert "# Triton kernel benchmarks" in capsys.readouterr().out and dynamo.config.cache_size_limit == 64


# ---- mlp.py ---------------------------------------------------------------------------------------------------------


def test_mlp_smoke_shapes_and_tail_launch_parser():
    """--smoke cuts widths 32x (at least 1); tail launches parse to (forward, backward) TailLaunch, x PROGRAMS_PER_SM
    defaulting to 1, r RELOAD and h HOIST_W (in that order only); malformed specs are refused."""
    mb = script("mlp")
    assert mb.smoke_shape(367, [512, 256, 1]) == (11, [16, 8, 1]) and mb.smoke_shape(13, [16]) == (1, [1])
    assert mb.parse_tail_launch("128x8/32x8") == (TailLaunch(128, 8), TailLaunch(32, 8, 1, 1, False, False))
    assert mb.parse_tail_launch("64x8/32x8x2r") == (TailLaunch(64, 8), TailLaunch(32, 8, 1, 2, True, False))
    assert mb.parse_tail_launch("64x4/16x4h") == (TailLaunch(64, 4), TailLaunch(16, 4, 1, 1, False, True))
    assert mb.parse_tail_launch("64x4/16x4x3rh")[1] == TailLaunch(16, 4, 1, 3, True, True)
    for bad in ("16x4", "16x4/16x4hr", "16x4/16x4x2x3", "16x4x1/16x4", "ax4/16x4"):
        with pytest.raises(ValueError, match="is not FWD_BMxWARPS"):
            mb.parse_tail_launch(bad)


def mrow(mlp, batch, impl, ms=None, precision="tf32", status="ok", **kw):
    return {"mlp": mlp, "shape": "11-16-8-1", "precision": precision, "batch": batch, "impl": impl, "ms": ms,
            "status": status, **kw}


def test_mlp_speedups_against_eager_of_the_same_case_and_markdown_cells():
    """speedup_vs_eager = eager ms / impl ms of the same (MLP, precision, batch); none without an eager time; the
    table's cells ('n/a' for missing numbers, an 'x' only after a speed-up)."""
    mb = script("mlp")
    rows = [mrow("kaggle_top", 8, "eager", 2.0), mrow("kaggle_top", 8, "fused", 0.5, min_ms=0.4, max_ms=0.6),
            mrow("kaggle_top", 16, "eager", 4.0), mrow("kaggle_top", 16, "fused", 2.0),
            mrow("kaggle_top", 8, "eager", 8.0, precision="fp32"),
            mrow("kaggle_top", 8, "fused", 1.0, precision="fp32"),
            mrow("kaggle_top", 32, "eager", status="failed: X"), mrow("kaggle_top", 32, "fused", 1.0)]
    mb.add_speedups(rows)
    assert [r.get("speedup_vs_eager") for r in rows] == [1.0, 4.0, 1.0, 2.0, 1.0, 8.0, None, None]
    lines = mb.markdown_table(rows)
    assert lines[3] == "| kaggle_top | 11-16-8-1 | tf32 | 8 | fused | 0.5000 | 0.4000 | 0.6000 | 4.00x | ok |"
    assert lines[8] == "| kaggle_top | 11-16-8-1 | tf32 | 32 | eager | n/a | n/a | n/a | n/a | failed: X |"


def test_mlp_measure_row_from_fake_windows(monkeypatch):
    """ms = the median window, min / max over windows, samples/s = batch / ms * 1e3, the smoke shape; skipped and
    failed rows; the forced tail launch set while building and put back."""
    from kernels import mlp_tail

    mb = script("mlp")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    precisions, built, windows = [], [], []
    monkeypatch.setattr(mb, "set_matmul_precision", precisions.append)

    def build(impl, in_features, widths, activate_last, device, backend):
        built.append((impl, in_features, widths, backend, mlp_tail.TAIL_LAUNCH_OVERRIDE))
        if impl == "fused":
            raise RuntimeError("boom\nsecond line")
        return torch.nn.Linear(in_features, widths[-1])

    def wall_windows(step, steps, n, warmup):
        windows.append((steps, n, warmup))
        return [3.0, 1.0, 10.0, 2.0, 4.0], 7

    monkeypatch.setattr(mb, "build", build)
    monkeypatch.setattr(mb, "wall_windows", wall_windows)
    args = NS(smoke=True, compile_backend="aot_eager", steps=2, windows=5, warmup=1)
    row = mb.measure("kaggle_bottom", "eager", "tf32", 6, CPU, args)
    assert row == {"mlp": "kaggle_bottom", "shape": "1-16-8-2-1", "precision": "tf32", "batch": 6, "impl": "eager",
                   "ms": 3.0, "min_ms": 1.0, "max_ms": 10.0, "samples_per_sec": 2000.0, "steps_per_window": 7,
                   "status": "ok"}
    assert windows == [(2, 5, 1)] and precisions == ["tf32"]
    assert mb.measure("kaggle_bottom", "tail[64x4/16x4x2]", "fp32", 6, CPU, args)["status"] == "ok"
    forced = (TailLaunch(64, 4), TailLaunch(16, 4, 1, 2))
    assert built[-1] == ("tail[64x4/16x4x2]", 1, [16, 8, 2, 1], "aot_eager", forced)
    assert mlp_tail.TAIL_LAUNCH_OVERRIDE is None and precisions[-1] == "fp32"
    assert mb.measure("kaggle_top", "fused", "tf32", 6, CPU, args)["status"] == "failed: RuntimeError: boom"
    for precision in ("fp32", "tf32"):
        assert mb.measure("kaggle_top", "fp8", precision, 6, CPU, args)["status"] == (
            "skipped: fp8 runs under bf16 autocast")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mb.measure("kaggle_top", "tail", "tf32", 6, CPU, args)["status"] == (
        "skipped: the on-chip tail runs 16-bit on CUDA")


def test_mlp_main_smoke_defaults_keep_explicit_options_tail_note_and_exit_code(monkeypatch, tmp_path):
    """--smoke replaces only the default batch sizes / precisions / steps; a failed case makes the exit code 1;
    bf16 is refused off CUDA; the tail note names each MLP's on-chip layers ('none' without a narrow tail)."""
    mb = script("mlp")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_dynamo(monkeypatch)
    monkeypatch.setattr(mb, "environment", lambda device: {"device": "cpu"})
    measured, notes = [], []

    def measure(name, impl, precision, batch, device, args):
        measured.append((name, impl, precision, batch, device.type, args.steps, args.windows, args.warmup,
                         args.compile_backend))
        return mrow(name, batch, impl, 1.0, precision, "failed: X" if impl == "fused" else "ok")

    monkeypatch.setattr(mb, "measure", measure)
    monkeypatch.setattr(mb, "write_results", lambda rows, env, out, title, note: notes.append(note))
    argv = ["--smoke", "--out", str(tmp_path), "--mlps", "kaggle_top"]
    assert mb.main([*argv, "--batch-sizes", "4", "--precisions", "fp32", "--steps", "3", "--impls", "eager"]) == 0
    assert measured == [("kaggle_top", "eager", "fp32", 4, "cpu", 3, 2, 2, "aot_eager")]
    measured.clear()
    assert mb.main(argv) == 1
    assert [m[:6] for m in measured] == [("kaggle_top", i, "tf32", 8, "cpu", 2) for i in ("eager", "compiled", "fused")]
    with pytest.raises(SystemExit):
        mb.main(["--out", str(tmp_path), "--precisions", "bf16"])

    monkeypatch.setitem(mb.CASES, "wide", (300, [512, 512], False, True))
    notes.clear()
    assert mb.main(["--out", str(tmp_path), "--mlps", "wide,kaggle_bottom", "--precisions", "tf32",
                    "--batch-sizes", "8", "--impls", "eager,tail"]) == 0
    assert notes[-1].endswith(" tail: OnChipTailMLP (kernels/mlp_tail_module.py), the on-chip layers: wide none, "
                              "kaggle_bottom 256-64-16; the others as fused.")


# ---- wgrad.py -------------------------------------------------------------------------------------------------------


def test_wgrad_reference_and_the_split_count_of_a_swept_launch():
    """torch_wgrad masks where y > 0 (not >= 0) for dW and db alike; a swept launch's splits 0 becomes
    ceil(2 SMs / tiles) (tiles rounded up) capped at B / (8 block_b), at least 1; a given split count is kept."""
    wb = script("wgrad")
    g, y, x = torch.ones(2, 2), torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0], [3.0]])
    dw, db = wb.torch_wgrad(g, y, x, True)
    assert dw.tolist() == [[3.0], [1.0]] and db.tolist() == [1.0, 1.0]
    dw, db = wb.torch_wgrad(g, y, x, False)
    assert dw.tolist() == [[4.0], [4.0]] and db.tolist() == [2.0, 2.0]
    launch = WgradLaunch(64, 32, 16, 4, 3, 0)
    assert wb._with_launch(launch, 4096, 100, 50, torch.bfloat16, 4) == launch._replace(splits=2)  # 4 tiles
    assert wb._with_launch(launch, 256, 100, 50, torch.bfloat16, 132).splits == 2  # 256 // (8 * 16)
    assert wb._with_launch(launch, 64, 100, 50, torch.bfloat16, 132).splits == 1
    assert wb._with_launch(launch._replace(splits=3), 4096, 100, 50, torch.bfloat16, 4).splits == 3


def test_wgrad_measure_bytes_rates_check_and_skipped_launches(monkeypatch):
    """A row's GB/s: (g, y when masked, x) bytes / ms / 1e6; a result off float64's by more than 2e-2 sqrt(B) is
    WRONG; a swept tile more than twice the output's side (at least 16) is skipped; the forced launch put back."""
    wb = script("wgrad")
    monkeypatch.setattr(wb.heuristics, "sm_count", lambda device: 4)
    timed, forced, state = [], [], {"offset": 0.0}
    monkeypatch.setattr(wb, "graph_replay_ms",
                        lambda fn, calls, windows, warmup: timed.append((calls, windows, warmup)) or 2.0)

    def linear_wgrad(g, x, y, weight_dtype, bias_dtype):
        forced.append(wb.heuristics.WGRAD_LAUNCH_OVERRIDE)
        gm = g * (y > 0) if y is not None else g
        return (gm.t() @ x).float() + state["offset"], gm.sum(0).float()

    monkeypatch.setattr(wb, "linear_wgrad", linear_wgrad)
    rows = wb.measure(8, 4, 3, True, torch.float32, CPU, ["torch", "triton"], [], 5, 3)
    gbps = (2 * 32 + 24) * 4 / 2.0 / 1e6  # g and y [8, 4], x [8, 3], fp32
    assert rows == [{"impl": i, "ms": 2.0, "gb_per_s": gbps, "status": ""} for i in ("torch", "triton")]
    assert timed == [(5, 3, 3)] * 2
    unmasked = wb.measure(8, 4, 3, False, torch.float32, CPU, ["triton"], [], 5, 3)
    assert unmasked[0]["gb_per_s"] == (32 + 24) * 4 / 2.0 / 1e6
    state["offset"] = 1.0  # tolerance at B = 100: 0.2
    assert wb.measure(100, 4, 3, False, torch.float32, CPU, ["triton"], [], 5, 3)[0]["status"] == "WRONG (1)"
    state["offset"], forced[:] = 0.0, []
    sweep = [WgradLaunch(32, 16, 16, 4, 3, 1), WgradLaunch(64, 16, 16, 4, 3, 1), WgradLaunch(16, 64, 16, 4, 3, 1)]
    rows = wb.measure(64, 16, 3, True, torch.float32, CPU, [], sweep, 5, 3)
    assert [(r["impl"], r["status"]) for r in rows] == [("triton[32x16x16/4x3/1]", "")]
    assert forced == [sweep[0]] and wb.heuristics.WGRAD_LAUNCH_OVERRIDE is None


def test_wgrad_main_sums_each_models_own_impls(monkeypatch, tmp_path):
    """main: CPU drops inductor and the sweep, --smoke is batch 67 with 2 calls in 1 window; the Markdown's sums add
    every layer's ms of torch / inductor / triton per model (swept launches not summed)."""
    wb = script("wgrad")
    dynamo = fake_dynamo(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(wb, "environment", lambda device: {"device": "cpu"})
    monkeypatch.setattr(wb, "pyplot", fake_pyplot)
    monkeypatch.setattr(wb, "save_figure", lambda *a, **k: None)
    calls = []

    def measure(B, M, N, mask, dtype, device, impls, sweep, n_calls, windows):
        calls.append((B, M, N, mask, dtype, impls, sweep, n_calls, windows))
        return [{"impl": "torch", "ms": 1.0 if M == 37 else 2.0, "gb_per_s": 1.0, "status": ""},
                {"impl": "triton", "ms": 0.5, "gb_per_s": 1.0, "status": ""},
                {"impl": "triton[x]", "ms": 9.0, "gb_per_s": 1.0, "status": ""}]

    monkeypatch.setattr(wb, "measure", measure)
    assert wb.main(["--smoke", "--out", str(tmp_path), "--name", "w", "--sweep"]) == 0
    assert dynamo.config.cache_size_limit == 64
    assert calls == [(67, 37, 13, True, torch.float32, ["torch", "triton"], [], 2, 1),
                     (67, 16, 40, False, torch.float32, ["torch", "triton"], [], 2, 1)]
    assert "Sum over a model's layers, ms: smoke torch 3.000; smoke triton 1.000\n" in (tmp_path / "w.md").read_text()
    rows = read_csv(tmp_path / "w.csv")
    assert [(r["layer"], r["impl"], r["batch"], r["dtype"]) for r in rows[:2]] == [
        ("a", "torch", "67", "torch.float32"), ("a", "triton", "67", "torch.float32")]


# ---- cross_layer.py -------------------------------------------------------------------------------------------------


def test_cross_layer_parse_tile_and_markdown_cells():
    """BMxBNxBKsSTAGESwWARPS in GemmTile's order (stages before warps); ms to 3 decimals, GB/s with thousands."""
    cl = script("cross_layer")
    assert cl.parse_tile("128x64x32s3w8") == GemmTile(128, 64, 32, 3, 8) and cl.parse_tile("picked") is None
    with pytest.raises(ValueError):
        cl.parse_tile("64x64")
    rows = [{"case": "fwd", "impl": "x", "tile": "", "store_pre": "", "ms": 1.23456, "gbps": 12345.6, "status": "ok"},
            {"case": "fwd", "impl": "y", "tile": "t", "store_pre": True, "status": "error: E"}]
    assert cl.markdown_table(rows)[2:] == ["| fwd | x |  |  | 1.235 | 12,346 | ok |",
                                           "| fwd | y | t | True |  |  | error: E |"]


def test_cross_layer_fwd_rows_bytes_summed_step_and_forced_tiles(monkeypatch):
    """Bytes of B=2, N=3, rank 1, bf16: cuBLAS u W^T reads u and writes y, the elementwise reads x0, y, x and writes
    out, the step is both (ms summed), the fused kernel reads u, x0, x and writes out (and pre); GB/s = bytes / ms /
    1e6; each tile forced while timed, then put back; a failing tile is a row."""
    from kernels import heuristics

    cl = script("cross_layer")
    times, forced = [1.0, 2.0, 4.0, 8.0, "raise", 0.0], []

    def timer(step):
        forced.append(heuristics.CROSS_TILE_OVERRIDE)
        t = times.pop(0)
        if t == "raise":
            raise RuntimeError("no fit\nmore")
        return t

    rows = cl.fwd_rows(NS(batch=2, width=3, rank=1, tiles="picked, 64x128x64s4w4"), CPU, timer)
    got = [(r["impl"], r["tile"], r["store_pre"], r.get("ms"), r.get("gbps"), r["status"]) for r in rows]
    assert got == [
        ("cuBLAS u W^T", "", "", 1.0, pytest.approx(16 / 1e6), "ok"),
        ("Inductor x0 * (y + b) + x", "", "", 2.0, pytest.approx(48 / 2.0 / 1e6), "ok"),
        ("cuBLAS + Inductor (the step's)", "", "saves y", 3.0, pytest.approx(64 / 3.0 / 1e6), "ok"),
        ("triton fused", "picked", True, 4.0, pytest.approx(52 / 4.0 / 1e6), "ok"),
        ("triton fused", "picked", False, 8.0, pytest.approx(40 / 8.0 / 1e6), "ok"),
        ("triton fused", "64x128x64s4w4", True, None, None, "error: RuntimeError: no fit"),
        ("triton fused", "64x128x64s4w4", False, 0.0, None, "ok"),
    ]
    assert all(r["batch"] == 2 and r["width"] == 3 and r["rank"] == 1 and r["case"] == "fwd" for r in rows)
    tile = GemmTile(64, 128, 64, 4, 4)
    assert forced == [None, None, None, None, tile, tile] and heuristics.CROSS_TILE_OVERRIDE is None


def test_cross_layer_main_smoke_keeps_explicit_tiles_and_times_one_call(monkeypatch, tmp_path):
    """--smoke: batch 8, width 24, rank 4, one call in one window, no warm-up on the CPU; explicit --tiles kept,
    the default replaced by two tiles; a malformed tile refused before anything runs."""
    cl = script("cross_layer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cl, "environment", lambda device: {"device": "cpu", "torch": "t", "triton": "t", "date": "d"})
    monkeypatch.setattr(cl, "plot", lambda *a: None)
    monkeypatch.setattr(cl, "graph_replay_ms", lambda step, calls, windows, warmup: (calls, windows, warmup))
    monkeypatch.setattr(cl, "net_rows", lambda args, device, timer: [])
    seen = []
    monkeypatch.setattr(cl, "fwd_rows", lambda args, device, timer: seen.append(
        (args.batch, args.width, args.rank, args.tiles, timer(None))) or [])
    assert cl.main(["--smoke", "--out", str(tmp_path), "--tiles", "128x64x64s4w4"]) == 0
    assert cl.main(["--smoke", "--out", str(tmp_path), "--overwrite"]) == 0  # (the first call's files)
    assert seen == [(8, 24, 4, "128x64x64s4w4", (1, 1, 0)), (8, 24, 4, "picked,64x128x64s4w4", (1, 1, 0))]
    with pytest.raises(SystemExit):
        cl.main(["--smoke", "--out", str(tmp_path), "--tiles", "picked,64x128", "--overwrite"])


# ---- mask_bias_launches.py ------------------------------------------------------------------------------------------


def test_mask_bias_launches_rows_from_a_fake_kernel(monkeypatch, tmp_path):
    """Bytes = 3 x [64, N] fp32 per layer, GB/s = bytes / s / 1e9; the shipped launch named and used as the reference
    (gm bit for bit, the largest bias difference over the layers); a failing launch is a row; the module's override
    put back; --smoke's batch 64; an empty --launches refused."""
    mbl = script("mask_bias_launches")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mbl, "environment", lambda device: {"device": "cpu"})
    timed = []

    def graph_replay_ms(step, calls, windows, warmup):
        step()
        timed.append((calls, windows, warmup))
        return 2.0

    monkeypatch.setattr(mbl, "graph_replay_ms", graph_replay_ms)
    fake = NS(MASK_LAUNCH_OVERRIDE="saved", _mask_launch=lambda device: (32, 4, 4))

    def mask_bias_grad(g, o, flag):
        launch = fake.MASK_LAUNCH_OVERRIDE
        if launch == (8, 1, 1):
            raise RuntimeError("boom")
        gm = g * (o > 0) + (1.0 if launch == (64, 4, 4) else 0.0)
        shift = 0.5 * g.shape[1] / 1024 if launch == (16, 2, 8) else 0.0  # 0.5 on the 1024-wide layers
        return gm, torch.full((g.shape[1],), shift)

    fake.mask_bias_grad = mask_bias_grad
    monkeypatch.setattr(mbl, "mlp", fake)
    argv = ["--smoke", "--out", str(tmp_path), "--name", "m", "--batch", "128"]
    assert mbl.main([*argv, "--launches", "64x4p4,32x4p4,16x2p8,8x1p1,"]) == 0
    assert fake.MASK_LAUNCH_OVERRIDE == "saved" and timed == [(1, 1, 0)] * 4
    gbps = 3 * 64 * 3712 * 4 / 2e-3 / 1e9
    rows = read_csv(tmp_path / "m.csv")
    rows = [(r["launch"], r["batch"], r["ms"], r["gbps"], r["max_bias_diff"], r["status"]) for r in rows]
    assert rows == [("64x4p4", "64", "2.0", str(gbps), "0.0", "failed: gm differs from the shipped launch's"),
                    ("32x4p4 (shipped)", "64", "2.0", str(gbps), "0.0", "ok"),
                    ("16x2p8", "64", "2.0", str(gbps), "0.5", "ok"),
                    ("8x1p1", "64", "", "", "", "failed: RuntimeError: boom")]
    assert gbps == pytest.approx(1.425408)
    table = (tmp_path / "m.md").read_text()
    assert "| 16x2p8 | 2.0000 | 1 | 5.00e-01 | ok |" in table
    assert "| 8x1p1 | n/a | n/a | n/a | failed: RuntimeError: boom |" in table
    assert read_csv(tmp_path / "m.csv")[0]["widths"] == "1024 1024 512 256 512 256 128"
    assert mbl.parse_launch("64x8p2") == (64, 8, 2)
    with pytest.raises(SystemExit):
        mbl.main([*argv, "--launches", ","])
