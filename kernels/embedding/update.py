"""Sparse optimizer update of the looked-up rows, and the lookup's dense backward, in sorted segments.

Notation: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N = B * F`` lookup positions,
``R`` rows of the single concatenated table.

The update never materialises a dense gradient: positions are sorted by row
(``torch.sort(stable=True)``, fixed size ``N``, no host sync), then

1. ``_sparse_chunk_kernel``: one program per chunk of ``CHUNK`` sorted positions sums the gradient of
   every segment (run of equal rows) inside the chunk with a 0/1 ``[CHUNK, CHUNK]`` matrix product, applies
   the update for segments that start and end in the chunk, and writes two partial sums per chunk (of its
   first and its last row) for segments that cross chunk boundaries;
2. ``_group_sum_kernel`` (launches with ``group_sums``: the multi-hot ones): per group of ``CARRY_BLOCK`` chunks,
   the sum of the first-row partials of its chunks that continue the row running into the group;
3. ``_sparse_carry_kernel``: one program per ``carry_chunks`` chunks (a launch config field) finishes the
   crossing segments that start in them by adding the first-row partials of the following chunks up to the
   next group boundary, then the group sums (``CARRY_BLOCK`` groups per step, so a hot row that fills
   thousands of chunks costs ``1 + chunks / CARRY_BLOCK**2`` steps; without group sums ``chunks / CARRY_BLOCK``
   steps of chunk partials), then applies the update.

Every unique row is therefore updated exactly once with its summed gradient, in a summation order fixed
by the sorted order: results are bitwise reproducible. ``deterministic=False`` only changes plain SGD on
fp32 weights, which then uses ``tl.atomic_add`` per position instead (faster, order-dependent rounding;
`kernels.embedding.atomic_update`).
The same two kernels, with the "optimizer" that stores the summed gradient, give the plain lookup's
deterministic dense ``[R, D]`` gradient (``dlrm_kernels::embedding_dense_grad``).

The multi-hot lookup (`kernels.embedding.pooled`) runs the same kernels on rows ``[B, L]`` of slots:
a slot-to-feature map (``SLOT_MAP``) finds each slot's gradient row ``grad_out[b, slot_feature[s]]``,
rows ``>= R`` (its empty slots) sort last and are never updated, and bf16 weights may be written back
by round-to-nearest or stochastic rounding bit arithmetic (``ROUND``) instead of the plain cast.

Launch configs: `kernels.heuristics.sparse_update_config` (``SPARSE_UPDATE_OVERRIDE`` forces one).

Tried and slower (2026-11-25, commit fbeee91, results/pooled_update_sweep_singles.md): the rows a batch touches
once (66% of the positions at MLPerf DLRM-DCNv2's shapes with uniform ids) updated by a third kernel in the
positions' original order, where a bag's gradient row is read once and each load depends on the position only,
the chunk kernel skipping them. The update took 6.45-7.26 ms against 4.52 on an H100: the same rows' weights
read and written in random order cost far more than in sorted (ascending address) order, more than the
gradient gathers it saved.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor

from kernels import heuristics
from kernels._backend import (INT32_OFFSET_LIMIT, check_gemm_dtype, check_same_device, check_triton_device, device_context, interpret_mode,
                              max_element_offset)
from kernels.embedding.atomic_update import _sgd_atomic_update
from kernels.embedding.rounding import RNG_CODES
from kernels.embedding.segment_carry import _group_sum_kernel, _sparse_carry_kernel
from kernels.embedding.segment_chunk import _sparse_chunk_kernel

__all__ = ["OPTIMIZERS", "check_hyperparameters", "embedding_sparse_update_", "init_sparse_optimizer_state", "sort_by_row",
           "update_sorts"]

# Optimizer kinds of the fused update, and their kernel codes. Code 3 is internal: "store the summed
# gradient into a dense gradient tensor" (the backward of the plain lookup).
OPTIMIZERS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2}
_DENSE_GRAD = 3
# How the update writes new bf16 weights (kernel code ROUND): the plain cast, or bit arithmetic.
_BF16_ROUNDING = {None: 0, "nearest": 1, "stochastic": 2}
# The random bits of stochastic rounding (`kernels.embedding.rounding.RNG_CODES`); module-level so that a
# benchmark can compare the generators.
# "hash1": 4% faster than "hash" at MLPerf shapes (results/pooled_update_sweep_hash1.md). "hash1hi" (3 integer
# ops an element against 4) measured 0.2% faster at the launch shipped then, (32, 16, 4, 1), and is 2.5% faster at
# today's one-warp launch (16, 32, 1, 1, 8): 3.915-3.926 ms against 4.020-4.024 on an H200, two interleaved repeats
# (results/pooled_update_sweep_rounding.md). It was held back because a 2-rank bf16 run's Adagrad sums once ended
# 4.7% from one process's; tests/test_distributed_bf16.py has since measured why: one process against itself with
# other rounding seeds ends 0.19-5.1% apart with "hash1" too (the earlier 0.13-0.24% came from a plan whose shards
# kept the one-process rows, so the same rounding bits). Both generators pass the same uniformity, independence
# and unbiasedness tests (tests/kernels/test_rounding.py).
SR_RNG = "hash1hi"
# When the chunk kernel loads the weights and optimizer state of the rows it updates (kernel code ROW_LOADS):
# after the gradient sums, right after the gradient gathers are issued, before them, or after the sums but
# prefetched into L2 first (GPU only; the interpreter runs "after_sums" for it). Module-level, so that
# benchmarks/pooled_update_sweep.py can compare them. MLPerf shapes, bf16 tables, H100, three interleaved
# repeats (results/pooled_update_sweep_row_loads.md), ms at the launch then shipped (32, 16, 4, 1): after_sums
# 5.98-6.02, first 5.86-5.88, with_gradients 5.73-5.75, prefetch_l2 5.71-5.73 (41.2-41.4% of copy
# bandwidth). "prefetch_l2" also gives "after_sums"' bits; the two others move w and s to another register
# layout, and row-wise Adagrad's sum over D then rounds in another order. It prefetches rows of >= 128 bytes
# only (see `_prefetch_row_state_l2`).
ROW_LOAD_ORDERS = {"after_sums": 0, "with_gradients": 1, "first": 2, "prefetch_l2": 3}
ROW_LOADS = "prefetch_l2"
# L2 eviction priorities of the chunk kernel's memory traffic in multi-hot updates: (rows' weights and state,
# loads and stores; the gradient gathers). Each updated row is read and written once, while each row of the
# [B, F, D] output gradient is gathered by every position of its bag (100 of a sample's 214 for MLPerf's widest
# feature): Nsight Compute at MLPerf shapes saw ~1.25 GB of the 3.6 GB of gradient gathers come from DRAM, at
# 54% L2 hits. MLPerf shapes, bf16 tables, H100, three interleaved repeats (2026-11-25,
# results/pooled_update_sweep_eviction.md): none 4.536-4.588 ms, rows_first 4.594-4.631, grad_last 4.483-4.525
# (-1.1%), rows_first_grad_last 4.553-4.588; the MLPerf step with grad_last 22.12-22.16 ms against 22.21-22.23
# alternating (results/mlperf_dcnv2_eviction.md); on an H200 the update 0.5% faster (3.971-3.974 against
# 3.987-4.003 ms, pooled_update_sweep_eviction_h200.md), the step inside that machine's run-to-run spread.
# With grad_last the kernel read 0.33 GB less from DRAM in the
# same time (ncu): it is bound by its chains of dependent loads more than by bytes. One-hot updates gather each
# gradient row once, so they keep no priority. Module-level, so that benchmarks/pooled_update_sweep.py can
# compare them.
EVICTIONS = {"none": ("", ""), "rows_first": ("evict_first", ""), "grad_last": ("", "evict_last"),
             "rows_first_grad_last": ("evict_first", "evict_last")}
EVICTION = "grad_last"


# How the chunk kernel writes the partial sums of its first and last row (`segment_chunk._chunk_update`), where the
# carry kernel reads them: "store", a store of the tile masked to that row's lane (no reduction), or "sum", the row
# picked by a masked sum over the tile's 16 positions (a cross-lane reduction, ~220 instructions a pick on sm_90 by
# an offline count; the way until 2026-11-29). The same values (sum: x + 0.0 turns -0.0 into +0.0); with uniform
# ids at MLPerf DLRM-DCNv2's shapes ~54% of 16-position chunks pick one (counted in NumPy: the small tables' rows
# repeat). Store: the update 0.3% faster at the one-warp launch, ncu 10% fewer instructions (H200,
# results/pooled_update_picks_h200.md). Module-level, so that benchmarks/pooled_update_sweep.py --picks can compare
# them.
PARTIAL_PICKS = {"store": True, "sum": False}
PARTIAL_PICK = "store"

# The chunk kernel's register cap forced over the launch config's ``chunk_maxnreg`` (`kernels.heuristics`): None takes
# the launch's, 0 none (the compiler's choice), N caps at N registers a thread. Module-level, for tests and
# benchmarks/pooled_update_sweep.py --maxnregs.
CHUNK_MAXNREG: Optional[int] = None

# Chunk boundaries per program of the carry kernel (`kernels.embedding.segment_carry`), forced (a power of two) over the
# launch config's ``carry_chunks`` (`kernels.heuristics.SparseUpdateConfig`); module-level, for tests and
# benchmarks/pooled_update_sweep.py --carry-chunks.
CARRY_CHUNKS: Optional[int] = None

# Hot rows' long segments finished from group sums (`segment_carry._group_sum_kernel`, 2026-11-29) or by the walk chunk
# by chunk: None takes the launch config's choice (`kernels.heuristics.SparseUpdateConfig.group_sums`: the multi-hot
# launches); True / False force it (tests, A/B measurements: benchmarks/step_profile.py --group-sums).
CARRY_GROUP_SUMS: Optional[bool] = None

# The Triton kernels: kernels/embedding/segment_chunk.py and kernels/embedding/segment_carry.py.


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def _sort_by_row(rows: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """``(sorted rows [N], permutation [N])`` of the flat positions, stable (equal rows keep their order)."""
    flat = rows.reshape(-1)
    # int32 keys sort faster; R is static, so this choice costs no host sync. Wider rows are clamped to R first: a row
    # at or past R is "no row" (skipped), and one past 2**31 cast as it is kept its low 32 bits (2**32 + 1 updated
    # row 1). int32 rows (the fused multi-hot op's, `pooled.fused_rows_dtype`) are keys as they are.
    if num_rows < 2**31 and flat.dtype != torch.int32:
        flat = flat.clamp(max=num_rows).to(torch.int32)
    return torch.sort(flat, stable=True)


def sort_by_row(rows: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """The sort the update of ``rows`` (any shape) into a table of ``num_rows`` rows runs first, for a caller
    that runs it earlier (``presorted`` of `sparse_update_impl`): it needs only the rows, so it can run while
    their gradients are still being computed or received (`dlrm.distributed.owner_exchange`)."""
    return _sort_by_row(rows, num_rows)


def update_sorts(optimizer: str, deterministic: bool, weight_dtype: torch.dtype, weight_decay: float = 0.0) -> bool:
    """Whether `sparse_update_impl` sorts the rows (its segment path), i.e. would use a ``presorted`` result;
    SGD on fp32 weights without decay and not deterministic adds per position instead (no sort)."""
    return not (optimizer == "sgd" and not deterministic and weight_dtype == torch.float32 and weight_decay == 0.0)


def _segment_update(rows: Tensor, grad_out: Tensor, target: Tensor, state: Tensor, lr: Tensor, opt: int, eps: float,
                    weight_decay: float = 0.0, slot_feature: Optional[Tensor] = None,
                    bf16_rounding: Optional[str] = None, sr_seed: Optional[Tensor] = None,
                    presorted: Optional[tuple[Tensor, Tensor]] = None):
    """Sort positions by row (or take ``presorted``, `sort_by_row` of these very rows) and run the chunk + carry
    kernels (see the module docstring).

    ``rows`` [B, C]; ``grad_out`` [B, F, D] with C == F, or any C with ``slot_feature`` [C] (the gradient
    row of column c is grad_out[:, slot_feature[c]]). Rows >= R are skipped (multi-hot padding).
    ``bf16_rounding`` (bf16 weights): None casts, 'nearest' rounds to nearest even, 'stochastic' rounds
    stochastically with the seed in ``sr_seed`` (a one-element int64 tensor; the caller advances it).
    """
    B, C = rows.shape
    N = B * C
    R, D = target.shape
    if slot_feature is not None:
        # the chunk kernel reads slot_feature[c] through its data pointer: any strides in, contiguous to the kernel
        # (a no-op for `pooled_layout`'s own tensors; a strided one gave each slot another slot's feature)
        slot_feature = slot_feature.contiguous()
    if presorted is None:
        sorted_rows, perm = _sort_by_row(rows, R)
    else:
        sorted_rows, perm = presorted
        if sorted_rows.shape != (N,) or perm.shape != (N,):
            raise ValueError(f"presorted: sort_by_row of the {N} rows, got shapes {tuple(sorted_rows.shape)} and "
                             f"{tuple(perm.shape)}")
    BLOCK_D = heuristics.dot_block(D)
    cfg = heuristics.sparse_update_config(BLOCK_D, grad_out.dtype, multi_hot=slot_feature is not None)
    if interpret_mode() and heuristics.SPARSE_UPDATE_OVERRIDE is None and cfg.chunk < 64:
        # The interpreter runs the programs one after another in Python, so the GPU's small chunks (16 positions
        # for fp32 D=16 and multi-hot D=128) would make the CPU test suite minutes slower. The results do not
        # depend on the chunk; tests that force 16-position chunks (SPARSE_UPDATE_OVERRIDE) still run them.
        cfg = cfg._replace(chunk=64)
    num_chunks = triton.cdiv(N, cfg.chunk)
    first = torch.empty((num_chunks, BLOCK_D), dtype=torch.float32, device=target.device)
    last = torch.empty_like(first)
    seed = lr if sr_seed is None else sr_seed  # never read unless stochastic
    rounding = _BF16_ROUNDING[bf16_rounding]
    if bf16_rounding == "stochastic":
        rounding += RNG_CODES[SR_RNG]
    common = dict(OPT=opt, DECAY=weight_decay != 0.0, ROUND=rounding, CHUNK=cfg.chunk, BLOCK_D=BLOCK_D)
    evict = EVICTION if slot_feature is not None else "none"  # see EVICTION
    maxnreg = cfg.chunk_maxnreg if CHUNK_MAXNREG is None else CHUNK_MAXNREG
    if torch.version.hip is not None:  # Triton's AMD backend has no maxnreg option (a launch with it raises)
        maxnreg = None
    _sparse_chunk_kernel[(num_chunks,)](
        sorted_rows,
        perm,
        perm if slot_feature is None else slot_feature,
        grad_out,
        grad_out.stride(0),
        grad_out.stride(1),
        grad_out.stride(2),
        target,
        target.stride(0),
        target.stride(1),
        state,
        lr,
        seed,
        first,
        last,
        eps,
        weight_decay,
        N,
        R,
        F=C,
        D=D,
        SLOT_MAP=slot_feature is not None,
        SPLIT_FP32=grad_out.dtype == torch.float32,
        DOT_16BIT=not interpret_mode(),
        ROW_LOADS=0 if interpret_mode() and ROW_LOADS == "prefetch_l2" else ROW_LOAD_ORDERS[ROW_LOADS],
        POS32=N + cfg.chunk < 2**31 and max_element_offset(grad_out) < INT32_OFFSET_LIMIT,
        ROW_EVICT=EVICTIONS[evict][0],
        GRAD_EVICT=EVICTIONS[evict][1],
        PICK_STORE=PARTIAL_PICKS[PARTIAL_PICK],
        num_warps=cfg.chunk_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        **common,
    )
    group_sums = cfg.group_sums if CARRY_GROUP_SUMS is None else CARRY_GROUP_SUMS
    gsum = first  # never read without group sums
    if group_sums:
        num_groups = triton.cdiv(num_chunks, cfg.carry_block)
        gsum = torch.empty((num_groups, BLOCK_D), dtype=torch.float32, device=target.device)
        _group_sum_kernel[(num_groups,)](sorted_rows, first, gsum, num_chunks, R, CHUNK=cfg.chunk, BLOCK_D=BLOCK_D,
                                         GROUP=cfg.carry_block, num_warps=4)
    carry_chunks = CARRY_CHUNKS or cfg.carry_chunks
    _sparse_carry_kernel[(triton.cdiv(num_chunks, carry_chunks),)](
        sorted_rows,
        target,
        target.stride(0),
        target.stride(1),
        state,
        lr,
        seed,
        first,
        last,
        gsum,
        eps,
        weight_decay,
        N,
        num_chunks,
        D,
        R,
        CARRY_BLOCK=cfg.carry_block,
        CHUNKS=carry_chunks,
        GROUP_SUMS=group_sums,
        num_warps=cfg.carry_warps,
        **common,
    )


def _expected_state_shape(optimizer: str, weight: Tensor) -> Optional[tuple[int, ...]]:
    """Shape of the optimizer state for ``weight`` [R, D]: [R, D] (adagrad), [R] (rowwise), None (sgd)."""
    R, D = weight.shape
    return {"adagrad": (R, D), "rowwise_adagrad": (R,)}.get(optimizer)


def check_hyperparameters(optimizer: str, eps: float, weight_decay: float) -> None:
    """One-line ValueErrors for what torch.optim.Adagrad refuses too: a negative (or NaN) ``eps`` of the Adagrad
    rules (``sqrt(0) + eps < 0`` divides by ~0 or flips the step: inf / NaN rows, silently) or ``weight_decay``."""
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if optimizer != "sgd" and not eps >= 0.0:
        raise ValueError(f"{optimizer} eps must be >= 0, got {eps!r}")


def _check_update_inputs(rows, grad_out, weight, state, lr, optimizer, weight_decay: float = 0.0,
                         slot_feature: Optional[Tensor] = None, eps: float = 0.0) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    check_hyperparameters(optimizer, eps, weight_decay)
    if rows.is_floating_point() or rows.is_complex():
        # the sort converts them to int32 keys: row 1.7 updated row 1, with no error (as raw values, refused)
        raise ValueError(f"rows must hold integers (int64 rows of weight, from hash_rows), got {rows.dtype}")
    if slot_feature is None:
        if rows.dim() != 2 or grad_out.dim() != 3 or tuple(grad_out.shape[:2]) != tuple(rows.shape):
            raise ValueError(
                f"rows [B, F] and grad_out [B, F, D] disagree: {tuple(rows.shape)}, {tuple(grad_out.shape)}"
            )
    elif (rows.dim() != 2 or grad_out.dim() != 3 or grad_out.shape[0] != rows.shape[0]
          or tuple(slot_feature.shape) != (rows.shape[1],)):
        raise ValueError(
            f"rows [B, L], grad_out [B, F, D] and slot_feature [L] disagree: {tuple(rows.shape)}, "
            f"{tuple(grad_out.shape)}, {tuple(slot_feature.shape)}"
        )
    if weight.dim() != 2 or grad_out.shape[2] != weight.shape[1]:
        raise ValueError(f"grad_out [B, F, D] and weight [R, D] disagree: {tuple(grad_out.shape)}, {tuple(weight.shape)}")
    if lr.numel() != 1 or lr.dtype != torch.float32 or lr.device != weight.device:
        raise ValueError("lr must be a one-element float32 tensor on weight's device")
    # the step is computed in fp32 and stored in weight's dtype: a float64 table had every row it touched rounded to
    # fp32 (1e8 + 0.3 became 1e8, an lr * grad of 1e-4 lost), with no error
    check_gemm_dtype(weight.dtype, "the sparse embedding update kernels", 'kernels.embedding "torch"')
    # rows, the gradient and the state are read on weight's device: one of another device read bad memory
    check_same_device("the sparse embedding update", rows=rows, grad_out=grad_out, weight=weight,
                      state=state if state.numel() else None, slot_feature=slot_feature)
    expected = _expected_state_shape(optimizer, weight)
    if expected is not None:
        if tuple(state.shape) != expected or state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(f"{optimizer} needs a contiguous float32 state of shape {expected}, got {tuple(state.shape)}")
    check_triton_device(weight.device, "sparse embedding update kernels")


def sparse_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay=0.0,
                       slot_feature=None, bf16_rounding=None, sr_seed=None, presorted=None) -> None:
    """Check the inputs and apply one optimizer step to the looked-up rows (in place).

    ``slot_feature``, ``bf16_rounding`` and ``sr_seed``: see `_segment_update` (the multi-hot update
    passes them). ``presorted``: `sort_by_row` of ``rows``, already run (used where `update_sorts`).
    """
    _check_update_inputs(rows, grad_out, weight, state, lr, optimizer, weight_decay, slot_feature, eps)
    if rows.numel() == 0 or weight.shape[1] == 0:
        return
    # The atomic path adds per position; the decay belongs to each unique row once, so it needs the segments.
    if not update_sorts(optimizer, deterministic, weight.dtype, weight_decay):
        _sgd_atomic_update(rows, grad_out, weight, lr, slot_feature)
        return
    state_arg = state if state.numel() > 0 else weight  # sgd: never read
    _segment_update(rows, grad_out, weight, state_arg, lr, OPTIMIZERS[optimizer], eps, weight_decay, slot_feature,
                    bf16_rounding, sr_seed, presorted)


def dense_grad_impl(rows: Tensor, grad_out: Tensor, num_rows: int, slot_feature: Optional[Tensor] = None,
                    dtype: Optional[torch.dtype] = None) -> Tensor:
    """Dense ``[num_rows, D]`` gradient of a lookup at ``rows``, summed in sorted segments (deterministic).

    ``slot_feature``: see `_segment_update` (rows >= num_rows get no gradient). ``dtype``: the gradient's
    (default grad_out's; the segment sums are fp32 either way, so float64 is refused in one line: a float64 table's
    gradient was summed in fp32 and handed back as float64, 2e-12 off a sum of two 1 + 1e-12, with no error)."""
    check_gemm_dtype(grad_out.dtype, "the embedding backward kernels", 'kernels.embedding "torch"')
    if dtype is not None:
        check_gemm_dtype(dtype, "the embedding backward kernels", 'kernels.embedding "torch"')
    D = grad_out.shape[2]
    grad = torch.zeros((num_rows, D), dtype=dtype or grad_out.dtype, device=grad_out.device)
    if rows.numel() == 0 or D == 0:
        return grad
    check_triton_device(grad_out.device, "embedding backward kernels")
    dummy = torch.zeros(1, dtype=torch.float32, device=grad_out.device)
    _segment_update(rows, grad_out, grad, dummy, dummy, _DENSE_GRAD, 0.0, slot_feature=slot_feature)
    return grad


# ----------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::embedding_dense_grad", mutates_args=())
def _embedding_dense_grad_op(rows: Tensor, grad_out: Tensor, num_rows: int,
                             dtype: Optional[torch.dtype] = None) -> Tensor:
    """Dense ``[num_rows, D]`` gradient of the lookup (the plain op's backward), deterministic."""
    with device_context(grad_out):
        return dense_grad_impl(rows, grad_out, num_rows, dtype=dtype)


@_embedding_dense_grad_op.register_fake
def _(rows, grad_out, num_rows, dtype=None):
    return grad_out.new_empty((num_rows, grad_out.shape[2]), dtype=dtype or grad_out.dtype)


@torch.library.custom_op("dlrm_kernels::embedding_sparse_update_", mutates_args=("weight", "state"))
def _embedding_sparse_update_op(
    rows: Tensor,
    grad_out: Tensor,
    weight: Tensor,
    state: Tensor,
    lr: Tensor,
    optimizer: str,
    eps: float,
    deterministic: bool,
    weight_decay: float = 0.0,
) -> None:
    with device_context(weight):
        one_hot_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay)


