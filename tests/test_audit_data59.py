"""Audit data59: data loading and tools at scale (the split held once, int64 widening without extra copies, trailing
blank lines, count-pass and checkpoint-load progress)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrm.config import load_config
from dlrm.data import device_loader as device_loader_module
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import split_files
from dlrm.data.schema import read_metadata
from dlrm.distributed.env import DistEnv
from tests.conftest import REPO, make_dataset, write_rows


def test_gpu_placement_split_smaller_than_a_batch_is_loaded_once(tmp_path, monkeypatch):
    """data.placement "gpu" and a train split (40 rows) smaller than data.batch_size (256): the loader was built a
    second time for the smaller batch, reading the whole split into (device) memory twice."""
    from dlrm.train.setup import load_dataset_metadata
    from dlrm.train.train_data import TrainData

    root = tmp_path / "ds"
    make_dataset(root, {"train": 40, "validation": 12})
    loads: list[int] = []
    real_load = DeviceLoader._load

    def counting_load(self):
        loads.append(len(self.files))
        return real_load(self)

    monkeypatch.setattr(DeviceLoader, "_load", counting_load)
    cfg = load_config(REPO / "configs" / "sample.json", {"data.path": str(root), "data.batch_size": 256,
                                                          "train.device": "cpu", "data.placement": "gpu"})
    data_dir, meta = load_dataset_metadata(cfg)
    built = TrainData.build(cfg, data_dir, meta, torch.device("cpu"), DistEnv(), "gpu")
    assert len(loads) == 2, loads  # train once, validation once
    assert built.batch_size == 40 and len(built.train) == 1
    assert [len(b) for b in built.train] == [40]


def test_widening_to_int64_midway_keeps_every_row(tmp_path, monkeypatch):
    """A value outside the int32 form's range in a later row group sends the split to int64: the rows loaded before
    are widened a slice at a time into the int64 block (no concatenated copies), exactly."""
    root = tmp_path / "ds"
    arrays = make_dataset(root, {"train": 50}, files_per_split=1, row_group_size=7)
    # several slices for the 42 rows before the value (raising=False: the name is the fix's)
    monkeypatch.setattr(device_loader_module, "_WIDEN_ROWS", 3, raising=False)
    widened: list[int] = []
    real_widen = device_loader_module._widen

    def recording_widen(x, padded=False):
        widened.append(int(x.shape[0]))
        return real_widen(x, padded)

    monkeypatch.setattr(device_loader_module, "_widen", recording_widen)
    sparse = arrays["train"]["sparse"].copy()
    sparse[45, 3] = 0xFFFFFFFF  # in the last row group: forces int64 after 6 groups
    write_rows(root / "train/part-00000.parquet", arrays["train"]["label"], arrays["train"]["dense"], sparse, 7)
    loader = DeviceLoader(split_files(root, read_metadata(root), "train"), 50, "cpu")
    assert loader.sparse.dtype == torch.int64
    np.testing.assert_array_equal(loader.sparse.numpy(), sparse)
    assert widened and max(widened) <= 3, widened  # never the 42 loaded rows at once (a whole split, at scale)


# -- trailing empty lines are no records; an empty line between records is a bad line ----------------------------

FAST = dict(workers=1, progress=False, compression="none")


def tsv_line(k: int) -> str:
    return "\t".join([str(k % 2), str(k), *["1"] * 12, f"{k * 2654435761 % (1 << 32):08x}", *["00000001"] * 25])


def _write(path, text: bytes):
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "wb") as f:
            f.write(text)
    else:
        path.write_bytes(text)
    return path


@pytest.mark.parametrize("name,newline,tail", [("a.tsv", "\n", "\n"), ("a.tsv", "\n", "\n\n\n"),
                                               ("a.tsv", "\r\n", "\r\n"), ("a.tsv.gz", "\n", "\n\n")])
def test_trailing_empty_lines_are_left_out(tmp_path, name, newline, tail):
    """A file whose records are followed by empty lines (an editor's trailing newline, `echo >> file`): the first
    empty line stopped the run with "expected 40 fields ..., found an empty line" (and, skipped, counted as a bad
    line). They are left out, with a log note, and every record is kept."""
    from loguru import logger

    from dlrm.data import preprocess as pp

    src = _write(tmp_path / name, "".join(tsv_line(k) + newline for k in range(20)).encode() + tail.encode())
    notes: list[str] = []
    handle = logger.add(lambda m: notes.append(m.record["message"]), level="INFO")
    try:
        meta = pp.preprocess([src], tmp_path / "ds", chunk_rows=8, **FAST)
    finally:
        logger.remove(handle)
    assert sum(s.rows for s in meta.splits.values()) == 20
    assert not any(meta.extra["bad_lines"].values()), meta.extra["bad_lines"]
    blank = tail.count("\n")
    assert any(f"ends in {blank} empty line(s)" in m and str(src) in m for m in notes), notes


def test_trailing_empty_lines_in_the_parallel_count(tmp_path):
    """The count of a big plain file spread over workers (`scan_file_parallel`) leaves them out the same way."""
    from concurrent.futures import ThreadPoolExecutor

    from dlrm.data.preprocess.scan import scan_file, scan_file_parallel

    src = _write(tmp_path / "a.tsv", "".join(tsv_line(k) + "\n" for k in range(30)).encode() + b"\n\r\n\n")
    with ThreadPoolExecutor(2) as pool:
        parallel = scan_file_parallel(src, "auto", 7, pool, 4)
    serial = scan_file(src, "auto", 7)
    assert parallel.lines == serial.lines == 30
    assert parallel.trailing_blank == serial.trailing_blank == 3
    assert parallel.offsets == serial.offsets and serial.offsets[-1] == src.stat().st_size - 4


def test_an_empty_line_between_records_still_stops(tmp_path):
    """Only the empty lines after the last record are left out: one between records is a bad line, named."""
    from dlrm.data import preprocess as pp

    src = _write(tmp_path / "a.tsv", (tsv_line(0) + "\n\n" + tsv_line(1) + "\n\n").encode())
    with pytest.raises(pp.PreprocessError, match=r"a.tsv:2: .*found an empty line"):
        pp.preprocess([src], tmp_path / "ds", **FAST)
    assert not (tmp_path / "ds").exists()


def test_blank_tail_across_block_boundaries():
    """The count pass reads a gzip file in blocks: the trailing empty lines and the end of the last record come out
    the same whichever way the bytes are cut (a CR at a block's end, a block of newlines alone)."""
    from dlrm.data.preprocess.scan import _BlankTail

    data = b"r1\nr2\r\n\r\n\n\r\n"
    whole = _BlankTail()
    whole.feed(data, 0)
    assert (whole.blank, whole.content_end) == (3, 7)
    for cut in range(1, len(data)):
        parts = _BlankTail()
        parts.feed(data[:cut], 0)
        parts.feed(data[cut:], cut)
        assert (parts.blank, parts.content_end) == (3, 7), cut
    one_by_one = _BlankTail()
    for i in range(len(data)):
        one_by_one.feed(data[i:i + 1], i)
    assert (one_by_one.blank, one_by_one.content_end) == (3, 7)


# -- the count pass shows progress within a file ---------------------------------------------------------------


class _RecordingBar:
    """Stands in for tqdm: what the count pass's bar was made with and told."""

    made: list[dict] = []

    def __init__(self, *args, **kwargs):
        self.kwargs, self.n = kwargs, 0
        self.total, self.disable = kwargs.get("total"), bool(kwargs.get("disable"))
        _RecordingBar.made.append(self)

    def update(self, n=1):
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["big.tsv", "big.tsv.gz"])
def test_counting_one_big_file_shows_byte_progress(tmp_path, monkeypatch, name):
    """One input file (a 50 GB day file): the count pass's bar counted files and was off for a single one, so the
    minutes it takes showed nothing. It now counts the file's bytes on disk, as they are read."""
    from dlrm.data.preprocess import scan as scan_module

    _RecordingBar.made = []
    monkeypatch.setattr(scan_module, "ProgressBar", _RecordingBar)
    monkeypatch.setattr(scan_module, "_READ_BLOCK", 4096)  # many blocks for a small file
    text = "".join(tsv_line(k) + "\n" for k in range(400)).encode()
    src = _write(tmp_path / name, text)
    updates: list[int] = []
    real_update = _RecordingBar.update
    monkeypatch.setattr(_RecordingBar, "update", lambda self, n=1: (updates.append(n), real_update(self, n)))
    scans = scan_module._count_pass([src], "auto", 100, None, 1, True)
    assert scans[0].lines == 400
    bar = next(b for b in _RecordingBar.made if b.kwargs.get("desc") == "counting lines")
    assert not bar.kwargs.get("disable") and bar.kwargs.get("unit") == "B"
    assert bar.kwargs["total"] == src.stat().st_size == bar.n
    if name.endswith(".tsv"):
        assert len(updates) > 1, updates  # block by block, not once at the end


def test_counting_a_big_plain_file_over_workers_reports_each_range(tmp_path, monkeypatch):
    """A big plain file counted by the workers (`scan_file_parallel`): the bar moves as each byte range is counted."""
    from concurrent.futures import ThreadPoolExecutor

    from dlrm.data.preprocess import scan as scan_module

    _RecordingBar.made = []
    monkeypatch.setattr(scan_module, "ProgressBar", _RecordingBar)
    monkeypatch.setattr(scan_module, "_PARALLEL_SCAN_MIN_BYTES", 1)
    src = _write(tmp_path / "a.tsv", "".join(tsv_line(k) + "\n" for k in range(200)).encode())
    with ThreadPoolExecutor(2) as pool:
        scans = scan_module._count_pass([src], "auto", 50, pool, 2, True)
    assert scans[0].lines == 200
    bar = next(b for b in _RecordingBar.made if b.kwargs.get("desc") == "counting lines")
    assert bar.n == src.stat().st_size


def test_reading_a_big_checkpoint_shows_a_bar(tmp_path, monkeypatch):
    """--resume of a big checkpoint (MLPerf's: tens of GB) read for minutes with no sign of life; writing one showed a
    bar. Reading one of at least PROGRESS_BYTES now shows one too (bytes of the file), and loads the same state."""
    from dlrm import checkpoint as ckpt
    from tests.test_audit_checkpoint_files import tiny_state

    path = tmp_path / "step-00000001.pt"
    ckpt.write_atomic(path, tiny_state(step=1), progress=False)
    small = ckpt.load_checkpoint(path)
    _RecordingBar.made = []
    monkeypatch.setattr(ckpt, "ProgressBar", _RecordingBar)
    monkeypatch.setattr(ckpt, "PROGRESS_BYTES", 1)
    big = ckpt.load_checkpoint(path)
    bars = [b for b in _RecordingBar.made if "reading step-00000001.pt" in str(b.kwargs.get("desc"))]
    assert len(bars) == 1 and not bars[0].kwargs.get("disable"), [b.kwargs for b in _RecordingBar.made]
    assert bars[0].n == path.stat().st_size == bars[0].kwargs["total"]
    assert big["position"] == small["position"]
    assert torch.equal(big["model"][next(iter(big["model"]))], small["model"][next(iter(small["model"]))])
