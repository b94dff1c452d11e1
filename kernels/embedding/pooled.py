"""Pooled (multi-hot) hashed embedding lookup of all sparse features in one launch, with a fused
sparse optimizer backward.

Notation: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``hotness [F]`` slots per feature,
``L = sum(hotness)`` slots per sample, ``R = sum(cardinalities)`` rows of the single concatenated table.

Multi-hot contract (the one-hot contract of `kernels.embedding`, widened):

* per feature f a fixed number of slots ``hotness[f] >= 1``; ``slot_offsets`` = exclusive cumsum of
  ``hotness``; ``slot_feature [L]`` = the feature of each slot (:func:`pooled_layout` builds the three);
* input ``raw [B, L]`` int64 (any strides): feature f's values are the columns
  ``slot_offsets[f] : slot_offsets[f] + hotness[f]``;
* ``PAD_SPARSE = -2`` marks an empty slot (a variable-length feature padded to ``hotness[f]``): it adds
  nothing to the sum and receives no update. Every other value, missing (-1) included, is hashed as in
  the one-hot lookup (`kernels.embedding.hashing`: modulus or vocabulary mode);
* forward: sum pooling, ``out[b, f] = sum_{s in f, raw[b, s] != PAD} weight[row(raw[b, s])]``, ``[B, F, D]``
  in the weight's dtype (fp32 accumulation; a feature whose slots are all PAD gives zeros), all
  features in one launch, hashing inside the kernel. The rows ``[B, L]`` int64 are written too (PAD
  slots get row ``R``, one past the last: "no row") and saved for the backward; the fused op keeps them as
  int32 where every row fits (`fused_rows_dtype`);
* backward: the gradient of slot s of sample b is ``grad_out[b, slot_feature[s]]``. Plain op
  (:func:`pooled_embedding_lookup`): a dense ``[R, D]`` gradient. Fused op (:func:`fused_pooled_embedding`):
  every row hit in the batch (any samples, any slots) gets the *sum* of its slots' gradients and then
  exactly one optimizer step, in place, with the semantics of the one-hot update
  (:func:`kernels.embedding.embedding_sparse_update_`: sgd / adagrad / rowwise_adagrad, lazy
  weight_decay added once per touched row before the rule). Deterministic (sorted segments, bitwise
  reproducible) or, for sgd on fp32 tables without decay, atomics (``deterministic=False``);
* tables in fp32 or bf16. The update math is fp32; bf16 results are written back with stochastic
  rounding (unbiased; counter-based random bits, `kernels.embedding.rounding`, keyed by a one-element
  int64 seed tensor on the device, which the update advances in place after each call: no host sync,
  and a replayed CUDA graph draws new numbers). ``stochastic_rounding=False`` rounds to nearest. Optimizer state is fp32.

With every ``hotness[f] == 1`` (and no PAD) all of this is the one-hot lookup and update, number for
number (the same sorted-segment kernels, which take a slot-to-feature indirection here).

Kernels here: the lookup forward (``_pooled_fwd_kernel``, which is also the rows-only hashing kernel);
the backward reuses `kernels.embedding.update`'s sorted segment kernels (``slot_feature`` indirection,
rows ``>= R`` skipped, optional stochastic rounding). Custom ops: ``dlrm_kernels::pooled_hash_rows``,
``dlrm_kernels::pooled_embedding_lookup`` (+ ``dlrm_kernels::pooled_embedding_dense_grad``),
``dlrm_kernels::fused_pooled_embedding`` and ``dlrm_kernels::pooled_embedding_sparse_update_``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
from torch import Tensor

from kernels._backend import check_gemm_dtype, check_same_device, check_triton_device, device_context
from kernels.embedding.hashing import hash_args
from kernels.embedding.pooled_fwd import _pooled_fwd_kernel
from kernels.embedding.update import dense_grad_impl, empty_state, sparse_update_impl
from kernels.heuristics import MAX_ROWS_PER_PROGRAM, pooled_lookup_launch

__all__ = [
    "PAD_SPARSE",
    "PooledLayout",
    "fused_pooled_embedding",
    "pooled_embedding_lookup",
    "pooled_embedding_sparse_update_",
    "pooled_hash_rows",
    "pooled_layout",
]

PAD_SPARSE = -2  # an empty multi-hot slot (missing values are -1 and hash to a row like any other)
# (samples per program, warps, slots a loop step[, register cap]) forced on the lookup's launch, or None for
# `kernels.heuristics.pooled_lookup_launch`; module-level so that benchmarks/pooled_embedding.py --lookup-launches
# can compare them.
POOLED_LOOKUP_OVERRIDE: Optional[tuple[int, ...]] = None

# The forward's Triton kernel: kernels/embedding/pooled_fwd.py.


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def _check_pooled_inputs(raw, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab,
                         vocab_offsets) -> None:
    """Shapes of the lookup's inputs (see the module docstring) and a device Triton can run on.

    The values of the layout tensors are not checked (that would sync with the host): build them with
    :func:`pooled_layout`.
    """
    if raw.dim() != 2:
        raise ValueError(f"raw must be [B, L], got shape {tuple(raw.shape)}")
    if raw.is_floating_point() or raw.is_complex():
        # as the one-hot lookup (`kernels.embedding.hashing.check_hash_inputs`): the kernel converts what it loads
        # to int64, so 1.5 was hashed as 1 and 2.7 as 2 with no error (the eager PooledSparseArch refuses them)
        raise ValueError(f"raw must hold integers (int64 raw values), got {raw.dtype}")
    F = hotness.shape[0] if hotness.dim() == 1 else -1
    if F < 1 or slot_offsets.shape != (F,):
        raise ValueError(f"hotness and slot_offsets must be [F] with F >= 1, got {tuple(hotness.shape)}, "
                         f"{tuple(slot_offsets.shape)}")
    if slot_feature.shape != (raw.shape[1],):
        raise ValueError(f"raw has {raw.shape[1]} slots, the layout's slot_feature {tuple(slot_feature.shape)}")
    if cardinalities.shape != (F,) or offsets.shape != (F,):
        raise ValueError(f"cardinalities and offsets must be [F={F}]")
    if (vocab is None) != (vocab_offsets is None):
        raise ValueError("vocab and vocab_offsets go together")
    if vocab_offsets is not None and vocab_offsets.shape != (F + 1,):
        raise ValueError(f"vocab_offsets must be [F + 1 = {F + 1}], got {tuple(vocab_offsets.shape)}")
    check_same_device("pooled embedding kernels", raw=raw, cardinalities=cardinalities, offsets=offsets, hotness=hotness,
                      slot_offsets=slot_offsets, slot_feature=slot_feature, vocab=vocab, vocab_offsets=vocab_offsets)
    check_triton_device(raw.device, "pooled embedding kernels")


def fused_rows_dtype(num_rows: int) -> torch.dtype:
    """The dtype of the rows the fused op saves for its backward: int32 where every row and the PAD row
    ``R`` fit. The update sorts int32 keys anyway (`kernels.embedding.update._sort_by_row`), so int64 rows
    cost a conversion kernel and twice the bytes: at MLPerf DLRM-DCNv2's batch 65536 (14M rows) a 112 MB
    write, read and 56 MB written again, ~0.06 ms of the step on an H100
    (results/step_profile_mlperf_b65536_twentyfirst.md, the ``direct_copy`` kernel)."""
    return torch.int32 if num_rows < 2**31 - 1 else torch.int64


def pooled_lookup_impl(raw, weight, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab, vocab_offsets,
                       lookup: bool = True, prefix: Optional[Tensor] = None,
                       rows_dtype: torch.dtype = torch.int64) -> tuple[Optional[Tensor], Tensor]:
    """Launch the forward: ``(out [B, F, D] in weight's dtype, rows [B, L] rows_dtype)``; ``lookup=False``
    hashes only (``out`` None, ``weight`` only gives R). With ``prefix`` [B, D] (weight's dtype), ``out`` is
    [B, 1 + F, D] with ``prefix`` as slot 0: the concatenation a DCN interaction takes, written in place of a
    separate copy of the pooled rows. ``rows_dtype`` int32 needs ``R < 2**31 - 1``."""
    _check_pooled_inputs(raw, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab, vocab_offsets)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [R, D], got shape {tuple(weight.shape)}")
    check_same_device("the pooled lookup", raw=raw, weight=weight, prefix=prefix)  # (read on raw's device)
    if lookup:  # the slots are summed in fp32: a float64 table's sums came back fp32-rounded (3.9 off at 1e9)
        check_gemm_dtype(weight.dtype, "the pooled lookup kernels", 'kernels.embedding "torch"')
    B, L = raw.shape
    F = hotness.shape[0]
    R, D = weight.shape
    P = 0 if prefix is None else 1
    if prefix is not None and (prefix.shape != (B, D) or prefix.dtype != weight.dtype):
        raise ValueError(f"prefix must be [B={B}, D={D}] in weight's dtype {weight.dtype}, got "
                         f"{tuple(prefix.shape)} {prefix.dtype}")
    full = torch.empty((B, P + F, D), dtype=weight.dtype, device=weight.device) if lookup else None
    out = full[:, P:] if lookup else None
    if prefix is not None and lookup:
        full[:, 0].copy_(prefix)
    if rows_dtype != torch.int64 and not (rows_dtype == torch.int32 and R < 2**31 - 1):
        raise ValueError(f"rows_dtype {rows_dtype} cannot hold the rows of a table of {R} rows")
    rows = torch.empty((B, L), dtype=rows_dtype, device=raw.device)
    if B == 0:
        return full, rows
    if D == 0 and lookup:
        return full, pooled_lookup_impl(raw, weight, cardinalities, offsets, hotness, slot_offsets, slot_feature,
                                        vocab, vocab_offsets, lookup=False, rows_dtype=rows_dtype)[1]
    args, use_vocab, steps = hash_args(raw, cardinalities, offsets, vocab, vocab_offsets)
    BLOCK_D = triton.next_power_of_2(max(D, 1))
    launch = (POOLED_LOOKUP_OVERRIDE or pooled_lookup_launch(BLOCK_D)) if lookup else (MAX_ROWS_PER_PROGRAM, 4, 1)
    BLOCK_B, warps, unroll = launch[:3]
    maxnreg = launch[3] if len(launch) > 3 else None  # a register cap (Triton's maxnreg), where the launch names one
    _pooled_fwd_kernel[(triton.cdiv(B, BLOCK_B), F)](
        *args,
        hotness.to(torch.int64).contiguous(),
        slot_offsets.to(torch.int64).contiguous(),
        weight if lookup else rows,  # hashing only: the [R, 0] stand-in has no storage; never read
        weight.stride(0),
        weight.stride(1),
        rows if out is None else out,  # never written without LOOKUP
        (P + F) * D,
        rows,
        B,
        L,
        F,
        D,
        R,
        PAD=PAD_SPARSE,
        USE_VOCAB=use_vocab,
        SEARCH_STEPS=steps,
        LOOKUP=lookup,
        BLOCK_B=BLOCK_B,
        BLOCK_D=BLOCK_D,
        UNROLL=unroll,
        num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return full, rows


def _bf16_rounding(weight: Tensor, stochastic_rounding: bool) -> Optional[str]:
    """How the update rounds new weights: bf16 tables stochastically or to nearest even (by bit
    arithmetic, the same on GPUs and in the interpreter); other dtypes by the plain cast (fp32 needs no
    rounding, fp16 rounds to nearest)."""
    if weight.dtype != torch.bfloat16:
        return None
    return "stochastic" if stochastic_rounding else "nearest"


def pooled_update_impl(rows, grad_out, slot_feature, weight, state, lr, optimizer, eps, deterministic, weight_decay,
                       sr_seed, stochastic_rounding, presorted=None) -> None:
    """Check the inputs, apply one optimizer step to the rows hit (in place) and advance ``sr_seed``.
    ``presorted``: `kernels.embedding.update.sort_by_row` of ``rows``, run earlier by the caller."""
    rounding = _bf16_rounding(weight, stochastic_rounding)
    sr = rounding == "stochastic"
    if sr and (sr_seed.numel() != 1 or sr_seed.dtype != torch.int64 or sr_seed.device != weight.device):
        raise ValueError("stochastic rounding of a bf16 table needs sr_seed: a one-element int64 tensor on "
                         "weight's device (or stochastic_rounding=False)")
    sparse_update_impl(rows, grad_out, weight, state, lr, optimizer, eps, deterministic, weight_decay,
                       slot_feature=slot_feature, bf16_rounding=rounding, sr_seed=sr_seed if sr else None,
                       presorted=presorted)
    if sr and rows.numel() > 0 and weight.shape[1] > 0:
        sr_seed.add_(1)  # on the device: the next call (or graph replay) draws new random bits


# ----------------------------------------------------------------------------------------------------
# Custom ops: hashing, the plain lookup (dense backward), the update, the lookup that updates in backward
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_kernels::pooled_hash_rows", mutates_args=())
def _pooled_hash_rows_op(
    raw: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    hotness: Tensor,
    slot_offsets: Tensor,
    slot_feature: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
    num_rows: int,
) -> Tensor:
    with device_context(raw):
        # A [num_rows, 0] stand-in for the weight: the kernel needs R only.
        R = raw.new_empty((num_rows, 0), dtype=torch.float32)
        return pooled_lookup_impl(raw, R, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab,
                                  vocab_offsets, lookup=False)[1]


@_pooled_hash_rows_op.register_fake
def _(raw, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab, vocab_offsets, num_rows):
    return raw.new_empty(raw.shape, dtype=torch.int64)


@torch.library.custom_op("dlrm_kernels::pooled_embedding_dense_grad", mutates_args=())
def _pooled_dense_grad_op(rows: Tensor, grad_out: Tensor, slot_feature: Tensor, num_rows: int) -> Tensor:
    """Dense ``[num_rows, D]`` gradient of the pooled lookup (the plain op's backward), deterministic."""
    with device_context(grad_out):
        return dense_grad_impl(rows, grad_out, num_rows, slot_feature)


@_pooled_dense_grad_op.register_fake
def _(rows, grad_out, slot_feature, num_rows):
    return grad_out.new_empty((num_rows, grad_out.shape[2]))


@torch.library.custom_op("dlrm_kernels::pooled_embedding_lookup", mutates_args=())
def _pooled_lookup_op(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    hotness: Tensor,
    slot_offsets: Tensor,
    slot_feature: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Returns ``(out [B, F, D] in weight's dtype, rows [B, L] int64)``; rows are saved for backward."""
    with device_context(weight):
        return pooled_lookup_impl(raw, weight, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab,
                                  vocab_offsets)


def _pooled_lookup_fake(raw, weight, cardinalities, offsets, hotness, *_):
    B, L = raw.shape
    return weight.new_empty((B, hotness.shape[0], weight.shape[1])), raw.new_empty((B, L), dtype=torch.int64)


_pooled_lookup_op.register_fake(_pooled_lookup_fake)


def _pooled_lookup_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[6])
    ctx.num_rows = inputs[1].shape[0]
    ctx.mark_non_differentiable(output[1])


def _pooled_lookup_backward(ctx, grad_out, _grad_rows):
    rows, slot_feature = ctx.saved_tensors
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = torch.ops.dlrm_kernels.pooled_embedding_dense_grad(rows, grad_out, slot_feature, ctx.num_rows)
    return (None, grad_w) + (None,) * 7


_pooled_lookup_op.register_autograd(_pooled_lookup_backward, setup_context=_pooled_lookup_setup_context)


@torch.library.custom_op("dlrm_kernels::pooled_embedding_sparse_update_", mutates_args=("weight", "state", "sr_seed"))
def _pooled_update_op(
    rows: Tensor,
    grad_out: Tensor,
    slot_feature: Tensor,
    weight: Tensor,
    state: Tensor,
    lr: Tensor,
    optimizer: str,
    eps: float,
    deterministic: bool,
    weight_decay: float,
    sr_seed: Tensor,
    stochastic_rounding: bool,
) -> None:
    with device_context(weight):
        pooled_update_impl(rows, grad_out, slot_feature, weight, state, lr, optimizer, eps, deterministic,
                           weight_decay, sr_seed, stochastic_rounding)


@_pooled_update_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("dlrm_kernels::fused_pooled_embedding", mutates_args=())
def _fused_pooled_op(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    hotness: Tensor,
    slot_offsets: Tensor,
    slot_feature: Tensor,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
    state: Tensor,
    lr: Tensor,
    optimizer: str,
    eps: float,
    deterministic: bool,
    grad_trigger: Tensor,
    weight_decay: float,
    sr_seed: Tensor,
    stochastic_rounding: bool,
    prefix: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Forward = pooled lookup (after ``prefix`` as slot 0, if given); backward applies the sparse optimizer in
    place (see fused_pooled_embedding) and returns ``prefix``'s gradient."""
    with device_context(weight):
        return pooled_lookup_impl(raw, weight, cardinalities, offsets, hotness, slot_offsets, slot_feature, vocab,
                                  vocab_offsets, prefix=prefix, rows_dtype=fused_rows_dtype(weight.shape[0]))


def _fused_pooled_fake(raw, weight, cardinalities, offsets, hotness, *args):
    out, _ = _pooled_lookup_fake(raw, weight, cardinalities, offsets, hotness)
    if args[-1] is not None:  # prefix: one more slot
        out = weight.new_empty((raw.shape[0], 1 + hotness.shape[0], weight.shape[1]))
    return out, raw.new_empty(tuple(raw.shape), dtype=fused_rows_dtype(weight.shape[0]))


_fused_pooled_op.register_fake(_fused_pooled_fake)


def _fused_pooled_setup_context(ctx, inputs, output):
    (_raw, weight, _card, _off, _hot, _soff, slot_feature, _voc, _voff, state, lr, optimizer, eps, deterministic,
     _trigger, weight_decay, sr_seed, stochastic_rounding, prefix) = inputs
    ctx.prefix_slots = 0 if prefix is None else 1
    ctx.save_for_backward(output[1], slot_feature)
    ctx.mark_non_differentiable(output[1])
    # Plain attributes, not saved tensors: the backward mutates them, and they must be the very tensors
    # the caller owns (parameter, optimizer state, seed), not saved copies/versions.
    ctx.weight, ctx.state, ctx.lr, ctx.sr_seed = weight, state, lr, sr_seed
    ctx.optimizer, ctx.eps, ctx.deterministic, ctx.weight_decay = optimizer, eps, deterministic, weight_decay
    ctx.stochastic_rounding = stochastic_rounding


def _fused_pooled_backward(ctx, grad_out, _grad_rows):
    rows, slot_feature = ctx.saved_tensors
    P = ctx.prefix_slots
    # the pooled slots' gradient as a view: the update kernels take its strides
    torch.ops.dlrm_kernels.pooled_embedding_sparse_update_(
        rows, grad_out[:, P:], slot_feature, ctx.weight, ctx.state, ctx.lr, ctx.optimizer, ctx.eps, ctx.deterministic,
        ctx.weight_decay, ctx.sr_seed, ctx.stochastic_rounding,
    )
    grad_prefix = grad_out[:, 0] if P and ctx.needs_input_grad[18] else None
    # no gradient for weight (updated in place: weight.grad stays None) nor the trigger
    return (None,) * 18 + (grad_prefix,)


_fused_pooled_op.register_autograd(_fused_pooled_backward, setup_context=_fused_pooled_setup_context)


# ----------------------------------------------------------------------------------------------------
# Thin functions
# ----------------------------------------------------------------------------------------------------


class PooledLayout(NamedTuple):
    """The slot layout of the multi-hot input, as int64 device tensors (built by :func:`pooled_layout`).

    Attributes:
        hotness: ``[F]`` slots per feature (each >= 1).
        slot_offsets: ``[F]`` first slot (column of ``raw``) of each feature: exclusive cumsum of hotness.
        slot_feature: ``[L]`` feature of each slot.
    """

    hotness: Tensor
    slot_offsets: Tensor
    slot_feature: Tensor

    @property
    def num_slots(self) -> int:
        """``L``: columns of ``raw``."""
        return self.slot_feature.shape[0]


def pooled_layout(hotness: Sequence[int], device: Optional[torch.device | str] = None) -> PooledLayout:
    """The layout tensors of ``hotness`` (F ints >= 1) on ``device`` (None: torch's default device).

    Build it once (it copies from the host) and pass it to every call.

    >>> pooled_layout([3, 1, 2])
    PooledLayout(hotness=tensor([3, 1, 2]), slot_offsets=tensor([0, 3, 4]), slot_feature=tensor([0, 0, 0, 1, 2, 2]))
    """
    hot = [int(h) for h in hotness]
    if not hot or min(hot) < 1:
        raise ValueError(f"hotness must be F >= 1 ints >= 1, got {hot}")
    offsets, feature = [], []
    for f, h in enumerate(hot):
        offsets.append(len(feature))
        feature.extend([f] * h)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return PooledLayout(as_t(hot), as_t(offsets), as_t(feature))


def pooled_hash_rows(
    raw: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    layout: PooledLayout,
    num_rows: int,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
) -> Tensor:
    """Global table rows of the multi-hot ``raw`` [B, L] (Triton kernel): ``[B, L]`` int64.

    Hashing as :func:`kernels.embedding.hash_rows`, feature by feature of ``layout``; PAD slots
    (``PAD_SPARSE``) get ``num_rows`` (R: no row).

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> layout = pooled_layout([2, 1], device)
    >>> cards, offs = torch.tensor([5, 3], device=device), torch.tensor([0, 5], device=device)
    >>> pooled_hash_rows(torch.tensor([[-1, PAD_SPARSE, 7]], device=device), cards, offs, layout, 8).tolist()
    [[0, 8, 7]]
    """
    return torch.ops.dlrm_kernels.pooled_hash_rows(
        raw, cardinalities, offsets, *layout, vocab, vocab_offsets, num_rows
    )


def pooled_embedding_lookup(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    layout: PooledLayout,
    vocab: Optional[Tensor] = None,
    vocab_offsets: Optional[Tensor] = None,
) -> Tensor:
    """Sum-pooled ``weight[hash(raw)]`` per feature: ``[B, F, D]`` in weight's dtype, one launch.

    Args:
        raw: ``[B, L]`` int64 multi-hot values (``PAD_SPARSE`` = empty slot), any strides.
        weight: ``[R, D]`` fp32 or bf16 table (fp32 accumulation).
        cardinalities, offsets: ``[F]`` int64 table layout (`kernels.table_layout.layout_tensors`).
        layout: :func:`pooled_layout` of the hotness.
        vocab, vocab_offsets: vocabulary mode (see :func:`kernels.embedding.hash_rows`), else None.

    Differentiable w.r.t. ``weight`` with an ordinary dense ``[R, D]`` gradient (deterministic).

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> weight = torch.arange(16.0, device=device).reshape(8, 2)
    >>> cards, offs = torch.tensor([5, 3], device=device), torch.tensor([0, 5], device=device)
    >>> raw = torch.tensor([[0, 2, 1], [3, PAD_SPARSE, -1]], device=device)  # feature 0: 2 slots
    >>> pooled_embedding_lookup(raw, weight, cards, offs, pooled_layout([2, 1], device)).tolist()
    [[[8.0, 10.0], [14.0, 15.0]], [[8.0, 9.0], [10.0, 11.0]]]
    """
    return torch.ops.dlrm_kernels.pooled_embedding_lookup(
        raw, weight, cardinalities, offsets, *layout, vocab, vocab_offsets
    )[0]


def pooled_embedding_sparse_update_(
    rows: Tensor,
    grad_out: Tensor,
    layout: PooledLayout,
    weight: Tensor,
    state: Optional[Tensor],
    lr: Tensor,
    optimizer: str = "sgd",
    eps: float = 1e-10,
    deterministic: bool = True,
    weight_decay: float = 0.0,
    sr_seed: Optional[Tensor] = None,
    stochastic_rounding: bool = True,
) -> None:
    """One optimizer step on the rows a pooled lookup hit, in place, from its output gradient.

    Args:
        rows: ``[B, L]`` int64 rows of the lookup (:func:`pooled_hash_rows`; rows ``>= R`` are skipped).
        grad_out: ``[B, F, D]`` gradient of the lookup output (any strides); slot s gets
            ``grad_out[:, slot_feature[s]]``.
        layout: :func:`pooled_layout` of the hotness.
        weight, state, lr, optimizer, eps, deterministic, weight_decay: as
            :func:`kernels.embedding.embedding_sparse_update_` (each row hit gets the sum of its slots'
            gradients and one step).
        sr_seed: one-element int64 tensor on weight's device; needed for bf16 tables with
            ``stochastic_rounding`` (and advanced by one per call), ignored otherwise.
        stochastic_rounding: bf16 tables: round the new weights stochastically (else to nearest).
    """
    if state is None:
        state = empty_state(weight)
    if sr_seed is None:
        sr_seed = torch.empty(0, dtype=torch.int64, device=weight.device)
    torch.ops.dlrm_kernels.pooled_embedding_sparse_update_(
        rows, grad_out, layout.slot_feature, weight, state, lr, optimizer, eps, deterministic, weight_decay, sr_seed,
        stochastic_rounding,
    )


def fused_pooled_embedding(
    raw: Tensor,
    weight: Tensor,
    cardinalities: Tensor,
    offsets: Tensor,
    layout: PooledLayout,
    vocab: Optional[Tensor],
    vocab_offsets: Optional[Tensor],
    state: Optional[Tensor],
    lr: Tensor,
    optimizer: str = "sgd",
    eps: float = 1e-10,
    deterministic: bool = True,
    grad_trigger: Optional[Tensor] = None,
    weight_decay: float = 0.0,
    sr_seed: Optional[Tensor] = None,
    stochastic_rounding: bool = True,
    prefix: Optional[Tensor] = None,
) -> Tensor:
    """Pooled lookup ``[B, F, D]`` whose backward updates ``weight`` (and ``state``, ``sr_seed``) in place.

    With ``prefix`` [B, D] (weight's dtype, may require grad): ``[B, 1 + F, D]``, ``prefix`` as slot 0, the
    concatenation a DCN interaction takes (one pass less than concatenating afterwards), and the backward returns
    ``prefix``'s gradient.

    Arguments as :func:`pooled_embedding_lookup` and :func:`pooled_embedding_sparse_update_`;
    ``grad_trigger`` as :func:`kernels.embedding.fused_embedding` (a frozen ``weight`` plus a zero-size
    tensor that requires grad makes autograd run the backward, also under torch.compile). The backward
    returns no gradient for ``weight``: ``weight.grad`` stays None.

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> weight = torch.zeros(8, 2, device=device)
    >>> cards, offs = torch.tensor([5, 3], device=device), torch.tensor([0, 5], device=device)
    >>> raw = torch.tensor([[0, 0, 1], [0, PAD_SPARSE, -1]], device=device)  # row 1 hit three times
    >>> trigger = torch.zeros(0, device=device, requires_grad=True)
    >>> lr = torch.tensor(0.5, device=device)
    >>> out = fused_pooled_embedding(raw, weight, cards, offs, pooled_layout([2, 1], device), None, None,
    ...                              None, lr, "sgd", grad_trigger=trigger)
    >>> out.sum().backward()
    >>> weight[:, 0].tolist()  # row 1: -0.5 * 3 (one step with the summed gradient); rows 5, 7: -0.5
    [0.0, -1.5, 0.0, 0.0, 0.0, -0.5, 0.0, -0.5]
    """
    if state is None:
        state = empty_state(weight)
    if grad_trigger is None:
        grad_trigger = empty_state(weight)
    if sr_seed is None:
        sr_seed = torch.empty(0, dtype=torch.int64, device=weight.device)
    return torch.ops.dlrm_kernels.fused_pooled_embedding(
        raw, weight, cardinalities, offsets, *layout, vocab, vocab_offsets, state, lr, optimizer, eps, deterministic,
        grad_trigger, weight_decay, sr_seed, stochastic_rounding, prefix,
    )[0]
