"""The TensorBoard event writer's kept write error (`dlrm.train.reporting._KeptWriteError`) names the event file; an
OSError without an errno (a bare ``OSError("...")``, ``io.UnsupportedOperation``) read "[Errno None] ..." once rebuilt
with the file's name."""

from __future__ import annotations

import errno
import io
from types import SimpleNamespace

import pytest

from dlrm.train.reporting import _KeptWriteError


class _Failing:
    def __init__(self, error: OSError) -> None:
        self.error = error

    def write(self, data: bytes) -> None:
        raise self.error


@pytest.mark.parametrize("error", [OSError("device went away"), io.UnsupportedOperation("not writable")])
def test_an_error_without_errno_names_the_file_without_errno_none(tmp_path, error):
    path = tmp_path / "events.out.tfevents.1"
    worker = SimpleNamespace(exception=None, _record_writer=_Failing(error))
    _KeptWriteError(worker, str(path)).write(b"x")
    kept = worker.exception
    assert isinstance(kept, OSError) and kept.errno is None
    assert "Errno" not in str(kept) and str(error) in str(kept) and str(path) in str(kept)


def test_an_error_with_errno_keeps_it_and_names_the_file(tmp_path):
    path = tmp_path / "events.out.tfevents.1"
    worker = SimpleNamespace(exception=None, _record_writer=_Failing(OSError(errno.ENOSPC, "No space left on device")))
    _KeptWriteError(worker, str(path)).write(b"x")
    assert worker.exception.errno == errno.ENOSPC and worker.exception.filename == str(path)
    assert str(worker.exception) == f"[Errno {errno.ENOSPC}] No space left on device: '{path}'"
