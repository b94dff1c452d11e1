"""Hashed embedding lookup for all sparse features in one launch, with a fused sparse optimizer backward.

Notation: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N = B * F`` lookup positions,
``R = sum(cardinalities)`` rows of the single concatenated table.

Contract (matches the eager ``SparseArch``):

* one weight ``[R, D]``; per-feature ``cardinalities [F]`` and ``offsets [F]`` (exclusive cumsum), int64;
* raw input ``raw [B, F]`` int64: 32-bit Criteo hash values, missing = -1 (any int64 is accepted);
* hashing, *modulus* mode: ``row = offsets[f] + (raw + 1) mod cardinalities[f]`` (non-negative modulo,
  so -1 lands on row ``offsets[f]``);
* hashing, *vocabulary* mode: per-feature sorted, unique vocabularies concatenated in ``vocab`` with
  ``vocab_offsets [F + 1]``; ``row = offsets[f] + (1 + i if vocab_f[i] == raw else 0)`` (local row 0 is
  the out-of-vocabulary row, missing values land there too), so ``cardinalities[f] = V_f + 1``.

File layout: ``@triton.jit`` kernels, host launchers, ``torch.library`` custom ops (``dlrm_kernels::*``,
each with a fake and, where differentiable, an autograd registration), then thin functions and the
``TritonSparseEmbedding`` module.

Backward paths:

* plain op (:func:`embedding_lookup`): an ordinary dense ``[R, D]`` gradient for ``weight`` (computed with
  the same sorted segment reduction as below, so it is deterministic);
* fused op (:func:`fused_embedding`): the backward applies the optimizer update directly to the rows
  that were looked up (:func:`embedding_sparse_update_`) and returns no gradient for ``weight``.

The sparse update never materialises a dense gradient: positions are sorted by row
(``torch.sort(stable=True)``, fixed size ``N``, no host sync), then

1. ``_sparse_chunk_kernel``: one program per chunk of ``CHUNK`` sorted positions sums the gradient of
   every segment (run of equal rows) inside the chunk with a 0/1 ``[CHUNK, CHUNK]`` matrix product, applies
   the update for segments that start and end in the chunk, and writes two partial sums per chunk (of its
   first and its last row) for segments that cross chunk boundaries;
2. ``_sparse_carry_kernel``: one program per chunk finishes the crossing segment that starts in it by
   adding the first-row partials of the following chunks (``CARRY_BLOCK`` chunks per step, so a hot row
   that fills thousands of chunks costs ``chunks / CARRY_BLOCK`` steps), then applies the update.

Every unique row is therefore updated exactly once with its summed gradient, in a summation order fixed
by the sorted order: results are bitwise reproducible. ``deterministic=False`` only changes plain SGD on
fp32 weights, which then uses ``tl.atomic_add`` per position instead (faster, order-dependent rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from kernels._backend import check_triton_device, device_context, interpret_mode

__all__ = [
    "OPTIMIZERS",
    "SparseOptimizerConfig",
    "TritonSparseEmbedding",
    "embedding_lookup",
    "embedding_sparse_update_",
    "fused_embedding",
    "hash_rows",
    "hash_rows_reference",
    "init_sparse_optimizer_state",
]

# Optimizer kinds of the fused update, and their kernel codes. Code 3 is internal: "store the summed
# gradient into a dense gradient tensor" (the backward of the plain op).
OPTIMIZERS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2}
_DENSE_GRAD = 3

# Launch configuration of the sparse update: (CHUNK sorted positions per program of the segment-sum
# kernel, CARRY_BLOCK chunks added per step of the carry loop, num_warps of the chunk kernel, num_warps
# of the carry kernel). tl.dot needs every dim >= 16; larger chunks cost CHUNK^2 * D multiply-adds per
# chunk but shorten hot rows' carry loops. Benchmarks may set _UPDATE_CONFIG_OVERRIDE.
_UPDATE_CONFIG_OVERRIDE: Optional[tuple[int, int, int, int]] = None


def _update_config(block_d: int, grad_dtype: torch.dtype) -> tuple[int, int, int, int]:
    if _UPDATE_CONFIG_OVERRIDE is not None:
        return _UPDATE_CONFIG_OVERRIDE
    # H100, B=65536, F=26, Criteo-like skew with one all-missing feature, rowwise Adagrad (us):
    # D=16: fp32 392 / bf16 289; D=128: bf16 740 with (64, 32, 4, 1); fp32 D=128 is cheapest with
    # 32-position chunks (1471 us): its 3-pass TF32 product grows with CHUNK^2. torch.sort is ~160 us of it.
    if grad_dtype == torch.float32 and block_d >= 64:
        return (32, 16, 4, 4)
    return (64, 32, 4, 1)


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _hash_positions(
    raw_ptr,
    stride_rb,
    stride_rf,
    card_ptr,
    off_ptr,
    vocab_ptr,
    voff_ptr,
    pos,
    mask,
    F,
    USE_VOCAB: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Global table rows (int64) of the flat positions ``pos = b * F + f`` (masked lanes give garbage)."""
    b = pos // F
    f = pos - b * F
    raw = tl.load(raw_ptr + b * stride_rb + f * stride_rf, mask=mask, other=0).to(tl.int64)
    base = tl.load(off_ptr + f, mask=mask, other=0)
    if USE_VOCAB:
        # Lower-bound binary search in vocab[start:end]. SEARCH_STEPS >= bit_length(total vocab size)
        # bounds every feature's segment, so a fixed, unrolled number of steps suffices (lanes whose
        # interval is already empty just stop moving).
        start = tl.load(voff_ptr + f, mask=mask, other=0)
        end = tl.load(voff_ptr + f + 1, mask=mask, other=0)
        lo = start
        hi = end
        for _ in tl.static_range(SEARCH_STEPS):
            active = lo < hi
            mid = lo + (hi - lo) // 2
            v = tl.load(vocab_ptr + mid, mask=mask & active, other=0)
            right = active & (v < raw)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (v >= raw), mid, hi)
        found = mask & (lo < end)
        v = tl.load(vocab_ptr + lo, mask=found, other=0)
        found = found & (v == raw)
        local = tl.where(found, lo - start + 1, 0)
    else:
        card = tl.load(card_ptr + f, mask=mask, other=1)
        # `%` truncates towards zero in compiled Triton (C semantics): fold negatives back.
        local = (raw + 1) % card
        local = tl.where(local < 0, local + card, local)
    return base + local


