"""The synthetic Criteo-format generator: determinism, schema, Criteo-like shape, the planted
oracle, the raw TSV twin, and safe handling of existing output."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dlrm.data import synthetic
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    NUM_DENSE,
    NUM_SPARSE,
    PAD_SPARSE,
    SPARSE_COLUMNS,
    arrow_schema,
    read_metadata,
    slot_column,
)
from tests.conftest import REPO
from tests.shared_once import computed_once


def read_split(root, split):
    """All rows of one split in file order: (label [n], dense [n, 13], sparse [n, 26])."""
    meta = read_metadata(root)
    tables = [pq.read_table(root / f) for f in meta.splits[split].files]
    for t in tables:
        assert t.schema.equals(arrow_schema())
    label = np.concatenate([t.column(LABEL_COLUMN).to_numpy() for t in tables])
    dense = np.stack([np.concatenate([t.column(c).to_numpy() for t in tables]) for c in DENSE_COLUMNS], axis=1)
    sparse = np.stack([np.concatenate([t.column(c).to_numpy() for t in tables]) for c in SPARSE_COLUMNS], axis=1)
    return label, dense, sparse


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """60k rows of the "small" preset, with the raw TSV twin."""
    root = tmp_path_factory.mktemp("syn")
    meta = synthetic.generate(root / "ds", 60_000, seed=3, cardinalities="small", raw_tsv=root / "train.txt",
                              rows_per_file=25_000)
    return root / "ds", root / "train.txt", meta


def test_metadata_and_layout(generated):
    ds, _, meta = generated
    back = read_metadata(ds)
    assert back.cardinalities == synthetic.CARDINALITY_PRESETS["small"]
    assert back.hashing == "modulus" and back.missing_sparse == -1
    assert {s: back.splits[s].rows for s in back.splits} == {"train": 48_000, "validation": 6_000, "test": 6_000}
    # 25k rows per file: train spans two files
    assert back.splits["train"].files == ["train/part-00000.parquet", "train/part-00001.parquet"]
    for split, info in back.splits.items():
        label, _, _ = read_split(ds, split)
        assert label.size == info.rows and int(label.sum()) == info.positives
    assert set(back.extra["oracle_auc"]) == {"train", "validation", "test"}
    assert back.extra["command"].startswith("python -m dlrm.data.synthetic --rows 60000 ")
    assert meta.extra["teacher"]["bias"] == back.extra["teacher"]["bias"]


def test_criteo_like_shape(generated):
    ds, _, _ = generated
    label, dense, sparse = read_split(ds, "train")
    assert abs(label.mean() - synthetic.TARGET_POSITIVE_RATE) < 0.015
    cards = synthetic.CARDINALITY_PRESETS["small"]
    missing = (sparse == -1).mean(axis=0)
    np.testing.assert_allclose(missing, synthetic._SPARSE_MISSING, atol=0.015)
    assert ((sparse == -1) | ((sparse >= 0) & (sparse < 2**32))).all()
    # dense: missing stored as 0; only DENSE_1 (Criteo's I2) goes negative, and only to -1..-3
    assert (dense[:, [j for j in range(NUM_DENSE) if j != 1]] >= 0).all()
    assert dense[:, 1].min() >= -3 and (dense[:, 1] < 0).any()
    zero = (dense == 0).mean(axis=0)
    assert (zero >= synthetic._DENSE_MISSING - 0.015).all()
    for f in range(NUM_SPARSE):
        present = sparse[:, f][sparse[:, f] >= 0]
        values, counts = np.unique(present, return_counts=True)
        assert values.size <= cards[f] - 1  # row 0 of each table is the missing row
        if cards[f] > 200:
            # Zipf-like: the head carries a large share, and frequencies fall with the category rank
            ids = synthetic.category_ids(3, f, cards[f], present)
            freq = np.bincount(ids, minlength=cards[f])
            assert freq[0] > freq[1] > freq[10] > freq[100] and freq[:10].sum() > 0.3 * present.size


def test_category_hash_is_an_invertible_bijection():
    ids = np.arange(3999, dtype=np.int64)
    values = synthetic.category_values(7, 2, 4000, ids)
    assert np.unique(values).size == ids.size and (values >= 0).all() and (values < 2**32).all()
    np.testing.assert_array_equal(synthetic.category_ids(7, 2, 4000, values), ids)
    assert not np.array_equal(values, synthetic.category_values(8, 2, 4000, ids))


def test_oracle_auc_is_the_teachers_auc(generated):
    ds, _, meta = generated
    teacher = synthetic.Teacher(3, meta.cardinalities, bias=meta.extra["teacher"]["bias"])
    for split in ("validation", "test"):
        label, dense, sparse = read_split(ds, split)
        p = teacher.probability_of_stored(dense, sparse)
        assert synthetic.rank_auc(p, label) == pytest.approx(meta.extra["oracle_auc"][split], abs=1e-12)
        # the labels really are Bernoulli(p): calibration in probability deciles
        edges = np.quantile(p, np.linspace(0, 1, 6))
        bins = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, 4)
        for b in range(5):
            assert abs(label[bins == b].mean() - p[bins == b].mean()) < 0.03
    assert 0.7 < meta.extra["oracle_auc"]["validation"] < 0.9


def test_rank_auc_matches_brute_force_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 200).astype(float)  # many ties
    labels = rng.integers(0, 2, 200)
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    assert synthetic.rank_auc(scores, labels) == pytest.approx(brute, abs=1e-15)
    assert synthetic.rank_auc(scores, np.ones(200)) is None


def test_raw_tsv_is_the_same_rows_in_kaggle_format(generated):
    ds, tsv, meta = generated
    lines = tsv.read_text().split("\n")
    assert lines[-1] == "" and len(lines) - 1 == 60_000
    rows = [ln.split("\t") for ln in lines[:-1]]
    assert {len(r) for r in rows} == {1 + NUM_DENSE + NUM_SPARSE}
    parts = [read_split(ds, s) for s in ("train", "validation", "test")]  # TSV order: train, validation, test
    label = np.concatenate([p[0] for p in parts])
    dense = np.concatenate([p[1] for p in parts])
    sparse = np.concatenate([p[2] for p in parts])
    cols = list(zip(*rows))
    np.testing.assert_array_equal(np.array(cols[0], dtype=np.int64), label)
    for j in range(NUM_DENSE):
        text = np.array(cols[1 + j])
        empty = text == ""
        # a missing count is an empty field in the raw file and 0 in parquet
        assert (dense[empty, j] == 0).all()
        np.testing.assert_array_equal(text[~empty].astype(np.int64), dense[~empty, j])
    for f in range(NUM_SPARSE):
        text = np.array(cols[1 + NUM_DENSE + f])
        empty = text == ""
        np.testing.assert_array_equal(empty, sparse[:, f] == -1)
        assert all(len(h) == 8 for h in text[~empty][:100])
        np.testing.assert_array_equal([int(h, 16) for h in text[~empty]], sparse[~empty, f])


def test_same_seed_same_rows_whatever_the_file_layout(tmp_path):
    a = synthetic.generate(tmp_path / "a", 3_000, seed=5, rows_per_file=1_000)
    synthetic.generate(tmp_path / "b", 3_000, seed=5)
    synthetic.generate(tmp_path / "c", 3_000, seed=6)
    assert len(a.splits["train"].files) == 3
    for split in ("train", "validation", "test"):
        for x, y in zip(read_split(tmp_path / "a", split), read_split(tmp_path / "b", split)):
            np.testing.assert_array_equal(x, y)
    assert not np.array_equal(read_split(tmp_path / "a", "train")[2], read_split(tmp_path / "c", "train")[2])


def test_refuses_to_overwrite_without_flag_and_replaces_with_it(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    runner = CliRunner()
    res = runner.invoke(synthetic.main, ["--rows", "500", "--out", str(out)])
    assert res.exit_code != 0
    assert "refusing to overwrite" in res.output and str(out) in res.output
    assert (out / "keep.txt").read_text() == "user data" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]  # no temporary left behind

    # --overwrite replaces a dataset only: a folder of other files is refused in one line, kept as it is
    res = runner.invoke(synthetic.main, ["--rows", "500", "--out", str(out), "--overwrite"])
    assert res.exit_code == 2 and f"--out {out}: refusing to replace it: it holds no dataset (no metadata.json; it " \
        "has keep.txt)" in res.output, res.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "metadata.json").write_text("{}")  # (a dataset's mark: replaced whole, the user's file with it)
    res = runner.invoke(synthetic.main, ["--rows", "500", "--out", str(out), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert not (out / "keep.txt").exists() and read_metadata(out).splits["train"].rows == 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


@pytest.mark.parametrize("args, needle", [
    (["--rows", "0"], "--rows"),
    (["--rows", "10", "--cardinalities", "huge"], "--cardinalities"),
    (["--rows", "10", "--validation-fraction", "0.6", "--test-fraction", "0.5"], "no training rows"),
])
def test_bad_arguments_fail_with_a_named_error(tmp_path, args, needle):
    res = CliRunner().invoke(synthetic.main, args + ["--out", str(tmp_path / "ds")])
    assert res.exit_code != 0 and needle in res.output
    assert not (tmp_path / "ds").exists()


def test_embedded_sample_is_what_its_command_regenerates(tmp_path):
    sample = REPO / "data" / "sample"
    meta = read_metadata(sample)
    assert sum(p.stat().st_size for p in sample.rglob("*") if p.is_file()) < 8 * 2**20
    argv = shlex.split(meta.extra["command"])
    assert argv[:3] == ["python", "-m", "dlrm.data.synthetic"]
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    res = CliRunner().invoke(synthetic.main, argv[3:])
    assert res.exit_code == 0, res.output
    again = read_metadata(tmp_path / "again")
    assert again.cardinalities == meta.cardinalities and again.extra["oracle_auc"] == meta.extra["oracle_auc"]
    for split in meta.splits:
        for x, y in zip(read_split(sample, split), read_split(tmp_path / "again", split)):
            np.testing.assert_array_equal(x, y)


# --- --sparse-layout: multi-hot features as list columns or as one column a slot ---------------------

LAYOUT_SIZES = [3, 1, 2] + [1] * 22 + [5]  # three multi-hot features, one of them the last column


def feature_slots(table, f, size):
    """Feature f of a pyarrow table as int64 slots [n, size] whatever its layout: the slot columns as they
    are, a list column's lists padded with -2 (`PAD_SPARSE`), a one-hot column as one slot."""
    if size == 1:
        return table.column(SPARSE_COLUMNS[f]).to_numpy()[:, None]
    if slot_column(f, 0) in table.schema.names:
        return np.stack([table.column(slot_column(f, j)).to_numpy() for j in range(size)], axis=1)
    lists = table.column(SPARSE_COLUMNS[f]).to_pylist()
    return np.array([v + [PAD_SPARSE] * (size - len(v)) for v in lists], dtype=np.int64).reshape(-1, size)


