"""Audit (by mutation) of the sweep and loader benchmark scripts' arithmetic, checked on the CPU against fake timers,
clocks, loaders and launchers (exact values, no real timings):

* copy_bandwidth.py: GB/s of each timer (bytes read + written of MiB-sized copies), the timers' arguments, the table;
* pooled_embedding.py: the copy reference (CPU and CUDA paths), `event_loop_ms`, the bytes a mode must move, the
  measured row (median ms, min/max, GB/s, % of copy, targets), the Markdown cells, main's caps, batches and launches;
* onehot_embedding_sweep.py: which byte count each op is divided into, the launches parsed and forced, main's L2 fetch
  sizes, table caps and CSV columns;
* pooled_update_sweep.py: `run_plan`'s bytes, rates, labels and the switches forced per row; main's option parsing;
* update_traffic_floor.py: the bytes of each case, the median of windows then of rounds, the launches timed;
* loader_throughput.py: rates, targets and meets_target, the parser's best run, the loader's median epoch and CPU time
  an epoch, the chunk size and line count main derives, the Markdown cells and the plot's labels;
* loader_training.py: the config each run trains, its failures and exit code, the table and CSV fields.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.test_audit_benchmark_numbers import FakeClock, fake_event_class, read_csv
from tests.test_benchmark_scripts import REPO, load_script

NS = types.SimpleNamespace


def fake_pyplot():
    """A pyplot stand-in (MagicMock): the figures' calls are recorded, nothing is drawn."""
    plt = mock.MagicMock()
    plt.subplots.return_value = (mock.MagicMock(), mock.MagicMock())
    return plt


def fake_tables(hotness=(2, 1), dim=4, dtype=torch.bfloat16, rows=50):
    """What `pooled_embedding.case_bytes` and `measure` read of a `Tables`: L = sum(hotness) slots, F features."""
    return NS(weight=torch.empty(0, dtype=dtype), layout=NS(num_slots=sum(hotness)), hotness=list(hotness), dim=dim,
              rows=rows)


# ---- copy_bandwidth.py --------------------------------------------------------------------------------------------


def test_copy_bandwidth_gbps_of_every_timer_from_fake_timers(monkeypatch, tmp_path):
    """GB/s = 2 x MiB x 2**20 / s / 1e9 (read + written, decimal GB); the graph replay's median window; the event loop
    `--loop` launches a window; the copy of `mib` MiB in fp32 elements; table columns MiB, timer, ms, GB/s."""
    cb = load_script("copy_bandwidth")
    sizes, calls = [], {}

    def empty(n, device=None):
        sizes.append(n)
        return torch.zeros(1)

    monkeypatch.setattr(cb, "torch", NS(cuda=NS(is_available=lambda: True, empty_cache=lambda: None),
                                        device=lambda d: d, empty=empty, empty_like=torch.empty_like))
    monkeypatch.setattr(cb, "environment", lambda device: {"device": "H200", "date": "d"})
    monkeypatch.setattr(cb, "triton", NS(testing=NS(do_bench=lambda fn, warmup, rep, return_mode: 0.5,
                                                    do_bench_cudagraph=lambda fn, rep, return_mode: 0.25)))

    def graph_replay_windows(fn, n, windows, warmup):
        calls["graph"] = (n, windows, warmup)
        return [4.0, 1.0, 2.0], 10  # median 2.0

    def event_loop_ms(fn, n, windows):
        calls["loop"] = (n, windows)
        return 0.125

    monkeypatch.setattr(cb, "graph_replay_windows", graph_replay_windows)
    monkeypatch.setattr(cb, "pe", NS(event_loop_ms=event_loop_ms))
    assert cb.main(["--out", str(tmp_path), "--name", "c", "--mib", "1,2", "--windows", "3", "--loop", "7"]) == 0
    assert sizes == [2**18, 2**19] and calls == {"graph": (0, 3, 2), "loop": (7, 3)}
    rows = read_csv(tmp_path / "c.csv")
    ms = {"do_bench": 0.5, "do_bench_cudagraph": 0.25, "graph_replay": 2.0, "event_loop": 0.125}
    assert [(r["mib"], r["timer"], float(r["ms"])) for r in rows] == [
        (m, t, v) for m in ("1", "2") for t, v in ms.items()]
    for r in rows:
        assert float(r["gbps"]) == pytest.approx(2 * int(r["mib"]) * 2**20 / (float(r["ms"]) / 1e3) / 1e9, rel=1e-12)
        assert r["device"] == "H200"
    assert float(rows[0]["gbps"]) == pytest.approx(4.194304)  # 2 MiB moved in 0.5 ms
    md = (tmp_path / "c.md").read_text()
    assert "| 1 | do_bench | 0.5000 | 4 |" in md and "| 2 | event_loop | 0.1250 | 34 |" in md


# ---- pooled_embedding.py ------------------------------------------------------------------------------------------


def test_pooled_copy_bandwidth_cpu_and_cuda_paths(monkeypatch):
    """The copy reference: 2 x nbytes (read + written) / the median window (CPU: wall_windows of 3 calls); on CUDA
    20 back-to-back launches a window by `event_loop_ms`, `windows` windows."""
    pe = load_script("pooled_embedding")
    seen = {}

    def wall_windows(step, calls, windows, warmup):
        seen["wall"] = (calls, windows, warmup)
        return [4.0, 1.0, 2.0], calls

    monkeypatch.setattr(pe, "wall_windows", wall_windows)
    assert pe.copy_bandwidth(torch.device("cpu"), 2**20, 3) == pytest.approx(2 * 2**20 / 2e-3 / 1e9, rel=1e-12)
    assert seen["wall"] == (3, 3, 2)

    def event_loop_ms(fn, n, windows):
        seen["loop"] = (n, windows)
        return 0.5

    monkeypatch.setattr(pe, "event_loop_ms", event_loop_ms)
    monkeypatch.setattr(pe, "torch", NS(empty=lambda n, device, dtype: torch.empty(n, dtype=dtype),
                                        empty_like=torch.empty_like, float32=torch.float32))
    assert pe.copy_bandwidth(NS(type="cuda"), 2**20, 5) == pytest.approx(4.194304, rel=1e-12)
    assert seen["loop"] == (20, 5)


