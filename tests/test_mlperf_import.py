"""`dlrm.data.mlperf_import`: MLPerf DLRM-DCNv2's own preprocessed files (day_{i}_labels.npy, day_{i}_dense.npy,
day_{i}_sparse_multi_hot.npz, as its reference writes them) into this project's dataset, value by value."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dlrm.data import mlperf_import as mi
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    MLPERF_MULTI_HOT_SIZES,
    NUM_SPARSE,
    PAD_SPARSE,
    arrow_schema,
    read_metadata,
    slot_column,
    slot_offsets,
)
from tests.test_synthetic import feature_slots

CARDS = [7 + f for f in range(NUM_SPARSE)]
ROWS = {0: 37, 1: 29, 23: 21}  # two training days and the evaluation day


def write_day(root, i, n, rng, counts=None, save=np.savez):
    """One day as MLPerf's reference leaves it: labels int32 [n, 1], dense float32 log(x + 3) [n, 13], and an
    uncompressed npz of 26 int32 [n, size] members "0" .. "25"."""
    counts = rng.integers(-2, 3000, (n, 13)) if counts is None else counts
    counts[0, :3] = [0, 123_456, -1]  # zero, a large count, a negative one (Criteo's I2)
    labels = rng.integers(0, 2, (n, 1)).astype(np.int32)
    np.save(root / f"day_{i}_labels.npy", labels)
    logged = np.log(counts + 3.0).astype(np.float32)
    np.save(root / f"day_{i}_dense.npy", logged)
    ids = {str(f): rng.integers(0, CARDS[f], (n, size)).astype(np.int32)
           for f, size in enumerate(MLPERF_MULTI_HOT_SIZES)}
    save(root / f"day_{i}_sparse_multi_hot.npz", **ids)
    return labels[:, 0], np.maximum(counts, 0), ids, logged


@pytest.fixture
def mlperf_dir(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "in"
    src.mkdir()
    return src, {i: write_day(src, i, n, rng) for i, n in ROWS.items()}


def run(*args):
    return CliRunner().invoke(mi.main, [str(a) for a in args])


@pytest.mark.parametrize("workers, layout, dense", [(1, None, None), (2, None, "counts"), (1, "lists", "counts"),
                                                    (2, "lists", None)])
def test_every_value_lands_where_the_reference_puts_it(mlperf_dir, tmp_path, workers, layout, dense):
    """Train = days 0-1 in order, validation the first ceil(N/2) rows of day 23, test the rest; labels, dense values
    (MLPerf's float32 log(x + 3) bit for bit by default; with --dense counts, counts recovered from them, negatives 0)
    and every id of every multi-hot feature as in the npz members, in slot columns (the default) or list columns
    (--sparse-layout lists), every one full; files of at most --rows-per-file rows, of the layout's schema; and the
    stream loader reads the rows back: the ids in their slots, the dense values as the model's input."""
    src, days = mlperf_dir
    out = tmp_path / "ds"
    res = run("--input", src, "--output", out, "--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)),
              "--rows-per-file", 16, "--workers", workers, *(["--sparse-layout", layout] if layout else []),
              *(["--dense", dense] if dense else []))
    assert res.exit_code == 0, res.output
    layout, dense = layout or "slots", dense or "float"
    meta = read_metadata(out)
    assert meta.sparse_layout == layout and meta.dense_format == dense
    version = 4 if dense == "float" else 3 if layout == "slots" else 2
    assert json.loads((out / "metadata.json").read_text())["schema_version"] == version
    half = math.ceil(ROWS[23] / 2)
    assert {s: i.rows for s, i in meta.splits.items()} == {"train": 66, "validation": half, "test": ROWS[23] - half}
    assert meta.multi_hot_sizes == MLPERF_MULTI_HOT_SIZES and meta.cardinalities == CARDS
    assert meta.hashing == "modulus" and meta.extra["compression"] == "lz4"
    expect = {"train": [(0, 0, ROWS[0]), (1, 0, ROWS[1])], "validation": [(23, 0, half)],
              "test": [(23, half, ROWS[23])]}
    for split, spans in expect.items():
        files = split_files(out, meta, split)
        assert all(pq.ParquetFile(f).metadata.num_rows <= 16 for f in files)
        assert {pq.ParquetFile(f).metadata.row_group(0).column(0).compression for f in files} == {"LZ4"}
        assert all(pq.ParquetFile(f).schema_arrow.equals(arrow_schema(MLPERF_MULTI_HOT_SIZES, layout, dense))
                   for f in files)
        table = pa.concat_tables([pq.read_table(f) for f in files])
        labels = np.concatenate([days[d][0][lo:hi] for d, lo, hi in spans])
        values = np.concatenate([days[d][1 if dense == "counts" else 3][lo:hi] for d, lo, hi in spans])
        np.testing.assert_array_equal(table.column(LABEL_COLUMN).to_numpy(), labels)
        for j in range(13):
            column = table.column(DENSE_COLUMNS[j]).to_numpy()
            if dense == "float":  # bit for bit
                assert column.dtype == np.float32
                np.testing.assert_array_equal(column.view(np.int32), values[:, j].view(np.int32))
            else:
                np.testing.assert_array_equal(column, values[:, j])
        for f, size in enumerate(MLPERF_MULTI_HOT_SIZES):
            ids = np.concatenate([days[d][2][str(f)][lo:hi] for d, lo, hi in spans])
            np.testing.assert_array_equal(feature_slots(table, f, size), ids)  # full: no -2 in either layout
        assert meta.splits[split].positives == int(labels.sum())
    batch = next(iter(ParquetLoader(split_files(out, meta, "validation"), half, multi_hot_sizes=meta.multi_hot_sizes,
                                    dense_format=meta.dense_format)))
    offsets = slot_offsets(MLPERF_MULTI_HOT_SIZES)
    np.testing.assert_array_equal(batch.sparse[:, offsets[20]:offsets[21]].numpy(), days[23][2]["20"][:half])
    if dense == "float":  # exactly MLPerf's input
        np.testing.assert_array_equal(batch.dense.numpy().view(np.int32), days[23][3][:half].view(np.int32))
    else:
        np.testing.assert_allclose(batch.dense.numpy(), np.log1p(days[23][1][:half]), rtol=1e-6)  # float32 log1p
    assert not mi.partial_dir(out).exists()  # renamed into place


def test_dense_counts_round_trip_mlperfs_log():
    """round(exp(log(x + 3)) - 3) is x for every count a float32 log keeps apart (up to ~5e5); negatives are 0."""
    x = np.array([-2, -1, 0, 1, 2, 17, 999, 65_535, 500_000])
    got = mi.dense_counts(np.log(x + 3.0).astype(np.float32))
    np.testing.assert_array_equal(got, np.maximum(x, 0))
    assert got.dtype == np.int32


def test_max_rows_per_day_imports_a_subset(mlperf_dir, tmp_path):
    src, _ = mlperf_dir
    res = run("--input", src, "--output", tmp_path / "ds", "--train-days", "0,1", "--num-embeddings",
              ",".join(map(str, CARDS)), "--max-rows-per-day", 10, "--workers", 1)
    assert res.exit_code == 0, res.output
    assert {s: i.rows for s, i in read_metadata(tmp_path / "ds").splits.items()} == {
        "train": 20, "validation": 5, "test": 5}


def _mutate_dense(src):
    dense = np.load(src / "day_1_dense.npy")
    dense[4, 7] = np.nan
    np.save(src / "day_1_dense.npy", dense)


def _mutate_ids(src):
    members = dict(np.load(src / "day_0_sparse_multi_hot.npz"))
    members["20"][6, 9] = CARDS[20]
    np.savez(src / "day_0_sparse_multi_hot.npz", **members)


def _compress(src):
    members = dict(np.load(src / "day_23_sparse_multi_hot.npz"))
    np.savez_compressed(src / "day_23_sparse_multi_hot.npz", **members)


def _drop_member(src):
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    del members["25"]
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)