@triton.jit
def _hash_rows_kernel(
    raw_ptr,
    stride_rb,
    stride_rf,
    card_ptr,
    off_ptr,
    vocab_ptr,
    voff_ptr,
    rows_ptr,
    N,
    F,
    USE_VOCAB: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = pos < N
    rows = _hash_positions(
        raw_ptr, stride_rb, stride_rf, card_ptr, off_ptr, vocab_ptr, voff_ptr, pos, mask, F, USE_VOCAB, SEARCH_STEPS
    )
    tl.store(rows_ptr + pos, rows, mask=mask)


@triton.jit
def _embedding_fwd_kernel(
    raw_ptr,
    stride_rb,
    stride_rf,
    card_ptr,
    off_ptr,
    vocab_ptr,
    voff_ptr,
    w_ptr,
    stride_wr,
    stride_wd,
    out_ptr,
    rows_ptr,
    N,
    F,
    D,
    USE_VOCAB: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[pos, :] = weight[row(pos), :] for BLOCK_N positions; also writes rows (saved for backward)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = pos < N
    rows = _hash_positions(
        raw_ptr, stride_rb, stride_rf, card_ptr, off_ptr, vocab_ptr, voff_ptr, pos, mask, F, USE_VOCAB, SEARCH_STEPS
    )
    tl.store(rows_ptr + pos, rows, mask=mask)
    d = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (d < D)[None, :]
    vals = tl.load(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, mask=m2, other=0.0)
    tl.store(out_ptr + pos[:, None] * D + d[None, :], vals, mask=m2)


@triton.jit
def _apply_row_update(
    rows,
    g,
    sel,
    d,
    D,
    w_ptr,
    stride_wr,
    stride_wd,
    state_ptr,
    lr_ptr,
    eps,
    OPT: tl.constexpr,
):
    """Apply the update for the rows ``rows`` [M] whose summed fp32 gradients are ``g`` [M, BLOCK_D].

    ``sel`` [M] selects the lanes that own a unique row (each row is selected exactly once per step).
    """
    dmask = d < D
    m2 = sel[:, None] & dmask[None, :]
    w_offs = rows[:, None] * stride_wr + d[None, :] * stride_wd
    if OPT == 3:
        # Plain backward: the dense gradient tensor (zeros elsewhere) has weight's layout.
        tl.store(w_ptr + w_offs, g.to(w_ptr.dtype.element_ty), mask=m2)
    else:
        lr = tl.load(lr_ptr).to(tl.float32)
        w = tl.load(w_ptr + w_offs, mask=m2, other=0.0).to(tl.float32)
        if OPT == 0:
            w = w - lr * g
        elif OPT == 1:
            # torch.optim.Adagrad, sparse grad: state += g^2; w -= lr * g / (sqrt(state) + eps)
            s_offs = rows[:, None] * D + d[None, :]
            s = tl.load(state_ptr + s_offs, mask=m2, other=0.0) + g * g
            tl.store(state_ptr + s_offs, s, mask=m2)
            w = w - lr * (g / (tl.sqrt(s) + eps))
        else:
            # Row-wise Adagrad: one accumulator per row, fed with the mean of g^2 over D.
            s = tl.load(state_ptr + rows, mask=sel, other=0.0) + tl.sum(g * g, axis=1) / D
            tl.store(state_ptr + rows, s, mask=sel)
            w = w - lr * (g / (tl.sqrt(s)[:, None] + eps))
        tl.store(w_ptr + w_offs, w.to(w_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _sparse_chunk_kernel(
    sorted_ptr,
    perm_ptr,
    grad_ptr,
    stride_gb,
    stride_gf,
    stride_gd,
    w_ptr,
    stride_wr,
    stride_wd,
    state_ptr,
    lr_ptr,
    first_ptr,
    last_ptr,
    eps,
    N,
    F,
    D,
    OPT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Segment sums inside one chunk of sorted positions; update the segments that lie inside it.

    Writes ``first[k]`` (sum over the chunk's positions whose row is the chunk's first row) and ``last[k]``
    (same for its last row); the carry kernel uses them for segments that cross chunk boundaries.
    """
    k = tl.program_id(0).to(tl.int64)
    cs = k * CHUNK
    i = cs + tl.arange(0, CHUNK)
    valid = i < N
    rows = tl.load(sorted_ptr + i, mask=valid, other=-1).to(tl.int64)
    nxt = tl.load(sorted_ptr + i + 1, mask=(i + 1) < N, other=-1).to(tl.int64)
    pos = tl.load(perm_ptr + i, mask=valid, other=0)
    b = pos // F
    f = pos - b * F
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    g = tl.load(
        grad_ptr + b[:, None] * stride_gb + f[:, None] * stride_gf + d[None, :] * stride_gd,
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    )

    row0 = tl.load(sorted_ptr + cs).to(tl.int64)
    prev = tl.load(sorted_ptr + cs - 1, mask=cs > 0, other=-1).to(tl.int64)
    last_i = tl.minimum(cs + CHUNK, N) - 1
    row_last = tl.load(sorted_ptr + last_i).to(tl.int64)

    # Per-position sum over the positions of the chunk with the same row: a 0/1 matrix product with fp32
    # accumulation, in a fixed order (deterministic). For bf16/fp16 gradients the 0/1 matrix is exact in
    # that dtype, so the tensor-core product is an exact fp32 sum of the gradients. fp32 gradients use
    # FP32_DOT: "tf32x3" on GPUs (tensor cores, ~fp32 accuracy), "ieee" in the interpreter.
    same = rows[:, None] == rows[None, :]
    if g.dtype == tl.float32:
        seg = tl.dot(same.to(tl.float32), g, input_precision=FP32_DOT)
    else:
        seg = tl.dot(same.to(g.dtype), g)

    # A segment is complete here when it ends in the chunk (next sorted row differs) and starts in it,
    # i.e. its row differs from row0, unless the chunk itself starts a segment (then compare against -2,
    # which no row equals). Written as one comparison: the interpreter mishandles scalar | vector masks.
    row0_cont = tl.where((cs == 0) | (prev != row0), -2, row0)
    ends_here = valid & (nxt != rows)
    starts_here = rows != row0_cont
    _apply_row_update(rows, seg, ends_here & starts_here, d, D, w_ptr, stride_wr, stride_wd, state_ptr, lr_ptr, eps, OPT)

    # Every lane of a segment holds the segment's chunk sum: pick the first and the last lane.
    lane = tl.arange(0, CHUNK)
    first = tl.sum(tl.where((lane == 0)[:, None], seg, 0.0), axis=0)
    last = tl.sum(tl.where((lane == (last_i - cs))[:, None], seg, 0.0), axis=0)
    tl.store(first_ptr + k * BLOCK_D + d, first)
    tl.store(last_ptr + k * BLOCK_D + d, last)


@triton.jit
def _sparse_carry_kernel(
    sorted_ptr,
    w_ptr,
    stride_wr,
    stride_wd,
    state_ptr,
    lr_ptr,
    first_ptr,
    last_ptr,
    eps,
    N,
    num_chunks,
    D,
    OPT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CARRY_BLOCK: tl.constexpr,
):
    """Finish the segment that starts in chunk k and continues into chunk k + 1 (if there is one)."""
    k = tl.program_id(0).to(tl.int64)
    cs = k * CHUNK
    ce = tl.minimum(cs + CHUNK, N)
    row0 = tl.load(sorted_ptr + cs).to(tl.int64)
    prev = tl.load(sorted_ptr + cs - 1, mask=cs > 0, other=-1).to(tl.int64)
    row_last = tl.load(sorted_ptr + ce - 1).to(tl.int64)
    following = tl.load(sorted_ptr + ce, mask=ce < N, other=-1).to(tl.int64)
    row0_cont = tl.where((cs == 0) | (prev != row0), -2, row0)
    if (following == row_last) & (row_last != row0_cont):
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(last_ptr + k * BLOCK_D + d)
        # The segment covers a run of following chunks whose first row is row_last; add their
        # first-row partials CARRY_BLOCK chunks at a time until a chunk starts with another row.
        j = k + 1
        n_match = CARRY_BLOCK
        while n_match == CARRY_BLOCK:
            kk = j + tl.arange(0, CARRY_BLOCK)
            kmask = kk < num_chunks
            head = tl.load(sorted_ptr + kk * CHUNK, mask=kmask, other=-1).to(tl.int64)
            match = kmask & (head == row_last)
            part = tl.load(first_ptr + kk[:, None] * BLOCK_D + d[None, :], mask=match[:, None], other=0.0)
            acc += tl.sum(part, axis=0)
            n_match = tl.sum(match.to(tl.int32), axis=0)
            j += CARRY_BLOCK
        one = tl.arange(0, 1)
        _apply_row_update(
            row_last + one * 0,
            acc[None, :],
            one == 0,
            d,
            D,
            w_ptr,
            stride_wr,
            stride_wd,
            state_ptr,
            lr_ptr,
            eps,
            OPT,
        )


@triton.jit
def _sgd_atomic_kernel(
    rows_ptr,
    grad_ptr,
    stride_gb,
    stride_gf,
    stride_gd,
    w_ptr,
    stride_wr,
    stride_wd,
    lr_ptr,
    N,
    F,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Non-deterministic SGD: w[row(pos)] -= lr * grad[pos] with atomics (fp32 weights only)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = pos < N
    rows = tl.load(rows_ptr + pos, mask=mask, other=0)
    b = pos // F
    f = pos - b * F
    d = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (d < D)[None, :]
    g = tl.load(
        grad_ptr + b[:, None] * stride_gb + f[:, None] * stride_gf + d[None, :] * stride_gd, mask=m2, other=0.0
    ).to(tl.float32)
    lr = tl.load(lr_ptr).to(tl.float32)
    tl.atomic_add(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, -lr * g, mask=m2)


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def _block_d(D: int) -> int:
    # tl.dot needs >= 16 along every dim.
    return max(16, triton.next_power_of_2(D))


def _search_steps(vocab: Optional[Tensor]) -> int:
    # Shape-derived (no host sync): every feature's vocabulary is at most vocab.numel() long.
    return 0 if vocab is None else max(1, int(vocab.numel()).bit_length())


def _check_hash_inputs(raw, cardinalities, offsets, vocab, vocab_offsets) -> None:
    if raw.dim() != 2:
        raise ValueError(f"raw must be [B, F], got shape {tuple(raw.shape)}")
    F = raw.shape[1]
    if cardinalities.shape != (F,) or offsets.shape != (F,):
        raise ValueError(f"cardinalities and offsets must be [F={F}]")
    if (vocab is None) != (vocab_offsets is None):
        raise ValueError("vocab and vocab_offsets go together")
    if vocab_offsets is not None and vocab_offsets.shape != (F + 1,):
        raise ValueError(f"vocab_offsets must be [F + 1 = {F + 1}], got {tuple(vocab_offsets.shape)}")
    check_triton_device(raw.device, "hashed embedding kernels")


def _hash_args(raw, cardinalities, offsets, vocab, vocab_offsets):
    use_vocab = vocab is not None
    card = cardinalities.to(torch.int64).contiguous()
    off = offsets.to(torch.int64).contiguous()
    if use_vocab:
        voc = vocab.to(torch.int64).contiguous()
        voff = vocab_offsets.to(torch.int64).contiguous()
        if voc.numel() == 0:  # never read (every search interval is empty), but needs a valid pointer
            voc = torch.zeros(1, dtype=torch.int64, device=raw.device)
    else:
        voc, voff = card, off  # unused under USE_VOCAB=False
    return (raw, raw.stride(0), raw.stride(1), card, off, voc, voff), use_vocab, _search_steps(vocab)


def _hash_rows_impl(raw, cardinalities, offsets, vocab, vocab_offsets) -> Tensor:
    _check_hash_inputs(raw, cardinalities, offsets, vocab, vocab_offsets)
    B, F = raw.shape
    N = B * F
    rows = torch.empty((B, F), dtype=torch.int64, device=raw.device)
    if N == 0:
        return rows
    args, use_vocab, steps = _hash_args(raw, cardinalities, offsets, vocab, vocab_offsets)
    BLOCK_N = 256
    _hash_rows_kernel[(triton.cdiv(N, BLOCK_N),)](
        *args, rows, N, F, USE_VOCAB=use_vocab, SEARCH_STEPS=steps, BLOCK_N=BLOCK_N
    )
    return rows


def _lookup_impl(raw, weight, cardinalities, offsets, vocab, vocab_offsets) -> tuple[Tensor, Tensor]:
    _check_hash_inputs(raw, cardinalities, offsets, vocab, vocab_offsets)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [R, D], got shape {tuple(weight.shape)}")
    B, F = raw.shape
    D = weight.shape[1]
    N = B * F
    out = torch.empty((B, F, D), dtype=weight.dtype, device=weight.device)
    rows = torch.empty((B, F), dtype=torch.int64, device=weight.device)
    if N == 0 or D == 0:
        return out, rows if N == 0 else _hash_rows_impl(raw, cardinalities, offsets, vocab, vocab_offsets)
    args, use_vocab, steps = _hash_args(raw, cardinalities, offsets, vocab, vocab_offsets)
    BLOCK_D = triton.next_power_of_2(D)
    # ~4K elements per program: enough bytes in flight per SM without spilling.
    BLOCK_N = max(1, min(256, 4096 // BLOCK_D))
    _embedding_fwd_kernel[(triton.cdiv(N, BLOCK_N),)](
        *args,
        weight,
        weight.stride(0),
        weight.stride(1),
        out,
        rows,
        N,
        F,
        D,
        USE_VOCAB=use_vocab,
        SEARCH_STEPS=steps,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
    )
    return out, rows


def _segment_update(rows: Tensor, grad_out: Tensor, target: Tensor, state: Tensor, lr: Tensor, opt: int, eps: float):
    """Sort positions by row and run the chunk + carry kernels (see the module docstring)."""
    B, F = rows.shape
    N = B * F
    R, D = target.shape
    flat = rows.reshape(-1)
    # int32 keys sort faster; R is static, so this choice costs no host sync.
    keys = flat.to(torch.int32) if R < 2**31 else flat
    sorted_rows, perm = torch.sort(keys, stable=True)
    BLOCK_D = _block_d(D)
    chunk, carry_block, chunk_warps, carry_warps = _update_config(BLOCK_D, grad_out.dtype)
    num_chunks = triton.cdiv(N, chunk)
    first = torch.empty((num_chunks, BLOCK_D), dtype=torch.float32, device=target.device)
    last = torch.empty_like(first)
    common = dict(OPT=opt, CHUNK=chunk, BLOCK_D=BLOCK_D)
    _sparse_chunk_kernel[(num_chunks,)](
        sorted_rows,
        perm,
        grad_out,
        grad_out.stride(0),
        grad_out.stride(1),
        grad_out.stride(2),
        target,
        target.stride(0),
        target.stride(1),
        state,
        lr,
        first,
        last,
        eps,
        N,
        F,
        D,
        FP32_DOT="ieee" if interpret_mode() else "tf32x3",
        num_warps=chunk_warps,
        **common,
    )
    _sparse_carry_kernel[(num_chunks,)](
        sorted_rows,
        target,
        target.stride(0),
        target.stride(1),
        state,
        lr,
        first,
        last,
        eps,
        N,
        num_chunks,
        D,
        CARRY_BLOCK=carry_block,
        num_warps=carry_warps,
        **common,
    )


def _check_update_inputs(rows, grad_out, weight, state, lr, optimizer):
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if rows.dim() != 2 or grad_out.dim() != 3 or tuple(grad_out.shape[:2]) != tuple(rows.shape):
        raise ValueError(f"rows [B, F] and grad_out [B, F, D] disagree: {tuple(rows.shape)}, {tuple(grad_out.shape)}")
    if weight.dim() != 2 or grad_out.shape[2] != weight.shape[1]:
        raise ValueError(f"grad_out [B, F, D] and weight [R, D] disagree: {tuple(grad_out.shape)}, {tuple(weight.shape)}")
    if lr.numel() != 1 or lr.dtype != torch.float32 or lr.device != weight.device:
        raise ValueError("lr must be a one-element float32 tensor on weight's device")
    R, D = weight.shape
    if optimizer == "adagrad":
        expected = (R, D)
    elif optimizer == "rowwise_adagrad":
        expected = (R,)
    else:
        expected = None
    if expected is not None:
        if tuple(state.shape) != expected or state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(f"{optimizer} needs a contiguous float32 state of shape {expected}, got {tuple(state.shape)}")
    check_triton_device(weight.device, "sparse embedding update kernels")


def _sparse_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic) -> None:
    _check_update_inputs(rows, grad_out, weight, state, lr, optimizer)
    B, F = rows.shape
    N = B * F
    R, D = weight.shape
    if N == 0 or D == 0:
        return
    if optimizer == "sgd" and not deterministic and weight.dtype == torch.float32:
        flat = rows.reshape(-1).contiguous()
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_N = max(1, min(256, 4096 // BLOCK_D))
        _sgd_atomic_kernel[(triton.cdiv(N, BLOCK_N),)](
            flat,
            grad_out,
            grad_out.stride(0),
            grad_out.stride(1),
            grad_out.stride(2),
            weight,
            weight.stride(0),
            weight.stride(1),
            lr,
            N,
            F,
            D,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
        )
        return
    state_arg = state if state.numel() > 0 else weight  # sgd: never read
    _segment_update(rows, grad_out, weight, state_arg, lr, OPTIMIZERS[optimizer], eps)


def _dense_grad_impl(rows: Tensor, grad_out: Tensor, num_rows: int) -> Tensor:
    D = grad_out.shape[2]
    grad = torch.zeros((num_rows, D), dtype=grad_out.dtype, device=grad_out.device)
    if rows.numel() == 0 or D == 0:
        return grad
    check_triton_device(grad_out.device, "embedding backward kernels")
    dummy = torch.zeros(1, dtype=torch.float32, device=grad_out.device)
    _segment_update(rows, grad_out, grad, dummy, dummy, _DENSE_GRAD, 0.0)
    return grad


# ----------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::hash_rows", mutates_args=())
def _hash_rows_op(
    raw: Tensor, cardinalities: Tensor, offsets: Tensor, vocab: Optional[Tensor], vocab_offsets: Optional[Tensor]
) -> Tensor:
    with device_context(raw):
        return _hash_rows_impl(raw, cardinalities, offsets, vocab, vocab_offsets)


@_hash_rows_op.register_fake
def _(raw, cardinalities, offsets, vocab, vocab_offsets):
    return raw.new_empty(raw.shape, dtype=torch.int64)


@torch.library.custom_op("dlrm_kernels::embedding_lookup", mutates_args=())
def _embedding_lookup_op(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Returns ``(out [B, F, D] in weight's dtype, rows [B, F] int64)``; rows are saved for backward."""
    with device_context(weight):
        return _lookup_impl(raw, weight, cardinalities, offsets, vocab, vocab_offsets)


def _lookup_fake(raw, weight, *_):
    B, F = raw.shape
    return weight.new_empty((B, F, weight.shape[1])), raw.new_empty((B, F), dtype=torch.int64)


_embedding_lookup_op.register_fake(_lookup_fake)


@torch.library.custom_op("dlrm_kernels::embedding_dense_grad", mutates_args=())
def _embedding_dense_grad_op(rows: Tensor, grad_out: Tensor, num_rows: int) -> Tensor:
    """Dense ``[num_rows, D]`` gradient of the lookup (the plain op's backward), deterministic."""
    with device_context(grad_out):
        return _dense_grad_impl(rows, grad_out, num_rows)


@_embedding_dense_grad_op.register_fake
def _(rows, grad_out, num_rows):
    return grad_out.new_empty((num_rows, grad_out.shape[2]))


def _lookup_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.num_rows = inputs[1].shape[0]
    ctx.mark_non_differentiable(output[1])


def _lookup_backward(ctx, grad_out, _grad_rows):
    (rows,) = ctx.saved_tensors
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = torch.ops.dlrm_kernels.embedding_dense_grad(rows, grad_out, ctx.num_rows)
    return None, grad_w, None, None, None, None


_embedding_lookup_op.register_autograd(_lookup_backward, setup_context=_lookup_setup_context)


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
) -> None:
    with device_context(weight):
        _sparse_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic)


@_embedding_sparse_update_op.register_fake
def _(rows, grad_out, weight, state, lr, optimizer, eps, deterministic):
    return None


@torch.library.custom_op("dlrm_kernels::fused_embedding", mutates_args=())
def _fused_embedding_op(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
    state: Tensor,
    lr: Tensor,
    optimizer: str,
    eps: float,
    deterministic: bool,
    grad_trigger: Tensor,
) -> tuple[Tensor, Tensor]:
    """Forward = lookup; backward applies the sparse optimizer update in place (see fused_embedding)."""
    with device_context(weight):
        return _lookup_impl(raw, weight, cardinalities, offsets, vocab, vocab_offsets)


_fused_embedding_op.register_fake(_lookup_fake)


def _fused_setup_context(ctx, inputs, output):
    raw, weight, _card, _off, _voc, _voff, state, lr, optimizer, eps, deterministic, _trigger = inputs
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])
    # Held as plain attributes, not saved tensors: the backward mutates them, and they must be the very
    # tensors the caller owns (the parameter and the optimizer state), not saved copies/versions.
    ctx.weight, ctx.state, ctx.lr = weight, state, lr
    ctx.optimizer, ctx.eps, ctx.deterministic = optimizer, eps, deterministic


def _fused_backward(ctx, grad_out, _grad_rows):
    (rows,) = ctx.saved_tensors
    torch.ops.dlrm_kernels.embedding_sparse_update_(
        rows, grad_out, ctx.weight, ctx.state, ctx.lr, ctx.optimizer, ctx.eps, ctx.deterministic
    )
    # No gradient for weight (the update has been applied: weight.grad stays None) nor the trigger.
    return (None,) * 12


_fused_embedding_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)


