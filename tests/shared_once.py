"""A module fixture's expensive output made once per test run, not once per pytest-xdist worker.

Under ``pytest -n N --dist worksteal`` the tests of one module spread over the workers, and each worker that runs
any of them sets up the module's fixtures again: for ``tests/test_distributed_bf16.py`` (one-process and two-rank
train.py runs) that was 322 s of CPU against 193 s in one process, 2026-11-29. `computed_once` makes a directory
in the temporary root the workers of this run share, under a file lock: the first worker to ask fills it, the
others wait for it and read it. Fixtures keep their scope and return values; only what they write to disk is
shared, and tests only read it (anything a test writes goes to its own ``tmp_path``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock  # a dependency of torch

__all__ = ["computed_once"]


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary root: the workers' common parent under pytest-xdist (each worker's base is
    ``<root>/popen-gw<k>``), the base itself without it (its parent holds earlier runs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def computed_once(tmp_path_factory: pytest.TempPathFactory, key: str, make: Callable[[Path], None]) -> Path:
    """``<shared root>/once-<key>``, filled by ``make(directory)`` the first time any worker asks for ``key``.

    A worker that died while filling it leaves no completion mark (and releases the lock), so the next one
    starts over from an empty directory; ``make`` raising leaves none either, and re-raises here."""
    root = _shared_root(tmp_path_factory)
    target = root / f"once-{key}"
    done = root / f"once-{key}.done"
    with FileLock(str(root / f"once-{key}.lock")):
        if not done.exists():
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            make(target)
            done.touch()
    return target
