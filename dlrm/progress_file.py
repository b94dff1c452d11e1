"""Binary file wrappers through which checkpoints are written and read (`dlrm.checkpoint`): a progress bar that follows
the bytes, and the failures torch's zip writer would otherwise hide behind its RuntimeError."""

from __future__ import annotations

from typing import Optional

from tqdm import tqdm


class ProgressFile:
    """A binary file whose writes advance a progress bar (`bar`, optional) and which keeps its first failed write's
    OSError (`error`): torch's zip writer turns an OSError of the file object's ``write`` (a full disk, a quota) into a
    RuntimeError ("unexpected pos ..."), which said neither the cause nor the file (a traceback and exit 1, unless
    little space was left: not so over a quota, nor once a large checkpoint's temporary file was removed); and a stop
    raised in a write (`stop`: a second SIGTERM's SystemExit, Ctrl-C), which read as "a bug", exit 1."""

    def __init__(self, f, bar: Optional[tqdm] = None) -> None:
        self._f, self._bar = f, bar
        self.error: Optional[OSError] = None
        self.stop: Optional[BaseException] = None  # a signal's stop raised in a write

    def write(self, data) -> int:
        try:
            n = self._f.write(data)
            if self._bar is not None:  # the total counts the tensors only: the archive's own few bytes stop at 100%
                self._bar.update(min(len(data), self._bar.total - self._bar.n))
            return n
        except OSError as e:
            self.error = self.error or e
            raise
        except BaseException as e:  # (a signal handler's exception, raised anywhere in here)
            self.stop = self.stop or e
            raise

    def flush(self) -> None:
        self._f.flush()

    def seek(self, offset: int, whence: int = 0) -> int:
        """(torch.save under ``skip_data`` seeks past each tensor's bytes, written later: `dlrm.stream_save`)"""
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


class ReadProgress:
    """A binary file whose reads advance a progress bar (torch.load reads an archive through readinto, seek and
    tell)."""

    def __init__(self, f, bar: tqdm) -> None:
        self._f, self._bar = f, bar

    def _advance(self, n: int) -> None:
        self._bar.update(max(0, min(n, self._bar.total - self._bar.n)))  # a seek back reads some bytes twice

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self._advance(len(data))
        return data

    def readinto(self, buffer) -> int:
        n = self._f.readinto(buffer)
        self._advance(n or 0)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()
