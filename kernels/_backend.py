"""Where Triton kernels can run: CUDA devices, or the CPU under ``TRITON_INTERPRET=1``.

The interpreter must be switched on before triton is first imported, so this module reads the
environment variable but never sets it.
"""

from __future__ import annotations

import contextlib
import os

import torch


class TritonUnavailableError(RuntimeError):
    """Raised when a Triton kernel is requested where it cannot run (never a silent fallback)."""


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set (Triton kernels then run on the CPU, fp32 only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_triton_device(device: torch.device | str, what: str = "triton kernels") -> None:
    """Raise `TritonUnavailableError` with a one-line reason unless Triton can run on `device`."""
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
                "(use --kernels torch, or run on a CUDA device)"
            )
        return
    raise TritonUnavailableError(f"{what} cannot run on device type {device.type!r}")


def device_context(t: torch.Tensor):
    """Launch on `t`'s GPU (Triton launches on the *current* CUDA device); a no-op on the CPU."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
