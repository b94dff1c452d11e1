"""The eager `SparseArch` with the sparse optimizer applied in its backward, in plain PyTorch ops.

`SparseArch`'s lookup emits a sparse COO gradient, whose coalesce (a sort and an ``index_put_`` with
data-dependent output sizes) keeps the embedding outside ``torch.compile`` and CUDA graphs.
`FusedUpdateSparseArch` keeps the same weight, hashing and state_dict but, once
``use_fused_update(config)`` is called (by ``dlrm.train.optim.FusedSparseOptimizer``), its backward
updates the looked-up rows in place (SGD, Adagrad or row-wise Adagrad) and returns no weight gradient.
Every tensor in that update has a shape fixed by the batch (``N = B * F`` positions) and nothing
reads a value back to the host, so Inductor compiles the lookup, the update and the rest of the step
as one graph, and a CUDA graph can capture it. It is the PyTorch twin of the Triton
``kernels.embedding.TritonSparseEmbedding`` (same ``SparseOptimizerConfig``, same update rules).

The update (:func:`sparse_update_`), for the rows ``rows [N]`` and output gradients ``grad [N, D]``:

1. sort the rows (fixed size N), mark where a new row starts, number the runs by a cumulative sum:
   run ("segment") ``k`` is the k-th distinct row; there are ``S <= N`` of them, ``S`` a device tensor;
2. sum the gradients of each segment into an ``[N, D]`` buffer (``index_add_`` by segment id: rows
   repeated in the batch get their gradients summed, as COO ``coalesce()`` does); slots ``k >= S``
   stay zero and are never read;
3. give every slot ``k`` of ``[0, N)`` the segment ``k mod S``: slots past S repeat a real segment,
   with its row and its summed gradient, so they compute exactly the same new row and state and
   write the same values to the same row. The update is then a gather of the old rows, the optimizer
   rule, and a scatter (``index_put_``) of the new rows, with no accumulation: its result does not
   depend on the order the writes land in (and ``mod S`` spreads the repeats over all touched rows
   instead of piling them on one).

Plain SGD without weight decay and with ``deterministic=False`` skips all this: it is linear in the
gradient, so one ``index_add_`` of ``-lr * grad`` per position (atomic adds on a GPU) gives the same
result up to rounding, as ``torch.optim.SGD`` adding an uncoalesced COO gradient does.

Only step 2 accumulates. With ``deterministic=True`` it runs as one opaque op (``dlrm_model::segment_sum``)
on ATen's deterministic kernels (the sort-based ``index_put_(accumulate=True)`` on CUDA, the serial
``index_add_`` on the CPU), so updates are bitwise reproducible also where Inductor would otherwise
emit atomic adds; ``deterministic=False`` leaves it to Inductor (faster, order-dependent rounding).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F_
from torch import Tensor

from dlrm.model.archs import SparseArch
from kernels.embedding.fused_switch import FusedUpdateSwitch

__all__ = ["FusedUpdateSparseArch", "init_state", "segment_sums", "sparse_update_"]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


# ----------------------------------------------------------------------------------------------------
# The deterministic segment sum: one op that Inductor leaves to ATen
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm_model::segment_sum", mutates_args=())
def _segment_sum_op(values: Tensor, segment: Tensor, num_segments: int) -> Tensor:
    """``out[k] = sum of values[i] with segment[i] == k`` ([num_segments, D]), in a fixed order."""
    out = values.new_zeros((num_segments, values.shape[1]))
    if values.device.type == "cuda":
        # CUDA's index_put_ with accumulate=True always takes the sort-based deterministic kernel
        # (index_add_ there uses atomics unless torch.use_deterministic_algorithms is on).
        return out.index_put_((segment,), values, accumulate=True)
    return out.index_add_(0, segment, values)  # the CPU kernel adds the indices one after another


@_segment_sum_op.register_fake
def _(values, segment, num_segments):
    return values.new_empty((num_segments, values.shape[1]))


# ----------------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------------


def segment_sums(rows: Tensor, grad: Tensor, num_rows: int, deterministic: bool = False,
                 dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Sum the gradients of repeated rows, with static shapes: ``(slot_rows [N], slot_grads [N, D])``.

    Every distinct row of ``rows`` gets the sum of its positions' gradients (as a COO gradient's
    ``coalesce()``). The result has ``N`` slots, more than the ``S`` distinct rows when rows repeat;
    slot ``k`` holds distinct row ``k mod S`` (ascending), so every distinct row appears at least once
    and every repeat of a row carries exactly the same summed gradient. No host sync.

    Args:
        rows: int64 ``[N]`` rows of the weight (any order, repeats allowed), ``N >= 1``.
        grad: ``[N, D]`` gradient of each position (any strides).
        num_rows: ``R``, the weight's rows (int32 sort keys when they fit: a faster sort).
        deterministic: sum in a fixed order (``dlrm_model::segment_sum``) instead of ``index_add_``.
        dtype: the sums' dtype (default ``grad``'s).

    Example:
        >>> rows, sums = segment_sums(torch.tensor([4, 1, 4]), torch.tensor([[1.0], [2.0], [3.0]]), 5)
        >>> rows.tolist(), sums.flatten().tolist()
        ([1, 4, 1], [2.0, 4.0, 2.0])

    Shapes: ``[N]``, ``[N, D]`` -> ``[N]``, ``[N, D]``.
    """
    n = rows.shape[0]
    keys = rows.to(torch.int32) if num_rows < 2**31 else rows  # R is static: choosing costs no sync
    sorted_rows, perm = torch.sort(keys, stable=True)  # stable: a fixed order for the deterministic sum
    starts = torch.ones(n, dtype=torch.bool, device=rows.device)
    starts[1:] = sorted_rows[1:] != sorted_rows[:-1]
    segment = torch.cumsum(starts, 0) - 1  # [N] segment of each sorted position, 0 .. S - 1
    values = grad[perm].to(dtype or grad.dtype)
    if deterministic:
        sums = torch.ops.dlrm_model.segment_sum(values, segment, n)
    else:
        sums = values.new_zeros((n, grad.shape[1])).index_add_(0, segment, values)
    # slot k -> segment k mod S (S = segment[-1] + 1, a device tensor); its first sorted position by
    # binary search in the nondecreasing `segment`
    slot_segment = torch.remainder(torch.arange(n, device=rows.device), segment[-1:] + 1)
    first = torch.searchsorted(segment, slot_segment)
    return sorted_rows[first].to(torch.int64), sums[slot_segment]


