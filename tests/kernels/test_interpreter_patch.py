"""kernels/_interpreter.py: the Triton interpreter's language patching once a grid instead of once a helper call.

Each case runs in a fresh process with ``TRITON_INTERPRET=1`` (so it runs the same on the GPU machine, whose
tests leave the interpreter off): a kernel that calls helpers of its own module and Triton's own
(``tl.zeros`` lives in ``triton.language.standard``, whose globals hold ``triton.language.core``, not
``triton.language``) computes the same with and without the change, with far fewer module walks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import CHILD_ENV

SCRIPT = r'''
import json, sys
import numpy as np
import torch
import triton
import triton.language as tl
import kernels  # installs the change unless DLRM_INTERPRETER_PATCH_ONCE=0
from kernels import _interpreter
import triton.runtime.interpreter as interpreter

calls = {"walks": 0}
if _interpreter.installed():
    inner = _interpreter._original
    def counting(fn):
        calls["walks"] += 1
        return inner(fn)
    _interpreter._original = counting
else:
    inner = interpreter._patch_lang
    def counting(fn):
        calls["walks"] += 1
        return inner(fn)
    interpreter._patch_lang = counting


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _shifted_square(x, s):
    return _square(x) + s + tl.zeros(x.shape, dtype=tl.float32)


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    y = _shifted_square(x, 1.0) + tl.sum(_square(x), axis=0)
    tl.store(out_ptr + offs, y, mask=m)


torch.manual_seed(0)
x = torch.randn(37)
out = torch.empty_like(x)
for _ in range(2):  # two grids: the second starts from the first's restore
    _kernel[(triton.cdiv(37, 8),)](x, out, 37, BLOCK=8)
# which names of the language modules hold Triton builtins after the grids (the rest: interpreter stand-ins)
builtins_after = {f"{m.__name__}.{name}": tl.core.is_builtin(getattr(m, name)) for m in (tl, tl.core, tl.math)
                  for name in dir(m)}
print(json.dumps({"installed": _interpreter.installed(), "walks": calls["walks"], "out": out.tolist(),
                  "builtins_after": builtins_after}))
'''


def _run(tmp_path: Path, patch_once: str | None, interpret: str = "1") -> dict:
    script = tmp_path / "interp_case.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in CHILD_ENV.items() if k != "DLRM_INTERPRETER_PATCH_ONCE"}  # the caller's PYTHONPATH too
    env.update(TRITON_INTERPRET=interpret)
    if patch_once is not None:
        env["DLRM_INTERPRETER_PATCH_ONCE"] = patch_once
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_same_results_with_fewer_module_walks(tmp_path):
    once = _run(tmp_path, None)
    every = _run(tmp_path, "0")
    assert once["installed"] and not every["installed"]
    assert once["out"] == every["out"]  # bit for bit (floats through JSON repr)
    torch.manual_seed(0)
    sq = torch.randn(37).double() ** 2
    for k in range(5):  # blocks of 8, one a program: out = x^2 + 1 + the block's sum of x^2
        block = slice(8 * k, min(8 * k + 8, 37))
        expected = sq[block] + 1.0 + sq[block].sum()
        torch.testing.assert_close(torch.tensor(once["out"][block], dtype=torch.float64), expected, rtol=1e-6,
                                   atol=1e-6)
    # without the change: a walk a grid and one a helper call a program (5 programs, each calling _shifted_square,
    # _square twice, tl.zeros, tl.sum...: 52 for the two grids with Triton 3.9); with it: one a grid, and one
    # for the first helper of triton.language.standard (its globals see triton.language.core, which the
    # kernel's module does not): 4
    assert every["walks"] >= 2 * (1 + 5 * 3)
    assert once["walks"] <= 2 * 2
    # the language modules are left as the interpreter itself leaves them (its helper calls' patches outlive the
    # grid in both cases), and the kernel-level builtins are back
    assert once["builtins_after"] == every["builtins_after"]
    assert once["builtins_after"]["triton.language.load"] and once["builtins_after"]["triton.language.store"]


def test_not_installed_without_the_interpreter_or_when_switched_off(tmp_path):
    from kernels import _interpreter

    env_before = dict(os.environ)
    try:
        os.environ["DLRM_INTERPRETER_PATCH_ONCE"] = "0"
        assert _interpreter.installed() or not _interpreter.install()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert _run(tmp_path, "0")["installed"] is False
    # TRITON_INTERPRET=0 in a process with no GPU: the kernel cannot launch, so ask install() directly
    code = "import os; os.environ['TRITON_INTERPRET']='0'; from kernels import _interpreter; print(_interpreter.install())"
    env = {**CHILD_ENV, "TRITON_INTERPRET": "0"}
    env.pop("DLRM_INTERPRETER_PATCH_ONCE", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
