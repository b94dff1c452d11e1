"""The preprocessor's multi-hot fields (issue #22): ``,``-separated hex values per categorical
field, padded slots, the bad-line policy for too many or empty values, every value counted; and
their two layouts on disk (``--sparse-layout``: list columns or one column a slot)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data import synthetic
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.preprocess import PROGRESS_DIR, BadLineError, PreprocessError, _Interrupted, parse_chunk, preprocess
from dlrm.data.preprocess.stats import sparse_stats
from dlrm.data.preprocess.worker import _stats_from_shard
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    MISSING_SPARSE,
    NUM_SPARSE,
    PAD_SPARSE,
    SPARSE_COLUMNS,
    SPARSE_LAYOUTS,
    arrow_schema,
    read_metadata,
    slot_column,
    slot_offsets,
)
from dlrm.data.vocabulary import read_vocabulary

SIZES = [1] * NUM_SPARSE
SIZES[0], SIZES[2] = 3, 2  # C1 holds up to 3 values, C3 up to 2; L = 29


def line(label: int, c1: str, c3: str, c2: str = "0a") -> str:
    cats = [c1, c2, c3] + ["ff"] * (NUM_SPARSE - 3)
    return "\t".join([str(label)] + ["1"] * 13 + cats) + "\n"


def test_parse_pads_each_field_to_its_size():
    data = (line(0, "1,2,3", "a") + line(1, "", "b,c") + line(0, "AbCdEf01", "")).encode()
    parsed = parse_chunk(data, multi_hot_sizes=SIZES)
    assert parsed.sparse.shape == (29, 3)
    s = parsed.sparse.T
    assert s[:, 0:3].tolist() == [[1, 2, 3], [PAD_SPARSE] * 3, [0xABCDEF01, PAD_SPARSE, PAD_SPARSE]]
    assert s[:, 3].tolist() == [10, 10, 10]  # C2, one-hot
    assert s[:, 4:6].tolist() == [[10, PAD_SPARSE], [11, 12], [PAD_SPARSE, PAD_SPARSE]]
    # one-hot parsing of the same columns is unchanged by the option's existence
    assert parse_chunk(line(0, "1", "2").encode()).sparse.shape == (26, 1)


@pytest.mark.parametrize("c1,detail", [("1,2,3,4", "holds more than 3 values (--multi-hot-sizes)"),
                                       ("1,,2", "holds an empty value"),
                                       ("1,zz", "holds a value that is not a hexadecimal category hash"),
                                       ("1,", "holds an empty value")])
def test_bad_multi_hot_fields_follow_the_bad_line_policy(c1, detail):
    data = (line(0, "1", "2") + line(1, c1, "2") + line(0, "5,6", "7")).encode()
    with pytest.raises(BadLineError) as e:
        parse_chunk(data, source="x.tsv", multi_hot_sizes=SIZES)
    assert e.value.bad.line == 2 and e.value.bad.column == "C1" and detail in e.value.bad.message()
    skipped = parse_chunk(data, on_bad_line="skip", multi_hot_sizes=SIZES)
    assert skipped.bad == {"bad_category": 1} and skipped.num_rows == 2
    assert skipped.sparse.T[:, 0:3].tolist() == [[1, PAD_SPARSE, PAD_SPARSE], [5, 6, PAD_SPARSE]]


EMPTY_VALUE = ("holds an empty value (',,', or ',' at its start or end): a multi-hot field's values are hexadecimal "
               "category hashes separated by ','")


@pytest.mark.parametrize("c1,detail", [
    ("1,,2", EMPTY_VALUE),
    (",1", EMPTY_VALUE),
    ("1,zz,2", "holds a value that is not a hexadecimal category hash (1 to 8 hex digits)")])
def test_a_bad_multi_hot_field_is_not_said_to_be_a_one_value_column(tmp_path, c1, detail):
    """A bad value list in a column whose --multi-hot-sizes size is 3: the line said "(',' separates a multi-hot
    field's values: this column's --multi-hot-sizes size is 1, or none given)", the advice for a one-value column,
    which sent the user to check a size that was right."""
    from tests.test_preprocess import error_lines, run_cli

    src = tmp_path / "a.tsv"
    src.write_text(line(0, "1", "2") + line(1, c1, "2") + line(0, "5,6", "7"))
    sizes = ",".join(map(str, SIZES))
    r = run_cli(["-i", str(src), "-o", str(tmp_path / "ds"), "--workers", "1", "--multi-hot-sizes", sizes])
    assert r.exit_code == 2 and not (tmp_path / "ds").exists()
    assert error_lines(r) == [f"error: {src}:2: column C1: '{c1}' {detail}"], r.stderr


def test_csv_is_refused_with_multi_hot(tmp_path):
    (tmp_path / "a.tsv").write_text(line(0, "1", "2"))
    with pytest.raises(PreprocessError, match="--multi-hot-sizes: needs --format tsv"):
        preprocess([tmp_path / "a.tsv"], tmp_path / "out", input_format="csv", multi_hot_sizes=SIZES)
    with pytest.raises(PreprocessError, match="--multi-hot-sizes: '3,2' is not"):
        preprocess([tmp_path / "a.tsv"], tmp_path / "out", multi_hot_sizes="3,2")


def test_vocabulary_counts_every_value(tmp_path):
    lines = [line(0, "a,b,a", "1"), line(1, "a", "1,2"), line(0, "c", "3")]
    (tmp_path / "a.tsv").write_text("".join(lines))
    meta = preprocess([tmp_path / "a.tsv"], tmp_path / "out", split="random", validation_fraction=0.0,
                      test_fraction=0.0, hashing="vocabulary", min_frequency=2, multi_hot_sizes=SIZES,
                      workers=1, progress=False)
    assert meta.multi_hot_sizes == SIZES and read_metadata(tmp_path / "out").multi_hot_sizes == SIZES
    assert read_vocabulary(tmp_path / "out", 0, meta.cardinalities[0]).tolist() == [0xA]  # a: 3 times; b, c: once
    assert read_vocabulary(tmp_path / "out", 2, meta.cardinalities[2]).tolist() == [1]
    assert meta.extra["distinct_counts"][:3] == [3, 1, 3]


@pytest.mark.parametrize("layout", SPARSE_LAYOUTS)
def test_synthetic_multi_hot_tsv_round_trips_through_the_preprocessor(tmp_path, layout):
    sizes = "3,2,1,1,6,1,1,1,1,1,1,1,1,4,1,1,1,1,1,5,1,1,1,1,1,1"
    gen = synthetic.generate(tmp_path / "syn", 1500, seed=2, cardinalities="tiny", multi_hot_sizes=sizes,
                             multi_hot_fill="variable", raw_tsv=tmp_path / "raw.txt", test_fraction=0,
                             validation_fraction=0)
    meta = preprocess([tmp_path / "raw.txt"], tmp_path / "pre", split="random", validation_fraction=0.0,
                      test_fraction=0.0, multi_hot_sizes=sizes, sparse_layout=layout, workers=1, progress=False)
    assert meta.multi_hot_sizes == gen.multi_hot_sizes and meta.splits["train"].rows == 1500
    assert meta.sparse_layout == layout
    got = [torch.cat([b.sparse for b in ParquetLoader(split_files(root, m, "train"), 512,
                                                      multi_hot_sizes=m.multi_hot_sizes)])
           for root, m in ((tmp_path / "syn", gen), (tmp_path / "pre", meta))]
    assert got[0].shape == (1500, slot_offsets(gen.multi_hot_sizes)[-1])
    np.testing.assert_array_equal(got[0].numpy(), got[1].numpy())


# ------------------------------------------------------------------------------------------
# --sparse-layout: the same rows as list columns or as one int64 column a slot


def random_lines(n: int, seed: int = 0, pool: int = 40) -> str:
    """``n`` TSV lines in the fields of `SIZES`: multi-hot fields of 0 to size values from a pool
    of `pool` (repeats, so that frequencies differ), one-hot fields missing one time in ten."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        cats = []
        for size in SIZES:
            count = int(rng.integers(0, size + 1)) if size > 1 else int(rng.random() > 0.1)
            cats.append(",".join(f"{int(v):x}" for v in rng.integers(0, pool, count)))
        dense = [str(v) for v in rng.integers(0, 100, 13)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]) + "\n")
    return "".join(lines)


