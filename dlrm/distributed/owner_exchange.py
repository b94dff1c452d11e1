"""The owner's pooled lookup and the exchange of its results as one autograd node, whose backward sorts the owner's
rows while their gradients travel.

On the owner of a multi-hot shard (`dlrm.distributed.sharded_embedding`, Triton kernel, fused update), the step
looks up [W, P, served features] pooled rows, sends them back with an ``all_to_all``, and in the backward receives
their gradients with the reverse ``all_to_all`` and then runs the fused update: the sort of its rows, the segment sums
and the optimizer step (`kernels.embedding.update`). The sort needs only the rows, known since the forward, so here
it runs between issuing the gradients' ``all_to_all`` and waiting for it: NCCL's kernel and the sort's run side by
side. Measured on two H200s at MLPerf DLRM-DCNv2's shapes (`benchmarks/stream_overlap.py`,
results/stream_overlap_nccl.md): the exchange 0.74 ms and the sort 0.72 ms took 1.48 ms one after the other and 1.04
side by side.

The forward likewise: from `SPLIT_MIN_SAMPLES` samples a rank on, it looks up the first half of every rank's samples,
issues their ``all_to_all`` (the list form, straight into the halves of the receiving blocks), then looks up the
second half beside it (measured there: the exchange 0.99 ms and the lookup 1.26 took 2.01 one after the other, 1.58
side by side).

Numbers: the same kernels on the same inputs as `kernels.embedding.TritonPooledEmbedding`'s fused lookup followed by
the module's old ``_AllToAll``, so the same results bit for bit (each pooled row is looked up on its own; the sort is
stable and sees the rows in one lookup's order: its output does not depend on when it runs).
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
# The forward in two halves of every rank's samples, the first half's embeddings travelling while the second half is
# looked up, from this many samples a rank (P) on, P even; below it (or with None) one lookup and one exchange.
# Module-level, so that benchmarks/scaling.py --split-exchange off can compare the two (the same numbers).
SPLIT_MIN_SAMPLES: int | None = 4096


def takes_fused_path(local) -> bool:
    """Whether ``local`` (a `kernels.embedding.TritonPooledEmbedding`) would run its fused lookup now: a fused update
    configured, training, and autograd recording (as its ``forward`` decides)."""
    return local.fused_update is not None and local.training and torch.is_grad_enabled()


def _send_half(emb: torch.Tensor, dests: list[torch.Tensor], W: int, D: int):
    """``all_to_all`` of ``emb`` [W * half, n, D] (rank q's part: rows q * half ...) into ``dests``, views of the
    receiving blocks; returns the work to wait for. NCCL takes parts of different sizes straight into the views; gloo's
    list form needs equal sizes, so there the half travels as one tensor and is copied into place (CPU runs)."""
    ins = list(emb.view(W, -1, D).unbind(0))
    outs = [d.view(-1, D) for d in dests]
    if dist.get_backend() == "nccl":
        return dist.all_to_all(outs, ins, async_op=True)
    recv = emb.new_empty((sum(o.shape[0] for o in outs), D))
    dist.all_to_all_single(recv, emb.view(-1, D), [o.shape[0] for o in outs], [i.shape[0] for i in ins])
    for o, r in zip(outs, recv.split([o.shape[0] for o in outs])):
        o.copy_(r)
    return None


class PooledLookupExchange(torch.autograd.Function):
    """``local``'s pooled lookup of ``raw`` [W * P, slots] sent to the ranks with ``all_to_all_single`` (or in two
    halves of each rank's samples, see `SPLIT_MIN_SAMPLES`); the backward receives the gradients, sorting the rows
    meanwhile, and applies ``local.fused_update`` to ``local.weight`` in place.

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
        weight, D = local.weight, local.weight.shape[1]
        W = len(in_splits)
        P = raw.shape[0] // W
        halves = 2 if SPLIT_MIN_SAMPLES is not None and P >= max(SPLIT_MIN_SAMPLES, 2) and P % 2 == 0 else 1
        out = weight.new_empty((sum(out_splits), D))
        # rank q's block of `out` is [P, n_q, D]: a half of its samples is a contiguous part of it
        blocks = [b.view(P, n // P if P else 0, D) for b, n in zip(out.split(out_splits), out_splits)]
        parts, works = [], []
        for h in range(halves):
            lo, hi = h * P // halves, (h + 1) * P // halves
            part = raw if halves == 1 else raw.view(W, P, -1)[:, lo:hi].reshape(W * (hi - lo), -1)
            with device_context(weight):
                emb, rows = pooled_lookup_impl(part, weight, local.cardinalities, local.offsets, *local.layout,
                                               local.vocab, local.vocab_offsets,
                                               rows_dtype=fused_rows_dtype(weight.shape[0]))
            if halves == 1:
                dist.all_to_all_single(out, emb.reshape(-1, D), out_splits, in_splits)
            else:  # issued, not waited for: the next half's lookup runs beside it (NCCL's kernel leaves SMs free)
                works.append(_send_half(emb, [b[lo:hi] for b in blocks], W, D))
            parts.append(rows)
        for work in works:
            if work is not None:
                work.wait()
        ctx.save_for_backward(*parts)
        ctx.local, ctx.splits, ctx.shape = local, (out_splits, in_splits), (W, P, emb.shape[1])
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.saved_tensors
        local, (out_splits, in_splits), (W, P, n) = ctx.local, ctx.splits, ctx.shape
        cfg, weight = local.fused_update, local.weight
        back = grad.new_empty((sum(in_splits), grad.shape[1]))
        work = dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, async_op=True)
        # The update needs only the rows, in every rank's sample order (the gradients' order; the halves' rows put
        # back in it, so that equal rows are summed in the order one lookup gives), and their sort: both run while
        # the gradients travel. Nothing else may run between here and the wait that reads `back`.
        rows = parts[0] if len(parts) == 1 else torch.stack([r.view(W, P // 2, -1) for r in parts], 1).view(W * P, -1)
        presorted = None
        if SORT_OVERLAP and update_sorts(cfg.kind, cfg.deterministic, weight.dtype, cfg.weight_decay) and rows.numel():
            with device_context(weight):
                presorted = sort_by_row(rows, weight.shape[0])
        work.wait()
        with device_context(weight):
            pooled_update_impl(rows, back.view(W * P, n, -1), local.layout.slot_feature, weight,
                               cfg.state if cfg.state is not None else empty_state(weight),
                               cfg.lr, cfg.kind, cfg.eps, cfg.deterministic, cfg.weight_decay, local.sr_seed,
                               local.stochastic_rounding, presorted=presorted)
        return None, None, None, None, None