def test_pooled_event_loop_ms_is_the_median_ms_per_call(monkeypatch):
    """One untimed call, then `windows` windows of `n` calls between events: ms per call (window / n), median."""
    pe = load_script("pooled_embedding")
    clock = [0.0]

    Event = fake_event_class(clock)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    costs = iter([100.0] + [1.0] * 4 + [3.0] * 4 + [0.5] * 4)  # the warm-up call, then 3 windows of 4 calls
    calls = []

    def fn():
        calls.append(1)
        clock[0] += next(costs)

    assert pe.event_loop_ms(fn, 4, 3) == 1.0 and len(calls) == 13  # windows of 1.0, 3.0, 0.5 ms a call


def test_pooled_case_bytes_by_hand():
    """fwd: L rows of D read + F pooled rows written a sample; bwd: the F x D gradient read, each distinct row read and
    written with its 4-byte state both ways; fwd+bwd the sum. L = 3, F = 2, D = 4, batch 5, 7 distinct rows."""
    pe = load_script("pooled_embedding")
    bf16, fp32 = fake_tables(), fake_tables(dtype=torch.float32)
    assert [pe.case_bytes(m, bf16, 5, 7) for m in pe.MODES] == [5 * (24 + 16), 5 * 16 + 7 * (16 + 8), 200 + 248]
    assert [pe.case_bytes(m, fp32, 5, 7) for m in pe.MODES] == [5 * (48 + 32), 5 * 32 + 7 * (32 + 8), 400 + 440]


def test_pooled_measure_row_from_fake_windows(monkeypatch):
    """The row of a case: ms the median window (with min and max), bytes, GB/s = bytes / s / 1e9, % of copy, lookups =
    batch x L, the target in % and met at exactly the target (>=); torch references and fwd+bwd carry no verdict."""
    pe = load_script("pooled_embedding")
    monkeypatch.setattr(pe, "make_step", lambda *a: None)
    seen = []

    def wall_windows(step, calls, windows, warmup):
        seen.append((calls, windows, warmup))
        return [2.0, 0.5, 1.0], 6

    monkeypatch.setattr(pe, "wall_windows", wall_windows)
    args = NS(steps=6, windows=3, warmup=0)
    t, x = fake_tables(), NS(unique=7)
    copy = 0.0002 / 0.7  # 200 bytes in 1 ms are 0.0002 GB/s: 70% of it
    r = pe.measure("triton", "fwd", "bf16", t, x, 5, copy, torch.device("cpu"), args)
    assert seen == [(6, 3, 0)] and r["status"] == "ok" and r["steps_per_window"] == 6
    assert (r["ms"], r["min_ms"], r["max_ms"], r["bytes"]) == (1.0, 0.5, 2.0, 200)
    assert (r["lookups"], r["unique_rows"]) == (15, 7)
    assert r["gbps"] == pytest.approx(0.0002, rel=1e-12) and r["table_rows"] == 50
    assert r["pct_of_copy"] == 70.0 and r["target_pct"] == 70.0 and r["meets_target"] is True
    r = pe.measure("triton", "bwd", "bf16", t, x, 5, 0.001, torch.device("cpu"), args)
    assert r["bytes"] == 248 and r["pct_of_copy"] == pytest.approx(24.8) and r["target_pct"] == 40.0
    assert r["meets_target"] is False
    r = pe.measure("torch-bag", "fwd", "bf16", t, x, 5, copy, torch.device("cpu"), args)
    assert r["meets_target"] is None and r["target_pct"] == 70.0
    r = pe.measure("triton", "fwd+bwd", "bf16", t, x, 5, copy, torch.device("cpu"), args)
    assert r["bytes"] == 448 and r["target_pct"] is None and r["meets_target"] is None


def test_pooled_markdown_cells_and_cases():
    """Target cells ("**met**" / "missed"), rates (two decimals under 10, thousands separators from 10), and the
    (impl, mode) pairs: the torch references forward only."""
    pe = load_script("pooled_embedding")
    base = {"impl": "triton", "dtype": "bf16", "batch": 2, "table_rows": 12345, "unique_rows": 400, "ms": 0.12345,
            "target_pct": 70.0, "status": "ok"}
    lines = pe.markdown_table([{**base, "mode": "fwd", "gbps": 12345.6, "pct_of_copy": 75.4, "meets_target": True},
                               {**base, "mode": "bwd", "gbps": 9.99, "pct_of_copy": 30.0, "target_pct": 40.0,
                                "meets_target": False},
                               {**base, "mode": "fwd", "gbps": 10.0, "pct_of_copy": 1.0, "meets_target": None}])
    assert lines[2] == "| triton | fwd | bf16 | 2 | 12,345 | 400 | 0.123 | 12,346 | 75% | >= 70%: **met** | ok |"
    assert lines[3] == "| triton | bwd | bf16 | 2 | 12,345 | 400 | 0.123 | 9.99 | 30% | >= 40%: missed | ok |"
    assert lines[4] == "| triton | fwd | bf16 | 2 | 12,345 | 400 | 0.123 | 10 | 1% |  | ok |"
    assert pe.cases(["fwd", "bwd"], list(pe.IMPLS)) == [("triton", "fwd"), ("torch-bag", "fwd"),
                                                         ("torch-bag-rows", "fwd"), ("triton", "bwd")]


