"""Multi-hot sparse features in the data layer (issue #22): schema version 2, list columns padded
to [B, L] with PAD_SPARSE by both loaders, their checks, and the synthetic generator's multi-hot
teacher."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data import synthetic
from dlrm.data.batch import widen_sparse
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    MLPERF_MULTI_HOT_SIZES,
    NUM_SPARSE,
    PAD_SPARSE,
    SPARSE_COLUMNS,
    DatasetError,
    Metadata,
    SplitInfo,
    arrow_schema,
    read_metadata,
    slot_offsets,
    sparse_width,
    write_metadata,
)

SIZES = [1] * NUM_SPARSE
SIZES[0], SIZES[3], SIZES[20] = 3, 2, 5  # three multi-hot features; L = 26 + 2 + 1 + 4 = 33


def random_lists(rng: np.random.Generator, n: int, sizes: list[int]) -> list[list]:
    """Per feature, per row: an int (one-hot; -1 sometimes) or a list of 0..size values."""
    features = []
    for size in sizes:
        if size == 1:
            features.append([int(v) for v in rng.integers(-1, 2**32 - 2, n)])
        else:
            features.append([[int(v) for v in rng.integers(0, 2**32 - 2, rng.integers(0, size + 1))]
                             for _ in range(n)])
    return features


def write_shard(path, label, dense, features, sizes, row_group_size, schema=None) -> None:
    cols = {LABEL_COLUMN: pa.array(label.astype(np.int8)),
            **{c: pa.array(dense[:, i].astype(np.int32)) for i, c in enumerate(DENSE_COLUMNS)}}
    for c, size, values in zip(SPARSE_COLUMNS, sizes, features):
        cols[c] = pa.array(values, pa.list_(pa.int64()) if size > 1 else pa.int64())
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols, schema=schema or arrow_schema(sizes)), path, row_group_size=row_group_size)


def reference_rows(files, sizes) -> tuple[np.ndarray, np.ndarray]:
    """(dense DENSE_0 [n], sparse [n, L]) straight from pyarrow, padded row by row (the slow, obvious way)."""
    offsets, rows, ids = slot_offsets(sizes), [], []
    for f in files:
        t = pq.read_table(f)
        ids.append(t.column("DENSE_0").to_numpy())
        cols = [t.column(c).to_pylist() for c in SPARSE_COLUMNS]
        for r in range(t.num_rows):
            row = []
            for k, size in enumerate(sizes):
                v = cols[k][r]
                row += [v] if size == 1 else list(v) + [PAD_SPARSE] * (size - len(v))
            assert len(row) == offsets[-1]
            rows.append(row)
    return np.concatenate(ids), np.array(rows, dtype=np.int64)


@pytest.fixture(scope="module")
def multi_hot_dataset(tmp_path_factory):
    """95 rows over two files of row groups of 7 rows; DENSE_0 is the row index."""
    root = tmp_path_factory.mktemp("mh")
    rng = np.random.default_rng(5)
    n, files, at = 95, [], 0
    for k, rows in enumerate((50, 45)):
        dense = rng.integers(0, 100, (rows, 13))
        dense[:, 0] = np.arange(at, at + rows)
        rel = f"train/part-{k:05d}.parquet"
        write_shard(root / rel, rng.integers(0, 2, rows), dense, random_lists(rng, rows, SIZES), SIZES, 7)
        files.append(rel)
        at += rows
    write_metadata(root, Metadata(cardinalities=[11] * NUM_SPARSE, multi_hot_sizes=SIZES,
                                  splits={"train": SplitInfo(n, 0, files)}))
    return root


def loaders(root, batch_size, **kw):
    files = split_files(root, read_metadata(root), "train")
    sizes = read_metadata(root).multi_hot_sizes
    return {
        "stream": ParquetLoader(files, batch_size, multi_hot_sizes=sizes, shuffle_buffer_rows=20, **kw),
        "stream-compact": ParquetLoader(files, batch_size, multi_hot_sizes=sizes, compact_sparse=True, **kw),
        "device": DeviceLoader(files, batch_size, "cpu", multi_hot_sizes=sizes, **kw),
    }


# -- schema and metadata ------------------------------------------------------------------------


def test_slot_layout_of_the_mlperf_sizes():
    offsets = slot_offsets(MLPERF_MULTI_HOT_SIZES)
    assert sparse_width(MLPERF_MULTI_HOT_SIZES) == offsets[-1] == 214 and len(offsets) == NUM_SPARSE + 1
    assert offsets[:4] == [0, 3, 5, 6] and slot_offsets() == list(range(NUM_SPARSE + 1))
    assert arrow_schema() == arrow_schema([1] * NUM_SPARSE)  # one-hot: the version-1 schema
    assert arrow_schema(MLPERF_MULTI_HOT_SIZES).field("SPARSE_20").type == pa.list_(pa.int64())


def test_metadata_version_2_round_trip_and_version_1_reads_as_one_hot(tmp_path):
    write_metadata(tmp_path, Metadata(cardinalities=[7] * NUM_SPARSE, multi_hot_sizes=SIZES))
    raw = json.loads((tmp_path / "metadata.json").read_text())
    assert raw["schema_version"] == 2 and raw["multi_hot_sizes"] == SIZES
    back = read_metadata(tmp_path)
    assert back.multi_hot_sizes == SIZES and back.sparse_width == 33 and back.is_multi_hot

    raw.update(schema_version=1)
    del raw["multi_hot_sizes"]
    (tmp_path / "metadata.json").write_text(json.dumps(raw))
    v1 = read_metadata(tmp_path)
    assert v1.schema_version == 1 and v1.multi_hot_sizes == [1] * NUM_SPARSE and not v1.is_multi_hot
    assert "multi_hot_sizes" not in v1.to_json() and v1.to_json()["schema_version"] == 1  # written back as it was


@pytest.mark.parametrize("change,message", [
    ({"schema_version": 1, "multi_hot_sizes": SIZES}, r"multi_hot_sizes: is a schema_version 2 key"),
    ({"multi_hot_sizes": [2] * 25}, r"multi_hot_sizes: must be a list of 26 integers"),
    ({"multi_hot_sizes": [1] * 25 + [0]}, r"multi_hot_sizes\[25\]: 0 is not an integer in \[1, 65536\]"),
    ({"multi_hot_sizes": [1] * 25 + [True]}, r"multi_hot_sizes\[25\]: True is not an integer"),
    ({"schema_version": 5}, r"schema_version: 5 is not a supported version"),
])
def test_bad_multi_hot_metadata_is_one_named_error(tmp_path, change, message):
    raw = {**Metadata(cardinalities=[7] * NUM_SPARSE).to_json(), **change}
    (tmp_path / "metadata.json").write_text(json.dumps(raw))
    with pytest.raises(DatasetError, match=r"metadata.json: " + message) as e:
        read_metadata(tmp_path)
    assert "\n" not in str(e.value)


def test_embedded_sample_is_still_version_1_and_loads_one_hot():
    from tests.conftest import REPO

    meta = read_metadata(REPO / "data" / "sample")
    assert meta.schema_version == 1 and meta.multi_hot_sizes == [1] * NUM_SPARSE
    batch = next(iter(ParquetLoader(split_files(REPO / "data" / "sample", meta, "validation"), 16,
                                    multi_hot_sizes=meta.multi_hot_sizes)))
    assert batch.sparse.shape == (16, 26) and (batch.sparse >= -1).all()


# -- loaders --------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [16, 95, 128])
def test_loaders_deliver_the_padded_rows_of_the_files(multi_hot_dataset, batch_size):
    root = multi_hot_dataset
    ids, expected = reference_rows(split_files(root, read_metadata(root), "train"), SIZES)
    assert (expected == PAD_SPARSE).any() and (expected[:, 0] == -1).sum() == 0  # some lists short, none -1
    for name, loader in loaders(root, batch_size).items():
        batches = list(loader)
        assert [len(b) for b in batches] == [min(batch_size, 95 - i) for i in range(0, 95, batch_size)], name
        sparse = torch.cat([b.sparse for b in batches])
        assert sparse.dtype == torch.int64 and sparse.shape == (95, 33), name
        np.testing.assert_array_equal(sparse.numpy(), expected, err_msg=name)
        got_ids = np.expm1(torch.cat([b.dense[:, 0] for b in batches]).numpy()).round()
        np.testing.assert_array_equal(got_ids, ids, err_msg=name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_slices_concatenate_to_the_global_batch(multi_hot_dataset, world_size):
    root = multi_hot_dataset
    for shuffle in (False, True):
        whole = {n: list(ld) for n, ld in loaders(root, 20, shuffle=shuffle, seed=4).items()}
        parts = [{n: list(ld) for n, ld in loaders(root, 20, shuffle=shuffle, seed=4, rank=r,
                                                    world_size=world_size).items()} for r in range(world_size)]
        for name, batches in whole.items():
            for i, batch in enumerate(batches):
                glued = torch.cat([p[name][i].sparse for p in parts])
                assert torch.equal(glued, batch.sparse), (name, shuffle, i)
                assert all(p[name][i].global_len == len(batch) for p in parts)


def test_shuffled_batches_hold_every_row_once(multi_hot_dataset):
    root = multi_hot_dataset
    _, expected = reference_rows(split_files(root, read_metadata(root), "train"), SIZES)
    for name, loader in loaders(root, 16, shuffle=True, seed=2).items():
        got = torch.cat([b.sparse for b in loader]).numpy()
        assert not np.array_equal(got, expected), name
        assert sorted(map(tuple, got)) == sorted(map(tuple, expected)), name


def test_too_long_list_is_a_named_error(tmp_path):
    rng = np.random.default_rng(0)
    features = random_lists(rng, 12, SIZES)
    features[20][9] = [1, 2, 3, 4, 5, 6]  # SPARSE_20 allows 5
    write_shard(tmp_path / "a.parquet", np.zeros(12), np.zeros((12, 13)), features, SIZES, 5)
    for make in (lambda: list(ParquetLoader([tmp_path / "a.parquet"], 4, multi_hot_sizes=SIZES)),
                 lambda: DeviceLoader([tmp_path / "a.parquet"], 4, "cpu", multi_hot_sizes=SIZES)):
        with pytest.raises(DatasetError, match=r"a.parquet: column SPARSE_20: row index 9 \(row group 1\) holds 6 "
                                               r"values; multi_hot_sizes\[20\] allows at most 5") as e:
            make()
        assert "\n" not in str(e.value)


def test_schema_mismatches_name_the_column(tmp_path):
    rng = np.random.default_rng(1)
    write_shard(tmp_path / "a.parquet", np.zeros(4), np.zeros((4, 13)), random_lists(rng, 4, SIZES), SIZES, 4)
    with pytest.raises(DatasetError, match=r"a.parquet: column SPARSE_0: type list<.*int64> is not int64 "
                                           r"\(a multi-hot column, but the dataset's multi_hot_sizes\[0\] is 1"):
        ParquetLoader([tmp_path / "a.parquet"], 4)  # one-hot: the default
    one_hot = [1] * NUM_SPARSE
    write_shard(tmp_path / "b.parquet", np.zeros(4), np.zeros((4, 13)), random_lists(rng, 4, one_hot), one_hot, 4)
    with pytest.raises(DatasetError, match=r"b.parquet: column SPARSE_0: type int64 is not list<item: int64>"):
        DeviceLoader([tmp_path / "b.parquet"], 4, "cpu", multi_hot_sizes=SIZES)


def test_null_lists_and_values_follow_the_null_policy(tmp_path):
    rng = np.random.default_rng(2)
    features = random_lists(rng, 6, SIZES)
    features[0][1] = None  # a null list: no values
    features[0][2] = [5, None]  # a null value: the missing category
    schema = pa.schema([f.with_nullable(True) for f in arrow_schema(SIZES)])
    write_shard(tmp_path / "a.parquet", np.zeros(6), np.zeros((6, 13)), features, SIZES, 6, schema=schema)
    for loader in (ParquetLoader([tmp_path / "a.parquet"], 6, multi_hot_sizes=SIZES),
                   DeviceLoader([tmp_path / "a.parquet"], 6, "cpu", multi_hot_sizes=SIZES)):
        sparse = next(iter(loader)).sparse
        assert sparse[1, :3].tolist() == [PAD_SPARSE] * 3 and sparse[2, :3].tolist() == [5, -1, PAD_SPARSE]


def test_compact_form_keeps_pad_and_missing_exact(tmp_path):
    wide = torch.tensor([[-2, -1, 0, 2**32 - 3, 2**31]])
    compact = (wide & 0xFFFFFFFF).to(torch.int64).numpy().astype(np.uint32).view(np.int32)
    assert torch.equal(widen_sparse(torch.from_numpy(compact), padded=True), wide)
    assert widen_sparse(torch.from_numpy(compact))[0, 0] == 2**32 - 2  # one-hot: the version-1 rule
    # 0xFFFFFFFE in multi-hot data: its bits are -2's, so the stream loader keeps int64
    features = random_lists(np.random.default_rng(3), 4, SIZES)
    features[0][0] = [2**32 - 2]
    write_shard(tmp_path / "a.parquet", np.zeros(4), np.zeros((4, 13)), features, SIZES, 4)
    stream = ParquetLoader([tmp_path / "a.parquet"], 4, multi_hot_sizes=SIZES, compact_sparse=True)
    device = DeviceLoader([tmp_path / "a.parquet"], 4, "cpu", multi_hot_sizes=SIZES)
    assert not stream._compact and device.sparse.dtype == torch.int64
    for loader in (stream, device):
        assert next(iter(loader)).sparse[0, :3].tolist() == [2**32 - 2, PAD_SPARSE, PAD_SPARSE]


# -- synthetic ------------------------------------------------------------------------------------

SYN_SIZES = "3,2,1,1,6,1,1,1,1,1,1,1,1,4,1,1,1,1,1,5,1,1,1,1,1,1"  # features 4 and 13, 19 in interactions


@pytest.fixture(scope="module", params=["fixed", "variable"])
def generated(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"syn-{request.param}")
    meta = synthetic.generate(root / "ds", 4000, seed=3, cardinalities="tiny", multi_hot_sizes=SYN_SIZES,
                              multi_hot_fill=request.param, raw_tsv=root / "train.txt", rows_per_file=1500,
                              sparse_layout="lists")  # list columns, read below; the slots hold the same rows (test_synthetic)
    return root, meta, request.param


def test_synthetic_multi_hot_layout_and_fill(generated):
    root, meta, fill = generated
    sizes = [int(s) for s in SYN_SIZES.split(",")]
    back = read_metadata(root / "ds")
    assert back.multi_hot_sizes == sizes and back.schema_version == 2 and back.extra["multi_hot_fill"] == fill
    assert f"--multi-hot-sizes {SYN_SIZES} --multi-hot-fill {fill}" in back.extra["command"]
    tables = [pq.read_table(root / "ds" / f) for f in back.splits["train"].files]
    for f, size in enumerate(sizes):
        column = pa.chunked_array([c for t in tables for c in t.column(SPARSE_COLUMNS[f]).chunks])
        if size == 1:
            assert column.type == pa.int64()
            continue
        lengths = np.concatenate([np.array([len(v) for v in c.to_pylist()]) for c in column.chunks])
        missing = synthetic._SPARSE_MISSING[f]
        assert lengths.max() == size and abs((lengths == 0).mean() - missing) < 0.03
        if fill == "fixed":
            assert set(np.unique(lengths)) <= {0, size}
        else:
            assert set(np.unique(lengths[lengths > 0])) == set(range(1, size + 1))


def test_synthetic_oracle_auc_is_the_multi_hot_teachers_auc(generated):
    root, meta, fill = generated
    back = read_metadata(root / "ds")
    teacher = synthetic.Teacher(3, synthetic.CARDINALITY_PRESETS["tiny"], bias=back.extra["teacher"]["bias"],
                                multi_hot_sizes=back.multi_hot_sizes)
    files = split_files(root / "ds", back, "validation")
    (batch,) = list(DeviceLoader(files, 10_000, "cpu", multi_hot_sizes=back.multi_hot_sizes))
    dense = pa.concat_tables([pq.read_table(f) for f in files])
    dense = np.stack([dense.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
    p = teacher.probability_of_stored(dense, batch.sparse.numpy())
    assert synthetic.rank_auc(p, batch.labels.numpy()) == pytest.approx(back.extra["oracle_auc"]["validation"], abs=1e-12)
    # the multi-hot values matter: scoring only each feature's first value gives another AUC
    first = batch.sparse.numpy().copy()
    offsets = slot_offsets(back.multi_hot_sizes)
    for f in range(NUM_SPARSE):
        first[:, offsets[f] + 1 : offsets[f + 1]] = PAD_SPARSE
    assert synthetic.rank_auc(teacher.probability_of_stored(dense, first), batch.labels.numpy()) != pytest.approx(
        back.extra["oracle_auc"]["validation"], abs=1e-3)
    assert 0.7 < back.extra["oracle_auc"]["validation"] < 0.95


def test_synthetic_multi_hot_raw_tsv_joins_values_with_commas(generated):
    root, meta, fill = generated
    back = read_metadata(root / "ds")
    first = pq.read_table(root / "ds" / back.splits["train"].files[0]).slice(0, 50)
    lines = (root / "train.txt").read_text().split("\n")[:50]
    for r, line in enumerate(lines):
        fields = line.split("\t")
        assert len(fields) == 40
        for f, size in enumerate(back.multi_hot_sizes):
            value = first.column(SPARSE_COLUMNS[f])[r].as_py()
            values = value if size > 1 else ([] if value == -1 else [value])
            assert fields[14 + f] == ",".join(f"{v:08x}" for v in values)


def test_synthetic_one_hot_preset_writes_the_one_hot_bytes(tmp_path):
    a = synthetic.generate(tmp_path / "a", 600, seed=1, cardinalities="tiny")
    b = synthetic.generate(tmp_path / "b", 600, seed=1, cardinalities="tiny", multi_hot_sizes="one-hot",
                           multi_hot_fill="variable")
    for split, info in a.splits.items():
        for f in info.files:
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert a.extra["oracle_auc"] == b.extra["oracle_auc"] and "multi_hot_fill" not in b.extra
    assert "--multi-hot" not in b.extra["command"]


def test_synthetic_mlperf_presets(tmp_path, mlperf_preset_dataset):
    """`--cardinalities mlperf --multi-hot-sizes mlperf` (the session's dataset, written by the command line: the
    fixture checks its exit code)."""
    from click.testing import CliRunner

    meta = read_metadata(mlperf_preset_dataset)
    assert meta.multi_hot_sizes == MLPERF_MULTI_HOT_SIZES and meta.cardinalities[0] == 40_000_000
    batch = next(iter(ParquetLoader(split_files(mlperf_preset_dataset, meta, "train"), 64,
                                    multi_hot_sizes=meta.multi_hot_sizes)))
    assert batch.sparse.shape == (64, 214)
    bad = CliRunner().invoke(synthetic.main, ["--rows", "30", "--out", str(tmp_path / "x"), "--multi-hot-sizes", "3,2"])
    assert bad.exit_code == 2 and "--multi-hot-sizes" in bad.output and not (tmp_path / "x").exists()


def test_synthetic_compression_changes_the_codec_not_the_rows(tmp_path):
    """--compression lz4 writes the same rows as the default zstd, in LZ4 files, recorded in the metadata and in the
    command that regenerates them; an unknown codec is refused before anything is written. Both datasets are written
    here with the same small multi-hot arguments (three multi-hot features, "tiny" tables): until 2026-12-02 the LZ4
    one repeated the session's MLPerf-preset dataset (`MLPERF_PRESET_ARGS`), whose teacher, tuned on a pilot of 214
    values a row, cost ~7 s of CPU whatever the row count; the codec's property does not depend on the preset, and
    both written here cost ~1.5 s."""
    from click.testing import CliRunner

    sizes = ",".join(map(str, SIZES))  # multi-hot: the loader's codec hint below is about multi-hot rows
    args = ["--rows", "200", "--cardinalities", "tiny", "--multi-hot-sizes", sizes]
    res = CliRunner().invoke(synthetic.main, args + ["--out", str(tmp_path / "zstd")])  # the default codec
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(synthetic.main, args + ["--out", str(tmp_path / "lz4"), "--compression", "lz4"])
    assert res.exit_code == 0, res.output
    roots = {"zstd": tmp_path / "zstd", "lz4": tmp_path / "lz4"}
    tables = {}
    for codec in ("zstd", "lz4"):
        meta = read_metadata(roots[codec])
        assert meta.extra["compression"] == codec
        assert ("--compression lz4" in meta.extra["command"]) == (codec == "lz4")
        files = split_files(roots[codec], meta, "train")
        footer = pq.ParquetFile(files[0]).metadata
        assert {footer.row_group(0).column(i).compression for i in range(footer.num_columns)} == {codec.upper()}
        tables[codec] = pq.read_table(files[0])
    assert tables["lz4"].equals(tables["zstd"])
    # the training loader says when multi-hot rows stream from files that a faster codec would decode sooner
    from loguru import logger

    from dlrm.config import load_config
    from dlrm.train.trainer import make_loader

    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "sample.json")
    for codec in ("zstd", "lz4"):
        meta = read_metadata(roots[codec])
        messages: list[str] = []
        handle = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
        try:
            loader = make_loader(cfg, split_files(roots[codec], meta, "train"), 64, torch.device("cpu"), train=True,
                                 placement="stream", multi_hot_sizes=meta.multi_hot_sizes)
            loader.close()
        finally:
            logger.remove(handle)
        assert loader.codecs == {codec.upper()} and loader.layouts == {"slots"}
        assert any("LZ4 files" in m and "zstd files" in m for m in messages) == (codec == "zstd"), messages
        assert not any("list columns" in m for m in messages)
    bad = CliRunner().invoke(synthetic.main, args + ["--out", str(tmp_path / "x"), "--compression", "lzo"])
    assert bad.exit_code == 2 and "--compression" in bad.output and not (tmp_path / "x").exists()


@pytest.mark.parametrize("lengths", [
    [4, 4, 4],  # every list full: the reshape
    [4, 0, 4, 0, 0, 4],  # full or empty (fixed fill, missing features): the row-block copy
    [0, 0],  # all empty
    [1, 4, 0, 3, 2],  # anything else: the scatter
    [4, 4, 3],  # one short list among full ones: the scatter, not the row-block copy
])
def test_list_slots_puts_each_rows_values_first_then_padding(lengths):
    """`list_slots` against a row-by-row reference on each of its paths (null lists count as empty)."""
    from dlrm.data.host_arena import list_slots

    rng = np.random.default_rng(len(lengths))
    rows = [None if n == 0 and i % 2 else [int(v) for v in rng.integers(0, 2**40, n)] for i, n in enumerate(lengths)]
    column = pa.array(rows, type=pa.list_(pa.int64()))
    expected = np.full((len(rows), 4), PAD_SPARSE, dtype=np.int64)
    for i, r in enumerate(rows):
        expected[i, : len(r or [])] = r or []
    got = list_slots(pa.chunked_array([column[:2], column[2:]]), 4)  # several chunks, as a read may return
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(list_slots(column, 4), expected)


@pytest.mark.parametrize("fill", ["full", "full_or_empty", "variable", "empty"])
@pytest.mark.parametrize("block_rows", [1, 3, 7, None])
def test_list_slots_into_matches_a_row_by_row_reference_in_any_layout(fill, block_rows):
    """`list_slots_into` into a column-major int32 arena view (the stream loader's) and a row-major int64 one (the
    device loader's), its row blocks cut at 1, 3, 7 rows and the default, so blocks of each path's kind (full,
    full-or-empty, scattered, all empty) meet blocks of the others; values above 2**32 keep their low 32 bits."""
    from dlrm.data.host_arena import list_slots_into

    rng = np.random.default_rng(17)
    n, size = 23, 5
    lengths = {"full": np.full(n, size), "full_or_empty": rng.choice([0, size], n), "empty": np.zeros(n, int),
               "variable": rng.integers(0, size + 1, n)}[fill]
    if fill == "variable":
        lengths[:7] = size  # a first block of full rows before the scattered ones
    rows = [[int(v) for v in rng.integers(0, 2**40, k)] for k in lengths]
    column = pa.array(rows, type=pa.list_(pa.int64()))
    expected = np.full((n, size), PAD_SPARSE, dtype=np.int64)
    for i, r in enumerate(rows):
        expected[i, : len(r)] = r
    arena = np.full((size + 2, n + 4), 99, dtype=np.int32)  # other slots and rows around the target: untouched
    list_slots_into(pa.chunked_array([column[:5], column[5:]]), size, arena[1 : 1 + size, 2 : 2 + n], block_rows)
    np.testing.assert_array_equal(arena[1 : 1 + size, 2 : 2 + n], expected.T.astype(np.int32))
    assert (arena[[0, size + 1]] == 99).all() and (arena[:, [0, 1, n + 2, n + 3]] == 99).all()
    row_major = np.zeros((n, size), dtype=np.int64)
    list_slots_into(column, size, row_major.T, block_rows)
    np.testing.assert_array_equal(row_major, expected)
    with pytest.raises(ValueError, match=r"\(5, 23\)"):
        list_slots_into(column, size, row_major)  # [n, size] where [size, n] is meant


@pytest.mark.parametrize("cores,multi_hot,one_hot", [(1, 2, 2), (16, 16, 4), (64, 16, 4), (8, 8, 2)])
def test_reader_threads_default_by_row_width(multi_hot_dataset, monkeypatch, cores, multi_hot, one_hot):
    """Multi-hot row groups decode side by side, one reader a core up to 16; one-hot ones a quarter of the cores,
    2 to 4 (pyarrow's own pool splits their many small columns)."""
    import dlrm.data.parquet_loader as pl

    monkeypatch.setattr(pl.os, "cpu_count", lambda: cores)
    files = split_files(multi_hot_dataset, read_metadata(multi_hot_dataset), "train")
    assert ParquetLoader(files, 8, multi_hot_sizes=SIZES).reader_threads == multi_hot
    assert ParquetLoader(files, 8, multi_hot_sizes=SIZES, reader_threads=3).reader_threads == 3
    from tests.conftest import REPO

    sample = REPO / "data" / "sample"
    one_hot_files = split_files(sample, read_metadata(sample), "validation")
    assert ParquetLoader(one_hot_files, 8).reader_threads == one_hot


def test_arrow_threads_switches_pyarrows_pool_and_batches_stay_the_same(multi_hot_dataset):
    """arrow_threads (pyarrow's column pool beside the readers) changes who decodes, never what is delivered; it
    must be a bool or None (the default; the benchmark once passed a "default" None through, which read as off)."""
    files = split_files(multi_hot_dataset, read_metadata(multi_hot_dataset), "train")
    batches = {}
    for arrow in (True, False):
        loader = ParquetLoader(files, 16, shuffle=True, seed=3, multi_hot_sizes=SIZES, arrow_threads=arrow,
                               shuffle_buffer_rows=20)
        assert loader.arrow_threads is arrow
        batches[arrow] = [b.sparse for b in loader]
    assert len(batches[True]) == 6 and all(torch.equal(a, b) for a, b in zip(batches[True], batches[False]))
    # by default off for multi-hot rows (their readers fill the cores), on for one-hot ones
    assert ParquetLoader(files, 8, multi_hot_sizes=SIZES).arrow_threads is False
    assert ParquetLoader(files, 8, multi_hot_sizes=SIZES, arrow_threads=None).arrow_threads is False
    from tests.conftest import REPO

    sample = REPO / "data" / "sample"
    assert ParquetLoader(split_files(sample, read_metadata(sample), "validation"), 8).arrow_threads is True
    with pytest.raises(TypeError, match="arrow_threads"):
        ParquetLoader(files, 8, multi_hot_sizes=SIZES, arrow_threads="on")


def test_the_loaders_read_one_hot_and_multi_hot_rows_without_importing_pandas(multi_hot_dataset, tmp_path):
    """pyarrow's ``to_numpy`` imports pandas (0.5 s of CPU in every process that reads a row group: each training run,
    torchrun rank and loader worker); the decode path goes through `dlrm.data.arrow_numpy.numpy_of` instead."""
    import subprocess
    import sys

    from tests.conftest import make_dataset

    make_dataset(tmp_path / "one-hot", {"train": 64, "validation": 8}, row_group_size=32)
    code = f"""
import sys
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import read_metadata
one_hot, multi_hot = {str(tmp_path / "one-hot")!r}, {str(multi_hot_dataset)!r}
files, sizes = split_files(multi_hot, read_metadata(multi_hot), "train"), read_metadata(multi_hot).multi_hot_sizes
batches = [ParquetLoader(split_files(one_hot, read_metadata(one_hot), "train"), 16),
           ParquetLoader(files, 16, multi_hot_sizes=sizes), ParquetLoader(files, 16, multi_hot_sizes=sizes, compact_sparse=True),
           DeviceLoader(files, 16, "cpu", multi_hot_sizes=sizes)]
rows = [sum(int(batch.labels.shape[0]) for batch in loader) for loader in batches]
assert rows == [64, 95, 95, 95], rows
print("pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
