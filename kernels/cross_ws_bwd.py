"""The DCNv2 cross network's backward data-gradient GEMM with the next layer's elementwise work in its epilogue,
as a warp-specialized, persistent Hopper kernel in Triton's Gluon dialect (the "coop" schedule of
`kernels.cross_ws`, whose loader and MMA partitions it reuses).

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the cross network's width, ``K`` its rank.

Backward of layer ``l`` (``x_{l+1} = x0 * pre_l + x_l``, ``pre_l = u_l W_l^T + b_l``, ``u_l = x_l V_l^T``), for
``g = d loss / d x_{l+1}``: ``x_l``'s gradient is ``dx_l = g + du_l V_l`` (``du_l`` [M, K], ``V_l`` [K, N]), and
layer ``l - 1`` then needs ``g_pre = dx_l * x0`` and adds ``dx_l * pre_{l-1}`` to ``x0``'s gradient. cuBLAS +
Inductor write ``du_l V_l`` and read it back in an elementwise pass; here the GEMM's epilogue does that pass:

* ``cross_backward_ws(du, v, g, x0, pre, dx0)`` (a layer above the first): returns ``dx_l = g + du V`` and
  ``g_pre = dx_l * x0``, and accumulates ``dx0 += dx_l * pre`` in place;
* ``pre=None`` (the first layer, where ``x_0`` is ``x0`` itself): ``dx0 += g + du V`` in place, nothing returned.

All tensors [M, N] except ``du`` [M, K] and ``v`` [K, N]; one 16-bit dtype; the GEMM accumulates in fp32 and
hands its tile to the epilogue in the tensors' dtype (rounded once), the epilogue computes in fp32 and rounds each
output once more (``dx0`` too, at each layer: the accumulation is in the tensors' dtype).
Requirements as `kernels.cross_ws.supported` (``v`` row-major [K, N]).

Used through `kernels.cross_ws_net` (the cross network's backward as one autograd function), which is off by
default: faster than cuBLAS + an Inductor pass for one layer alone, slower in the MLPerf step (PERF.md, sixteenth
run).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kernels.cross_ws import WsConfig, _coop_loader, _coop_mma, _desc, _tma_load

__all__ = ["cross_backward_ws"]


@gluon.jit
def _bwd_epi_loader(g_desc, x0_desc, pre_desc, acc_desc, g_bufs, x0_bufs, pre_bufs, dx0_bufs, epi_ready, epi_empty,
                    M, N, BM: gl.constexpr, LAST: gl.constexpr):
    """The 1-warp partition streaming the epilogue's operands (``g``, ``x0``, ``pre``, ``dx0``; ``g`` and ``dx0``
    for the first layer) in ``SUB``-row slices into a ring of ``EPI_STAGES`` slots."""
    SUB: gl.constexpr = g_bufs.type.shape[1]
    BN: gl.constexpr = g_bufs.type.shape[2]
    EPI_STAGES: gl.constexpr = g_bufs.type.shape[0]
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    q = 0
    for t in range(pid, num_tiles, grid):
        om = (t // num_pid_n) * BM
        on = (t % num_pid_n) * BN
        for r in range(BM // SUB):
            e = q % EPI_STAGES
            mbarrier.wait(epi_empty.index(e), ((q // EPI_STAGES) & 1) ^ 1)
            if LAST:
                mbarrier.expect(epi_ready.index(e), 2 * g_desc.block_type.nbytes)
            else:
                mbarrier.expect(epi_ready.index(e), 4 * g_desc.block_type.nbytes)
                _tma_load(x0_desc, [om + r * SUB, on], epi_ready.index(e), x0_bufs.index(e))
                _tma_load(pre_desc, [om + r * SUB, on], epi_ready.index(e), pre_bufs.index(e))
            _tma_load(g_desc, [om + r * SUB, on], epi_ready.index(e), g_bufs.index(e))
            _tma_load(acc_desc, [om + r * SUB, on], epi_ready.index(e), dx0_bufs.index(e))
            q += 1


@gluon.jit
def _bwd_epilogue(dx_ptr, gpre_ptr, dx0_ptr, stride, acc_bufs, g_bufs, x0_bufs, pre_bufs, dx0_bufs, acc_ready,
                  acc_empty, epi_ready, epi_empty, M, N, LAST: gl.constexpr, EPI_WARPS: gl.constexpr):
    """The epilogue partition: per tile, slice by slice, ``dx = g + acc``; then ``g_pre = dx * x0`` and
    ``dx0 += dx * pre`` (or ``dx0 += dx`` for the first layer), written with coalesced vector stores."""
    BM: gl.constexpr = acc_bufs.type.shape[1]
    BN: gl.constexpr = acc_bufs.type.shape[2]
    SUB: gl.constexpr = g_bufs.type.shape[1]
    EPI_STAGES: gl.constexpr = g_bufs.type.shape[0]
    TN: gl.constexpr = BN // 8 if BN // 8 < 32 else 32
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [TN, 32 // TN], [EPI_WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    j = 0
    q = 0
    for t in range(pid, num_tiles, grid):
        om = (t // num_pid_n) * BM
        on = (t % num_pid_n) * BN
        slot = j % 2
        buf = acc_bufs.index(slot)
        mbarrier.wait(acc_ready.index(slot), (j // 2) & 1)
        cols = on + gl.arange(0, BN, gl.SliceLayout(0, blk))
        for r in gl.static_range(BM // SUB):  # unrolled: a shared-memory slice needs a constant start
            e = q % EPI_STAGES
            mbarrier.wait(epi_ready.index(e), (q // EPI_STAGES) & 1)
            g = g_bufs.index(e).load(blk).to(gl.float32)
            dx0 = dx0_bufs.index(e).load(blk).to(gl.float32)
            if not LAST:
                x0 = x0_bufs.index(e).load(blk).to(gl.float32)
                pre = pre_bufs.index(e).load(blk).to(gl.float32)
            # Order these shared loads before the epilogue loader's next TMA write into the slot.
            fence_async_shared()
            mbarrier.arrive(epi_empty.index(e), count=1)
            dx = g + buf.slice(r * SUB, SUB, 0).load(blk).to(gl.float32)
            rows = om + r * SUB + gl.arange(0, SUB, gl.SliceLayout(1, blk))
            m = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            offs = gl.expand_dims(rows.to(gl.int64), 1) * stride + gl.expand_dims(cols, 0)
            if LAST:
                gl.store(dx0_ptr + offs, (dx0 + dx).to(dx0_ptr.dtype.element_ty), mask=m)
            else:
                gl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
                gl.store(gpre_ptr + offs, (dx * x0).to(gpre_ptr.dtype.element_ty), mask=m)
                gl.store(dx0_ptr + offs, (dx0 + dx * pre).to(dx0_ptr.dtype.element_ty), mask=m)
            q += 1
        mbarrier.arrive(acc_empty.index(slot), count=1)
        j += 1


@gluon.jit
def _cross_bwd_coop_kernel(du_desc, v_desc, acc_desc, g_desc, x0_desc, pre_desc, dx0_desc, dx_ptr, gpre_ptr, dx0_ptr,
                           stride, M, N, K, STAGES: gl.constexpr, EPI_STAGES: gl.constexpr, LAST: gl.constexpr,
                           MMA_WARPS: gl.constexpr, MMA_REGS: gl.constexpr, EPI_WARPS: gl.constexpr):
    """A loader warp for the K loop, ``MMA_WARPS`` warps on one ``BM x BN`` tile of ``du V`` at a time (staged in
    bf16), a loader warp for the epilogue's operands and the launch's ``num_warps`` warps running the previous
    tile's epilogue."""
    BM: gl.constexpr = du_desc.block_type.shape[0]
    BK: gl.constexpr = du_desc.block_type.shape[1]
    BN: gl.constexpr = v_desc.block_type.shape[1]
    SUB: gl.constexpr = g_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(du_desc.dtype, [STAGES, BM, BK], du_desc.layout)
    b_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BK, BN], v_desc.layout)
    acc_bufs = gl.allocate_shared_memory(acc_desc.dtype, [2, BM, BN], acc_desc.layout)
    g_bufs = gl.allocate_shared_memory(g_desc.dtype, [EPI_STAGES, SUB, BN], g_desc.layout)
    dx0_bufs = gl.allocate_shared_memory(dx0_desc.dtype, [EPI_STAGES, SUB, BN], dx0_desc.layout)
    if LAST:
        x0_bufs = g_bufs
        pre_bufs = g_bufs
    else:
        x0_bufs = gl.allocate_shared_memory(x0_desc.dtype, [EPI_STAGES, SUB, BN], x0_desc.layout)
        pre_bufs = gl.allocate_shared_memory(pre_desc.dtype, [EPI_STAGES, SUB, BN], pre_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [EPI_STAGES, 1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [EPI_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(acc_ready.index(i), count=1)
        mbarrier.init(acc_empty.index(i), count=1)
    for i in gl.static_range(EPI_STAGES):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_empty.index(i), count=1)
    gl.warp_specialize([
        (_bwd_epilogue, (dx_ptr, gpre_ptr, dx0_ptr, stride, acc_bufs, g_bufs, x0_bufs, pre_bufs, dx0_bufs, acc_ready,
                         acc_empty, epi_ready, epi_empty, M, N, LAST, EPI_WARPS)),
        (_coop_mma, (dx_ptr, a_bufs, b_bufs, acc_bufs, ready, empty, acc_ready, acc_empty, M, N, K, MMA_WARPS, False,
                     False)),
        (_coop_loader, (du_desc, v_desc, a_bufs, b_bufs, ready, empty, M, N, K, False)),
        (_bwd_epi_loader, (g_desc, x0_desc, pre_desc, dx0_desc, g_bufs, x0_bufs, pre_bufs, dx0_bufs, epi_ready,
                           epi_empty, M, N, BM, LAST)),
    ], [MMA_WARPS, 1, 1], [MMA_REGS, 24, 24])


def default_config() -> WsConfig:
    """The launch: 128 x 128 tiles, a 4-slot ring, the epilogue's four operands in one 32-row slice slot."""
    return WsConfig(bm=128, bn=128, bk=64, stages=4, schedule="coop", sub=32, epi_stages=1)


def cross_backward_ws(du: Tensor, v: Tensor, g: Tensor, x0: Tensor, pre: Optional[Tensor], dx0: Tensor,
                      config: Optional[WsConfig] = None, num_sms: Optional[int] = None,
                      out_dx0: Optional[Tensor] = None) -> Optional[tuple[Tensor, Tensor]]:
    """``dx = g + du @ v``; with ``pre``: returns ``(dx, dx * x0)`` and adds ``dx * pre`` to ``dx0``; without (the
    first layer): adds ``dx`` to ``dx0`` and returns None. The sum goes to ``out_dx0`` (contiguous, ``dx0``'s shape
    and dtype) when given, else into ``dx0`` in place. See the module docstring."""
    cfg = config or default_config()
    M, K = du.shape
    N = v.shape[1]
    for name, t in (("g", g), ("x0", x0), ("pre", pre), ("dx0", dx0)):
        if t is not None and tuple(t.shape) != (M, N):
            raise ValueError(f"cross_backward_ws: {name} {tuple(t.shape)} is not [M, N] = [{M}, {N}]")
    if tuple(v.shape) != (K, N):
        raise ValueError(f"cross_backward_ws: v {tuple(v.shape)} is not [K, N] = [{K}, {N}]")
    out_dx0 = dx0 if out_dx0 is None else out_dx0
    if not (dx0.is_contiguous() and out_dx0.is_contiguous() and out_dx0.shape == dx0.shape
            and g.stride(1) == 1 and x0.stride(1) == 1):
        raise ValueError("cross_backward_ws: dx0 and out_dx0 must be contiguous [M, N], g and x0 row-major")
    last = pre is None
    dx = None if last else torch.empty((M, N), dtype=g.dtype, device=g.device)
    gpre = None if last else torch.empty((M, N), dtype=g.dtype, device=g.device)
    if M == 0 or N == 0:
        return None if last else (dx, gpre)
    tile, sub = [cfg.bm, cfg.bn], [cfg.sub, cfg.bn]
    sms = num_sms or torch.cuda.get_device_properties(g.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)),)
    _cross_bwd_coop_kernel[grid](
        # the staging slots' type and layout come from a descriptor of a tile-sized scratch tensor
        _desc(du, [cfg.bm, cfg.bk]), _desc(v, [cfg.bk, cfg.bn]), _desc(g.new_empty((cfg.bm, cfg.bn)), tile),
        _desc(g, sub), _desc(x0, sub), _desc(x0 if last else pre, sub), _desc(dx0, sub),
        out_dx0 if last else dx, out_dx0 if last else gpre, out_dx0, out_dx0.stride(0), M, N, K,
        STAGES=cfg.stages, EPI_STAGES=cfg.epi_stages, LAST=last,
        MMA_WARPS=cfg.mma_warps, MMA_REGS=cfg.mma_regs, EPI_WARPS=cfg.epi_warps, num_warps=cfg.epi_warps)
    return None if last else (dx, gpre)
