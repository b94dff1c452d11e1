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

The teacher (`Teacher`, in `dlrm.data.teacher`) gives every row a click probability ``p = sigmoid(logit)``::

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

Multi-hot (``--multi-hot-sizes``, e.g. ``mlperf`` for MLPerf DLRM-DCNv2's 26 sizes, 214 values a
row, with ``--cardinalities mlperf`` for its table sizes): a feature of size s > 1 holds up to s
values. ``--sparse-layout`` says how they are stored (`dlrm.data.schema`): ``slots`` (the default,
schema version 3) as s int64 columns ``SPARSE_<f>_0 .. SPARSE_<f>_<s-1>``, -2 in a slot that holds
no value, which the loaders read 1.6-2x faster; ``lists`` (version 2) as one list column. The rows are
the same in either (the layout only stores them). A feature's first value is the one-hot feature's category
(a missing one makes the list empty), its others are further draws from the same power law;
``--multi-hot-fill fixed`` gives every present list s values, ``variable`` a uniform 1..s (both
from their own random stream, `dlrm.data.teacher.expand_multi_hot`). The teacher then scores a
feature by the mean of its values' effects and latent vectors (`dlrm.data.teacher`), and the
oracle AUC is computed from the very probabilities the labels were drawn from. Without the
option (all sizes 1) the output is byte for byte what it was before multi-hot existed.

Usage::

    python -m dlrm.data.synthetic --rows 200000 --out data/sample --seed 0 --cardinalities tiny --test-fraction 0
    python -m dlrm.data.synthetic --rows 100000 --out data/mlperf-mh --cardinalities mlperf --multi-hot-sizes mlperf
    python -m dlrm.data.synthetic --rows 10000000 --out /tmp/mh --cardinalities small --multi-hot-sizes mlperf --workers 0
    python -m dlrm.data.synthetic --regime small-real --out data/small-real --raw-tsv data/small-real.txt

Regimes (`REGIMES`, ``--regime``) are presets of the settings above plus how the tables are sized:

* ``default``: what the options say; the metadata's table sizes are the preset's category counts
  (every category has its own row).
* ``small-real``: a small real click log, as issue #21 met it: 10,000 rows (``--rows`` changes it)
  split as ``python -m dlrm.preprocess --split sequential`` splits as many lines (8,572 / 714 / 714 of 10,000),
  the Criteo Kaggle category counts (up to 10M a feature), so that most values are rare (measured at
  10,000 rows: 76% of the 41,000 distinct train values occur once; 79% of 3,053 at 300 rows, where
  the 300 real lines of ../shared/criteo have 82% of 3,134), and the teacher's signal is mostly
  additive (log-count slopes and per-category effects), which a linear model captures well. Its
  table sizes are those the preprocessor would give (distinct train values + 1 per feature, modulus
  hashing), not the 33.8M rows of the category counts; the ``--raw-tsv`` twin goes through
  ``python -m dlrm.preprocess`` like a real log (e.g. with ``--hashing vocabulary --min-frequency auto``).

Rows are generated in fixed chunks of `CHUNK_ROWS`, each from its own random stream derived
from (seed, chunk index), so the data depend only on (seed, rows, cardinalities, split
fractions); the parquet options only cut them into files and store them (``--sparse-layout``,
``--compression``), and ``--workers N`` only computes the chunks in N processes
(`dlrm.data.synthetic_chunks`). The splits are contiguous ranges in generation order: train, then
validation, then test (small-real: train, test, validation, the order ``--split sequential`` cuts its twin in).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import shlex
import shutil
import sys
import tempfile
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click
import numpy as np
from loguru import logger

from dlrm.data.output_dirs import (check_apart, check_named, check_parent_writable, check_replaceable, check_target,
                                   check_unowned, output_lock, recover_replaced, remove_stale_temps)