def test_pooled_main_caps_batches_and_lookup_launches(monkeypatch, tmp_path):
    """fp32 tables capped at the smaller of --rows-cap and --fp32-rows-cap; every batch size; each --lookup-launches
    launch (unroll 1 when left out) forced for one more triton fwd row, with no verdict against the target; an unroll
    of 8 refused."""
    pe = load_script("pooled_embedding")
    import kernels.embedding.pooled as pooled

    made, measured = [], []

    class Tables:
        def __init__(self, cards, hotness, dim, dtype, device):
            made.append((dtype, cards))

        @staticmethod
        def nbytes(cards, dim, dtype):
            return 0

    monkeypatch.setattr(pe, "Tables", Tables)
    monkeypatch.setattr(pe, "Inputs", lambda t, batch, device: NS(batch=batch))
    monkeypatch.setattr(pe, "copy_bandwidth", lambda *a: 100.0)
    monkeypatch.setattr(pe, "environment", lambda device: {"device": "cpu"})
    monkeypatch.setattr(pe, "gc", NS(collect=lambda: None))  # 0.3 s a call with torch loaded

    def measure(impl, mode, dtype, t, x, batch, copy_gbps, device, args):
        measured.append(pooled.POOLED_LOOKUP_OVERRIDE)
        return {"impl": impl, "mode": mode, "dtype": dtype, "batch": batch, "status": "ok", "meets_target": True,
                "ms": 1.0, "gbps": 1.0, "pct_of_copy": 1.0}

    monkeypatch.setattr(pe, "measure", measure)
    rows = []
    monkeypatch.setattr(pe, "write_results", lambda r, *a: rows.__setitem__(slice(None), r) or "text")
    assert pe.main(["--out", str(tmp_path), "--dtypes", "bf16,fp32", "--batch-sizes", "4,2", "--modes", "fwd",
                    "--impls", "triton,torch-bag", "--rows-cap", "50000000", "--fp32-rows-cap", "1000",
                    "--lookup-launches", "16x2"]) == 0
    cards = pe.load_config(pe.CONFIG).model.cardinalities
    assert made == [(torch.bfloat16, [min(c, 50_000_000) for c in cards]),
                    (torch.float32, [min(c, 1000) for c in cards])]
    assert [(r["impl"], r["dtype"], r["batch"], r["meets_target"]) for r in rows] == [
        (i, d, b, m) for d in ("bf16", "fp32") for b in (4, 2)
        for i, m in (("triton", True), ("triton 16x2x1", None), ("torch-bag", True))]
    assert measured == [None, (16, 2, 1), None] * 4 and pooled.POOLED_LOOKUP_OVERRIDE is None
    with pytest.raises(SystemExit):
        pe.main(["--out", str(tmp_path), "--lookup-launches", "16x4x8"])


# ---- onehot_embedding_sweep.py ------------------------------------------------------------------------------------


def test_onehot_run_case_bytes_and_rates_from_a_fake_timer(monkeypatch):
    """Each op's GB/s: kernels.py's bwd bytes for every update (bwd, bwd_atomic, bwd_atomic_hashed), its fwd bytes for
    the lookups and fwd_atomic, of batch x 26 lookups and the table's element size; the median window; % of copy; each
    forced launch set while its lookup is timed, reset after."""
    sw = load_script("onehot_embedding_sweep")
    import kernels.embedding.lookup as lookup

    seen, work = [], []

    def wall_windows(fn, steps, windows, warmup):
        seen.append((lookup.LOOKUP_LAUNCH_OVERRIDE, steps, windows, warmup))
        return [2.0, 0.5, 1.0], 1

    def bytes_of(n, unique, dim, elem):
        work.append((n, unique, dim, elem))
        return {"fwd": 3e6, "bwd": 5e6}

    monkeypatch.setattr(sw, "wall_windows", wall_windows)
    args = NS(steps=1, windows=3, warmup=0)
    rows = sw.run_case(16, 10, torch.float32, 4, [None, (16, 2)], 64, torch.device("cpu"), 10.0, bytes_of, args)
    assert [(r["op"], r["launch"]) for r in rows] == [("fwd", "picked"), ("fwd", "16x2"), ("bwd", "picked"),
                                                      ("fwd_atomic", "picked"), ("bwd_atomic", "picked"),
                                                      ("bwd_atomic_hashed", "picked")]
    assert seen == [(None, 1, 3, 0), ((16, 2), 1, 3, 0)] + [(None, 1, 3, 0)] * 4
    assert lookup.LOOKUP_LAUNCH_OVERRIDE is None
    assert all(r["ms"] == 1.0 and r["status"] == "ok" and r["l2_fetch_bytes"] == 64 and r["dtype"] == "float32"
               for r in rows)
    assert [r["gbps"] for r in rows] == pytest.approx([3.0, 3.0, 5.0, 3.0, 5.0, 5.0], rel=1e-12)
    assert [r["pct_of_copy"] for r in rows] == pytest.approx([30.0, 30.0, 50.0, 30.0, 50.0, 50.0], rel=1e-12)
    assert work == [(4 * 26, rows[0]["unique_rows"], 16, 4)] and 0 < rows[0]["unique_rows"] <= 104
    sw.run_case(16, 10, torch.bfloat16, 4, [None], 0, torch.device("cpu"), 10.0, bytes_of, args)
    assert work[-1][3] == 2


def test_onehot_parse_launches():
    """ROWSxWARPS: rows a power of two, warps 1 to 16; 'picked' is None."""
    sw = load_script("onehot_embedding_sweep")
    assert sw.parse_launches("picked, 256x16,1024x8") == [None, (256, 16), (1024, 8)]
    for bad in ("100x4", "128x3", "128", "x4"):
        with pytest.raises(ValueError):
            sw.parse_launches(bad)