def layout_dataset(root, name, **kwargs):
    """The 3,000 rows of seed 7, three files of train, variable multi-hot lists, with their raw TSV."""
    return synthetic.generate(root / name, 3_000, seed=7, cardinalities="tiny", rows_per_file=1_000,
                              multi_hot_sizes=LAYOUT_SIZES, multi_hot_fill="variable", raw_tsv=root / f"{name}.txt",
                              **kwargs)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same seed written as "lists", as "slots" and with the default layout: made once per test run and shared by
    the pytest-xdist workers (`tests.shared_once`; 6.4 s on one thread of a loaded 2-core machine, paid by each
    worker that ran one of the five tests using it); tests only read it."""

    def make(root: Path) -> None:
        for name, kwargs in (("lists", {"sparse_layout": "lists"}), ("slots", {"sparse_layout": "slots"}),
                             ("default", {})):
            layout_dataset(root, name, **kwargs)

    return computed_once(tmp_path_factory, "synthetic-layouts", make)


def test_both_layouts_hold_the_same_rows_slot_by_slot(layouts):
    """Same seed, same values: a list padded with -2 is its slot columns, in every file of every split; labels,
    dense counts, one-hot features, split counts, oracle AUCs and the raw TSV are the same."""
    lists, slots = read_metadata(layouts / "lists"), read_metadata(layouts / "slots")
    assert lists.splits == slots.splits and len(lists.splits["train"].files) == 3
    assert lists.extra["oracle_auc"] == slots.extra["oracle_auc"]
    pads = 0
    for split, info in lists.splits.items():
        for rel in info.files:
            a, b = pq.read_table(layouts / "lists" / rel), pq.read_table(layouts / "slots" / rel)
            for name in [LABEL_COLUMN, *DENSE_COLUMNS]:
                assert a.column(name).equals(b.column(name)), (rel, name)
            for f, size in enumerate(LAYOUT_SIZES):
                got = feature_slots(b, f, size)
                np.testing.assert_array_equal(feature_slots(a, f, size), got, err_msg=f"{rel} SPARSE_{f}")
                pads += int((got == PAD_SPARSE).sum())
    assert pads > 0  # variable fill: short lists, so the slot columns hold -2
    assert (layouts / "lists.txt").read_text() == (layouts / "slots.txt").read_text()


def test_each_layouts_schema_and_metadata(layouts):
    """lists: one list<int64> column a multi-hot feature, schema_version 2 and no sparse_layout key (what it always
    was); slots: SPARSE_<f>_<j> int64 columns, each with a dictionary (few distinct ids here: `write_options` caps
    its page at 64 KB), schema_version 3 and sparse_layout "slots". The regenerate command names the layout."""
    for layout, version in (("lists", 2), ("slots", 3)):
        meta = read_metadata(layouts / layout)
        raw = json.loads((layouts / layout / "metadata.json").read_text())
        assert raw["schema_version"] == version and meta.sparse_layout == layout
        assert raw.get("sparse_layout") == (None if layout == "lists" else "slots")
        assert f"--multi-hot-fill variable --sparse-layout {layout}" in meta.extra["command"]
        footer = pq.ParquetFile(layouts / layout / meta.splits["train"].files[0])
        assert footer.schema_arrow.equals(arrow_schema(LAYOUT_SIZES, layout))
        group = footer.metadata.row_group(0)
        dictionary = {group.column(i).path_in_schema.split(".")[0]: "RLE_DICTIONARY" in group.column(i).encodings
                      for i in range(group.num_columns)}
        assert all(dictionary.values()), dictionary
    names = footer.schema_arrow.names
    assert names[14:21] == ["SPARSE_0_0", "SPARSE_0_1", "SPARSE_0_2", "SPARSE_1", "SPARSE_2_0", "SPARSE_2_1",
                            "SPARSE_3"]
    assert names[-5:] == [slot_column(25, j) for j in range(5)] and len(names) == 1 + NUM_DENSE + sum(LAYOUT_SIZES)


def test_the_default_layout_is_slots(layouts):
    default, slots = read_metadata(layouts / "default"), read_metadata(layouts / "slots")
    assert default.sparse_layout == "slots" and "--sparse-layout slots" in default.extra["command"]
    for rel in slots.splits["train"].files:
        assert pq.read_table(layouts / "default" / rel).equals(pq.read_table(layouts / "slots" / rel))
    option = next(p for p in synthetic.main.params if p.name == "sparse_layout")
    assert option.default == "slots"


def test_a_recorded_lists_command_regenerates_lists(layouts, tmp_path):
    argv = shlex.split(read_metadata(layouts / "lists").extra["command"])
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    res = CliRunner().invoke(synthetic.main, argv[3:])
    assert res.exit_code == 0, res.output
    for rel in read_metadata(layouts / "lists").splits["validation"].files:
        assert pq.read_table(tmp_path / "again" / rel).equals(pq.read_table(layouts / "lists" / rel))


def test_one_hot_files_are_the_same_in_both_layouts(tmp_path):
    """One-hot data have no multi-hot feature to store: the same bytes, version-2 metadata without the key, and a
    command without --sparse-layout (it reads as it always did)."""
    for layout in ("lists", "slots"):
        synthetic.generate(tmp_path / layout, 1_500, seed=2, cardinalities="tiny", sparse_layout=layout)
    raw = [json.loads((tmp_path / layout / "metadata.json").read_text()) for layout in ("lists", "slots")]
    assert [r["schema_version"] for r in raw] == [2, 2] and not any("sparse_layout" in r for r in raw)
    assert "--sparse-layout" not in raw[1]["extra"]["command"]
    for rel in read_metadata(tmp_path / "lists").splits["train"].files:
        assert (tmp_path / "lists" / rel).read_bytes() == (tmp_path / "slots" / rel).read_bytes()


def test_a_bad_sparse_layout_is_one_line(tmp_path):
    res = CliRunner().invoke(synthetic.main, ["--rows", "100", "--out", str(tmp_path / "ds"), "--sparse-layout",
                                              "rows", "--multi-hot-sizes", "mlperf"])
    assert res.exit_code == 2 and "--sparse-layout" in res.output and "'rows'" in res.output, res.output
    with pytest.raises(click.ClickException) as e:
        synthetic.generate(tmp_path / "ds", 100, sparse_layout="columns")
    assert e.value.format_message() == "--sparse-layout: 'columns' is not one of lists, slots"
    assert not (tmp_path / "ds").exists()


def test_the_loader_reads_both_layouts_as_the_same_batches(layouts):
    """End to end: `ParquetLoader` takes each file's layout from its schema and cuts the same batches from both,
    the slots the files hold."""
    from dlrm.data.loader import ParquetLoader, split_files

    batches = {}
    for layout in ("lists", "slots"):
        meta = read_metadata(layouts / layout)
        loader = ParquetLoader(split_files(layouts / layout, meta, "train"), 512, device="cpu",
                               multi_hot_sizes=meta.multi_hot_sizes)
        batches[layout] = list(loader)
    assert len(batches["lists"]) == len(batches["slots"]) == 5  # 2,400 rows: four of 512 and 352
    for a, b in zip(batches["lists"], batches["slots"]):
        for name in ("labels", "dense", "sparse"):
            assert getattr(a, name).equal(getattr(b, name)), name
    meta = read_metadata(layouts / "slots")
    tables = [pq.read_table(layouts / "slots" / rel) for rel in meta.splits["train"].files]
    expected = np.concatenate([np.concatenate([feature_slots(t, f, size) for f, size in enumerate(LAYOUT_SIZES)],
                                              axis=1) for t in tables])
    np.testing.assert_array_equal(np.concatenate([b.sparse.numpy() for b in batches["slots"]]), expected)