from dlrm.data.schema import (
    MAX_MULTI_HOT_SIZE, MLPERF_CARDINALITIES, MLPERF_MULTI_HOT_SIZES, NUM_SPARSE, SPARSE_LAYOUTS, SPLITS, Metadata,
    SplitInfo, arrow_schema, is_multi_hot, one_hot_sizes, slot_offsets, write_options, write_metadata,
)
# The planted teacher and its hashing live in dlrm.data.teacher; every name is re-exported here,
# where the tests and other modules import them from.
from dlrm.data.teacher import (  # noqa: F401
    _ACTIVITY_LOADING, _DENSE_CURVATURE, _DENSE_MISSING, _DENSE_MU, _DENSE_SIGMA, _DENSE_SLOPE,
    _EFFECT_RANK_POWER, _EFFECT_RANK_SCALE, _INTERACTIONS, _LATENT_RANK, _LATENT_RANK_POWER, _LATENT_RANK_SCALE,
    _M32, _NEGATIVE_PROBS, _PURPOSE_EFFECT, _PURPOSE_LATENT, _PURPOSE_MISSING, _PURPOSE_ROW, _PURPOSE_VALUE,
    _SPARSE_MISSING, _SPARSE_SCALE, _SPARSE_ZIPF, _U64, PILOT_ROWS, TARGET_POSITIVE_RATE, Rows, Teacher,
    MULTI_HOT_FILLS, _hash_normal, _hash_u64, _key, _mix64, _row_permutation, category_ids, category_values,
    expand_multi_hot, rank_auc, sample_rows,
)
from dlrm.errors import report_bug
from dlrm.logging_setup import ProgressBar, configure_logging, counted
from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand
from dlrm.stop_signal import EXIT_INTERRUPTED, StopAtOnce, interruption  # noqa: F401 - EXIT_INTERRUPTED re-exported

GENERATOR_VERSION = 3
"""Bumped whenever the same seed and settings would produce different rows or splits (2: small-real's split sizes as
``--split sequential``'s at every row count; 3: its rows too, test before validation; 2026-12-01; the rows are v1's)."""

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
    # MLPerf DLRM-DCNv2's tables (Criteo 1TB, capped at 40M rows); effects are hashed, never materialised.
    "mlperf": list(MLPERF_CARDINALITIES),
}

MULTI_HOT_PRESETS: dict[str, list[int]] = {
    "one-hot": one_hot_sizes(),
    # MLPerf DLRM-DCNv2's multi-hot Criteo: 214 values a row.
    "mlperf": list(MLPERF_MULTI_HOT_SIZES),
}


def parse_multi_hot_sizes(text: str) -> list[int]:
    """``--multi-hot-sizes``: a `MULTI_HOT_PRESETS` name or 26 comma-separated integers >= 1;
    raises `click.BadParameter` (one line) otherwise."""
    if text in MULTI_HOT_PRESETS:
        return list(MULTI_HOT_PRESETS[text])
    parts = text.split(",")
    if len(parts) != NUM_SPARSE or not all(p.strip().isdecimal() and int(p) >= 1 for p in parts):  # isdigit() admits '²'
        raise click.BadParameter(f"{text!r:.80} is not {' or '.join(MULTI_HOT_PRESETS)} or {NUM_SPARSE} "
                                 "comma-separated integers >= 1")
    return [int(p) for p in parts]


def multi_hot_label(sizes: list[int]) -> str:
    """How ``--multi-hot-sizes`` spells `sizes`: its preset's name, else the 26 integers."""
    names = [name for name, preset in MULTI_HOT_PRESETS.items() if preset == list(sizes)]
    return names[0] if names else ",".join(str(size) for size in sizes)

@dataclass(frozen=True)
class Regime:
    """A preset of `generate`'s settings (see the module docstring).

    Attributes:
        cardinalities: the `CARDINALITY_PRESETS` name of the category counts.
        rows: rows when the caller gives none (None: the caller must).
        validation_fraction, test_fraction: the split.
        table_sizes: "categories" (a row per category) or "distinct" (distinct train values + 1,
            the preprocessor's modulus rule).
        sequential: given its own fractions, split as ``--split sequential`` splits as many lines (`sequential_sizes`).
    """

    cardinalities: str
    rows: Optional[int]
    validation_fraction: float
    test_fraction: float
    table_sizes: str
    sequential: bool = False


REGIMES: dict[str, Regime] = {
    "default": Regime("small", None, 0.1, 0.1, "categories"),
    # 1/14 each: the sizes --split sequential gives the same number of lines (8,572 / 714 / 714 of 10,000)
    "small-real": Regime("kaggle", 10_000, 1 / 14, 1 / 14, "distinct", sequential=True),
}