def _short_dense(src):
    np.save(src / "day_0_dense.npy", np.load(src / "day_0_dense.npy")[:-1])


def _float64_dense(src):
    np.save(src / "day_0_dense.npy", np.load(src / "day_0_dense.npy").astype(np.float64))


def _bad_label(src):
    labels = np.load(src / "day_23_labels.npy")
    labels[3, 0] = 2
    np.save(src / "day_23_labels.npy", labels)


@pytest.mark.parametrize("mutate,needle,kept", [
    (_mutate_dense, "day_1_dense.npy: row 4, column 7: nan", True),
    # found while writing the first file: nothing finished, nothing kept
    (_mutate_ids, "day_0_sparse_multi_hot.npz: member 20.npy: row 6, value 9: id 27 is outside", False),
    (_bad_label, "day_23_labels.npy: row 3: label 2 is not 0 or 1", True),
    (_compress, "day_23_sparse_multi_hot.npz: member 0.npy is compressed", False),
    (_drop_member, "day_1_sparse_multi_hot.npz: no member 25.npy", False),
    (_short_dense, "day_0_dense.npy: shape (36, 13)", False),
    (_float64_dense, "day_0_dense.npy: shape (37, 13) float64, expected float32", False),
    (lambda src: (src / "day_1_labels.npy").unlink(), "day_1_labels.npy: missing", False),
])
def test_a_bad_file_or_value_stops_with_one_line_and_no_output(mlperf_dir, tmp_path, mutate, needle,
                                                                kept):
    """Shapes, dtypes and files are checked before anything is written; a bad value found while writing stops
    the import with --output unwritten and only complete files kept for a resume (`kept`: a file was finished
    before the bad value; none finished, the unfinished import is removed)."""
    src, _ = mlperf_dir
    mutate(src)
    res = run("--input", src, "--output", tmp_path / "ds", "--train-days", "0-1", "--num-embeddings",
              ",".join(map(str, CARDS)), "--workers", 1)
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert not (tmp_path / "ds").exists()
    work = mi.partial_dir(tmp_path / "ds")
    assert work.exists() == kept
    assert not list(work.rglob("*.tmp"))


