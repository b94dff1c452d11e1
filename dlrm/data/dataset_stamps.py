"""What a resume compares to tell whether a dataset changed since its run or sweep began on it (`dataset_stamps`):
each of its files' size and a SHA-256 of its parquet footer, not of its rows.

The SHA-256 of metadata.json alone (all a sweep recorded before 2026-12-04; a checkpoint recorded none) passed every
change that keeps metadata.json: a dataset regenerated in place with the same seed and rows by a changed generator,
parquet files rewritten by hand (rows reordered, values mended), a split file truncated or replaced by another with as
many rows. A hash of every byte would tell those too, but reads the whole dataset at every start and resume (hundreds
of GB for MLPerf DLRM-DCNv2's import). A parquet footer holds each row group's row count and each column chunk's
offset, compressed and uncompressed sizes and statistics: other rows, another order, another encoding change it in all
but contrived cases, and it is a small part of its file, read from its end. The same dataset written again (the same
command and pyarrow: the same bytes) has the same stamps, and resumes.

A sweep records them in sweep.json (`dlrm.sweep_resume.check_datasets_unchanged`), a run in every checkpoint
(`dlrm.train.resume_policy.check_dataset_unchanged`); both compare them with `stamp_change`.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any, Optional

from dlrm.data.schema import NUM_SPARSE, DatasetError, read_metadata

METADATA = "metadata.json"
EDGE_BYTES = 1 << 20
"""A file without a parquet footer (a vocabulary's .npy) is stamped by its first and last this many bytes."""
_MAGIC = b"PAR1"


def file_stamp(path: Path, whole: bool = False) -> str:
    """``"<size>:<sha256 hex>"`` of the file `path`: the SHA-256 of its parquet footer (its last bytes: the footer,
    its length and the magic), or of a file that has none its first and last `EDGE_BYTES` (`whole`: of all its bytes);
    ``"missing"``, or ``"unreadable (<why>)"`` where it cannot be read (the run that reads it refuses it, naming it).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "f.bin"
        >>> _ = path.write_bytes(b"abc")
        >>> file_stamp(path)[:12], file_stamp(path.with_name("gone.bin"))
        ('3:ba7816bf8f', 'missing')
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # (a FIFO would block the open)
            return "unreadable (not a regular file)"
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            footer = None if whole else _footer_bytes(f, size)
            if footer is not None:
                digest.update(footer)
            elif whole:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            else:
                digest.update(f.read(EDGE_BYTES))
                if size > EDGE_BYTES:  # (a file of up to 2 EDGE_BYTES: its last bytes from the first's end)
                    f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                    digest.update(f.read(EDGE_BYTES))
        return f"{size}:{digest.hexdigest()}"
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def _footer_bytes(f: Any, size: int) -> Optional[bytes]:
    """The last bytes of an open parquet file from its footer on (footer, length, magic); None for another file."""
    if size < 12:
        return None
    f.seek(size - 8)
    tail = f.read(8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != _MAGIC or length + 12 > size:
        return None
    f.seek(size - 8 - length)
    return f.read(length + 8)


def dataset_stamps(data_dir: str | os.PathLike) -> dict[str, str]:
    """{file: `file_stamp`} of the dataset in `data_dir`: metadata.json (all its bytes) first, then every file its
    splits list and, with hashing "vocabulary", its vocabularies, by their paths relative to `data_dir`. A metadata.json
    that is no dataset's gives its own stamp alone (the runs refuse the dataset, saying why).

    Raises nothing: a file that cannot be read is stamped so (`file_stamp`), and differs from a readable one.
    """
    data_dir = Path(data_dir)
    stamps = {METADATA: file_stamp(data_dir / METADATA, whole=True)}
    try:
        meta = read_metadata(data_dir)
    except (OSError, DatasetError):
        return stamps
    names = [name for info in meta.splits.values() for name in info.files]
    if meta.hashing == "vocabulary":  # (`dlrm.data.vocabulary.vocab_path`'s, relative)
        names += [f"vocab/SPARSE_{f}.npy" for f in range(NUM_SPARSE)]
    for name in names:
        stamps.setdefault(name, file_stamp(data_dir / name))
    return stamps


def is_stamps(value: Any) -> bool:
    """Whether `value` is a `dataset_stamps` result as read back (a record may be hand-edited or damaged)."""
    return type(value) is dict and all(type(k) is str and type(v) is str for k, v in value.items())


def stamp_change(recorded: dict[str, str], now: dict[str, str]) -> Optional[str]:
    """What differs between two `dataset_stamps` of one dataset, in a few words naming the first file that changed
    (metadata.json first) and how many others did; None when nothing did.

    Example:
        >>> stamp_change({"metadata.json": "9:aa", "train/a.parquet": "100:bb"},
        ...              {"metadata.json": "9:aa", "train/a.parquet": "96:cc"})
        'train/a.parquet changed (100 -> 96 bytes)'
    """
    changed = [name for name in {**recorded, **now} if recorded.get(name) != now.get(name)]
    if not changed:
        return None
    name = changed[0]
    old, new = recorded.get(name), now.get(name)
    if old is None:
        what = f"{name} is new (metadata.json did not list it)"
    elif new is None:
        what = f"{name} is no longer listed in metadata.json"
    elif new == "missing" or not new[:1].isdigit():
        what = f"{name} is {'gone' if new == 'missing' else new}"
    elif old.split(":")[0] != new.split(":")[0]:
        what = f"{name} changed ({_size(old)} -> {_size(new)} bytes)"
    else:
        how = "its parquet footer (row groups, column statistics) differs" if name.endswith(".parquet") else \
            "its bytes differ"
        what = f"{name} changed (the same size, but {how})"
    more = len(changed) - 1
    return what + (f"; {more} other file{'s differ' if more > 1 else ' differs'} too" if more else "")


def _size(stamp: str) -> str:
    size = stamp.split(":")[0]
    return f"{int(size):,}" if size.isdigit() else "?"
