"""torch 2.11 on the CPU: what 2.13 runs that 2.11 did not.

1. The Triton interpreter of torch 2.11 (Triton 3.6) with NumPy >= 2.4: a kernel's scalar as a loop bound.

Triton 3.6's interpreter converts a scalar tensor (a 1-element numpy array) to an int with ``int(array)``, which NumPy
2.4 refuses, so ``range(0, hot, UNROLL)`` of the pooled lookup (``hot`` loaded in the kernel) failed at every launch
under torch 2.11 on the CPU ("only 0-dimensional arrays can be converted to Python scalars": the multi-hot model, the
sharded multi-hot embedding, every pooled-lookup kernel test). Triton 3.9 squeezes the array first;
`kernels._interpreter.fix_scalar_index` does the same where the installed conversion fails.

Each case runs in a fresh process that puts Triton 3.6's conversion under NumPy 2.4's rule (any array that is not
0-d refused, whatever NumPy is installed) in place before ``kernels`` is imported, so it fails without the fix on any
Triton and NumPy; under torch 2.11 the real conversion is exercised by tests/kernels/test_pooled_embedding.py.

2. torch 2.11's CPU ``torch._scaled_mm`` takes one scale a tensor only: the rowwise FP8 layer
(`kernels.fp8_linear.fp8_rowwise_linear`, its doctest and tests) stopped at an internal assert ("Now _scaled_mm only
supports per-tensor scaling for CPU backend"). Emulated here on any torch by a ``_scaled_mm`` that refuses rowwise
scales on the CPU as 2.11's does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kernels import fp8_linear
from tests.conftest import CHILD_ENV

SCRIPT = r'''
import json
import triton.language as tl
import triton.runtime.interpreter as interpreter

real_patch_tensor = interpreter._patch_lang_tensor


def _strict_int(a):  # NumPy >= 2.4: only a 0-d array converts to a Python int
    if a.ndim != 0:
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
    return int(a)


def triton36_patch_tensor(tensor, scope):  # Triton 3.6's __index__: int(self.handle.data), no squeeze
    real_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: _strict_int(self.handle.data))


interpreter._patch_lang_tensor = triton36_patch_tensor
index_before = getattr(tl.tensor, "__index__", None)

import torch
import kernels  # noqa: F401  (installs the interpreter's fixes)
from kernels.embedding.pooled import pooled_embedding_lookup, pooled_layout

hotness = [2, 3, 1, 4]  # loop bounds of 1, 2 and 3 steps of the kernel's slot loop (UNROLL 1, 2 or 4)
L, F, D = sum(hotness), len(hotness), 5
card = torch.tensor([5, 7, 3, 11])
off = torch.cumsum(card, 0) - card
R = int(card.sum())
g = torch.Generator().manual_seed(0)
raw = torch.randint(-1, 60, (L, 13), generator=g).t()  # [13, L], non-contiguous
base = torch.randn(D, R, generator=g)
results = []
for _ in range(2):  # two grids each way: the second starts from the first's restore
    weight = base.t().detach().requires_grad_()  # [R, D] with strides (1, R)
    out = pooled_embedding_lookup(raw, weight, card, off, pooled_layout(hotness))
    grad_out = torch.randn(out.shape, generator=g)
    (out * grad_out).sum().backward()
    results.append({"out": out.detach().double().tolist(), "grad": weight.grad.double().tolist(),
                    "grad_out": grad_out.double().tolist()})
print(json.dumps({"results": results, "restored": getattr(tl.tensor, "__index__", None) is index_before,
                  "raw": raw.tolist(), "base": base.double().tolist(), "hotness": hotness,
                  "card": card.tolist(), "off": off.tolist()}))
'''


def _reference(case: dict, grad_out: torch.Tensor):
    """float64 pooled sums and the dense table gradient, one slot at a time."""
    raw = torch.tensor(case["raw"], dtype=torch.int64)
    weight = torch.tensor(case["base"], dtype=torch.float64).t()
    B, D = raw.shape[0], weight.shape[1]
    out = torch.zeros(B, len(case["hotness"]), D, dtype=torch.float64)
    grad = torch.zeros_like(weight)
    s = 0
    for f, hot in enumerate(case["hotness"]):
        for _ in range(hot):
            for b in range(B):
                row = case["off"][f] + (int(raw[b, s]) + 1) % case["card"][f]
                out[b, f] += weight[row]
                grad[row] += grad_out[b, f]
            s += 1
    return out, grad


@pytest.mark.parametrize("patch_once", ["1", "0"])
def test_pooled_lookup_runs_under_triton36_scalar_conversion(tmp_path, patch_once):
    script = tmp_path / "triton36_index.py"
    script.write_text(SCRIPT)
    env = {**CHILD_ENV, "TRITON_INTERPRET": "1", "DLRM_INTERPRETER_PATCH_ONCE": patch_once}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    case = json.loads(result.stdout.strip().splitlines()[-1])
    # the grids' restore puts tl.tensor back as it was (the fix is scoped like Triton's own patch)
    assert case["restored"]
    for run in case["results"]:
        grad_out = torch.tensor(run["grad_out"], dtype=torch.float64)
        out64, grad64 = _reference(case, grad_out)
        torch.testing.assert_close(torch.tensor(run["out"], dtype=torch.float64), out64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(run["grad"], dtype=torch.float64), grad64, rtol=1e-5, atol=1e-5)


def _torch211_cpu_scaled_mm(real):
    def scaled_mm(a, b, *, scale_a, scale_b, **kwargs):
        if a.device.type == "cpu" and (scale_a.numel() != 1 or scale_b.numel() != 1):
            raise RuntimeError("(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED: Now _scaled_mm "
                               "only supports per-tensor scaling for CPU backend.")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)
    return scaled_mm


def test_rowwise_fp8_linear_on_a_cpu_scaled_mm_without_rowwise_scales(monkeypatch):
    """y and dx of the rowwise layer against the float64 product of the dequantized operands (bf16 output rounding,
    as tests/kernels/test_fp8_linear.py), dW the bf16 GEMM, with a column-major input and gradient; per-tensor
    `Fp8Linear` still goes through ``_scaled_mm`` itself."""
    monkeypatch.setattr(torch, "_scaled_mm", _torch211_cpu_scaled_mm(torch._scaled_mm))
    monkeypatch.setattr(fp8_linear, "_cpu_rowwise", None)  # probe the emulated op, not the installed one
    torch.manual_seed(7)
    weight = (torch.randn(48, 80) * 80**-0.5).requires_grad_()
    bias = torch.randn(48).requires_grad_()
    x = torch.randn(80, 32).t().detach().requires_grad_()  # [32, 80], column-major
    g = torch.randn(48, 32).t()  # [32, 48], column-major
    y = fp8_linear.fp8_rowwise_linear(x, weight, bias)
    y.backward(g)
    assert fp8_linear._cpu_rowwise is False
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32

    def dq(t):
        q, inv = fp8_linear.quantize_rows(t)
        return q.double() * inv.double()

    def close(actual, expected):
        atol = 2**-7 * float(expected.abs().max())
        torch.testing.assert_close(actual.double(), expected, rtol=2**-7, atol=atol)

    w = weight.detach()
    gb = g.to(torch.bfloat16)
    close(y, dq(x.detach()) @ dq(w).T + bias.detach().double())
    close(x.grad, dq(gb) @ dq(w.t()).T)
    close(weight.grad, gb.double().T @ x.detach().to(torch.bfloat16).double())
    torch.testing.assert_close(bias.grad.double(), gb.double().sum(0), rtol=1e-5, atol=1e-5)

    layer = fp8_linear.Fp8Linear(32, 16)  # tensorwise scales: 2.11's CPU op takes them
    layer(torch.randn(16, 32)).float().sum().backward()
    assert layer.weight.grad is not None and bool(torch.isfinite(layer.weight.grad).all())