def test_onehot_main_l2_fetch_sizes_table_caps_and_csv_columns(monkeypatch, tmp_path):
    """With a (fake) CUDA device: an --l2-fetch of 0 is the driver's value (set and reported as such), others are set;
    D = 128 tables capped at 4M rows, D = 16 full size; the driver's value restored at the end; the CSV's copy_gbps
    and driver_l2_fetch columns."""
    sw = load_script("onehot_embedding_sweep")
    fetch, sets, cases = [64], [], []

    def l2(nbytes=0):
        if nbytes:
            sets.append(nbytes)
            fetch[0] = nbytes
        return fetch[0]

    def run_case(dim, cap, dtype, batch, launches, f, device, copy_gbps, bytes_of, args):
        cases.append((f, dim, cap, dtype, batch, launches))
        return [dict(l2_fetch_bytes=f, dim=dim, dtype="float32", batch=batch, op="fwd", launch="picked", unique_rows=1,
                     ms=0.5, gbps=2.0, pct_of_copy=12.5, status="ok")]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(sw, "l2_fetch_granularity", l2)
    monkeypatch.setattr(sw, "run_case", run_case)
    monkeypatch.setattr(sw.pe, "copy_bandwidth", lambda *a: 16.0)
    monkeypatch.setattr(sw, "_bench_kernels", lambda: NS(embedding_bytes=None))
    monkeypatch.setattr(sw, "environment", lambda device: {"device": "H200", "date": "d"})
    monkeypatch.setattr(sw, "pyplot", fake_pyplot)
    monkeypatch.setattr(sw, "save_figure", lambda *a, **k: None)
    assert sw.main(["--out", str(tmp_path), "--name", "s", "--l2-fetch", "0,32", "--dims", "16,128", "--dtypes", "fp32",
                    "--batch-sizes", "8", "--launches", "picked"]) == 0
    assert cases == [(f, d, c, torch.float32, 8, [None]) for f in (64, 32) for d, c in ((16, None), (128, 4_000_000))]
    assert sets == [64, 32, 64]  # each size set, then the driver's restored
    rows = read_csv(tmp_path / "s.csv")
    assert [(r["l2_fetch_bytes"], r["copy_gbps"], r["driver_l2_fetch"]) for r in rows] == [("64", "16.0", "64")] * 2 + [
        ("32", "16.0", "64")] * 2
    assert "| 64 | 16 | float32 | 8 | fwd | picked | 0.5000 | 12.5% | ok |" in (tmp_path / "s.md").read_text()


# ---- pooled_update_sweep.py ---------------------------------------------------------------------------------------


def test_pooled_update_run_plan_rows_and_forced_switches(monkeypatch):
    """Each plan row: the backward's bytes (pooled_embedding's "bwd"), ms the median window, GB/s and % of copy; the
    launch printed (with "(picked)" for the launcher's), its own carry_chunks and register cap unless forced; the
    rounding (nearest: no stochastic rounding), launch and switches set while it runs, the shipped ones restored."""
    sw = load_script("pooled_update_sweep")
    from kernels import heuristics
    from kernels.embedding import update

    monkeypatch.setattr(sw.pe, "Tables", lambda cards, hotness, dim, dtype, device: NS(
        **vars(fake_tables(hotness, dim, dtype)), state=None, lr=None, sr_seed=None))
    monkeypatch.setattr(sw.pe, "Inputs", lambda t, batch, device: NS(unique=100, rows=None, grad=None))
    calls = []

    def update_(rows, grad, layout, weight, state, lr, opt, eps, deterministic, wd, seed, sr):
        calls.append((sr, update.SR_RNG, heuristics.SPARSE_UPDATE_OVERRIDE, update.ROW_LOADS, update.EVICTION,
                      update.CARRY_CHUNKS, update.PARTIAL_PICK, update.CHUNK_MAXNREG))

    def wall_windows(step, steps, windows, warmup):
        step()
        return [2.0, 0.5, 1.0], steps

    monkeypatch.setattr(sw.pe, "pooled_embedding_sparse_update_", update_)
    monkeypatch.setattr(sw, "wall_windows", wall_windows)
    shipped = (update.SR_RNG, update.ROW_LOADS, update.EVICTION, update.CARRY_CHUNKS, update.PARTIAL_PICK)
    plan = [("bf16", "hash1", None, ("prefetch_l2", "grad_last", None, "store", None)),
            ("bf16", "nearest", (16, 16, 2, 1), ("prefetch_l2", "grad_last", 4, "store", 0)),
            ("bf16", "hash", (32, 16, 4, 1), ("after_sums", "none", None, "sum", 96))]
    m = NS(multi_hot_sizes=[3, 1], embedding_dim=128)
    rows = sw.run_plan("bf16", plan, [10, 10], m, 2, torch.device("cpu"), 1e-4, NS(steps=1, windows=3, warmup=0))
    nbytes = 2 * 2 * 128 * 2 + 100 * (2 * 128 * 2 + 8)  # B x F x D x 2 B gradient + 100 rows and their state, r+w
    assert all(r["ms"] == 1.0 and r["unique_rows"] == 100 and r["batch"] == 2 and r["status"] == "ok" for r in rows)
    assert [r["gbps"] for r in rows] == pytest.approx([nbytes / 1e6] * 3, rel=1e-12)
    assert [r["pct_of_copy"] for r in rows] == pytest.approx([100 * nbytes / 1e6 / 1e-4] * 3, rel=1e-12)
    picked = heuristics.sparse_update_config(128, torch.bfloat16, multi_hot=True)
    assert [r["launch"] for r in rows] == [str(tuple(picked)) + " (picked)",
                                           str(tuple(heuristics.SparseUpdateConfig(16, 16, 2, 1))),
                                           str(tuple(heuristics.SparseUpdateConfig(32, 16, 4, 1)))]
    assert [(r["carry_chunks"], r["maxnreg"]) for r in rows] == [(picked.carry_chunks, picked.chunk_maxnreg),
                                                                 (4, "none"), (32, 96)]
    assert calls == [(True, "hash1", None, "prefetch_l2", "grad_last", None, "store", None),
                     (False, shipped[0], (16, 16, 2, 1), "prefetch_l2", "grad_last", 4, "store", 0),
                     (True, "hash", (32, 16, 4, 1), "after_sums", "none", None, "sum", 96)]
    assert (update.SR_RNG, update.ROW_LOADS, update.EVICTION, update.CARRY_CHUNKS, update.PARTIAL_PICK) == shipped
    assert heuristics.SPARSE_UPDATE_OVERRIDE is None and update.CHUNK_MAXNREG is None


