"""Tests of `dlrm.data.preprocess` (``python -m dlrm.preprocess``).

Every check of parsed values is against an independent plain-Python parse of the raw line:
split on the delimiter, ``int(float(x))`` for counts (empty -> 0, negative -> 0, clipped to
int32 max), ``int(x, 16)`` for categories (empty -> -1).
"""

from __future__ import annotations

import gzip
import json
import random
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dlrm.data import preprocess as pp
from dlrm.data.schema import (
    ALL_COLUMNS,
    arrow_schema,
    read_metadata,
)
from dlrm.data.vocabulary import vocab_path

from tests.conftest import REPO
SHARED = REPO.parent / "shared" / "criteo"
needs_samples = pytest.mark.skipif(
    not (SHARED / "part-0.tsv").is_file(),
    reason=f"real Criteo samples not found in {SHARED} (shared folder absent; they may not be copied into the repo)",
)
INT32_MAX = 2**31 - 1
HEADER = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
FAST = dict(progress=False, workers=1)


# ------------------------------------------------------------------------------------------
# helpers


def ref_row(line: str, sep: str) -> tuple:
    """The expected stored row of a raw line, parsed with plain Python."""
    f = line.rstrip("\r\n").split(sep)
    assert len(f) == 40, line
    label = int(float(f[0]))
    dense = [min(max(int(float(x)), 0), INT32_MAX) if x else 0 for x in f[1:14]]
    sparse = [int(x, 16) if x else -1 for x in f[14:]]
    return (label, *dense, *sparse)


def raw_lines(path: Path) -> tuple[list[str], str]:
    """Data lines and delimiter of a raw file (plain or gz; CSV header dropped)."""
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rt", newline="") as fh:
        lines = fh.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    sep = "\t" if "\t" in lines[0] else ","
    if lines[0].startswith("label"):
        lines = lines[1:]
    return lines, sep


def split_rows(out: Path, split: str) -> list[tuple]:
    meta = read_metadata(out)
    rows: list[tuple] = []
    for rel in meta.splits[split].files:
        t = pq.read_table(out / rel)
        assert t.schema.equals(arrow_schema(), check_metadata=False)
        rows.extend(zip(*(t.column(c).to_pylist() for c in ALL_COLUMNS)))
    return rows


def sequential_parts(total: int) -> dict[str, np.ndarray]:
    """The reference split of facebookresearch/dlrm (Kaggle): 7 parts, last one halved."""
    parts = np.array_split(np.arange(total), 7)
    test, val = np.array_split(parts[-1], 2)
    return {"train": np.concatenate(parts[:-1]), "test": test, "validation": val}


