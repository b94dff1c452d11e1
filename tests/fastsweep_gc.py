"""An autouse fixture for the test modules whose runs call gc.collect() (a sweep frees each trial's models and compiled
graphs before the next: `dlrm.train.compare.release_memory`) or build millions of objects (a 64 MB summary.json parsed).

In a pytest-xdist worker the heap holds everything the tests before built (torch's compiler, the Triton interpreter,
datasets, ...): every full collection walks all of it, a second or more per call there. `gc.freeze()` moves what exists
when the test starts into the permanent generation, which collections skip; what the test itself builds (the trials'
models, their cycles) is collected exactly as before, so the sweep's own freeing is still what the tests check.
`gc.unfreeze()` afterwards hands the frozen objects back to the oldest generation (garbage among them is collected by
the next full collection). Import it into a test module: `from tests.fastsweep_gc import frozen_heap  # noqa: F401`;
a module-scoped fixture that runs a sweep uses `with frozen():` (a test's autouse fixtures start after those).
"""

import contextlib
import gc

import pytest

_DEPTH = 0  # how many `frozen()` blocks are open: gc.unfreeze() is not nestable, so only the outermost one calls it


@contextlib.contextmanager
def frozen():
    """What exists on entry frozen until the outermost block ends (a module fixture's sweep, or a test)."""
    global _DEPTH
    if _DEPTH == 0:
        gc.freeze()
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            gc.unfreeze()


@pytest.fixture(autouse=True)
def frozen_heap():
    with frozen():
        yield
