"""Raw Criteo values to global table rows, on the device (the hashing the lookup kernel fuses).

Computes exactly what the training code's ``dlrm.model.hashing`` computes (tests compare the two):

* *modulus* mode: ``row = offsets[f] + (raw + 1) mod cardinalities[f]`` (non-negative modulo, so the
  missing value -1 lands on row ``offsets[f]``), for every int64 ``raw`` (``raw + 1`` in int64 arithmetic: 2**63 - 1
  wraps to -2**63, here as in ``dlrm.model.hashing`` and the exported program, so training and serving agree);
* *vocabulary* mode: per-feature sorted, unique vocabularies concatenated in ``vocab`` with
  ``vocab_offsets [F + 1]``; ``row = offsets[f] + (1 + i if vocab_f[i] == raw else 0)`` (local row 0 is
  the out-of-vocabulary row, missing values land there too), so ``cardinalities[f] = V_f + 1``. An
  exact per-feature binary search, for every int64 ``raw`` and vocabulary value.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._backend import check_same_device, check_triton_device, device_context
from kernels.heuristics import MAX_ROWS_PER_PROGRAM

__all__ = ["hash_rows"]


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _hash_values(
    raw,
    f,
    mask,
    card_ptr,
    off_ptr,
    vocab_ptr,
    voff_ptr,
    USE_VOCAB: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Global table rows (int64) of the int64 values ``raw`` of features ``f`` (same shape; masked lanes
    give garbage). The one hashing step of every kernel (one-hot positions, multi-hot slots)."""
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
    return _hash_values(raw, f, mask, card_ptr, off_ptr, vocab_ptr, voff_ptr, USE_VOCAB, SEARCH_STEPS)


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


# ----------------------------------------------------------------------------------------------------
# Host launchers (the lookup's launcher shares the argument checks and packing)
# ----------------------------------------------------------------------------------------------------


def search_steps(vocab: Optional[Tensor]) -> int:
    """Binary-search steps that cover any feature's vocabulary (0 in modulus mode).

    Shape-derived, so no host sync: every feature's vocabulary is at most ``vocab.numel()`` long.
    """
    return 0 if vocab is None else max(1, int(vocab.numel()).bit_length())


def check_hash_inputs(raw, cardinalities, offsets, vocab, vocab_offsets) -> None:
    """Shapes of the hashing inputs (see the module docstring) and a device Triton can run on."""
    if raw.dim() != 2:
        raise ValueError(f"raw must be [B, F], got shape {tuple(raw.shape)}")
    if raw.is_floating_point() or raw.is_complex():
        # the kernels convert what they load to int64: 1.5 hashed as 1, with no error (the eager SparseArch refuses)
        raise ValueError(f"raw must hold integers (int64 raw values), got {raw.dtype}")
    F = raw.shape[1]
    if cardinalities.shape != (F,) or offsets.shape != (F,):
        raise ValueError(f"cardinalities and offsets must be [F={F}]")
    if (vocab is None) != (vocab_offsets is None):
        raise ValueError("vocab and vocab_offsets go together")
    if vocab_offsets is not None and vocab_offsets.shape != (F + 1,):
        raise ValueError(f"vocab_offsets must be [F + 1 = {F + 1}], got {tuple(vocab_offsets.shape)}")
    # the kernels read every table on raw's device: a batch left on the CPU beside CUDA tables (or the other way
    # round) failed inside Triton naming a pointer's position, or read another GPU's memory
    check_same_device("hashed embedding kernels", raw=raw, cardinalities=cardinalities, offsets=offsets, vocab=vocab,
                      vocab_offsets=vocab_offsets)
    check_triton_device(raw.device, "hashed embedding kernels")


def hash_args(raw, cardinalities, offsets, vocab, vocab_offsets) -> tuple[tuple, bool, int]:
    """``(pointer arguments of _hash_positions, USE_VOCAB, SEARCH_STEPS)`` for a launch."""
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
    return (raw, raw.stride(0), raw.stride(1), card, off, voc, voff), use_vocab, search_steps(vocab)


def hash_rows_impl(raw, cardinalities, offsets, vocab, vocab_offsets) -> Tensor:
    """Launch the hashing kernel: ``[B, F]`` int64 rows."""
    check_hash_inputs(raw, cardinalities, offsets, vocab, vocab_offsets)
    B, F = raw.shape
    N = B * F
    rows = torch.empty((B, F), dtype=torch.int64, device=raw.device)
    if N == 0:
        return rows
    args, use_vocab, steps = hash_args(raw, cardinalities, offsets, vocab, vocab_offsets)
    BLOCK_N = MAX_ROWS_PER_PROGRAM  # one int64 per position: the widest block of the gather kernels
    _hash_rows_kernel[(triton.cdiv(N, BLOCK_N),)](
        *args, rows, N, F, USE_VOCAB=use_vocab, SEARCH_STEPS=steps, BLOCK_N=BLOCK_N
    )
    return rows


# ----------------------------------------------------------------------------------------------------
# Custom op
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::hash_rows", mutates_args=())
def _hash_rows_op(
    raw: Tensor, cardinalities: Tensor, offsets: Tensor, vocab: Optional[Tensor], vocab_offsets: Optional[Tensor]
) -> Tensor:
    with device_context(raw):
        return hash_rows_impl(raw, cardinalities, offsets, vocab, vocab_offsets)


@_hash_rows_op.register_fake
def _(raw, cardinalities, offsets, vocab, vocab_offsets):
    return raw.new_empty(raw.shape, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------
# Thin function
# ----------------------------------------------------------------------------------------------------


def hash_rows(
    raw: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
) -> Tensor:
    """Global table rows of ``raw`` [B, F] (Triton kernel): ``[B, F]`` int64.

    Args:
        raw: int64 [B, F] raw values (-1: missing, which lands on each table's row 0).
        cardinalities, offsets: int64 [F] table sizes and first rows (`kernels.table_layout.layout_tensors`).
        vocab, vocab_offsets: None for modulus mode, ``offsets[f] + (raw + 1) mod cardinalities[f]``; else
            vocabulary mode, ``vocab`` [sum V_f] int64 (each feature's segment sorted ascending and unique)
            and ``vocab_offsets`` [F + 1] int64, each feature's segment.

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> cards, offs = torch.tensor([5, 3], device=device), torch.tensor([0, 5], device=device)
        >>> raw = torch.tensor([[0, 2], [-1, 7]], device=device)   # -1: missing
        >>> hash_rows(raw, cards, offs).tolist()   # offset + (raw + 1) mod rows
        [[1, 5], [0, 7]]
        >>> vocab, vocab_offsets = torch.tensor([10, 20, 5], device=device), torch.tensor([0, 2, 3], device=device)
        >>> raw = torch.tensor([[20, 5], [7, -1]], device=device)   # feature 0's vocabulary: 10, 20; feature 1's: 5
        >>> hash_rows(raw, torch.tensor([3, 2], device=device), torch.tensor([0, 3], device=device), vocab,
        ...           vocab_offsets).tolist()   # offset + 1 + position in the vocabulary; offset: not in it
        [[2, 4], [0, 3]]
    """
    return torch.ops.dlrm_kernels.hash_rows(raw, cardinalities, offsets, vocab, vocab_offsets)