def test_pooled_update_main_options_caps_and_csv(monkeypatch, tmp_path):
    """--maxnregs 'launch' (None: the launch's own), 'none' (0) and a count from 24; --roundings with '-' keeps fp32's
    rows and gives bf16 only its named roundings; --repeats runs the plan again; fp32 tables capped at the smaller cap;
    the CSV carries copy_gbps; a cap under 24 refused."""
    sw = load_script("pooled_update_sweep")
    plans = []

    def run_plan(dtype, plan, cards, m, batch, device, copy_gbps, args):
        plans.append((dtype, plan, cards, batch))
        return [dict(dtype=dtype, rounding=p[1], launch=str(p[2]), row_loads=p[3][0], eviction=p[3][1],
                     carry_chunks=p[3][2], pick=p[3][3], maxnreg=p[3][4], batch=batch, unique_rows=1, ms=0.5,
                     gbps=1.0, pct_of_copy=12.5, status="ok") for p in plan]

    monkeypatch.setattr(sw, "run_plan", run_plan)
    monkeypatch.setattr(sw.pe, "copy_bandwidth", lambda *a: 8.0)
    monkeypatch.setattr(sw, "environment", lambda device: {"device": "H200", "date": "d"})
    monkeypatch.setattr(sw, "pyplot", fake_pyplot)
    monkeypatch.setattr(sw, "save_figure", lambda *a, **k: None)
    assert sw.main(["--out", str(tmp_path), "--name", "s", "--batch", "4", "--rows-cap", "50000000", "--fp32-rows-cap",
                    "1000", "--launches", "picked", "--roundings", "hash1,-", "--maxnregs", "launch,none,24",
                    "--repeats", "2"]) == 0
    from kernels.embedding import update

    o = (update.ROW_LOADS, update.EVICTION, update.CARRY_CHUNKS, update.PARTIAL_PICK)
    orders = [(*o, cap) for cap in (None, 0, 24)]
    cards = sw.load_config(sw.pe.CONFIG).model.cardinalities
    assert plans == [("bf16", [("bf16", "hash1", None, order) for order in orders] * 2,
                      [min(c, 50_000_000) for c in cards], 4),
                     ("fp32", [("fp32", "-", None, order) for order in orders] * 2, [min(c, 1000) for c in cards], 4)]
    rows = read_csv(tmp_path / "s.csv")
    assert len(rows) == 12 and {r["copy_gbps"] for r in rows} == {"8.0"}
    assert "| bf16 | hash1 | None | prefetch_l2 |" in (tmp_path / "s.md").read_text()
    with pytest.raises(SystemExit):
        sw.main(["--out", str(tmp_path), "--maxnregs", "23"])


# ---- update_traffic_floor.py --------------------------------------------------------------------------------------


def test_update_traffic_case_bytes_by_hand():
    """12 B a position (sorted row + permutation), each distinct row and its 4-byte state read and written, a gradient
    row gathered per position; a launch variant counts as its case."""
    utf = load_script("update_traffic_floor")
    got = {c: utf.case_bytes(c, 10, 4, 256) for c in ("update", "rmw+gather", "rmw", "gather", "rmw+gather@32:2")}
    assert got == {"update": 120 + 2080 + 2560, "rmw+gather": 4760, "rmw": 2200, "gather": 2680,
                   "rmw+gather@32:2": 4760}


