"""The whole DCNv2 cross network as one autograd function: the forward's layers through
``dlrm_kernels::cross_layer_ws`` (`kernels.cross_ws_op`), the backward's data-gradient GEMMs through
``dlrm_kernels::cross_backward_ws`` (`kernels.cross_ws_bwd`), whose epilogue does the next layer's elementwise work.

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the width, ``K`` the rank, ``L`` layers.

Why one function: layer ``l``'s backward GEMM ``dx_l = g + du_l V_l`` hands layer ``l - 1`` its ``g_pre = dx_l * x0``
and adds ``dx_l * pre_{l-1}`` to ``x0``'s gradient in the same kernel; autograd's per-layer ops pass each other only
``x_l``'s gradient. Backward, for ``G = d loss / d x_L``: ``g_pre = G * x0``, ``dx0 = G * pre_{L-1}``, then for
``l = L-1 .. 0``: ``db_l = sum_rows(g_pre)`` (fp32), ``du = g_pre W_l``, ``dW_l = g_pre^T u_l``, ``dV_l = du^T x_l``,
and the fused GEMM (``l > 0``: ``G, g_pre, dx0 <- dx_l, dx_l * x0, dx0 + dx_l * pre_{l-1}``; ``l = 0``:
``dx0 <- dx0 + G + du V_0``). The GEMMs, sums and products outside the fused kernel are PyTorch ops, which Inductor
compiles with the rest of the step.

Not the default (`FUSED_BACKWARD`, below: measured slower in the step). The ops run the Gluon kernels on a Hopper
GPU with 16-bit operands that TMA can read (`kernels.cross_ws.supported`'s rules), and the same arithmetic in
PyTorch ops elsewhere (the CPU tests, other GPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._backend import device_context
from kernels.cross_ws_op import _gluon_importable, _hopper

__all__ = ["cross_net_ws", "FUSED_BACKWARD"]

# Whether `dlrm.model.archs.GluonLowRankCrossNet` runs its layers as this one function (the fused backward) where it
# can; module-level so that a benchmark can compare it with the per-layer ops. Off: in the MLPerf DLRM-DCNv2 step on
# an H100 it was 0.6-0.7 ms slower than the per-layer ops (21.94-22.00 against 21.25-21.39 ms, alternating;
# benchmarks/results/mlperf_dcnv2_fusedbwd.md). Its three backward kernels took 3.79 ms where the cuBLAS GEMMs,
# Inductor's passes and copies they replace took ~3.0 (step_profile_mlperf_b65536_fusedbwd.md): Inductor already
# fuses the step's cross-layer elementwise work better than the one-layer comparison in
# benchmarks/results/cross_ws_probe_backward.md assumed, and the kernel's epilogue streams at ~2.2 TB/s.
FUSED_BACKWARD = False


def _kernel_ok(*ts: Tensor) -> bool:
    t0 = ts[0]
    if not (t0.is_cuda and _gluon_importable() and _hopper(t0.device.index or 0)):
        return False
    if t0.dtype not in (torch.bfloat16, torch.float16):
        return False
    return all(t.dtype == t0.dtype and t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 and t.shape[1] % 8 == 0 for t in ts)


@torch.library.custom_op("dlrm_kernels::cross_backward_ws", mutates_args=())
def _cross_backward_op(du: Tensor, v: Tensor, g: Tensor, x0: Tensor, pre: Tensor,
                       dx0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``dx = g + du @ v``; returns ``(dx, dx * x0, dx0 + dx * pre)``."""
    if _kernel_ok(du, v, g, x0, pre, dx0) and dx0.is_contiguous():
        from kernels.cross_ws_bwd import cross_backward_ws

        new_dx0 = torch.empty_like(dx0)
        with device_context(g):
            dx, gpre = cross_backward_ws(du, v, g, x0, pre, dx0, out_dx0=new_dx0)
        return dx, gpre, new_dx0
    dx = g + du @ v
    return dx, dx * x0, dx0 + dx * pre


@_cross_backward_op.register_fake
def _(du, v, g, x0, pre, dx0):
    return torch.empty_like(g), torch.empty_like(g), torch.empty_like(dx0)


@torch.library.custom_op("dlrm_kernels::cross_backward_ws_first", mutates_args=())
def _cross_backward_first_op(du: Tensor, v: Tensor, g: Tensor, dx0: Tensor) -> Tensor:
    """``dx0 + g + du @ v`` (the first layer, whose input is ``x0`` itself)."""
    if _kernel_ok(du, v, g, dx0) and dx0.is_contiguous():
        from kernels.cross_ws_bwd import cross_backward_ws

        new_dx0 = torch.empty_like(dx0)
        with device_context(g):
            cross_backward_ws(du, v, g, g, None, dx0, out_dx0=new_dx0)
        return new_dx0
    return dx0 + (g + du @ v)


@_cross_backward_first_op.register_fake
def _(du, v, g, dx0):
    return torch.empty_like(dx0)


class _CrossNetFunction(torch.autograd.Function):
    """``x_L`` of the cross network from ``x0`` and the layers' ``V``, ``W`` (in ``x0``'s dtype) and ``b``."""

    @staticmethod
    def forward(ctx, x0: Tensor, *params: Tensor) -> Tensor:
        L = len(params) // 3
        vs, ws, bs = params[:L], params[L:2 * L], params[2 * L:]
        x, xs, us, pres = x0, [], [], []
        for layer in range(L):
            u = F.linear(x, vs[layer])
            out, pre = torch.ops.dlrm_kernels.cross_layer_ws(x0, x, u, ws[layer], bs[layer])
            xs.append(x)
            us.append(u)
            pres.append(pre)
            x = out
        ctx.save_for_backward(x0, *xs, *us, *pres, *vs, *ws)
        ctx.num_layers = L
        ctx.b_dtypes = [b.dtype for b in bs]
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        L = ctx.num_layers
        saved = ctx.saved_tensors
        x0 = saved[0]
        xs, us, pres, vs, ws = [saved[1 + i * L:1 + (i + 1) * L] for i in range(5)]
        g = grad.to(x0.dtype)
        g_pre = g * x0
        dx0 = g * pres[L - 1]
        dvs, dws, dbs = [None] * L, [None] * L, [None] * L
        for layer in reversed(range(L)):
            dbs[layer] = g_pre.sum(0, dtype=torch.promote_types(g_pre.dtype, torch.float32)).to(ctx.b_dtypes[layer])
            du = g_pre @ ws[layer]
            dws[layer] = g_pre.t() @ us[layer]
            dvs[layer] = du.t() @ xs[layer]
            if layer > 0:
                g, g_pre, dx0 = torch.ops.dlrm_kernels.cross_backward_ws(du, vs[layer], g, x0, pres[layer - 1], dx0)
            else:
                dx0 = torch.ops.dlrm_kernels.cross_backward_ws_first(du, vs[layer], g, dx0)
        return (dx0, *dvs, *dws, *dbs)


def cross_net_ws(x0: Tensor, vs: list[Tensor], ws: list[Tensor], bs: list[Tensor]) -> Tensor:
    """The cross network's output ``x_L`` [M, N] from ``x0`` [M, N], ``V_l`` [K, N], ``W_l`` [N, K] (both in
    ``x0``'s dtype) and ``b_l`` [N], with the backward above."""
    return _CrossNetFunction.apply(x0, *vs, *ws, *bs)
