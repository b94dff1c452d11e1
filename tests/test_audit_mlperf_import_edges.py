"""`dlrm.data.mlperf_import` on damaged or odd inputs: every one a one-line error (exit 2) naming the file, nothing
written to --output, never a traceback or a dataset that silently lacks rows."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

from dlrm.data import mlperf_import as mi
from dlrm.data.schema import NUM_SPARSE, read_metadata

CARDS = [7 + f for f in range(NUM_SPARSE)]
SIZES = [3, 1, 2] + [1] * (NUM_SPARSE - 3)


def write_day(root, i, n, seed=0, id_dtype=np.int32):
    rng = np.random.default_rng(seed + i)
    np.save(root / f"day_{i}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    np.save(root / f"day_{i}_dense.npy", np.log(rng.integers(0, 3000, (n, 13)) + 3.0).astype(np.float32))
    ids = {str(f): rng.integers(0, CARDS[f], (n, s)).astype(id_dtype) for f, s in enumerate(SIZES)}
    np.savez(root / f"day_{i}_sparse_multi_hot.npz", **ids)
    return ids


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for i, n in {0: 6, 23: 4}.items():
        write_day(root, i, n)
    return root


def run(src, out, *extra):
    return CliRunner().invoke(mi.main, [str(a) for a in ("--input", src, "--output", out, "--train-days", "0",
                                                         "--num-embeddings", ",".join(map(str, CARDS)),
                                                         "--workers", 1, *extra)])


def assert_refused(res, out, needle):
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert "Traceback" not in res.output and "this is a bug" not in res.output, res.output
    assert not out.exists()


def _rewrite_npz(path, members, short=None, claimed_rows=None):
    """`members` as an uncompressed npz; member `short` with its last row's bytes left out, or with a header that
    claims `claimed_rows` rows while holding its real ones."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, a in members.items():
            buf = io.BytesIO()
            if name == short and claimed_rows is not None:
                np.lib.format.write_array_header_1_0(buf, {"descr": a.dtype.str, "fortran_order": False,
                                                           "shape": (claimed_rows, a.shape[1])})
                buf.write(a.tobytes())
                data = buf.getvalue()
            else:
                np.lib.format.write_array(buf, a)
                data = buf.getvalue()
                if name == short:
                    data = data[:-a.shape[1] * a.itemsize]
            z.writestr(f"{name}.npy", data)


@pytest.mark.parametrize("member, claimed_rows", [("3", None), ("25", None), ("25", 600)])
def test_an_npz_member_cut_short_is_one_line(src, tmp_path, member, claimed_rows):
    """A member whose stored bytes are fewer than its .npy header's shape needs: before, its memory map ran into the
    next member's (or the zip directory's) bytes, read as ids ("id 67324752 is outside ..."), or past the file's
    end (numpy's ValueError: a traceback, exit 1)."""
    members = dict(np.load(src / "day_0_sparse_multi_hot.npz"))
    _rewrite_npz(src / "day_0_sparse_multi_hot.npz", members, short=member, claimed_rows=claimed_rows)
    out = tmp_path / "ds"
    res = run(src, out)
    assert_refused(res, out, f"day_0_sparse_multi_hot.npz: member {member}.npy holds ")
    assert "the member is cut short" in res.output
    assert not mi.partial_dir(out).exists()  # found before any work


@pytest.mark.parametrize("name, content", [
    ("day_0_labels.npy", b""),  # a copy cut off before its first byte: np.load's EOFError
    ("day_23_dense.npy", b""),
    ("day_0_dense.npy", b"PK\x03\x04 not a zip"),  # np.load takes it for an .npz: BadZipFile
])
def test_an_empty_or_garbled_npy_is_one_line(src, tmp_path, name, content):
    (src / name).write_bytes(content)
    out = tmp_path / "ds"
    assert_refused(run(src, out), out, f"{name}: not a readable .npy array")