# ----------------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------------


def hash_rows(
    raw: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
) -> Tensor:
    """Global table rows of ``raw`` [B, F] (Triton kernel): ``[B, F]`` int64.

    Modulus mode when ``vocab`` is None, otherwise vocabulary mode (``vocab`` [sum V_f] int64, each
    feature's segment sorted ascending and unique; ``vocab_offsets`` [F + 1] int64).
    """
    return torch.ops.dlrm_kernels.hash_rows(raw, cardinalities, offsets, vocab, vocab_offsets)


# Vocabulary keys of the reference: feature f's value v maps to f * 2**35 + (v + 2**33), so a single
# searchsorted over the concatenated vocabulary finds per-feature positions. Exact for vocabulary values
# in [-2**33 + 1, 2**33) (32-bit hashes and -1 fit with room to spare); raw values outside that range
# can never match and are mapped to a sentinel below every vocabulary key.
_KEY_HALF = 2**33
_KEY_STRIDE = 2**35


def vocab_search_keys(vocab: Tensor, vocab_offsets: Tensor) -> Tensor:
    """Globally sorted int64 keys of the concatenated vocabulary (cacheable input of the reference)."""
    idx = torch.arange(vocab.numel(), device=vocab.device)
    feat = torch.searchsorted(vocab_offsets[1:].contiguous(), idx, right=True)
    return feat * _KEY_STRIDE + (vocab.to(torch.int64) + _KEY_HALF)


