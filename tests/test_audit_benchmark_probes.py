"""Audit (by mutation) of the probe scripts' CPU-reachable logic: sparse_layout_decode.py (the whole CPU benchmark:
ids, tables, writer options, units, best-of, decode, files), and the arithmetic, parsing and files of the GPU probes
(cross_tma, wgrad_tma, gemm_layout, fp8_dense, cross_ws, cross_ws_head, cublaslt_drelu) with their kernels and
clocks replaced by fakes: exact values computed by hand or in float64, no real timings."""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import io
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_audit_benchmark_numbers import fake_event_class
from tests.test_benchmark_scripts import load_script


def read_csv(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def fake_time(values: list[float]):
    """A stand-in for the `time` module whose perf_counter returns `values` in order."""
    return types.SimpleNamespace(perf_counter=lambda: values.pop(0))


# ---- sparse_layout_decode.py -----------------------------------------------------------------------------------------

MLPERF_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
MLPERF_CARDS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
                155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
MODE_LABELS = {"default": "pyarrow's default (1 MB dictionary pages)",
               "writers'": "64 KB dictionary pages (the writers')", "dense": "no dictionary on sparse columns"}


def feature_ids(table, f: int) -> np.ndarray:
    """Feature f's ids, int64 [rows, size], read from either layout's columns by name."""
    size = MLPERF_SIZES[f]
    names = table.column_names
    if size == 1:
        return table.column(f"SPARSE_{f}").to_numpy()[:, None]
    if f"SPARSE_{f}" in names:  # "lists": one list<int64> column
        return np.array(table.column(f"SPARSE_{f}").to_pylist(), dtype=np.int64)
    return np.stack([table.column(f"SPARSE_{f}_{j}").to_numpy() for j in range(size)], axis=1)


def test_sparse_layout_decode_draws_uniform_ids_over_the_whole_table_and_zipf_ids_heavy_headed():
    """Uniform ids cover every id of a small table (none left out); Zipf ids are below the table size, rank 0 (the
    most frequent id) is id 0 and rank 1 (the next) is scattered to 2654435761 mod the table size, each rank as
    frequent as the power law truncated to the table says."""
    sld = load_script("sparse_layout_decode")
    ids = sld.draw_ids(np.random.default_rng(0), 5, (4000, 3), "uniform")
    assert ids.shape == (4000, 3) and set(np.unique(ids)) == {0, 1, 2, 3, 4}
    card = 1_000_003
    z = sld.draw_ids(np.random.default_rng(1), card, (20000,), "zipf")
    assert z.min() >= 0 and z.max() < card
    values, counts = np.unique(z, return_counts=True)
    top = values[np.argsort(-counts)[:2]]
    assert list(top) == [0, 2654435761 % card]
    p0 = 1 / (np.arange(1, card + 1, dtype=np.float64) ** -1.1).sum()  # ~0.124: far from uniform (1e-6 an id)
    assert abs(counts[values == 0][0] / z.size - p0) < 0.01
    # the law truncated to the table: rank r < 7 with probability (r + 1)^-1.1 / sum; once, ranks past the table
    # were clamped to its last rank, which took the whole tail (78% of the draws here, 16% on a 40M-row table)
    small = sld.draw_ids(np.random.default_rng(2), 7, (20000,), "zipf")
    law = np.arange(1, 8) ** -1.1
    expected = np.zeros(7)
    expected[(np.arange(7) * 2654435761) % 7] = law / law.sum()
    np.testing.assert_allclose(np.bincount(small, minlength=7) / small.size, expected, atol=0.015)


def test_sparse_layout_decode_mlperf_table_has_mlperf_features_in_both_layouts():
    """Both layouts hold the same rows: labels 0 and 1, 13 int32 dense columns, each feature's MLPerf multi-hot size
    of ids below its table size (uniform by default: the 40M-row tables' ids all but distinct)."""
    import pyarrow as pa

    sld = load_script("sparse_layout_decode")
    lists, slots = sld.mlperf_table(256, "lists"), sld.mlperf_table(256, "slots")
    assert lists.num_rows == slots.num_rows == 256
    assert set(lists.column("label").to_pylist()) == {0, 1}
    for j in range(13):
        assert lists.schema.field(f"DENSE_{j}").type == pa.int32()
        assert lists.column(f"DENSE_{j}").equals(slots.column(f"DENSE_{j}"))
    assert "SPARSE_20" in lists.column_names and "SPARSE_20_99" in slots.column_names
    for f, (size, card) in enumerate(zip(MLPERF_SIZES, MLPERF_CARDS)):
        a, b = feature_ids(lists, f), feature_ids(slots, f)
        assert a.shape == (256, size) and np.array_equal(a, b), f
        assert a.min() >= 0 and a.max() < card, (f, card, a.max())
        if card <= 4:  # 256 x size uniform draws hit every id of a tiny table
            assert set(np.unique(a)) == set(range(card)), f
    assert len(np.unique(feature_ids(lists, 20))) > 0.99 * 256 * 100  # uniform over 40M ids, not Zipf


def test_sparse_layout_decode_measure_writes_one_row_group_decodes_it_and_reports_the_best_us_a_row(monkeypatch):
    """measure(): the row group written once with the codec and the mode's dictionaries, read back equal to the table
    (pyarrow), copied into the arena column by column; MB = bytes / 1e6; read and read + arena each the best of the
    repeats (fake clock), in microseconds a row."""
    import pyarrow.parquet as pq

    from dlrm.data import host_arena

    sld = load_script("sparse_layout_decode")
    table = sld.mlperf_table(256, "slots")
    written, decoded, arenas = [], [], []
    real_write, real_copy = pq.write_table, host_arena._write_columns

    def write_table(t, where, **kw):
        real_write(t, where, **kw)
        written.append((kw, where.getvalue()))

    def write_columns(t, out, at, sizes, layout):
        real_copy(t, out, at, sizes, layout)
        decoded.append(t)
        arenas.append(tuple(a.copy() for a in out))

    monkeypatch.setattr(pq, "write_table", write_table)
    monkeypatch.setattr(host_arena, "_write_columns", write_columns)
    # three repeats (t0, t1 read, t2 arena): reads 10, 4, 8 ms; read + arena 30, 40, 12 ms
    monkeypatch.setattr(sld, "time", fake_time([0.0, 0.010, 0.030, 1.0, 1.004, 1.040, 2.0, 2.008, 2.012]))
    r = sld.measure(table, "lz4", "slots", "writers'", 3)
    assert len(written) == 1 and len(decoded) == 3
    kw, data = written[0]
    assert kw["compression"] == "lz4" and kw["row_group_size"] == 256 and kw["dictionary_pagesize_limit"] == 65536
    assert r == {"codec": "lz4", "layout": "slots", "dictionary": "writers'", "rows": 256,
                 "mbytes": len(data) / 1e6, "read_us_per_row": pytest.approx(0.004 / 256 * 1e6, rel=1e-9),
                 "total_us_per_row": pytest.approx(0.012 / 256 * 1e6, rel=1e-9)}
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    assert meta.num_row_groups == 1 and meta.row_group(0).num_rows == 256
    assert meta.row_group(0).column(0).compression == "LZ4"
    assert decoded[0].equals(table)
    label, dense, sparse = arenas[0]
    assert np.array_equal(label, table.column("label").to_numpy())
    assert dense.dtype == np.int32 and np.array_equal(dense, np.stack([table.column(f"DENSE_{j}").to_numpy()
                                                                        for j in range(13)]))
    expected = np.concatenate([feature_ids(table, f) for f in range(26)], axis=1).T  # slot rows, column-major
    assert sparse.shape == (214, 256) and np.array_equal(sparse, expected)


def test_sparse_layout_decode_writer_modes_put_dictionaries_where_they_say(monkeypatch):
    """"default": pyarrow's dictionaries on every column; "dense": none on the sparse (list) columns, still on the
    label and dense ones; codec "none" writes uncompressed."""
    import pyarrow.parquet as pq

    sld = load_script("sparse_layout_decode")
    table = sld.mlperf_table(64, "lists")
    written = []
    real_write = pq.write_table

    def write_table(t, where, **kw):
        real_write(t, where, **kw)
        written.append((kw, where.getvalue()))

    monkeypatch.setattr(pq, "write_table", write_table)
    for mode in ("default", "dense"):
        r = sld.measure(table, "none", "lists", mode, 1)
        assert r["rows"] == 64 and r["mbytes"] > 0 and 0 < r["read_us_per_row"] <= r["total_us_per_row"]
    for (kw, data), mode in zip(written, ("default", "dense")):
        assert kw["compression"] is None
        group = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
        chunks = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
        assert {c.compression for c in chunks.values()} == {"UNCOMPRESSED"}
        sparse = [c.has_dictionary_page for p, c in chunks.items() if p.startswith("SPARSE")]
        assert len(sparse) == 26 and all(sparse) == (mode == "default") and any(sparse) == (mode == "default"), mode
        assert chunks["label"].has_dictionary_page and chunks["DENSE_0"].has_dictionary_page


def test_sparse_layout_decode_main_writes_every_codec_layout_and_mode(tmp_path, monkeypatch):
    """main() on 256 rows: the tables drawn as asked (--ids), per codec (spaces stripped) the lists layout with two
    dictionary modes and the slots layout with three, and <name>.csv / .md / .png (the default name from the host)
    under a folder it creates; the Markdown rows are the CSV's values."""
    import pyarrow as pa

    sld = load_script("sparse_layout_decode")
    drawn = []
    real_table = sld.mlperf_table

    def mlperf_table(rows, layout, ids="uniform", seed=0):
        drawn.append((rows, layout, ids))
        return real_table(rows, layout, ids, seed)

    monkeypatch.setattr(sld, "mlperf_table", mlperf_table)
    monkeypatch.setattr(sld.platform, "node", lambda: "box")
    out = tmp_path / "a" / "b"
    argv = ["--rows", "256", "--codecs", "lz4, none", "--ids", "zipf", "--repeats", "1", "--out", str(out)]
    assert sld.main(argv) == 0
    assert drawn == [(256, "lists", "zipf"), (256, "slots", "zipf")]
    keys, rows = read_csv(out / "sparse_layout_decode_box.csv")
    assert keys == ["codec", "layout", "dictionary", "rows", "mbytes", "read_us_per_row", "total_us_per_row",
                    "cpu", "cpu_count", "pyarrow", "numpy", "python", "host", "date", "ids"]
    cases = [(c, lay, d) for c in ("lz4", "none") for lay, ds in (("lists", ("default", "dense")),
                                                                  ("slots", ("default", "writers'", "dense")))
             for d in ds]
    assert [(r["codec"], r["layout"], r["dictionary"]) for r in rows] == cases
    for r in rows:
        assert r["rows"] == "256" and r["ids"] == "zipf" and r["host"] == "box" and r["pyarrow"] == pa.__version__
        assert 0 < float(r["mbytes"]) < 10 and 0 < float(r["read_us_per_row"]) <= float(r["total_us_per_row"])
    mb = {(r["codec"], r["layout"], r["dictionary"]): float(r["mbytes"]) for r in rows}
    assert mb[("none", "lists", "dense")] > mb[("lz4", "lists", "dense")]  # lz4 compresses what "none" leaves
    md = (out / "sparse_layout_decode_box.md").read_text()
    assert "--rows 256 --codecs lz4, none --ids zipf` (best of 1); 256 rows of 214 ids (zipf)" in md
    assert "| codec | layout | dictionaries | MB | read us/row | read + arena us/row |" in md
    for r in rows:
        line = (f"| {r['codec']} | {r['layout']} | {MODE_LABELS[r['dictionary']]} | {float(r['mbytes']):.1f} | "
                f"{float(r['read_us_per_row']):.2f} | {float(r['total_us_per_row']):.2f} |")
        assert line in md.splitlines(), line
    assert (out / "sparse_layout_decode_box.png").stat().st_size > 0


@pytest.mark.parametrize("flag", ["--repeats", "--rows"])
def test_sparse_layout_decode_refuses_zero_repeats_or_rows(tmp_path, capsys, flag):
    """No read (its best time would be inf in the CSV) or no row (us a row divides by it): a usage error, nothing
    written."""
    sld = load_script("sparse_layout_decode")
    with pytest.raises(SystemExit) as exc:
        sld.main([flag, "0", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- cross_tma_probe.py ----------------------------------------------------------------------------------------------


def test_cross_tma_probe_parses_each_variant_flag_on_its_own():
    ctp = load_script("cross_tma_probe")
    base = {"bm": 64, "bn": 128, "bk": 32, "stages": 3, "warps": 4}
    assert ctp.parse_variant("64x128x32s3w4") == dict(base, flatten=False, ws=False, epi_tma=True)
    assert ctp.parse_variant("64x128x32s3w4-ws") == dict(base, flatten=False, ws=True, epi_tma=True)
    assert ctp.parse_variant("64x128x32s3w4-flat") == dict(base, flatten=True, ws=False, epi_tma=True)
    assert ctp.parse_variant("64x128x32s3w4-ptr") == dict(base, flatten=False, ws=False, epi_tma=False)


def test_cross_tma_probe_rows_bytes_flops_errors_and_failures(tmp_path, monkeypatch):
    """Each row's launch fields, its error against float64 (the saved pre-activation included), GB/s of u, W and the
    three (four with pre) [B, N] streams, TFLOP/s of 2 B N r, a variant that raises as an error row; the cuBLAS row
    timed without the check's extra ``y + b``. Kernels replaced by float64 fakes, the timer by a fixed 0.5 ms."""
    ctp = load_script("cross_tma_probe")
    monkeypatch.setattr(ctp.torch.cuda, "is_available", lambda: False)  # the CPU path, on a GPU machine too
    launches, timed = [], []

    def exact(x0, x, u, w, b, store_pre, pre_offset=0.0):
        pre = u.double() @ w.double().t() + b.double()
        out = (x0.double() * pre + x.double()).to(x0.dtype)
        return out, ((pre + pre_offset).to(x0.dtype) if store_pre else None)

    def persistent_forward(x0, x, u, w, b, store_pre, **kw):
        launches.append((kw, store_pre))
        if kw["bm"] == 8:
            raise RuntimeError("no such launch")
        return exact(x0, x, u, w, b, store_pre, 0.25 if kw["bm"] == 16 else 0.0)

    def timer(fn):
        timed.append(fn())
        return 0.5

    monkeypatch.setattr(ctp, "persistent_forward", persistent_forward)
    monkeypatch.setattr(ctp, "cross_forward", lambda x0, x, u, w, b, store_pre: exact(x0, x, u, w, b, store_pre))
    monkeypatch.setattr(ctp, "wall_ms", timer)
    variants = "32x16x16s2w4-flat,16x16x16s2w4-ws-ptr,8x16x16s2w4"
    assert ctp.main(["--out", str(tmp_path), "--batch", "64", "--width", "48", "--rank", "16", "--variants", variants,
                     "--calls", "1", "--windows", "1"]) == 0
    B, N, r, el = 64, 48, 16, 4  # fp32 on the CPU
    # each launch checked, then timed (twice a row); a launch that raises is not timed
    assert [(kw["bm"], kw["flatten"], kw["ws"], kw["epi_tma"], s) for kw, s in launches] == [
        *[(32, True, False, True, True)] * 2, *[(32, True, False, True, False)] * 2,
        *[(16, False, True, False, True)] * 2, *[(16, False, True, False, False)] * 2,
        (8, False, False, True, True), (8, False, False, True, False)]
    keys, rows = read_csv(tmp_path / "cross_tma_probe.csv")
    assert [(x["tile"], x["flatten"], x["ws"], x["epi"], x["store_pre"], x["status"].split(":")[0]) for x in rows] == [
        ("", "", "", "", "True", "ok"), ("picked", "", "", "", "True", "ok"), ("picked", "", "", "", "False", "ok"),
        ("32x16x16s2w4-flat", "True", "False", "tma", "True", "ok"),
        ("32x16x16s2w4-flat", "True", "False", "tma", "False", "ok"),
        ("16x16x16s2w4-ws-ptr", "False", "True", "ptr", "True", "ok"),
        ("16x16x16s2w4-ws-ptr", "False", "True", "ptr", "False", "ok"),
        ("8x16x16s2w4", "False", "False", "tma", "True", "error"),
        ("8x16x16s2w4", "False", "False", "tma", "False", "error")]
    assert rows[-1]["status"] == "error: RuntimeError: no such launch" and rows[-1]["ms"] == ""
    for x in rows[:7]:
        streams = 4 if x["store_pre"] == "True" else 3
        assert float(x["ms"]) == 0.5
        assert float(x["gbps"]) == pytest.approx((B * r + N * r + streams * B * N) * el / 0.5 / 1e6, rel=1e-12)
        assert float(x["tflops"]) == pytest.approx(2 * B * N * r / 0.5 / 1e9, rel=1e-12)
    errs = [float(x["max_abs_err"]) for x in rows[:7]]
    assert errs[5] == pytest.approx(0.25, abs=1e-5)  # the wrong saved pre-activation is counted
    assert max(errs[:5] + errs[6:]) < 1e-5
    # the cuBLAS row is timed as the step runs it: y = u W^T saved, without the check's + b
    bias = timed[1][1].double() - timed[0][1].double()  # pre - y: b in every row
    assert bias.shape == (B, N) and bias.abs().max() > 0.1 and (bias - bias[0]).abs().max() < 1e-4
    md = (tmp_path / "cross_tma_probe.md").read_text().splitlines()
    sep = next(line for line in md if line.startswith("| ---"))
    assert sep.count("---") == len(keys) - 5  # the 11 KEYS (keys also holds the 5 environment columns)
    assert any(line.startswith("| persistent TMA | 32x16x16s2w4-flat | True | False | tma | True | 0.5 | 0.1126 |")
               for line in md), md


# ---- wgrad_tma_probe.py ----------------------------------------------------------------------------------------------


def test_wgrad_tma_probe_bytes_stages_errors_and_layer_sums(tmp_path, monkeypatch):
    """GB/s of g (twice for a masked layer: g and y) and x at the smoke batch 67, the TMA rows at the smoke's 2
    stages with TMA switched on, both dW's and db's errors counted, and each kernel's sum over the layers.
    `linear_wgrad` replaced by a float64 fake (its TMA path's db off by 0.125), the timer by fixed times."""
    wtp = load_script("wgrad_tma_probe")
    monkeypatch.setattr(wtp.torch.cuda, "is_available", lambda: False)  # the CPU path, on a GPU machine too
    seen = []

    def linear_wgrad(g, x, y, weight_dtype, bias_dtype):
        seen.append((wtp.wg.TMA_OPERANDS, wtp.wg.TMA_STAGES, tuple(g.shape)))
        gm = g.double() if y is None else torch.where(y > 0, g, torch.zeros_like(g)).double()
        return gm.t() @ x.double(), gm.sum(0) + (0.125 if wtp.wg.TMA_OPERANDS else 0.0)

    times = [0.25, 0.125, 0.5, 0.375]  # a pointer, a TMA, b pointer, b TMA
    monkeypatch.setattr(wtp, "linear_wgrad", linear_wgrad)
    monkeypatch.setattr(wtp, "wall_ms", lambda fn: times.pop(0))
    assert wtp.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert seen == [(False, 3, (67, 32)), (True, 2, (67, 32)), (False, 3, (67, 16)), (True, 2, (67, 16))]
    _, rows = read_csv(tmp_path / "wgrad_tma_probe.csv")
    assert [(x["layer"], x["impl"], x["stages"]) for x in rows] == [
        ("a", "pointer loads", ""), ("a", "TMA", "2"), ("b", "pointer loads", ""), ("b", "TMA", "2")]
    nbytes = {"a": (67 * 32 * 2 + 67 * 13) * 4, "b": (67 * 16 + 67 * 32) * 4}
    for x, ms in zip(rows, [0.25, 0.125, 0.5, 0.375]):
        assert float(x["ms"]) == ms and float(x["gbps"]) == pytest.approx(nbytes[x["layer"]] / ms / 1e6, rel=1e-12)
        err = float(x["max_abs_err"])
        assert (err == pytest.approx(0.125, abs=1e-9)) if x["impl"] == "TMA" else err < 1e-9, x
    md = (tmp_path / "wgrad_tma_probe.md").read_text()
    assert "Sum over the layers, pointer loads: 0.7500 ms" in md and "Sum over the layers, TMA s2: 0.5000 ms" in md


# ---- gemm_layout_probe.py --------------------------------------------------------------------------------------------


def test_gemm_layout_probe_step_gemms_are_the_three_passes_of_each_layer():
    """Y = X W^T [B, n] (K = k, A row- and B column-major as eager hands them), dX = dY W [B, k] (K = n, both
    row-major), dW = dY^T X [n, k] (K = B, A column-major); cross V (width -> rank), cross W (rank -> width), the
    top layers but the 1-wide one."""
    glp = load_script("gemm_layout_probe")
    got = glp.step_gemms(64, 48, 16, [32, 16, 1])
    expected = []
    for name, k, n in [("cross V", 48, 16), ("cross W", 16, 48), ("top.0", 48, 32), ("top.1", 32, 16)]:
        expected += [(name, "fwd", 64, n, k, "row,col"), (name, "dgrad", 64, k, n, "row,row"),
                     (name, "wgrad", n, k, 64, "col,row")]
    assert got == expected


def test_gemm_layout_probe_layouts_are_the_strides_they_name():
    glp = load_script("gemm_layout_probe")
    t = torch.arange(12.0).reshape(3, 4)
    assert glp.in_layout(t, "row").stride() == (4, 1)
    col = glp.in_layout(t, "col")
    assert col.stride() == (1, 3) and torch.equal(col, t)
    rows = glp.layout_rows(("g", "fwd", 5, 3, 4, "row,col"), None, torch.device("cpu"), torch.float32, lambda f: 1.0)
    assert [(x["a"], x["b"], x["c"]) for x in rows] == [(a, b, c) for a in ("row", "col") for b in ("row", "col")
                                                        for c in ("row", "col")]
    assert [(x["a"], x["b"], x["c"]) for x in rows if x["as_run"]] == [("row", "col", "row")]
    assert all(x["status"] == "ok" and x["max_rel_err"] < 1e-6 and x["impl"] == "fp32" for x in rows)


def gemm_rows() -> list[dict]:
    def row(pas, impl, a, b, c, ms, as_run=False, M=65536, N=512, K=3456):
        r = {"gemm": "cross V", "pass": pas, "M": M, "N": N, "K": K, "impl": impl, "a": a, "b": b, "c": c,
             "as_run": as_run}
        return r if ms is None else {**r, "ms": ms}

    return [row("fwd", "fp32", "row", "col", "row", 0.5, True), row("fwd", "fp32", "col", "row", "col", 0.25),
            row("fwd", "fp32", "row", "row", "row", 1.0), row("fwd", "fp32", "col", "col", "row", None),
            row("fwd", "fp8 tensorwise", "row", "col", "row", 0.2),
            row("fwd", "fp8 rowwise", "row", "col", "row", 0.125),
            row("fwd", "rowwise quantize A (Inductor)", "row", "col", "row", 0.07),
            row("dgrad", "fp32", "row", "row", "row", 2.0, True, N=3456, K=512),
            row("dgrad", "fp32", "col", "col", "col", 1.0, N=3456, K=512)]


def test_gemm_layout_probe_finish_gives_tflops_and_speed_against_the_as_run_layout_of_the_same_pass():
    glp = load_script("gemm_layout_probe")
    rows = gemm_rows()
    glp.finish(rows)
    flops = 2 * 65536 * 512 * 3456
    for r in rows:
        if "ms" not in r:
            assert "tflops" not in r and "vs_as_run" not in r
            continue
        if r["impl"].startswith("rowwise quantize"):
            assert "tflops" not in r
        else:
            assert r["tflops"] == pytest.approx(flops / r["ms"] / 1e9, rel=1e-12)
        base = 0.5 if r["pass"] == "fwd" else 2.0
        assert r["vs_as_run"] == pytest.approx(base / r["ms"], rel=1e-12)
    assert rows[1]["vs_as_run"] == 2.0 and rows[8]["vs_as_run"] == 2.0


def test_gemm_layout_probe_summary_names_the_fastest_layout_and_the_fp8_rowwise_time():
    glp = load_script("gemm_layout_probe")
    rows = gemm_rows()
    glp.finish(rows)
    lines = glp.summary(rows)
    def t(ms):
        return f"{2 * 65536 * 512 * 3456 / ms / 1e9:.0f}"

    assert lines[2] == (f"| cross V | fwd | 65536 x 512 x 3456 | 0.500 ({t(0.5)}) | col,row,col | 0.250 ({t(0.25)}) "
                        "| 0.125 | 0.070 |")
    assert lines[3] == (f"| cross V | dgrad | 65536 x 3456 x 512 | 2.000 ({t(2.0)}) | col,col,col | 1.000 ({t(1.0)}) "
                        "|  |  |")
    assert len(lines) == 4


# ---- fp8_dense_probe.py ----------------------------------------------------------------------------------------------


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (torch 2.11's takes per-tensor scales only: an
    internal assert; the GPU image has 2.11, CI the newest torch)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


needs_cpu_rowwise_fp8 = pytest.mark.skipif(not _cpu_rowwise_scaled_mm(),
                                           reason="this torch's CPU _scaled_mm takes per-tensor scales only")


def fp8_spy(monkeypatch, fdp, calls: list, real=None):
    def spy(x, w, b=None):
        calls.append(tuple(w.shape))
        return (real or F.linear)(x, w, b)

    monkeypatch.setattr(fdp, "fp8_rowwise_linear", spy)


def test_fp8_dense_probe_routes_only_the_chosen_gemms_through_fp8(monkeypatch):
    """fp8_cross: each cross layer's V and W GEMMs; fp8_top: the top MLP's layers but the 1-wide logit layer."""
    fdp = load_script("fp8_dense_probe")
    calls = []
    fp8_spy(monkeypatch, fdp, calls)
    model = fdp.DensePart(16, 2, 4, [16, 8, 1])
    x0 = torch.randn(3, 16)
    for flags, expected in [((True, False), [(4, 16), (16, 4)] * 2), ((False, True), [(16, 16), (8, 16)]),
                            ((False, False), []), ((True, True), [(4, 16), (16, 4)] * 2 + [(16, 16), (8, 16)])]:
        calls.clear()
        model.fp8_cross, model.fp8_top = flags
        assert model(x0).shape == (3,)
        assert calls == expected, flags


def test_fp8_dense_probe_dense_part_is_the_cross_network_then_the_relu_mlp():
    """In float64 with no FP8: `LowRankCrossNet`'s own forward (non-zero biases), then ReLU layers, then the logit
    layer without a ReLU, squeezed to [B]."""
    fdp = load_script("fp8_dense_probe")
    torch.manual_seed(0)
    model = fdp.DensePart(12, 2, 3, [8, 1]).double()
    with torch.no_grad():
        for b in model.cross.bias:
            b.normal_()
    x0 = torch.randn(5, 12, dtype=torch.float64)
    with torch.no_grad():
        model.top[1].bias -= 0.25  # logits of both signs
    h = torch.relu(model.cross(x0) @ model.top[0].weight.t() + model.top[0].bias)
    expected = (h @ model.top[1].weight.t() + model.top[1].bias).squeeze(-1)
    got = model(x0)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert (expected < 0).any()  # a ReLU on the logits would show


@needs_cpu_rowwise_fp8
def test_fp8_dense_probe_errors_are_relative_to_float64_eager_without_fp8():
    """errors(): ||model - ref|| / ||ref|| for the logits, x0's gradient and V_0's gradient, the model under bf16
    autocast (FP8 cross layers here), the reference a float64 copy with FP8 off; the model's gradients cleared."""
    fdp = load_script("fp8_dense_probe")
    torch.manual_seed(0)
    base = fdp.DensePart(16, 1, 4, [16, 1])
    with torch.no_grad():
        for b in base.cross.bias:
            b.normal_()
    x0, glog = torch.randn(8, 16), torch.randn(8)

    ref = copy.deepcopy(base).double()
    xr = x0.double().requires_grad_()
    out_r = ref(xr)
    out_r.backward(glog.double())
    model = copy.deepcopy(base)
    model.fp8_cross = True
    xm = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(xm)
    out.backward(glog.to(out.dtype))
    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())

    expected = {"err_logits": rel(out, out_r), "err_dx0": rel(xm.grad, xr.grad),
                "err_dV0": rel(model.cross.V_kernels[0].grad, ref.cross.V_kernels[0].grad)}

    checked = copy.deepcopy(base)
    checked.fp8_cross = True
    got = fdp.errors(checked, x0, glog, torch.device("cpu"))
    assert got == pytest.approx(expected, rel=1e-9, abs=0)
    assert 0 < got["err_dV0"] < 1 and got["err_dV0"] != pytest.approx(
        rel(model.cross.W_kernels[0].grad, ref.cross.W_kernels[0].grad), rel=1e-6)
    assert all(p.grad is None for p in checked.parameters())


@needs_cpu_rowwise_fp8
def test_fp8_dense_probe_main_times_each_variant_against_bf16(tmp_path, monkeypatch):
    """On the CPU, ms = one step's perf_counter difference x 1e3 (fake clock), vs_bf16 = bf16's ms / the variant's;
    "fp8 top" runs only the top MLP's GEMMs in FP8; an empty --variants is refused."""
    from kernels.fp8_linear import fp8_rowwise_linear

    fdp = load_script("fp8_dense_probe")
    monkeypatch.setattr(fdp.torch.cuda, "is_available", lambda: False)  # the CPU path, on a GPU machine too
    calls = []
    fp8_spy(monkeypatch, fdp, calls, real=fp8_rowwise_linear)
    monkeypatch.setattr(fdp, "time", fake_time([10.0, 10.0078125, 20.0, 20.001953125]))
    assert fdp.main(["--out", str(tmp_path), "--batch", "16", "--check-batch", "8", "--width", "16", "--rank", "4",
                     "--layers", "1", "--top", "16,1", "--variants", "bf16,fp8 top"]) == 0
    assert calls and set(calls) == {(16, 16)}  # the top MLP's first layer only: no cross GEMM, no logit layer
    _, rows = read_csv(tmp_path / "fp8_dense_probe.csv")
    assert [(r["variant"], r["batch"], r["ms"], r["vs_bf16"], r["status"]) for r in rows] == [
        ("bf16", "16", "7.8125", "1.0", "ok"), ("fp8 top", "16", "1.953125", "4.0", "ok")]
    md = (tmp_path / "fp8_dense_probe.md").read_text()
    assert "| fp8 top | 1.953 | 4.000 | " in md and "| bf16 | 7.812 | 1.000 | " in md
    with pytest.raises(SystemExit):
        fdp.main(["--out", str(tmp_path), "--variants", ","])


# ---- cross_ws_probe.py / cross_ws_head_probe.py ----------------------------------------------------------------------


def test_cross_ws_probe_parse_config_sets_every_field():
    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_probe")
    c = probe.parse_config("coop:64x128x32s3u16q2m4r144e8")
    assert (c.schedule, c.bm, c.bn, c.bk, c.stages, c.sub, c.epi_stages, c.mma_warps, c.mma_regs, c.epi_warps) == (
        "coop", 64, 128, 32, 3, 16, 2, 4, 144, 8)
    p = probe.parse_config("64x128x32s3r200")
    assert (p.schedule, p.bm, p.bn, p.bk, p.stages, p.consumer_regs) == ("pingpong", 64, 128, 32, 3, 200)


def test_cross_ws_head_probe_parse_config_keeps_the_tile_order():
    pytest.importorskip("kernels.cross_ws_head", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_head_probe")
    c = probe.parse_config("64x128x32s3e2")
    assert (c.schedule, c.bm, c.bn, c.bk, c.stages, c.epi_stages) == ("coop", 64, 128, 32, 3, 2)


# ---- cublaslt_drelu_probe.py -----------------------------------------------------------------------------------------


def test_cublaslt_drelu_probe_times_a_loop_when_the_graph_capture_fails(monkeypatch):
    """timed(): where capture raises, `warmup` untimed calls, then `windows` event-timed windows of `calls` calls,
    ms a call, the median window, labelled "loop" (fake CUDA events on a fake clock)."""
    probe = load_script("cublaslt_drelu_probe")
    clock = [0.0]
    durations = [100.0, 1.0, 3.0, 0.5, 0.5, 4.0, 4.0]  # the warmup call, then three windows of two calls
    calls = []

    def step():
        calls.append(1)
        clock[0] += durations.pop(0)

    def no_graph(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(probe, "graph_replay_ms", no_graph)
    monkeypatch.setattr(probe.torch.cuda, "Event", fake_event_class(clock))
    monkeypatch.setattr(probe.torch.cuda, "synchronize", lambda *a: None)
    ms, how = probe.timed(step, argparse.Namespace(calls=2, windows=3, warmup=1))
    assert (ms, how) == (2.0, "loop") and len(calls) == 7  # windows 2.0, 0.5, 4.0 ms a call: median 2.0


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("nvmath") is not None,
                    reason="checks the refusal where CUDA is faked and nvmath-python is absent")
def test_cublaslt_drelu_probe_refuses_without_nvmath(tmp_path, monkeypatch, capsys):
    probe = load_script("cublaslt_drelu_probe")
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: True)
    assert probe.main(["--out", str(tmp_path)]) == 2
    assert "needs nvmath-python" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cublaslt_drelu_probe_main_tables_each_layer_and_the_totals(tmp_path, monkeypatch):
    """main() with the GPU parts faked: the top and bottom MLPs' rows (TOP / BOTTOM shapes) in the CSV with the
    environment and nvmath's version, each row and the summed 'all' row in the Markdown table."""
    probe = load_script("cublaslt_drelu_probe")
    asked = []

    def row(part, layer, shipped, epi):
        return {"part": part, "layer": layer, "shape": "[8,16]x[16,4]", "shipped_ms": shipped, "epilogue_ms": epi,
                "saved_ms": shipped - epi, "timing": "graph/loop", "max_diff": 0.001, "status": "ok"}

    def mlp_rows(name, k0, widths, batch, ep, args, gen):
        asked.append((name, k0, widths, batch))
        if name == "top":
            return [row("top forward", 1, 1.5, 1.25), row("top backward", 2, 0.75, 1.0)]
        return [row("bottom forward", 1, 0.5, 0.125)]

    class Generator:
        def __init__(self, device=None):
            pass

        def manual_seed(self, seed):
            return self

    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "Epilogues", lambda: object())
    monkeypatch.setattr(probe, "mlp_rows", mlp_rows)
    monkeypatch.setattr(probe, "environment", lambda device: {"device": "GPU X"})
    monkeypatch.setattr(probe.torch, "Generator", Generator)
    monkeypatch.setitem(sys.modules, "nvmath", types.SimpleNamespace(__version__="0.9"))
    assert probe.main(["--out", str(tmp_path), "--batch", "8"]) == 0
    assert asked == [("top", 3456, [1024, 1024, 512, 256], 8), ("bottom", 16, [512, 256, 128], 8)]
    keys, rows = read_csv(tmp_path / "cublaslt_drelu_probe.csv")
    assert keys == [*probe.KEYS, "device", "nvmath"] and len(probe.KEYS) == 9
    assert [(r["part"], r["saved_ms"], r["timing"], r["status"], r["nvmath"]) for r in rows] == [
        ("top forward", "0.25", "graph/loop", "ok", "0.9"), ("top backward", "-0.25", "graph/loop", "ok", "0.9"),
        ("bottom forward", "0.375", "graph/loop", "ok", "0.9")]
    md = (tmp_path / "cublaslt_drelu_probe.md").read_text().splitlines()
    assert "| top backward | 2 | [8,16]x[16,4] | 0.7500 | 1.0000 | -0.2500 | graph/loop | 0.001 | ok |" in md
    assert "| all |  |  | 2.7500 | 2.3750 | +0.3750 |  |  |  |" in md