def test_update_traffic_main_medians_bytes_and_launches(monkeypatch, tmp_path):
    """ms = the median over rounds of each round's median window; GB = the case's bytes (bf16 rows of 256 B, the batch's
    positions and distinct rows) / 1e9; % of copy; each launch timed at its own positions and warps; warps not a power
    of two refused."""
    utf = load_script("update_traffic_floor")
    # the CPU path (wall-clock windows, no warmup); on a GPU machine main would time CUDA-graph replays
    monkeypatch.setattr(utf.torch.cuda, "is_available", lambda: False)
    calls, n = [], [0]
    monkeypatch.setattr(utf.pe, "Tables", lambda cards, hotness, dim, dtype, device: NS(
        dim=dim, weight=torch.empty(0, dtype=dtype), rows=sum(cards), layout=NS(slot_feature=None), state=None, lr=None,
        sr_seed=None))
    monkeypatch.setattr(utf.pe, "Inputs", lambda t, batch, device: NS(rows=torch.zeros(batch, 214), unique=300,
                                                                     grad=None))
    monkeypatch.setattr(utf.update, "sort_by_row", lambda rows, n_rows: (None, None))
    monkeypatch.setattr(utf.pe, "copy_bandwidth", lambda *a: 0.5)
    monkeypatch.setattr(utf, "environment", lambda device: {"device": "cpu", "date": "d"})
    monkeypatch.setattr(utf, "pyplot", fake_pyplot)
    monkeypatch.setattr(utf, "save_figure", lambda *a, **k: None)
    monkeypatch.setattr(utf.update, "_segment_update", lambda *a, **k: calls.append(("update", 16, 1)))
    monkeypatch.setattr(utf, "skeleton", lambda case, *a: calls.append((case, *(a[7:] or (16, 1)))))

    def wall_windows(step, steps, windows, warmup):
        step()
        s = (1.0, 3.0, 2.0)[n[0] // 5]  # rounds: every case's windows scaled by 1, 3, then 2
        n[0] += 1
        return [2.0 * s, 0.5 * s, 8.0 * s][:windows], 1

    monkeypatch.setattr(utf, "wall_windows", wall_windows)
    assert utf.main(["--out", str(tmp_path), "--name", "u", "--rows-cap", "1000", "--batch", "4", "--windows", "3",
                     "--repeats", "3", "--skeleton-launches", "32:2"]) == 0
    cases = ["update", "rmw+gather", "rmw", "gather", "rmw+gather@32:2"]
    want_calls = [("update", 16, 1), ("rmw+gather", 16, 1), ("rmw", 16, 1), ("gather", 16, 1), ("rmw+gather", 32, 2)]
    assert calls == want_calls * 3
    rows = read_csv(tmp_path / "u.csv")
    positions, distinct = 4 * 214, 300
    assert [r["case"] for r in rows] == cases + ["copy"]
    for r in rows[:5]:
        gbytes = utf.case_bytes(r["case"], positions, distinct, 256) / 1e9
        assert float(r["ms"]) == 4.0 and r["all_ms"] == "2.000 6.000 4.000"
        assert float(r["gbytes"]) == pytest.approx(gbytes, rel=1e-12)
        assert float(r["gbps"]) == pytest.approx(gbytes / 4e-3, rel=1e-12)
        assert float(r["pct_of_copy"]) == pytest.approx(100 * gbytes / 4e-3 / 0.5, rel=1e-12)
        assert (int(r["positions"]), int(r["distinct_rows"])) == (positions, distinct)
    assert (rows[5]["gbps"], rows[5]["pct_of_copy"]) == ("0.5", "100.0")
    with pytest.raises(SystemExit):
        utf.main(["--smoke", "--out", str(tmp_path), "--skeleton-launches", "32:3"])


# ---- loader_throughput.py -----------------------------------------------------------------------------------------


def test_loader_throughput_row_rates_and_targets():
    """rate = rows / seconds (none for a failed or untimed run); the target of the preprocess stage and of each loader
    placement, none for the decode stage and the parser."""
    lt = load_script("loader_throughput")
    assert lt.row("loader", "cuda", 1000, 0.5, "samples/s", placement="stream")["rate"] == 2000.0
    assert lt.row("loader", "cuda", 1000, 0.5, "samples/s", placement="stream")["target"] == 20e6
    assert lt.row("loader", "cuda", 1000, 0.5, "samples/s", placement="gpu")["target"] == 200e6
    r = lt.row("preprocess", "cpu", 10, 4.0, "rows/s", workers=4)
    assert (r["rate"], r["target"], r["workers"], r["meets_target"]) == (2.5, 1e6, 4, None)
    assert lt.row("decode", "host", 10, 1.0, "samples/s", placement="stream")["target"] is None
    assert lt.row("parse", "cpu", 10, 1.0, "rows/s")["target"] is None
    assert lt.row("preprocess", "cpu", 10, 4.0, "rows/s", status="error: X")["rate"] is None
    assert lt.row("loader", "cpu", 10, None, "samples/s", placement="stream")["rate"] is None


def test_loader_throughput_parser_best_of_repeats_and_max_lines(monkeypatch, tmp_path):
    """The parser's rate: the first `max_lines` lines over the fastest repeat."""
    lt = load_script("loader_throughput")
    clock, took, parsed = FakeClock(), iter([0.5, 0.25, 1.0]), []

    def parse_chunk(data, fmt):
        parsed.append(data)
        clock.now += next(took)

    monkeypatch.setattr(lt, "time", clock)
    monkeypatch.setattr(lt, "pp", NS(parse_chunk=parse_chunk))
    raw = tmp_path / "raw.tsv"
    raw.write_bytes(b"a\nb\nc\nd\ne\n")
    r = lt.bench_parse(raw, max_lines=3, repeats=3)
    assert parsed == [b"a\nb\nc\n"] * 3 and (r["rows"], r["seconds"], r["rate"], r["workers"]) == (3, 0.25, 12.0, 1)


def test_loader_throughput_preprocess_failure_keeps_the_last_good_dataset(monkeypatch, tmp_path):
    """Each worker count's rate = input lines / the whole call's seconds; a failed run is reported, no rate, and the
    dataset measured after is the last one that was made."""
    lt = load_script("loader_throughput")
    clock = FakeClock()

    def preprocess(inputs, out, workers, chunk_rows, progress):
        clock.now += {1: 4.0, 2: 2.0, 4: 1.0}[workers]
        if workers == 4:
            raise RuntimeError("boom")
        out.mkdir()

    monkeypatch.setattr(lt, "time", clock)
    monkeypatch.setattr(lt, "pp", NS(preprocess=preprocess))
    rows, last = lt.bench_preprocess(tmp_path / "raw.tsv", 1000, tmp_path, [1, 2, 4], 500)
    assert [(r["workers"], r["seconds"], r["rate"], r["chunk_rows"]) for r in rows] == [
        (1, 4.0, 250.0, 500), (2, 2.0, 500.0, 500), (4, 1.0, None, 500)]
    assert rows[2]["status"] == "error: RuntimeError: boom" and last == tmp_path / "pp_w2"
    assert not (tmp_path / "pp_w1").exists()  # the older one removed


def test_loader_throughput_bench_loader_median_epoch_and_cpu_time(monkeypatch, tmp_path):
    """A loader row: rows of the first timed epoch over the median epoch's seconds (the warm-up epoch not timed), the
    CPU user and system seconds and minor faults an epoch (over the timed epochs), one-hot rows keeping their
    target, multi-hot rows none."""
    lt = load_script("loader_throughput")
    import dlrm.data.device_loader
    import dlrm.data.loader
    import dlrm.data.schema

    sizes = [[1, 1]]
    monkeypatch.setattr(dlrm.data.schema, "read_metadata", lambda d: NS(
        multi_hot_sizes=sizes[0], dense_format=None, splits={"train": NS(rows=1000)}))
    monkeypatch.setattr(dlrm.data.loader, "split_files", lambda d, meta, split: ["f"])

    class Loader:
        def __init__(self, *a, **k):
            self.reader_threads, self.arrow_threads = 3, True

        def set_epoch(self, e):
            pass

    monkeypatch.setattr(dlrm.data.loader, "ParquetLoader", Loader)
    monkeypatch.setattr(dlrm.data.device_loader, "DeviceLoader", Loader)
    monkeypatch.setattr(lt, "dataset_codec", lambda d: "zstd")
    monkeypatch.setattr(lt, "dataset_layout", lambda d: "slots")
    epochs = iter([(1000, 9.0), (1000, 0.5), (1000, 0.25), (1000, 1.0)] * 4)
    monkeypatch.setattr(lt, "_host_epoch", lambda loader: next(epochs))
    monkeypatch.setattr(lt, "_epoch", lambda loader, device: next(epochs))
    usage = iter([NS(ru_utime=1.0, ru_stime=0.5, ru_minflt=100), NS(ru_utime=4.0, ru_stime=1.4, ru_minflt=400)] * 4)
    monkeypatch.setattr(lt, "resource", NS(RUSAGE_SELF=0, getrusage=lambda who: next(usage)))
    out = lt.bench_loader(tmp_path, ["cpu"], 256, 3, [False], [None], 100)
    assert [(r["stage"], r["device"], r["placement"]) for r in out] == [("decode", "host", "stream"),
                                                                      ("loader", "cpu", "stream")]
    for r in out:
        assert (r["rows"], r["seconds"], r["rate"], r["workers"], r["codec"], r["layout"]) == (
            1000, 0.5, 2000.0, 3, "zstd", "slots")
        assert r["cpu_user_s"] == 1.0 and r["cpu_sys_s"] == pytest.approx(0.3) and r["minor_faults"] == 100
    assert (out[0]["target"], out[1]["target"]) == (None, 20e6)
    sizes[0] = [3, 1]
    out = lt.bench_loader(tmp_path, ["cpu"], 256, 3, [False], [None], 100)
    assert [r["target"] for r in out] == [None, None] and out[1]["rate"] == 2000.0


def test_loader_throughput_main_targets_chunk_rows_and_repeat(monkeypatch, tmp_path):
    """On a (fake) GPU machine: --repeat K preprocesses K x the lines; chunk rows about 4 chunks per worker of the most
    workers; the target judged for the run with the most workers (met at exactly the target), not the others."""
    lt = load_script("loader_throughput")
    seen = {}

    def make_raw(rows, raw_tsv, work):
        (work / "raw.tsv").write_bytes(b"x\n")
        return work / "raw.tsv", 400_000

    def bench_preprocess(raw, lines, work, workers, chunk_rows):
        seen["pre"] = (raw.read_bytes(), lines, workers, chunk_rows)
        return [lt.row("preprocess", "cpu", 3_000_000, 1.0, "rows/s", workers=1),
                lt.row("preprocess", "cpu", 1_000_000, 1.0, "rows/s", workers=2)], None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lt, "environment", lambda: {"gpu": "H200", "cpu_count": 2})
    monkeypatch.setattr(lt, "make_raw", make_raw)
    monkeypatch.setattr(lt, "bench_parse", lambda raw: lt.row("parse", "cpu", 10, 1.0, "rows/s", workers=1))
    monkeypatch.setattr(lt, "bench_preprocess", bench_preprocess)
    monkeypatch.setattr(lt, "write_results", lambda rows, env, out, stem: seen.setdefault("rows", rows) and [])
    assert lt.main(["--workers", "1,2", "--repeat", "3", "--work", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert seen["pre"] == (b"x\n" * 3, 1_200_000, [1, 2], 150_000)
    assert [r["meets_target"] for r in seen["rows"]] == [None, None, True]


def test_loader_throughput_main_parses_the_loader_lists(monkeypatch, tmp_path):
    """--shuffle values case-insensitive, --reader-threads and --arrow-threads lists, --devices."""
    lt = load_script("loader_throughput")
    (tmp_path / "metadata.json").write_text("{}")
    seen = []
    monkeypatch.setattr(lt, "environment", lambda: {"gpu": "none", "cpu_count": 2})
    monkeypatch.setattr(lt, "bench_loader", lambda *a, **k: seen.append(a) or [])
    monkeypatch.setattr(lt, "write_results", lambda *a: [])
    assert lt.main(["--dataset", str(tmp_path), "--shuffle", "True, no,YES", "--reader-threads", "4,8",
                    "--arrow-threads", "on,default", "--devices", "cpu", "--repeats", "2", "--batch-size", "64",
                    "--work", str(tmp_path / "w"), "--out", str(tmp_path)]) == 0
    assert seen == [(tmp_path, ["cpu"], 64, 2, [True, False, True], [4, 8], 1_000_000, [True, None])]


def test_loader_throughput_dataset_mode_judges_the_targets(monkeypatch, tmp_path):
    """Bug fixed: with --dataset, main wrote the loader rows' targets but never judged them (meets "-" for a one-hot
    dataset on the GPU machine); now as the full run does: the loader rows fed to CUDA only."""
    lt = load_script("loader_throughput")
    (tmp_path / "metadata.json").write_text("{}")
    results = [lt.row("decode", "host", 30_000_000, 1.0, "samples/s", placement="stream"),
               lt.row("loader", "cuda", 20_000_000, 1.0, "samples/s", placement="stream"),
               lt.row("loader", "cuda", 100_000_000, 1.0, "samples/s", placement="gpu"),
               lt.row("loader", "cpu", 30_000_000, 1.0, "samples/s", placement="stream")]
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lt, "environment", lambda: {"gpu": "H200", "cpu_count": 2})
    monkeypatch.setattr(lt, "bench_loader", lambda *a, **k: results)
    monkeypatch.setattr(lt, "write_results", lambda rows, *a: seen.append(rows) or [])
    assert lt.main(["--dataset", str(tmp_path), "--work", str(tmp_path / "w"), "--out", str(tmp_path)]) == 0
    assert [r["meets_target"] for r in seen[0]] == [None, True, False, None]


def test_loader_throughput_table_cells_and_plot_labels(monkeypatch, tmp_path):
    """Rates in millions from 1e5, meets yes / NO / -, and each bar's label naming its codec and layout once."""
    lt = load_script("loader_throughput")
    assert (lt._fmt(1e5, "samples/s"), lt._fmt(99_999.0, "rows/s"), lt._fmt(2.5), lt._fmt(None), lt._fmt(3)) == (
        "0.10M", "99,999", "2.500", "-", "3")
    plt = mock.MagicMock()
    a1, a2 = mock.MagicMock(), mock.MagicMock()
    plt.subplots.return_value = (mock.MagicMock(), (a1, a2))
    monkeypatch.setattr(lt, "pyplot", lambda: plt)
    monkeypatch.setattr(lt, "save_figure", lambda *a, **k: None)
    rows = [lt.row("loader", "cuda", 2_000_000, 0.1, "samples/s", placement="stream", shuffle=True, workers=4,
                   codec="zstd", layout="slots", arrow_threads=True),
            lt.row("preprocess", "cpu", 1_000_000, 2.0, "rows/s", workers=8)]
    rows[0]["meets_target"], rows[1]["meets_target"] = True, False
    env = {"gpu": "H200", "cpu_count": 2, "torch": "t", "pyarrow": "p", "date": "d"}
    lt.write_results(rows, env, tmp_path, "lt")
    md = (tmp_path / "lt.md").read_text()
    assert "| loader | cuda | 4 | stream | zstd | slots | True | True | - | 2,000,000 | 0.100 | 20.00M samples/s | - " \
           "| 20.00M | yes | ok |" in md
    assert "| 1,000,000 | 2.000 | 0.50M rows/s | - | 1.00M | NO | ok |" in md
    assert a2.set_yticks.call_args.args[1] == ["cuda stream, shuffled, 4 readers, zstd, slots, arrow pool"]


# ---- loader_training.py -------------------------------------------------------------------------------------------


def _fake_train_py(tmp_path, rc: int, configs: list):
    def run(cmd, stdout, stderr, cwd):
        cfg = json.loads(Path(cmd[cmd.index("--config") + 1]).read_text())
        configs.append(cfg)
        d = Path(cfg["log"]["tb_dir"]) / cfg["log"]["run_name"]
        (d / "checkpoints").mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"steps": 12, "samples_per_sec": 2.5e6, "data_wait_fraction": 0.0,
                                                    "auc": 0.75, "device_name": "NVIDIA H200",
                                                    "versions": {"torch": "2.9"}}))
        stdout.write("step 12\nTraceback: boom\n")
        return NS(returncode=rc)

    return run


