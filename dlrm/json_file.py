"""`read_json`: the JSON of a record file that may be untrusted (a run or sweep directory someone else made, a
``config.json`` or ``sweep.json`` in a directory above an output, on a machine others write to).

``json.loads(path.read_text())`` there hung or failed in ways its callers, which catch OSError and ValueError, did
not expect: a FIFO under that name blocked the open forever (waiting for a writer: the data tools, a new run's
``--tb-dir`` check, ``--resume`` of such a directory hung), a link to ``/dev/zero`` read until memory ran out, and
JSON nested 100,000 levels deep raised RecursionError (a traceback, "a bug in dlrm"). `read_regular_file`: the
bytes of such a file, for the other files of a run directory read whole (its TensorBoard event files).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

RECORD_LIMIT = 64 << 20  # bytes: a run's config.json, a sweep's record, a data tool's plan are kilobytes to a few MB
# bytes: a run's summary.json, which holds every logged loss (``train_losses``, ~50 bytes a window as written): 64 MB
# at some 1.4M windows (train.log_every 1 over a long run), where a resume took it for unreadable (the earlier sessions'
# records dropped), a finished run for unfinished and a sweep its finished trial for one to train again
SUMMARY_LIMIT = 2 << 30


def read_json(path: str | Path, limit: int = RECORD_LIMIT) -> Any:
    """The JSON value of the regular file `path`. Raises OSError for what is not a regular file (opened without
    waiting: O_NONBLOCK) or is larger than `limit` bytes, as for a missing one, and ValueError for text that is not
    UTF-8 JSON or is nested too deep to parse.

    Example:
        >>> import shutil, tempfile
        >>> d = Path(tempfile.mkdtemp()); os.mkfifo(d / "config.json")
        >>> read_json(d / "config.json")
        Traceback (most recent call last):
        ...
        OSError: [Errno 22] not a regular file: '...config.json'
        >>> (d / "config.json").unlink(); (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
        200000
        >>> read_json(d / "config.json")
        Traceback (most recent call last):
        ...
        ValueError: ...config.json: JSON nested too deeply
        >>> shutil.rmtree(d)
    """
    data = read_regular_file(path, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None


def read_regular_file(path: str | Path, limit: Optional[int] = None) -> bytes:
    """The bytes of the regular file `path` (opened without waiting: O_NONBLOCK). Raises OSError for what is not a
    regular file (a FIFO, a device) or is larger than `limit` bytes (None: no limit)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if limit is not None and st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit:,} bytes, more than a record holds", str(path))
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:  # (grown since the fstat)
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes, more than a record holds", str(path))
    return data