def hash_rows_reference(
    raw: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
    vocab_keys: Optional[Tensor] = None,
) -> Tensor:
    """Plain-torch equivalent of :func:`hash_rows` (device-side, no host sync; usable as eager hashing).

    Modulus mode uses ``torch.remainder`` (non-negative for positive cardinalities). Vocabulary mode uses
    one ``torch.searchsorted`` over the concatenated vocabulary with per-feature keys (see
    ``vocab_search_keys``; pass its result as ``vocab_keys`` to avoid recomputing it every call). The
    Triton kernel is exact for every int64 value; this reference requires vocabulary values in
    ``[-2**33 + 1, 2**33)``.
    """
    raw = raw.to(torch.int64)
    offsets = offsets.to(torch.int64)
    if vocab is None:
        return offsets + torch.remainder(raw + 1, cardinalities.to(torch.int64))
    vocab_offsets = vocab_offsets.to(torch.int64)
    keys = vocab_search_keys(vocab, vocab_offsets) if vocab_keys is None else vocab_keys
    F = raw.shape[1]
    feat = torch.arange(F, device=raw.device)
    in_range = (raw > -_KEY_HALF) & (raw < _KEY_HALF)
    q = (feat * _KEY_STRIDE + torch.where(in_range, raw + _KEY_HALF, torch.zeros_like(raw))).contiguous()
    idx = torch.searchsorted(keys, q)
    found = idx < vocab_offsets[1:]
    hit = keys[idx.clamp(max=max(keys.numel() - 1, 0))] if keys.numel() > 0 else torch.full_like(q, -1)
    found = found & in_range & (hit == q)
    local = torch.where(found, idx - vocab_offsets[:-1] + 1, torch.zeros_like(idx))
    return offsets + local


