"""--overwrite of a complete dataset: the new one is built beside the old one and swapped in whole.

A run that replaces a complete dataset (``metadata.json`` in ``--output``) writes the new dataset into
``OUT/.preprocess-new/`` (the staging directory: its shards, ``_progress/`` and, last, its metadata.json), so
that a bad line, a full disk, Ctrl-C or a kill leaves the old dataset as it was: a training run on ``OUT``
still reads it, and the same command without --overwrite resumes the replacement (with --overwrite, it
starts the replacement over). Before, the old dataset was removed after the count pass, and a run that then
failed left neither.

Once the new dataset is complete the swap renames a handful of entries (``metadata.json``, the split
directories, ``vocab/``). It is journaled (``OUT/.preprocess-swap.json``: the old and the new entries'
names), so a kill inside it is finished by the next run of the output (`finish_replacement`, under the
output's lock): the old entries go aside into ``OUT/.preprocess-old/`` (metadata.json first: a directory
half swapped never claims to be a complete dataset), the new ones come in (metadata.json last), then the old
ones are removed. The cost: disk for both datasets until the swap.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dlrm.data.preprocess.constants import PROGRESS_DIR
from dlrm.data.schema import SPLITS, write_json_atomic
from dlrm.json_file import read_json

STAGING = ".preprocess-new"
ASIDE = ".preprocess-old"
JOURNAL = ".preprocess-swap.json"
_ENTRIES = ("metadata.json", *SPLITS, "vocab")  # a dataset's entries, in the order they are set aside


def stages_into(out: Path, overwrite: bool) -> bool:
    """Whether a run of ``out`` writes into its staging directory: ``out`` holds a complete dataset, and the run
    replaces it (--overwrite) or resumes a replacement that was stopped (the staging directory's manifest)."""
    if not (out / "metadata.json").is_file():
        return False
    return overwrite or (out / STAGING / PROGRESS_DIR / "manifest.json").is_file()


def finish_replacement(out: Path) -> bool:
    """Swap a complete staged dataset into ``out``, or finish a swap a kill cut short; True if there was one.

    Idempotent: every step checks what is already done, so a run killed anywhere in here is finished by the next.
    """
    staging, journal = out / STAGING, out / JOURNAL
    if journal.is_file():
        plan = read_json(journal)
    elif (staging / "metadata.json").is_file():
        plan = {"old": [n for n in _ENTRIES if os.path.lexists(out / n)],
                "new": [n for n in _ENTRIES if os.path.lexists(staging / n)]}
        write_json_atomic(journal, plan)
    else:
        return False
    aside = out / ASIDE
    aside.mkdir(exist_ok=True)
    if all(os.path.lexists(staging / n) for n in plan["new"]):  # no new entry moved in yet: set the old ones aside
        for name in plan["old"]:
            if os.path.lexists(out / name) and not os.path.lexists(aside / name):
                _rename(out / name, aside / name)
    for name in sorted(plan["new"], key=lambda n: n == "metadata.json"):  # metadata.json last
        if os.path.lexists(staging / name):
            _rename(staging / name, out / name)
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    journal.unlink(missing_ok=True)
    return True


def swap_committed(out: Path) -> bool:
    """Whether a staged run's new dataset is complete and swapped in, or being swapped in (its journal), given that
    the run got as far as its staging directory."""
    return (out / JOURNAL).is_file() or not (out / STAGING).exists()


def _rename(src: Path, dst: Path) -> None:
    """One step of the swap (the tests stop the swap between any two)."""
    os.replace(src, dst)


def replacement_names() -> tuple[str, ...]:
    """The names a replacement keeps in ``out`` besides the dataset's own (not the user's files)."""
    return STAGING, ASIDE, JOURNAL
