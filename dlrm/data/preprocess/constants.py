"""Constants shared by the preprocessing submodules (field layout, defaults, option names)."""

from __future__ import annotations

import gzip
import zlib

import numpy as np

from dlrm.data.schema import NUM_DENSE, NUM_SPARSE, SPLITS

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE  # 40
# Column names of the raw files (and of the CSV header); used in error messages.
RAW_COLUMNS = ["label", *[f"I{i + 1}" for i in range(NUM_DENSE)], *[f"C{i + 1}" for i in range(NUM_SPARSE)]]
INT32_MAX = np.iinfo(np.int32).max

DEFAULT_CHUNK_ROWS = 262_144  # about 370 MB peak per worker (measured); one row group per full shard
DEFAULT_ROW_GROUP_ROWS = 262_144
DEFAULT_MAX_ROWS_PER_TABLE = 40_000_000
DEFAULT_SPARSE_LAYOUT = "slots"  # --sparse-layout of a new multi-hot run: slot columns read 1.6-2x faster than lists
RECORDLESS_SPARSE_LAYOUT = "lists"  # a run whose options lack sparse_layout: older versions wrote list columns only
PROGRESS_DIR = "_progress"
MANIFEST_VERSION = 1

BAD_LINE_REASONS = ("wrong_field_count", "bad_label", "bad_integer", "bad_category", "empty_file", "corrupt_gzip")
# Options that change the output; a resumed run must use the same values (and the same --multi-hot-sizes and
# --sparse-layout, recorded only when multi-hot: `output._multi_hot_diffs`).
_OUTPUT_OPTIONS = (
    "format",
    "split",
    "validation_fraction",
    "test_fraction",
    "seed",
    "hashing",
    "min_frequency",
    "max_rows_per_table",
    "chunk_rows",
    "row_group_rows",
    "compression",
    "compression_level",
    "on_bad_line",
)
_SPLIT_CODE = {name: i for i, name in enumerate(SPLITS)}  # train 0, validation 1, test 2
_READ_BLOCK = 1 << 24
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)
_M64 = (1 << 64) - 1
_U = np.uint64