def embedding_lookup(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
) -> Tensor:
    """``weight[hash(raw)]``: ``[B, F, D]`` in weight's dtype, one launch for all features.

    Differentiable w.r.t. ``weight`` with an ordinary dense ``[R, D]`` gradient.
    """
    return torch.ops.dlrm_kernels.embedding_lookup(raw, weight, cardinalities, offsets, vocab, vocab_offsets)[0]


def _empty_state(weight: Tensor) -> Tensor:
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
) -> None:
    """Apply one optimizer step to the rows looked up, in place, from the lookup's output gradient.

    Args:
        rows: ``[B, F]`` int64 global rows (from :func:`hash_rows`).
        grad_out: ``[B, F, D]`` gradient of the lookup output (any strides, stride 0 included).
        weight: ``[R, D]`` table, updated in place (fp32 or bf16; the arithmetic is fp32).
        state: None or empty for 'sgd'; ``[R, D]`` fp32 for 'adagrad'; ``[R]`` fp32 for
            'rowwise_adagrad' (see :func:`init_sparse_optimizer_state`). Updated in place.
        lr: one-element float32 tensor on weight's device (read in the kernel: a schedule may change it).
        optimizer: 'sgd' (w -= lr g), 'adagrad' (torch.optim.Adagrad with sparse grads, no decay),
            'rowwise_adagrad' (state[r] += mean_d g[r]^2; w[r] -= lr g[r] / (sqrt(state[r]) + eps)).
        deterministic: bitwise reproducible results (always so except 'sgd' on fp32 weights with False).

    ``g[r]`` is the sum of ``grad_out`` over every position that hashed to ``r``; each unique row is
    updated once. No host synchronisation.
    """
    if state is None:
        state = _empty_state(weight)
    torch.ops.dlrm_kernels.embedding_sparse_update_(rows, grad_out, weight, state, lr, optimizer, eps, deterministic)


