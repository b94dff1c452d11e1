"""Audit tests of `dlrm.data.relayout` and `dlrm.data.mlperf_import`: tiny inputs whose stored result is
written out by hand, guarding silent corruptions the broader tests let through (see the audit report)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dlrm.data import mlperf_import as mi
from dlrm.data import preprocess as pp
from dlrm.data.relayout import relayout
from dlrm.data.schema import DENSE_COLUMNS, LABEL_COLUMN, NUM_SPARSE, read_metadata, slot_column
from dlrm.data.vocabulary import vocab_path

# -- mlperf_import: row groups cover every row of a file, exactly once ---------------------------------


def _write_day(root, i, n, sizes):
    """Day i: label r % 2, dense log(x + 3) of x = 10 * r + column, ids (r * 7 + f + j) % 50 in slot j of feature f."""
    r = np.arange(n)
    np.save(root / f"day_{i}_labels.npy", (r % 2).astype(np.int32)[:, None])
    counts = 10 * r[:, None] + np.arange(13)[None, :]
    np.save(root / f"day_{i}_dense.npy", np.log(counts + 3.0).astype(np.float32))
    np.savez(root / f"day_{i}_sparse_multi_hot.npz",
             **{str(f): ((r[:, None] * 7 + f + np.arange(s)[None, :]) % 50).astype(np.int32)
                for f, s in enumerate(sizes)})


def test_mlperf_import_row_groups_keep_every_row(tmp_path, monkeypatch):
    """Row groups of 4 rows (patched down from 131,072) in files of 10: day 0's 10 train rows are one file of row
    groups 4, 4, 2, holding rows 0..9 in order; day 1 (eval, 7 rows): validation rows 0..3 (ceil(7 / 2) = 4),
    test rows 4..6. Dense as counts: x = 10 * r + column exactly."""
    monkeypatch.setattr(mi, "ROW_GROUP_ROWS", 4)
    sizes = [3, 2] + [1] * (NUM_SPARSE - 2)
    src = tmp_path / "in"
    src.mkdir()
    _write_day(src, 0, 10, sizes)
    _write_day(src, 1, 7, sizes)
    meta = mi.import_mlperf(src, tmp_path / "ds", [0], 1, cards=[50] * NUM_SPARSE, rows_per_file=10, workers=1,
                            dense_format="counts", sparse_layout="slots")
    assert {s: (i.rows, i.positives) for s, i in meta.splits.items()} == {
        "train": (10, 5), "validation": (4, 2), "test": (3, 1)}
    want = {"train": range(0, 10), "validation": range(0, 4), "test": range(4, 7)}
    for split, rows in want.items():
        (rel,) = meta.splits[split].files
        f = pq.ParquetFile(tmp_path / "ds" / rel)
        t = f.read()
        r = np.asarray(rows)
        assert t.column(LABEL_COLUMN).to_pylist() == (r % 2).tolist()
        for j in (0, 5, 12):
            assert t.column(DENSE_COLUMNS[j]).to_pylist() == (10 * r + j).tolist()
        for j in range(3):
            assert t.column(slot_column(0, j)).to_pylist() == ((r * 7 + j) % 50).tolist()
        assert t.column(slot_column(1, 1)).to_pylist() == ((r * 7 + 2) % 50).tolist()
        assert t.column("SPARSE_25").to_pylist() == ((r * 7 + 25) % 50).tolist()
        if split == "train":
            assert [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)] == [4, 4, 2]


def test_mlperf_import_max_rows_per_day_above_a_days_rows_takes_that_day_whole(tmp_path):
    """--max-rows-per-day 8: day 0 (10 rows) gives train rows 0..7; day 1 (eval, 7 rows, fewer than 8) is taken
    whole: validation rows 0..3, test rows 4..6 (not 4..7: there is no row 7)."""
    sizes = [2] + [1] * (NUM_SPARSE - 1)
    src = tmp_path / "in"
    src.mkdir()
    _write_day(src, 0, 10, sizes)
    _write_day(src, 1, 7, sizes)
    meta = mi.import_mlperf(src, tmp_path / "ds", [0], 1, cards=[50] * NUM_SPARSE, workers=1, max_rows_per_day=8,
                            dense_format="counts")
    assert {s: (i.rows, i.positives) for s, i in meta.splits.items()} == {
        "train": (8, 4), "validation": (4, 2), "test": (3, 1)}
    for split, rows in {"train": range(8), "validation": range(4), "test": range(4, 7)}.items():
        t = pq.read_table(tmp_path / "ds" / meta.splits[split].files[0])
        assert t.num_rows == len(rows)
        assert t.column(DENSE_COLUMNS[1]).to_pylist() == [10 * r + 1 for r in rows]
    assert read_metadata(tmp_path / "ds").splits == meta.splits


# -- relayout: a vocabulary dataset stays a vocabulary dataset ------------------------------------------


def test_relayout_keeps_a_vocabulary_datasets_hashing_tables_and_values(tmp_path):
    """A multi-hot (C1 up to 2 values) vocabulary dataset of 14 lines, written in lists, relayouted to slots: the
    metadata keeps hashing "vocabulary", the cardinalities (vocabulary sizes + 1), the vocabulary files and
    extra; the slots hold each row's values then -2 (no value), missing C2 stays -1."""
    c1 = ["0000000a,0000000b", "0000000a", ""] * 4 + ["0000000c", "0000000a"]
    lines = ["\t".join(["1", str(k), *["1"] * 12, c, "" if k % 3 else "00000005", *["00000001"] * 24])
             for k, c in enumerate(c1)]
    raw = tmp_path / "in.tsv"
    raw.write_text("\n".join(lines) + "\n")
    sizes = [2] + [1] * (NUM_SPARSE - 1)
    lists = tmp_path / "lists"
    pp.preprocess([raw], lists, hashing="vocabulary", min_frequency=2, multi_hot_sizes=sizes, sparse_layout="lists",
                  progress=False, workers=1)
    before = read_metadata(lists)
    meta = relayout(lists, tmp_path / "slots", "slots", workers=1)
    after = read_metadata(tmp_path / "slots")
    # train = lines 0..11: C1 value 10 eight times, 11 four times; C2 value 5 four times
    assert np.load(vocab_path(tmp_path / "slots", 0)).tolist() == [10, 11]
    assert np.load(vocab_path(tmp_path / "slots", 1)).tolist() == [5]
    for m in (meta, after):
        assert m.hashing == "vocabulary" == before.hashing
        assert m.cardinalities[:3] == [3, 2, 2] == before.cardinalities[:3]
        assert m.extra["vocabulary_sizes"][:2] == [2, 1]
        assert m.sparse_layout == "slots" and m.multi_hot_sizes == sizes
        assert {s: (i.rows, i.positives) for s, i in m.splits.items()} == {
            "train": (12, 12), "test": (1, 1), "validation": (1, 1)}
    (rel,) = after.splits["train"].files
    t = pq.read_table(tmp_path / "slots" / rel)
    assert t.column(slot_column(0, 0)).to_pylist() == [10, 10, -2] * 4
    assert t.column(slot_column(0, 1)).to_pylist() == [11, -2, -2] * 4
    assert t.column("SPARSE_1").to_pylist() == [5, -1, -1] * 4
    assert t.column(DENSE_COLUMNS[0]).to_pylist() == list(range(12))


