"""Compile Gluon kernels for sm_90 in a fresh Python process, for the CPU tests of kernels/cross_ws*.py.

Gluon has no interpreter, so without a GPU its kernels can only be compiled. That must not happen in the test worker:
once a worker has run Triton kernels under ``TRITON_INTERPRET=1`` (every other kernel test on the CPU), the
interpreter's patches of ``triton.language`` stay in place and Gluon's code generator trips over them (seen in CI,
not in a lone run of these files). The child process runs without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

HOPPER_SHARED_BYTES = 232448  # the most shared memory one H100 CTA may use


def summary(compiled) -> dict:
    """What the tests check of a compiled kernel."""
    ptx = compiled.asm["ptx"]
    return {"cubin_bytes": len(compiled.asm["cubin"]), "wgmma": "wgmma.mma_async" in ptx,
            "setmaxnreg": "setmaxnreg" in ptx, "shared": compiled.metadata.shared}


def in_clean_process(module: str, function: str) -> dict:
    """``module.function()`` (a dict of JSON values) run in a child process without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import importlib, json, sys; sys.path.insert(0, sys.argv[1]); "
            "m = importlib.import_module(sys.argv[2]); print('RESULT ' + json.dumps(getattr(m, sys.argv[3])()))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO), module, function], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def check(results: dict) -> None:
    """Every compiled kernel has wgmma, warp-specialized partitions and fits one H100 CTA's shared memory."""
    assert results
    for name, r in results.items():
        assert r["cubin_bytes"] > 0, name
        assert r["wgmma"], name
        assert r["setmaxnreg"], name  # the partitions were formed (warp specialization)
        assert 0 < r["shared"] <= HOPPER_SHARED_BYTES, (name, r["shared"])