def test_arguments_and_an_occupied_output_are_refused(mlperf_dir, tmp_path):
    src, _ = mlperf_dir
    cards = ",".join(map(str, CARDS))
    occupied = tmp_path / "ds"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    res = run("--input", src, "--output", occupied, "--train-days", "0-1", "--num-embeddings", cards)
    assert res.exit_code == 2 and "refusing to overwrite" in res.output
    assert (occupied / "keep.txt").read_text() == "mine"
    for args, needle in [(["--train-days", "0-x"], "--train-days"), (["--train-days", "0-1", "--eval-day", "1"],
                                                                      "also a training day"),
                         (["--train-days", "0-1", "--num-embeddings", "5,5"], "--num-embeddings")]:
        res = run("--input", src, "--output", tmp_path / "new", *args, *(["--num-embeddings", cards]
                                                                       if "--num-embeddings" not in args else []))
        assert res.exit_code == 2 and needle in res.output, res.output
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("value", [2**63, 99999999999999999999999, 0])
def test_a_table_size_outside_1_to_2_63_is_refused_naming_it(mlperf_dir, tmp_path, value):
    """train.py refuses a dataset whose table sizes are not below 2^63: refused before anything is written."""
    src, _ = mlperf_dir
    cards = [*CARDS[:3], value, *CARDS[4:]]
    res = run("--input", src, "--output", tmp_path / "ds", "--train-days", "0-1", "--num-embeddings",
              ",".join(map(str, cards)))
    assert res.exit_code == 2, res.output
    assert f"--num-embeddings: {value} (feature 3) is not a table size >= 1 and below 2^63" in res.output, res.output
    assert not (tmp_path / "ds").exists() and not mi.partial_dir(tmp_path / "ds").exists()


def _input_files(src) -> dict:
    return {f.name: f.read_bytes() for f in sorted(src.iterdir())}


@pytest.mark.parametrize("where, needle", [
    (lambda src: src, "is --input itself"),
    (lambda src: src.parent, "is inside --output"),
    (lambda src: src / "ds", "is inside --input"),
    (lambda src: src.parent / "link", "is --input itself"),
])
def test_an_output_overlapping_the_input_is_refused_even_with_overwrite(mlperf_dir, where, needle):
    """--overwrite replaces --output whole: an --output that is the input, holds it or lies inside it (symlinks
    resolved) would delete the .npy/.npz files being read. Refused in one line, exit 2, the input untouched."""
    src, _ = mlperf_dir
    (src.parent / "link").symlink_to(src, target_is_directory=True)
    before = _input_files(src)
    res = run("--input", src, "--output", where(src), "--train-days", "0-1", "--num-embeddings",
              ",".join(map(str, CARDS)), "--workers", 1, "--overwrite")
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output
    assert _input_files(src) == before and not mi.partial_dir(where(src)).exists()


def test_an_input_inside_the_unfinished_imports_directory_is_refused(mlperf_dir, tmp_path):
    """--overwrite removes the partial directory: an input inside it would go with it."""
    src, _ = mlperf_dir
    work = mi.partial_dir(tmp_path / "ds")
    src.rename(work)
    res = run("--input", work, "--output", tmp_path / "ds", "--train-days", "0-1", "--overwrite")
    assert res.exit_code == 2 and f"--input {work} is inside {work}, where" in res.output, res.output
    assert (work / "day_0_dense.npy").is_file()