from dlrm.data.synthetic_chunks import CHUNK_ROWS, chunks  # noqa: E402,F401 - CHUNK_ROWS re-exported
from dlrm.data.synthetic_io import (COMPRESSION, ROW_GROUP_ROWS, SPARSE_LAYOUT, _SplitWriter, _table,  # noqa: E402
                                    _tsv_block, publish, refuse_one_hot_options, stored_layout)  # the writers
from dlrm.data.preprocess.options import CODECS  # noqa: E402 - the same codecs as preprocessing
from dlrm.data.preprocess.splits import sequential_sizes  # noqa: E402 - small-real's split, the preprocessor's

DEFAULT_ROWS_PER_FILE = 1_000_000
MAX_SEED = 2**31 - 1  # --seed's range (2^40 overflows `dlrm.data.teacher._key`)


def split_sizes(rows: int, validation_fraction: float, test_fraction: float) -> dict[str, int]:
    """Rows per split (validation and test rounded, train takes the rest)."""
    validation, test = round(rows * validation_fraction), round(rows * test_fraction)
    return {"train": rows - validation - test, "validation": validation, "test": test}


def _exact(x: float) -> str:
    """`x` as the command writes it: %g where that reads back as `x`, else every digit (%g wrote 1/14 as 0.0714286)."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(float(x))


def regenerate_command(out: str, rows: int, seed: int, cardinalities: str, validation_fraction: float,
                       test_fraction: float, rows_per_file: int, regime: str = "default",
                       multi_hot_sizes: Optional[list[int]] = None, multi_hot_fill: str = "fixed",
                       compression: str = COMPRESSION, sparse_layout: str = SPARSE_LAYOUT) -> str:
    """The command line that writes the same parquet files again (the multi-hot options, the layout
    included, only when multi-hot and the codec only when not the default, so a one-hot command reads
    as it always did and a multi-hot one names its layout whatever the default becomes)."""
    multi_hot = (f" --multi-hot-sizes {multi_hot_label(multi_hot_sizes)} --multi-hot-fill {multi_hot_fill}"
                 f" --sparse-layout {sparse_layout}" if is_multi_hot(multi_hot_sizes) else "")
    return (f"python -m dlrm.data.synthetic --rows {rows} --out {shlex.quote(out)} --seed {seed} --cardinalities "
            f"{cardinalities} --validation-fraction {_exact(validation_fraction)} --test-fraction {_exact(test_fraction)}"
            f" --rows-per-file {rows_per_file}" + (f" --regime {regime}" if regime != "default" else "") + multi_hot
            + (f" --compression {compression}" if compression != COMPRESSION else ""))


def _distinct_tables(values: list[np.ndarray]) -> list[int]:
    """Table sizes the preprocessor's modulus hashing gives: distinct train values (`_Splits.add` keeps them) + 1."""
    return [int(v.size) + 1 for v in values]  # (np.unique hashes them on numpy >= 2.3: ~1 us a value)


@dataclass(frozen=True)
class _Settings:
    """`generate`'s arguments with the regime's defaults filled in, checked (see `_settings`)."""

    out: Path
    tsv_path: Optional[Path]
    rows: int
    seed: int
    cardinalities: str
    validation_fraction: float
    test_fraction: float
    rows_per_file: int
    regime: str
    table_sizes: str
    sizes: dict[str, int]
    multi_hot_sizes: Optional[list[int]] = None  # None: one-hot
    multi_hot_fill: str = "fixed"
    compression: str = COMPRESSION
    sparse_layout: str = "lists"  # `stored_layout`: what a one-hot dataset reads back as

    @property
    def cards(self) -> list[int]:
        """The 26 category counts of the teacher."""
        return CARDINALITY_PRESETS[self.cardinalities]


