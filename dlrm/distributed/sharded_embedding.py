"""The SparseArch of a distributed run: tables sharded over ranks, lookups exchanged with all_to_all.

Every rank holds a local shard (`dlrm.distributed.sharding`) and a data-parallel slice of the
global batch. One forward, on rank r with a local batch of B rows padded to P = ceil(global / W):

1. hash raw values into table rows on the device (as the one-GPU `SparseArch`);
2. ``all_to_all`` of ids: rank r sends rank q the ids of the tables q serves ([P, |S_q|]);
3. rank q looks its [W, P, |S_q|] ids up in its local shard (ids outside its block of a row-wise
   table give zeros); where Triton runs, steps 1 and 3's id arithmetic are one kernel each
   (`kernels.exchange_ids`; modulus hashing, else the eager ops for step 1);
4. ``all_to_all`` of embeddings back (differentiable: its backward is the reverse all_to_all of
   the gradients); rank r sums the W
   blocks of each row-wise table and takes each table-wise table from its owner -> [B, F, D]
   (`kernels.exchange_combine`: one Triton kernel a direction where Triton runs, the same sums in
   PyTorch ops for the torch kernel on the CPU).

Multi-hot tables (``hotness``): the ids travel per slot, the embeddings per feature, pooled where
they are looked up. Rank q is sent the hashed rows of every slot of the tables it serves ([P, slots
of S_q]; an empty slot, PAD, is sent as row -1, which no shard holds, so it is skipped), sums each
feature's slots that fall in its block (the Triton pooled kernel, or an eager ``embedding_bag``)
and sends back [P, |S_q|, D], as one-hot tables do; rank r sums the row-wise blocks into [B, F, D]
as for one-hot tables: sum pooling, as `dlrm.model.pooled_sparse.PooledSparseArch`. Pooling on
the owner divides the bytes of the exchange and of its gradient by the mean hotness of the features
a rank serves: for MLPerf DLRM-DCNv2 on two ranks 25x and 8.4x (152 slots over 6 features, 211 over
25), and its step went from 129.6 to 35.4 ms on two H200s (benchmarks/results/mlperf_dcnv2_two_gpus.md).

Backward: the gradients travel back to the owners, whose local lookup turns them into a sparse
gradient of the shard (applied by the sparse optimizer there) or, with the Triton embedding, the
fused update in the lookup's backward. A multi-hot Triton shard's lookup and exchange are one autograd
node (`dlrm.distributed.owner_exchange`) whose backward sorts the owner's rows for the update while
their gradients travel. All message sizes depend on P and the plan only, never on
the data: no host sync, and shapes stay static across steps.

Gradient scale: each rank's loss is its share of the global mean (`dlrm.train.step`), DDP averages
the dense gradients over ranks, and the embedding gradients, which are summed on the owners, get a
factor 1/W here -- so an N-rank step equals a one-process step on the same global batch.

bf16 shards (``dtype=torch.bfloat16``, ``model.embedding_dtype: "bf16"``, Triton only): each rank
stores its rows in bf16, as one process stores the whole tables. Lookups travel in bf16 (half the
bytes of the exchange). One-hot: exact (a looked-up row, or its masked zero, is a bf16 value), and
the requesting rank sums row-wise blocks in fp32 and rounds once. Multi-hot: the owner's pooled
kernel sums a feature's slots in fp32 and rounds once to bf16, as the one-process pooled lookup
does, so a table-wise feature arrives exactly as one process computes it; a row-wise feature
arrives as W such partial sums, added in fp32 and rounded again (a second bf16 rounding, as the
exchange of partial sums in the table's dtype has in TorchRec's row-wise sharding). Their gradients
arrive in bf16 (the interaction's cast sends them back so, as to the one-process lookup), get the
1/W in fp32 and travel back in bf16 (exact when W is a power of two). The owner's update runs in
fp32 and rounds back as the one-process table of the same model does (see `ShardedSparseArch`).
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from dlrm.data.schema import PAD_SPARSE
from dlrm.distributed.owner_exchange import PooledLookupExchange, takes_fused_path
from dlrm.distributed.sharding import ShardingPlan
from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows
from dlrm.model.masked_lookup import masked_embedding, masked_embedding_bag
from kernels.exchange_combine import (
    COMBINE_DTYPES,
    EXCHANGE_TENSORS,
    ExchangeLayout,
    combine_received,
    combine_received_eager,
    exchange_layout,
)
from kernels.exchange_ids import local_ids, send_ids, send_ids_eager
from kernels.table_layout import first_init_chunks, init_rows_, init_seed, layout_tensors


def _pool_over_one_table(local, hotness: list[int], rows: int) -> None:
    """Point a `TritonPooledEmbedding` built as one table of `rows` rows and one slot at features of
    `hotness` slots each, every one looking up that whole table: feature i sums its slots' rows of the
    local shard. The weight (and its state_dict key) is unchanged; only the layout buffers change.
    With modulus hashing over R rows, the raw value ``r - 1`` is row r of the shard."""
    from kernels.embedding.pooled import pooled_layout

    device = local.cardinalities.device
    layout = pooled_layout(hotness, device)
    local.hotness, local.slot_offsets, local.slot_feature = layout.hotness, layout.slot_offsets, layout.slot_feature
    local.hotness_list = list(hotness)
    local.cardinalities = torch.full((len(hotness),), rows, dtype=local.cardinalities.dtype, device=device)
    local.offsets = torch.zeros(len(hotness), dtype=local.offsets.dtype, device=device)


def _one_table_per_feature(local, counts: list[int]) -> None:
    """Point a one-hot `TritonSparseEmbedding` built as one table of ``sum(counts)`` rows at the
    blocks it holds, one table a served feature (``counts[i]`` rows from the sum of the counts before):
    raw ``r`` of column i is row ``(r + 1) mod counts[i]`` of block i. The weight (and its state_dict
    key) is unchanged; only the layout buffers change.

    Why not one column of every slot: the update then runs column-major, one feature a program, so a
    block of a tiny table's samples is summed per row before its atomic adds
    (`kernels.embedding.atomic_update`). As one column, every program mixed all served features and
    added each position alone: Kaggle's two-rank one-hot update took 0.30-0.38 ms a rank against 0.11
    on one GPU, every sample's adds to a 3- or 4-row table serialised on those rows' addresses.
    A block with no rows here (row-wise, more ranks than rows) is pointed at row 0 with one row: every
    lookup into it is masked."""
    device = local.cardinalities.device
    starts = list(itertools.accumulate([0, *counts]))[:-1]
    local.cardinality_list = [max(n, 1) for n in counts]
    local.cardinalities = torch.tensor(local.cardinality_list, dtype=local.cardinalities.dtype, device=device)
    local.offsets = torch.tensor([a if n else 0 for a, n in zip(starts, counts)], dtype=local.offsets.dtype,
                                 device=device)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` along dim 0 whose backward is the reverse all_to_all of the
    gradients (torch.distributed.nn.functional's version is deprecated; this uses the public op)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


class ShardedSparseArch(nn.Module):
    """The F embedding tables sharded over W ranks by `plan`; this module is rank `rank`'s part.

    Args:
        cardinalities: rows per table (F ints), as for `SparseArch`.
        dim: D.
        plan: the placement (`dlrm.distributed.sharding.plan_sharding`).
        rank: this process's rank.
        vocabs: vocabulary hashing, as for `SparseArch`.
        kernel: "torch" (sparse gradients, eager sparse optimizers on the owner) or "triton" (the
            local lookup is a `kernels.embedding.TritonSparseEmbedding` whose backward applies the
            fused sparse update on the owner).
        hotness: values per sample of each feature, sum-pooled (None: one each). The raw input is
            then [B, L], L = sum(hotness), with PAD_SPARSE (-2) in empty slots.
        dtype: of the local shard, float32 or (kernel "triton" only) bfloat16. A bf16 shard is
            updated as the one-process bf16 table of the same model: fp32 update math, then
            stochastic rounding (`kernels.embedding.TritonPooledEmbedding` for multi-hot tables,
            `kernels.embedding.TritonSparseEmbedding` for one-hot ones; seed in the buffer
            ``sr_seed``, advanced on the device once per step). The rounding's random bits are
            keyed by the row of the local shard, not of the full table, so a bf16 shard rounds
            like one process in distribution, not bit for bit.
        skip_masked_updates: make masked lookups (another rank's block of a row-wise table, an empty
            slot, a padded sample: they point at the shard's row 0) skip the update, as one process
            never touches a row for them. Needed for a lazy sparse weight decay, which decays every
            row an update touches (`dlrm.train.optim.decay_touched_rows_`); without it a masked
            lookup's zero gradient is a no-op for SGD, Adagrad and row-wise Adagrad (and a bf16 row
            rounds back to itself), so the faster one-hot Triton module is kept. Triton: every shard
            then takes `kernels.embedding.TritonPooledEmbedding` (hotness 1), whose PAD slots are
            skipped. The torch kernel always leaves masked lookups out of its sparse gradient
            (`dlrm.model.masked_lookup`).

    Example (inside a torchrun launch of 2 processes)::

        arch = ShardedSparseArch([10] * 26, 16, plan_sharding([10] * 26, 2, "table", 10**7), rank)
        arch(raw_local_batch, global_batch=2 * len(raw_local_batch))   # [B_local, 26, 16]

    Shapes: int64 [B, F] (or [B, L] multi-hot) raw values -> [B, F, D] in the shard's dtype.
    Parameters: ``weight``, the local shard [R_rank, D] (its rows are `plan.local_layout(rank)`), the
    same state_dict key as `SparseArch`; a bf16 shard (stochastically rounded) adds the int64 buffer
    ``sr_seed`` [1], so that a resumed run draws the rounding bits the uninterrupted one would
    (`dlrm.distributed.checkpoint.merge` leaves it out of a one-process checkpoint). Initialised
    exactly as the one-process arch would initialise the full tables from the same RNG state (in the
    shard's dtype as the one-process table is), drawing only the init chunks this rank's rows lie in
    (`kernels.table_layout.init_rows_`: at most one chunk beyond the shard held at once), so a sharded
    run starts from the same parameters as a one-process run with the same seed.
    """

    # dlrm.model.interfaces.SparseArchInterface: the lookup runs eagerly, outside torch.compile and CUDA
    # graphs (its collectives); every rank must call forward together (see `global_batch`)
    compilable = False
    collective = True
    fused_optimizer = False  # True with kernel "triton" (set in __init__)

    def __init__(self, cardinalities: list[int], dim: int, plan: ShardingPlan, rank: int,
                 vocabs: Optional[list[torch.Tensor]] = None, kernel: str = "torch",
                 hotness: Optional[list[int]] = None, dtype: torch.dtype = torch.float32,
                 skip_masked_updates: bool = False) -> None:
        super().__init__()
        if list(plan.cardinalities) != list(cardinalities):
            raise ValueError("the sharding plan was made for other table sizes")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: {dtype} is not torch.float32 or torch.bfloat16")
        if dtype != torch.float32 and kernel != "triton":
            # the eager sparse optimizers would round every update to bf16 to nearest and lose the
            # small ones (dlrm.config refuses model.embedding_dtype "bf16" with kernels.embedding "torch")
            raise ValueError(f'dtype: {dtype} needs kernel "triton" (its fused update computes in fp32), '
                             f"not {kernel!r}")
        self.plan, self.rank, self.world_size, self.dim = plan, rank, plan.world_size, dim
        self.num_features = len(cardinalities)
        cards, offsets = layout_tensors(cardinalities)
        self.register_buffer("cardinalities", cards, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.hashing = "modulus" if vocabs is None else "vocabulary"
        if vocabs is not None:
            keys, vocab_offsets = keyed_vocabulary(vocabs)
            self.register_buffer("vocab_keys", keys, persistent=False)
            self.register_buffer("vocab_offsets", vocab_offsets, persistent=False)

        layout = plan.local_layout(rank)
        self.hotness = [int(h) for h in hotness] if hotness is not None else [1] * self.num_features
        if len(self.hotness) != self.num_features or min(self.hotness) < 1:
            raise ValueError(f"hotness: one int >= 1 per feature ({self.num_features}), got {self.hotness}")
        self.multi_hot = any(h != 1 for h in self.hotness)
        # the exchange is per slot (one slot a feature when one-hot): slot_feature[s] is slot s's feature
        slot_feature = [f for f, h in enumerate(self.hotness) for _ in range(h)]
        self.register_buffer("_slot_feature", torch.tensor(slot_feature, dtype=torch.int64), persistent=False)
        self.register_buffer("_slot_card", cards[self._slot_feature], persistent=False)  # each slot's table size
        # the ids the exchange sends (`kernels.exchange_ids`): int32, half the bytes, while every table's rows fit
        self._id_dtype = torch.int32 if max(cardinalities) < 2**31 else torch.int64
        self.served = [plan.served(q) for q in range(self.world_size)]
        self.served_slots = [[s for f in feats for s in range(len(slot_feature)) if slot_feature[s] == f]
                             for feats in self.served]
        self.row_wise = bool(plan.row_wise_tables())
        for q in range(self.world_size):
            self.register_buffer(f"_send_slots_{q}", torch.tensor(self.served_slots[q], dtype=torch.int64),
                                 persistent=False)
        # the embeddings come back per served feature (pooled on the owner): rank q sends [P, |S_q|, D], combined
        # into [B, F, D] by `kernels.exchange_combine` (its layout tensors are buffers, so they follow .to(device))
        exchange = exchange_layout(self.served, self.num_features)
        self._exchange = (exchange.num_features, exchange.parts, exchange.columns_per_rank)
        for name in EXCHANGE_TENSORS:
            self.register_buffer(f"_exchange_{name}", getattr(exchange, name), persistent=False)
        # this rank's served slots, grouped by served feature (served_slots lists each feature's slots together)
        self.served_hotness = [self.hotness[f] for f in self.served[rank]]
        group = [i for i, h in enumerate(self.served_hotness) for _ in range(h)]
        self.register_buffer("_slot_group", torch.tensor(group, dtype=torch.int64), persistent=False)
        starts = list(itertools.accumulate([0, *self.served_hotness]))[:-1]  # each served feature's first slot
        self.register_buffer("_group_start", torch.tensor(starts, dtype=torch.int64), persistent=False)
        # this rank's block of each table it serves, per served slot (layout is in served-feature order)
        block = {f: (start, count, at) for f, start, count, at in layout}
        mine = [block[slot_feature[s]] for s in self.served_slots[rank]]
        self.register_buffer("_base", torch.tensor([b for b, _, _ in mine], dtype=torch.int64), persistent=False)
        self.register_buffer("_count", torch.tensor([c for _, c, _ in mine], dtype=torch.int64), persistent=False)
        self.register_buffer("_local_offset", torch.tensor([o for _, _, o in mine], dtype=torch.int64), persistent=False)

        rows = plan.local_rows(rank)
        self.kernel = kernel
        if kernel == "triton":
            from kernels.embedding import TritonPooledEmbedding, TritonSparseEmbedding

            # Its own init must not move the RNG of the device it draws on (ours follows, and so do
            # the OverArch's): fork the CPU RNG and, when building on CUDA, that device's.
            device = torch.empty(0).device  # the default device build_model set
            # The local module is the one-process model's kind (dlrm.model.dlrm: TritonPooledEmbedding
            # for multi-hot tables, TritonSparseEmbedding for one-hot ones), so a bf16 shard's update
            # rounds as that table's does. Multi-hot: it pools each served feature's slots on this rank
            # (`_pool_over_one_table`). skip_masked_updates takes the pooled module for one-hot
            # tables too (hotness 1 is the one-hot lookup, number for number): its PAD slots skip the update.
            stochastic = dtype == torch.bfloat16  # both kinds round bf16 updates stochastically
            self.pooled_local = self.multi_hot or skip_masked_updates
            with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                if self.pooled_local:
                    local = TritonPooledEmbedding([rows], [1], dim, dtype=dtype)
                    if self.served_hotness:  # (a rank serving no table never calls it: `_lookup`)
                        _pool_over_one_table(local, self.served_hotness, rows)
                else:
                    local = TritonSparseEmbedding([rows], dim, dtype=dtype)
                    if self.served[rank]:
                        _one_table_per_feature(local, [count for _, _, count, _ in layout])
            # Not a registered submodule: the state_dict keeps the key "weight" (and "sr_seed", below).
            self.__dict__["_triton"] = local
            self.weight = local.weight
            if stochastic:
                # The very tensor the update advances in place. Persistent: a resumed run must go on
                # drawing new rounding bits, not replay those of its first steps.
                self.register_buffer("sr_seed", local.sr_seed)
            self.use_fused_update = local.use_fused_update  # the owner's rows get the fused update
            self.fused_optimizer = True
        else:
            self.pooled_local = False
            self.weight = nn.Parameter(torch.empty(rows, dim))
        self._init_like_sparse_arch(list(cardinalities), layout)

    @torch.no_grad()
    def _init_like_sparse_arch(self, cardinalities: list[int], layout) -> None:
        """This rank's rows of the tables as `SparseArch.reset_parameters` initialises them from the same RNG state
        (`kernels.table_layout.init_tables_`): the same one draw of the init's seed, then only the chunks this
        rank's rows lie in (`kernels.table_layout.init_rows_`), never a whole table.

        Drawn in the shard's dtype: the one-process bf16 table is filled by ``uniform_`` on bf16 storage, which
        is not the fp32 draw rounded (on the CPU the two give different values from the same generator)."""
        seed = init_seed()  # even on a rank serving no table: the RNG stream after it is every rank's and one process's
        firsts = first_init_chunks(cardinalities)
        for f, start, count, at in layout:
            init_rows_(self.weight[at : at + count], cardinalities[f], start, seed, firsts[f])

    def rows(self, raw: torch.Tensor) -> torch.Tensor:
        """int64 [B, F] (or [B, L]) raw values -> int64 rows of the full (unsharded) weight (a PAD
        slot: its table's row 0; `forward` masks it)."""
        if not self.multi_hot:
            if self.hashing == "modulus":
                return modulus_rows(raw, self.cardinalities, self.offsets)
            return vocabulary_rows(raw, self.vocab_keys, self.vocab_offsets, self.offsets)
        f = self._slot_feature
        raw = torch.where(raw == PAD_SPARSE, torch.full_like(raw, -1), raw)
        if self.hashing == "modulus":
            return modulus_rows(raw, self.cardinalities[f], self.offsets[f])
        return vocabulary_rows(raw, self.vocab_keys, self.vocab_offsets, self.offsets[f], f)

    def _padded_batch(self, batch: int, global_batch: Optional[int]) -> int:
        if global_batch is None:
            # Unknown global batch (export, tests): ask the other ranks. A host sync, so the
            # training and evaluation steps always pass global_batch.
            n = torch.tensor([batch], device=self.weight.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            return int(n.item())
        padded = -(-global_batch // self.world_size)
        if batch > padded:
            raise ValueError(f"local batch {batch} is larger than ceil(global batch {global_batch} / {self.world_size})")
        return padded

    def _lookup(self, recv: torch.Tensor) -> torch.Tensor:
        """[W, P, served slots] received table rows -> [W, P, served features, D]: each served feature's
        slots summed (one slot a feature when one-hot), lookups outside this rank's block of a table
        (another rank's block, an empty slot, a padded sample: row -1) contributing zeros and no update."""
        W, P, S = recv.shape
        if S == 0:  # this rank serves no table (more ranks than tables): nothing to look up, but its part
            # of the exchange must take part in autograd, so that its backward all_to_all meets the others'
            return torch.zeros(W, P, 0, self.dim, dtype=self.weight.dtype, device=self.weight.device, requires_grad=True)
        if self.kernel == "triton":
            # the local raw values (`kernels.exchange_ids`): pooled, one table of R rows (raw r -> row r + 1 mod R),
            # a PAD slot skipped; one-hot, one table a served feature (`_one_table_per_feature`), a masked lookup
            # pointed at a row spread by its sample, not every one at row 0 of its block, whose address all of them
            # would contend for in the update's atomic adds
            raw, valid = local_ids(recv.view(W * P, S), self._base, self._count, self._local_offset, self.pooled_local)
            local = self.__dict__["_triton"]
            emb = local(raw).view(W, P, -1, self.dim)
            if not self.pooled_local and self.row_wise:  # (padded samples are cut off after the exchange)
                # where, not a multiply by the 0/1 mask: the row a masked lookup points at may hold NaN or Inf
                # (0 * NaN = NaN); its gradient is zero either way
                emb = torch.where(valid.view(W, P, S, 1), emb, 0.0)
            return emb
        t = recv - self._base
        valid = (t >= 0) & (t < self._count)
        local_rows = torch.where(valid, t + self._local_offset, torch.zeros_like(t))  # masked: row 0, no gradient
        if not self.multi_hot:
            return masked_embedding(local_rows, self.weight, valid)  # masked lookups left out of the gradient
        # bag (sample, served feature) holds that feature's slots, which lie together in the sample's row
        n = len(self.served_hotness)
        sample = torch.arange(W * P, device=recv.device)
        bag_starts = (sample.unsqueeze(1) * S + self._group_start).reshape(-1)
        bag = (sample.unsqueeze(1) * n + self._slot_group).reshape(-1)
        pooled = masked_embedding_bag(local_rows.reshape(-1), self.weight, valid.reshape(-1), bag_starts, bag)
        return pooled.view(W, P, n, self.dim)

    def _lookup_and_send(self, recv: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """`_lookup` of the [W, P, served slots] received rows, sent back with ``all_to_all_single`` (splits as
        it takes them) -> [sum(out_splits), D]. A multi-hot Triton shard with its fused update takes
        `dlrm.distributed.owner_exchange.PooledLookupExchange`: the same numbers, its backward sorting the rows
        while their gradients travel."""
        W, P, S = recv.shape
        local = self.__dict__.get("_triton")
        if S > 0 and self.kernel == "triton" and self.pooled_local and takes_fused_path(local):
            raw, _ = local_ids(recv.view(W * P, S), self._base, self._count, self._local_offset, True)
            return PooledLookupExchange.apply(raw, local._grad_trigger, local, out_splits, in_splits)
        return _AllToAll.apply(self._lookup(recv).reshape(-1, self.dim), out_splits, in_splits)

    def forward(self, raw: torch.Tensor, global_batch: Optional[int] = None) -> torch.Tensor:
        W, B = self.world_size, raw.shape[0]
        if raw.shape[1] != len(self._slot_feature):
            raise ValueError(f"sparse input has {raw.shape[1]} columns, the tables take {len(self._slot_feature)}")
        P = self._padded_batch(B, global_batch)
        sizes = [len(s) for s in self.served_slots]
        mine = sizes[self.rank]
        feats = [len(f) for f in self.served]  # what comes back: pooled per served feature
        triton_runs = self.kernel == "triton" or raw.is_cuda  # Triton's kernels: CUDA, or the CPU's interpreter

        # ids: rank q gets [P, slots of S_q] table rows, destination-major; padded samples and empty slots ask
        # for row -1, which no shard holds
        slots = [getattr(self, f"_send_slots_{q}") for q in range(W)]
        if triton_runs and self.hashing == "modulus":  # hashed and laid out in one pass (`kernels.exchange_ids`),
            # (every rank takes this path or none)
            send = send_ids(raw, self._slot_card, slots, P, self.multi_hot, self._id_dtype)
        else:
            table_rows = self.rows(raw) - self.offsets[self._slot_feature]
            if self.multi_hot:
                table_rows = torch.where(raw == PAD_SPARSE, torch.full_like(table_rows, -1), table_rows)
            send = send_ids_eager(table_rows, slots, P)
        recv = torch.empty(W * P * mine, dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send, [P * mine] * W, [P * s for s in sizes])

        # local lookup of what every rank asked for, pooled per feature ([W, P, |S_rank| features, D]), and the
        # embeddings back, in the shard's dtype (bf16: half the bytes): from rank q, [P, |S_q|, D]
        out = self._lookup_and_send(recv.view(W, P, mine), [P * n for n in feats], [P * feats[self.rank]] * W)
        # Row-wise parts summed in fp32 (at least) and rounded once more to the shard's dtype; the backward scales
        # the gradients by 1/W and sends them back in the shard's dtype, as the one-process lookup receives them.
        layout = ExchangeLayout(*self._exchange, *(getattr(self, f"_exchange_{n}") for n in EXCHANGE_TENSORS))
        if triton_runs and out.dtype in COMBINE_DTYPES:  # one Triton kernel a direction (its sums are fp32: a
            # shard made float64 by .double() takes the eager ops, which add in float64)
            return combine_received(out, layout, B, P, 1.0 / W)
        return combine_received_eager(out, layout, B, P, 1.0 / W)
