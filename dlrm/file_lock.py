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
import re
import socket
import stat
import time
from pathlib import Path


class LockHeld(Exception):
    """Another open file description holds the lock; ``holder`` is the line it wrote ("pid N on HOST ...")."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class NotALockFile(OSError):
    """The lock's path holds a symbolic link or something other than a regular file (a FIFO, a device, a directory):
    never opened for writing, so no other file is written through it (`try_lock`)."""


def _open_lock(path: Path) -> int:
    """`path` opened read-write (created 0644), the last component not followed: a run directory or sweep handed over
    by someone else (a tarball, a shared disk) may hold ``.lock -> ~/.bashrc``, and the holder's line written into the
    lock (`name_holder`, after a truncation) emptied that file. Raises `NotALockFile` for a link or a non-regular file
    (O_NONBLOCK: a FIFO's open does not wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise NotALockFile(errno.ELOOP, f"a symbolic link (to {os.readlink(path)!r}) where a lock file belongs, never "
                           "written through; remove it", str(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotALockFile(errno.EINVAL, "not a regular file where a lock file belongs; remove it", str(path))
    return fd


# a terminal's escape sequence: CSI (ESC [ ... a final byte), OSC (ESC ] ... BEL or ESC \), or ESC and one character
_ESCAPE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|.)", re.DOTALL)


def _holder_line(fd: int) -> str:
    r"""The line the lock file holds, as text to print: written by any process that could write the file (a run
    directory or dataset handed over by someone else), so its terminal escape sequences and other non-printable
    characters are dropped (printable: `str.isprintable`, as `dlrm.config_parse` shows a user's key); printed raw,
    they could clear the screen or rewrite the line that names the holder.

        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"pid 7 on h\x1b[2J\x1b]0;title\x07\r\n")
        ...     f.flush()
        ...     _holder_line(f.fileno())
        'pid 7 on h'
    """
    text = _ESCAPE.sub("", os.pread(fd, 200, 0).decode(errors="replace"))
    return "".join(c for c in text if c.isprintable()).strip()


def try_lock(path: Path, shared: bool = False) -> tuple[int, str]:
    """Open `path` (created 0644; `_open_lock`: never through a symbolic link) and take its exclusive lock (`shared`: a
    shared one, which others' shared locks allow) without waiting: (the descriptor, the line the file held: a dead
    holder's, or ""). Raises `LockHeld` while another holds it (exclusively, or at all for an exclusive lock),
    `NotALockFile` for a link or a non-regular file there; other OSErrors as they come."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder_line(fd) or "another process"
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise LockHeld(holder) from None
        raise
    return fd, _holder_line(fd)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0 checks without signalling)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # exists, owned by someone else
    except (ProcessLookupError, OverflowError):
        return False
    return True


# How long a taker waits for a lock held under no live holder's name: a moment's holder that never names itself,
# `dlrm.train.run_dir.lock_holder`'s probe (a refusal's advice, a sweep's --resume) or a taker between its flock and
# `name_holder`, holds it for microseconds; a run starting just then was refused as "in use by" the line of the run
# that last held it, long gone. A real holder names itself at once and is refused without waiting.
UNNAMED_HOLD_WAIT_S = 0.5
_UNNAMED_HOLD_POLL_S = 0.002
_clock, _pause = time.monotonic, time.sleep  # (the tests' stand-ins replace these, not the time module's)


def _named_live(holder: str) -> bool:
    """Whether the lock file's line names a live holder: a process of this host that exists, or one of another host
    (its liveness unknown here: a shared disk)."""
    m = re.match(r"pid (\d+) on (\S+)", holder)
    if m is None:
        return False
    return m.group(2) != socket.gethostname() or pid_alive(int(m.group(1)))


def try_lock_named(path: Path, shared: bool = False) -> tuple[int, str]:
    """`try_lock`, of the file that `path` names once the lock is taken. A holder that removes its lock file (its
    release) does so while still holding it, but a taker that opened the file just before and takes the lock just
    after holds a file no longer named `path`, while the next taker creates and locks a new one: two holders. So the
    taker checks, after its flock, that `path` still names the file it locked, else opens the new one and tries again.
    A lock held under no live holder's name is tried again for `UNNAMED_HOLD_WAIT_S` before `LockHeld` is raised."""
    deadline = None
    while True:
        try:
            fd, previous = try_lock(path, shared)
        except LockHeld as held:
            if _named_live(held.holder):
                raise
            now = _clock()
            deadline = now + UNNAMED_HOLD_WAIT_S if deadline is None else deadline
            if now >= deadline:
                raise
            _pause(_UNNAMED_HOLD_POLL_S)
            continue
        try:
            named, held = os.lstat(path), os.fstat(fd)
            if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                return fd, previous
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_held(path: Path, fd: int) -> None:
    """Remove the lock file `path` whose lock `fd` holds, before closing `fd` (`try_lock_named` is what makes that safe
    for every taker). Not when `path` names another file now (removed by hand and made again by a later taker, whose
    lock it is)."""
    try:
        named, held = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return
    if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
        os.unlink(path)


def name_holder(fd: int, since: bool = False, note: str = "") -> None:
    """Write this process's line into the locked file `fd` ("pid N on HOST", and the time with `since`, then `note`)."""
    line = f"pid {os.getpid()} on {socket.gethostname()}" + (f" since {time.strftime('%Y-%m-%d %H:%M:%S')}" if since else "")
    line += note
    os.ftruncate(fd, 0)
    os.pwrite(fd, (line + "\n").encode(), 0)
