"""An exclusive, non-blocking ``flock`` on a lock file that names its holder, for the one-writer rules: a run
directory's ``.lock`` (`dlrm.train.run_dir.RunLock`) and a data tool's ``.OUT.lock`` (`dlrm.data.output_dirs.output_lock`),
which a run reading that dataset holds shared meanwhile (`dlrm.data.output_dirs.dataset_read_lock`).
The kernel drops the lock of a process that dies, so a file left by a killed holder is simply taken over.

Example:
    >>> import os, tempfile
    >>> path = Path(tempfile.mkdtemp()) / ".lock"
    >>> fd, previous = try_lock(path)
    >>> previous, name_holder(fd)
    ('', None)
    >>> try_lock(path)  # any second holder, even one in this process, is refused
    Traceback (most recent call last):
    ...
    dlrm.file_lock.LockHeld: pid ... on ...
    >>> os.close(fd); os.remove(path); os.rmdir(path.parent)
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path


class LockHeld(Exception):
    """Another open file description holds the lock; ``holder`` is the line it wrote ("pid N on HOST ...")."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def try_lock(path: Path, shared: bool = False) -> tuple[int, str]:
    """Open `path` (created 0644) and take its exclusive lock (`shared`: a shared one, which others' shared locks
    allow) without waiting: (the descriptor, the line the file held: a dead holder's, or ""). Raises `LockHeld` while
    another holds it (exclusively, or at all for an exclusive lock); other OSErrors as they come."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise LockHeld(holder) from None
        raise
    return fd, os.pread(fd, 200, 0).decode(errors="replace").strip()


def name_holder(fd: int, since: bool = False, note: str = "") -> None:
    """Write this process's line into the locked file `fd` ("pid N on HOST", and the time with `since`, then `note`)."""
    line = f"pid {os.getpid()} on {socket.gethostname()}" + (f" since {time.strftime('%Y-%m-%d %H:%M:%S')}" if since else "")
    line += note
    os.ftruncate(fd, 0)
    os.pwrite(fd, (line + "\n").encode(), 0)
