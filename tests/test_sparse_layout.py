"""The "slots" sparse layout (schema version 3): a multi-hot feature as one int64 column a slot.

Both loaders must deliver exactly the batches of the same rows stored as list columns, whatever
mix of layouts a split's files hold; the checks (schema, nulls, compact int32 form) hold for slot
columns as they do for lists; metadata.json says version 3 only where it must."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from loguru import logger

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.host_arena import _HostBlock, compact_sparse_ok
from dlrm.data.loader import ParquetLoader, file_layout, open_shard, split_files
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
    slot_column,
    slot_offsets,
    sparse_columns,
    write_options,
    write_metadata,
)
from tests.test_multihot_data import SIZES, random_lists, reference_rows, write_shard


def padded(values: list, size: int) -> list:
    return list(values) + [PAD_SPARSE] * (size - len(values))


def write_slots_shard(path, label, dense, features, sizes, row_group_size, nullable=False) -> None:
    """The rows of `write_shard`, but each multi-hot feature as its slot columns (values, then -2)."""
    cols = {LABEL_COLUMN: pa.array(label.astype(np.int8)),
            **{c: pa.array(dense[:, i].astype(np.int32)) for i, c in enumerate(DENSE_COLUMNS)}}
    for f, (size, values) in enumerate(zip(sizes, features)):
        if size == 1:
            cols[SPARSE_COLUMNS[f]] = pa.array(values, pa.int64())
            continue
        slots = np.array([padded(v, size) for v in values], dtype=np.int64).reshape(-1, size)
        for j in range(size):
            cols[slot_column(f, j)] = pa.array(slots[:, j])
    schema = arrow_schema(sizes, "slots")
    if nullable:
        schema = pa.schema([pa.field(fld.name, fld.type, nullable=True) for fld in schema])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols, schema=schema), path, row_group_size=row_group_size,
                   **write_options(sizes, "slots"))


def make_split(root, layouts: list[str], seed: int = 5) -> Metadata:
    """Three files of 50, 45 and 31 rows (row groups of 7), file k written in `layouts[k]`; the rows
    depend only on `seed`, never on the layouts. DENSE_0 is the row index."""
    rng = np.random.default_rng(seed)
    files, at = [], 0
    for k, (rows, layout) in enumerate(zip((50, 45, 31), layouts)):
        dense = rng.integers(0, 100, (rows, 13))
        dense[:, 0] = np.arange(at, at + rows)
        label, features = rng.integers(0, 2, rows), random_lists(rng, rows, SIZES)
        rel = f"train/part-{k:05d}.parquet"
        writer = write_slots_shard if layout == "slots" else write_shard
        writer(root / rel, label, dense, features, SIZES, 7)
        files.append(rel)
        at += rows
    meta = Metadata(cardinalities=[11] * NUM_SPARSE, multi_hot_sizes=SIZES, splits={"train": SplitInfo(at, 0, files)},
                    sparse_layout="slots" if "slots" in layouts else "lists")
    write_metadata(root, meta)
    return meta


def all_batches(root, kind: str, batch_size: int = 16) -> list[tuple[torch.Tensor, ...]]:
    files = split_files(root, read_metadata(root), "train")
    if kind == "device":
        loader = DeviceLoader(files, batch_size, "cpu", multi_hot_sizes=SIZES, shuffle=True, seed=3)
    else:
        loader = ParquetLoader(files, batch_size, multi_hot_sizes=SIZES, shuffle=True, seed=3, shuffle_buffer_rows=20,
                               compact_sparse=kind == "stream-compact", reader_threads=3)
    out = [(b.dense.clone(), b.sparse.clone(), b.labels.clone()) for b in loader]
    if kind != "device":
        loader.close()
    return out


# -- schema and metadata ------------------------------------------------------------------------


def test_slot_columns_follow_the_in_memory_slots():
    names = sparse_columns(MLPERF_MULTI_HOT_SIZES, "slots")
    offsets = slot_offsets(MLPERF_MULTI_HOT_SIZES)
    assert len(names) == offsets[-1] == 214
    for f, size in enumerate(MLPERF_MULTI_HOT_SIZES):
        want = [SPARSE_COLUMNS[f]] if size == 1 else [f"SPARSE_{f}_{j}" for j in range(size)]
        assert names[offsets[f] : offsets[f + 1]] == want
    schema = arrow_schema(MLPERF_MULTI_HOT_SIZES, "slots")
    assert schema.names == [LABEL_COLUMN, *DENSE_COLUMNS, *names]
    assert all(schema.field(c).type == pa.int64() and not schema.field(c).nullable for c in names)
    assert sparse_columns(None, "slots") == SPARSE_COLUMNS and arrow_schema(None, "slots") == arrow_schema()
    assert write_options(MLPERF_MULTI_HOT_SIZES, "slots") == {"dictionary_pagesize_limit": 65536}
    assert write_options(MLPERF_MULTI_HOT_SIZES, "lists") == {} and write_options(None, "slots") == {}
    with pytest.raises(ValueError, match="sparse layout 'rows' is not one of lists, slots"):
        arrow_schema(SIZES, "rows")


def test_slot_dictionaries_fall_back_to_plain_early(tmp_path):
    """`write_options`' 64 KB dictionary page: a slot column of many distinct ids (MLPerf's uniform extra ids)
    leaves its dictionary after 8,192 of them, one of few distinct ids keeps it; pyarrow's default 1 MB page
    would have dictionary-encoded the first 131,072."""
    rng = np.random.default_rng(0)
    n = 40_000
    table = pa.table({"many": rng.integers(0, 40_000_000, n), "few": rng.integers(0, 1000, n)})

    def dictionary_bytes(**options) -> dict[str, int]:
        """Each column's dictionary page, in bytes (uncompressed: 8 B a distinct id, plus its header)."""
        pq.write_table(table, tmp_path / "t.parquet", compression=None, data_page_size=1 << 14, **options)
        group = pq.ParquetFile(tmp_path / "t.parquet").metadata.row_group(0)
        return {name: group.column(i).data_page_offset - group.column(i).dictionary_page_offset
                for i, name in enumerate(table.column_names)}

    capped, default = dictionary_bytes(**write_options(SIZES, "slots")), dictionary_bytes()
    assert 60_000 < capped["many"] < 2 * 65_536  # filled to about the cap (checked a batch at a time), then plain
    assert default["many"] > 8 * 39_000  # every id of the chunk in the dictionary
    assert capped["few"] == default["few"] < 8 * 1000 + 100  # few distinct ids: the same dictionary either way


