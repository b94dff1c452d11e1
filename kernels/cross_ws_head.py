"""The top MLP's first data-gradient GEMM with the DCNv2 cross network's top backward pass in its epilogue, as a
warp-specialized, persistent Hopper kernel in Triton's Gluon dialect (the "coop" schedule of `kernels.cross_ws`,
whose loader and MMA partitions it reuses). A probe: no model path uses it yet (see "Why").

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the cross network's width (the top MLP's input), ``K``
the top MLP's first width.

For the top MLP's first layer ``h = relu(x_L W^T + b)`` (``W`` [K, N]) with masked gradient ``gm`` [M, K], and the
cross network's last layer ``x_L = x0 * pre_{L-1} + x_{L-1}``:

* ``G = gm @ W`` [M, N]: ``x_L``'s gradient (cuBLAS writes it today, 464 GFLOP at MLPerf DLRM-DCNv2's shapes);
* ``g_pre = G * x0`` and ``db_{L-1} = sum_rows(g_pre)``: the cross network's top backward pass
  (`kernels.cross_bwd_passes`, which reads ``G`` and ``x0`` back and writes ``g_pre``: 0.49 ms on an H100).

`cross_head_ws(gm, w, x0)` returns ``(G, g_pre, db)`` from one kernel: ``G`` stored by TMA from the bf16 staging slot
of each output tile, ``g_pre`` computed slice by slice from it and ``x0`` (streamed by a loader warp) and written with
vector stores, and the column sums of the ``g_pre`` values written (rounded, as the pass sums them) kept in fp32 per
tile row and added up in a fixed order afterwards. Its three streams run under the next tile's tensor-core math.

Why a probe: using it needs the cross network and the over arch's first layer in one autograd function (the top
layer's ``g_pre`` must come out of the MLP's backward); `benchmarks/cross_ws_head_probe.py` measures first whether
the fused kernel beats cuBLAS + the pass at the step's shapes. It does not yet (H100, 2026-11-25,
benchmarks/results/cross_ws_head_probe.md): 1.18-1.22 ms against 1.10 for cuBLAS (0.61) + the pass (0.48), its
outputs bit for bit those of the two kernels (``db`` to fp32 summation order). 11 us a 128 x 128 tile, about the
K loop's and the epilogue's times added: a 128 x 128 tile reads 32 KB of operands per 2.1 MFLOP K step, more than
an SM's share of L2 bandwidth gives at the tensor cores' rate, so the K loop itself runs near 60% of cuBLAS's
(192 x 192 / 256 x 128 tiles), and the epilogue's streams add to it. Larger tiles did not compile (tried on the
CPU for sm_90, 2026-11-25, not kept): 128 x 256 with one staging slot needs 154 registers a thread in the MMA
warpgroups where 14 warps leave 128 (ptxas C7602), and the epilogue partition cannot drop below 4 warps (Gluon
requires a multiple of 4); 256 x 128 (four MMA warpgroups) needs 90 where 22 warps leave 80.

Requirements as `kernels.cross_ws.supported` (``w`` row-major [K, N], ``K % 8 == 0``, ``N % 8 == 0``); Hopper only,
no interpreter; the CPU tests compile it for sm_90.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kernels.cross_ws import WsConfig, _coop_epi_loader, _coop_loader, _coop_mma, _desc, _tma_store

__all__ = ["cross_head_ws", "cross_head_reference", "default_config"]


@gluon.jit
def _head_epilogue(g_desc, gpre_ptr, part_ptr, stride, g_bufs, x0_bufs, acc_ready, acc_empty, epi_ready, epi_empty,
                   M, N, EPI_WARPS: gl.constexpr):
    """The epilogue partition: per tile, ``G`` to global by TMA straight from its staging slot, then slice by slice
    ``g_pre = G * x0`` with coalesced vector stores and the column sums of the stored values, one fp32 row of
    partial sums per tile."""
    BM: gl.constexpr = g_bufs.type.shape[1]
    BN: gl.constexpr = g_bufs.type.shape[2]
    SUB: gl.constexpr = x0_bufs.type.shape[1]
    EPI_STAGES: gl.constexpr = x0_bufs.type.shape[0]
    TN: gl.constexpr = BN // 8 if BN // 8 < 32 else 32
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [TN, 32 // TN], [EPI_WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    j = 0
    q = 0
    for t in range(pid, num_tiles, grid):
        tm = t // num_pid_n
        om = tm * BM
        on = (t % num_pid_n) * BN
        slot = j % 2
        buf = g_bufs.index(slot)
        mbarrier.wait(acc_ready.index(slot), (j // 2) & 1)
        _tma_store(g_desc, [om, on], buf)
        cols = on + gl.arange(0, BN, gl.SliceLayout(0, blk))
        colsum = gl.zeros([BN], gl.float32, gl.SliceLayout(0, blk))
        for r in gl.static_range(BM // SUB):  # unrolled: a shared-memory slice needs a constant start
            e = q % EPI_STAGES
            mbarrier.wait(epi_ready.index(e), (q // EPI_STAGES) & 1)
            x0 = x0_bufs.index(e).load(blk).to(gl.float32)
            # Order this shared load before the epilogue loader's next TMA write into the slot.
            fence_async_shared()
            mbarrier.arrive(epi_empty.index(e), count=1)
            gq = (buf.slice(r * SUB, SUB, 0).load(blk).to(gl.float32) * x0).to(gpre_ptr.dtype.element_ty)
            rows = om + r * SUB + gl.arange(0, SUB, gl.SliceLayout(1, blk))
            m = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            offs = gl.expand_dims(rows.to(gl.int64), 1) * stride + gl.expand_dims(cols, 0)
            gl.store(gpre_ptr + offs, gq, mask=m)
            colsum += gl.sum(gl.where(m, gq.to(gl.float32), 0.0), axis=0)
            q += 1
        gl.store(part_ptr + tm.to(gl.int64) * N + cols, colsum, mask=cols < N)
        # The slot goes back to the MMA partition once the TMA store has read it.
        tma.store_wait(0)
        mbarrier.arrive(acc_empty.index(slot), count=1)
        j += 1


@gluon.jit
def _cross_head_kernel(a_desc, b_desc, g_desc, x0_desc, gpre_ptr, part_ptr, stride, M, N, K, STAGES: gl.constexpr,
                       EPI_STAGES: gl.constexpr, MMA_WARPS: gl.constexpr, MMA_REGS: gl.constexpr,
                       EPI_WARPS: gl.constexpr):
    """A loader warp for the K loop, ``MMA_WARPS`` warps on one ``BM x BN`` tile of ``gm @ W`` at a time (staged in
    bf16), a loader warp streaming ``x0`` and the launch's ``num_warps`` warps running the previous tile's epilogue."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    SUB: gl.constexpr = x0_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    g_bufs = gl.allocate_shared_memory(g_desc.dtype, [2, BM, BN], g_desc.layout)
    x0_bufs = gl.allocate_shared_memory(x0_desc.dtype, [EPI_STAGES, SUB, BN], x0_desc.layout)
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
        (_head_epilogue, (g_desc, gpre_ptr, part_ptr, stride, g_bufs, x0_bufs, acc_ready, acc_empty, epi_ready,
                          epi_empty, M, N, EPI_WARPS)),
        (_coop_mma, (part_ptr, a_bufs, b_bufs, g_bufs, ready, empty, acc_ready, acc_empty, M, N, K, MMA_WARPS, False,
                     False)),
        (_coop_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, False)),
        (_coop_epi_loader, (x0_desc, x0_desc, x0_bufs, x0_bufs, epi_ready, epi_empty, M, N, BM, True)),
    ], [MMA_WARPS, 1, 1], [MMA_REGS, 24, 24])