def _check_numbers(rows, seed, validation_fraction, test_fraction, rows_per_file, workers) -> tuple:
    """The CLI's ranges, for `generate`'s callers too (out of them a run failed after the work with a traceback, from
    pyarrow, numpy or round(); workers < 0 was taken as one per CPU), as Python numbers (numpy's: not JSON)."""
    for name, value, low, high in (("rows", rows, 1, None), ("seed", seed, 0, MAX_SEED),
                                   ("rows_per_file", rows_per_file, 1, None), ("workers", workers, 0, None)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (high and value > high):
            raise click.ClickException(f"{name}: {value!r:.40} is not an integer in [{low}, {high or 'inf'}]")
    for name, value in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
            raise click.ClickException(f"{name}: {value!r:.40} is not a number in [0, 1)")
    return int(rows), int(seed), float(validation_fraction), float(test_fraction), int(rows_per_file)


def _settings(out: str | os.PathLike, rows: Optional[int], seed: int, cardinalities: Optional[str],
              raw_tsv: Optional[str | os.PathLike], validation_fraction: Optional[float],
              test_fraction: Optional[float], rows_per_file: int, overwrite: bool, regime: str,
              multi_hot_sizes: Optional[list[int] | str] = None, multi_hot_fill: str = "fixed",
              compression: str = COMPRESSION, sparse_layout: str = SPARSE_LAYOUT, workers: int = 1) -> _Settings:
    """`generate`'s arguments resolved against `regime`; raises `click.ClickException` on bad ones."""
    if regime not in REGIMES:
        raise click.ClickException(f"unknown regime {regime!r} (expected one of {', '.join(REGIMES)})")
    preset = REGIMES[regime]
    rows = preset.rows if rows is None else rows
    if rows is None:
        raise click.ClickException("--rows: required (or a --regime that sets it, e.g. small-real)")
    cardinalities = preset.cardinalities if cardinalities is None else cardinalities
    validation_fraction = preset.validation_fraction if validation_fraction is None else validation_fraction
    test_fraction = preset.test_fraction if test_fraction is None else test_fraction
    rows, seed, validation_fraction, test_fraction, rows_per_file = _check_numbers(
        rows, seed, validation_fraction, test_fraction, rows_per_file, workers)
    out = Path(out)
    check_named(out, "--out")
    # small-real: its TSV twin's sizes (1/14 rounded gave 1,714 train rows of 2,000, the twin 1,715: other tables)
    sequential = sequential_sizes(rows) if preset.sequential and (validation_fraction, test_fraction) == (
        preset.validation_fraction, preset.test_fraction) else None
    sizes = sequential or split_sizes(rows, validation_fraction, test_fraction)
    if sizes["train"] < 1:
        raise click.ClickException(f"validation and test fractions leave no training rows out of {rows}")
    empty = [s for s, f in (("validation", validation_fraction), ("test", test_fraction)) if f > 0 and not sizes[s]]
    if empty:  # a fraction rounded to no row wrote no such split, silently (train.py: "has no 'validation' split")
        what = (f"--regime {regime}'s split (--split sequential's) of {counted(rows, 'row')} leaves"
                if sizes is sequential else f"--{empty[0]}-fraction of {counted(rows, 'row')} rounds to")
        raise click.ClickException(f"{what} no {empty[0]} row (more --rows{'' if sizes is sequential else ', or 0'})")
    if cardinalities not in CARDINALITY_PRESETS:
        raise click.ClickException(f"unknown cardinalities {cardinalities!r} (expected one of {', '.join(CARDINALITY_PRESETS)})")
    if isinstance(multi_hot_sizes, str):
        try:
            multi_hot_sizes = parse_multi_hot_sizes(multi_hot_sizes)
        except click.BadParameter as e:
            raise click.ClickException(f"--multi-hot-sizes: {e.format_message()}") from None
    if multi_hot_sizes is not None and (len(multi_hot_sizes) != NUM_SPARSE or min(multi_hot_sizes) < 1):
        raise click.ClickException(f"--multi-hot-sizes: need {NUM_SPARSE} integers >= 1, got {multi_hot_sizes}")
    if multi_hot_sizes is not None and max(multi_hot_sizes) > MAX_MULTI_HOT_SIZE:
        # the readers and the preprocessor refuse larger sizes; generating them would only run out of memory
        f = next(i for i, size in enumerate(multi_hot_sizes) if size > MAX_MULTI_HOT_SIZE)
        raise click.ClickException(f"--multi-hot-sizes: SPARSE_{f}'s size {multi_hot_sizes[f]} is above the cap of "
                                   f"{MAX_MULTI_HOT_SIZE} values a feature")
    if multi_hot_fill not in MULTI_HOT_FILLS:
        raise click.ClickException(f"--multi-hot-fill: {multi_hot_fill!r} is not one of {', '.join(MULTI_HOT_FILLS)}")
    if compression not in CODECS:
        raise click.ClickException(f"--compression: {compression!r} is not one of {', '.join(CODECS)}")
    if sparse_layout not in SPARSE_LAYOUTS:
        raise click.ClickException(f"--sparse-layout: {sparse_layout!r:.40} is not one of {', '.join(SPARSE_LAYOUTS)}")
    check_target(out, overwrite, "directory", "--out")
    check_unowned(out, "--out")  # (a dataset, run or sweep around it: replaced with it, or listing it as its own)
    check_replaceable(out, "--out")  # (--overwrite of a folder that holds no dataset)
    tsv_path = Path(raw_tsv) if raw_tsv is not None else None
    if tsv_path is not None:
        # --out is renamed into place whole: a TSV inside it would have no directory, or go with the old dataset
        check_apart("--out", out, "--raw-tsv", tsv_path, "write the TSV outside the dataset directory, which is "
                    "replaced as a whole")
        check_target(tsv_path, overwrite, "file", "--raw-tsv")  # (also a FIFO or dangling link, without --overwrite)
    return _Settings(out, tsv_path, rows, seed, cardinalities, validation_fraction, test_fraction, rows_per_file,
                     regime, preset.table_sizes, sizes,
                     list(multi_hot_sizes) if is_multi_hot(multi_hot_sizes) else None, multi_hot_fill, compression,
                     stored_layout(multi_hot_sizes, sparse_layout))


class _Splits:
    """The splits being written under `root`: their parquet writers, and what the metadata needs
    of their rows (probabilities and labels for the oracle AUC, distinct train values if asked)."""

    def __init__(self, root: Path, sizes: dict[str, int], rows_per_file: int, distinct: bool,
                 multi_hot_sizes: Optional[list[int]] = None, compression: str = COMPRESSION,
                 layout: str = SPARSE_LAYOUT) -> None:
        self.order = list(sizes)  # row ranges in this order (small-real: train, test, validation, as in its TSV twin)
        self.bounds = np.cumsum([0] + [sizes[s] for s in self.order])
        self.multi_hot_sizes, self.layout = multi_hot_sizes, layout
        self.offsets = slot_offsets(multi_hot_sizes)
        schema = arrow_schema(multi_hot_sizes, layout)
        options = write_options(multi_hot_sizes, layout)
        self.writers = {s: _SplitWriter(root, s, rows_per_file, schema, compression, options)
                        for s in SPLITS if sizes[s]}
        self.probs: dict[str, list[np.ndarray]] = {s: [] for s in self.writers}
        self.labels: dict[str, list[np.ndarray]] = {s: [] for s in self.writers}
        self.distinct = distinct
        self.train_values: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(NUM_SPARSE)]

    def add(self, start: int, block: Rows, p: np.ndarray, labels: np.ndarray, sparse: np.ndarray) -> None:
        """Append the rows that begin at row `start` of the dataset to the splits they fall in."""
        n = labels.size
        table = _table(labels, block, sparse, self.multi_hot_sizes, self.layout)
        for i, split in enumerate(self.order):
            lo, hi = max(self.bounds[i] - start, 0), min(self.bounds[i + 1] - start, n)
            if lo < hi:
                self.writers[split].append(table.slice(lo, hi - lo))
                self.probs[split].append(p[lo:hi])
                self.labels[split].append(labels[lo:hi])
                if split == "train" and self.distinct:  # by a sort: np.union1d hashes on numpy >= 2.3 (3.2 s, 0.03)
                    for f, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:])):
                        v = np.sort(np.concatenate([self.train_values[f], sparse[lo:hi, a:b].ravel()]))
                        self.train_values[f] = v[(v >= 0) & np.concatenate(([True], v[1:] != v[:-1]))]

    def close(self) -> None:
        for w in self.writers.values():
            w.close()

    def summary(self) -> tuple[dict[str, SplitInfo], dict[str, Optional[float]]]:
        """Each split's `SplitInfo` and oracle AUC (the teacher's probabilities scored on its labels)."""
        splits, oracle = {}, {}
        for split, w in self.writers.items():
            y = np.concatenate(self.labels[split])
            splits[split] = SplitInfo(rows=int(y.size), positives=int(y.sum()), files=w.files)
            oracle[split] = rank_auc(np.concatenate(self.probs[split]), y)
        return splits, oracle