def fused_embedding(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
    state: Optional[Tensor],
    lr: Tensor,
    optimizer: str = "sgd",
    eps: float = 1e-10,
    deterministic: bool = True,
    grad_trigger: Optional[Tensor] = None,
) -> Tensor:
    """Lookup ``[B, F, D]`` whose backward updates ``weight`` (and ``state``) in place.

    The backward calls :func:`embedding_sparse_update_` and returns no gradient for ``weight``, so
    ``weight.grad`` stays None (leave ``weight`` out of the dense optimizer).

    Autograd runs the backward only if ``weight`` or ``grad_trigger`` requires grad. Under
    ``torch.compile`` with torch 2.11, AOTAutograd refuses an in-place update, in the backward, of a
    graph input that requires grad ("a leaf Variable that requires grad is being used in an in-place
    operation"; torch 2.13 accepts it): there, give a ``weight`` with ``requires_grad=False`` and a
    ``grad_trigger`` that requires grad (any tensor, e.g. ``torch.zeros(0, requires_grad=True)``; it
    gets no gradient). :class:`TritonSparseEmbedding` does this in fused mode.
    """
    if state is None:
        state = _empty_state(weight)
    if grad_trigger is None:
        grad_trigger = _empty_state(weight)
    return torch.ops.dlrm_kernels.fused_embedding(
        raw, weight, cardinalities, offsets, vocab, vocab_offsets, state, lr, optimizer, eps, deterministic, grad_trigger
    )[0]


