"""Hostile files handed to a user: a run directory whose ``.lock`` is a symbolic link to one of the user's files (the
lock's holder line was written through it, the file emptied), checkpoints whose optimizer state tensors share or
overlap memory, are sparse, or count negative steps (tracebacks at the first step, or silently wrong moments), and
parquet footers whose row counts disagree with themselves (a billion rows sized a 52 GB buffer; fewer rows than the
file holds dropped the rest from training without a word)."""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch

from dlrm.config import ConfigError
from dlrm.data.output_dirs import output_lock
from dlrm.data.schema import DatasetError, read_metadata
from dlrm.data.validation import open_shard, split_files
from dlrm.file_lock import NotALockFile, try_lock
from dlrm.train.run_dir import RunLock
from tests.conftest import CHILD_ENV, REPO, make_dataset
from tests.test_audit_untrusted52 import _resume_edited
from tests.test_checkpoint_safety import trained  # noqa: F401 - the fixture: a 3-step run (Adam, row-wise Adagrad)

PRECIOUS = "the user's own file\n"


# -- a lock file that is a symbolic link (or no regular file) --------------------------------------------------------

def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text(PRECIOUS)
    return victim


def test_a_run_lock_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    victim = _victim(tmp_path)
    (run_dir / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError) as e:
        RunLock.acquire(run_dir)
    assert str(run_dir / ".lock") in str(e.value) and "symbolic link" in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == PRECIOUS and (run_dir / ".lock").is_symlink()


def test_a_run_lock_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / ".lock")

    def hung(signum, frame):  # a regression blocks on the FIFO: a failure in 20 s, not a hung worker
        raise TimeoutError("RunLock.acquire waited on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(ConfigError, match="not a regular file"):
            RunLock.acquire(run_dir)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_data_tools_output_lock_that_is_a_symlink_is_refused(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / ".out.lock").symlink_to(victim)
    with pytest.raises(click.ClickException, match="symbolic link"):
        with output_lock(tmp_path / "out", "--out"):
            pass
    assert victim.read_text() == PRECIOUS


def test_an_ordinary_lock_file_still_locks(tmp_path):
    fd, previous = try_lock(tmp_path / ".lock")
    os.close(fd)
    assert previous == ""
    os.symlink(tmp_path / ".lock", tmp_path / ".link.lock")
    with pytest.raises(NotALockFile):
        try_lock(tmp_path / ".link.lock")


def test_resume_of_a_handed_over_run_whose_lock_links_to_a_user_file_leaves_it_intact(trained, tmp_path):  # noqa: F811
    """The whole path: `train.py --resume` of a run directory received from someone else (its .lock -> ~/.bashrc)."""
    import shutil

    tb = tmp_path / "tb"
    shutil.copytree(Path(trained["cfg"].log.tb_dir), tb, symlinks=True)
    victim = _victim(tmp_path)
    (tb / "run" / ".lock").unlink(missing_ok=True)
    (tb / "run" / ".lock").symlink_to(victim)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(trained["cfg_path"]),
                             "--tb-dir", str(tb), "--run-name", "run", "--resume", "--max-steps", "6"],
                            cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert victim.read_text() == PRECIOUS
    assert "symbolic link" in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr


# -- optimizer state tensors that are not tensors of their own memory ------------------------------------------------

def _state(d: dict, optimizer: int) -> dict:
    return d["optimizers"][optimizer]["state"][0]


