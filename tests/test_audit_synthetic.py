"""Audit tests of the synthetic generator: exact properties the other tests leave open (each found by a
mutation that the rest of the suite let through)."""

from __future__ import annotations

import click
import numpy as np
import pytest

from dlrm.data import synthetic
from dlrm.data.schema import MISSING_SPARSE, NUM_DENSE, NUM_SPARSE, PAD_SPARSE, slot_offsets
from dlrm.data.synthetic_chunks import make_chunk
from dlrm.data.teacher import Teacher

CARDS = synthetic.CARDINALITY_PRESETS["tiny"]


def test_multi_hot_values_are_drawn_per_chunk():
    """Each chunk draws its further multi-hot values from its own (seed, chunk) stream: two chunks of one
    dataset must not repeat each other's values and lengths."""
    sizes = [3] + [1] * 25
    teacher = Teacher(4, CARDS, bias=0.0, multi_hot_sizes=sizes)
    n = 2_000
    a = make_chunk(4, 0, n, CARDS, teacher, sizes, "variable")[0].ids
    b = make_chunk(4, 1, n, CARDS, teacher, sizes, "variable")[0].ids
    assert not np.array_equal(a[:, 0], b[:, 0])  # the one-hot draws differ per chunk (as before)
    # the further values (slots 1, 2): equal in only a small share of rows, as independent draws are
    assert (a[:, 1:3] == b[:, 1:3]).all(axis=1).mean() < 0.5


# Feature 0 (size 3) is in no interaction; feature 4 (size 2) interacts with feature 24 (one-hot).
MH_SIZES = [3, 1, 1, 1, 2] + [1] * 21


def _one_hot_ids(rng, n):
    ids = rng.integers(0, 12, (n, NUM_SPARSE)).astype(np.int64)
    ids[rng.random((n, NUM_SPARSE)) < 0.1] = MISSING_SPARSE
    return ids


def _multi_hot(one_hot, lists):
    """Slot-layout ids: feature f's list from `lists[f]` ([n, size] with PAD_SPARSE after the values), else the
    one-hot id."""
    offsets = slot_offsets(MH_SIZES)
    out = np.full((one_hot.shape[0], offsets[-1]), PAD_SPARSE, dtype=np.int64)
    for f in range(NUM_SPARSE):
        out[:, offsets[f] : offsets[f + 1]] = lists[f] if f in lists else one_hot[:, f : f + 1]
    return out


@pytest.fixture(scope="module")
def teachers():
    one = Teacher(9, CARDS, bias=-1.25)
    many = Teacher(9, CARDS, bias=-1.25, multi_hot_sizes=MH_SIZES)
    return one, many


def _rows(n=400, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 50, (n, NUM_DENSE)).astype(np.int32)
    return rng, dense, _one_hot_ids(rng, n)


def test_a_single_valued_multi_hot_feature_scores_like_the_one_hot_feature(teachers):
    """A multi-hot list holding one value is that one-hot category (effect, damping, latent vector);
    an empty list is a missing category (its own missing effect)."""
    one, many = teachers
    rng, dense, ids = _rows()
    ids[:5, 0] = MISSING_SPARSE  # some empty lists of feature 0 and feature 4
    ids[5:10, 4] = MISSING_SPARSE
    pad = lambda col, size: np.concatenate([col[:, None], np.full((col.size, size - 1), PAD_SPARSE)], axis=1)
    # an empty list is all padding (expand_multi_hot: no values at all)
    first0 = np.where(ids[:, 0] < 0, PAD_SPARSE, ids[:, 0])
    first4 = np.where(ids[:, 4] < 0, PAD_SPARSE, ids[:, 4])
    lists = {0: pad(first0, 3), 4: pad(first4, 2)}
    np.testing.assert_allclose(many.logit(dense, _multi_hot(ids, lists)), one.logit(dense, ids), rtol=0, atol=1e-12)


def test_a_multi_hot_feature_scores_the_mean_of_its_values(teachers):
    """Feature 0 (no interaction) and feature 4 (in one with a one-hot feature) enter the logit linearly:
    a list's logit is the mean of the one-hot logits of its values, over the values present (not the slots)."""
    one, many = teachers
    rng, dense, ids = _rows(seed=1)
    n = ids.shape[0]
    values0 = rng.integers(0, 12, (n, 3))
    values4 = rng.integers(0, 12, (n, 2))
    for f, values in ((0, values0), (4, values4)):
        size = values.shape[1]
        for length in range(1, size + 1):
            lists = {0: np.where(np.arange(3) < 1, values0, PAD_SPARSE), 4: np.where(np.arange(2) < 1, values4, PAD_SPARSE)}
            lists[f] = np.where(np.arange(size) < length, values, PAD_SPARSE)
            expected = np.zeros(n)
            for j in range(length):
                k = ids.copy()
                k[:, 0], k[:, 4] = values0[:, 0], values4[:, 0]
                k[:, f] = values[:, j]
                expected += one.logit(dense, k) / length
            got = many.logit(dense, _multi_hot(ids, lists))
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12, err_msg=f"feature {f}, {length} values")


