"""The planted teacher of `dlrm.data.synthetic` and the keyed hashing it rests on.

Every per-category quantity (a stored value, an effect, a latent vector) is a hash of
(seed, feature, purpose, category id), so no per-category table is ever materialised.
`sample_rows` draws feature rows (`expand_multi_hot` gives multi-hot features their further
values), `Teacher` gives them click probabilities, `category_values` and `category_ids` map
category ids to stored values and back, and `rank_auc` scores a model exactly.

Multi-hot: ids are [n, L] in the slot layout of `dlrm.data.schema.slot_offsets`, a feature's
values first and `PAD_SPARSE` after them. The teacher's per-category term of a feature is then
the mean of its values' effects (the missing effect when it has none), and its latent vector in
an interaction the mean of its values' damped latent vectors (zero when it has none). With all
sizes 1 both reduce to the one-hot formulas, computed by the one-hot code (bit for bit as before). The model itself is described in `dlrm.data.synthetic`'s module docstring.

Example:
    >>> import numpy as np
    >>> ids = np.arange(5)
    >>> values = category_values(0, 3, 100, ids)
    >>> bool((values >= 0).all() and (values < 2**32).all())
    True
    >>> category_ids(0, 3, 100, values).tolist()
    [0, 1, 2, 3, 4]
    >>> rank_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    0.75
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dlrm.data.schema import MISSING_DENSE, MISSING_SPARSE, NUM_DENSE, NUM_SPARSE, PAD_SPARSE, is_multi_hot, slot_offsets

TARGET_POSITIVE_RATE = 0.25
PILOT_ROWS = 1 << 17
"""Rows of the pilot sample the bias is tuned on (mean p error ~0.001)."""

# Dense columns (Criteo I1..I13): missing rate, mean and spread of log1p(count), and the
# teacher's logit slope per unit of log1p(count). Means are near the log of Criteo's medians.
_DENSE_MISSING = np.array([0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.001, 0.04, 0.45, 0.04, 0.45, 0.22])
_DENSE_MU = np.array([0.9, 1.6, 2.1, 1.7, 7.9, 3.5, 1.5, 2.2, 3.6, 0.5, 0.9, 0.4, 1.7])
_DENSE_SIGMA = np.array([1.0, 1.5, 1.2, 0.9, 1.6, 1.4, 1.3, 0.9, 1.3, 0.6, 0.9, 0.7, 1.0])
_DENSE_SLOPE = np.array([0.30, -0.10, 0.0, -0.20, -0.15, 0.08, 0.25, 0.0, 0.12, 0.40, 0.30, 0.15, -0.20])
_DENSE_CURVATURE = 0.15  # the peaked effect on DENSE_6: mid-range counts click most
_ACTIVITY_LOADING = 0.5  # correlation of log-counts through the shared activity factor
# DENSE_1 (I2) alone holds negative values: P(-1), P(-2), P(-3) among its present values.
_NEGATIVE_PROBS = np.array([0.06, 0.01, 0.005])

# Sparse features (C1..C26): missing rate, Zipf exponent, and the scale a_f of the category effects.
_SPARSE_MISSING = np.array([0.0, 0.0, 0.034, 0.034, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.034, 0.0,
                            0.0, 0.0, 0.034, 0.0, 0.0, 0.44, 0.44, 0.034, 0.45, 0.0, 0.034, 0.44, 0.44])
_SPARSE_ZIPF = np.array([1.10, 1.15, 1.05, 1.08, 1.20, 1.25, 1.12, 1.18, 1.30, 1.10, 1.15, 1.05, 1.12,
                         1.25, 1.10, 1.06, 1.20, 1.15, 1.12, 1.30, 1.08, 1.22, 1.25, 1.10, 1.18, 1.10])
_SPARSE_SCALE = np.array([0.55, 0.45, 0.65, 0.55, 0.40, 0.45, 0.50, 0.35, 0.30, 0.50, 0.40, 0.65, 0.40,
                          0.45, 0.50, 0.60, 0.30, 0.35, 0.45, 0.30, 0.55, 0.40, 0.35, 0.50, 0.40, 0.45])
_EFFECT_RANK_SCALE = 4.0  # K and alpha: category k's effect is damped by (1 + k / K) ** -alpha
_EFFECT_RANK_POWER = 1.0
# Latent interactions: (feature, feature, strength) among low-cardinality features.
_INTERACTIONS = ((5, 13, 0.6), (16, 19, 0.5), (21, 22, 0.5), (4, 24, 0.5))
_LATENT_RANK = 4
_LATENT_RANK_SCALE = 4.0
_LATENT_RANK_POWER = 0.5

# Hash "purposes": independent streams of per-category randomness for one (seed, feature).
_PURPOSE_VALUE, _PURPOSE_ROW, _PURPOSE_EFFECT, _PURPOSE_MISSING, _PURPOSE_LATENT = 1, 2, 3, 4, 16

_U64 = np.uint64
_M32 = 0xFFFFFFFF


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective, well-mixing map of uint64 (wraps on overflow)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _key(seed: int, feature: int, purpose: int) -> np.uint64:
    """The 64-bit key of one stream of per-category randomness."""
    packed = np.array([(seed << 24) ^ (feature << 12) ^ purpose], dtype=np.uint64)
    return _mix64(_mix64(packed))[0]


def _hash_u64(seed: int, feature: int, purpose: int, ids: np.ndarray) -> np.ndarray:
    """A uniform uint64 per id, fixed by (seed, feature, purpose, id)."""
    # SplitMix64's stream: the i-th output is mix64(key + i * golden), distinct for distinct i.
    return _mix64(_key(seed, feature, purpose) + ids.astype(np.uint64) * _U64(0x9E3779B97F4A7C15))


def _hash_normal(seed: int, feature: int, purpose: int, ids: np.ndarray) -> np.ndarray:
    """A standard normal per id, fixed by (seed, feature, purpose, id) (Box-Muller on two hashes)."""
    base = ids.astype(np.uint64) * _U64(2)
    u1 = ((_hash_u64(seed, feature, purpose, base) >> _U64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]
    u2 = (_hash_u64(seed, feature, purpose, base + _U64(1)) >> _U64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _row_permutation(seed: int, feature: int, cardinality: int) -> tuple[int, int]:
    """(a, b) of the affine permutation ``k -> (a * k + b) mod (cardinality - 1)`` of category ids."""
    n = cardinality - 1
    key = int(_key(seed, feature, _PURPOSE_ROW))
    a = 1 + (key & _M32) % n
    while math.gcd(a, n) != 1:  # a must be invertible mod n; some a <= n + 1 always is
        a += 1
    return a, (key >> 32) % n


def category_values(seed: int, feature: int, cardinality: int, ids: np.ndarray) -> np.ndarray:
    """The stored 32-bit hash value (int64) of each category id in ``[0, cardinality - 1)``.

    ``(value + 1) mod cardinality`` is ``1 + perm(id)`` for a seeded permutation, so modulus
    hashing puts each category on its own row and leaves row 0 to missing values; the
    quotient ``value // cardinality`` is a hash of the id, which spreads values over [0, 2^32).
    """
    a, b = _row_permutation(seed, feature, cardinality)
    row = 1 + (ids * a + b) % (cardinality - 1)
    quotients = (2**32 - cardinality) // cardinality + 1  # keeps value <= 2^32 - 2
    q = (_hash_u64(seed, feature, _PURPOSE_VALUE, ids) % _U64(quotients)).astype(np.int64)
    return row - 1 + cardinality * q


def category_ids(seed: int, feature: int, cardinality: int, values: np.ndarray) -> np.ndarray:
    """Inverse of `category_values`: the category id (int64) of each stored value (values >= 0)."""
    a, b = _row_permutation(seed, feature, cardinality)
    n = cardinality - 1
    return ((values + 1) % cardinality - 1 - b) % n * pow(a, -1, n) % n


@dataclass
class Rows:
    """A block of generated rows.

    dense: int32 [n, 13] as stored (missing = 0); dense_missing: bool [n, 13];
    ids: int64 [n, 26] category ids (missing = -1).
    """

    dense: np.ndarray
    dense_missing: np.ndarray
    ids: np.ndarray


def sample_rows(rng: np.random.Generator, n: int, cardinalities: list[int]) -> Rows:
    """Draw `n` rows of features (no labels) from `rng`."""
    activity = rng.standard_normal((n, 1))
    noise = rng.standard_normal((n, NUM_DENSE))
    z = _ACTIVITY_LOADING * activity + math.sqrt(1.0 - _ACTIVITY_LOADING**2) * noise
    log_count = _DENSE_MU + _DENSE_SIGMA * z
    # Clip below so counts are >= 0, and above before the cast: a 6-sigma DENSE_4 would overflow int32.
    dense = np.floor(np.expm1(np.clip(log_count, 0.0, math.log(2**31 - 1)))).astype(np.int32)
    negative = np.searchsorted(np.cumsum(_NEGATIVE_PROBS), rng.random(n), side="right")
    dense[:, 1] = np.where(negative < len(_NEGATIVE_PROBS), -1 - negative, dense[:, 1])
    dense_missing = rng.random((n, NUM_DENSE)) < _DENSE_MISSING
    dense[dense_missing] = MISSING_DENSE

    ids = np.empty((n, NUM_SPARSE), dtype=np.int64)
    u = rng.random((n, NUM_SPARSE))
    missing = rng.random((n, NUM_SPARSE)) < _SPARSE_MISSING
    for f, card in enumerate(cardinalities):
        ids[:, f] = _zipf_ids(u[:, f], f, card)
    ids[missing] = MISSING_SPARSE
    return Rows(dense=dense, dense_missing=dense_missing, ids=ids)


def _zipf_ids(u: np.ndarray, feature: int, card: int) -> np.ndarray:
    """Category ids of feature `feature` from uniforms `u` (any shape): card - 1 categories (row 0
    of the table is the missing row). Continuous power law x^-s on [1, card), floored:
    P(k) ~ (k + 1.5)^-s, and no per-category tables."""
    one_minus_s = 1.0 - _SPARSE_ZIPF[feature]
    x = (1.0 - u * (1.0 - float(card) ** one_minus_s)) ** (1.0 / one_minus_s)
    return np.minimum(np.floor(x).astype(np.int64) - 1, card - 2)


MULTI_HOT_FILLS = ("fixed", "variable")


def expand_multi_hot(rng: np.random.Generator, ids: np.ndarray, cardinalities: list[int], sizes: list[int],
                     fill: str) -> np.ndarray:
    """Category ids [n, L] in the multi-hot slot layout, from one-hot ids [n, 26] (`sample_rows`).

    A one-hot feature (size 1) keeps its id. A multi-hot feature of size s keeps its id as its
    first value and draws its others from the same power law (repeats allowed, as in real logs);
    with `fill` "fixed" every row has s values, with "variable" a uniform 1..s. A row whose
    feature `sample_rows` made missing has no values at all (an empty list), so a multi-hot list
    never holds -1; the slots after a row's values hold `PAD_SPARSE`. Draws from `rng` only here.
    """
    if fill not in MULTI_HOT_FILLS:
        raise ValueError(f"multi-hot fill must be one of {', '.join(MULTI_HOT_FILLS)}, got {fill!r}")
    n, offsets = ids.shape[0], slot_offsets(sizes)
    out = np.empty((n, offsets[-1]), dtype=np.int64)
    for f, size in enumerate(sizes):
        lo, hi = offsets[f], offsets[f + 1]
        out[:, lo] = ids[:, f]
        if size == 1:
            continue
        out[:, lo + 1 : hi] = _zipf_ids(rng.random((n, size - 1)), f, cardinalities[f])
        lengths = np.full(n, size) if fill == "fixed" else rng.integers(1, size + 1, n)
        lengths[ids[:, f] < 0] = 0
        out[:, lo:hi][np.arange(size)[None, :] >= lengths[:, None]] = PAD_SPARSE
    return out


# Tuned biases by `Teacher.pilot_key`: the pilot costs ~1 s of CPU one-hot (seconds multi-hot) whatever the rows
# written, and a process that makes several datasets of one seed and cardinalities (the tests: 40 pilots of 19
# distinct teachers in 8 files, 2026-12-05) tuned the same bias again each time. The bisection is deterministic, so
# the value kept is the one it would compute again, bit for bit.
_TUNED_BIAS: dict[tuple, float] = {}


class Teacher:
    """The planted click model (see the module docstring).

    Args:
        seed: the dataset seed (fixes every per-category effect).
        cardinalities: 26 category counts.
        bias: the logit bias; None tunes it on a pilot sample to `TARGET_POSITIVE_RATE`.
        multi_hot_sizes: values per feature (None: one-hot); ids and stored values are then
            [n, L] in the slot layout (see the module docstring).
        multi_hot_fill: how the pilot sample fills multi-hot features (`expand_multi_hot`).
    """

    def __init__(self, seed: int, cardinalities: list[int], bias: Optional[float] = None,
                 multi_hot_sizes: Optional[list[int]] = None, multi_hot_fill: str = "fixed") -> None:
        self.seed = seed
        self.cardinalities = list(cardinalities)
        self.multi_hot_sizes = list(multi_hot_sizes) if is_multi_hot(multi_hot_sizes) else None
        self.multi_hot_fill = multi_hot_fill
        self.offsets = slot_offsets(self.multi_hot_sizes)
        self.bias = 0.0
        if bias is None:
            key = self.pilot_key()
            if key not in _TUNED_BIAS:
                _TUNED_BIAS[key] = self._tune_bias()
            bias = _TUNED_BIAS[key]
        self.bias = float(bias)

    def pilot_key(self) -> tuple:
        """What the tuned bias depends on (the pilot's rows and the logits are functions of these alone; the class too,
        as a subclass may compute its logits otherwise)."""
        sizes = None if self.multi_hot_sizes is None else tuple(int(n) for n in self.multi_hot_sizes)
        return type(self), int(self.seed), tuple(int(c) for c in self.cardinalities), sizes, self.multi_hot_fill

    def logit(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Teacher logits (float64 [n]) of stored dense counts [n, 13] and category ids [n, L]
        (L = 26 when one-hot; multi-hot: the slot layout, `PAD_SPARSE` in empty slots)."""
        logit = np.full(dense.shape[0], self.bias)
        centered = np.log1p(np.maximum(dense, 0).astype(np.float64)) - _DENSE_MU
        for j in range(NUM_DENSE):
            logit += _DENSE_SLOPE[j] * centered[:, j]
        logit -= _DENSE_CURVATURE * centered[:, 6] ** 2
        for f in range(NUM_SPARSE):
            lo, hi = self.offsets[f], self.offsets[f + 1]
            missing_effect = _hash_normal(self.seed, f, _PURPOSE_MISSING, np.zeros(1, dtype=np.int64))[0]
            if hi - lo > 1:
                logit += _SPARSE_SCALE[f] * self._mean_effect(f, ids[:, lo:hi], missing_effect)
                continue
            k = ids[:, lo]
            present = k >= 0
            k0 = np.maximum(k, 0)
            effect = _hash_normal(self.seed, f, _PURPOSE_EFFECT, k0) * (1.0 + k0 / _EFFECT_RANK_SCALE) ** -_EFFECT_RANK_POWER
            logit += _SPARSE_SCALE[f] * np.where(present, effect, missing_effect)
        for f, g, strength in _INTERACTIONS:
            (f0, f1), (g0, g1) = self.offsets[f : f + 2], self.offsets[g : g + 2]
            if f1 - f0 == 1 and g1 - g0 == 1:
                logit += strength * self._latent_dot(f, g, ids[:, f0], ids[:, g0])
            else:
                logit += strength * self._mean_latent_dot(f, g, ids[:, f0:f1], ids[:, g0:g1])
        return logit

    def _mean_effect(self, f: int, block: np.ndarray, missing_effect: float) -> np.ndarray:
        """The per-category term of multi-hot feature `f` (ids [n, s]): the mean of its values'
        effects, or `missing_effect` for a row without values."""
        present = block >= 0
        k0 = np.maximum(block, 0)
        effect = _hash_normal(self.seed, f, _PURPOSE_EFFECT, k0) * (1.0 + k0 / _EFFECT_RANK_SCALE) ** -_EFFECT_RANK_POWER
        count = present.sum(axis=1)
        mean = np.where(present, effect, 0.0).sum(axis=1) / np.maximum(count, 1)
        return np.where(count > 0, mean, missing_effect)

    def _mean_latent(self, f: int, block: np.ndarray, r: int) -> np.ndarray:
        """Component `r` of feature `f`'s latent vector per row (ids [n, s]): the mean of its
        values' damped latent components, zero for a row without values."""
        present = block >= 0
        k0 = np.maximum(block, 0)
        u = _hash_normal(self.seed, f, _PURPOSE_LATENT + r, k0) * (1.0 + k0 / _LATENT_RANK_SCALE) ** -_LATENT_RANK_POWER
        return np.where(present, u, 0.0).sum(axis=1) / np.maximum(present.sum(axis=1), 1)

    def _mean_latent_dot(self, f: int, g: int, bf: np.ndarray, bg: np.ndarray) -> np.ndarray:
        """<mean u_f, mean u_g> / sqrt(R) of multi-hot blocks (one-hot: `_latent_dot`'s value)."""
        dot = np.zeros(bf.shape[0])
        for r in range(_LATENT_RANK):
            dot += self._mean_latent(f, bf, r) * self._mean_latent(g, bg, r)
        return dot / math.sqrt(_LATENT_RANK)

    def _latent_dot(self, f: int, g: int, kf: np.ndarray, kg: np.ndarray) -> np.ndarray:
        """<u_f(kf), u_g(kg)> / sqrt(R), zero where either category is missing."""
        kf0, kg0 = np.maximum(kf, 0), np.maximum(kg, 0)
        dot = np.zeros(kf.shape[0])
        for r in range(_LATENT_RANK):
            dot += (_hash_normal(self.seed, f, _PURPOSE_LATENT + r, kf0)
                    * _hash_normal(self.seed, g, _PURPOSE_LATENT + r, kg0))
        damp = ((1.0 + kf0 / _LATENT_RANK_SCALE) * (1.0 + kg0 / _LATENT_RANK_SCALE)) ** -_LATENT_RANK_POWER
        return np.where((kf >= 0) & (kg >= 0), damp * dot / math.sqrt(_LATENT_RANK), 0.0)

    def probability(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Click probabilities (float64 [n]) of stored dense counts and category ids."""
        return 1.0 / (1.0 + np.exp(-self.logit(dense, ids)))

    def probability_of_stored(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """Click probabilities of rows as stored: dense int [n, 13], raw sparse values [n, L]
        (as a loader's `Batch.sparse` holds them: -1 missing, -2 an empty multi-hot slot)."""
        if not is_multi_hot(self.multi_hot_sizes):
            ids = np.full(sparse.shape, MISSING_SPARSE, dtype=np.int64)
            for f in range(NUM_SPARSE):
                present = sparse[:, f] >= 0
                ids[present, f] = category_ids(self.seed, f, self.cardinalities[f], sparse[present, f])
            return self.probability(dense, ids)
        ids = sparse.astype(np.int64, copy=True)  # -1 and -2 stay as they are
        for f in range(NUM_SPARSE):
            block = ids[:, self.offsets[f] : self.offsets[f + 1]]
            present = block >= 0
            block[present] = category_ids(self.seed, f, self.cardinalities[f], block[present])
        return self.probability(dense, ids)

    def _tune_bias(self) -> float:
        """The bias whose mean pilot probability is `TARGET_POSITIVE_RATE` (bisection)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1]))
        rows = sample_rows(rng, PILOT_ROWS, self.cardinalities)
        ids = rows.ids
        if self.multi_hot_sizes is not None:  # its own stream: the one-hot pilot stays as it was
            more = np.random.default_rng(np.random.SeedSequence([self.seed, 1, 1]))
            ids = expand_multi_hot(more, ids, self.cardinalities, self.multi_hot_sizes, self.multi_hot_fill)
        base = self.logit(rows.dense, ids) - self.bias
        lo, hi = -20.0, 20.0
        for _ in range(60):  # 40 / 2^60: far below float64 resolution of the bias
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(base + mid)))) < TARGET_POSITIVE_RATE:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)


def rank_auc(scores: np.ndarray, labels: np.ndarray) -> Optional[float]:
    """Exact ROC AUC (Mann-Whitney U, tied scores get their average rank); None if one class is absent.

    Integer arithmetic on doubled ranks keeps it exact for any number of rows.
    """
    labels = labels.astype(bool)
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return None
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    below = np.cumsum(counts) - counts  # rows with a strictly smaller score
    doubled_rank = 2 * below + counts + 1  # twice the average 1-based rank of each distinct score
    u_doubled = int(doubled_rank[inverse[labels]].sum()) - positives * (positives + 1)
    return u_doubled / (2 * positives * negatives)