def test_metadata_says_version_3_only_for_multi_hot_slots(tmp_path):
    cases = [(SIZES, "slots", 3), (SIZES, "lists", 2), ([1] * NUM_SPARSE, "slots", 2), ([1] * NUM_SPARSE, "lists", 2)]
    for k, (sizes, layout, version) in enumerate(cases):
        root = tmp_path / str(k)
        write_metadata(root, Metadata(cardinalities=[7] * NUM_SPARSE, multi_hot_sizes=sizes, sparse_layout=layout))
        raw = json.loads((root / "metadata.json").read_text())
        assert raw["schema_version"] == version
        assert raw.get("sparse_layout") == ("slots" if version == 3 else None)
        back = read_metadata(root)
        assert back.schema_version == version and back.sparse_layout == ("slots" if version == 3 else "lists")
        assert back.to_json() == raw  # written back as read
    with pytest.raises(ValueError, match="sparse layout 'columns' is not one of lists, slots"):
        Metadata(cardinalities=[7] * NUM_SPARSE, sparse_layout="columns")


@pytest.mark.parametrize("change,message", [
    ({"schema_version": 2, "sparse_layout": "slots"}, r"sparse_layout: is a schema_version 3 key \(this file says version 2\)"),
    ({"schema_version": 3, "sparse_layout": "columns"}, r"sparse_layout: 'columns' is not 'lists' or 'slots'"),
    ({"schema_version": 3, "sparse_layout": 1}, r"sparse_layout: 1 is not 'lists' or 'slots'"),
    ({"schema_version": 5}, r"schema_version: 5 is not a supported version \(1, 2, 3, 4\)"),
])
def test_bad_layout_metadata_is_one_named_error(tmp_path, change, message):
    raw = {**Metadata(cardinalities=[7] * NUM_SPARSE, multi_hot_sizes=SIZES).to_json(), **change}
    (tmp_path / "metadata.json").write_text(json.dumps(raw))
    with pytest.raises(DatasetError, match=r"metadata.json: " + message) as e:
        read_metadata(tmp_path)
    assert "\n" not in str(e.value)