def _write_rows(s: _Settings, teacher: Teacher, splits: _Splits, tsv, workers: int = 1) -> None:
    """Generate all rows chunk by chunk (`dlrm.data.synthetic_chunks.chunks`, in `workers` processes)
    into `splits`, and into the open `tsv` file if not None."""
    with ProgressBar(total=s.rows, unit="row", unit_scale=True, desc="generating", disable=None) as bar:
        for start, (block, p, labels, sparse) in chunks(s.seed, s.rows, s.cards, teacher, s.multi_hot_sizes,
                                                        s.multi_hot_fill, workers):
            splits.add(start, block, p, labels, sparse)
            if tsv is not None:
                tsv.write(_tsv_block(labels, block, sparse, s.multi_hot_sizes))
            bar.update(labels.size)


def _metadata(s: _Settings, teacher: Teacher, splits: _Splits) -> Metadata:
    """The dataset's metadata once every split is written."""
    infos, oracle = splits.summary()
    extra = {
        "generator": "dlrm.data.synthetic",
        "generator_version": GENERATOR_VERSION,
        "command": regenerate_command(str(s.out), s.rows, s.seed, s.cardinalities, s.validation_fraction,
                                      s.test_fraction, s.rows_per_file, s.regime, s.multi_hot_sizes,
                                      s.multi_hot_fill, s.compression, s.sparse_layout),
        "regime": s.regime,
        "seed": s.seed,
        "rows": s.rows,
        "cardinality_preset": s.cardinalities,
        "validation_fraction": s.validation_fraction,
        "test_fraction": s.test_fraction,
        "rows_per_file": s.rows_per_file,
        "row_group_rows": ROW_GROUP_ROWS,
        "compression": s.compression,
        "teacher": {
            "bias": teacher.bias,
            "target_positive_rate": TARGET_POSITIVE_RATE,
            "interactions": [[f, g] for f, g, _ in _INTERACTIONS],
            "latent_rank": _LATENT_RANK,
        },
        "oracle_auc": oracle,
    }
    if s.multi_hot_sizes is not None:  # absent when one-hot: its metadata stays as it was
        extra["multi_hot_fill"] = s.multi_hot_fill
        extra["teacher"]["multi_hot"] = "mean of the values' effects and latent vectors"
    tables = _distinct_tables(splits.train_values) if s.table_sizes == "distinct" else s.cards
    return Metadata(cardinalities=tables, multi_hot_sizes=s.multi_hot_sizes or one_hot_sizes(), hashing="modulus",
                    splits=infos, extra=extra, sparse_layout=s.sparse_layout)