EDITS = {
    # before: RuntimeError "more than one element of the written-to tensor refers to a single memory location" at the
    # first step (a traceback, "a bug in dlrm")
    "moment_stride_0": (lambda d: _state(d, 0).update(exp_avg=torch.zeros(1, 1).expand(*_state(d, 0)["exp_avg"].shape)),
                        "optimizers[0].state.0.exp_avg"),
    "row_sums_stride_0": (lambda d: _state(d, 1).update(sum=torch.zeros(1).expand(*_state(d, 1)["sum"].shape)),
                          "optimizers[1].state.0.sum"),
    # before: NotImplementedError at the first step
    "moment_sparse": (lambda d: _state(d, 0).update(exp_avg=_state(d, 0)["exp_avg"].to_sparse()),
                      "optimizers[0].state.0.exp_avg"),
    # before: trained silently, Adam's two moments one tensor
    "moments_one_storage": (lambda d: _state(d, 0).update(exp_avg_sq=_state(d, 0)["exp_avg"]),
                            "optimizers[0].state.0.exp_avg_sq"),
    # before: RuntimeError "result type ComplexFloat can't be cast to the desired output type Float" at the first step
    "step_negative": (lambda d: _state(d, 0).update(step=torch.tensor(-5.0)), "optimizers[0].state.0.step"),
    # before: a NaN loss blamed on the training ("loss became NaN or Inf at step ...", exit 3)
    "step_nan": (lambda d: _state(d, 0).update(step=torch.tensor(float("nan"))), "optimizers[0].state.0.step"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_optimizer_state_of_shared_or_strange_memory_is_refused_in_one_line(trained, tmp_path, name):  # noqa: F811
    edit, key = EDITS[name]
    message, after = _resume_edited(trained, tmp_path, edit)
    assert "\n" not in message
    assert trained["path"].name in message and key in message, message
    assert [p.name for p in after] == [trained["path"].name]  # nothing trained, nothing written


# -- parquet footers whose row counts disagree ------------------------------------------------------------------------

def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if not c & 0x80:
            return r, i


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _zigzag(n: int) -> int:
    return ((n << 1) ^ (n >> 63)) & (2**64 - 1)


def _skip(b: bytes, i: int, t: int, edits: list, path: tuple) -> int:
    """Skip a thrift compact value of type `t` at `i`, noting (start, end) of the i64 fields at `path`s in `edits`."""
    if t in (1, 2):
        return i
    if t == 3:
        return i + 1
    if t in (4, 5, 6):
        return _varint(b, i)[1]
    if t == 7:
        return i + 8
    if t == 8:
        n, i = _varint(b, i)
        return i + n
    if t in (9, 10):
        n, et = b[i] >> 4, b[i] & 15
        i += 1
        if n == 15:
            n, i = _varint(b, i)
        for k in range(n):
            i = i + 1 if et in (1, 2) else _skip(b, i, et, edits, path + (k,))
        return i
    if t == 12:
        last = 0
        while b[i]:
            delta, ft = b[i] >> 4, b[i] & 15
            i += 1
            if delta:
                fid = last + delta
            else:
                z, i = _varint(b, i)
                fid = (z >> 1) ^ -(z & 1)
            last = fid
            start = i
            i = _skip(b, i, ft, edits, path + (fid,))
            edits.append((path + (fid,), start, i))
        return i + 1
    raise ValueError(f"thrift type {t}")


def set_footer_rows(path: Path, row_group: int, rows: int) -> None:
    """Rewrite the parquet footer of `path` so that row group `row_group` says `rows` rows (FileMetaData field 4,
    RowGroup field 3), the file's total (field 3) and the columns' value counts left as they were."""
    data = path.read_bytes()
    n = struct.unpack("<I", data[-8:-4])[0]
    footer = data[-8 - n:-8]
    fields: list = []
    _skip(footer, 0, 12, fields, ())
    (_, start, end), = [f for f in fields if f[0] == (4, row_group, 3)]
    footer = footer[:start] + _encode_varint(_zigzag(rows)) + footer[end:]
    path.write_bytes(data[:-8 - n] + footer + struct.pack("<I", len(footer)) + b"PAR1")


@pytest.mark.parametrize("rows", [10**9, 3, 0, -5])
def test_a_row_group_whose_footer_disagrees_with_the_file_is_a_dataset_error(tmp_path, rows):
    """10**9: the stream loader sized its buffers by the row group (a 52 GB allocation, "retry with a smaller
    data.batch_size"); 3 (of 7): pyarrow read 3 rows and the split trained 96 of its 100 without a word."""
    root = tmp_path / "ds"
    make_dataset(root, {"train": 100, "validation": 30})
    shard = root / "train" / "part-00000.parquet"
    set_footer_rows(shard, 0, rows)
    for check in (lambda: split_files(root, read_metadata(root), "train"), lambda: open_shard(shard)):
        with pytest.raises(DatasetError) as e:
            check()
        assert str(shard) in str(e.value) and "row group 0" in str(e.value) and f"{rows:,} rows" in str(e.value)


def test_train_py_names_the_file_of_a_footer_that_says_a_billion_rows(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 100, "validation": 30})
    set_footer_rows(root / "train" / "part-00000.parquet", 0, 10**9)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/sample.json"),
                             "--data", str(root), "--tb-dir", str(tmp_path / "tb"), "--max-steps", "2"],
                            cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "part-00000.parquet: row group 0" in last and "1,000,000,000 rows" in last, last