def test_raw_tsv_leaves_exactly_the_missing_counts_empty(tmp_path):
    """A missing dense count is an empty field in the raw TSV (0 in parquet): exactly the rows the generator made
    missing, which the chunk's own random stream tells."""
    meta = synthetic.generate(tmp_path / "ds", 3_000, seed=11, cardinalities="tiny", raw_tsv=tmp_path / "t.txt")
    teacher = Teacher(11, CARDS, bias=meta.extra["teacher"]["bias"])
    block = make_chunk(11, 0, 3_000, CARDS, teacher)[0]
    rows = [line.split("\t") for line in (tmp_path / "t.txt").read_text().split("\n")[:-1]]
    empty = np.array([[r[1 + j] == "" for j in range(NUM_DENSE)] for r in rows])
    assert empty.shape == (3_000, NUM_DENSE)
    np.testing.assert_array_equal(empty, block.dense_missing)
    assert empty[:, 0].mean() > 0.35  # DENSE_0 (I1) is missing 45% of the time


def test_fractions_that_leave_no_training_row_are_refused(tmp_path):
    with pytest.raises(click.ClickException, match="no training rows"):
        synthetic.generate(tmp_path / "ds", 10, validation_fraction=0.5, test_fraction=0.5)
    assert not (tmp_path / "ds").exists()


def test_an_existing_raw_tsv_is_not_overwritten_without_the_flag(tmp_path):
    tsv = tmp_path / "raw.txt"
    tsv.write_text("precious\n")
    with pytest.raises(click.ClickException, match="refusing to overwrite"):
        synthetic.generate(tmp_path / "ds", 100, cardinalities="tiny", raw_tsv=tsv)
    assert tsv.read_text() == "precious\n" and not (tmp_path / "ds").exists()
    synthetic.generate(tmp_path / "ds", 100, cardinalities="tiny", raw_tsv=tsv, overwrite=True)
    assert len(tsv.read_text().split("\n")) == 101


def test_row_groups_are_capped_within_each_file(tmp_path, monkeypatch):
    """Files of `rows_per_file` rows in row groups of at most `ROW_GROUP_ROWS` (100 here), the last one short."""
    import pyarrow.parquet as pq

    from dlrm.data import synthetic_io

    monkeypatch.setattr(synthetic_io, "ROW_GROUP_ROWS", 100)
    meta = synthetic.generate(tmp_path / "ds", 1_000, seed=1, cardinalities="tiny", rows_per_file=450,
                              validation_fraction=0.1, test_fraction=0.0)
    groups = [[pq.ParquetFile(tmp_path / "ds" / rel).metadata.row_group(i).num_rows
               for i in range(pq.ParquetFile(tmp_path / "ds" / rel).num_row_groups)] for rel in meta.splits["train"].files]
    assert groups == [[100, 100, 100, 100, 50], [100, 100, 100, 100, 50]]


def test_split_sizes_round_the_fractions():
    assert synthetic.split_sizes(999, 0.1, 0.1) == {"train": 799, "validation": 100, "test": 100}
    assert synthetic.split_sizes(10_000, 1 / 14, 1 / 14) == {"train": 8_572, "validation": 714, "test": 714}
    assert synthetic.split_sizes(1_007, 0.0, 0.2) == {"train": 806, "validation": 0, "test": 201}


def test_the_raw_tsv_gets_an_ordinary_files_mode(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        synthetic.generate(tmp_path / "ds", 100, cardinalities="tiny", raw_tsv=tmp_path / "raw.txt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "raw.txt").stat().st_mode) == 0o644


def test_the_largest_multi_hot_size_is_accepted_and_one_more_refused(tmp_path):
    """The cap is inclusive: a feature of `MAX_MULTI_HOT_SIZE` values passes the settings check (not generated here),
    one more value is refused naming the feature."""
    from dlrm.data.schema import MAX_MULTI_HOT_SIZE

    def settings(last):
        return synthetic._settings(tmp_path / "ds", 10, 0, "tiny", None, None, None, 1_000, False, "default",
                                   [1] * 25 + [last], "fixed")

    assert settings(MAX_MULTI_HOT_SIZE).multi_hot_sizes[-1] == MAX_MULTI_HOT_SIZE
    with pytest.raises(click.ClickException, match=f"SPARSE_25's size {MAX_MULTI_HOT_SIZE + 1} is above the cap"):
        settings(MAX_MULTI_HOT_SIZE + 1)
    assert not (tmp_path / "ds").exists()
