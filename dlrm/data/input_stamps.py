"""The input files' stamps (size, modification time) an unfinished import recorded, so that its resume writes again
the finished files of an input changed since, instead of mixing them with files written from the new input.

An import (`dlrm.data.mlperf_import`) that stops keeps the files it finished for the same command to resume from.
Its plan names the input directory, the options and each day's row count, not the files' contents: a day's files
replaced by others of the same shape (MLPerf's multi-hot ids drawn again, another preprocessing) passed the plan's
check, and the resume kept the old day's finished files beside new ones. Refusing such a resume would also refuse
the documented repair (a day stopped by a bad id, mended, then resumed), so the finished files of a changed input
are written again instead, and those of unchanged inputs kept.
"""

from __future__ import annotations

import os
from pathlib import Path

from dlrm.data.schema import write_json_atomic
from dlrm.json_file import read_json

STAMPS_FILE = "input-stamps.json"


def file_stamp(path: Path) -> list[int]:
    """[size in bytes, modification time, status change time (ns)] of `path`. The change time too: a file rewritten
    to the same size within a coarse file system's mtime step (1-2 s), or whose mtime a copy restored (``tar``,
    ``rsync -t``), keeps its size and mtime, but no tool can set the change time (a chmod moves it too: a needless
    redo of that day, never a missed change)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def redo_changed_inputs(work: Path, inputs: dict[str, list[Path]], outputs: dict[str, list[str]]) -> dict[str, int]:
    """Remove from `work` the finished outputs of every input whose stamps differ from those recorded there, then
    record the stamps of all `inputs` now; {input key: files removed} of the changed inputs that had any.

    Args:
        work: the unfinished import's directory (it holds ``STAMPS_FILE`` from the run that last started there).
        inputs: input key (a day) -> the files it is read from.
        outputs: input key -> the paths, relative to `work`, of the files written from it.

    An import started by a version that recorded no stamps is taken as it is (nothing to compare with). The stamps are
    written after the removals: a kill in between finds the same changes again on the next resume.

    Example:
        >>> import tempfile
        >>> work, src = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp()) / "day_0.npy"
        >>> _ = src.write_bytes(b"ab"); _ = (work / "part-0.parquet").write_bytes(b"old")
        >>> redo_changed_inputs(work, {"0": [src]}, {"0": ["part-0.parquet"]})  # the first run records them
        {}
        >>> _ = src.write_bytes(b"abc")  # the day's file replaced before the resume
        >>> redo_changed_inputs(work, {"0": [src]}, {"0": ["part-0.parquet"]}), (work / "part-0.parquet").exists()
        ({'0': 1}, False)
    """
    now = {key: [file_stamp(p) for p in paths] for key, paths in inputs.items()}
    try:
        recorded = read_json(work / STAMPS_FILE)
    except (OSError, ValueError):  # none yet (a new import, or one an older version started), or cut short
        recorded = None
    removed: dict[str, int] = {}
    if isinstance(recorded, dict):
        for key, stamps in now.items():
            if key in recorded and recorded[key] != stamps:
                gone = [p for p in outputs.get(key, []) if (work / p).is_file()]
                for p in gone:
                    (work / p).unlink()
                if gone:
                    removed[key] = len(gone)
    write_json_atomic(work / STAMPS_FILE, now)
    return removed
