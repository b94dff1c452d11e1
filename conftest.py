"""Root pytest setup, imported before any test or doctest module.

`--doctest-modules` (pyproject.toml) imports every module of dlrm/ and kernels/ to collect its
docstring examples. Without CUDA the Triton kernels must run under Triton's interpreter, switched
on by TRITON_INTERPRET=1, which triton reads when first imported: this file is loaded before
collection imports anything, so the variable is set in time (setdefault: an explicit
TRITON_INTERPRET=0 still wins). tests/conftest.py does the same for runs started below it, and
holds the one hook that skips tests marked `gpu` without CUDA (it also sees the doctest items,
none of which is marked).
"""

import os
import sys

# Bytecode cached for the test session even where PYTHONDONTWRITEBYTECODE is set (as in CI's image): without it each
# pytest worker re-did the assertion rewriting of all ~560 test modules at collection (31 s of CPU a worker against
# 13 s with it cached, 2026-12-05), and each of the ~520 processes the tests start recompiled the dlrm/ and kernels/
# modules it imported (~0.3 s of CPU for all of them). Written beside the sources, in the __pycache__ folders git
# ignores, where the installed packages' are read from: a PYTHONPYCACHEPREFIX folder instead is the only place
# Python then looks, and torch's import compiled there took 10 s of CPU against 3.4 s. Python and pytest check each
# file against its source's mtime and size. Cleared in the environment here, before xdist starts its workers and
# tests/conftest.py the prewarmed interpreter, so that they and every process they start write the cache too.
if sys.dont_write_bytecode:
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/data holds data and the scripts that regenerate it, not tests: --doctest-modules would
# otherwise import those scripts (which put their folder on sys.path) just to find no examples. tests/prewarm is the
# prewarmed interpreter's server, its child and client (tests/prewarm/launch.py): programs, no examples either.
collect_ignore = ["tests/data", "tests/prewarm"]