@_embedding_sparse_update_op.register_fake
def _(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay=0.0):
    return None


# Stochastic rounding of bf16 weights has its own op, whose seed is a required argument: torch 2.11's
# custom-op dispatch fails (IndexError in ADInplaceOrView) on a mutated argument left at its default.
@torch.library.custom_op("dlrm_kernels::embedding_sparse_update_sr_", mutates_args=("weight", "state", "sr_seed"))
def _embedding_sparse_update_sr_op(
    rows: Tensor,
    grad_out: Tensor,
    weight: Tensor,
    state: Tensor,
    lr: Tensor,
    optimizer: str,
    eps: float,
    deterministic: bool,
    weight_decay: float,
    sr_seed: Tensor,
) -> None:
    with device_context(weight):
        one_hot_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay, sr_seed)


@_embedding_sparse_update_sr_op.register_fake
def _(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay, sr_seed):
    return None


def one_hot_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay=0.0,
                        sr_seed=None) -> None:
    """`sparse_update_impl` for the one-hot lookup: bf16 weights are written back by stochastic rounding
    when ``sr_seed`` (a one-element int64 tensor on weight's device) is given, which is then advanced on
    the device (the next call, or a replayed CUDA graph, draws new bits); else rounded to nearest even."""
    rounding = None
    if weight.dtype == torch.bfloat16:
        rounding = "nearest" if sr_seed is None else "stochastic"
        if sr_seed is not None and (sr_seed.numel() != 1 or sr_seed.dtype != torch.int64
                                    or sr_seed.device != weight.device):
            raise ValueError("sr_seed must be a one-element int64 tensor on weight's device")
    sparse_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay,
                       bf16_rounding=rounding, sr_seed=sr_seed if rounding == "stochastic" else None)
    if rounding == "stochastic":
        sr_seed.add_(1)