def make_fields(n: int, seed: int, *, pool: int = 40) -> list[list[str]]:
    """Synthetic raw rows as field strings (plain Python, seeded)."""
    rng = random.Random(seed)
    pools = [[rng.getrandbits(32) for _ in range(1 + (pool * (f % 5 + 1)) // 3)] for f in range(26)]
    rows = []
    for _ in range(n):
        r = [str(rng.randint(0, 1))]
        for i in range(13):
            u = rng.random()
            if u < 0.2:
                r.append("")
            elif u < 0.21:
                r.append(str(rng.randint(2**31, 2**40)))  # clipped to int32 max
            else:
                r.append(str(rng.randint(-3 if i == 1 else 0, 3000)))
        for f in range(26):
            if rng.random() < 0.1:
                r.append("")
            else:  # skewed, so that frequencies differ
                r.append(f"{pools[f][int(len(pools[f]) * rng.random() ** 2)]:08x}")
        rows.append(r)
    return rows


def write_raw(path: Path, rows: list[list[str]], fmt: str = "tsv", *, gz: bool = False) -> Path:
    if fmt == "tsv":
        text = "".join("\t".join(r) + "\n" for r in rows)
    else:  # the CSV variant: header, counts written as floats
        body = [[r[0], *[f"{x}.0" if x else "" for x in r[1:14]], *r[14:]] for r in rows]
        text = HEADER + "\n" + "".join(",".join(r) + "\n" for r in body)
    data = text.encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def dataset_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def assert_same_dataset(a: Path, b: Path) -> None:
    fa, fb = dataset_files(a), dataset_files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name


def run_cli(args: list[str]):
    result = CliRunner().invoke(pp.build_cli(), [*args, "--no-progress"])
    return result


_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \| [A-Z]+ +\| ")


def error_lines(result) -> list[str]:
    """The CLI's stderr without loguru records (whether loguru's sink is the captured stream
    depends on which test imported loguru first)."""
    return [x for x in result.stderr.strip().splitlines() if not _LOG_RECORD.match(x)]


# ------------------------------------------------------------------------------------------
# golden tests on the real samples


@needs_samples
@pytest.mark.parametrize("name,fmt", [("part-0.tsv", "tsv"), ("criteo_sample.txt", "csv")])
def test_golden_real_samples(tmp_path, name, fmt):
    src = SHARED / name
    meta = pp.preprocess([src], tmp_path / "ds", **FAST)
    lines, sep = raw_lines(src)
    expected = [ref_row(line, sep) for line in lines]
    parts = sequential_parts(len(lines))
    for split in ("train", "validation", "test"):
        got = split_rows(tmp_path / "ds", split)
        assert got == [expected[i] for i in parts[split]], split
        assert meta.splits[split].rows == len(parts[split])
        assert meta.splits[split].positives == sum(expected[i][0] for i in parts[split])
    assert meta.extra["inputs"][0]["format"] == fmt and meta.extra["inputs"][0]["lines"] == len(lines)
    assert meta.extra["inputs"][0]["header"] == (fmt == "csv")
    # modulus tables: distinct non-missing train values + 1 (the README's counts)
    train = [expected[i] for i in parts["train"]]
    distinct = [len({r[14 + f] for r in train} - {-1}) for f in range(26)]
    assert meta.extra["distinct_counts"] == distinct
    assert meta.cardinalities == [d + 1 for d in distinct]
    assert read_metadata(tmp_path / "ds").to_json() == meta.to_json()
    assert not (tmp_path / "ds" / pp.PROGRESS_DIR).exists()


@needs_samples
def test_real_sample_via_cli_gz_and_positive_rate(tmp_path):
    gz = tmp_path / "part-0.tsv.gz"
    gz.write_bytes(gzip.compress((SHARED / "part-0.tsv").read_bytes()))
    result = run_cli(["-i", str(gz), "-o", str(tmp_path / "ds"), "--workers", "1"])
    assert result.exit_code == 0, result.output
    meta = read_metadata(tmp_path / "ds")
    assert sum(s.rows for s in meta.splits.values()) == 100
    assert sum(s.positives for s in meta.splits.values()) == 29  # README: 29/100


@needs_samples
def test_issue_done_when_preprocess_part0_then_train_the_sample_config_on_it(tmp_path):
    """`python -m dlrm.preprocess --input ../shared/criteo/part-0.tsv --output DIR`, then
    `python train.py --config configs/sample.json --data DIR`: its 86 train rows are fewer than the
    config's batch of 256, so it trains on one batch of all of them an epoch, and says so."""
    out = tmp_path / "part0"
    pre = subprocess.run([sys.executable, "-m", "dlrm.preprocess", "--input", str(SHARED / "part-0.tsv"), "--output",
                          str(out)], cwd=REPO, capture_output=True, text=True)
    assert pre.returncode == 0, pre.stderr[-2000:]
    train_rows = read_metadata(out).splits["train"].rows
    assert train_rows == 86
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/sample.json", "--data", str(out),
                          "--device", "cpu", "--tb-dir", str(tmp_path / "tb"), "--run-name", "part0"],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"training with batch {train_rows} instead" in run.stderr
    summary = json.loads((tmp_path / "tb" / "part0" / "summary.json").read_text())
    epochs = json.loads((REPO / "configs" / "sample.json").read_text())["train"]["epochs"]
    assert summary["steps"] == epochs and summary["samples"] == epochs * train_rows
    # the run trained with the whole split as its batch; the config keeps what the user asked for (256)
    assert summary["batch_size"] == train_rows and summary["config"]["data"]["batch_size"] == 256 and 0 <= summary["auc"] <= 1


# ------------------------------------------------------------------------------------------
# splits on synthetic inputs


def test_sequential_over_mixed_inputs_and_chunks(tmp_path):
    """TSV + CSV (header, N.0 counts) + gzip TSV in one run, several chunks per file."""
    rows = make_fields(900, seed=1)
    files = [
        write_raw(tmp_path / "a.tsv", rows[:300]),
        write_raw(tmp_path / "b.csv", rows[300:650], "csv"),
        write_raw(tmp_path / "c.tsv.gz", rows[650:], gz=True),
    ]
    meta = pp.preprocess(files, tmp_path / "ds", chunk_rows=64, row_group_rows=40, **FAST)
    expected = [ref_row("\t".join(r), "\t") for r in rows]
    parts = sequential_parts(900)
    for split in ("train", "validation", "test"):
        assert split_rows(tmp_path / "ds", split) == [expected[i] for i in parts[split]]
    assert [i["lines"] for i in meta.extra["inputs"]] == [300, 350, 250]
    assert [i["format"] for i in meta.extra["inputs"]] == ["tsv", "csv", "tsv"]
    clipped = sum(1 for r in rows for x in r[1:14] if x and int(x) > INT32_MAX)
    assert meta.extra["dense_clipped"] == clipped > 0
    # shards: one per chunk and split, named by (file, chunk), row groups of 40
    assert meta.splits["train"].files[0] == "train/part-0000-000000.parquet"
    assert pq.ParquetFile(tmp_path / "ds" / meta.splits["train"].files[0]).metadata.num_row_groups == 2
    # the training loader reads the dataset back: same rows, in order
    from dlrm.data.loader import ParquetLoader, split_files

    loader = ParquetLoader(split_files(tmp_path / "ds", read_metadata(tmp_path / "ds"), "train"), batch_size=128)
    batches = list(loader)
    sparse = np.concatenate([b.sparse.numpy() for b in batches])
    labels = np.concatenate([b.labels.numpy() for b in batches])
    want = np.array([expected[i] for i in parts["train"]], dtype=np.int64)
    assert np.array_equal(sparse, want[:, 14:]) and np.array_equal(labels, want[:, 0].astype(np.float32))


def test_split_days(tmp_path):
    days = [make_fields(n, seed=10 + i) for i, n in enumerate([120, 80, 101])]
    # given out of order: sorted by day number
    files = [write_raw(tmp_path / f"day_{i}", d) for i, d in enumerate(days)]
    meta = pp.preprocess([files[2], files[0], files[1]], tmp_path / "ds", split="days", chunk_rows=50, **FAST)
    ref = [[ref_row("\t".join(r), "\t") for r in d] for d in days]
    assert split_rows(tmp_path / "ds", "train") == ref[0] + ref[1]
    assert split_rows(tmp_path / "ds", "test") == ref[2][:51]
    assert split_rows(tmp_path / "ds", "validation") == ref[2][51:]
    assert [Path(i["path"]).name for i in meta.extra["inputs"]] == ["day_0", "day_1", "day_2"]


def test_split_random_deterministic_and_chunk_independent(tmp_path):
    rows = make_fields(3000, seed=2)
    src = write_raw(tmp_path / "r.tsv", rows)
    kw = dict(split="random", validation_fraction=0.1, test_fraction=0.2, seed=7, **FAST)
    meta = pp.preprocess([src], tmp_path / "a", chunk_rows=128, **kw)
    pp.preprocess([src], tmp_path / "b", chunk_rows=1000, **kw)
    pp.preprocess([src], tmp_path / "c", chunk_rows=128, **{**kw, "seed": 8})
    expected = [ref_row("\t".join(r), "\t") for r in rows]
    u = pp.random_uniform(7, np.arange(3000))
    want = {"test": u < 0.2, "validation": (u >= 0.2) & (u < 0.3), "train": u >= 0.3}
    for split in ("train", "validation", "test"):
        got = split_rows(tmp_path / "a", split)
        assert got == [expected[i] for i in np.flatnonzero(want[split])]
        assert got == split_rows(tmp_path / "b", split)
    assert abs(meta.splits["test"].rows / 3000 - 0.2) < 0.03
    assert abs(meta.splits["validation"].rows / 3000 - 0.1) < 0.03
    assert split_rows(tmp_path / "c", "test") != split_rows(tmp_path / "a", "test")


def test_gz_input_equals_plain_input(tmp_path):
    rows = make_fields(700, seed=3)
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    plain = write_raw(tmp_path / "x" / "day.tsv", rows)
    gz = write_raw(tmp_path / "y" / "day.tsv", rows, gz=True)  # same name, gzip content
    pp.preprocess([plain], tmp_path / "p", chunk_rows=100, **FAST)
    pp.preprocess([gz], tmp_path / "g", chunk_rows=100, **FAST)
    fp, fg = dataset_files(tmp_path / "p"), dataset_files(tmp_path / "g")
    assert sorted(fp) == sorted(fg)
    for name in fp:
        if name != "metadata.json":
            assert fp[name] == fg[name], name
    mp, mg = json.loads(fp["metadata.json"]), json.loads(fg["metadata.json"])
    for m in (mp, mg):
        for i in m["extra"]["inputs"]:
            del i["path"], i["bytes"], i["compressed"]
    assert mp == mg


# ------------------------------------------------------------------------------------------
# tables


def test_vocabulary_mode(tmp_path):
    import torch

    from dlrm.model.hashing import keyed_vocabulary, vocabulary_rows

    rows = make_fields(1500, seed=4, pool=300)
    src = write_raw(tmp_path / "v.tsv", rows)
    min_freq = 3
    meta = pp.preprocess(
        [src], tmp_path / "ds", hashing="vocabulary", min_frequency=min_freq, chunk_rows=200, **FAST
    )
    train = split_rows(tmp_path / "ds", "train")
    heldout = split_rows(tmp_path / "ds", "validation") + split_rows(tmp_path / "ds", "test")
    assert meta.hashing == "vocabulary"
    n_rare = 0
    vocabs: list = []
    queries: list = []
    for f in range(26):
        counts: dict[int, int] = {}
        for r in train:
            v = r[14 + f]
            if v != -1:
                counts[v] = counts.get(v, 0) + 1
        vocab = np.load(vocab_path(tmp_path / "ds", f))
        assert vocab.dtype == np.int64
        assert vocab.tolist() == sorted(v for v, c in counts.items() if c >= min_freq)
        assert vocab.size > 0
        n_rare += len(counts) - vocab.size
        assert meta.cardinalities[f] == vocab.size + 1
        assert meta.extra["distinct_counts"][f] == len(counts)
        vocabs.append(torch.from_numpy(vocab))
        unseen = [r[14 + f] for r in heldout if r[14 + f] not in counts] + [-1, 2**32 - 1]
        queries.append((vocab.tolist(), [v for v in unseen if v not in set(vocab.tolist())],
                        [v for v, c in counts.items() if c < min_freq]))
    assert n_rare > 0  # some values fell below the minimum frequency
    # the model's own lookup (dlrm.model.hashing, as used on the device): row offsets[f] + 1 + position
    # of a vocabulary value, offsets[f] (the OOV row) for rare, unseen and missing values
    keys, vocab_offsets = keyed_vocabulary(vocabs)
    offsets = torch.tensor(np.concatenate(([0], np.cumsum(meta.cardinalities)[:-1])), dtype=torch.int64)
    for f, (seen, unseen, rare) in enumerate(queries):
        values = [*seen, *unseen, *rare]
        raw = torch.full((len(values), 26), -1, dtype=torch.int64)
        raw[:, f] = torch.tensor(values, dtype=torch.int64)
        got = vocabulary_rows(raw, keys, vocab_offsets, offsets)[:, f] - offsets[f]
        assert got[: len(seen)].tolist() == list(range(1, len(seen) + 1))  # distinct rows, in order
        assert (got[len(seen) :] == 0).all() and len(unseen) > 0


def test_modulus_cap(tmp_path):
    rows = make_fields(400, seed=6, pool=60)
    src = write_raw(tmp_path / "m.tsv", rows)
    meta = pp.preprocess([src], tmp_path / "ds", max_rows_per_table=50, **FAST)
    d = meta.extra["distinct_counts"]
    assert meta.cardinalities == [min(x + 1, 50) for x in d]
    assert max(d) > 50 and min(d) < 49
    assert not (tmp_path / "ds" / "vocab").exists()


def test_distinct_counter_compaction_matches_numpy():
    rng = np.random.default_rng(0)
    c = pp.DistinctCounter(count_cap=4, min_compact=50)
    allv = []
    for _ in range(40):
        v = rng.integers(0, 300, 60).astype(np.uint32)
        allv.append(v)
        s = np.sort(v)
        c.add(0, *pp._group_counts(s, None, 4))
    vals, cnts = np.unique(np.concatenate(allv), return_counts=True)
    c.finish()
    assert c.values[0].tolist() == vals.tolist()
    assert c.counts[0].tolist() == np.minimum(cnts, 4).tolist()
    assert c.vocabulary(0, 4).tolist() == vals[cnts >= 4].tolist()


# ------------------------------------------------------------------------------------------
# bad input


def _with_bad_line(tmp_path: Path, reason: str) -> tuple[Path, int, str | None, str | None, int]:
    """A 300-line file whose line 201 is bad: (path, bad line number, column, value, good lines)."""
    rows = make_fields(300, seed=9)
    lines = ["\t".join(r) for r in rows]
    bad = rows[200][:]
    column = value = None
    if reason == "wrong_field_count":
        bad = bad[:-1]
    elif reason == "bad_integer":
        bad[5], column, value = "abc", "I5", "abc"
    elif reason == "bad_category":
        bad[16], column, value = "xyz123zz", "C3", "xyz123zz"
    elif reason == "bad_label":
        bad[0], column, value = "2", "label", "2"
    lines[200] = "\t".join(bad)
    path = tmp_path / "in" / "train.txt"
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    return path, 201, column, value, 299


def _unrecorded_parquet(out: Path) -> list[str]:
    recorded = set()
    done = out / pp.PROGRESS_DIR / "done.jsonl"
    if done.is_file():
        for line in done.read_text().splitlines():
            recorded |= {s["file"] for s in json.loads(line)["shards"].values()}
    return [str(p.relative_to(out)) for p in out.rglob("*.parquet") if str(p.relative_to(out)) not in recorded]


@pytest.mark.parametrize("reason", ["wrong_field_count", "bad_integer", "bad_category", "bad_label"])
def test_bad_line(tmp_path, reason):
    src, line, column, value, good = _with_bad_line(tmp_path, reason)
    out = tmp_path / "ds"
    # stop (default): one line naming file, line, column and value; exit code 2
    result = run_cli(["-i", str(src), "-o", str(out), "--chunk-rows", "50", "--workers", "1"])
    assert result.exit_code == 2
    msg = error_lines(result)
    assert len(msg) == 1 and msg[0].startswith(f"error: {src}:{line}: "), result.stderr
    if column:
        assert f"column {column}: {value!r}" in msg[0]
    else:
        assert "expected 40 fields" in msg[0] and "found 39" in msg[0]
    assert not (out / "metadata.json").exists()
    assert _unrecorded_parquet(out) == []
    assert len(list(out.rglob("*.parquet"))) >= 4  # the chunks before the bad one are kept
    assert not list(out.rglob("*.tmp"))
    # skip: the good lines, and the count per reason
    meta = pp.preprocess([src], tmp_path / "skip", on_bad_line="skip", chunk_rows=50, **FAST)
    assert sum(s.rows for s in meta.splits.values()) == good
    assert meta.extra["bad_lines"] == {r: int(r == reason) for r in pp.BAD_LINE_REASONS}
    lines, sep = raw_lines(src)
    expected = [ref_row(x, sep) for i, x in enumerate(lines) if i != line - 1]
    got = [r for s in ("train", "test", "validation") for r in split_rows(tmp_path / "skip", s)]
    assert got == expected  # sequential: train, then test, then validation


def test_bad_lines_with_worker_processes(tmp_path, monkeypatch):
    """The pool path: the first bad line of the file is named, whichever worker finds one first;
    every shard left behind is complete and recorded, so the skip run resumes from them."""
    rows = make_fields(1200, seed=16)
    lines = ["\t".join(r) for r in rows]
    for i in (1100, 450):  # two bad lines in different chunks; 451 is the first
        r = rows[i][:]
        r[20] = "zz"
        lines[i] = "\t".join(r)
    src = tmp_path / "train.txt"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    # the count pass of a big plain file, in byte ranges over the workers
    monkeypatch.setattr(pp.scan, "_PARALLEL_SCAN_MIN_BYTES", 0)
    monkeypatch.setattr(pp.scan, "_SCAN_RANGE_BYTES", 20_000)
    result = run_cli(["-i", str(src), "-o", str(out), "--chunk-rows", "100", "--workers", "2"])
    assert result.exit_code == 2
    assert error_lines(result) == [
        f"error: {src}:451: column C7: 'zz' is not a hexadecimal category hash (1 to 8 hex digits)"
    ]
    assert _unrecorded_parquet(out) == [] and not list(out.rglob("*.tmp"))
    assert not (out / "metadata.json").exists()
    meta = pp.preprocess([src], out, chunk_rows=100, on_bad_line="skip", workers=2, progress=False)
    assert meta.extra["bad_lines"]["bad_category"] == 2
    assert sum(s.rows for s in meta.splits.values()) == 1198


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    good = write_raw(tmp_path / "good.tsv", make_fields(50, seed=1))
    result = run_cli(["-i", str(good), "-i", str(empty), "-o", str(tmp_path / "ds")])
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {empty}: empty file (no data lines)"]
    assert not (tmp_path / "ds").exists() or not list((tmp_path / "ds").rglob("*"))
    meta = pp.preprocess([good, empty], tmp_path / "skip", on_bad_line="skip", **FAST)
    assert meta.extra["bad_lines"]["empty_file"] == 1
    assert sum(s.rows for s in meta.splits.values()) == 50


def test_truncated_gzip(tmp_path):
    rows = make_fields(2000, seed=8)
    full = gzip.compress("".join("\t".join(r) + "\n" for r in rows).encode(), mtime=0)
    src = tmp_path / "day_0.gz"
    src.write_bytes(full[: len(full) * 2 // 3])
    # what a plain zlib stream decoder recovers: complete lines before the cut
    d = zlib.decompressobj(wbits=31)
    recovered = d.decompress(src.read_bytes())
    complete = recovered.count(b"\n")
    assert 0 < complete < 2000
    result = run_cli(["-i", str(src), "-o", str(tmp_path / "ds"), "--chunk-rows", "300"])
    assert result.exit_code == 2
    msg = error_lines(result)
    assert len(msg) == 1 and msg[0].startswith(f"error: {src}:") and "gzip" in msg[0]
    assert not (tmp_path / "ds" / "metadata.json").exists() and not list((tmp_path / "ds").rglob("*.parquet"))
    meta = pp.preprocess([src], tmp_path / "skip", on_bad_line="skip", chunk_rows=300, **FAST)
    assert meta.extra["bad_lines"]["corrupt_gzip"] == 1
    n = sum(s.rows for s in meta.splits.values())
    # the decompressor may hold back the last few KB; never more lines than zlib recovered
    assert 0 < n <= complete and n >= complete - 200
    got = [r for s in ("train", "test", "validation") for r in split_rows(tmp_path / "skip", s)]
    assert got == [ref_row("\t".join(r), "\t") for r in rows[:n]]


def test_truncated_plain_file(tmp_path):
    """A plain file cut in the middle of its last line: that line has too few fields."""
    rows = make_fields(120, seed=14)
    text = "".join("\t".join(r) + "\n" for r in rows)
    src = tmp_path / "cut.tsv"
    src.write_text(text[: text.rfind("\t", 0, len(text) - 1) - 3])  # last line: a few fields, no newline
    out = tmp_path / "ds"
    result = run_cli(["-i", str(src), "-o", str(out), "--workers", "1"])
    assert result.exit_code == 2
    msg = error_lines(result)
    assert len(msg) == 1 and msg[0].startswith(f"error: {src}:120: expected 40 fields"), result.stderr
    assert not out.exists()  # nothing finished: the run removes what it created
    meta = pp.preprocess([src], tmp_path / "skip", on_bad_line="skip", **FAST)
    assert meta.extra["bad_lines"]["wrong_field_count"] == 1
    got = [r for s in ("train", "test", "validation") for r in split_rows(tmp_path / "skip", s)]
    assert got == [ref_row("\t".join(r), "\t") for r in rows[:119]]


def test_corrupt_gzip_inside_stream(tmp_path):
    """Damage inside a gzip stream (CRC mismatch): the data before the error cannot be trusted, so
    stop names the file and skip drops the whole file."""
    rows = make_fields(800, seed=15)
    data = bytearray(gzip.compress("".join("\t".join(r) + "\n" for r in rows).encode(), mtime=0))
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 16])
    bad = tmp_path / "day_1.gz"
    bad.write_bytes(bytes(data))
    good = write_raw(tmp_path / "day_0.tsv", rows[:300])
    result = run_cli(["-i", str(good), "-i", str(bad), "-o", str(tmp_path / "ds"), "--workers", "1"])
    assert result.exit_code == 2
    msg = error_lines(result)
    assert len(msg) == 1 and msg[0].startswith(f"error: {bad}: corrupt gzip stream"), result.stderr
    assert not (tmp_path / "ds").exists()
    meta = pp.preprocess([good, bad], tmp_path / "skip", on_bad_line="skip", **FAST)
    assert meta.extra["bad_lines"]["corrupt_gzip"] == 1
    assert [i["lines"] for i in meta.extra["inputs"]] == [300, 0]
    got = [r for s in ("train", "test", "validation") for r in split_rows(tmp_path / "skip", s)]
    assert got == [ref_row("\t".join(r), "\t") for r in rows[:300]]


def test_nothing_good_is_an_error(tmp_path):
    src = tmp_path / "junk.tsv"
    src.write_text("1\t2\n0\t3\n")
    with pytest.raises(pp.PreprocessError, match="no rows to write"):
        pp.preprocess([src], tmp_path / "ds", on_bad_line="skip", **FAST)
    assert not (tmp_path / "ds" / "metadata.json").exists()