def sparse_update_(rows: Tensor, grad: Tensor, weight: Tensor, state: Optional[Tensor], lr: Tensor, kind: str,
                   eps: float, weight_decay: float = 0.0, deterministic: bool = False) -> None:
    """One optimizer step on the rows a lookup used, in place, from the lookup's output gradient.

    The rules are those of the eager sparse optimizers on the coalesced COO gradient ``g[r]`` (the sum
    over every position that looked up row ``r``; rows not looked up are untouched):

    * ``"sgd"`` (``torch.optim.SGD``): ``w[r] -= lr * g[r]``;
    * ``"adagrad"`` (``torch.optim.Adagrad``): ``s[r] += g[r]**2``; ``w[r] -= lr * g[r] / (sqrt(s[r]) + eps)``;
    * ``"rowwise_adagrad"`` (``dlrm.train.optim.RowWiseAdagrad``): ``s[r] += mean(g[r]**2)``;
      ``w[r] -= lr / (sqrt(s[r]) + eps) * g[r]``.

    With ``weight_decay``, ``g[r] += weight_decay * w[r]`` first (lazy L2 on the touched rows, as
    ``dlrm.train.optim.decay_touched_rows_``). Arithmetic in fp32 at least (the weight's dtype if wider).

    Args:
        rows: int64 ``[B, F]`` (or any shape) rows of ``weight`` that were looked up.
        grad: ``[*rows.shape, D]`` gradient of the lookup's output (any strides, stride 0 included).
        weight: ``[R, D]``, updated in place.
        state: None for sgd; ``[R, D]`` (adagrad) or ``[R]`` (rowwise_adagrad) sums, updated in place.
        lr: one-element tensor on weight's device (read on the device: a schedule changes it in place).
        kind: "sgd" | "adagrad" | "rowwise_adagrad".
        eps: the Adagrad epsilon (> 0).
        weight_decay: lazy L2 coefficient (0: none).
        deterministic: bitwise reproducible (see :func:`segment_sums`).

    Example:
        >>> w = torch.zeros(4, 2)
        >>> sparse_update_(torch.tensor([[1, 3, 1]]), torch.ones(1, 3, 2), w, None, torch.tensor([0.5]), "sgd", 1e-8)
        >>> w
        tensor([[ 0.0000,  0.0000],
                [-1.0000, -1.0000],
                [ 0.0000,  0.0000],
                [-0.5000, -0.5000]])

    Shapes: ``rows [B, F]``, ``grad [B, F, D]``; ``weight [R, D]`` and ``state`` keep theirs.
    """
    if kind not in OPTIMIZERS:
        raise ValueError(f"kind must be one of {OPTIMIZERS}, got {kind!r}")
    n, dim = rows.numel(), weight.shape[1]
    if n == 0 or dim == 0:
        return
    acc = torch.promote_types(weight.dtype, torch.float32)  # fp32 arithmetic for bf16 weights, as the eager optimizers
    lr = lr.to(acc)
    if kind == "sgd" and not deterministic and not weight_decay:
        # Plain SGD is linear in the gradient: one add per position (atomic on a GPU) needs no sort and
        # no segment sums; torch.optim.SGD adds an uncoalesced COO gradient the same way.
        weight.index_add_(0, rows.reshape(n), (-lr * grad.reshape(n, dim).to(acc)).to(weight.dtype))
        return
    slot_rows, g = segment_sums(rows.reshape(n), grad.reshape(n, dim), weight.shape[0], deterministic, acc)
    w = weight[slot_rows].to(acc)
    if weight_decay:
        g = g + weight_decay * w
    if kind == "sgd":
        new_w = w - lr * g
    elif kind == "adagrad":
        s = state[slot_rows] + g * g
        state.index_put_((slot_rows,), s)
        new_w = w - lr * (g / (s.sqrt() + eps))
    else:
        s = state[slot_rows] + g.square().mean(dim=1)
        state.index_put_((slot_rows,), s)
        new_w = w + (-(lr / (s.sqrt() + eps))).unsqueeze(1) * g
    # Repeated slots write identical values: no accumulation, any order of writes gives the same result.
    weight.index_put_((slot_rows,), new_w.to(weight.dtype))


