"""Hashed embedding lookup of all sparse features in one launch: the plain op and the fused-update op.

``out[b, f, :] = weight[row(raw[b, f]), :]`` with the hashing of `kernels.embedding.hashing` fused
into the gather; the rows are written too and saved for the backward.

Output dtype: the weight's, or bf16 from fp32 tables (``out_dtype``), rounded to nearest even inside the
gather -- exactly ``weight[rows].to(torch.bfloat16)``. Under bf16 autocast the model casts the embeddings
to bf16 anyway (the interaction's input); emitting them in bf16 halves the lookup's write, the next
kernel's read, and the gradient the backward reads (which then arrives in bf16: the update converts it
to fp32 exactly, so the results are those of the fp32 output and its cast, up to the order in which the
fp32 segment sums add the same values on the GPU's tensor cores).

Backward paths:

* plain op (:func:`embedding_lookup`): an ordinary dense ``[R, D]`` gradient for ``weight`` (computed with
  the sorted segment reduction of `kernels.embedding.update`, so it is deterministic);
* fused op (:func:`fused_embedding`): the backward applies the optimizer update directly to the rows
  that were looked up (:func:`embedding_sparse_update_`) and returns no gradient for ``weight``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._backend import check_same_device, device_context
from kernels.embedding.atomic_update import hashes_in_update
from kernels.embedding.hashing import _hash_positions, check_hash_inputs, hash_args, hash_rows_impl
from kernels.embedding.rounding import _round_bf16
from kernels.embedding.update import embedding_sparse_update_, empty_state
from kernels.heuristics import lookup_launch

__all__ = ["embedding_lookup", "fused_embedding"]

# (rows per program, warps) forced on the lookup's launch, or None for `kernels.heuristics.lookup_launch`;
# module-level so that benchmarks/onehot_embedding_sweep.py can compare launches.
LOOKUP_LAUNCH_OVERRIDE: Optional[tuple[int, int]] = None


# ----------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------


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
    ROUND_OUT: tl.constexpr,
    STORE_ROWS: tl.constexpr,
):
    """out[pos, :] = weight[row(pos), :] for BLOCK_N positions; with ``STORE_ROWS`` also writes rows (saved for
    the backward).

    ``ROUND_OUT``: fp32 rows written to a bf16 ``out``, rounded to nearest even by bit arithmetic (the
    interpreter's cast truncates; this gives the GPU's and torch's rounding everywhere)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = pos < N
    rows = _hash_positions(
        raw_ptr, stride_rb, stride_rf, card_ptr, off_ptr, vocab_ptr, voff_ptr, pos, mask, F, USE_VOCAB, SEARCH_STEPS
    )
    if STORE_ROWS:
        tl.store(rows_ptr + pos, rows, mask=mask)
    d = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (d < D)[None, :]
    vals = tl.load(w_ptr + rows[:, None] * stride_wr + d[None, :] * stride_wd, mask=m2, other=0.0)
    if ROUND_OUT:
        vals = _round_bf16(vals, w_ptr, rows[:, None], d[None, :], D, False)
    tl.store(out_ptr + pos[:, None] * D + d[None, :], vals.to(out_ptr.dtype.element_ty), mask=m2)



# ----------------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------------


def output_dtype(weight: Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The lookup's output dtype: ``out_dtype`` if given (the weight's, or bf16 from fp32 weights), else the
    weight's."""
    if out_dtype is None or out_dtype == weight.dtype:
        return weight.dtype
    if out_dtype == torch.bfloat16 and weight.dtype == torch.float32:
        return out_dtype
    raise ValueError(f"out_dtype must be the weight's dtype ({weight.dtype}) or bfloat16 from float32 weights, "
                     f"got {out_dtype}")


def lookup_impl(raw, weight, cardinalities, offsets, vocab, vocab_offsets,
                out_dtype: Optional[torch.dtype] = None, store_rows: bool = True) -> tuple[Tensor, Tensor]:
    """Launch the lookup: ``(out [B, F, D] in `output_dtype`, rows [B, F] int64)``; without ``store_rows`` the
    rows are not written and an empty [0] tensor stands for them."""
    check_hash_inputs(raw, cardinalities, offsets, vocab, vocab_offsets)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [R, D], got shape {tuple(weight.shape)}")
    check_same_device("the embedding lookup", raw=raw, weight=weight)  # (the tables: `check_hash_inputs`)
    B, F = raw.shape
    D = weight.shape[1]
    N = B * F
    dtype = output_dtype(weight, out_dtype)
    out = torch.empty((B, F, D), dtype=dtype, device=weight.device)
    rows = torch.empty((B, F) if store_rows else (0,), dtype=torch.int64, device=weight.device)
    if N == 0 or D == 0:
        return out, rows if N == 0 or not store_rows else hash_rows_impl(raw, cardinalities, offsets, vocab,
                                                                         vocab_offsets)
    args, use_vocab, steps = hash_args(raw, cardinalities, offsets, vocab, vocab_offsets)
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_N, warps = LOOKUP_LAUNCH_OVERRIDE or lookup_launch(BLOCK_D)
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
        ROUND_OUT=dtype != weight.dtype,
        STORE_ROWS=store_rows,
        num_warps=warps,
    )
    return out, rows