def run(tmp_path: Path, name: str, src: Path, **kw):
    """`preprocess` of `src` into ``tmp_path / name``, multi-hot in `SIZES`, a fifth validation."""
    return preprocess([src], tmp_path / name, split="random", validation_fraction=0.2, test_fraction=0.0,
                      multi_hot_sizes=SIZES, workers=1, progress=False, **kw)


def dataset_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def padded_lists(table: pa.Table, f: int) -> list[tuple]:
    """Feature f's lists in a "lists" shard, padded with `PAD_SPARSE` to its size: its slots."""
    return [tuple(v + [PAD_SPARSE] * (SIZES[f] - len(v))) for v in table.column(SPARSE_COLUMNS[f]).to_pylist()]


def slot_rows(table: pa.Table, f: int) -> list[tuple]:
    """Feature f's slots in a "slots" shard, row by row."""
    return list(zip(*(table.column(slot_column(f, j)).to_pylist() for j in range(SIZES[f]))))


def assert_same_rows(lists: pa.Table, slots: pa.Table) -> None:
    """The two layouts of one shard hold the same rows: slot j of a multi-hot feature is the j-th
    value of its list, or `PAD_SPARSE` past its end; every other column is the same."""
    for f, size in enumerate(SIZES):
        if size == 1:
            assert lists.column(SPARSE_COLUMNS[f]).equals(slots.column(SPARSE_COLUMNS[f])), f
        else:
            assert padded_lists(lists, f) == slot_rows(slots, f), f
    flat = [LABEL_COLUMN, *DENSE_COLUMNS]
    assert lists.select(flat).equals(slots.select(flat))


