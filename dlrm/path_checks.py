"""Paths the file system cannot take at all: a name over 255 bytes, a path over PATH_MAX, one through a symbolic
link loop or a directory without search permission.

`os.stat` of such a path raises (ENAMETOOLONG, ELOOP, EACCES), and pathlib's ``is_dir``/``is_file``/``exists``
swallow only ENOENT, ENOTDIR, EBADF and ELOOP: a ``--data`` or ``--tb-dir`` of a 300-byte name made train.py say
"this is a bug in dlrm (OSError)" with a traceback, exit 1, from whichever check looked at it first (a sweep's
``--config``, ``--resume``, ``--run-name`` too). Each command checks every path it is given here, before any work
(nothing created: ``mkdir -p`` of ``new/<300 bytes>`` made ``new`` first), in one line naming the flag or key and
the value, shortened when long (`shown_path`). A missing path is left to the caller's own check, which says what it
found there; one under a file too, unless asked (`under_file`: where that check named no flag, "checkpoint not found"
of ``afile/x.pt``). Torch-free: the data tools' click types use it (`dlrm.one_line_usage`).
"""

from __future__ import annotations

import errno
import os
from typing import Callable, Optional, Union

NAME_MAX = 255  # bytes of one name (Linux's file systems: ext4, xfs, btrfs, tmpfs)
PATH_MAX = 4096  # bytes of a whole path given to the kernel, its final NUL included

PathText = Union[str, bytes, "os.PathLike[str]"]


def shown_path(path: PathText, limit: int = 120) -> str:
    """`path` for a message: itself, or its start and end around "..." with its length in bytes when longer than
    `limit` characters (a 5,000-byte path made a line of 5,000 characters; both ends tell paths apart).

    >>> shown_path("/tmp/" + "x" * 300, limit=20)
    '/tmp/xxxxx...xxxxxxx (305 bytes)'
    """
    text = os.fsdecode(path)
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}...{text[-(limit - head - 3):]} ({len(os.fsencode(text))} bytes)"


def absolute_size(path: PathText) -> int:
    """Bytes of `path` made absolute: the commands work with os.path.abspath(path) (a run directory, a dataset's
    lock beside it)."""
    raw = os.fsencode(path)
    try:
        return len(os.fsencode(os.path.abspath(os.fsdecode(raw))))
    except OSError:  # (a working directory removed since: getcwd fails, and the path's own length is what is known)
        return len(raw)


def file_on_the_way(path: PathText) -> Optional[str]:
    """The existing file (not a directory) that `path` goes through, as in ``afile/x`` (ENOTDIR), or None.

    >>> import tempfile; d = tempfile.mkdtemp(); open(os.path.join(d, "f"), "w").close()
    >>> file_on_the_way(os.path.join(d, "f", "x")) == os.path.join(d, "f"), file_on_the_way(d)
    (True, None)
    """
    try:
        os.lstat(path)
        return None
    except OSError as e:
        if e.errno != errno.ENOTDIR:
            return None
    except ValueError:
        return None
    here = os.path.abspath(os.fsdecode(path))
    while os.path.dirname(here) != here:
        here = os.path.dirname(here)
        if os.path.lexists(here):  # the deepest part that exists: a file (or a link to one) where a directory must be
            return None if os.path.isdir(here) else here
    return None


def path_problem(path: PathText, under_file: bool = False) -> Optional[str]:
    """Why no file can be found or made at `path`, or None. `under_file`: also a path through a file (``afile/x``,
    ENOTDIR), which a command's own check named as missing ("checkpoint not found", "no such file") without its flag.

    >>> path_problem("x" * 256)
    'a name of 256 bytes in it is too long (at most 255)'
    >>> path_problem("missing/dir") is None
    True
    """
    raw = os.fsencode(path)
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return f"a name of {len(longest)} bytes in it is too long (at most {NAME_MAX})"
    size = absolute_size(raw)
    if size >= PATH_MAX:
        whose = "a" if raw.startswith(b"/") else "its absolute"
        return f"{whose} path of {size} bytes is too long (at most {PATH_MAX - 1})"
    try:
        os.lstat(raw)  # (not following a last link: a link OUT that --overwrite replaces is the caller's to judge)
    except OSError as e:
        if e.errno == errno.ENOTDIR and under_file:
            above = file_on_the_way(raw)
            return f"{shown_path(above) if above else 'a part of it'} is not a directory"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        if e.errno == errno.ELOOP:
            return "a symbolic link in it loops (too many levels of symbolic links)"
        # EACCES: a directory on the way without search permission; ENAMETOOLONG of a file system with shorter names
        return e.strerror or str(e)
    except ValueError:  # an embedded NUL: the config's own check names it (a command line cannot hold one)
        return None
    return None


def check_path(flag: str, path: Optional[PathText], error: Optional[Callable[[str], Exception]] = None,
               under_file: bool = False) -> None:
    """Raise `error` (default `dlrm.errors.ConfigError`, exit 2) ``"<flag>: <path>: <problem>"`` when `path` has a
    `path_problem` (`under_file`: a path through a file too); None and "" pass (an option left out; an empty one is
    refused as such elsewhere)."""
    if path is None or os.fspath(path) in ("", b""):
        return
    problem = path_problem(path, under_file)
    if problem is not None:
        if error is None:
            from dlrm.errors import ConfigError

            error = ConfigError
        raise error(f"{flag}: {shown_path(path)}: {problem}")
