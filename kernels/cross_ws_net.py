"""The whole DCNv2 cross network as one autograd function: the forward's layers through
``dlrm_kernels::cross_layer_ws`` (`kernels.cross_ws_op`), the backward as one of two implementations (`BACKWARD`).

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the width, ``K`` the rank, ``L`` layers.

Why one function: the per-layer ops hand each other only ``x_l``'s gradient, so the backward's elementwise work
(``g_pre = G_{l+1} * x0``, the bias sums, ``x0``'s gradient) is whatever Inductor makes of autograd's graph. As one
function the backward can be written for the step's memory traffic:

* "passes" (the default), ``dlrm_kernels::cross_net_backward``: one op of cuBLAS GEMMs and
  `kernels.cross_bwd_passes`' elementwise passes, which sum the bias gradients while they write ``g_pre`` and leave
  the last data-gradient GEMM to add itself into ``dx0`` in place (``addmm_``, no copy of the addend);
* "fused_gemm": the data-gradient GEMMs through ``dlrm_kernels::cross_backward_ws`` (`kernels.cross_ws_bwd`), whose
  epilogue does the next layer's elementwise work. For ``G = d loss / d x_L``: ``g_pre = G * x0``,
  ``dx0 = G * pre_{L-1}``, then for ``l = L-1 .. 0``: ``db_l = sum_rows(g_pre)`` (fp32), ``du = g_pre W_l``,
  ``dW_l = g_pre^T u_l``, ``dV_l = du^T x_l``, and the fused GEMM (``l > 0``: ``G, g_pre, dx0 <- dx_l, dx_l * x0,
  dx0 + dx_l * pre_{l-1}``; ``l = 0``: ``dx0 <- dx0 + G + du V_0``); the rest in PyTorch ops that Inductor compiles.

The ops run the Gluon / Triton kernels on a Hopper GPU with 16-bit operands that TMA can read
(`kernels.cross_ws.supported`'s rules), and the same arithmetic in PyTorch ops elsewhere (the CPU tests, other GPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._backend import device_context
from kernels.cross_bwd_passes import MAX_TERMS, cross_backward_pass, cross_backward_pass_reference
from kernels.cross_ws_op import _gluon_importable, _hopper

__all__ = ["BACKWARDS", "BACKWARD", "cross_net_ws"]

# How `dlrm.model.archs.GluonLowRankCrossNet` runs the cross network's backward on a Hopper GPU in 16 bits;
# module-level so that a benchmark can compare them:
# - "layers": per-layer ops, autograd and Inductor (the network is not this function);
# - "fused_gemm": this function, with the Gluon data-gradient GEMMs carrying the next layer's elementwise work. In the
#   MLPerf DLRM-DCNv2 step on an H100 0.6-0.7 ms slower than "layers" (21.94-22.00 against 21.25-21.39 ms,
#   alternating; benchmarks/results/mlperf_dcnv2_fusedbwd.md): its three kernels took 3.79 ms where the cuBLAS
#   GEMMs, Inductor's passes and copies they replace took ~3.0 (step_profile_mlperf_b65536_fusedbwd.md), since
#   Inductor fuses the cross-layer elementwise work better than the one-layer comparison in
#   benchmarks/results/cross_ws_probe_backward.md assumed, and the kernel's epilogue streams at ~2.2 TB/s;
# - "passes" (the default): this function, with ``dlrm_kernels::cross_net_backward`` (cuBLAS GEMMs and
#   `kernels.cross_bwd_passes`). In the MLPerf DLRM-DCNv2 step on an H100 0.5 ms faster than "layers" (20.87-20.91
#   against 21.38-21.44 ms, alternating in one process; benchmarks/results/mlperf_dcnv2_passes.md): the bias sums no
#   longer re-read g_pre (0.48 ms), aten's copy before the last addmm is gone (0.3 ms), and the passes stream at
#   2.8-2.9 TB/s.
BACKWARDS = ("layers", "fused_gemm", "passes")
BACKWARD = "passes"


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


def _passes_ok(grad: Tensor, x0: Tensor, layers: int) -> bool:
    return grad.is_cuda and x0.dtype in (torch.bfloat16, torch.float16) and layers - 1 <= MAX_TERMS


@torch.library.custom_op("dlrm_kernels::cross_net_backward", mutates_args=())
def _cross_net_backward_op(grad: Tensor, x0: Tensor, xs: list[Tensor], us: list[Tensor], pres: list[Tensor],
                           vs: list[Tensor], ws: list[Tensor],
                           b_dtype: torch.dtype) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """``(dx0, dV_l, dW_l, db_l)`` of the cross network for ``grad = d loss / d x_L``, from what the forward saved:
    ``xs`` the layers' inputs (``xs[0]`` is ``x0``), ``us`` their ``x_l V_l^T``, ``pres`` their ``u W^T + b``.

    From the top layer down: `kernels.cross_bwd_passes.cross_backward_pass` (``g_pre``, ``db``; at the first layer
    also ``dx0`` without ``T_0``), then cuBLAS's ``du = g_pre W``, ``dW = g_pre^T u``, ``dV = du^T x_l`` and
    ``T_l = du V_l``, kept for the passes below; at the first layer ``dx0 += du V_0`` in place."""
    L = len(vs)
    kernel = _passes_ok(grad, x0, L)
    run_pass = cross_backward_pass if kernel else cross_backward_pass_reference
    g = grad.to(x0.dtype)
    ts: list[Tensor] = []
    dvs, dws, dbs = [x0] * L, [x0] * L, [x0] * L  # placeholders, each set below
    dx0 = x0
    with device_context(x0):
        for layer in reversed(range(L)):
            first = layer == 0
            gpre, dbs[layer], part = run_pass(g, ts, x0, list(reversed(pres)) if first else None, b_dtype)
            du = gpre @ ws[layer]
            dws[layer] = gpre.t() @ us[layer]
            dvs[layer] = du.t() @ xs[layer]
            if first:
                dx0 = part.addmm_(du, vs[layer])  # in place: no copy of the addend, unlike an out-of-place addmm
            else:
                ts.append(du @ vs[layer])
    # contiguous, as the fake says: the PyTorch pass's dx0 follows the incoming gradient's layout (a transposed one
    # under torch.compile would break the fake's strides); free for the kernels' contiguous dx0
    return dx0.contiguous(), dvs, dws, dbs


@_cross_net_backward_op.register_fake
def _(grad, x0, xs, us, pres, vs, ws, b_dtype):
    # every output contiguous (the GEMMs' results and dx0 above), whatever the layout of x0 and the weights
    return (x0.new_empty(x0.shape), [v.new_empty(v.shape) for v in vs], [w.new_empty(w.shape) for w in ws],
            [x0.new_empty((x0.shape[1],), dtype=b_dtype) for _ in vs])


class _CrossNetFunction(torch.autograd.Function):
    """``x_L`` of the cross network from ``x0`` and the layers' ``V``, ``W`` (in ``x0``'s dtype) and ``b``; the backward
    named by ``backward_impl`` ("passes" or "fused_gemm")."""

    @staticmethod
    def forward(ctx, x0: Tensor, backward_impl: str, *params: Tensor) -> Tensor:
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
        if len(set(ctx.b_dtypes)) > 1:
            raise ValueError(f"cross_net_ws: the biases must share a dtype, got {ctx.b_dtypes}")
        ctx.backward_impl = backward_impl
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        L = ctx.num_layers
        saved = ctx.saved_tensors
        x0 = saved[0]
        xs, us, pres, vs, ws = [saved[1 + i * L:1 + (i + 1) * L] for i in range(5)]
        if ctx.backward_impl == "passes":
            dx0, dvs, dws, dbs = torch.ops.dlrm_kernels.cross_net_backward(
                grad, x0, list(xs), list(us), list(pres), list(vs), list(ws), ctx.b_dtypes[0])
            return (dx0, None, *dvs, *dws, *dbs)
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
        return (dx0, None, *dvs, *dws, *dbs)


def cross_net_ws(x0: Tensor, vs: list[Tensor], ws: list[Tensor], bs: list[Tensor], backward: str = "passes") -> Tensor:
    """The cross network's output ``x_L`` [M, N] from ``x0`` [M, N], ``V_l`` [K, N], ``W_l`` [N, K] (both in
    ``x0``'s dtype) and ``b_l`` [N], with the backward named by ``backward`` ("passes" or "fused_gemm", see
    `BACKWARD`)."""
    if backward not in ("fused_gemm", "passes"):
        raise ValueError(f"cross_net_ws: backward must be 'fused_gemm' or 'passes', got {backward!r}")
    return _CrossNetFunction.apply(x0, backward, *vs, *ws, *bs)