def test_an_npz_under_an_npy_name_is_one_line(src, tmp_path):
    """np.load returns an NpzFile for it: before, `.ndim` on it was an AttributeError traceback."""
    np.savez(src / "labels.npz", labels=np.zeros((6, 1), np.int32))
    (src / "labels.npz").replace(src / "day_0_labels.npy")
    out = tmp_path / "ds"
    assert_refused(run(src, out), out, "day_0_labels.npy: an .npz archive, not an .npy array")


@pytest.mark.parametrize("empty_day, split", [(0, "train"), (23, "validation")])
def test_a_day_without_rows_is_refused(src, tmp_path, empty_day, split):
    """Before, a 0-row day was imported with exit 0 into a dataset without its split (train.py then stops at
    "splits: has no 'train' split"); a 1-row day still imports."""
    write_day(src, empty_day, 0)
    out = tmp_path / "ds"
    assert_refused(run(src, out), out, f"day_{empty_day}_labels.npy: no rows")
    assert not mi.partial_dir(out).exists()
    write_day(src, empty_day, 1)
    res = run(src, out)
    assert res.exit_code == 0, res.output
    assert read_metadata(out).splits[split].rows == 1


def test_an_unsigned_id_beyond_int64_is_named_as_the_file_holds_it(tmp_path):
    """A uint64 id of 2^64 - 1: before, the error named it as its int64 cast, "id -1", a value not in the file."""
    src = tmp_path / "in"
    src.mkdir()
    ids = write_day(src, 0, 6, id_dtype=np.uint64)
    write_day(src, 23, 4, id_dtype=np.uint64)
    ids["2"][4, 1] = np.uint64(2**64 - 1)
    np.savez(src / "day_0_sparse_multi_hot.npz", **ids)
    out = tmp_path / "ds"
    assert_refused(run(src, out), out, f"member 2.npy: row 4, value 1: id {2**64 - 1} is outside feature 2's table")


def test_a_backwards_day_range_is_refused(src, tmp_path):
    """--train-days 0,9-3: before, "9-3" named no days and day 0 alone was imported, exit 0."""
    out = tmp_path / "ds"
    res = run(src, out, "--train-days", "0,9-3")  # the last --train-days wins
    assert_refused(res, out, "'0,9-3': '9-3' runs backwards (write 3-9)")
    with pytest.raises(Exception, match="runs backwards"):
        mi.parse_days("5-2")
    assert mi.parse_days("3-5,0") == [0, 3, 4, 5]


def test_a_failed_final_rename_leaves_an_import_the_same_command_finishes(src, tmp_path, monkeypatch):
    """The last step, renaming the finished files into --output, fails (here EBUSY): the log says the same command
    resumes. Before, the plan had been deleted just before the rename, so the same command was refused ("an
    unfinished import with other options"), leaving only --overwrite, which writes every file again."""
    import errno

    real_replace = mi.replace_dir

    def busy(tmp, out):
        raise OSError(errno.EBUSY, "Device or resource busy", str(out))

    out = tmp_path / "ds"
    monkeypatch.setattr(mi, "replace_dir", busy)
    first = run(src, out, "--rows-per-file", 4)
    assert first.exit_code == 2 and "Device or resource busy" in first.output, first.output
    assert "the same command resumes" in first.output and not out.exists()
    kept = {p: p.stat().st_mtime_ns for p in mi.partial_dir(out).rglob("*.parquet")}
    assert len(kept) == 4  # train 6 rows in 2 files, validation 2 and test 2 rows
    monkeypatch.setattr(mi, "replace_dir", real_replace)
    second = run(src, out, "--rows-per-file", 4)
    assert second.exit_code == 0 and "resuming" in second.output, second.output
    assert {p: (out / p.relative_to(mi.partial_dir(out))).stat().st_mtime_ns for p in kept} == kept  # not rewritten
    assert {s: i.rows for s, i in read_metadata(out).splits.items()} == {"train": 6, "validation": 2, "test": 2}
    assert not (out / mi.PLAN_FILE).exists() and not mi.partial_dir(out).exists()
