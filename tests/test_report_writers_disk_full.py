"""The TensorBoard events --compare and a sweep write beside their reports (`dlrm.train.compare.log_comparison`,
`dlrm.sweep_report.write_hparams`) on a full disk: an OSError naming the event file, as a run's own writer gives
(`dlrm.train.reporting.open_writer`). A plain SummaryWriter's thread died of it with a traceback on stderr
("Exception in thread"), and the error raised afterwards named no file."""

from __future__ import annotations

import errno
import threading

import pytest
from tensorboard.compat.tensorflow_stub.io import gfile

from dlrm.sweep import SettingResult
from dlrm.sweep_report import write_hparams
from dlrm.train.compare import log_comparison


@pytest.fixture
def full_disk(monkeypatch):
    """Every event-file append fails with ENOSPC; the threads that die of it, collected."""
    died = []

    def append(self, filename, content, binary_mode=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gfile.LocalFileSystem, "append", append)
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    return died


def test_the_comparison_s_events_on_a_full_disk_name_the_event_file(tmp_path, full_disk):
    with pytest.raises(OSError, match="No space left on device") as e:
        log_comparison(tmp_path, "| variant |\n| --- |\n| eager |", b"")
    assert e.value.filename.startswith(str(tmp_path / "events.out.tfevents."))
    assert full_disk == []


def test_a_sweep_s_hparams_on_a_full_disk_name_the_event_file(tmp_path, full_disk):
    result = SettingResult(0, {"optim.sparse.lr": 0.01}, [{"auc": 0.7, "logloss": 0.5}], {})
    with pytest.raises(OSError, match="No space left on device") as e:
        write_hparams(tmp_path, [result])
    assert str(tmp_path) in e.value.filename and "events.out.tfevents." in e.value.filename
    assert full_disk == []
