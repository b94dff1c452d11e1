"""The DCNv2 cross layer with its forward's second GEMM and epilogue in one warp-specialized Gluon kernel
(`kernels.cross_ws`), as a ``torch.library`` custom op with a PyTorch backward (``kernels.interaction: "gluon"``
runs it through `dlrm.model.archs.GluonLowRankCrossNet`).

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the cross network's width, ``K`` its rank.

One layer of TorchRec's ``LowRankCrossNet`` is ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``. Here
``u = x_l V_l^T`` stays a cuBLAS ``F.linear``; ``dlrm_kernels::cross_layer_ws(x0, x, u, w, b)`` returns
``(out, pre)`` with ``pre = u w^T + b`` and ``out = x0 * pre + x``. It runs the Gluon kernel on a Hopper GPU
with operands that `kernels.cross_ws.supported` accepts (``x0``, ``x``, ``u``, ``w`` in one 16-bit dtype, rows
TMA can read): at MLPerf DLRM-DCNv2's shapes on an H100 0.71 ms a layer against 0.93 for cuBLAS + Inductor's
pass, 0.61 against 0.79 for the first layer, where ``x`` is ``x0`` (benchmarks/results/cross_ws_probe.md; the
MLPerf step +2.5-2.7%, results/mlperf_dcnv2_gluon.md). Anywhere else (the CPU, other GPUs, fp32, misaligned
rows) it runs the same arithmetic in PyTorch ops.

Backward, for ``g = d loss / d out`` (``pre`` is saved; it is not differentiable): ``g_pre = g * x0``,
``d x0 = g * pre``, ``d x = g``, ``d b = sum_rows(g_pre)`` (at least fp32), ``d u = g_pre w``,
``d w = g_pre^T u``: plain PyTorch ops, so under ``torch.compile`` Inductor fuses the elementwise parts across
layers and cuBLAS runs the GEMMs, as it does for the eager module.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._backend import device_context

__all__ = ["cross_layer_ws", "gluon_hopper_available"]


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.lru_cache(maxsize=None)
def _gluon_importable() -> bool:
    try:
        import kernels.cross_ws  # noqa: F401
    except ImportError:
        return False
    return True


def gluon_hopper_available(device: torch.device) -> bool:
    """Whether the Gluon cross kernel can run on ``device``: a Hopper GPU and a Triton with Gluon's Hopper dialect."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available() and _hopper(device.index or 0)
            and _gluon_importable())


def _reference(x0: Tensor, x: Tensor, u: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The eager module's arithmetic: the GEMM in the operands' dtype, the bias cast to it; ``x0 * pre + x`` in
    the promoted dtype (fp32 when ``x0`` or ``x`` is fp32 under bf16 autocast, as in the eager module)."""
    pre = F.linear(u, w) + b.to(u.dtype)
    return (x0 * pre + x).contiguous(), pre.contiguous()


def _use_kernel(x0: Tensor, x: Tensor, u: Tensor, w: Tensor) -> bool:
    if not (x0.is_cuda and _gluon_importable() and _hopper(x0.device.index or 0)):
        return False
    from kernels.cross_ws import supported

    return supported(x0, x, u, w)


@torch.library.custom_op("dlrm_kernels::cross_layer_ws", mutates_args=())
def _cross_layer_ws_op(x0: Tensor, x: Tensor, u: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if _use_kernel(x0, x, u, w):
        from kernels.cross_ws import cross_forward_ws

        with device_context(x0):
            return cross_forward_ws(x0, x, u, w, b, store_pre=True)
    return _reference(x0, x, u, w, b)


@_cross_layer_ws_op.register_fake
def _(x0, x, u, w, b):
    M, N = x0.shape
    out_dtype = torch.promote_types(torch.promote_types(x0.dtype, x.dtype), u.dtype)
    return x0.new_empty((M, N), dtype=out_dtype), x0.new_empty((M, N), dtype=u.dtype)


def _setup_context(ctx, inputs, output):
    x0, x, u, w, b = inputs
    _, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.save_for_backward(x0, u, w, pre)
    ctx.dtypes = (x0.dtype, x.dtype, b.dtype)


def _backward(ctx, g, _g_pre):
    x0, u, w, pre = ctx.saved_tensors
    x0_dtype, x_dtype, b_dtype = ctx.dtypes
    g_pre = (g * x0).to(u.dtype)  # where the eager graph's promotion casts it back, when x0 or x is wider
    # 16-bit gradients summed in fp32 (as Inductor does for the eager module), others in their own precision
    grad_b = g_pre.sum(0, dtype=torch.promote_types(g_pre.dtype, torch.float32)).to(b_dtype)
    return (g * pre).to(x0_dtype), g.to(x_dtype), g_pre @ w, g_pre.t() @ u, grad_b


_cross_layer_ws_op.register_autograd(_backward, setup_context=_setup_context)


def cross_layer_ws(x0: Tensor, x: Tensor, u: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``x0 * (u @ w^T + b) + x`` [M, N] for ``x0``, ``x`` [M, N], ``u`` [M, K], ``w`` [N, K], ``b`` [N]
    (see the module docstring for where it runs and the backward)."""
    return torch.ops.dlrm_kernels.cross_layer_ws(x0, x, u, w, b)[0]
