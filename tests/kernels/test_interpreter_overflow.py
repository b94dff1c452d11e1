"""`kernels._interpreter.skip_dead_overflow_checks`: under TRITON_INTERPRET the interpreter's int32 overflow check
computed a comparison that its ``device_assert`` (``debug`` off, always, in the interpreter) threw away. With the check
off, a kernel computes the same values and raises the same nothing, also on an int32 overflow; and the option is left
as it is where ``debug`` is on or ``DLRM_INTERPRETER_PATCH_ONCE=0``. Run in fresh processes under the interpreter (on
the GPU machine too, where the test session leaves it off)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = r'''
import dataclasses, os, sys
import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

import kernels
from kernels import _interpreter


@triton.jit
def _mul_add(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * 65536 + x - 7, mask=mask)  # int32: overflows for |x| >= 32768


x = torch.tensor([3, -5, 40000, -70000, 2**31 - 1], dtype=torch.int32)
want = torch.from_numpy(((x.numpy().astype(np.int64) * 65537 - 7 + 2**31) % 2**32 - 2**31).astype(np.int32))
options = interpreter.interpreter_builder.options
if os.environ.get("DLRM_INTERPRETER_PATCH_ONCE") == "0":
    assert options.sanitize_overflow and not _interpreter.skip_dead_overflow_checks()
    print("left on")
    sys.exit()
assert not options.sanitize_overflow and not options.debug
outs = []
for sanitize in (False, True):
    interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=sanitize)
    out = torch.empty_like(x)
    _mul_add[(1,)](x, out, x.numel(), BLOCK=8)
    outs.append(out)
assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], want), (outs, want)
# with debug on, the check would fire: left on
interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=True, debug=True)
assert not _interpreter.skip_dead_overflow_checks() and interpreter.interpreter_builder.options.sanitize_overflow
print("same values")
'''


def _run(**env) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_a_kernel_computes_the_same_without_the_thrown_away_overflow_check():
    assert _run() == "same values"


def test_the_check_is_left_on_when_the_interpreter_patches_are_off():
    assert _run(DLRM_INTERPRETER_PATCH_ONCE="0") == "left on"