def test_both_layouts_hold_the_same_values_slot_by_slot(tmp_path):
    src = tmp_path / "a.tsv"
    src.write_text(random_lines(300, seed=1))
    metas = {layout: run(tmp_path, layout, src, sparse_layout=layout, chunk_rows=100) for layout in SPARSE_LAYOUTS}
    assert metas["lists"].splits == metas["slots"].splits and metas["slots"].splits["validation"].rows > 0
    assert metas["lists"].cardinalities == metas["slots"].cardinalities
    for rel in [f for info in metas["slots"].splits.values() for f in info.files]:
        lists, slots = (pq.read_table(tmp_path / layout / rel) for layout in SPARSE_LAYOUTS)
        assert lists.schema == arrow_schema(SIZES, "lists") and pa.types.is_list(lists.schema.field("SPARSE_0").type)
        assert slots.schema == arrow_schema(SIZES, "slots")
        assert slots.column_names[14:21] == ["SPARSE_0_0", "SPARSE_0_1", "SPARSE_0_2", "SPARSE_1", "SPARSE_2_0",
                                             "SPARSE_2_1", "SPARSE_3"]
        assert all(slots.schema.field(c).type == pa.int64() for c in slots.column_names[14:])
        assert_same_rows(lists, slots)
    every = [c for t in [slot_rows(pq.read_table(tmp_path / "slots" / rel), 0)
                         for rel in metas["slots"].splits["train"].files] for c in t]
    assert (PAD_SPARSE,) * 3 in every and any(PAD_SPARSE not in row for row in every)  # empty and full lists
    for layout, version in (("lists", 2), ("slots", 3)):
        raw = json.loads((tmp_path / layout / "metadata.json").read_text())
        assert raw["schema_version"] == version and raw.get("sparse_layout", "lists") == layout
        assert ("sparse_layout" in raw) == (layout == "slots")  # version 2 has no such key
        assert read_metadata(tmp_path / layout).sparse_layout == layout == raw["extra"]["options"]["sparse_layout"]