# ----------------------------------------------------------------------------------------------------
# Custom ops: the plain lookup (dense backward) and the lookup whose backward updates in place
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::embedding_lookup", mutates_args=())
def _embedding_lookup_op(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor]:
    """Returns ``(out [B, F, D] in `output_dtype`, rows [B, F] int64)``; rows are saved for backward."""
    with device_context(weight):
        return lookup_impl(raw, weight, cardinalities, offsets, vocab, vocab_offsets, out_dtype)


def _lookup_fake(raw, weight, cardinalities, offsets, vocab, vocab_offsets, out_dtype=None, store_rows=True):
    B, F = raw.shape
    out = weight.new_empty((B, F, weight.shape[1]), dtype=output_dtype(weight, out_dtype))
    return out, raw.new_empty((B, F) if store_rows else (0,), dtype=torch.int64)


_embedding_lookup_op.register_fake(_lookup_fake)


def _lookup_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.num_rows = inputs[1].shape[0]
    ctx.weight_dtype = inputs[1].dtype
    ctx.mark_non_differentiable(output[1])


def _lookup_backward(ctx, grad_out, _grad_rows):
    (rows,) = ctx.saved_tensors
    grad_w = None
    if ctx.needs_input_grad[1]:
        # in the weight's dtype (a bf16 output's gradient is summed in fp32 into an fp32 gradient)
        grad_w = torch.ops.dlrm_kernels.embedding_dense_grad(rows, grad_out, ctx.num_rows, ctx.weight_dtype)
    return None, grad_w, None, None, None, None, None


