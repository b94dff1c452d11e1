"""Audit tests of `dlrm.data.preprocess`: tiny hand-written inputs whose stored result is worked out by
hand (never by calling the code under test). Each guards a way the preprocessor could corrupt a dataset
silently that the broader tests let through (see the audit report of the test suite)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dlrm.data import preprocess as pp
from dlrm.data.schema import read_metadata
from dlrm.data.vocabulary import vocab_path

FAST = dict(progress=False, workers=1)
INT32_MAX = 2**31 - 1


def tsv_line(label: str, dense0: str, c1: str = "0000abcd", i2: str = "7") -> str:
    """A 40-field TSV line: DENSE_0 (I1) and I2 as given, I3..I13 "1"; C1 as given, C2..C26 "00000001"."""
    return "\t".join([label, dense0, i2, *["1"] * 11, c1, *["00000001"] * 25])


def column(out: Path, split: str, name: str) -> list:
    """A column of a split, its shards in order."""
    meta = read_metadata(out)
    return [v for rel in meta.splits[split].files for v in pq.read_table(out / rel, columns=[name])[name].to_pylist()]


# -- a skipped bad line must not move the lines after it to another split ------------------------------


@pytest.mark.parametrize("total,train_end,test_end", [(27, 24, 26), (15, 13, 14), (22, 19, 21), (14, 12, 13)])
def test_sequential_split_boundaries(tmp_path, total, train_end, test_end):
    """facebookresearch/dlrm's Kaggle split, worked out by hand: 7 parts as np.array_split (the first total % 7
    parts one line longer), parts 0-5 train, the first half of part 6 rounded up test, the rest validation.
    27 = 7 * 3 + 6: parts of 4, 4, 4, 4, 4, 4, 3: train 0..23, test 24, 25, validation 26 (an odd last part and
    total % 7 == 6); 15: parts 3, 2, .. 2: train 0..12, test 13, validation 14; 22: parts 4, 3, .. 3: train
    0..18, test 19, 20, validation 21; 14: train 0..11, test 12, validation 13."""
    src = tmp_path / "in.tsv"
    src.write_text("".join(tsv_line(str(k % 2), str(k)) + "\n" for k in range(total)))
    meta = pp.preprocess([src], tmp_path / "ds", chunk_rows=5, **FAST)
    assert column(tmp_path / "ds", "train", "DENSE_0") == list(range(train_end))
    assert column(tmp_path / "ds", "test", "DENSE_0") == list(range(train_end, test_end))
    assert column(tmp_path / "ds", "validation", "DENSE_0") == list(range(test_end, total))
    assert meta.splits["test"].positives == sum(k % 2 for k in range(train_end, test_end))


def test_sequential_split_after_a_skipped_line_follows_the_file_line_numbers(tmp_path):
    """14 lines, DENSE_0 = the line's 0-based number; line 1 is bad (I1 "abc") and skipped. The sequential
    rule over all 14 lines (as the count pass counted them): [0, 12) train, 12 test, 13 validation, so the
    kept lines land by their line number, not by their position among the kept rows."""
    lines = [tsv_line(str(k % 2), str(k)) for k in range(14)]
    lines[1] = tsv_line("1", "abc")
    src = tmp_path / "in.tsv"
    src.write_text("\n".join(lines) + "\n")
    meta = pp.preprocess([src], tmp_path / "ds", on_bad_line="skip", **FAST)
    assert column(tmp_path / "ds", "train", "DENSE_0") == [0, *range(2, 12)]
    assert column(tmp_path / "ds", "test", "DENSE_0") == [12]
    assert column(tmp_path / "ds", "validation", "DENSE_0") == [13]
    assert {s: i.rows for s, i in meta.splits.items()} == {"train": 11, "validation": 1, "test": 1}
    assert meta.extra["bad_lines"]["bad_integer"] == 1


def test_days_split_after_a_skipped_line_in_the_last_day(tmp_path):
    """Days: day 1 (the last) has 5 lines, its first (5 + 1) // 2 = 3 are test. Its line 0 is bad and skipped:
    lines 1, 2 stay test and 3, 4 validation."""
    (tmp_path / "d0").write_text("".join(tsv_line("0", str(100 + k)) + "\n" for k in range(4)))
    day1 = [tsv_line("1", str(k)) for k in range(5)]
    day1[0] = tsv_line("x", "0")  # bad label
    (tmp_path / "d1").write_text("\n".join(day1) + "\n")
    pp.preprocess([tmp_path / "d0", tmp_path / "d1"], tmp_path / "ds", split="days", on_bad_line="skip", **FAST)
    assert column(tmp_path / "ds", "train", "DENSE_0") == [100, 101, 102, 103]
    assert column(tmp_path / "ds", "test", "DENSE_0") == [1, 2]
    assert column(tmp_path / "ds", "validation", "DENSE_0") == [3, 4]


def test_days_are_ordered_by_day_number_not_by_name(tmp_path):
    """day_0 .. day_10 given shuffled: day_10 (not day_9, the last by name) is the held-out day; train holds days
    0..9 in numeric order. Day d has 2 lines with DENSE_0 = 10 * d and 10 * d + 1."""
    paths = []
    for d in range(11):
        p = tmp_path / f"day_{d}.tsv"
        p.write_text(tsv_line("0", str(10 * d)) + "\n" + tsv_line("1", str(10 * d + 1)) + "\n")
        paths.append(p)
    shuffled = [paths[i] for i in (3, 10, 0, 7, 1, 9, 2, 5, 8, 4, 6)]
    meta = pp.preprocess(shuffled, tmp_path / "ds", split="days", **FAST)
    assert column(tmp_path / "ds", "train", "DENSE_0") == [v for d in range(10) for v in (10 * d, 10 * d + 1)]
    assert column(tmp_path / "ds", "test", "DENSE_0") == [100]
    assert column(tmp_path / "ds", "validation", "DENSE_0") == [101]
    assert [Path(i["path"]).name for i in meta.extra["inputs"]] == [f"day_{d}.tsv" for d in range(11)]


# -- the hash 0 is a value like any other ------------------------------------------------------------------


@pytest.mark.parametrize("hashing", ["vocabulary", "modulus"])
def test_category_hash_zero_is_counted_and_kept_in_the_vocabulary(tmp_path, hashing):
    """C1 over the 12 train lines (of 14; sequential): "00000000" 6 times, "0" (also 0) once, "0000000a" 5 times;
    C2 always missing. Distinct train values of C1: {0, 10}; with --min-frequency 6 only 0 (7 times) is kept
    (10 is seen 5 times). Missing values (-1) are neither values nor counted."""
    c1 = ["00000000"] * 6 + ["0"] + ["0000000a"] * 5 + ["0000000b", ""]
    lines = ["\t".join(["0", str(k), *["1"] * 12, c, "", *["00000001"] * 24]) for k, c in enumerate(c1)]
    src = tmp_path / "in.tsv"
    src.write_text("\n".join(lines) + "\n")
    kw = dict(hashing="vocabulary", min_frequency=6) if hashing == "vocabulary" else {}
    meta = pp.preprocess([src], tmp_path / "ds", **kw, **FAST)
    assert meta.extra["distinct_counts"][:3] == [2, 0, 1]
    assert column(tmp_path / "ds", "train", "SPARSE_0") == [0] * 7 + [10] * 5
    assert column(tmp_path / "ds", "validation", "SPARSE_0") == [-1]
    if hashing == "vocabulary":
        assert np.load(vocab_path(tmp_path / "ds", 0)).tolist() == [0]
        assert np.load(vocab_path(tmp_path / "ds", 1)).tolist() == []
        assert meta.cardinalities[:3] == [2, 1, 2]
    else:
        assert meta.cardinalities[:3] == [3, 1, 2]


def test_min_frequency_keeps_values_seen_exactly_that_often(tmp_path):
    """Train (12 of 14 lines): C1 "000000aa" 3 times, "000000bb" 2 times, "000000cc" 7 times. --min-frequency 3:
    the vocabulary is [0xaa, 0xcc] (a count equal to the threshold is kept), cardinality 3."""
    c1 = ["000000aa"] * 3 + ["000000bb"] * 2 + ["000000cc"] * 7 + ["000000bb"] * 2
    src = tmp_path / "in.tsv"
    src.write_text("".join(tsv_line("1", str(k), c) + "\n" for k, c in enumerate(c1)))
    meta = pp.preprocess([src], tmp_path / "ds", hashing="vocabulary", min_frequency=3, **FAST)
    assert np.load(vocab_path(tmp_path / "ds", 0)).tolist() == [0xAA, 0xCC]
    assert meta.cardinalities[0] == 3 and meta.extra["vocabulary_sizes"][0] == 2


# -- counts: negatives, clipping, and the clipped count of skipped lines ------------------------------------


def test_dense_counts_negative_zero_and_clipped_and_the_clip_count_of_skipped_lines(tmp_path):
    """I1 per line: "-5" (stored 0), "2147483648" (clipped to int32 max), "" (0), "-99999999999" (0, slow path),
    "2147483647" (kept, not clipped), "12.0" (12), and a line with I1 "99999999999" whose label "2" is bad: it is
    skipped, so its clipped count does not count. dense_clipped is 1."""
    dense0 = ["-5", "2147483648", "", "-99999999999", "2147483647", "12.0", "99999999999"]
    labels = ["0", "1", "0", "1", "0", "1", "2"]
    lines = [tsv_line(lab, d) for lab, d in zip(labels, dense0)] + [tsv_line("0", str(k)) for k in range(7)]
    src = tmp_path / "in.tsv"
    src.write_text("\n".join(lines) + "\n")
    meta = pp.preprocess([src], tmp_path / "ds", on_bad_line="skip", **FAST)
    # 14 lines: [0, 12) train (line 6, the bad one, among them), 12 test, 13 validation
    assert column(tmp_path / "ds", "train", "DENSE_0") == [0, INT32_MAX, 0, 0, INT32_MAX, 12, 0, 1, 2, 3, 4]
    assert meta.extra["dense_clipped"] == 1
    assert meta.extra["bad_lines"]["bad_label"] == 1
    assert meta.splits["train"].positives == 3


# -- line numbers of a CSV file's later chunks -----------------------------------------------------------


def test_csv_bad_line_number_in_a_later_chunk_counts_the_header(tmp_path):
    """A CSV file: header, then 8 data lines in chunks of 3; data line 7 (file line 8: the header is line 1) has
    I2 "x". The error names line 8."""
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    rows = [tsv_line("0", str(k)).replace("\t", ",") for k in range(8)]
    rows[6] = tsv_line("0", "6", i2="x").replace("\t", ",")
    src = tmp_path / "in.csv"
    src.write_text(header + "\n" + "\n".join(rows) + "\n")
    with pytest.raises(pp.BadLineError) as e:
        pp.preprocess([src], tmp_path / "ds", chunk_rows=3, **FAST)
    assert e.value.bad.line == 8 and e.value.bad.reason == "bad_integer"
    assert f"{src}:8:" in str(e.value)


# -- categories: 1 to 8 hex digits, either case -------------------------------------------------------


@pytest.mark.parametrize("value,expected", [("a", 10), ("0", 0), ("ABCDEF12", 0xABCDEF12), ("abcdef12", 0xABCDEF12),
                                            ("FFFFFFFF", 2**32 - 1), ("7fFfFfF", 0x7FFFFFF), ("", -1)])
def test_category_values_parse_to_their_hash(value, expected):
    data = ("\t".join(["1", *["3"] * 13, value, *["00000001"] * 25]) + "\n").encode()
    parsed = pp.parse_chunk(data)
    assert parsed.sparse[:, 0].tolist() == [expected] + [1] * 25


@pytest.mark.parametrize("value", ["123456789", "000000001", "fffffffff", "0x12", "12 4", "g"])
def test_category_of_more_than_8_hex_digits_or_not_hex_is_a_bad_line(value):
    """A 9-digit value would not fit the 32-bit hash the tables store (uint32 in the statistics): a bad line,
    never a value; skipped, the other line stays."""
    good = "\t".join(["0", *["3"] * 13, *["0000000a"] * 26])
    bad = "\t".join(["1", *["3"] * 13, "0000000b", value, *["0000000a"] * 24])
    data = f"{good}\n{bad}\n".encode()
    with pytest.raises(pp.BadLineError) as e:
        pp.parse_chunk(data, source="x.tsv")
    assert (e.value.bad.line, e.value.bad.reason, e.value.bad.column) == (2, "bad_category", "C2")
    parsed = pp.parse_chunk(data, on_bad_line="skip")
    assert parsed.num_rows == 1 and parsed.bad == {"bad_category": 1}
    assert parsed.sparse[:, 0].tolist() == [10] * 26



# -- resuming: a chunk is done only when every one of its shards is intact --------------------------------


@pytest.mark.parametrize("split", ["train", "test"])
def test_resume_redoes_a_chunk_one_of_whose_shards_is_damaged(tmp_path, split):
    """14 lines in chunks of 7: chunk 1 (lines 7..13) has a train (7..11), a test (12) and a validation (13) shard.
    The run stops after both chunks are recorded; one of chunk 1's shards is then cut short. The resumed run
    redoes chunk 1 (its other shards being intact does not make it done) and the dataset holds every line."""
    src = tmp_path / "in.tsv"
    src.write_text("".join(tsv_line(str(k % 2), str(k)) + "\n" for k in range(14)))
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess([src], out, chunk_rows=7, checkpoint_interval=0, _max_new_chunks=2, **FAST)
    shard = out / split / "part-0000-000001.parquet"
    shard.write_bytes(shard.read_bytes()[:40])
    meta = pp.preprocess([src], out, chunk_rows=7, **FAST)
    assert column(out, "train", "DENSE_0") == list(range(12))
    assert column(out, "test", "DENSE_0") == [12]
    assert column(out, "validation", "DENSE_0") == [13]
    assert {s: i.rows for s, i in meta.splits.items()} == {"train": 12, "validation": 1, "test": 1}