# ----------------------------------------------------------------------------------------------------
# Thin functions
# ----------------------------------------------------------------------------------------------------


def empty_state(weight: Tensor) -> Tensor:
    """The zero-size float32 tensor that stands for "no optimizer state" (custom ops take no None here)."""
    return torch.empty(0, dtype=torch.float32, device=weight.device)


def embedding_sparse_update_(
    rows: Tensor,
    grad_out: Tensor,
    weight: Tensor,
    state: Optional[Tensor],
    lr: Tensor,
    optimizer: str = "sgd",
    eps: float = 1e-10,
    deterministic: bool = True,
    weight_decay: float = 0.0,
    sr_seed: Optional[Tensor] = None,
) -> None:
    """Apply one optimizer step to the rows looked up, in place, from the lookup's output gradient.

    Args:
        rows: ``[B, F]`` int64 global rows (from :func:`hash_rows`): each in ``[0, R)``, or ``>= R`` (skipped).
            Not checked (that would be a host synchronisation): a negative row writes outside the table.
        grad_out: ``[B, F, D]`` gradient of the lookup output (any strides, stride 0 included).
        weight: ``[R, D]`` table, updated in place (fp32 or bf16; the arithmetic is fp32).
        state: None or empty for 'sgd'; ``[R, D]`` fp32 for 'adagrad'; ``[R]`` fp32 for
            'rowwise_adagrad' (see :func:`init_sparse_optimizer_state`). Updated in place.
        lr: one-element float32 tensor on weight's device (read in the kernel: a schedule may change it).
        optimizer: 'sgd' (w -= lr g), 'adagrad' (torch.optim.Adagrad with sparse grads, no decay),
            'rowwise_adagrad' (state[r] += mean_d g[r]^2; w[r] -= lr g[r] / (sqrt(state[r]) + eps)).
        deterministic: bitwise reproducible results (always so except 'sgd' on fp32 weights with False).
        weight_decay: lazy L2: ``g[r] += weight_decay * w[r]`` for every row looked up, before the
            optimizer's rule (rows not looked up are untouched); 0 adds nothing.
        sr_seed: bf16 weights only: a one-element int64 tensor; the new weights are rounded
            stochastically (unbiased: small updates are not lost to bf16's 8-bit mantissa) with random
            bits keyed by it, and it is incremented on the device. None: round to nearest even.

    ``g[r]`` is the sum of ``grad_out`` over every position that hashed to ``r``; each unique row is
    updated once. No host synchronisation.
    """
    if state is None:
        state = empty_state(weight)
    if sr_seed is None:
        torch.ops.dlrm_kernels.embedding_sparse_update_(rows, grad_out, weight, state, lr, optimizer, eps, deterministic,
                                                        weight_decay)
    else:
        torch.ops.dlrm_kernels.embedding_sparse_update_sr_(rows, grad_out, weight, state, lr, optimizer, eps,
                                                           deterministic, weight_decay, sr_seed)


def init_sparse_optimizer_state(optimizer: str, weight: Tensor) -> Optional[Tensor]:
    """Zero optimizer state for ``weight`` [R, D]: None (sgd), [R, D] (adagrad) or [R] (rowwise) fp32."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    shape = _expected_state_shape(optimizer, weight)
    return None if shape is None else torch.zeros(shape, dtype=torch.float32, device=weight.device)