def default_config() -> WsConfig:
    """The launch: 128 x 128 tiles, a 4-slot ring of 64-deep K steps, ``x0`` in two 32-row slice slots."""
    return WsConfig(bm=128, bn=128, bk=64, stages=4, schedule="coop", sub=32, epi_stages=2)


def cross_head_reference(gm: Tensor, w: Tensor, x0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(G, g_pre, db)`` in PyTorch ops: ``G = gm @ w`` and ``g_pre = G * x0`` in ``x0``'s dtype, ``db`` the fp32
    column sums of ``g_pre``."""
    g = gm @ w
    gpre = g * x0
    return g, gpre, gpre.float().sum(0)


def cross_head_ws(gm: Tensor, w: Tensor, x0: Tensor, config: Optional[WsConfig] = None,
                  num_sms: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(G, g_pre, db)`` as `cross_head_reference` (see the module docstring): ``gm`` [M, K], ``w`` [K, N] row-major,
    ``x0`` [M, N] row-major, one 16-bit dtype; ``db`` fp32, its partial sums added in a fixed order."""
    cfg = config or default_config()
    M, K = gm.shape
    N = w.shape[1]
    if tuple(w.shape) != (K, N) or tuple(x0.shape) != (M, N):
        raise ValueError(f"cross_head_ws: shapes disagree: gm {tuple(gm.shape)}, w {tuple(w.shape)}, "
                         f"x0 {tuple(x0.shape)}")
    g = torch.empty((M, N), dtype=x0.dtype, device=x0.device)
    gpre = torch.empty((M, N), dtype=x0.dtype, device=x0.device)
    part = torch.zeros((max(triton.cdiv(M, cfg.bm), 1), N), dtype=torch.float32, device=x0.device)
    if M == 0 or N == 0:
        return g, gpre, part.sum(0)
    sms = num_sms or torch.cuda.get_device_properties(x0.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)),)
    _cross_head_kernel[grid](
        _desc(gm, [cfg.bm, cfg.bk]), _desc(w, [cfg.bk, cfg.bn]), _desc(g, [cfg.bm, cfg.bn]), _desc(x0, [cfg.sub, cfg.bn]),
        gpre, part, gpre.stride(0), M, N, K, STAGES=cfg.stages, EPI_STAGES=cfg.epi_stages, MMA_WARPS=cfg.mma_warps,
        MMA_REGS=cfg.mma_regs, EPI_WARPS=cfg.epi_warps, num_warps=cfg.epi_warps)
    return g, gpre, part.sum(0)
