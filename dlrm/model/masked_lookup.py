"""Eager embedding lookups whose sparse gradient leaves out masked lookups.

A lookup can be *masked*: an empty multi-hot slot (``PAD_SPARSE``), or, under torchrun, an id that
another rank's block of a row-wise table serves, or a padded sample. Such a lookup still has to
point at some row (static shapes), and it contributes exactly zeros to the output, also when that row
holds NaN or Inf (it is selected out or left out of the bag, never multiplied by 0). With
``F.embedding(sparse=True)`` or ``F.embedding_bag(per_sample_weights=0)`` its row would still
appear in the sparse gradient, with a zero value. A zero gradient changes nothing for SGD, Adagrad or
row-wise Adagrad. But the lazy weight decay (`dlrm.train.optim.decay_touched_rows_`) decays every row
of the sparse gradient, so that row would be decayed although no sample used it. The functions here
build the sparse COO gradient from the kept lookups only, as the Triton kernels skip masked slots.

Their backward selects the kept lookups with a boolean mask: that is a host sync. It is acceptable
here because these are the eager sparse paths, whose sparse optimizers coalesce and sync anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_


def _kept_rows_grad(weight_shape: torch.Size, rows: torch.Tensor, keep: torch.Tensor, grad: torch.Tensor,
                    bag: torch.Tensor | None) -> torch.Tensor:
    """Sparse COO [R, D] gradient: for each kept lookup i, row ``rows[i]`` gets ``grad[bag[i]]``
    (``grad[i]`` when ``bag`` is None). Uncoalesced, as ``F.embedding``'s sparse gradient is."""
    kept = keep.nonzero().squeeze(1)  # host sync (see the module docstring)
    source = kept if bag is None else bag.index_select(0, kept)
    values = grad.reshape(-1, weight_shape[1]).index_select(0, source)
    # its rows are the lookups' own, within the table: nothing for torch's invariant checks to find
    return unchecked_sparse_coo(rows.index_select(0, kept).unsqueeze(0), values, weight_shape)


def unchecked_sparse_coo(indices: torch.Tensor, values: torch.Tensor, shape: torch.Size,
                         is_coalesced: bool | None = None) -> torch.Tensor:
    """``torch.sparse_coo_tensor`` without invariant checks (the caller's indices are valid), and without torch's
    "Sparse invariant checks are implicitly disabled. Memory errors (e.g. SEGFAULT) will occur ..." warning, which
    every multi-hot or sharded eager run printed at its first backward: torch 2.13 leaves it out for
    ``check_invariants=False``, torch 2.11 (the GPU image's) warns unless the process-wide setting is made explicitly,
    as the context manager does (it restores the caller's setting, checks off by default)."""
    with torch.sparse.check_sparse_tensor_invariants(enable=torch.sparse.check_sparse_tensor_invariants.is_enabled()):
        return torch.sparse_coo_tensor(indices, values, shape, is_coalesced=is_coalesced, check_invariants=False)


class _MaskedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, keep)
        ctx.weight_shape = weight.shape
        out = F_.embedding(rows, weight)
        # where, not a multiply by the 0/1 mask: a masked lookup's row may hold NaN or Inf (0 * NaN = NaN), and it
        # must contribute nothing, as the Triton kernels skip it (same cost: one pass writing the output)
        return torch.where(keep.unsqueeze(-1), out, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, keep = ctx.saved_tensors
        return _kept_rows_grad(ctx.weight_shape, rows.reshape(-1), keep.reshape(-1), grad, None), None, None


def masked_embedding(rows: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``weight[rows]`` with masked lookups zeroed; the sparse gradient of `weight` holds the kept ones only.

    Args:
        rows: int64 rows of `weight`, any shape S (a masked lookup may hold any valid row).
        weight: [R, D].
        keep: bool, shape S: False for a masked lookup.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, 2))
        >>> out = masked_embedding(torch.tensor([1, 0, 1]), w, torch.tensor([True, False, True]))
        >>> out.sum().backward()
        >>> w.grad.coalesce().indices().tolist()   # row 0 was only looked up by the masked lookup
        [[1]]

    Shapes: S -> S + [D]; ``weight.grad`` is sparse COO.
    """
    return _MaskedEmbedding.apply(weight, rows, keep)


def _kept_first(rows: torch.Tensor, keep: torch.Tensor, bag_starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` with the kept lookups first (in their order, so each bag's stay together) and the masked ones after
    them, and ``F.embedding_bag`` offsets of the bags over the kept ones plus one last bag of the masked ones.

    A masked lookup must contribute nothing to its bag. A per-sample weight of 0 does not do that when its row holds
    NaN or Inf (0 * NaN = NaN), whereas the Triton kernels skip it; leaving it out of the bags does. Static shapes
    and no host sync. Cost: a few elementwise passes over N int64s (a cumulative count, the positions, a scatter with
    unique indices: deterministic) and two N int64 temporaries besides `packed`, against the N * D values the lookup
    reads; the 0/1 per-sample weights it replaces were N floats."""
    n = rows.shape[0]
    kept_before = torch.zeros(n + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(keep, 0, out=kept_before[1:])
    total = kept_before[n:]
    # a kept lookup goes to (kept ones before it), a masked one to total + (masked ones before it)
    position = torch.arange(n, device=rows.device).sub_(kept_before[:-1]).add_(total)
    torch.where(keep, kept_before[:-1], position, out=position)
    packed = torch.empty_like(rows).scatter_(0, position, rows)
    return packed, torch.cat([kept_before[bag_starts], total])


class _MaskedEmbeddingBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor, bag_starts: torch.Tensor,
                bag: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, keep, bag)
        ctx.weight_shape = weight.shape
        packed, offsets = _kept_first(rows, keep, bag_starts)
        # the last bag holds the masked lookups: its sum is dropped
        return F_.embedding_bag(packed, weight, offsets, mode="sum")[:-1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, keep, bag = ctx.saved_tensors
        return _kept_rows_grad(ctx.weight_shape, rows, keep, grad, bag), None, None, None, None


def masked_embedding_bag(rows: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor, bag_starts: torch.Tensor,
                         bag: torch.Tensor) -> torch.Tensor:
    """Sum pooling, ``F.embedding_bag(mode="sum")`` with masked lookups left out of the sums and of the
    sparse gradient of `weight`.

    Args:
        rows: int64 [N] rows of `weight`, the bags' lookups one after another.
        weight: [R, D].
        keep: bool [N]: False for a masked lookup (an empty slot).
        bag_starts: int64 [n_bags], where each bag starts in `rows` (``F.embedding_bag``'s offsets).
        bag: int64 [N], the bag of each lookup (the same bags as `bag_starts`, spelled out for the backward).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, 2))
        >>> rows, keep = torch.tensor([1, 0, 3]), torch.tensor([True, False, True])
        >>> out = masked_embedding_bag(rows, w, keep, torch.tensor([0, 2]), torch.tensor([0, 0, 1]))
        >>> out.tolist()
        [[1.0, 1.0], [1.0, 1.0]]
        >>> out.sum().backward()
        >>> w.grad.coalesce().indices().tolist()
        [[1, 3]]

    Shapes: [N] -> [n_bags, D]; ``weight.grad`` is sparse COO.
    """
    return _MaskedEmbeddingBag.apply(weight, rows, keep, bag_starts, bag)