_embedding_lookup_op.register_autograd(_lookup_backward, setup_context=_lookup_setup_context)


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
    weight_decay: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    sr_seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Forward = lookup; backward applies the sparse optimizer update in place (see fused_embedding). Where the
    backward hashes the raw values again (`hashes_in_update`), no rows are written: an empty [0] tensor."""
    with device_context(weight):
        return lookup_impl(raw, weight, cardinalities, offsets, vocab, vocab_offsets, out_dtype,
                           not hashes_in_update(weight, vocab, optimizer, deterministic, weight_decay))


@_fused_embedding_op.register_fake
def _(raw, weight, cardinalities, offsets, vocab, vocab_offsets, state, lr, optimizer, eps, deterministic, grad_trigger,
      weight_decay=0.0, out_dtype=None, sr_seed=None):
    return _lookup_fake(raw, weight, cardinalities, offsets, vocab, vocab_offsets, out_dtype,
                        not hashes_in_update(weight, vocab, optimizer, deterministic, weight_decay))


def _fused_setup_context(ctx, inputs, output):
    (raw, weight, card, off, vocab, _voff, state, lr, optimizer, eps, deterministic, _trigger, weight_decay, _,
     sr_seed) = inputs
    ctx.rehash = hashes_in_update(weight, vocab, optimizer, deterministic, weight_decay)
    ctx.save_for_backward(*((raw, card, off) if ctx.rehash else (output[1],)))
    ctx.mark_non_differentiable(output[1])
    # Held as plain attributes, not saved tensors: the backward mutates them, and they must be the very
    # tensors the caller owns (the parameter and the optimizer state), not saved copies/versions.
    ctx.weight, ctx.state, ctx.lr, ctx.sr_seed = weight, state, lr, sr_seed
    ctx.optimizer, ctx.eps, ctx.deterministic, ctx.weight_decay = optimizer, eps, deterministic, weight_decay


def _fused_backward(ctx, grad_out, _grad_rows):
    if ctx.rehash:  # the atomic SGD update on the raw values (no rows were written)
        raw, card, off = ctx.saved_tensors
        torch.ops.dlrm_kernels.embedding_sgd_atomic_hashed_(raw, card, off, grad_out, ctx.weight, ctx.lr)
        return (None,) * 15
    (rows,) = ctx.saved_tensors
    embedding_sparse_update_(rows, grad_out, ctx.weight, ctx.state, ctx.lr, ctx.optimizer, ctx.eps, ctx.deterministic,
                             ctx.weight_decay, ctx.sr_seed)
    # No gradient for weight (the update has been applied: weight.grad stays None) nor the trigger.
    return (None,) * 15


_fused_embedding_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)


# ----------------------------------------------------------------------------------------------------
# Thin functions
# ----------------------------------------------------------------------------------------------------


def embedding_lookup(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``weight[hash(raw)]``: ``[B, F, D]`` in weight's dtype (or ``out_dtype``: bf16 from fp32 weights,
    rounded to nearest even), one launch for all features.

    Differentiable w.r.t. ``weight`` with an ordinary dense ``[R, D]`` gradient (in weight's dtype).

    Args:
        raw: int64 [B, F] raw values.
        weight: [R, D], every feature's table (fp32 or bf16).
        cardinalities, offsets, vocab, vocab_offsets: the hashing, as :func:`kernels.embedding.hash_rows`'.
        out_dtype: None or the weight's dtype, or bf16 from fp32 weights (ValueError otherwise).

    Example (on the CPU the kernel runs in Triton's interpreter, TRITON_INTERPRET=1):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> weight = torch.arange(16.0, device=device).reshape(8, 2).requires_grad_()   # R = 8 rows, D = 2
        >>> cards, offs = torch.tensor([5, 3], device=device), torch.tensor([0, 5], device=device)
        >>> out = embedding_lookup(torch.tensor([[0, 2], [-1, 7]], device=device), weight, cards, offs)
        >>> out.shape, torch.equal(out, weight[torch.tensor([[1, 5], [0, 7]], device=device)])   # rows as hash_rows
        (torch.Size([2, 2, 2]), True)
        >>> out.sum().backward()
        >>> weight.grad[:, 0].tolist()   # dense [R, D] gradient: one per lookup of each row
        [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    """
    return torch.ops.dlrm_kernels.embedding_lookup(raw, weight, cardinalities, offsets, vocab, vocab_offsets,
                                                   out_dtype)[0]


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
    weight_decay: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    sr_seed: Optional[Tensor] = None,
) -> Tensor:
    """Lookup ``[B, F, D]`` whose backward updates ``weight`` (and ``state``) in place.

    The backward calls :func:`embedding_sparse_update_` and returns no gradient for ``weight``, so
    ``weight.grad`` stays None (leave ``weight`` out of the dense optimizer).

    Autograd runs the backward only if ``weight`` or ``grad_trigger`` requires grad. Under
    ``torch.compile`` with torch 2.11, AOTAutograd refuses an in-place update, in the backward, of a
    graph input that requires grad ("a leaf Variable that requires grad is being used in an in-place
    operation"; torch 2.13 accepts it): there, give a ``weight`` with ``requires_grad=False`` and a
    ``grad_trigger`` that requires grad (any tensor, e.g. ``torch.zeros(0, requires_grad=True)``; it
    gets no gradient). :class:`TritonSparseEmbedding` does this in fused mode. ``weight_decay``: lazy L2
    on the rows looked up (see :func:`embedding_sparse_update_`). ``out_dtype``: as for
    :func:`embedding_lookup` (a bf16 output's gradient is converted to fp32 exactly in the update).
    ``sr_seed``: bf16 weights are rounded stochastically with it (and it advances), see
    :func:`embedding_sparse_update_`.
    """
    if state is None:
        state = empty_state(weight)
    if grad_trigger is None:
        grad_trigger = empty_state(weight)
    return torch.ops.dlrm_kernels.fused_embedding(
        raw, weight, cardinalities, offsets, vocab, vocab_offsets, state, lr, optimizer, eps, deterministic, grad_trigger,
        weight_decay, out_dtype, sr_seed,
    )[0]