def test_every_column_starts_with_a_dictionary_in_either_layout(tmp_path):
    """`write_options`: slot columns keep pyarrow's dictionary (its page capped at 64 KB, which a column of
    this few distinct ids never reaches); a "lists" shard is written as before the option existed."""
    src = tmp_path / "a.tsv"
    src.write_text(random_lines(100, seed=2))
    for layout in SPARSE_LAYOUTS:
        meta = run(tmp_path, layout, src, sparse_layout=layout)
        group = pq.ParquetFile(tmp_path / layout / meta.splits["train"].files[0]).metadata.row_group(0)
        dictionary = {group.column(i).path_in_schema: group.column(i).has_dictionary_page
                      for i in range(group.num_columns)}
        slots = {c for c in dictionary if c.startswith(("SPARSE_0_", "SPARSE_2_"))}
        assert len(slots) == (5 if layout == "slots" else 0)
        assert all(dictionary.values())


def test_default_layout_is_slots_and_one_hot_data_ignore_it(tmp_path):
    src = tmp_path / "a.tsv"
    src.write_text(random_lines(50, seed=3))
    meta = run(tmp_path, "default", src)
    assert meta.sparse_layout == "slots" and read_metadata(tmp_path / "default").schema_version == 3
    assert pq.read_schema(tmp_path / "default" / meta.splits["train"].files[0]) == arrow_schema(SIZES, "slots")
    # one-hot: both layouts are the same files, recorded as version 2's "lists"
    (tmp_path / "one.tsv").write_text("".join(line(i % 2, f"{i:x}", "b") for i in range(40)))
    for layout in (None, *SPARSE_LAYOUTS):
        meta = preprocess([tmp_path / "one.tsv"], tmp_path / f"one-{layout}", sparse_layout=layout, workers=1,
                          progress=False)
        raw = json.loads((tmp_path / f"one-{layout}" / "metadata.json").read_text())
        assert meta.sparse_layout == "lists" and raw["schema_version"] == 2 and "sparse_layout" not in raw
        assert "sparse_layout" not in raw["extra"]["options"]
    assert dataset_bytes(tmp_path / "one-slots") == dataset_bytes(tmp_path / "one-lists") == \
        dataset_bytes(tmp_path / "one-None")


def test_bad_layout_is_refused_naming_the_option(tmp_path):
    src = tmp_path / "a.tsv"
    src.write_text(random_lines(5))
    for bad in ("rows", "", 2, "Slots"):
        with pytest.raises(PreprocessError, match=f"^--sparse-layout: {bad!r} is not one of lists, slots$"):
            run(tmp_path, "out", src, sparse_layout=bad)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", SPARSE_LAYOUTS)
def test_resume_keeps_the_layout_it_started_with(tmp_path, layout):
    """An interrupted run resumed without --sparse-layout goes on in its own layout (table
    statistics of its finished chunks re-read from their shards: no checkpoint) and ends with the
    bytes of an uninterrupted run; another layout, given explicitly, is refused."""
    src = tmp_path / "a.tsv"
    src.write_text(random_lines(400, seed=4, pool=400))  # values seen once or twice: min_frequency 2 tells
    kw = dict(chunk_rows=50, hashing="vocabulary", min_frequency=2, checkpoint_interval=1e9)
    run(tmp_path, "ref", src, sparse_layout=layout, **kw)
    with pytest.raises(_Interrupted):
        run(tmp_path, "out", src, sparse_layout=layout, _max_new_chunks=3, **kw)
    other = "slots" if layout == "lists" else "lists"
    with pytest.raises(PreprocessError, match=f"sparse-layout: '{layout}' \\(earlier run\\) vs '{other}' \\(now\\)"):
        run(tmp_path, "out", src, sparse_layout=other, **kw)
    with pytest.raises(PreprocessError, match=r"multi-hot-sizes: \[3, 1, 2, .*\(earlier run\) vs 'one-hot' \(now\)"):
        preprocess([src], tmp_path / "out", split="random", validation_fraction=0.2, test_fraction=0.0, workers=1,
                   progress=False, **kw)
    assert not (tmp_path / "out" / PROGRESS_DIR / "stats.npz").exists()
    meta = run(tmp_path, "out", src, **kw)
    assert meta.sparse_layout == layout
    assert dataset_bytes(tmp_path / "out") == dataset_bytes(tmp_path / "ref")