# -- mlperf_import: dense values must be finite ---------------------------------------------------------


@pytest.mark.parametrize("value,dense_format", [(np.inf, "float"), (-np.inf, "float"), (-np.inf, "counts"),
                                                (np.nan, "counts")])
def test_mlperf_import_refuses_an_infinite_or_nan_dense_value(tmp_path, value, dense_format):
    """day_0_dense.npy row 2, column 4 not finite: the import stops naming the file, row and column, and writes
    no --output (an infinite float would reach the model; -inf as counts would silently become 0)."""
    sizes = [1] * NUM_SPARSE
    src = tmp_path / "in"
    src.mkdir()
    _write_day(src, 0, 6, sizes)
    _write_day(src, 1, 4, sizes)
    dense = np.load(src / "day_0_dense.npy")
    dense[2, 4] = value
    np.save(src / "day_0_dense.npy", dense)
    with pytest.raises(mi.ImportInputError) as e:
        mi.import_mlperf(src, tmp_path / "ds", [0], 1, cards=[50] * NUM_SPARSE, workers=1, dense_format=dense_format)
    assert "day_0_dense.npy: row 2, column 4: " in e.value.format_message()
    assert not (tmp_path / "ds").exists()


def test_mlperf_import_reads_a_fortran_ordered_npz_member_by_its_header(tmp_path):
    """A member saved Fortran-ordered (np.savez keeps the order in the .npy header): the memory map must follow
    the header, or every value of the feature lands in another row and slot. Feature 0 (size 3) of day 0 (5 rows):
    row r holds [3r, 3r + 1, 3r + 2]."""
    sizes = [3] + [1] * (NUM_SPARSE - 1)
    src = tmp_path / "in"
    src.mkdir()
    _write_day(src, 0, 5, sizes)
    _write_day(src, 1, 2, sizes)
    members = dict(np.load(src / "day_0_sparse_multi_hot.npz"))
    members["0"] = np.asfortranarray(np.arange(15, dtype=np.int32).reshape(5, 3))
    assert members["0"].flags.f_contiguous and not members["0"].flags.c_contiguous
    np.savez(src / "day_0_sparse_multi_hot.npz", **members)
    meta = mi.import_mlperf(src, tmp_path / "ds", [0], 1, cards=[50] * NUM_SPARSE, workers=1, sparse_layout="slots")
    t = pq.read_table(tmp_path / "ds" / meta.splits["train"].files[0])
    assert [t.column(slot_column(0, j)).to_pylist() for j in range(3)] == [
        [0, 3, 6, 9, 12], [1, 4, 7, 10, 13], [2, 5, 8, 11, 14]]
