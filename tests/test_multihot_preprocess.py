"""The preprocessor's multi-hot fields (issue #22): ``,``-separated hex values per categorical
field, padded slots, the bad-line policy for too many or empty values, every value counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrm.data import synthetic
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.preprocess import BadLineError, PreprocessError, parse_chunk, preprocess
from dlrm.data.schema import NUM_SPARSE, PAD_SPARSE, read_metadata, read_vocabulary, slot_offsets

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
                                       ("1,,2", "is not a hexadecimal category hash"),
                                       ("1,zz", "is not a hexadecimal category hash"),
                                       ("1,", "is not a hexadecimal category hash")])
def test_bad_multi_hot_fields_follow_the_bad_line_policy(c1, detail):
    data = (line(0, "1", "2") + line(1, c1, "2") + line(0, "5,6", "7")).encode()
    with pytest.raises(BadLineError) as e:
        parse_chunk(data, source="x.tsv", multi_hot_sizes=SIZES)
    assert e.value.bad.line == 2 and e.value.bad.column == "C1" and detail in e.value.bad.message()
    skipped = parse_chunk(data, on_bad_line="skip", multi_hot_sizes=SIZES)
    assert skipped.bad == {"bad_category": 1} and skipped.num_rows == 2
    assert skipped.sparse.T[:, 0:3].tolist() == [[1, PAD_SPARSE, PAD_SPARSE], [5, 6, PAD_SPARSE]]


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


def test_synthetic_multi_hot_tsv_round_trips_through_the_preprocessor(tmp_path):
    sizes = "3,2,1,1,6,1,1,1,1,1,1,1,1,4,1,1,1,1,1,5,1,1,1,1,1,1"
    gen = synthetic.generate(tmp_path / "syn", 1500, seed=2, cardinalities="tiny", multi_hot_sizes=sizes,
                             multi_hot_fill="variable", raw_tsv=tmp_path / "raw.txt", test_fraction=0,
                             validation_fraction=0)
    meta = preprocess([tmp_path / "raw.txt"], tmp_path / "pre", split="random", validation_fraction=0.0,
                      test_fraction=0.0, multi_hot_sizes=sizes, workers=1, progress=False)
    assert meta.multi_hot_sizes == gen.multi_hot_sizes and meta.splits["train"].rows == 1500
    got = [torch.cat([b.sparse for b in ParquetLoader(split_files(root, m, "train"), 512,
                                                      multi_hot_sizes=m.multi_hot_sizes)])
           for root, m in ((tmp_path / "syn", gen), (tmp_path / "pre", meta))]
    assert got[0].shape == (1500, slot_offsets(gen.multi_hot_sizes)[-1])
    np.testing.assert_array_equal(got[0].numpy(), got[1].numpy())
