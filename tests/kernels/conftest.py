"""Shared fixtures for the Triton kernel tests.

Without CUDA the kernels run under Triton's interpreter, which must be switched on before anything
imports triton: pytest imports this file before the test modules of this folder (tests/conftest.py may
do the same; setdefault keeps whichever came first, and an explicit TRITON_INTERPRET=0 wins).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# (atol, rtol) per dtype for comparisons against a float64 reference computed from the same input
# values. fp32: a few ulps on sums of tens to hundreds of terms. bf16 (mostly GPU tests; the interpreter
# computes bf16 as a GPU does since `kernels._interpreter.install_bf16_dot`): outputs are rounded to bf16
# (8 bits of mantissa, rel. step 2**-8 ~ 4e-3) after fp32 accumulation, plus the bf16 rounding of
# intermediate results fed to the next step.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for results computed in `dtype`."""
    return TOLERANCES[dtype]


@pytest.fixture
def device() -> torch.device:
    """cuda when available, else cpu (Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def tol():
    """``tol(dtype) -> (atol, rtol)`` (see TOLERANCES)."""
    return tolerance


@pytest.fixture
def assert_close():
    """``assert_close(actual, expected, dtype, scale=1.0, msg="")``: compare in float64 with the
    tolerances of `dtype`; `scale` multiplies atol (for results whose magnitude is far from 1)."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0, msg: str = ""):
        atol, rtol = tolerance(dtype)
        torch.testing.assert_close(
            actual.detach().double().cpu(),
            expected.detach().double().cpu(),
            atol=atol * scale,
            rtol=rtol,
            msg=(lambda m: f"{msg}: {m}") if msg else None,
        )

    return check
