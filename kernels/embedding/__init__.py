"""Hashed embedding lookup for all sparse features in one launch, with a fused sparse optimizer backward.

Notation: ``B`` batch, ``F`` sparse features, ``D`` embedding dim, ``N = B * F`` lookup positions,
``R = sum(cardinalities)`` rows of the single concatenated table.

Contract (matches the eager ``SparseArch``):

* one weight ``[R, D]``; per-feature ``cardinalities [F]`` and ``offsets [F]`` (exclusive cumsum), int64,
  laid out and initialised by `kernels.table_layout`;
* raw input ``raw [B, F]`` int64: 32-bit Criteo hash values, missing = -1 (any int64 is accepted);
* hashing (modulus or vocabulary mode): `kernels.embedding.hashing`, the same rows as ``dlrm.model.hashing``.

One file per job:

* `hashing`: the hashing kernel (``dlrm_kernels::hash_rows``) and the hashing step the lookup fuses;
* `lookup`: the lookup forward (``dlrm_kernels::embedding_lookup``, ``dlrm_kernels::fused_embedding``);
* `update`: the sorted segment-sum kernels of the fused sparse optimizer update and of the plain
  lookup's dense backward (``dlrm_kernels::embedding_sparse_update_``, ``dlrm_kernels::embedding_dense_grad``);
  `segment_chunk` / `segment_carry` its two kernels, `row_update` the optimizer rules, `rounding` bf16 rounding;
* `atomic_update`: plain SGD with atomic adds on fp32 tables (non-deterministic), and its op that hashes the raw
  values itself (``dlrm_kernels::embedding_sgd_atomic_hashed_``: the lookup then writes no rows);
* `select_sum`: sums of gradient rows picked by a 0/1 matrix (fp32 gradients as three exact bf16 parts);
* `module`: ``TritonSparseEmbedding`` and its ``SparseOptimizerConfig``; `fused_switch`: the switch to the
  in-backward update it shares with ``dlrm.model.fused_sparse`` (the weight frozen, a zero-size grad trigger);
* `pooled`: the multi-hot (sum-pooled) lookup with ``PAD_SPARSE`` slots, its fused update (the same
  segment kernels) with stochastic rounding for bf16 tables; `pooled_module`: ``TritonPooledEmbedding``.

Launch configs live in `kernels.heuristics`.
"""

from kernels.embedding.hashing import hash_rows
from kernels.embedding.lookup import embedding_lookup, fused_embedding
from kernels.embedding.module import SparseOptimizerConfig, TritonSparseEmbedding
from kernels.embedding.pooled import (
    PAD_SPARSE,
    PooledLayout,
    fused_pooled_embedding,
    pooled_embedding_lookup,
    pooled_embedding_sparse_update_,
    pooled_hash_rows,
    pooled_layout,
)
from kernels.embedding.pooled_module import TritonPooledEmbedding
from kernels.embedding.update import OPTIMIZERS, embedding_sparse_update_, init_sparse_optimizer_state

__all__ = [
    "OPTIMIZERS",
    "PAD_SPARSE",
    "PooledLayout",
    "SparseOptimizerConfig",
    "TritonPooledEmbedding",
    "TritonSparseEmbedding",
    "embedding_lookup",
    "embedding_sparse_update_",
    "fused_embedding",
    "fused_pooled_embedding",
    "hash_rows",
    "init_sparse_optimizer_state",
    "pooled_embedding_lookup",
    "pooled_embedding_sparse_update_",
    "pooled_hash_rows",
    "pooled_layout",
]
