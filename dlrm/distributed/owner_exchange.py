"""The owner's pooled lookup and the exchange of its results as one autograd node, whose backward sorts the owner's
rows while their gradients travel.

On the owner of a multi-hot shard (`dlrm.distributed.sharded_embedding`, Triton kernel, fused update), the step
looks up [W, P, served features] pooled rows, sends them back with an ``all_to_all``, and in the backward receives
their gradients with the reverse ``all_to_all`` and then runs the fused update: the sort of its rows, the segment sums
and the optimizer step (`kernels.embedding.update`). The sort needs only the rows, known since the forward, so here
it runs between issuing the gradients' ``all_to_all`` and waiting for it: NCCL's kernel and the sort's run side by
side. Measured on two H200s at MLPerf DLRM-DCNv2's shapes (`benchmarks/stream_overlap.py`,
results/stream_overlap_nccl.md): the exchange 0.74 ms and the sort 0.72 ms took 1.48 ms one after the other and 1.04
side by side; the whole step +1% on two H200s and +4% on four (`benchmarks/scaling.py --sort-overlap off` against
on, results/mlperf_dcnv2_two_gpus.md). Tried and not kept: the forward's lookup in two halves, the first half's
embeddings travelling beside the second half's lookup (no change in the two-H200 step).

Numbers: the same kernels on the same inputs as `kernels.embedding.TritonPooledEmbedding`'s fused lookup followed by
the module's old ``_AllToAll``, so the same results bit for bit (the sort is stable: its output does not depend on
when it runs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels._backend import device_context
from kernels.embedding.pooled import fused_rows_dtype, pooled_lookup_impl, pooled_update_impl
from kernels.embedding.update import empty_state, sort_by_row, update_sorts

__all__ = ["PooledLookupExchange", "takes_fused_path"]

# Sort while the gradients travel (True), or after they have arrived, as the fused lookup's own backward does
# (False: the same numbers). Module-level, so that benchmarks/scaling.py --sort-overlap off can compare the two.
SORT_OVERLAP = True


def takes_fused_path(local) -> bool:
    """Whether ``local`` (a `kernels.embedding.TritonPooledEmbedding`) would run its fused lookup now: a fused update
    configured, training, and autograd recording (as its ``forward`` decides)."""
    return local.fused_update is not None and local.training and torch.is_grad_enabled()


class PooledLookupExchange(torch.autograd.Function):
    """``local``'s pooled lookup of ``raw`` [W * P, slots] sent to the ranks with ``all_to_all_single``; the backward
    receives the gradients, sorting the rows meanwhile, and applies ``local.fused_update`` to ``local.weight`` in place.

    Args (of ``apply``):
        raw: [W * P, S] int64 local raw values (`kernels.exchange_ids.local_ids`: PAD where a slot is not this rank's).
        trigger: ``local._grad_trigger``, the zero-size tensor that requires grad, so that autograd runs the backward.
        local: the `TritonPooledEmbedding` shard, its fused update configured (`takes_fused_path`).
        out_splits, in_splits: rows of [., D] received from and sent to each rank (``all_to_all_single``'s
            output and input split sizes).

    Returns [sum(out_splits), D] in the shard's dtype: what every rank sent this one. No gradient for ``raw``; the
    weight's gradient is its update (``weight.grad`` stays None).
    """

    @staticmethod
    def forward(ctx, raw, trigger, local, out_splits: list[int], in_splits: list[int]):
        weight = local.weight
        with device_context(weight):
            emb, rows = pooled_lookup_impl(raw, weight, local.cardinalities, local.offsets, *local.layout, local.vocab,
                                           local.vocab_offsets, rows_dtype=fused_rows_dtype(weight.shape[0]))
        D = weight.shape[1]
        out = emb.new_empty((sum(out_splits), D))
        dist.all_to_all_single(out, emb.reshape(-1, D), out_splits, in_splits)
        ctx.save_for_backward(rows)
        ctx.local, ctx.splits, ctx.emb_shape = local, (out_splits, in_splits), emb.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        local, (out_splits, in_splits) = ctx.local, ctx.splits
        cfg, weight = local.fused_update, local.weight
        back = grad.new_empty((sum(in_splits), grad.shape[1]))
        work = dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, async_op=True)
        # The sort of the update needs only the rows: it runs while the gradients travel. Nothing else may run
        # between here and the wait that reads `back`.
        presorted = None
        if SORT_OVERLAP and update_sorts(cfg.kind, cfg.deterministic, weight.dtype, cfg.weight_decay) and rows.numel():
            with device_context(weight):
                presorted = sort_by_row(rows, weight.shape[0])
        work.wait()
        with device_context(weight):
            pooled_update_impl(rows, back.view(ctx.emb_shape), local.layout.slot_feature, weight,
                               cfg.state if cfg.state is not None else empty_state(weight),
                               cfg.lr, cfg.kind, cfg.eps, cfg.deterministic, cfg.weight_decay, local.sr_seed,
                               local.stochastic_rounding, presorted=presorted)
        return None, None, None, None, None
