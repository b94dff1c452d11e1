"""Raw Criteo hash values to embedding rows, on the model's device (see dlrm/data/schema.py).

The per-step functions are plain tensor ops with static output shapes: no host sync, so they
run inside torch.compile graphs and CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch

# Raw values lie in [-1, 2**32); adding feature * 2**33 gives every feature its own key range,
# so one sorted array and one searchsorted serve all features at once.
_FEATURE_SHIFT = 1 << 33
# Vocabulary values in [-2**32, 2**32) keep feature f's keys in [f * 2**33 - 2**32, f * 2**33 + 2**32).
VOCABULARY_VALUE_LIMIT = 1 << 32  # vocabulary values lie in [-limit, limit): 32-bit hashes
_VALUE_LIMIT = VOCABULARY_VALUE_LIMIT


def _check_vocabulary_range(feature: int, vocab: torch.Tensor) -> None:
    """Raise ValueError when a vocabulary value lies outside ``[-2**32, 2**32)`` (keys would collide)."""
    if vocab.numel() and not (int(vocab.min()) >= -_VALUE_LIMIT and int(vocab.max()) < _VALUE_LIMIT):
        raise ValueError(f"feature {feature}: vocabulary values must lie in [-2**32, 2**32)")


def modulus_rows(raw: torch.Tensor, cardinalities: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Global row of each value: ``offsets[f] + (raw + 1) mod cardinalities[f]``.

    Args:
        raw: int64 [B, F] raw hash values (missing = -1, which lands on each table's row 0).
        cardinalities: int64 [F] table sizes.
        offsets: int64 [F] first row of each table in the shared weight.
    Returns:
        int64 [B, F] rows into the shared weight.

    Example:
        >>> modulus_rows(torch.tensor([[0, 2], [-1, 7]]), torch.tensor([5, 3]), torch.tensor([0, 5])).tolist()
        [[1, 5], [0, 7]]
    """
    return torch.remainder(raw + 1, cardinalities) + offsets


def keyed_vocabulary(vocabs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-feature sorted vocabularies into one sorted key array (done once, at build).

    Each vocabulary must be 1-D, sorted ascending and unique, with values in ``[-2**32, 2**32)`` (32-bit
    hashes do; ValueError otherwise): then each feature's keys stay inside its own ``2**33``-wide range
    and the array stays sorted.

    Args:
        vocabs: F int64 tensors, each feature's vocabulary (V values in all).

    Returns:
        keys: int64 [V] with ``keys = value + feature * 2**33``, sorted.
        vocab_offsets: int64 [F + 1], start of each feature's vocabulary in `keys`.

    Example:
        >>> keys, vocab_offsets = keyed_vocabulary([torch.tensor([10, 20]), torch.tensor([5])])
        >>> (keys - torch.tensor([0, 0, 2**33])).tolist(), vocab_offsets.tolist()
        ([10, 20, 5], [0, 2, 3])
    """
    for f, v in enumerate(vocabs):
        # `vocabulary_rows`' searchsorted is only exact on sorted, unique keys: an unsorted or repeated vocabulary put
        # in-vocabulary values on the out-of-vocabulary row, silently, in every eager module (SparseArch,
        # PooledSparseArch, ShardedSparseArch, the baseline's RowHasher), where the Triton modules refuse it.
        if v.dim() != 1 or (v.numel() > 1 and not bool((v[1:] > v[:-1]).all())):
            raise ValueError(f"feature {f}: vocabulary must be a 1-D tensor sorted ascending and unique")
        _check_vocabulary_range(f, v)
    sizes = torch.tensor([0] + [len(v) for v in vocabs], dtype=torch.int64)
    keys = torch.cat([v.to(torch.int64) + f * _FEATURE_SHIFT for f, v in enumerate(vocabs)])
    return keys, torch.cumsum(sizes, 0)


def vocabulary_rows(
    raw: torch.Tensor, keys: torch.Tensor, vocab_offsets: torch.Tensor, offsets: torch.Tensor,
    features: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Global row of each value under vocabulary hashing.

    Row ``offsets[f] + 1 + i`` when ``raw == vocab_f[i]``, else ``offsets[f]`` (the shared
    out-of-vocabulary row, which missing values also use). Exact for every int64 ``raw``: a key
    found outside feature f's own segment of `keys` (a raw value far outside the 32-bit range
    whose key lands in another feature's range) is out of vocabulary.

    Args:
        raw: int64 [B, C]: column c holds values of feature ``features[c]``.
        keys, vocab_offsets: from `keyed_vocabulary`.
        offsets: int64 [C] first row of each column's table.
        features: int64 [C], the feature of each column (multi-hot slots); None: column c is feature c.
    Returns:
        int64 [B, C] rows into the shared weight.

    Example:
        >>> keys, vocab_offsets = keyed_vocabulary([torch.tensor([10, 20]), torch.tensor([5])])   # tables of 3, 2 rows
        >>> raw = torch.tensor([[20, 5], [7, -1]])   # 7 is not in feature 0's vocabulary; -1: missing
        >>> vocabulary_rows(raw, keys, vocab_offsets, torch.tensor([0, 3])).tolist()
        [[2, 4], [0, 3]]
    """
    if features is None:
        features = torch.arange(raw.shape[1], device=raw.device, dtype=torch.int64)
    # contiguous: searchsorted copies a strided input itself (a transposed batch keeps its strides through the
    # add), with a UserWarning in the user's log; the copy made here costs the same and says nothing
    keyed_raw = (raw + features * _FEATURE_SHIFT).contiguous()
    pos = torch.searchsorted(keys, keyed_raw)
    # An empty vocabulary array would make the gather below index out of range; keep a dummy key.
    safe_keys = keys if keys.numel() else torch.full((1,), -1, dtype=torch.int64, device=raw.device)
    lo, hi = vocab_offsets[:-1][features], vocab_offsets[1:][features]
    in_segment = (pos >= lo) & (pos < hi)
    found = in_segment & (safe_keys[pos.clamp(max=safe_keys.numel() - 1)] == keyed_raw)
    local = torch.where(found, pos - lo + 1, torch.zeros_like(pos))
    return local + offsets