def _done_line(s: _Settings, meta: Metadata, seconds: float) -> str:
    """The log line of a finished dataset (and of its --raw-tsv file): time, positive rate, oracle AUC per split."""
    total_pos = sum(i.positives for i in meta.splits.values())
    aucs = [f"{split} oracle AUC {a:.4f}" for split, a in meta.extra["oracle_auc"].items() if a is not None]
    wrote = f"{s.out} and its raw TSV {s.tsv_path}" if s.tsv_path is not None else f"{s.out}"  # both made: both named
    return ", ".join([f"wrote {wrote} in {seconds:.1f}s: positive rate {total_pos / s.rows:.4f}", *aucs])  # none: no ", "


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
    multi_hot_sizes: Optional[list[int] | str] = None,
    multi_hot_fill: str = "fixed",
    workers: int = 1,
    compression: str = COMPRESSION,
    sparse_layout: str = SPARSE_LAYOUT,
) -> Metadata:
    """Write a synthetic dataset directory at `out` (and optionally the raw TSV); returns its metadata.

    `rows`, `cardinalities` and the fractions left None come from `regime` (`REGIMES`; "default":
    "small" categories, 10% validation, 10% test, rows required). `multi_hot_sizes`: 26 sizes or
    a `MULTI_HOT_PRESETS` name (None: one-hot); `multi_hot_fill`: "fixed" or "variable" (see the
    module docstring). `workers`: processes that compute the rows (0: one per CPU); the output is
    the same whatever their number. `compression`: the parquet codec (`CODECS`; the rows are the same in any).
    `sparse_layout`: "slots" or "lists", how multi-hot features are stored (the same rows in either;
    one-hot data are the same files in both).

    Everything is written into temporary siblings that are renamed into place at the end, so
    an interrupted run leaves no partial dataset behind. Raises `click.ClickException` if
    `out` (or `raw_tsv`) is non-empty and `overwrite` is False, or the settings are invalid.

    Example (~1 s):
        >>> out = Path(tempfile.mkdtemp())
        >>> meta = generate(out / "small-real", regime="small-real")
        >>> {s: i.rows for s, i in meta.splits.items()}
        {'train': 8572, 'validation': 714, 'test': 714}
        >>> shutil.rmtree(out)
    """
    args = (out, rows, seed, cardinalities, raw_tsv, validation_fraction, test_fraction, rows_per_file, overwrite,
            regime, multi_hot_sizes, multi_hot_fill, compression, sparse_layout, workers)
    # one run of an --out (and of a --raw-tsv: two runs' TSVs replaced one another) at a time: a second one (checked
    # before the first's output was in place) was silently replaced by it at its end, --overwrite or not; checked
    # again under the locks (one may have finished meanwhile)
    tsv_out = _settings(*args).tsv_path
    with output_lock(_settings(*args).out, "--out"), \
            (output_lock(tsv_out, "--raw-tsv") if tsv_out is not None else contextlib.nullcontext()):
        recover_replaced(_settings(*args).out)  # (before the checks: a killed replace's old dataset comes back)
        s = _settings(*args)
        started = time.perf_counter()
        logger.info(f"tuning the teacher's bias on {PILOT_ROWS:,} pilot rows")  # ~2-20 s before any progress bar
        teacher = Teacher(s.seed, s.cards, multi_hot_sizes=s.multi_hot_sizes, multi_hot_fill=s.multi_hot_fill)
        split_rows = ", ".join(f"{split} {n:,}" for split, n in s.sizes.items())  # (a dict's repr before)
        logger.info(f"teacher bias {teacher.bias:.4f}; writing {s.rows:,} rows ({split_rows}) to {s.out}")

        remove_stale_temps(s.out, ".{name}.tmp-{rand}")  # a killed run's dataset and TSV (this run holds the locks)
        if s.tsv_path is not None:
            remove_stale_temps(s.tsv_path, ".{name}.{rand}.tmp")
        s.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{s.out.name}.tmp-", dir=s.out.parent))
        tsv_tmp = None
        try:
            splits = _Splits(tmp, s.sizes, s.rows_per_file, s.table_sizes == "distinct", s.multi_hot_sizes, s.compression,
                             s.sparse_layout)
            tsv = None
            if s.tsv_path is not None:
                s.tsv_path.parent.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(prefix=f".{s.tsv_path.name}.", suffix=".tmp", dir=s.tsv_path.parent)
                tsv_tmp = Path(name)
                tsv = os.fdopen(fd, "w")
            _write_rows(s, teacher, splits, tsv, workers if workers > 0 else (os.cpu_count() or 1))
            splits.close()
            if tsv is not None:
                tsv.close()
            meta = _metadata(s, teacher, splits)
            write_metadata(tmp, meta)  # last file of the dataset: marks it complete
            publish(tmp, s.out, tsv_tmp, s.tsv_path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if tsv_tmp is not None:
                tsv_tmp.unlink(missing_ok=True)
            raise
        logger.info(_done_line(s, meta, time.perf_counter() - started))
        return meta


EXIT_BAD_INPUT = 2
"""Exit code for bad arguments and unwritable or occupied outputs (click's usage errors use it too)."""
EXIT_OUT_OF_MEMORY = 4


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
    if isinstance(exc, BrokenProcessPool):  # a --workers process was killed (by the OOM killer, most often)
        logger.error("a --workers process died (out of host memory?): use fewer --workers; no partial dataset was left")
        return EXIT_OUT_OF_MEMORY
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C (130), or SIGTERM (`Terminated`: 143)
        logger.error(f"interrupted ({interruption(exc)[1]}); no partial dataset was left behind")
        return interruption(exc)[0]
    return report_bug(exc)


@click.command(cls=OneLineUsageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rows", type=click.IntRange(min=1), default=None,
              help="Total rows over all splits (required unless --regime sets it: small-real 10,000).")
@click.option("--out", type=NonEmptyPath(file_okay=False), required=True, help="Dataset directory to create.")
@click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED), default=0, show_default=True)
@click.option("--cardinalities", type=click.Choice(sorted(CARDINALITY_PRESETS)), default=None,
              help="tiny: the embedded sample (3..400); small: CPU-sized tables (3..4000); kaggle: the Criteo Kaggle "
                   "table sizes; mlperf: MLPerf DLRM-DCNv2's (up to 40M) [default: the regime's: small, or kaggle for "
                   "small-real].")
