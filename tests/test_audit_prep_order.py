"""Audit tests of the preprocessor's stop-on-first-bad-line order and of `dlrm.data.relayout`'s round trips.

Each test failed on the code before its fix (the failure is quoted in its docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.data import preprocess as pp
from dlrm.data.relayout import relayout
from dlrm.data.schema import (
    PAD_SPARSE,
    Metadata,
    SplitInfo,
    arrow_schema,
    slot_column,
    write_metadata,
)


def tsv_line(label: str, dense0: str, c1: str = "0000abcd") -> str:
    """A 40-field TSV line: I1 as given, I2..I13 "1"; C1 as given, C2..C26 "00000001"."""
    return "\t".join([label, dense0, *["1"] * 12, c1, *["00000001"] * 25])


def write_lines(path: Path, n: int, bad: dict[int, str], c1: str = "0000abcd") -> Path:
    """`n` good lines, line k (0-based) replaced by one whose I1 is ``bad[k]`` (not an integer); C1 ``c1``."""
    lines = [tsv_line(str(k % 2), bad.get(k, str(k)), c1) for k in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- (a) --on-bad-line stop reports the first bad line in input order, whatever the workers -------------------


def test_stop_reports_the_first_bad_line_in_input_order_with_two_workers(tmp_path):
    """a.tsv (24 chunks of 5 lines) is bad at its line 111, b.tsv at its line 1. One worker reports a.tsv:111,
    the first bad line in input order; two workers ran b.tsv's chunk beside a.tsv's first chunks and stopped
    everything at its error. Before the fix:
    ``BadLineError: .../b.tsv:1: column I1: 'x2' is not an integer`` (workers 2) vs ``a.tsv:111`` (workers 1).
    The chunks before the bad line are finished and recorded, none after it is half-written."""
    a = write_lines(tmp_path / "a.tsv", 120, {110: "x1"})
    # (b's lines are not a's: an input whose lines are mostly another's is refused as a copy, `same_rows`)
    b = write_lines(tmp_path / "b.tsv", 20, {0: "x2"}, c1="0000beef")
    messages = {}
    for workers in (1, 2):
        out = tmp_path / f"ds{workers}"
        with pytest.raises(pp.BadLineError) as info:
            pp.preprocess([a, b], out, chunk_rows=5, workers=workers, progress=False)
        messages[workers] = str(info.value)
        assert info.value.bad.path == str(a) and info.value.bad.line == 111
        assert not (out / "metadata.json").exists()
        assert not list(out.rglob("*.tmp"))
        # every chunk of a.tsv before the bad one (chunk 22) is finished (its rows are train rows)
        names = {p.name for p in (out / "train").glob("part-*.parquet")}
        assert {f"part-0000-{c:06d}.parquet" for c in range(22)} <= names
    assert messages[1] == messages[2] == f"{a}:111: column I1: 'x1' is not an integer"


def test_count_pass_reports_the_first_files_header_error_with_two_workers(tmp_path, monkeypatch):
    """Two CSV files whose headers are both wrong: the first file's must be named, whatever the number of
    workers. With several, a big plain file (here: over a lowered threshold) was counted first, in this
    process, and a small one's error waited in the pool. Before the fix (workers 2):
    ``PreprocessError: .../b.csv:1: header column 40: expected 'C26', found 'CY'``."""
    from dlrm.data.preprocess import scan

    monkeypatch.setattr(scan, "_PARALLEL_SCAN_MIN_BYTES", 20_000)
    names = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 26))]
    line = ",".join(["0", *["1"] * 13, *["00000001"] * 26]) + "\n"
    small = tmp_path / "a.csv"
    small.write_text(",".join([*names, "CX"]) + "\n" + line)
    big = tmp_path / "b.csv"
    big.write_text(",".join([*names, "CY"]) + "\n" + line * 200)
    assert small.stat().st_size < 20_000 <= big.stat().st_size
    for workers in (1, 2):
        out = tmp_path / f"ds{workers}"
        with pytest.raises(pp.PreprocessError, match=r"a\.csv:1: header column 40: expected 'C26', found 'CX'"):
            pp.preprocess([small, big], out, workers=workers, progress=False)
        assert not out.exists()


# -- (b) relayout: slots -> lists -> slots gives back the same slots ------------------------------------------


SIZES = [3, *[1] * 25]


def slot_dataset(root: Path, first_feature: list[list[int]]) -> Path:
    """A one-file train split in the slots layout whose feature 0 (3 slots) holds `first_feature`'s rows."""
    n = len(first_feature)
    schema = arrow_schema(SIZES, "slots")
    cols = {"label": pa.array(np.arange(n) % 2, pa.int8())}
    for j in range(13):
        cols[f"DENSE_{j}"] = pa.array(np.full(n, j), pa.int32())
    slots = np.array(first_feature, dtype=np.int64)
    for j in range(3):
        cols[slot_column(0, j)] = pa.array(slots[:, j], pa.int64())
    for f in range(1, 26):
        cols[f"SPARSE_{f}"] = pa.array(np.full(n, f), pa.int64())
    (root / "train").mkdir(parents=True)
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), root / "train" / "part-0.parquet")
    write_metadata(root, Metadata(cardinalities=[10] * 26, multi_hot_sizes=SIZES, sparse_layout="slots",
                                  splits={"train": SplitInfo(n, n // 2, ["train/part-0.parquet"])}))
    return root


def test_slots_to_lists_and_back_keep_a_pad_in_a_middle_slot(tmp_path):
    """A row [5, PAD, 7] (a value, an empty slot, a value: what another writer may store) went to the list
    [5, 7] and back to [5, 7, PAD]: the pooled sum is the same, the data is not. Before the fix:
    ``assert [5, 7, -2] == [5, -2, 7]``."""
    rows = [[5, PAD_SPARSE, 7], [PAD_SPARSE, PAD_SPARSE, 4], [1, 2, 3], [PAD_SPARSE] * 3, [6, PAD_SPARSE, PAD_SPARSE]]
    src = slot_dataset(tmp_path / "src", rows)
    relayout(src, tmp_path / "lists", "lists", workers=1)
    relayout(tmp_path / "lists", tmp_path / "back", "slots", workers=1)
    before = pq.read_table(src / "train" / "part-0.parquet")
    after = pq.read_table(tmp_path / "back" / "train" / "part-0.parquet")
    got = np.stack([after.column(slot_column(0, j)).to_numpy() for j in range(3)], axis=1).tolist()
    assert got[0] == [5, PAD_SPARSE, 7]
    assert got == rows
    assert after.equals(before)
    # the lists hold the values up to each row's last one (a trailing empty slot is no value)
    lists = pq.read_table(tmp_path / "lists" / "train" / "part-0.parquet").column("SPARSE_0").to_pylist()
    assert lists == [[5, PAD_SPARSE, 7], [PAD_SPARSE, PAD_SPARSE, 4], [1, 2, 3], [], [6]]
    # and the loaders read the list copy into the source's slots
    from dlrm.data.loader import ParquetLoader

    def batches(root: Path) -> list:
        loader = ParquetLoader([root / "train" / "part-0.parquet"], 8, multi_hot_sizes=SIZES, shuffle=False,
                               compact_sparse=False)
        try:
            return [b.sparse.clone() for b in loader]
        finally:
            loader.close()

    a, b = batches(src), batches(tmp_path / "lists")
    assert len(a) == len(b) == 1 and a[0][:, :3].tolist() == rows and b[0].tolist() == a[0].tolist()


# -- relayout of a dataset with an empty split -----------------------------------------------------------------


def test_relayout_keeps_a_split_without_rows(tmp_path):
    """The preprocessor lists a split that got no rows with ``rows`` 0 and no files (a tiny input, or --split random
    with a fraction 0); relayout refused such a dataset. Before the fix:
    ``DatasetError: .../ds/metadata.json: splits.validation: lists no files``."""
    src = write_lines(tmp_path / "in.tsv", 12, {})
    pp.preprocess([src], tmp_path / "ds", split="random", validation_fraction=0.0, test_fraction=0.0, workers=1,
                  progress=False)
    meta = relayout(tmp_path / "ds", tmp_path / "copy", "lists", workers=1)
    assert {k: (v.rows, v.files) for k, v in meta.splits.items()} == {
        "train": (12, ["train/part-0000-000000.parquet"]), "validation": (0, []), "test": (0, [])}
    before = pq.read_table(tmp_path / "ds" / "train" / "part-0000-000000.parquet")
    assert pq.read_table(tmp_path / "copy" / "train" / "part-0000-000000.parquet").equals(before)


# -- paths that are not UTF-8 (a Latin-1 file name on Linux): pyarrow cannot open them --------------------------


def test_preprocess_refuses_an_output_path_that_is_not_utf8(tmp_path):
    """pyarrow refuses such a path (``UnicodeEncodeError``), so the dataset the preprocessor wrote there through its
    own file handles could not be read by any loader, nor resumed (its shards looked damaged, every chunk was redone).
    Refused before anything is written. Before the fix: the run finished (``DID NOT RAISE``)."""
    src = write_lines(tmp_path / "in.tsv", 12, {})
    out = Path(str(tmp_path / "ds") + b"\xff".decode("utf-8", "surrogateescape"))
    with pytest.raises(pp.PreprocessError, match=r"not valid UTF-8"):
        pp.preprocess([src], out, workers=1, progress=False)
    assert not out.exists()


def test_a_dataset_path_that_is_not_utf8_is_one_line_error(tmp_path):
    """`split_files` and `open_shard` (every loader's, and relayout's, first look at a shard) crashed with pyarrow's
    UnicodeEncodeError: relayout printed a traceback and 'this is a bug' (exit 1). Now a `DatasetError` naming the
    path (exit 2). Before the fix: ``UnicodeEncodeError: 'utf-8' codec can't encode character '\\udcff'``."""
    from click.testing import CliRunner

    from dlrm.data import relayout as relayout_module
    from dlrm.data.schema import DatasetError, read_metadata
    from dlrm.data.validation import open_shard, split_files

    src = write_lines(tmp_path / "in.tsv", 12, {})
    good = tmp_path / "ds"
    pp.preprocess([src], good, workers=1, progress=False)
    bad = Path(str(tmp_path / "ds") + b"\xff".decode("utf-8", "surrogateescape"))
    good.rename(bad)
    with pytest.raises(DatasetError, match=r"not valid UTF-8"):
        split_files(bad, read_metadata(bad), "train")
    with pytest.raises(DatasetError, match=r"not valid UTF-8"):
        open_shard(bad / "train" / "part-0000-000000.parquet")
    result = CliRunner().invoke(relayout_module.main, ["--data", str(bad), "--output", str(tmp_path / "copy")])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "copy").exists()
    # a good dataset, an --output that is not UTF-8: refused before anything is written (was the same traceback)
    bad.rename(good)
    out = Path(str(tmp_path / "copy") + b"\xfe".decode("utf-8", "surrogateescape"))
    result = CliRunner().invoke(relayout_module.main, ["--data", str(good), "--output", str(out)])
    assert result.exit_code == 2, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "in.tsv"]


def test_a_failed_relayout_removes_the_parent_directories_it_created(tmp_path):
    """--output under directories that do not exist yet: relayout made them, and a failure (here a label 3 in a
    shard) removed its temporary directory but left them behind. Before the fix:
    ``assert ['new', 'src'] == ['src']``."""
    from dlrm.data.schema import DatasetError

    src = slot_dataset(tmp_path / "src", [[1, 2, 3]] * 4)
    shard = src / "train" / "part-0.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.set_column(0, "label", pa.array([0, 1, 3, 0], pa.int8())), shard)
    with pytest.raises(DatasetError, match=r"part-0.parquet: column label: row index 2 .* holds 3"):
        relayout(src, tmp_path / "new" / "sub" / "copy", "lists", workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # an --output whose parent exists keeps it (it is not the relayout's)
    (tmp_path / "mine").mkdir()
    with pytest.raises(DatasetError):
        relayout(src, tmp_path / "mine" / "copy", "lists", workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "src"] and not any((tmp_path / "mine").iterdir())