def test_loader_training_run_trains_the_placement_shuffled_for_the_steps(monkeypatch, tmp_path):
    """Each run's config: the dataset, the placement, shuffled, the batch, --steps steps, logging every --log-every,
    no evaluation; its row from summary.json; a non-zero exit is a failure even with a summary written."""
    lt = load_script("loader_training")
    configs = []
    monkeypatch.setattr(lt.subprocess, "run", _fake_train_py(tmp_path, 0, configs))
    args = NS(variant="eager", data=Path("/d/x"), batch_size=64, steps=12, log_every=2)
    r = lt.run(REPO / "configs" / "sample.json", "stream", args, tmp_path)
    d, t = configs[0]["data"], configs[0]["train"]
    assert (d["path"], d["placement"], d["shuffle"], d["batch_size"]) == ("/d/x", "stream", True, 64)
    assert (t["max_steps"], t["epochs"], t["eval_every"], t["log_every"]) == (12, 1000, None, 2)
    assert r == {"placement": "stream", "batch_size": 64, "steps": 12, "samples_per_sec": 2.5e6,
                 "data_wait_fraction": 0.0, "auc": 0.75, "status": "ok", "device_name": "NVIDIA H200",
                 "versions": {"torch": "2.9"}}
    assert not (tmp_path / "tb" / "loader-stream" / "checkpoints").exists()
    monkeypatch.setattr(lt.subprocess, "run", _fake_train_py(tmp_path, 1, configs))
    r = lt.run(REPO / "configs" / "sample.json", "gpu", args, tmp_path)
    assert r == {"placement": "gpu", "batch_size": 64, "status": "exit 1: Traceback: boom"}