@click.option("--raw-tsv", type=NonEmptyPath("the raw TSV file to write", dir_okay=False), default=None,
              help="Also write all rows in Kaggle's raw train.txt format: train, validation, test (small-real: train, test, validation).")
@click.option("--validation-fraction", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="[default: the regime's: 0.1, or 1/14 for small-real]")
@click.option("--test-fraction", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="[default: the regime's: 0.1, or 1/14 for small-real]")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=DEFAULT_ROWS_PER_FILE, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out directory (and --raw-tsv file).")
@click.option("--regime", type=click.Choice(sorted(REGIMES)), default="default", show_default=True,
              help="A preset (module docstring): small-real = a 10,000-line real click log's shape (Kaggle category "
                   "counts, most values rare, 8,572/714/714 split, tables sized like the preprocessor's).")
@click.option("--multi-hot-sizes", default=None, metavar="PRESET|S1,...,S26",
              help="Values per row of each sparse feature: mlperf (MLPerf DLRM-DCNv2's 26 sizes, 214 a row), one-hot, "
                   "or 26 comma-separated integers >= 1 [default: one-hot].")
@click.option("--multi-hot-fill", type=click.Choice(MULTI_HOT_FILLS), default="fixed", show_default=True,
              help="fixed: every present multi-hot feature holds its size's values; variable: 1..size, uniform.")