def test_unedited_footers_still_open(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, {"train": 100, "validation": 30})
    assert len(split_files(root, read_metadata(root), "train")) == 2


# -- record files (config.json, sweep.json, summary.json) that are FIFOs, devices or nested too deep ------------------

DEEP = "[" * 100_000 + "]" * 100_000


def _owners_probe(tmp_path: Path, make) -> subprocess.CompletedProcess:
    """What a data tool (`owner_of` its output) and a new run (`sweep_holding` its --tb-dir) find above a path whose
    parent holds what `make` puts there; in a child with a timeout: a FIFO blocked the open for good."""
    shared = tmp_path / "shared"
    (shared / "checkpoints").mkdir(parents=True)  # with config.json: what a run's directory looks like
    make(shared)
    code = ("import sys; from pathlib import Path; from dlrm.data.output_dirs import owner_of; "
            "from dlrm.output_place import sweep_holding; "
            "print(owner_of(Path(sys.argv[1]) / 'ds'), sweep_holding(sys.argv[1] + '/tb'))")
    return subprocess.run([sys.executable, "-c", code, str(shared)], env=CHILD_ENV, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("what", ["fifo_config", "fifo_sweep", "deep_config", "deep_sweep", "dev_zero_sweep"])
def test_a_hostile_record_above_an_output_neither_hangs_nor_fails_the_probe(tmp_path, what):
    """Anyone who may write a directory above the user's output (``/tmp``, a shared disk) put a FIFO named
    config.json or sweep.json there: every data tool writing below it (synthetic, relayout, imports, preprocess) and
    a new training run hung in the owner check; JSON nested 100,000 levels deep failed them with a RecursionError
    traceback; a link to /dev/zero read until memory ran out."""
    name = what.split("_")[-1] + ".json"

    def make(d: Path) -> None:
        if what.startswith("fifo"):
            os.mkfifo(d / name)
        elif what.startswith("deep"):
            (d / name).write_text(DEEP)
        else:
            (d / name).symlink_to("/dev/zero")

    try:
        result = _owners_probe(tmp_path, make)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the owner check hung on {what}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["None", "None"]


def test_resume_of_a_run_whose_summary_is_nested_too_deep_goes_on_with_a_warning(trained, tmp_path):  # noqa: F811
    """Before: RecursionError, "this is a bug in dlrm" (exit 1), reading the run's earlier sessions from it."""
    import shutil

    tb = tmp_path / "tb"
    shutil.copytree(Path(trained["cfg"].log.tb_dir), tb, symlinks=True)
    (tb / "run" / "summary.json").write_text(DEEP)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(trained["cfg_path"]),
                             "--tb-dir", str(tb), "--run-name", "run", "--resume", "--max-steps", "4"],
                            cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "summary.json: not readable" in result.stderr and "nested too deeply" in result.stderr
    assert json.loads((tb / "run" / "summary.json").read_text())["steps"] == 4


# -- a finished sweep trial's summary.json whose nested AUCs are no numbers -------------------------------------------

@pytest.mark.parametrize("key,value", [("baseline", "x"), ("baseline", [1]), ("baseline", {"auc": "abc"}),
                                       ("best", "x"), ("best", {"auc": {"a": 1}})])