def test_a_bad_value_found_by_a_worker_process_is_the_same_one_line(mlperf_dir, tmp_path):
    """An id out of range found in a --workers process comes back as the same one-line error, exit 2, no output."""
    src, _ = mlperf_dir
    _mutate_ids(src)
    res = run("--input", src, "--output", tmp_path / "ds", "--train-days", "0-1", "--num-embeddings",
              ",".join(map(str, CARDS)), "--workers", 2, "--rows-per-file", 8)
    assert res.exit_code == 2, res.output
    assert "day_0_sparse_multi_hot.npz: member 20.npy: row 6, value 9: id 27 is outside" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "ds").exists()


def test_a_stopped_import_resumes_from_its_finished_files(mlperf_dir, tmp_path):
    """Day 1 holds a bad id: day 0's files are finished and kept; once the file is mended the same command
    resumes (day 0's files untouched) and writes what an uninterrupted import writes. Other options with the
    unfinished import there are refused; --overwrite starts over."""
    src, _ = mlperf_dir
    args = ["--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)), "--workers", 1,
            "--rows-per-file", 16]
    clean = run("--input", src, "--output", tmp_path / "clean", *args)
    assert clean.exit_code == 0, clean.output
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    good = members["4"][2, 1]
    members["4"][2, 1] = -5
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    out = tmp_path / "ds"
    first = run("--input", src, "--output", out, *args)
    assert first.exit_code == 2 and "id -5 is outside" in first.output and "resumes" in first.output, first.output
    kept = sorted(mi.partial_dir(out).rglob("*.parquet"))
    assert [p.name for p in kept] == ["day-00-part-00000.parquet", "day-00-part-00001.parquet",
                                      "day-00-part-00002.parquet"]
    stamps = [p.stat().st_mtime_ns for p in kept]
    other = run("--input", src, "--output", out, *args[:-1], 8)
    assert other.exit_code == 2 and "other options" in other.output and not out.exists()
    members["4"][2, 1] = good
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    second = run("--input", src, "--output", out, *args)
    assert second.exit_code == 0 and "resuming" in second.output, second.output
    assert [(out / p.relative_to(mi.partial_dir(out))).stat().st_mtime_ns for p in kept] == stamps
    assert read_metadata(out).splits == read_metadata(tmp_path / "clean").splits
    for rel in read_metadata(out).splits["train"].files:
        assert pq.read_table(out / rel).equals(pq.read_table(tmp_path / "clean" / rel))
    assert not mi.partial_dir(out).exists() and not (out / mi.PLAN_FILE).exists()
    again = run("--input", src, "--output", tmp_path / "fresh", *args[:-1], 8)
    assert again.exit_code == 0
    mi.partial_dir(tmp_path / "x").mkdir()
    (mi.partial_dir(tmp_path / "x") / mi.PLAN_FILE).write_text("{}")
    assert run("--input", src, "--output", tmp_path / "x", *args).exit_code == 2
    assert run("--input", src, "--output", tmp_path / "x", *args, "--overwrite").exit_code == 0


@pytest.mark.parametrize("size", [100, 0])
def test_a_resume_writes_again_a_finished_file_damaged_since(mlperf_dir, tmp_path, size):
    """A finished file in the partial directory cut short (a full disk, a copy gone wrong) cannot be read: the
    resumed import writes it again, naming it, and the dataset equals an uninterrupted import's."""
    src, _ = mlperf_dir
    args = ["--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)), "--workers", 1,
            "--rows-per-file", 16]
    assert run("--input", src, "--output", tmp_path / "clean", *args).exit_code == 0
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    good = members["4"][2, 1]
    members["4"][2, 1] = -5
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    out = tmp_path / "ds"
    assert run("--input", src, "--output", out, *args).exit_code == 2
    damaged = mi.partial_dir(out) / "train" / "day-00-part-00001.parquet"
    with open(damaged, "r+b") as f:
        f.truncate(size)
    members["4"][2, 1] = good
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    resumed = run("--input", src, "--output", out, *args)
    assert resumed.exit_code == 0 and "resuming" in resumed.output, resumed.output
    assert f"{damaged}: a finished file that cannot be read" in resumed.output, resumed.output
    assert read_metadata(out).splits == read_metadata(tmp_path / "clean").splits
    for rel in read_metadata(out).splits["train"].files:
        assert pq.read_table(out / rel).equals(pq.read_table(tmp_path / "clean" / rel))


