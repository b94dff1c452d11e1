"""DCNv2 cross layer forward ``out = x0 * (U @ W^T + b) + x`` as a warp-specialized, persistent Hopper GEMM
written in Triton's Gluon dialect: the epilogue's memory traffic of one tile runs under the next tile's
tensor-core math.

Notation as in `kernels.cross`: ``M`` rows (the batch), ``N`` the cross network's width, ``K`` its rank.

Why (benchmarks/PERF.md, eighth and fourteenth runs): one MLPerf DLRM-DCNv2 cross layer at batch 65536
(N = 3456, K = 512, bf16) is cuBLAS's ``U @ W^T`` (0.35 ms) and Inductor's elementwise pass (0.58 ms). The
GEMM's math (232 GFLOP, ~0.3 ms) is shorter than the epilogue's streams (``x0`` and ``x`` read, ``out`` and
``pre`` written: 1.8 GB, ~0.6 ms at the copy bandwidth), and a tiled Triton kernel runs the two in series
inside each program: 0.90-0.98 ms whatever its tile, persistence or Triton's own warp specialization. Here
each part has its own warps. Two schedules (``WsConfig.schedule``):

* ``"coop"`` (the default; what `kernels.cross_ws_op` runs): four partitions per persistent CTA. A 1-warp
  loader issues the TMA loads of the ``U`` and ``W`` tiles of every K step into a ring of ``STAGES``
  shared-memory slots; ``mma_warps`` warps (two warpgroups, 64 rows each of a 128 x 128 tile) run the wgmma K
  loop and write ``pre = acc + b`` in bf16 into one of two staging slots; a second 1-warp loader streams the
  tile's ``x0`` and ``x`` in ``sub``-row slices into a ring of ``epi_stages`` slots; the epilogue warpgroup
  (the launch's ``num_warps``) writes ``pre`` by a TMA store straight from its slot and ``out = x0 * pre + x``
  slice by slice with coalesced vector stores, while the MMA warps already run the next tile.
* ``"pingpong"`` (CUTLASS's arrangement): two 4-warp consumers take the CTA's 64 x 128 tiles in turn, each
  running its own epilogue while the other runs its K loop, fed by one loader warp. Its tiles are half the
  size, so each tile's ``U`` and ``W`` bytes cost more L2 traffic per FLOP.

Measured (H100, MLPerf DLRM-DCNv2 shapes, bf16, benchmarks/results/cross_ws_probe.md; ``pre`` saved): "coop"
0.71 ms a layer (2.6 TB/s of the 3.0 a copy gets) and 0.61 ms for the first layer (``x`` is ``x0``), against
0.93 and 0.79 for cuBLAS + Inductor's pass; "pingpong" 0.85 and 0.75. The ring depth decides: with 3 slots
"coop" took 0.89 ms, with 2 x0/x slices of 32 rows in flight 0.71, with 4 of 16 rows 0.90.

Each CTA is persistent (one per SM) and walks tiles ``pid, pid + G, ...`` in row-major tile order, so the
``U`` rows of the tiles in flight stay in L2 and ``W`` (3.5 MB) lives there.

Numerics: fp32 accumulation; ``pre = acc + b`` rounded once to the output dtype; ``out = x0 * pre + x`` in fp32
and rounded once, from the fp32 ``pre`` ("pingpong") or the rounded one ("coop": two roundings). Inductor's
path rounds ``U @ W^T`` to bf16 first; the tests compare both against float64.

Requirements (`supported`): an sm_90 GPU, bf16 or fp16 operands, contiguous rows (last stride 1) with
16-byte aligned row strides (TMA), ``K % 8 == 0`` and ``N % 8 == 0``. Any ``M``, ``N`` and ``K`` otherwise:
TMA zero-fills reads past the edges and clips stores.

Gluon is Triton's experimental low-level dialect (``triton.experimental.gluon``): the code is written against
Triton 3.6's API and compile-checked for sm_90 with the installed Triton by the CPU tests; it runs only on a
Hopper GPU (no interpreter).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import heuristics

__all__ = ["cross_forward_ws", "default_config", "supported", "WsConfig"]

# Triton 3.6 (the GPU image) names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global;
# later releases renamed them async_load / async_store and made the old names raise.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


# ----------------------------------------------------------------------------------------------------
# Gluon kernels
# ----------------------------------------------------------------------------------------------------


@gluon.jit
def _loader(u_desc, w_desc, x0_desc, x_desc, a_bufs, b_bufs, x0_bufs, x_bufs, ready, empty, epi_ready,
            epi_empty, M, N, K, X_IS_X0: gl.constexpr):
    """The 1-warp partition that issues every TMA load, in the order the consumers take them."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_steps = gl.cdiv(K, BK)
    count = 0
    j = 0
    for t in range(pid, num_tiles, grid):
        om = (t // num_pid_n) * BM
        on = (t % num_pid_n) * BN
        c = j % 2
        # The epilogue's operands go to consumer c's slot once its previous tile has read them.
        mbarrier.wait(epi_empty.index(c), ((j // 2) & 1) ^ 1)
        if X_IS_X0:
            mbarrier.expect(epi_ready.index(c), x0_desc.block_type.nbytes)
        else:
            mbarrier.expect(epi_ready.index(c), x0_desc.block_type.nbytes + x_desc.block_type.nbytes)
            _tma_load(x_desc, [om, on], epi_ready.index(c), x_bufs.index(c))
        _tma_load(x0_desc, [om, on], epi_ready.index(c), x0_bufs.index(c))
        for k in range(k_steps):
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), u_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(u_desc, [om, k * BK], ready.index(s), a_bufs.index(s))
            _tma_load(w_desc, [on, k * BK], ready.index(s), b_bufs.index(s))
            count += 1
        j += 1


@gluon.jit
def _consumer(c: gl.constexpr, out_desc, pre_desc, b_ptr, a_bufs, b_bufs, x0_bufs, x_bufs, out_bufs, pre_bufs,
              ready, empty, epi_ready, epi_empty, order, M, N, K, X_IS_X0: gl.constexpr, STORE_PRE: gl.constexpr):
    """One 4-warp consumer: the K loop of every other tile of the CTA (those with ``j % 2 == c``), then its
    epilogue, whose TMA stores finish while the other consumer runs its K loop.

    The K loops take turns (``order[c]``: consumer ``1 - c`` has finished waiting on its K loop's slots). Without
    that, a consumer could wait on a ring slot whose barrier is two phases behind its turn, and an mbarrier's
    parity cannot tell those phases apart: it read slots still holding the other consumer's tiles (wrong sums)
    once K took more steps than the ring has slots."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_steps = gl.cdiv(K, BK)
    out_buf = out_bufs.index(c)
    pre_buf = pre_bufs.index(c)
    j = c
    for t in range(pid + c * grid, num_tiles, 2 * grid):
        om = (t // num_pid_n) * BM
        on = (t % num_pid_n) * BN
        count = j * k_steps
        i = j // 2
        mbarrier.wait(order.index(c), i & 1)
        acc = gl.zeros((BM, BN), gl.float32, acc_layout)
        for k in range(k_steps):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # Keep one wgmma in flight; the one before it has read its slot, which goes back to the loader.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
            count += 1
        mbarrier.arrive(order.index(1 - c), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)

        cols = on + gl.arange(0, BN, col_layout)
        bias = gl.load(b_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
        pre = acc + gl.expand_dims(bias, 0)
        mbarrier.wait(epi_ready.index(c), i & 1)
        x0 = x0_bufs.index(c).load(acc_layout).to(gl.float32)
        if X_IS_X0:
            xx = x0
        else:
            xx = x_bufs.index(c).load(acc_layout).to(gl.float32)
        # Order the shared loads above before the loader's next TMA write into these slots.
        fence_async_shared()
        mbarrier.arrive(epi_empty.index(c), count=1)
        out = x0 * pre + xx
        # The staging buffers are free once the previous tile's stores have read them.
        tma.store_wait(0)
        out_buf.store(out.to(out_desc.dtype))
        if STORE_PRE:
            pre_buf.store(pre.to(pre_desc.dtype))
        fence_async_shared()
        _tma_store(out_desc, [om, on], out_buf)
        if STORE_PRE:
            _tma_store(pre_desc, [om, on], pre_buf)
        j += 2
    tma.store_wait(0)


@gluon.jit
def _cross_fwd_ws_kernel(u_desc, w_desc, x0_desc, x_desc, out_desc, pre_desc, b_ptr, M, N, K,
                         STAGES: gl.constexpr, X_IS_X0: gl.constexpr, STORE_PRE: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr):
    """Allocate the shared buffers and barriers, then fork the consumers and the loader."""
    BM: gl.constexpr = u_desc.block_type.shape[0]
    BK: gl.constexpr = u_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(u_desc.dtype, [STAGES, BM, BK], u_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    x0_bufs = gl.allocate_shared_memory(x0_desc.dtype, [2, BM, BN], x0_desc.layout)
    if X_IS_X0:
        x_bufs = x0_bufs
    else:
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2, BM, BN], x_desc.layout)
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, BM, BN], out_desc.layout)
    if STORE_PRE:
        pre_bufs = gl.allocate_shared_memory(pre_desc.dtype, [2, BM, BN], pre_desc.layout)
    else:
        pre_bufs = out_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_empty.index(i), count=1)
        mbarrier.init(order.index(i), count=1)
    # Consumer 0 takes the first turn: its first K loop waits on phase 0 of order[0], completed here.
    mbarrier.arrive(order.index(0), count=1)

    gl.warp_specialize([
        (_consumer, (0, out_desc, pre_desc, b_ptr, a_bufs, b_bufs, x0_bufs, x_bufs, out_bufs, pre_bufs, ready, empty,
                     epi_ready, epi_empty, order, M, N, K, X_IS_X0, STORE_PRE)),
        (_consumer, (1, out_desc, pre_desc, b_ptr, a_bufs, b_bufs, x0_bufs, x_bufs, out_bufs, pre_bufs, ready, empty,
                     epi_ready, epi_empty, order, M, N, K, X_IS_X0, STORE_PRE)),
        (_loader, (u_desc, w_desc, x0_desc, x_desc, a_bufs, b_bufs, x0_bufs, x_bufs, ready, empty, epi_ready,
                   epi_empty, M, N, K, X_IS_X0)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def _coop_loader(u_desc, w_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_KMAJOR: gl.constexpr = True):
    """The 1-warp partition of the cooperative schedule: the ``U`` and ``W`` tiles of every K step (``W`` as
    [N, K] tiles with ``B_KMAJOR``, as nn.Linear stores it; else as [K, N] tiles)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1] if B_KMAJOR else b_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_steps = gl.cdiv(K, BK)
    count = 0
    for t in range(pid, num_tiles, grid):
        om = (t // num_pid_n) * BM
        on = (t % num_pid_n) * BN
        for k in range(k_steps):
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), u_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(u_desc, [om, k * BK], ready.index(s), a_bufs.index(s))
            if B_KMAJOR:
                _tma_load(w_desc, [on, k * BK], ready.index(s), b_bufs.index(s))
            else:
                _tma_load(w_desc, [k * BK, on], ready.index(s), b_bufs.index(s))
            count += 1


@gluon.jit
def _coop_mma(b_ptr, a_bufs, b_bufs, pre_bufs, ready, empty, pre_ready, pre_empty, M, N, K,
              MMA_WARPS: gl.constexpr, B_KMAJOR: gl.constexpr = True, HAS_BIAS: gl.constexpr = True):
    """The MMA partition (``MMA_WARPS`` warps, one wgmma row block of 64 per warpgroup): each tile's K loop,
    then ``pre = acc + b`` (``acc`` without ``HAS_BIAS``) in bf16 into a shared staging slot for the epilogue
    partition."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1] if B_KMAJOR else b_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                         instr_shape=[16, BN, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = gl.cdiv(M, BM) * num_pid_n
    k_steps = gl.cdiv(K, BK)
    count = 0
    j = 0
    for t in range(pid, num_tiles, grid):
        on = (t % num_pid_n) * BN
        acc = gl.zeros((BM, BN), gl.float32, acc_layout)
        for k in range(k_steps):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            if B_KMAJOR:
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            else:
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
        if HAS_BIAS:
            cols = on + gl.arange(0, BN, col_layout)
            bias = gl.load(b_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            pre = (acc + gl.expand_dims(bias, 0)).to(pre_bufs.dtype)
        else:
            pre = acc.to(pre_bufs.dtype)
        slot = j % 2
        mbarrier.wait(pre_empty.index(slot), ((j // 2) & 1) ^ 1)
        pre_bufs.index(slot).store(pre)
        fence_async_shared()
        mbarrier.arrive(pre_ready.index(slot), count=1)
        j += 1


@gluon.jit
def _coop_epi_loader(x0_desc, x_desc, x0_bufs, x_bufs, epi_ready, epi_empty, M, N, BM: gl.constexpr,
                     X_IS_X0: gl.constexpr):
    """The 1-warp partition that streams the epilogue's ``x0`` and ``x`` in ``SUB``-row slices into a ring of
    ``EPI_STAGES`` slots, as far ahead of the epilogue as the ring allows."""
    SUB: gl.constexpr = x0_bufs.type.shape[1]
    BN: gl.constexpr = x0_bufs.type.shape[2]
    EPI_STAGES: gl.constexpr = x0_bufs.type.shape[0]
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
            if X_IS_X0:
                mbarrier.expect(epi_ready.index(e), x0_desc.block_type.nbytes)
            else:
                mbarrier.expect(epi_ready.index(e), x0_desc.block_type.nbytes + x_desc.block_type.nbytes)
                _tma_load(x_desc, [om + r * SUB, on], epi_ready.index(e), x_bufs.index(e))
            _tma_load(x0_desc, [om + r * SUB, on], epi_ready.index(e), x0_bufs.index(e))
            q += 1


@gluon.jit
def _coop_epilogue(pre_desc, out_ptr, stride_out, pre_bufs, x0_bufs, x_bufs, pre_ready, pre_empty, epi_ready,
                   epi_empty, M, N, X_IS_X0: gl.constexpr, STORE_PRE: gl.constexpr, EPI_WARPS: gl.constexpr):
    """The epilogue partition: per tile, ``pre`` to global by TMA straight from its staging slot, then
    ``out = x0 * pre + x`` slice by slice from the ``x0``/``x`` ring, written with coalesced vector stores."""
    BM: gl.constexpr = pre_bufs.type.shape[1]
    BN: gl.constexpr = pre_bufs.type.shape[2]
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
        om = (t // num_pid_n) * BM
        on = (t % num_pid_n) * BN
        slot = j % 2
        buf = pre_bufs.index(slot)
        mbarrier.wait(pre_ready.index(slot), (j // 2) & 1)
        if STORE_PRE:
            _tma_store(pre_desc, [om, on], buf)
        cols = on + gl.arange(0, BN, gl.SliceLayout(0, blk))
        for r in gl.static_range(BM // SUB):  # unrolled: a shared-memory slice needs a constant start
            e = q % EPI_STAGES
            mbarrier.wait(epi_ready.index(e), (q // EPI_STAGES) & 1)
            x0 = x0_bufs.index(e).load(blk).to(gl.float32)
            if X_IS_X0:
                xx = x0
            else:
                xx = x_bufs.index(e).load(blk).to(gl.float32)
            # Order these shared loads before the epilogue loader's next TMA write into the slot.
            fence_async_shared()
            mbarrier.arrive(epi_empty.index(e), count=1)
            p = buf.slice(r * SUB, SUB, 0).load(blk).to(gl.float32)
            rows = om + r * SUB + gl.arange(0, SUB, gl.SliceLayout(1, blk))
            m = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            offs = gl.expand_dims(rows.to(gl.int64), 1) * stride_out + gl.expand_dims(cols, 0)
            gl.store(out_ptr + offs, (x0 * p + xx).to(out_ptr.dtype.element_ty), mask=m)
            q += 1
        # The slot goes back to the MMA partition once the TMA store has read it.
        tma.store_wait(0)
        mbarrier.arrive(pre_empty.index(slot), count=1)
        j += 1


@gluon.jit
def _cross_fwd_coop_kernel(u_desc, w_desc, pre_desc, x0_desc, x_desc, out_ptr, b_ptr, stride_out, M, N, K,
                           STAGES: gl.constexpr, EPI_STAGES: gl.constexpr, X_IS_X0: gl.constexpr,
                           STORE_PRE: gl.constexpr, MMA_WARPS: gl.constexpr, MMA_REGS: gl.constexpr,
                           EPI_WARPS: gl.constexpr):
    """The cooperative schedule: a loader warp for the K loop, ``MMA_WARPS`` warps on one ``BM x BN`` tile at a
    time, a loader warp for the epilogue's operands and the launch's ``num_warps`` warps running the previous
    tile's epilogue."""
    BM: gl.constexpr = u_desc.block_type.shape[0]
    BK: gl.constexpr = u_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    SUB: gl.constexpr = x0_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(u_desc.dtype, [STAGES, BM, BK], u_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    pre_bufs = gl.allocate_shared_memory(pre_desc.dtype, [2, BM, BN], pre_desc.layout)
    x0_bufs = gl.allocate_shared_memory(x0_desc.dtype, [EPI_STAGES, SUB, BN], x0_desc.layout)
    if X_IS_X0:
        x_bufs = x0_bufs
    else:
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [EPI_STAGES, SUB, BN], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pre_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [EPI_STAGES, 1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [EPI_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(pre_ready.index(i), count=1)
        mbarrier.init(pre_empty.index(i), count=1)
    for i in gl.static_range(EPI_STAGES):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_empty.index(i), count=1)
    gl.warp_specialize([
        (_coop_epilogue, (pre_desc, out_ptr, stride_out, pre_bufs, x0_bufs, x_bufs, pre_ready, pre_empty, epi_ready,
                          epi_empty, M, N, X_IS_X0, STORE_PRE, EPI_WARPS)),
        (_coop_mma, (b_ptr, a_bufs, b_bufs, pre_bufs, ready, empty, pre_ready, pre_empty, M, N, K, MMA_WARPS)),
        (_coop_loader, (u_desc, w_desc, a_bufs, b_bufs, ready, empty, M, N, K)),
        (_coop_epi_loader, (x0_desc, x_desc, x0_bufs, x_bufs, epi_ready, epi_empty, M, N, BM, X_IS_X0)),
    ], [MMA_WARPS, 1, 1], [MMA_REGS, 24, 24])


# ----------------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------------


class WsConfig:
    """The launch.

    ``schedule``: ``"pingpong"`` (two 4-warp consumers taking tiles in turn, each running its own epilogue) or
    ``"coop"`` (``mma_warps`` warps on one tile, ``epi_warps`` warps running the previous tile's epilogue).
    ``BM x BN`` output tiles (pingpong: one consumer's, ``BM`` = 64; coop: ``BM`` = 64 per MMA warpgroup),
    ``BK`` the K step, ``STAGES`` ring slots for the ``U``/``W`` tiles, ``sub`` rows per epilogue slice and
    ``epi_stages`` slots of the slices' ``x0``/``x`` ring (coop),
    register budgets per thread of the worker partitions (the default partition gets what is left of
    ``maxnreg``).
    """

    def __init__(self, bm: int = 128, bn: int = 128, bk: int = 64, stages: int = 4, consumer_regs: int = 232,
                 maxnreg: Optional[int] = None, schedule: str = "coop", sub: int = 32, mma_warps: int = 8,
                 mma_regs: int = 160, epi_warps: int = 4, epi_stages: int = 2) -> None:
        if schedule not in ("pingpong", "coop"):
            raise ValueError(f"schedule must be 'pingpong' or 'coop', got {schedule!r}")
        self.bm, self.bn, self.bk, self.stages = bm, bn, bk, stages
        self.consumer_regs, self.maxnreg, self.schedule = consumer_regs, maxnreg, schedule
        self.sub, self.mma_warps, self.mma_regs, self.epi_warps = sub, mma_warps, mma_regs, epi_warps
        self.epi_stages = epi_stages

    def __repr__(self) -> str:
        if self.schedule == "coop":
            return (f"coop {self.bm}x{self.bn}x{self.bk}s{self.stages} sub{self.sub}x{self.epi_stages} "
                    f"mma{self.mma_warps}w r{self.mma_regs} epi{self.epi_warps}w")
        return f"{self.bm}x{self.bn}x{self.bk}s{self.stages}r{self.consumer_regs}"


def default_config(device: torch.device) -> WsConfig:
    """The launch `cross_forward_ws` takes without one: the coop schedule, 32-row epilogue slices in a ring of 2
    (H100: results/cross_ws_probe.md); on an H200 64-row slices, one at a time, which read ``x0``/``x`` in larger
    TMA loads (results/cross_ws_probe_h200.md: a later layer with ``pre`` stored 0.614 ms against 0.632, the first
    0.543 against 0.559; on the H100 the same launch was slower, 0.758 against 0.712 and 0.631 against 0.615)."""
    return WsConfig(sub=64, epi_stages=1) if heuristics.is_h200(device) else WsConfig()


def supported(x0: Tensor, x: Tensor, u: Tensor, w: Tensor) -> bool:
    """Whether `cross_forward_ws` can run these operands (see the module docstring)."""
    if not (x0.is_cuda and torch.cuda.get_device_capability(x0.device)[0] == 9):
        return False
    if x0.dtype not in (torch.bfloat16, torch.float16) or not all(t.dtype == x0.dtype for t in (x, u, w)):
        return False
    for t in (x0, x, u, w):
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return u.shape[1] % 8 == 0 and w.shape[0] % 8 == 0


def _desc(t: Tensor, block: list[int]) -> TensorDescriptor:
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def cross_forward_ws(x0: Tensor, x: Tensor, u: Tensor, w: Tensor, b: Tensor, store_pre: bool = True,
                     config: Optional[WsConfig] = None, num_sms: Optional[int] = None) -> tuple[Tensor, Optional[Tensor]]:
    """``(out, pre)`` with ``pre = u @ w^T + b`` and ``out = x0 * pre + x`` (``pre`` None unless ``store_pre``).

    Args:
        x0, x: ``[M, N]`` (``x`` may be ``x0`` itself: the first layer reads it once).
        u: ``[M, K]``; w: ``[N, K]`` (``nn.Linear``'s weight layout); b: ``[N]`` (any float dtype).
    """
    cfg = config or default_config(x0.device)
    M, N = x0.shape
    K = u.shape[1]
    if tuple(x.shape) != (M, N) or tuple(u.shape) != (M, K) or tuple(w.shape) != (N, K) or tuple(b.shape) != (N,):
        raise ValueError(f"cross_forward_ws: shapes disagree: x0 {tuple(x0.shape)}, x {tuple(x.shape)}, "
                         f"u {tuple(u.shape)}, w {tuple(w.shape)}, b {tuple(b.shape)}")
    out = torch.empty((M, N), dtype=x0.dtype, device=x0.device)
    pre = torch.empty((M, N), dtype=x0.dtype, device=x0.device) if store_pre else None
    if M == 0 or N == 0:
        return out, pre
    x_is_x0 = x is x0 or (x.data_ptr() == x0.data_ptr() and x.stride() == x0.stride())
    tile = [cfg.bm, cfg.bn]
    sms = num_sms or torch.cuda.get_device_properties(x0.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)),)
    extra = {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
    if cfg.schedule == "coop":
        sub = [cfg.sub, cfg.bn]
        _cross_fwd_coop_kernel[grid](
            _desc(u, [cfg.bm, cfg.bk]), _desc(w, [cfg.bn, cfg.bk]), _desc(pre if store_pre else out, tile),
            _desc(x0, sub), _desc(x, sub), out, b, out.stride(0), M, N, K, STAGES=cfg.stages,
            EPI_STAGES=cfg.epi_stages, X_IS_X0=x_is_x0, STORE_PRE=store_pre, MMA_WARPS=cfg.mma_warps,
            MMA_REGS=cfg.mma_regs, EPI_WARPS=cfg.epi_warps, num_warps=cfg.epi_warps, **extra)
        return out, pre
    descs = (_desc(u, [cfg.bm, cfg.bk]), _desc(w, [cfg.bn, cfg.bk]), _desc(x0, tile), _desc(x, tile),
             _desc(out, tile), _desc(pre if store_pre else out, tile))
    _cross_fwd_ws_kernel[grid](
        *descs, b, M, N, K, STAGES=cfg.stages, X_IS_X0=x_is_x0, STORE_PRE=store_pre,
        CONSUMER_REGS=cfg.consumer_regs, num_warps=4, **extra)
    return out, pre