def init_state(kind: str, weight: Tensor) -> Optional[Tensor]:
    """Zero optimizer state for ``weight [R, D]``: None (sgd), ``[R, D]`` (adagrad), ``[R]`` (rowwise_adagrad).

    fp32, or the weight's dtype when wider (float64 in the reference tests).

    Example:
        >>> init_state("rowwise_adagrad", torch.zeros(5, 3)).shape
        torch.Size([5])
    """
    if kind not in OPTIMIZERS:
        raise ValueError(f"kind must be one of {OPTIMIZERS}, got {kind!r}")
    dtype = torch.promote_types(weight.dtype, torch.float32)
    shape = {"adagrad": tuple(weight.shape), "rowwise_adagrad": (weight.shape[0],)}.get(kind)
    return None if shape is None else torch.zeros(shape, dtype=dtype, device=weight.device)


class _LookupThenUpdate(torch.autograd.Function):
    """Forward ``weight[rows]``; backward :func:`sparse_update_` in place and no gradient for anything.

    ``weight``, ``state`` and ``lr`` are held as ctx attributes, not saved tensors: the backward
    mutates the very tensors the caller owns (the parameter and the optimizer state). ``trigger``
    (a zero-size tensor that requires grad) is what makes autograd run the backward at all, since
    ``weight`` does not require grad in this mode (see `FusedUpdateSparseArch.use_fused_update`).
    """

    @staticmethod
    def forward(ctx, rows, weight, state, lr, trigger, kind, eps, weight_decay, deterministic):
        ctx.save_for_backward(rows)
        ctx.weight, ctx.state, ctx.lr = weight, state, lr
        ctx.kind, ctx.eps, ctx.weight_decay, ctx.deterministic = kind, eps, weight_decay, deterministic
        return F_.embedding(rows, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        with torch.no_grad():
            sparse_update_(rows, grad_out, ctx.weight, ctx.state, ctx.lr, ctx.kind, ctx.eps, ctx.weight_decay,
                           ctx.deterministic)
        return (None,) * 9


class FusedUpdateSparseArch(FusedUpdateSwitch, SparseArch):
    """`SparseArch` whose backward applies the sparse optimizer (PyTorch ops, static shapes).

    Same weight, hashing, initialisation and state_dict (``weight`` only) as `SparseArch`, so a
    checkpoint of either loads into the other. Until ``use_fused_update(config)`` it behaves exactly
    as `SparseArch` (sparse COO gradient). After it, a training forward with grad enabled returns a
    lookup whose backward updates the looked-up rows in place with ``config``'s optimizer
    (:func:`sparse_update_`) and leaves ``weight.grad`` None; evaluation and no-grad forwards are the
    plain lookup. ``dlrm.train.optim.FusedSparseOptimizer`` makes that call and keeps the state.

    Args:
        cardinalities: table size per feature (F ints).
        dim: D.
        vocabs: for vocabulary hashing, the sorted vocabulary of each feature (as `SparseArch`).

    Example:
        >>> from kernels.embedding import SparseOptimizerConfig
        >>> arch = FusedUpdateSparseArch([10, 20, 5], 8)
        >>> cfg = arch.use_fused_update(SparseOptimizerConfig("rowwise_adagrad", torch.tensor([0.1]), eps=1e-8))
        >>> before = arch.weight.detach().clone()
        >>> out = arch(torch.tensor([[3, -1, 2**32 - 1]]))
        >>> out.shape
        torch.Size([1, 3, 8])
        >>> out.sum().backward()
        >>> arch.weight.grad is None, int((arch.weight != before).any(dim=1).sum()), int((cfg.state > 0).sum())
        (True, 3, 3)

    Shapes: int64 [B, F] -> [B, F, D].
    """

    # dlrm.model.interfaces.SparseArchInterface: after use_fused_update (which build_optimizers calls
    # before the train step reads `compilable`), no COO gradient and no data-dependent shape is left,
    # so the lookup and its update compile and capture with the rest of the step
    compilable = True
    collective = False
    fused_optimizer = True

    def __init__(self, cardinalities: list[int], dim: int, vocabs: Optional[list[Tensor]] = None) -> None:
        super().__init__(cardinalities, dim, vocabs)
        self.fused_update = None  # a kernels.embedding.SparseOptimizerConfig once use_fused_update is called
        # Plain attribute (not a parameter or buffer: state_dict stays {"weight"}); see use_fused_update.
        self._grad_trigger: Optional[Tensor] = None

    def use_fused_update(self, config):
        """Switch training forwards to the in-backward update with ``config`` (None switches back).

        ``config`` is a ``kernels.embedding.SparseOptimizerConfig`` (kind, lr tensor, eps, state,
        deterministic, weight_decay); its ``state`` is allocated (zeros, :func:`init_state`) when None
        and the optimizer needs one. In this mode ``weight.requires_grad`` is False: no optimizer
        (nor torch.compile's check against in-place updates of leaves that require grad, torch 2.11)
        sees it as a trainable leaf; a private zero-size tensor that requires grad makes autograd run
        the backward. Returns ``config``.
        """
        if config is not None:
            if config.kind not in OPTIMIZERS:
                raise ValueError(f"kind must be one of {OPTIMIZERS}, got {config.kind!r}")
            if config.lr.numel() != 1 or config.lr.device != self.weight.device:
                raise ValueError("lr must be a one-element tensor on the weight's device")
            if config.state is None:
                config.state = init_state(config.kind, self.weight)
            # The backward mutates the state and reads the lr in place, and their addresses never change:
            # tell CUDA graphs (compile mode reduce-overhead) not to copy them into graph-owned inputs,
            # which would leave the real state unchanged (the weight, a Parameter, is static already).
            for t in (config.state, config.lr):
                if t is not None:
                    torch._dynamo.mark_static_address(t)
        self._switch_fused_update(config)
        return config

    def forward(self, raw: Tensor) -> Tensor:
        cfg = self.fused_update
        if cfg is None:
            return super().forward(raw)
        rows = self.rows(raw)
        if self.training and torch.is_grad_enabled():
            state = cfg.state if cfg.state is not None else self.weight.new_empty(0)
            return _LookupThenUpdate.apply(rows, self.weight, state, cfg.lr, self._grad_trigger, cfg.kind,
                                           float(cfg.eps), float(cfg.weight_decay), bool(cfg.deterministic))
        return F_.embedding(rows, self.weight)
