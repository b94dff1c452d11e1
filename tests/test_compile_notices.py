"""A compiled run prints none of the two notices torch gives every compiled DLRM step (`dlrm.train.step.quiet_compile_notices`).

Seen in the README's first command on an H200: Dynamo's "Profiler record function ... will be ignored" glued to the
training bar, and Inductor's advice to call torch.set_float32_matmul_precision, which `train.precision` overrides."""

import logging
import math
import subprocess
import sys
import warnings

from dlrm.train.step import quiet_compile_notices
from tests.conftest import REPO

SCRIPT = """
import torch
from torch.profiler import record_function
if {quiet}:
    from dlrm.train.step import quiet_compile_notices
    quiet_compile_notices()

def f(x):
    with record_function("DenseArch"):
        return x.sin() + 1

print(torch.compile(f, backend="eager")(torch.ones(3)).sum().item())
"""


def _compile_stderr(quiet: bool) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(quiet=quiet)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert abs(float(done.stdout.split()[-1]) - 3 * (math.sin(1.0) + 1)) < 1e-5  # the range's body ran, compiled
    return done.stderr


def test_dynamo_notice_of_the_model_ranges_is_dropped():
    assert "will be ignored" in _compile_stderr(quiet=False)  # what torch prints without it (the test sees it)
    assert "will be ignored" not in _compile_stderr(quiet=True)


def test_inductor_tf32_advice_is_dropped_and_other_warnings_kept():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_compile_notices()
        quiet_compile_notices()  # twice (every compiled step calls it): one filter on each logger
        warnings.warn("TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. "
                      "Consider setting `torch.set_float32_matmul_precision('high')` for better performance.")
        warnings.warn("another warning")
    assert [str(w.message) for w in seen] == ["another warning"]
    for name in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch"):
        assert len(logging.getLogger(name).filters) == 1