def _layout_of(out, path):
    """What a dataset's files hold: "slots" when SPARSE_0 (size 3) is three int64 columns, "lists" when one list."""
    names = pq.ParquetFile(out / path).schema_arrow.names
    assert (slot_column(0, 0) in names) != ("SPARSE_0" in names)
    return "slots" if slot_column(0, 0) in names else "lists"


def test_both_layouts_hold_the_same_values(mlperf_dir, tmp_path):
    """The same input in slots and in lists: the same labels, dense counts and ids, a list equal to its slot columns
    (no slot holds -2: MLPerf's rows are full); every column with a dictionary (few distinct ids); the loader's batches
    identical."""
    src, _ = mlperf_dir
    args = ["--input", src, "--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)), "--workers", 1]
    for layout in ("lists", "slots"):
        res = run(*args, "--output", tmp_path / layout, "--sparse-layout", layout)
        assert res.exit_code == 0, res.output
    meta = read_metadata(tmp_path / "slots")
    assert meta.splits == read_metadata(tmp_path / "lists").splits
    for split, info in meta.splits.items():
        for rel in info.files:
            assert [_layout_of(tmp_path / layout, rel) for layout in ("lists", "slots")] == ["lists", "slots"]
            a, b = pq.read_table(tmp_path / "lists" / rel), pq.read_table(tmp_path / "slots" / rel)
            assert a.select([LABEL_COLUMN, *DENSE_COLUMNS]).equals(b.select([LABEL_COLUMN, *DENSE_COLUMNS]))
            for f, size in enumerate(MLPERF_MULTI_HOT_SIZES):
                slots = feature_slots(b, f, size)
                np.testing.assert_array_equal(feature_slots(a, f, size), slots)
                assert not (slots == PAD_SPARSE).any()
        group = pq.ParquetFile(tmp_path / "slots" / info.files[0]).metadata.row_group(0)
        assert all(group.column(i).has_dictionary_page for i in range(group.num_columns))  # few distinct ids here
    loaded = {layout: list(ParquetLoader(split_files(tmp_path / layout, meta, "train"), 25, device="cpu",
                                         multi_hot_sizes=meta.multi_hot_sizes, dense_format=meta.dense_format))
              for layout in ("lists", "slots")}
    assert len(loaded["slots"]) == 3
    for x, y in zip(loaded["lists"], loaded["slots"]):
        assert x.labels.equal(y.labels) and x.dense.equal(y.dense) and x.sparse.equal(y.sparse)


def test_a_bad_sparse_layout_is_one_line(mlperf_dir, tmp_path):
    src, _ = mlperf_dir
    res = run("--input", src, "--output", tmp_path / "ds", "--train-days", "0-1", "--sparse-layout", "columns")
    assert res.exit_code == 2 and "--sparse-layout" in res.output and "'columns'" in res.output, res.output
    with pytest.raises(mi.ImportInputError) as e:
        mi.import_mlperf(src, tmp_path / "ds", [0, 1], 23, CARDS, sparse_layout="rows")
    assert e.value.format_message() == "--sparse-layout: 'rows' is not one of lists, slots"
    assert not (tmp_path / "ds").exists() and not mi.partial_dir(tmp_path / "ds").exists()


def test_a_resume_in_another_layout_is_refused(mlperf_dir, tmp_path):
    """An import that stopped keeps its layout in import-plan.json: resuming in the other one is refused (the files
    it kept are in the first one), the same one resumes. A plan written before the key existed means "lists"."""
    src, _ = mlperf_dir
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    good = members["4"][2, 1]
    members["4"][2, 1] = -5
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    common = ["--input", src, "--train-days", "0-1", "--num-embeddings", ",".join(map(str, CARDS)), "--workers", 1,
              "--rows-per-file", 16]
    stopped = {}
    for layout in ("slots", "lists"):  # day 0's three files finished, day 1 stops each import
        out = tmp_path / layout
        first = run(*common, "--output", out, "--sparse-layout", layout)
        assert first.exit_code == 2 and "id -5 is outside" in first.output, first.output
        assert json.loads((mi.partial_dir(out) / mi.PLAN_FILE).read_text())["sparse_layout"] == layout
        stopped[layout] = sorted(p.relative_to(mi.partial_dir(out)) for p in mi.partial_dir(out).rglob("*.parquet"))
        assert len(stopped[layout]) == 3
    plan = mi.partial_dir(tmp_path / "lists") / mi.PLAN_FILE
    older = {k: v for k, v in json.loads(plan.read_text()).items() if k != "sparse_layout"}
    plan.write_text(json.dumps(older))  # as an import from before --sparse-layout left it
    for layout, other in (("slots", "lists"), ("lists", "slots")):
        refused = run(*common, "--output", tmp_path / layout, "--sparse-layout", other)
        assert refused.exit_code == 2 and "other options" in refused.output, refused.output
    assert run(*common, "--output", tmp_path / "lists").exit_code == 2  # the default, slots: not the older plan's
    members["4"][2, 1] = good
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    for layout in ("slots", "lists"):
        out = tmp_path / layout
        resumed = run(*common, "--output", out, "--sparse-layout", layout)
        assert resumed.exit_code == 0 and "resuming" in resumed.output, resumed.output
        assert read_metadata(out).sparse_layout == layout
        files = read_metadata(out).splits["train"].files
        assert {str(rel) for rel in stopped[layout]} < set(files)
        assert {_layout_of(out, rel) for rel in files} == {layout}


def test_a_bad_dense_format_or_a_resume_with_another_is_refused(mlperf_dir, tmp_path):
    """--dense takes counts or float; an import that stopped keeps its format in import-plan.json, and resuming
    with the other is refused (a plan from before --dense means counts)."""
    src, _ = mlperf_dir
    res = run("--input", src, "--output", tmp_path / "ds", "--dense", "log")
    assert res.exit_code == 2 and "--dense" in res.output and "'log'" in res.output, res.output
    with pytest.raises(mi.ImportInputError) as e:
        mi.import_mlperf(src, tmp_path / "ds", [0, 1], 23, CARDS, dense_format="log")
    assert e.value.format_message() == "--dense: 'log' is not one of counts, float"
    members = dict(np.load(src / "day_1_sparse_multi_hot.npz"))
    members["4"][2, 1] = -5
    np.savez(src / "day_1_sparse_multi_hot.npz", **members)
    common = ["--input", src, "--output", tmp_path / "ds", "--train-days", "0-1", "--num-embeddings",
              ",".join(map(str, CARDS)), "--workers", 1, "--rows-per-file", 16]
    assert run(*common).exit_code == 2
    plan = mi.partial_dir(tmp_path / "ds") / mi.PLAN_FILE
    assert json.loads(plan.read_text())["dense_format"] == "float"
    refused = run(*common, "--dense", "counts")
    assert refused.exit_code == 2 and "other options" in refused.output, refused.output
    plan.write_text(json.dumps({k: v for k, v in json.loads(plan.read_text()).items() if k != "dense_format"}))
    refused = run(*common)  # the default, float: not the older plan's counts
    assert refused.exit_code == 2 and "other options" in refused.output, refused.output


def test_workers_log_in_this_process_format_and_leave_ctrl_c_to_it(monkeypatch):
    """The pool's workers log in this process's format (their initializer), and are started by `start_pool`, which
    keeps Ctrl-C (it reaches the whole process group) from them from their first instruction on
    (tests/test_worker_pool.py)."""
    from dlrm.data import mlperf_import

    calls = []
    monkeypatch.setattr(mlperf_import, "configure_logging", lambda: calls.append("logging"))
    mlperf_import._init_worker()
    assert calls == ["logging"]
    assert mlperf_import.start_pool.__module__ == "dlrm.data.worker_pool"


def test_ctrl_c_once_the_output_is_complete_says_so(mlperf_dir, tmp_path, monkeypatch):
    """An interrupt after --output was renamed into place: exit 130 (a calling script stops) with a line saying the
    dataset is complete, not that nothing was written."""
    src, _ = mlperf_dir
    real_info = mi.logger.info

    def info(message, *args, **kwargs):
        if str(message).startswith("wrote "):
            raise KeyboardInterrupt
        return real_info(message, *args, **kwargs)

    monkeypatch.setattr(mi.logger, "info", info)
    res = run("--input", src, "--output", tmp_path / "ds", "--train-days", "0,1", "--num-embeddings",
              ",".join(map(str, CARDS)), "--workers", 1)
    assert res.exit_code == mi.EXIT_INTERRUPTED, res.output
    assert f"after {tmp_path / 'ds'} was complete" in res.output and "was not written" not in res.output
    assert read_metadata(tmp_path / "ds").splits["train"].rows > 0