def test_a_version_3_file_without_the_key_reads_as_lists(tmp_path):
    raw = {**Metadata(cardinalities=[7] * NUM_SPARSE, multi_hot_sizes=SIZES).to_json(), "schema_version": 3}
    (tmp_path / "metadata.json").write_text(json.dumps(raw))
    assert read_metadata(tmp_path).sparse_layout == "lists"


# -- loaders ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """The same rows as lists only, slots only, and a mix of both (one file in each, one more in slots)."""
    roots = {}
    for name, layouts in (("lists", ["lists"] * 3), ("slots", ["slots"] * 3), ("mixed", ["slots", "lists", "slots"])):
        roots[name] = tmp_path_factory.mktemp(name)
        make_split(roots[name], layouts)
    return roots


def test_each_file_is_read_in_its_own_layout(splits):
    files = split_files(splits["mixed"], read_metadata(splits["mixed"]), "train")
    assert [open_shard(f, SIZES)[1] for f in files] == ["slots", "lists", "slots"]
    assert [file_layout(pq.read_schema(f), SIZES) for f in files] == ["slots", "lists", "slots"]
    assert file_layout(pq.read_schema(files[0]), None) == "lists"  # one-hot: the layouts coincide


@pytest.mark.parametrize("kind", ["stream", "stream-compact", "device"])
def test_loaders_deliver_the_same_batches_from_either_layout(splits, kind):
    lists = all_batches(splits["lists"], kind)
    _, rows = reference_rows(split_files(splits["lists"], read_metadata(splits["lists"]), "train"), SIZES)
    assert sum(len(b[2]) for b in lists) == len(rows) == 126
    for other in ("slots", "mixed"):
        batches = all_batches(splits[other], kind)
        assert len(batches) == len(lists)
        for (d0, s0, y0), (d1, s1, y1) in zip(lists, batches):
            assert s1.dtype == torch.int64 and torch.equal(s0, s1) and torch.equal(d0, d1) and torch.equal(y0, y1)
    # and every delivered row is the file's row, padded the obvious way
    seen = torch.cat([d[:, 0] for d, _, _ in lists]).expm1().round().long()
    sparse = torch.cat([s for _, s, _ in lists])
    assert torch.equal(sparse, torch.from_numpy(rows)[seen])


def test_host_block_from_slot_columns_equals_from_lists(splits):
    lists = split_files(splits["lists"], read_metadata(splits["lists"]), "train")[0]
    slots = split_files(splits["slots"], read_metadata(splits["slots"]), "train")[0]
    a = _HostBlock.from_table(pq.read_table(lists), SIZES, "lists")
    b = _HostBlock.from_table(pq.read_table(slots), SIZES, "slots")
    assert np.array_equal(a.sparse, b.sparse) and np.array_equal(a.dense, b.dense) and np.array_equal(a.label, b.label)
    assert (b.sparse == PAD_SPARSE).any()  # the fixture's short lists left empty slots


def test_slot_column_statistics_decide_the_compact_form(tmp_path):
    make_split(tmp_path, ["slots"] * 3)
    files = split_files(tmp_path, read_metadata(tmp_path), "train")
    assert compact_sparse_ok([pq.ParquetFile(f).metadata for f in files], (-2, 0xFFFFFFFE))
    # a slot column holding 0xFFFFFFFE (-2's bit pattern in int32) must keep the split int64
    rng = np.random.default_rng(0)
    features = random_lists(rng, 5, SIZES)
    features[20] = [[0xFFFFFFFE]] * 5
    write_slots_shard(tmp_path / "big.parquet", np.zeros(5), np.zeros((5, 13)), features, SIZES, 5)
    assert not compact_sparse_ok([pq.ParquetFile(tmp_path / "big.parquet").metadata], (-2, 0xFFFFFFFE))
    batch = next(iter(ParquetLoader([tmp_path / "big.parquet"], 5, multi_hot_sizes=SIZES, compact_sparse=True)))
    at = slot_offsets(SIZES)[20]
    assert (batch.sparse[:, at] == 0xFFFFFFFE).all() and (batch.sparse[:, at + 1 : at + 5] == PAD_SPARSE).all()


