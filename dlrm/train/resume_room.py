"""A resume in place writes into the run's existing directory, wherever it is now: checked for room as a new run's
``log.tb_dir`` is (`dlrm.run_paths`), before any work.

A run moved deeper since it started (``mv tb/r archive/.../r``), or resumed on a host of a longer name (its event
files' names hold it), passed every check of ``--tb-dir``, which a resume in place does not create, and failed once
the data and the model were built: at its first event file ("a bug in dlrm (OSError)", exit 1), or, deeper still,
reading its own checkpoint. tests/test_path_room.py resumes a moved run one byte over the limit and at it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from dlrm.run_paths import check_room, longest, run_files


def resumed_in_place(resume: Optional[str], tb_dir: str, run_name: Optional[str]) -> Optional[Path]:
    """The existing run directory a training ``--resume`` continues in place (`dlrm.train.run_dir.RunDirectory`'s
    ``for_resume`` and ``create(restart=True)`` write there), or None: a new directory (a branch ``--resume CHECKPOINT
    --run-name NEW``, a run by name not there yet), which `run_deepest` checks under ``log.tb_dir`` as a new run's, or
    a resume refused later anyway (no --run-name to ``latest``, a checkpoint outside a run)."""
    named = Path(tb_dir) / run_name if run_name else None
    if resume is None or (named is not None and not os.path.lexists(named)):
        return None
    if resume == "latest":
        return named
    from dlrm.train.run_dir import BRANCH_NAME, run_of  # (torch: imported late, as the trainer is)

    source = run_of(Path(resume))
    if named is None:
        return source
    try:  # its own run by --run-name (a link to it too), or the branch of this name taken again
        same = source is not None and os.path.samefile(named, source)
    except OSError:
        same = False
    return named if same or (named / BRANCH_NAME).is_file() else None


def check_resume_room(resume: Optional[str], tb_dir: str, run_name: Optional[str]) -> None:
    """Refuse a resume in place whose run directory has no room for the longest path the session writes there
    (moved deeper since, or resumed on a host of a longer name): its first event file failed with "a bug in dlrm
    (OSError)" once the data and model were built, or the checkpoint could not even be read."""
    run = resumed_in_place(resume, tb_dir, run_name)
    if run is not None:
        check_room("--resume", str(run), longest(run_files()), advice=(
            "the run is continued in place there: move it to a shorter path and --resume it there, or continue it in "
            "a new run (--resume CHECKPOINT --tb-dir SHORTER --run-name NEW)"))
