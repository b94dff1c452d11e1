"""OpenMP's threads wait passively unless the user says otherwise (`dlrm/__init__.py`): libgomp's spinning threads
took the cores a loaded machine's training thread needed (the sample's CPU run 48-163 s against 22-27 s beside the
test suite on 2 cores). The variable must be set before torch loads libgomp, which reads it once."""

import ast
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PROBE = "import sys, os, dlrm; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"


def _probe(**env):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("env, policy", [
    ({}, "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),        # the user's own choice kept
    ({"GOMP_SPINCOUNT": "100000"}, "None"),           # a tuned spin count: the policy left to libgomp
])
def test_passive_unless_the_user_chose(env, policy):
    assert _probe(**env) == [policy, "False"]  # set by `import dlrm`, which loads no torch: before libgomp reads it


def test_train_py_imports_dlrm_before_anything_that_loads_torch():
    tree = ast.parse((REPO / "train.py").read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    first = imports[0]
    names = [first.module] if isinstance(first, ast.ImportFrom) else [a.name for a in first.names]
    assert all(n == "dlrm" or n.startswith("dlrm.") for n in names), names