def init_sparse_optimizer_state(optimizer: str, weight: Tensor) -> Optional[Tensor]:
    """Zero optimizer state for ``weight`` [R, D]: None (sgd), [R, D] (adagrad) or [R] (rowwise) fp32."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer == "adagrad":
        return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if optimizer == "rowwise_adagrad":
        return torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    return None


@dataclass
class SparseOptimizerConfig:
    """Optimizer of the fused-update path of :class:`TritonSparseEmbedding`.

    Attributes:
        kind: 'sgd' | 'adagrad' | 'rowwise_adagrad'.
        lr: one-element float32 tensor on the embedding's device; change it in place (``lr.fill_(x)``)
            to schedule the learning rate without recompiling.
        eps: Adagrad epsilon (torch.optim.Adagrad's default 1e-10).
        state: optimizer state (see :func:`init_sparse_optimizer_state`); None lets
            ``TritonSparseEmbedding.use_fused_update`` allocate zeros. Not part of the module's state_dict:
            checkpoint it with the optimizer.
        deterministic: bitwise reproducible updates (see :func:`embedding_sparse_update_`).
    """

    kind: str
    lr: Tensor
    eps: float = 1e-10
    state: Optional[Tensor] = None
    deterministic: bool = True


class TritonSparseEmbedding(nn.Module):
    """All sparse features' embedding tables as one ``[R, D]`` weight, looked up by a Triton kernel.

    Args:
        cardinalities: rows per feature (``F`` ints). In vocabulary mode each must equal
            ``len(vocab[f]) + 1``.
        dim: embedding dim ``D``.
        vocabs: None (modulus hashing) or ``F`` 1-D int64 tensors of sorted, unique raw values (the
            eager ``SparseArch``'s argument name; ``vocab=`` is accepted as an alias).

    ``forward(raw [B, F] int64) -> [B, F, D]``. By default the ordinary differentiable lookup (dense
    gradient for ``weight``). After ``use_fused_update(config)`` the forward, while training with grad
    enabled, uses :func:`fused_embedding`: the backward applies ``config``'s optimizer to the looked-up
    rows in place and leaves ``weight.grad`` None. In that mode ``weight.requires_grad`` is False (so a
    dense optimizer skips it, and torch.compile accepts the in-place update in the backward, see
    :func:`fused_embedding`) and a private zero-size tensor that requires grad makes autograd run the
    backward. ``use_fused_update(None)`` switches back (and sets ``requires_grad`` again). The
    state_dict holds only ``weight``.
    """

    # The plain lookup's backward is an ordinary dense [R, D] gradient from a custom op (no sparse COO
    # gradient), so a training step may compile the lookup together with the rest of the model
    # (dlrm.train.step reads this flag; the eager SparseArch has sparse gradients).
    sparse_gradients = False

    def __init__(
        self,
        cardinalities: Sequence[int],
        dim: int,
        vocabs: Optional[Sequence[Tensor]] = None,
        *,
        vocab: Optional[Sequence[Tensor]] = None,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if vocab is not None:
            if vocabs is not None:
                raise ValueError("give the vocabularies once: vocabs= (vocab= is an alias)")
            vocabs = vocab
        vocab = vocabs
        cards = [int(c) for c in cardinalities]
        if not cards or min(cards) < 1:
            raise ValueError(f"cardinalities must be F >= 1 positive ints, got {cards}")
        self.cardinality_list = cards
        self.dim = int(dim)
        offs = [0]
        for c in cards[:-1]:
            offs.append(offs[-1] + c)
        self.register_buffer("cardinalities", torch.tensor(cards, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("offsets", torch.tensor(offs, dtype=torch.int64, device=device), persistent=False)
        if vocab is not None:
            if len(vocab) != len(cards):
                raise ValueError(f"vocab has {len(vocab)} features, cardinalities {len(cards)}")
            for f, (v, c) in enumerate(zip(vocab, cards)):
                v = torch.as_tensor(v)
                if v.dim() != 1 or v.numel() + 1 != c:
                    raise ValueError(f"feature {f}: cardinality {c} must be len(vocab) + 1 = {v.numel() + 1}")
                if v.numel() > 1 and not bool((v[1:] > v[:-1]).all()):
                    raise ValueError(f"feature {f}: vocabulary must be sorted ascending and unique")
            flat = torch.cat([torch.as_tensor(v, dtype=torch.int64).reshape(-1) for v in vocab]).to(device)
            voff = torch.tensor([0] + [int(torch.as_tensor(v).numel()) for v in vocab], dtype=torch.int64)
            self.register_buffer("vocab", flat, persistent=False)
            self.register_buffer("vocab_offsets", voff.cumsum(0).to(device), persistent=False)
        else:
            self.vocab = None
            self.vocab_offsets = None
        self.weight = nn.Parameter(torch.empty(sum(cards), self.dim, device=device, dtype=dtype))
        self.fused_update: Optional[SparseOptimizerConfig] = None
        # Plain attribute (not a parameter or buffer: state_dict stays {"weight"}); see use_fused_update.
        self._grad_trigger: Optional[Tensor] = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # DLRM's per-table init: U(-1/sqrt(n), 1/sqrt(n)) for a table of n rows.
        start = 0
        for c in self.cardinality_list:
            bound = 1.0 / math.sqrt(c)
            self.weight[start : start + c].uniform_(-bound, bound)
            start += c

    @property
    def num_features(self) -> int:
        return len(self.cardinality_list)

    @property
    def hashing(self) -> str:
        """'modulus' or 'vocabulary' (as the eager SparseArch)."""
        return "modulus" if self.vocab is None else "vocabulary"

    def rows(self, raw: Tensor) -> Tensor:
        """int64 [B, F] raw values -> int64 [B, F] rows of `weight` (the Triton hashing kernel)."""
        return hash_rows(raw, self.cardinalities, self.offsets, self.vocab, self.vocab_offsets)

    def use_fused_update(self, config: Optional[SparseOptimizerConfig]) -> Optional[SparseOptimizerConfig]:
        """Switch the training forward to the fused sparse-update path (None switches back).

        Allocates ``config.state`` (zeros) when it is None and the optimizer needs one; returns config.
        """
        if config is not None:
            if config.kind not in OPTIMIZERS:
                raise ValueError(f"kind must be one of {sorted(OPTIMIZERS)}, got {config.kind!r}")
            if config.state is None:
                config.state = init_sparse_optimizer_state(config.kind, self.weight)
            self.weight.requires_grad_(False)
            self._grad_trigger = self._new_trigger()
        else:
            self.weight.requires_grad_(True)
            self._grad_trigger = None
        self.fused_update = config
        return config

    def _new_trigger(self) -> Tensor:
        return torch.zeros(0, device=self.weight.device, requires_grad=True)

    def _apply(self, fn, *args, **kwargs):
        # Keep the trigger on weight's device across .to() / .cuda().
        out = super()._apply(fn, *args, **kwargs)
        if self._grad_trigger is not None:
            self._grad_trigger = self._new_trigger()
        return out

    def forward(self, raw: Tensor) -> Tensor:
        cfg = self.fused_update
        if cfg is not None and self.training and torch.is_grad_enabled():
            return fused_embedding(
                raw,
                self.weight,
                self.cardinalities,
                self.offsets,
                self.vocab,
                self.vocab_offsets,
                cfg.state,
                cfg.lr,
                cfg.kind,
                cfg.eps,
                cfg.deterministic,
                self._grad_trigger,
            )
        return embedding_lookup(raw, self.weight, self.cardinalities, self.offsets, self.vocab, self.vocab_offsets)

    def extra_repr(self) -> str:
        mode = "vocabulary" if self.vocab is not None else "modulus"
        return f"features={len(self.cardinality_list)}, rows={self.weight.shape[0]}, dim={self.dim}, hashing={mode}"