@click.option("--workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="Processes computing the rows (0: one per CPU). The dataset is the same for any number.")
@click.option("--compression", type=click.Choice(CODECS), default=COMPRESSION, show_default=True,
              help="Parquet codec. lz4 files are ~1.4x larger than zstd ones; multi-hot rows stream from them 1.1-1.4x "
                   "faster (benchmarks/results/loader_layouts_final_mlperf.md).")
@click.option("--sparse-layout", type=click.Choice(SPARSE_LAYOUTS), default=SPARSE_LAYOUT, show_default=True,
              help="Multi-hot features as slots, one int64 column a slot (-2: no value; schema version 3, read 1.6-2x "
                   "faster), or lists, one list column a feature (version 2). The same rows either way.")
def main(rows, out, seed, cardinalities, raw_tsv, validation_fraction, test_fraction, rows_per_file, overwrite,
         regime, multi_hot_sizes, multi_hot_fill, workers, compression, sparse_layout):
    """Generate a synthetic Criteo-format dataset with a planted teacher (see the module docstring).

    Exit codes: 0 done; 1 a bug (traceback, then a line saying so); 2 bad arguments, an occupied
    or unwritable output; 4 out of memory; 130 Ctrl-C; 143 SIGTERM.
    """
    configure_logging()
    try:  # SIGTERM raises as Ctrl-C does: its default action left the temporary dataset (and TSV) beside --out
        with StopAtOnce(interrupt=True):
            refuse_one_hot_options(multi_hot_sizes, parse_multi_hot_sizes)  # before any work: a flag without effect
            check_parent_writable(Path(out), "--out")
            if raw_tsv is not None:
                check_parent_writable(Path(raw_tsv), "--raw-tsv")
            generate(out, rows, seed, cardinalities, raw_tsv, validation_fraction, test_fraction, rows_per_file,
                     overwrite, regime, multi_hot_sizes, multi_hot_fill, workers, compression, sparse_layout)
    except (Exception, KeyboardInterrupt) as e:
        sys.exit(_report(e))


if __name__ == "__main__":
    main()