# -- checks ---------------------------------------------------------------------------------------


def test_null_slots_hold_no_value_and_are_logged_once(tmp_path):
    rng = np.random.default_rng(1)
    features = random_lists(rng, 9, SIZES)
    path = tmp_path / "n.parquet"
    write_slots_shard(path, np.zeros(9), np.zeros((9, 13)), features, SIZES, 4, nullable=True)
    table = pq.read_table(path)
    column = slot_column(20, 1)
    values = table.column(column).to_numpy().copy()
    mask = np.zeros(9, bool)
    mask[[0, 4, 8]] = True
    table = table.set_column(table.schema.get_field_index(column), column,
                             pa.array(values, pa.int64(), mask=mask))
    pq.write_table(table, path, row_group_size=4)
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        for loader in (ParquetLoader([path], 9, multi_hot_sizes=SIZES), DeviceLoader([path], 9, "cpu", multi_hot_sizes=SIZES)):
            got = next(iter(loader)).sparse[:, slot_offsets(SIZES)[20] + 1]
            want = torch.from_numpy(np.where(mask, PAD_SPARSE, values))
            assert torch.equal(got, want)
    finally:
        logger.remove(sink)
    assert len(messages) == 1  # once per file and process, not once a loader: its three nulls in one line
    assert all("3 null multi-hot slots replaced by no value (-2) (SPARSE_20_1 3)" in m for m in messages)


def test_slot_schema_mismatches_name_the_column(tmp_path):
    rng = np.random.default_rng(2)
    features = random_lists(rng, 4, SIZES)
    path = tmp_path / "s.parquet"
    write_slots_shard(path, np.zeros(4), np.zeros((4, 13)), features, SIZES, 4)
    table = pq.read_table(path)

    def refused(t: pa.Table, message: str) -> None:
        bad = tmp_path / "bad.parquet"
        pq.write_table(t, bad)
        with pytest.raises(DatasetError, match=message) as e:
            ParquetLoader([bad], 4, multi_hot_sizes=SIZES)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)

    refused(table.drop_columns([slot_column(20, 4)]), r"column SPARSE_20_4: missing")
    refused(table.append_column("SPARSE_20_5", table.column(slot_column(20, 0))), r"column SPARSE_20_5: not part of")
    i = table.schema.get_field_index(slot_column(3, 1))
    refused(table.set_column(i, slot_column(3, 1), table.column(i).cast(pa.int32())),
            r"column SPARSE_3_1: type int32 is not int64")
    # feature 0 in slots, feature 3 as a list: the file is held to its first multi-hot feature's layout
    mixed = table.drop_columns([slot_column(3, 0), slot_column(3, 1)])
    at = mixed.schema.get_field_index("SPARSE_4")
    mixed = mixed.add_column(at, "SPARSE_3", pa.array(features[3], pa.list_(pa.int64())))
    refused(mixed, r"column SPARSE_3_0: missing")
    # and multi_hot_sizes that disagree with the file's slot count
    other = list(SIZES)
    other[20] = 6
    with pytest.raises(DatasetError, match=r"column SPARSE_20_5: missing"):
        ParquetLoader([path], 4, multi_hot_sizes=other)


def test_training_loader_suggests_slot_columns_for_list_files(splits):
    """The training loader logs how to rewrite list columns (any file of the split) as slot columns; not for slots."""
    from dlrm.config import load_config
    from dlrm.train.trainer import make_loader
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "sample.json")
    for name, hinted in (("lists", True), ("mixed", True), ("slots", False)):
        messages: list[str] = []
        handle = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
        try:
            loader = make_loader(cfg, split_files(splits[name], read_metadata(splits[name]), "train"), 16,
                                 torch.device("cpu"), train=True, placement="stream", multi_hot_sizes=SIZES)
            loader.close()
        finally:
            logger.remove(handle)
        assert any("python -m dlrm.data.relayout" in m for m in messages) == hinted, (name, messages)