def test_a_trial_summary_whose_best_or_baseline_is_no_record_is_not_taken_as_finished(tmp_path, key, value):
    """Taken as finished, its row made the sweep's report a traceback (`SettingResult.row`: "string indices must be
    integers", "could not convert string to float"; trials.csv: "'str' object has no attribute 'get'"). Now the trial
    is one that did not finish, as one whose AUC is no number: what it left is moved aside, and it trains again."""
    from dlrm.sweep_resume import gathered_summary
    from dlrm.sweep_results import SettingResult

    run_dir = tmp_path / "seed-0"
    run_dir.mkdir()
    summary = {"auc": 0.5, "logloss": 0.7, "steps": 3, "baseline": {"auc": 0.6}, "best": {"auc": 0.55, "step": 2}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    taken = gathered_summary(run_dir, {"train": {"seed": 0}}, "seed-0")
    SettingResult(0, {}, [taken]).row()  # an ordinary one reports
    (run_dir / "summary.json").write_text(json.dumps({**summary, key: value}))
    assert gathered_summary(run_dir, {"train": {"seed": 0}}, "seed-0") is None


@pytest.mark.parametrize("mark", ["x", [1], {"a": 1}])
def test_an_earlier_session_marked_discarded_after_no_step_is_marked_again(tmp_path, mark):
    """A resume from an earlier checkpoint than the summary's last session marks that session `discarded_after`; an
    edited mark of another type made the summary's write, at the end of the session's training, a TypeError
    ("'<' not supported between instances of 'str' and 'int'": "a bug in dlrm", and no summary.json)."""
    from dlrm.train.sessions import with_sessions

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"steps": 10, "sessions": [{"start_step": 0, "end_step": 10, "discarded_after": mark}]}))
    summary = {"steps": 12, "resumed_at_step": 2}
    with_sessions(summary, path)
    assert summary["sessions"][0]["discarded_after"] == 2
    assert summary["sessions"][-1]["start_step"] == 2


def test_an_earlier_discarded_mark_that_is_a_step_keeps_the_earliest(tmp_path):
    from dlrm.train.sessions import with_sessions

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"steps": 10, "sessions": [{"start_step": 0, "end_step": 10, "discarded_after": 1}]}))
    summary = {"steps": 12, "resumed_at_step": 2}
    with_sessions(summary, path)
    assert summary["sessions"][0]["discarded_after"] == 1


@pytest.mark.parametrize("what", ["fifo", "dev_zero"])
def test_resume_of_a_run_holding_an_event_file_that_is_no_file_ends(trained, tmp_path, what):  # noqa: F811
    """At a resumed session's end the earlier sessions' event files are read whole, for their HParams: a handed-over
    run's FIFO of that name hung it there for good (after all its training), a link to /dev/zero read until memory ran
    out. Now such an entry is left alone, said in a warning."""
    import shutil

    tb = tmp_path / "tb"
    shutil.copytree(Path(trained["cfg"].log.tb_dir), tb, symlinks=True)
    evil = tb / "run" / "events.out.tfevents.1.evil"
    os.mkfifo(evil) if what == "fifo" else evil.symlink_to("/dev/zero")
    try:
        result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(trained["cfg_path"]),
                                 "--tb-dir", str(tb), "--run-name", "run", "--resume", "--max-steps", "4"],
                                cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the resumed session hung at its end")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{evil}: not read" in result.stderr


# -- a sweep trial's failure mark ------------------------------------------------------------------------------------

def test_a_failed_trials_mark_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    """A handed-over sweep's trial directory with ``sweep_trial_failed.txt -> ~/.bashrc`` and a checkpoint (so its
    --resume trains in that directory): when the trial failed (a checkpoint of NaN weights fails it at once), the
    reason was written into the user's file."""
    from dlrm.sweep_resume import FAILED_MARK, _failure, mark_failed

    victim = _victim(tmp_path)
    run_dir = tmp_path / "seed-0"
    run_dir.mkdir()
    (run_dir / FAILED_MARK).symlink_to(victim)
    mark_failed(run_dir, "weight became NaN")
    assert victim.read_text() == PRECIOUS
    assert not (run_dir / FAILED_MARK).is_symlink() and _failure(run_dir) == "weight became NaN"


def test_a_failure_mark_that_is_a_fifo_is_no_mark_and_does_not_hang(tmp_path):
    """`sweep --resume` read the mark of each trial it found without a summary or checkpoint: a FIFO hung it."""
    from dlrm.sweep_resume import FAILED_MARK

    run_dir = tmp_path / "seed-0"
    run_dir.mkdir()
    os.mkfifo(run_dir / FAILED_MARK)
    code = "import sys; from pathlib import Path; from dlrm.sweep_resume import _failure; print(_failure(Path(sys.argv[1])))"
    try:
        result = subprocess.run([sys.executable, "-c", code, str(run_dir)], env=CHILD_ENV, capture_output=True,
                                text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("reading the failure mark hung")
    assert result.stdout.strip() == "None", result.stderr[-2000:]