def test_loader_training_table_csv_and_exit_code(monkeypatch, tmp_path):
    """Millions (1e6) of samples/s, a zero wait written as 0.0%, the GPU name from the run that succeeded even after a
    failed one; main exits 1 when a placement failed."""
    lt = load_script("loader_training")
    monkeypatch.setattr(lt, "date_stamp", lambda: "2026-11-30 08:00")
    monkeypatch.setattr(lt, "pyplot", fake_pyplot)
    monkeypatch.setattr(lt, "save_figure", lambda *a, **k: None)
    rows = [{"placement": "stream", "batch_size": 64, "status": "exit 1: boom"},
            {"placement": "gpu", "batch_size": 64, "steps": 12, "samples_per_sec": 2.5e6, "data_wait_fraction": 0.0,
             "auc": 0.75, "status": "ok", "device_name": "NVIDIA H200", "versions": {"torch": "2.9"}}]
    args = NS(out=str(tmp_path), variant="eager", config="configs/sample.json", data="/d/x", batch_size=64)
    lt.write(rows, args, "t")
    md = (tmp_path / "t.md").read_text()
    assert "gpu: NVIDIA H200; torch 2.9; date: 2026-11-30 08:00" in md
    assert "| stream | 64 | - | - | - | - | exit 1: boom |" in md
    assert "| gpu | 64 | 12 | 2.50M | 0.0% | 0.7500 | ok |" in md
    assert [(r["gpu"], r["date"], r["samples_per_sec"]) for r in read_csv(tmp_path / "t.csv")] == [
        ("NVIDIA H200", "2026-11-30 08:00", ""), ("NVIDIA H200", "2026-11-30 08:00", "2500000.0")]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "metadata.json").write_text("{}")
    monkeypatch.setattr(lt, "run", lambda cfg, placement, args, work: rows[placement == "gpu"])
    monkeypatch.setattr(lt, "write", lambda rows, args, stem: [])
    assert lt.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path)]) == 1
    assert lt.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path), "--placements", "gpu"]) == 0
