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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/data holds data and the scripts that regenerate it, not tests: --doctest-modules would
# otherwise import those scripts (which put their folder on sys.path) just to find no examples. tests/prewarm is the
# prewarmed interpreter's server, its child and client (tests/prewarm/launch.py): programs, no examples either.
collect_ignore = ["tests/data", "tests/prewarm"]
