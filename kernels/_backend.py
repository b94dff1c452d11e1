"""Where Triton kernels can run: CUDA devices, or the CPU under ``TRITON_INTERPRET=1``.

The interpreter must be switched on before triton is first imported, so this module reads the
environment variable but never sets it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch


class TritonUnavailableError(RuntimeError):
    """Raised when a Triton kernel is requested where it cannot run (never a silent fallback)."""


# How Triton reads a boolean variable (`triton.knobs.env_bool`): these words, in any case, and nothing else.
_TRITON_TRUE = ("1", "true", "yes", "on", "y")


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET`` switches Triton's interpreter on (Triton kernels then run on the CPU; bf16 as a
    GPU computes it only with `kernels._interpreter.install_bf16_dot`, which ``import kernels`` installs): ``1``, or ``true`` / ``yes`` / ``on`` / ``y`` in any case, as Triton itself reads the variable (only
    ``1`` counted before, so ``TRITON_INTERPRET=true`` ran the interpreter with launches picked for a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRITON_TRUE


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_triton_device(device: torch.device | str, what: str = "triton kernels",
                        instead: str = "use --kernels torch") -> None:
    """Raise `TritonUnavailableError` with a one-line reason unless Triton can run on `device`; `instead` is the
    way round it that the CPU's refusal advises (a caller where `--kernels` cannot be given names its own)."""
    device = torch.device(device)
    if not triton_importable():
        raise TritonUnavailableError(f"{what} need the 'triton' package, which is not installed")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TritonUnavailableError(f"{what} were requested on {device} but CUDA is not available")
        return
    if device.type == "cpu":
        if not interpret_mode():
            raise TritonUnavailableError(
                f"{what} cannot run on the CPU unless TRITON_INTERPRET=1 is set before triton is imported "
                f"({instead}, or run on a CUDA device)"
            )
        return
    raise TritonUnavailableError(f"{what} cannot run on device type {device.type!r}")


# Operand dtypes of the GEMM kernels whose ``tl.dot`` accumulates in an fp32 accumulator (`kernels.linear`,
# `kernels.cross`, `kernels.wgrad`). Triton types the product of float64 operands float64 while that accumulator
# stays fp32, so float64 gave garbage with no error (the interpreter stored fp32 bit patterns into the float64
# output: ``ones(3, 4) @ ones(2, 4).T`` read 5e-315); such operands are refused by `check_gemm_dtype`.
GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_gemm_dtype(dtype: torch.dtype, what: str, instead: str = "the PyTorch modules") -> None:
    """One-line ValueError unless ``dtype`` is one of `GEMM_DTYPES` (use the PyTorch layers for float64). Also
    used by the kernels that accumulate in fp32 without a ``tl.dot``: they would compute float64 inputs in fp32
    and return them as float64, looking exact; ``instead`` names what runs other dtypes."""
    if dtype not in GEMM_DTYPES:
        raise ValueError(f"{what} take float32, bfloat16 or float16 operands, got {dtype} ({instead} "
                         "run other dtypes)")


def check_same_device(what: str, **tensors: Optional[torch.Tensor]) -> None:
    """One-line ValueError unless the given tensors (None skipped) lie on one device: a kernel launches on its
    first operand's device and reads every pointer there, so a tensor of another device (a CPU index tensor with
    CUDA ids, another GPU's buffer) was read as bad memory or failed inside Triton with no word of which tensor.

    >>> import torch
    >>> check_same_device("f", a=torch.empty(1), b=None, c=torch.empty(1, device="meta"))
    Traceback (most recent call last):
    ...
    ValueError: f: a, c must share one device, got a on cpu, c on meta
    """
    given = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in given.items())
        raise ValueError(f"{what}: {', '.join(given)} must share one device, got {where}")


def device_context(t: torch.Tensor):
    """Launch on `t`'s GPU (Triton launches on the *current* CUDA device); a no-op on the CPU."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


# Element offsets from here on do not fit the int32 arithmetic of a kernel's indices and strides. In a kernel
# ``rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)`` is int32 and strides below 2^31 are specialized as int32, so
# ``rm[:, None] * stride`` wraps once an operand has an element offset of 2^31 or more (MLPerf DLRM-DCNv2's cross net,
# N = 3456, at ~621k rows; a 1024-wide layer at ~2.1M rows): another row is read or written, silently. The dense
# kernels' launchers (`kernels.cross`, `kernels.linear`, `kernels.epilogue`, `kernels.mlp`, `kernels.wgrad`,
# `kernels.loss`, `kernels.col_sum`) set their ``INT64_OFFSETS`` flag by `needs_int64_offsets`: with it the kernels cast
# their row (and column) indices to int64 before multiplying; without it they compile to exactly the 32-bit code they
# always ran, which every shape below that size keeps.
INT32_OFFSET_LIMIT = 2**31


def max_element_offset(t: Optional[torch.Tensor]) -> int:
    """The largest element offset from ``t``'s data pointer, ``sum_d (size_d - 1) * stride_d`` (0 for an empty tensor
    or None): what a kernel's index arithmetic reaches on ``t``.

    >>> import torch
    >>> max_element_offset(torch.empty(3, 5)), max_element_offset(torch.empty(3, 5).t()), max_element_offset(None)
    (14, 14, 0)
    """
    if t is None or t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def needs_int64_offsets(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether one of ``tensors`` (None skipped) has an element offset of 2^31 or more: then a kernel's 32-bit
    ``index * stride`` products would wrap, and its launcher sets ``INT64_OFFSETS``.

    >>> import torch
    >>> [needs_int64_offsets(torch.empty(m, 2**15, device="meta"), None) for m in (2**16, 2**16 + 1)]
    [False, True]
    """
    return any(max_element_offset(t) >= INT32_OFFSET_LIMIT for t in tensors)