def test_a_run_recorded_without_a_layout_resumes_as_lists(tmp_path):
    """The options of a run begun before --sparse-layout existed lack the key: it wrote lists, so it
    resumes as lists (not the new default); asking for slots is refused."""
    src = tmp_path / "a.tsv"
    src.write_text(random_lines(200, seed=5))
    kw = dict(chunk_rows=50, checkpoint_interval=1e9)
    run(tmp_path, "ref", src, sparse_layout="lists", **kw)
    with pytest.raises(_Interrupted):
        run(tmp_path, "out", src, sparse_layout="lists", _max_new_chunks=2, **kw)
    manifest_path = tmp_path / "out" / PROGRESS_DIR / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["options"].pop("sparse_layout") == "lists"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(PreprocessError, match=r"sparse-layout: 'lists' \(earlier run\) vs 'slots' \(now\)"):
        run(tmp_path, "out", src, sparse_layout="slots", **kw)
    meta = run(tmp_path, "out", src, **kw)
    assert meta.sparse_layout == "lists"
    assert dataset_bytes(tmp_path / "out") == dataset_bytes(tmp_path / "ref")


@pytest.mark.parametrize("cap", [None, 2])
@pytest.mark.parametrize("layout", SPARSE_LAYOUTS)
def test_stats_from_a_shard_equal_the_in_memory_stats(tmp_path, layout, cap):
    """What a resumed run re-reads from a train shard is what the chunk counted in memory: the
    padding of empty slots (-2) and missing values (-1) count in neither."""
    parsed = parse_chunk(random_lines(200, seed=6).encode(), multi_hot_sizes=SIZES)
    assert (parsed.sparse == PAD_SPARSE).any() and (parsed.sparse == MISSING_SPARSE).any()
    path = tmp_path / "train.parquet"
    pq.write_table(parsed.to_table(None, SIZES, layout), path)
    key, got = _stats_from_shard((str(path), 1, 7, cap, SIZES, layout))
    want = sparse_stats(parsed.sparse, cap, SIZES)
    assert key == (1, 7) and len(got) == len(want) == NUM_SPARSE
    for f, ((values, counts), (want_values, want_counts)) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(values, want_values, err_msg=f"feature {f}")
        assert values.dtype == want_values.dtype and (counts is None) == (want_counts is None) == (cap is None)
        if cap is not None:
            np.testing.assert_array_equal(counts, want_counts, err_msg=f"feature {f}")


def test_both_layouts_load_as_the_same_batches(tmp_path):
    """The loader reads either layout from the file's own schema: the same batches, whose sparse
    slots are those the parser made of the raw lines."""
    text = random_lines(500, seed=7)
    (tmp_path / "a.tsv").write_text(text)
    batches = {}
    for layout in SPARSE_LAYOUTS:
        meta = preprocess([tmp_path / "a.tsv"], tmp_path / layout, split="random", validation_fraction=0.0,
                          test_fraction=0.0, multi_hot_sizes=SIZES, sparse_layout=layout, chunk_rows=200, workers=1,
                          progress=False)
        batches[layout] = list(ParquetLoader(split_files(tmp_path / layout, meta, "train"), 64,
                                             multi_hot_sizes=SIZES))
    assert len(batches["lists"]) == len(batches["slots"]) == 8
    for a, b in zip(batches["lists"], batches["slots"]):
        for name in ("dense", "sparse", "labels"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    sparse = torch.cat([b.sparse for b in batches["slots"]]).numpy()
    np.testing.assert_array_equal(sparse, parse_chunk(text.encode(), multi_hot_sizes=SIZES).sparse.T)
