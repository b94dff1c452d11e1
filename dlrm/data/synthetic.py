"""Synthetic Criteo-format click logs with labels from a planted teacher.

Rows look like Criteo's (Kaggle display-advertising) logs and follow `dlrm.data.schema`:

* 13 dense counts ``DENSE_0..12`` (Criteo's I1..I13): ``floor(expm1(N(mu, sigma)))`` per
  column, so ``log1p(count)`` is roughly normal and the counts are heavy-tailed; a shared
  per-row "activity" factor correlates the columns. Each column has a Criteo-like missing
  rate (0-45%); a missing count is stored as 0. ``DENSE_1`` (Criteo's I2) is sometimes
  -1, -2 or -3, as I2 is.
* 26 categorical features ``SPARSE_0..25`` (C1..C26). Feature f draws a category id
  ``k in [0, cardinality_f)`` from a truncated power law with Zipf exponent 1.05-1.3,
  so id 0 is the most frequent category. The stored value is a fixed pseudo-random 32-bit
  "hash" of k: a keyed bijection of the 32-bit integers, hence distinct within a feature,
  invertible (`category_ids`) and deterministic in the seed. Missing rates are Criteo-like
  (mostly 0-5%, four features ~45%); a missing category is stored as -1.

The teacher (`Teacher`) gives every row a click probability ``p = sigmoid(logit)``::

    logit = bias
          + sum_j  b_j * (log1p(max(dense_j, 0)) - mu_j)        # dense log-count effects
          - c * (log1p(max(dense_6, 0)) - mu_6) ** 2            # one non-linear (peaked) effect
          + sum_f  a_f * z_f(k_f) / (1 + k_f / K)               # per-category effects
          + sum_(f,g) s_fg * <u_f(k_f), u_g(k_g)> / sqrt(R)     # a few latent interactions

and the label is ``Bernoulli(p)``. ``z_f(k)`` and the latent vectors ``u_f(k)`` (rank R,
zero for a missing category) are standard normals hashed from (seed, feature, k), so no
per-category table is ever materialised, even for Kaggle's 10M-category features. The
``1 / (1 + k / K)`` factor puts the large effects on the frequent categories: what a model
can learn from a modest sample is most of the signal. A missing category has its own effect.
The interactions pair low-cardinality features, whose categories are all frequent. ``bias``
is tuned on a fixed-size pilot sample so that the positive rate is ~25%. The teacher is a
function of the stored values only (dense as stored, categories via `category_ids`), so
`Teacher.probability_of_stored` recomputes p from a parquet file.

Usage::

    python -m dlrm.data.synthetic --rows 200000 --out data/sample --seed 0 --cardinalities tiny --test-fraction 0
    python -m dlrm.data.synthetic --regime small-real --out data/small-real --raw-tsv data/small-real.txt

Regimes (`REGIMES`, ``--regime``) are presets of the settings above plus how the tables are sized:

* ``default``: what the options say; the metadata's table sizes are the preset's category counts
  (every category has its own row).
* ``small-real``: a small real click log, as issue #21 met it: 10,000 rows (``--rows`` changes it)
  split 8,572 / 714 / 714 like ``python -m dlrm.preprocess --split sequential`` splits 10,000 lines,
  the Criteo Kaggle category counts (up to 10M a feature), so that most values are rare (measured at
  10,000 rows: 76% of the 41,000 distinct train values occur once; 79% of 3,053 at 300 rows, where
  the 300 real lines of ../shared/criteo have 82% of 3,134), and the teacher's signal is mostly
  additive (log-count slopes and per-category effects), which a linear model captures well. Its
  table sizes are those the preprocessor would give (distinct train values + 1 per feature, modulus
  hashing), not the 33.8M rows of the category counts; the ``--raw-tsv`` twin goes through
  ``python -m dlrm.preprocess`` like a real log (e.g. with ``--hashing vocabulary --min-frequency auto``).

Rows are generated in fixed chunks of `CHUNK_ROWS`, each from its own random stream derived
from (seed, chunk index), so the data depend only on (seed, rows, cardinalities, split
fractions); the parquet layout options only cut them into files. The splits are contiguous
ranges in generation order: train, then validation, then test.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from loguru import logger
from tqdm import tqdm

from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    MISSING_DENSE,
    MISSING_SPARSE,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    SPLITS,
    Metadata,
    SplitInfo,
    arrow_schema,
    write_metadata,
)
from dlrm.errors import report_bug
from dlrm.logging_setup import configure_logging

GENERATOR_VERSION = 1
"""Bumped whenever the same seed and settings would produce different rows."""

CARDINALITY_PRESETS: dict[str, list[int]] = {
    # The embedded data/sample: "small" divided by 10 (features of <= 30 values keep their size), so
    # 150k rows see every category often enough for a CPU model to get within 0.02 of the oracle AUC.
    "tiny": [30, 20, 400, 250, 10, 24, 80, 20, 3, 150, 60, 400, 50,
             27, 90, 350, 10, 60, 40, 4, 350, 18, 15, 200, 6, 180],
    # Scaled-down Kaggle shapes (the 3..27-sized features keep their real sizes) for CPU samples.
    "small": [300, 200, 4000, 2500, 100, 24, 800, 200, 3, 1500, 600, 4000, 500,
              27, 900, 3500, 10, 600, 400, 4, 3500, 18, 15, 2000, 60, 1800],
    # The table sizes of the Criteo Kaggle display-advertising challenge (distinct values per feature).
    "kaggle": [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572],
}

@dataclass(frozen=True)
class Regime:
    """A preset of `generate`'s settings (see the module docstring).

    Attributes:
        cardinalities: the `CARDINALITY_PRESETS` name of the category counts.
        rows: rows when the caller gives none (None: the caller must).
        validation_fraction, test_fraction: the split.
        table_sizes: "categories" (a row per category) or "distinct" (distinct train values + 1,
            the preprocessor's modulus rule).
    """

    cardinalities: str
    rows: Optional[int]
    validation_fraction: float
    test_fraction: float
    table_sizes: str


REGIMES: dict[str, Regime] = {
    "default": Regime("small", None, 0.1, 0.1, "categories"),
    # 1/14 each: the sizes --split sequential gives the same number of lines (8,572 / 714 / 714 of 10,000)
    "small-real": Regime("kaggle", 10_000, 1 / 14, 1 / 14, "distinct"),
}

TARGET_POSITIVE_RATE = 0.25
CHUNK_ROWS = 1 << 16
"""Rows per generation chunk; fixed so the data do not depend on memory or file settings."""
ROW_GROUP_ROWS = 1 << 17
"""Rows per parquet row group (~10 MB decoded): large enough to compress well, small enough
for a loader to shuffle and prefetch row groups."""
PILOT_ROWS = 1 << 17
"""Rows of the pilot sample the bias is tuned on (mean p error ~0.001)."""
COMPRESSION = "zstd"
DEFAULT_ROWS_PER_FILE = 1_000_000

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
        # card - 1 categories (row 0 of the table is the missing row). Continuous power law
        # x^-s on [1, card), floored: P(k) ~ (k + 1.5)^-s, and no per-category tables.
        one_minus_s = 1.0 - _SPARSE_ZIPF[f]
        x = (1.0 - u[:, f] * (1.0 - float(card) ** one_minus_s)) ** (1.0 / one_minus_s)
        ids[:, f] = np.minimum(np.floor(x).astype(np.int64) - 1, card - 2)
    ids[missing] = MISSING_SPARSE
    return Rows(dense=dense, dense_missing=dense_missing, ids=ids)


class Teacher:
    """The planted click model (see the module docstring).

    Args:
        seed: the dataset seed (fixes every per-category effect).
        cardinalities: 26 category counts.
        bias: the logit bias; None tunes it on a pilot sample to `TARGET_POSITIVE_RATE`.
    """

    def __init__(self, seed: int, cardinalities: list[int], bias: Optional[float] = None) -> None:
        self.seed = seed
        self.cardinalities = list(cardinalities)
        self.bias = 0.0
        self.bias = self._tune_bias() if bias is None else float(bias)

    def logit(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Teacher logits (float64 [n]) of stored dense counts [n, 13] and category ids [n, 26]."""
        logit = np.full(dense.shape[0], self.bias)
        centered = np.log1p(np.maximum(dense, 0).astype(np.float64)) - _DENSE_MU
        for j in range(NUM_DENSE):
            logit += _DENSE_SLOPE[j] * centered[:, j]
        logit -= _DENSE_CURVATURE * centered[:, 6] ** 2
        for f in range(NUM_SPARSE):
            k = ids[:, f]
            present = k >= 0
            k0 = np.maximum(k, 0)
            effect = _hash_normal(self.seed, f, _PURPOSE_EFFECT, k0) * (1.0 + k0 / _EFFECT_RANK_SCALE) ** -_EFFECT_RANK_POWER
            missing_effect = _hash_normal(self.seed, f, _PURPOSE_MISSING, np.zeros(1, dtype=np.int64))[0]
            logit += _SPARSE_SCALE[f] * np.where(present, effect, missing_effect)
        for f, g, strength in _INTERACTIONS:
            logit += strength * self._latent_dot(f, g, ids[:, f], ids[:, g])
        return logit

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
        """Click probabilities of rows as stored: dense int [n, 13], raw sparse values [n, 26]."""
        ids = np.full(sparse.shape, MISSING_SPARSE, dtype=np.int64)
        for f in range(NUM_SPARSE):
            present = sparse[:, f] >= 0
            ids[present, f] = category_ids(self.seed, f, self.cardinalities[f], sparse[present, f])
        return self.probability(dense, ids)

    def _tune_bias(self) -> float:
        """The bias whose mean pilot probability is `TARGET_POSITIVE_RATE` (bisection)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1]))
        rows = sample_rows(rng, PILOT_ROWS, self.cardinalities)
        base = self.logit(rows.dense, rows.ids) - self.bias
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


def _table(labels: np.ndarray, rows: Rows, sparse: np.ndarray) -> pa.Table:
    """Rows as an arrow table with the dataset schema."""
    cols = [pa.array(labels, pa.int8())]
    cols += [pa.array(rows.dense[:, j]) for j in range(NUM_DENSE)]
    cols += [pa.array(sparse[:, f]) for f in range(NUM_SPARSE)]
    return pa.Table.from_arrays(cols, schema=arrow_schema())


class _SplitWriter:
    """Writes one split as parquet files of `rows_per_file` rows, in row groups of `ROW_GROUP_ROWS`."""

    def __init__(self, root: Path, split: str, rows_per_file: int) -> None:
        self.root, self.split, self.rows_per_file = root, split, rows_per_file
        self.files: list[str] = []
        self._writer: Optional[pq.ParquetWriter] = None
        self._file_rows = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def append(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self._room():
            self._write(self._room())

    def close(self) -> None:
        if self._pending_rows:
            self._write(self._pending_rows)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _room(self) -> int:
        """Rows the next row group takes: a full group, or what the current file has left."""
        return min(ROW_GROUP_ROWS, self.rows_per_file - self._file_rows)

    def _write(self, n: int) -> None:
        pending = pa.concat_tables(self._pending)
        group, rest = pending.slice(0, n).combine_chunks(), pending.slice(n)
        self._pending, self._pending_rows = [rest], rest.num_rows
        if self._writer is None:
            rel = f"{self.split}/part-{len(self.files):05d}.parquet"
            (self.root / self.split).mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.root / rel, arrow_schema(), compression=COMPRESSION)
            self.files.append(rel)
        self._writer.write_table(group, row_group_size=n)
        self._file_rows += n
        if self._file_rows == self.rows_per_file:
            self._writer.close()
            self._writer, self._file_rows = None, 0


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)


def _hex8(values: np.ndarray) -> np.ndarray:
    """Values in [0, 2^32) as 8-digit lowercase hex strings (object array), vectorised."""
    nibbles = (values.astype(np.uint64)[:, None] >> _NIBBLE_SHIFTS) & _U64(0xF)
    return np.ascontiguousarray(_HEX_DIGITS[nibbles]).view("S8").ravel().astype(str).astype(object)


def _tsv_block(labels: np.ndarray, rows: Rows, sparse: np.ndarray) -> str:
    """Rows in Kaggle's train.txt format: label, I1..I13, C1..C26, tab-separated, missing = empty."""
    cols: dict[str, object] = {"label": labels}
    for j in range(NUM_DENSE):
        cols[f"I{j + 1}"] = pd.array(rows.dense[:, j], dtype="Int32")
        cols[f"I{j + 1}"][rows.dense_missing[:, j]] = pd.NA
    for f in range(NUM_SPARSE):
        text = _hex8(np.maximum(sparse[:, f], 0))
        text[sparse[:, f] < 0] = None
        cols[f"C{f + 1}"] = text
    return pd.DataFrame(cols).to_csv(sep="\t", header=False, index=False, na_rep="", lineterminator="\n")


def split_sizes(rows: int, validation_fraction: float, test_fraction: float) -> dict[str, int]:
    """Rows per split (validation and test rounded, train takes the rest)."""
    validation = round(rows * validation_fraction)
    test = round(rows * test_fraction)
    return {"train": rows - validation - test, "validation": validation, "test": test}


def regenerate_command(out: str, rows: int, seed: int, cardinalities: str, validation_fraction: float,
                       test_fraction: float, rows_per_file: int, regime: str = "default") -> str:
    """The command line that writes the same parquet files again."""
    return (f"python -m dlrm.data.synthetic --rows {rows} --out {out} --seed {seed} --cardinalities {cardinalities}"
            f" --validation-fraction {validation_fraction:g} --test-fraction {test_fraction:g}"
            f" --rows-per-file {rows_per_file}" + (f" --regime {regime}" if regime != "default" else ""))


def teacher_cardinalities(meta: Metadata) -> list[int]:
    """The category counts the teacher of a generated dataset used (its tables may be smaller)."""
    preset = meta.extra.get("cardinality_preset")
    return CARDINALITY_PRESETS[preset] if preset in CARDINALITY_PRESETS else list(meta.cardinalities)


def _distinct_tables(values: list[np.ndarray]) -> list[int]:
    """Table sizes the preprocessor's modulus hashing gives: distinct train values + 1 per feature."""
    return [int(np.unique(v).size) + 1 for v in values]


def _check_target(path: Path, overwrite: bool, what: str) -> None:
    """Raise a one-line `click.ClickException` unless `path` may be (over)written."""
    if path.is_dir() and what == "file":
        raise click.ClickException(f"{path} is a directory, expected a file path for the raw TSV")
    if path.exists() and not path.is_dir() and what == "directory":
        raise click.ClickException(f"{path} exists and is not a directory")
    occupied = path.is_file() or (path.is_dir() and any(path.iterdir()))
    if occupied and not overwrite:
        raise click.ClickException(f"refusing to overwrite non-empty {path} (pass --overwrite to replace it)")


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an old `out` is set aside first and removed only after."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the dataset is an ordinary readable directory
    os.replace(tmp, out)  # rename(2) also replaces an empty directory
    if old is not None:
        shutil.rmtree(old)


def generate(
    out: str | os.PathLike,
    rows: Optional[int] = None,
    seed: int = 0,
    cardinalities: Optional[str] = None,
    raw_tsv: Optional[str | os.PathLike] = None,
    validation_fraction: Optional[float] = None,
    test_fraction: Optional[float] = None,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    overwrite: bool = False,
    regime: str = "default",
) -> Metadata:
    """Write a synthetic dataset directory at `out` (and optionally the raw TSV); returns its metadata.

    `rows`, `cardinalities` and the fractions left None come from `regime` (`REGIMES`; "default":
    "small" categories, 10% validation, 10% test, rows required).

    Everything is written into temporary siblings that are renamed into place at the end, so
    an interrupted run leaves no partial dataset behind. Raises `click.ClickException` if
    `out` (or `raw_tsv`) is non-empty and `overwrite` is False, or the settings are invalid.

    Example:
        >>> meta = generate("/tmp/small-real", regime="small-real", overwrite=True)   # doctest: +SKIP
        >>> {s: i.rows for s, i in meta.splits.items()}                                # doctest: +SKIP
        {'train': 8572, 'validation': 714, 'test': 714}
    """
    if regime not in REGIMES:
        raise click.ClickException(f"unknown regime {regime!r} (expected one of {', '.join(REGIMES)})")
    preset = REGIMES[regime]
    rows = preset.rows if rows is None else rows
    if rows is None:
        raise click.ClickException("--rows: required (or a --regime that sets it, e.g. small-real)")
    cardinalities = preset.cardinalities if cardinalities is None else cardinalities
    validation_fraction = preset.validation_fraction if validation_fraction is None else validation_fraction
    test_fraction = preset.test_fraction if test_fraction is None else test_fraction
    out = Path(out)
    sizes = split_sizes(rows, validation_fraction, test_fraction)
    if sizes["train"] < 1:
        raise click.ClickException(f"validation and test fractions leave no training rows out of {rows}")
    if cardinalities not in CARDINALITY_PRESETS:
        raise click.ClickException(f"unknown cardinalities {cardinalities!r} (expected one of {', '.join(CARDINALITY_PRESETS)})")
    _check_target(out, overwrite, "directory")
    tsv_path = Path(raw_tsv) if raw_tsv is not None else None
    if tsv_path is not None:
        _check_target(tsv_path, overwrite, "file")
    cards = CARDINALITY_PRESETS[cardinalities]
    started = time.perf_counter()
    teacher = Teacher(seed, cards)
    logger.info(f"teacher bias {teacher.bias:.4f}; writing {rows} rows ({sizes}) to {out}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tsv_tmp = None
    try:
        bounds = np.cumsum([0] + [sizes[s] for s in SPLITS])
        writers = {s: _SplitWriter(tmp, s, rows_per_file) for s in SPLITS if sizes[s]}
        probs: dict[str, list[np.ndarray]] = {s: [] for s in writers}
        labels_of: dict[str, list[np.ndarray]] = {s: [] for s in writers}
        train_values: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(NUM_SPARSE)]  # "distinct" tables
        tsv = None
        if tsv_path is not None:
            tsv_path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{tsv_path.name}.", suffix=".tmp", dir=tsv_path.parent)
            tsv_tmp = Path(name)
            tsv = os.fdopen(fd, "w")
        with tqdm(total=rows, unit="row", unit_scale=True, desc="generating", disable=None) as bar:
            for chunk, start in enumerate(range(0, rows, CHUNK_ROWS)):
                n = min(CHUNK_ROWS, rows - start)
                rng = np.random.default_rng(np.random.SeedSequence([seed, 0, chunk]))
                block = sample_rows(rng, n, cards)
                p = teacher.probability(block.dense, block.ids)
                labels = (rng.random(n) < p).astype(np.int8)
                sparse = np.full((n, NUM_SPARSE), MISSING_SPARSE, dtype=np.int64)
                for f in range(NUM_SPARSE):
                    present = block.ids[:, f] >= 0
                    sparse[present, f] = category_values(seed, f, cards[f], block.ids[present, f])
                table = _table(labels, block, sparse)
                for i, split in enumerate(SPLITS):
                    lo, hi = max(bounds[i] - start, 0), min(bounds[i + 1] - start, n)
                    if lo < hi:
                        writers[split].append(table.slice(lo, hi - lo))
                        probs[split].append(p[lo:hi])
                        labels_of[split].append(labels[lo:hi])
                        if split == "train" and preset.table_sizes == "distinct":
                            for f in range(NUM_SPARSE):
                                col = sparse[lo:hi, f]
                                train_values[f] = np.union1d(train_values[f], col[col >= 0])
                if tsv is not None:
                    tsv.write(_tsv_block(labels, block, sparse))
                bar.update(n)
        for w in writers.values():
            w.close()
        if tsv is not None:
            tsv.close()

        splits, oracle = {}, {}
        for split, w in writers.items():
            y = np.concatenate(labels_of[split])
            splits[split] = SplitInfo(rows=int(y.size), positives=int(y.sum()), files=w.files)
            oracle[split] = rank_auc(np.concatenate(probs[split]), y)
        extra = {
            "generator": "dlrm.data.synthetic",
            "generator_version": GENERATOR_VERSION,
            "command": regenerate_command(str(out), rows, seed, cardinalities, validation_fraction,
                                          test_fraction, rows_per_file, regime),
            "regime": regime,
            "seed": seed,
            "rows": rows,
            "cardinality_preset": cardinalities,
            "validation_fraction": validation_fraction,
            "test_fraction": test_fraction,
            "rows_per_file": rows_per_file,
            "row_group_rows": ROW_GROUP_ROWS,
            "compression": COMPRESSION,
            "teacher": {
                "bias": teacher.bias,
                "target_positive_rate": TARGET_POSITIVE_RATE,
                "interactions": [[f, g] for f, g, _ in _INTERACTIONS],
                "latent_rank": _LATENT_RANK,
            },
            "oracle_auc": oracle,
        }
        tables = _distinct_tables(train_values) if preset.table_sizes == "distinct" else cards
        meta = Metadata(cardinalities=tables, hashing="modulus", splits=splits, extra=extra)
        write_metadata(tmp, meta)  # last file of the dataset: marks it complete
        _replace_dir(tmp, out)
        if tsv_tmp is not None:
            os.chmod(tsv_tmp, 0o644)  # mkstemp makes 0600; the finished file gets an ordinary file's mode
            os.replace(tsv_tmp, tsv_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if tsv_tmp is not None:
            tsv_tmp.unlink(missing_ok=True)
        raise
    total_pos = sum(s.positives for s in splits.values())
    logger.info(
        f"wrote {out} in {time.perf_counter() - started:.1f}s: positive rate {total_pos / rows:.4f}, "
        + ", ".join(f"{s} oracle AUC {a:.4f}" for s, a in oracle.items() if a is not None)
    )
    return meta


EXIT_BAD_INPUT = 2
"""Exit code for bad arguments and unwritable or occupied outputs (click's usage errors use it too)."""
EXIT_OUT_OF_MEMORY = 4
EXIT_INTERRUPTED = 130


def _check_parent_writable(path: Path, option: str) -> None:
    """Raise a one-line `click.ClickException` unless `path` could be created: its nearest
    existing ancestor must be a writable directory (checked before any work starts)."""
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise click.ClickException(f"{option} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise click.ClickException(f"{option} {path}: directory {ancestor} is not writable")


def _report(exc: BaseException) -> int:
    """Log the failure in one line (a bug: traceback and a bug line); return the exit code."""
    if isinstance(exc, click.ClickException):  # generate()'s and the CLI's checks of the arguments and outputs
        logger.error(exc.format_message())
        return EXIT_BAD_INPUT
    if isinstance(exc, OSError):  # the file system refused a write: full, read-only, permissions
        where = f"{exc.filename}: " if exc.filename else ""
        logger.error(f"cannot write the dataset: {where}{exc.strerror or exc}")
        return EXIT_BAD_INPUT
    if isinstance(exc, MemoryError):
        logger.error("out of host memory: generate fewer --rows")
        return EXIT_OUT_OF_MEMORY
    if isinstance(exc, KeyboardInterrupt):
        logger.error("interrupted (Ctrl-C); no partial dataset was left behind")
        return EXIT_INTERRUPTED
    return report_bug(exc)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rows", type=click.IntRange(min=1), default=None,
              help="Total rows over all splits (required unless --regime sets it: small-real 10,000).")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Dataset directory to create.")
@click.option("--seed", type=click.IntRange(min=0, max=2**31 - 1), default=0, show_default=True)
@click.option("--cardinalities", type=click.Choice(sorted(CARDINALITY_PRESETS)), default=None,
              help="tiny: the embedded sample (3..400); small: CPU-sized tables (3..4000); kaggle: the Criteo Kaggle "
                   "table sizes [default: the regime's: small, or kaggle for small-real].")
@click.option("--raw-tsv", type=click.Path(dir_okay=False), default=None,
              help="Also write all rows (train, validation, test) in Kaggle's raw train.txt format.")
@click.option("--validation-fraction", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="[default: the regime's: 0.1, or 1/14 for small-real]")
@click.option("--test-fraction", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="[default: the regime's: 0.1, or 1/14 for small-real]")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=DEFAULT_ROWS_PER_FILE, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out directory (and --raw-tsv file).")
@click.option("--regime", type=click.Choice(sorted(REGIMES)), default="default", show_default=True,
              help="A preset (module docstring): small-real = a 10,000-line real click log's shape (Kaggle category "
                   "counts, most values rare, 8,572/714/714 split, tables sized like the preprocessor's).")
def main(rows, out, seed, cardinalities, raw_tsv, validation_fraction, test_fraction, rows_per_file, overwrite,
         regime):
    """Generate a synthetic Criteo-format dataset with a planted teacher (see the module docstring).

    Exit codes: 0 done; 1 a bug (traceback, then a line saying so); 2 bad arguments, an occupied
    or unwritable output; 4 out of memory; 130 Ctrl-C.
    """
    configure_logging()
    try:
        _check_parent_writable(Path(out), "--out")
        if raw_tsv is not None:
            _check_parent_writable(Path(raw_tsv), "--raw-tsv")
        generate(out, rows, seed, cardinalities, raw_tsv, validation_fraction, test_fraction, rows_per_file, overwrite,
                 regime)
    except (Exception, KeyboardInterrupt) as e:
        sys.exit(_report(e))


if __name__ == "__main__":
    main()
