"""The on-disk dataset contract: column names, missing-value conventions and `metadata.json`.

A dataset is a directory::

    DIR/
      metadata.json          # written last; its presence marks a complete dataset
      train/*.parquet
      validation/*.parquet
      test/*.parquet         # optional
      vocab/SPARSE_<i>.npy   # only for hashing mode "vocabulary": sorted int64 values per feature
                             # (`dlrm.data.vocabulary.read_vocabulary` checks them)

Columns (in this order):
  ``label``            int8, 0 or 1
  ``DENSE_0..DENSE_12`` int32, integer counts; a missing count is stored as 0. The loaders feed the
                       model ``log1p(max(x, 0))``. Or (``dense_format`` "float", schema version 4)
                       float32 values the model takes as they are, e.g. MLPerf's preprocessed
                       ``log(x + 3)`` (`DenseFormat`); every value must be finite
  ``SPARSE_0..SPARSE_25`` the 32-bit Criteo hash (the hex string read as an integer):
                       int64 for a one-hot feature (``multi_hot_sizes[f] == 1``), where a missing
                       category is stored as ``MISSING_SPARSE`` (-1). A multi-hot feature
                       (``multi_hot_sizes[f] > 1``) is stored in one of two layouts
                       (`SparseLayout`, ``sparse_layout`` in metadata.json):
                       "lists": one ``list<int64>`` column ``SPARSE_<f>``, 0 to ``multi_hot_sizes[f]``
                       values per row (an empty list: no value; a longer list is a `DatasetError`
                       naming file, column and row);
                       "slots" (schema version 3): ``multi_hot_sizes[f]`` int64 columns
                       ``SPARSE_<f>_0 .. SPARSE_<f>_<size-1>``, one per slot, ``PAD_SPARSE`` (-2)
                       in a slot that holds no value. No repetition levels to decode: the
                       loaders decode these ~3x faster, and MLPerf DLRM-DCNv2 streams 1.25-1.53x faster
                       (benchmarks/results/sparse_layout_mlperf.md).
Files from other writers may declare columns nullable; the loaders then read a null count as 0,
a null category as -1, a null list as an empty list and a null value inside a list as -1 (logged
once per file) and refuse a null label (`dlrm.data.loader.check_table`).

Readers take each file's layout from its own schema (`file_layout`), so both read anywhere;
``sparse_layout`` records what the writer wrote. A dataset is written with the lowest version that
describes it (`Metadata.written_version`): slot columns of a multi-hot dataset need version 3,
float dense columns need version 4, everything else is version 2 (or 1, kept for a one-hot dataset
read from a version-1 file), so older readers keep reading what they can and refuse the rest by its
version.

Multi-hot (schema version 2): ``metadata.json`` holds ``multi_hot_sizes``, per sparse feature the
most values a row may hold (all 1: one-hot, the only layout of version 1, whose files lack the
key and read as all 1). In memory a row's sparse values are one int64 vector of
``L = sum(multi_hot_sizes)`` slots (`sparse_width`): feature f occupies slots
``slot_offsets(sizes)[f] : slot_offsets(sizes)[f] + sizes[f]``, its values first in list order,
then ``PAD_SPARSE`` (-2) in the slots its list leaves empty. With all sizes 1 that is exactly the
one-hot ``[B, 26]`` of version 1. -1 keeps meaning a missing category; -2 is no value at all (a
model skips it: it is neither a category nor the missing row).

Hashing (applied on the model's device, never on the host):
  ``modulus``:    row = (raw + 1) mod cardinality, so a missing value (-1) lands on row 0.
  ``vocabulary``: row = 1 + position of raw in the feature's sorted vocabulary when present,
                  else 0 (the shared out-of-vocabulary row, which missing values also use);
                  cardinality = len(vocabulary) + 1.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

SCHEMA_VERSION = 4
"""The newest contract version (what `Metadata` describes; `Metadata.written_version` is what a dataset needs)."""
SUPPORTED_SCHEMA_VERSIONS = (1, 2, 3, 4)
"""Versions `read_metadata` accepts: 1 (one-hot only, no ``multi_hot_sizes``), 2 (multi-hot list columns), 3
(``sparse_layout``: multi-hot features as one column a slot) and 4 (``dense_format``: float dense columns)."""
NUM_DENSE = 13
NUM_SPARSE = 26
LABEL_COLUMN = "label"
DENSE_COLUMNS = [f"DENSE_{i}" for i in range(NUM_DENSE)]
SPARSE_COLUMNS = [f"SPARSE_{i}" for i in range(NUM_SPARSE)]
ALL_COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
KAGGLE_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
"""Distinct values per categorical feature of the Criteo Kaggle display-advertising challenge data (the
table sizes of the reference DLRM; configs/kaggle.json carries the same list, checked by a test)."""
MLPERF_CARDINALITIES = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
                        2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
"""Table sizes of MLPerf's DLRM-DCNv2 benchmark (Criteo 1TB, tables capped at 40M rows)."""
MLPERF_MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
"""Values per row and feature of MLPerf's DLRM-DCNv2 multi-hot Criteo (214 lookups a row)."""
MAX_MULTI_HOT_SIZE = 1 << 16
"""The largest `multi_hot_sizes` entry `read_metadata` accepts (a bound on a row's slots)."""
MISSING_SPARSE = -1
PAD_SPARSE = -2
"""An empty slot of a multi-hot feature (its list is shorter than its size); never stored on disk."""
MISSING_DENSE = 0
SPLITS = ("train", "validation", "test")
HashingMode = Literal["modulus", "vocabulary"]
SparseLayout = Literal["lists", "slots"]
SPARSE_LAYOUTS = ("lists", "slots")
"""How a multi-hot feature is stored: "lists", one ``list<int64>`` column; "slots", one int64 column a slot."""
DenseFormat = Literal["counts", "float"]
DENSE_FORMATS = ("counts", "float")
"""How the dense features are stored: "counts", int32 counts the loaders transform (``log1p(max(x, 0))``);
"float", float32 values the model takes as they are (already transformed by their writer)."""


from dlrm.errors import DatasetError  # noqa: E402,F401 - defined low (dlrm.errors), raised here
from dlrm.errors import os_errors_named  # noqa: E402
from dlrm.file_modes import file_mode  # noqa: E402


def one_hot_sizes() -> list[int]:
    """`multi_hot_sizes` of a one-hot dataset: 1 value per feature."""
    return [1] * NUM_SPARSE


def slot_offsets(sizes: list[int] | None = None) -> list[int]:
    """Where each feature's slots begin in a row of ``sum(sizes)`` sparse values, plus the total
    at the end (27 entries): feature f is ``[offsets[f], offsets[f + 1])``. None: one-hot."""
    offsets = [0]
    for size in sizes if sizes is not None else one_hot_sizes():
        offsets.append(offsets[-1] + size)
    return offsets


def sparse_width(sizes: list[int] | None = None) -> int:
    """L, the sparse values of a row: ``sum(sizes)`` (26 when one-hot or None)."""
    return NUM_SPARSE if sizes is None else sum(sizes)


def is_multi_hot(sizes: list[int] | None) -> bool:
    """Whether any feature of `sizes` may hold more than one value."""
    return sizes is not None and any(size != 1 for size in sizes)


def check_layout(layout: str) -> str:
    """`layout` if it is one of `SPARSE_LAYOUTS`, else a ValueError naming it."""
    if layout not in SPARSE_LAYOUTS:
        raise ValueError(f"sparse layout {layout!r:.40} is not one of {', '.join(SPARSE_LAYOUTS)}")
    return layout


def check_dense_format(dense_format: str) -> str:
    """`dense_format` if it is one of `DENSE_FORMATS`, else a ValueError naming it."""
    if dense_format not in DENSE_FORMATS:
        raise ValueError(f"dense format {dense_format!r:.40} is not one of {', '.join(DENSE_FORMATS)}")
    return dense_format


def slot_column(feature: int, slot: int) -> str:
    """The column of slot `slot` of multi-hot feature `feature` in the "slots" layout: ``SPARSE_<f>_<j>``."""
    return f"{SPARSE_COLUMNS[feature]}_{slot}"


def sparse_columns(multi_hot_sizes: list[int] | None = None, layout: SparseLayout = "lists") -> list[str]:
    """The sparse columns of a shard, in file order: ``SPARSE_<f>`` per feature, except a multi-hot
    feature's ``size`` slot columns in the "slots" layout (then one column a slot, L in all, in the
    order of the in-memory slots)."""
    check_layout(layout)
    names: list[str] = []
    for f, size in enumerate(multi_hot_sizes if multi_hot_sizes is not None else one_hot_sizes()):
        names += [slot_column(f, j) for j in range(size)] if size > 1 and layout == "slots" else [SPARSE_COLUMNS[f]]
    return names


def arrow_schema(multi_hot_sizes: list[int] | None = None, layout: SparseLayout = "lists",
                 dense_format: DenseFormat = "counts"):
    """The pyarrow schema every shard is written with: a multi-hot feature (size > 1) is a
    ``list<int64>`` column ("lists") or ``size`` int64 columns ("slots"), the dense columns int32
    ("counts") or float32 ("float"), every other column as in version 1 (None: one-hot, where both
    layouts are the same schema)."""
    import pyarrow as pa

    sizes = multi_hot_sizes if multi_hot_sizes is not None else one_hot_sizes()
    fields = [pa.field(LABEL_COLUMN, pa.int8(), nullable=False)]
    dense = pa.float32() if check_dense_format(dense_format) == "float" else pa.int32()
    fields += [pa.field(c, dense, nullable=False) for c in DENSE_COLUMNS]
    if layout == "slots":
        fields += [pa.field(c, pa.int64(), nullable=False) for c in sparse_columns(sizes, layout)]
    else:
        check_layout(layout)
        fields += [pa.field(c, pa.list_(pa.int64()) if size > 1 else pa.int64(), nullable=False)
                   for c, size in zip(SPARSE_COLUMNS, sizes)]
    return pa.schema(fields)


SLOT_DICTIONARY_PAGE_BYTES = 1 << 16
"""pyarrow's ``dictionary_pagesize_limit`` for shards with slot columns (pyarrow's default is 1 MB)."""


def write_options(multi_hot_sizes: list[int] | None = None, layout: SparseLayout = "lists") -> dict[str, Any]:
    """Extra pyarrow parquet writer arguments for a shard of `multi_hot_sizes` in `layout`: none without slot
    columns (pyarrow's defaults: files as before the "slots" layout existed); a 64 KB dictionary page with them.

    A slot column holds one id a row. Where the column chunk holds few distinct ids (a small table, or
    Zipf-like real data) a dictionary shrinks it; where it holds many (MLPerf's uniform extra ids of a
    40M-row table) pyarrow's default 1 MB dictionary page fills before it falls back to plain encoding,
    and those dictionary-encoded pages cost more than they save. Capped at 64 KB (~8,000 distinct ids),
    one MLPerf-shaped 131,072-row group from LZ4 was 135 MB with uniform ids (172 with 1 MB pages, 138
    without dictionaries) and decoded in 1.10 us a row (1.50, 1.12); with Zipf-like ids 99 MB (85, 107)
    and 1.17 us (1.01, 1.29); one thread of the 2-core machine,
    benchmarks/results/sparse_layout_decode_{uniform,zipf}_cpu.md (2026-11-30). List columns took 3.1-3.5 us a row.
    """
    slots = set(sparse_columns(multi_hot_sizes, layout)) - set(SPARSE_COLUMNS)
    return {"dictionary_pagesize_limit": SLOT_DICTIONARY_PAGE_BYTES} if slots else {}


def slots_to_list_array(slots):
    """A multi-hot feature's slots, int64 numpy [n, size] (values first, `PAD_SPARSE` after them),
    as the ``list<int64>`` array of its column (the inverse of `dlrm.data.host_arena.list_slots`)."""
    import numpy as np
    import pyarrow as pa

    slots = np.ascontiguousarray(slots, dtype=np.int64)
    n, size = slots.shape
    valid = slots != PAD_SPARSE
    if valid.all():  # every list full (MLPerf's rows, fixed fill): the slots are the values, offsets 0, size, ...
        return pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * size, size, dtype=np.int32)),
                                        pa.array(slots.reshape(-1)))
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(slots[valid], pa.int64()))


def feature_columns(slots, layout: SparseLayout = "lists") -> list:
    """One feature's slots, int64 numpy [n, size] (values first, `PAD_SPARSE` after them), as the arrays of
    its columns in `layout`: one int64 array when size is 1; else one ``list<int64>`` array ("lists",
    `slots_to_list_array`) or size int64 arrays, the slots as they are ("slots")."""
    import pyarrow as pa

    if slots.shape[1] == 1:
        return [pa.array(slots[:, 0], pa.int64())]
    if check_layout(layout) == "slots":
        return [pa.array(slots[:, j], pa.int64()) for j in range(slots.shape[1])]
    return [slots_to_list_array(slots)]


@dataclass
class SplitInfo:
    """Row and positive counts of one split, and its shard files (relative to the dataset dir)."""

    rows: int
    positives: int
    files: list[str]


@dataclass
class Metadata:
    """Contents of `metadata.json`.

    Args:
        cardinalities: table size per sparse feature (26 ints, each >= 1).
        multi_hot_sizes: per sparse feature the most values a row holds (26 ints, each >= 1;
            all 1 = one-hot, what a version-1 file means).
        hashing: "modulus" or "vocabulary".
        splits: per split name, its `SplitInfo`.
        schema_version: the contract version read (`SCHEMA_VERSION` for a new dataset); what
            `to_json` writes is `written_version`.
        sparse_layout: how the shards store multi-hot features, "lists" or "slots" (`SparseLayout`);
            recorded for people and older readers: the loaders take each file's from its schema.
        dense_format: how the shards store the dense features, "counts" or "float" (`DenseFormat`);
            every file must hold this one, and a model trained on one format refuses the other.
        missing_sparse: the stored value of a missing category.
        extra: free-form provenance (generator settings, oracle AUC, bad-line counts, ...).
    """

    cardinalities: list[int]
    multi_hot_sizes: list[int] = field(default_factory=one_hot_sizes)
    hashing: str = "modulus"
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    missing_sparse: int = MISSING_SPARSE
    extra: dict[str, Any] = field(default_factory=dict)
    sparse_layout: str = "lists"
    dense_format: str = "counts"

    def __post_init__(self) -> None:
        check_layout(self.sparse_layout)
        check_dense_format(self.dense_format)

    @property
    def slot_offsets(self) -> list[int]:
        """`slot_offsets` of this dataset's `multi_hot_sizes` (27 entries, the last is L)."""
        return slot_offsets(self.multi_hot_sizes)

    @property
    def sparse_width(self) -> int:
        """L: the columns of `Batch.sparse` for this dataset (26 when one-hot)."""
        return sparse_width(self.multi_hot_sizes)

    @property
    def is_multi_hot(self) -> bool:
        return is_multi_hot(self.multi_hot_sizes)

    @property
    def written_version(self) -> int:
        """The lowest schema version that describes this dataset, which `to_json` writes (older readers
        keep reading what they can): 4 with float dense columns, 3 for a multi-hot dataset in slot
        columns, 1 for a one-hot one read from a version-1 file, else 2."""
        if self.dense_format == "float":
            return 4
        if self.is_multi_hot and self.sparse_layout == "slots":
            return 3
        return 1 if self.schema_version < 2 and not self.is_multi_hot else 2

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema_version"] = self.written_version
        if d["schema_version"] < 4:  # counts, version 3 and older's only dense format
            del d["dense_format"]
        if d["schema_version"] < 3:  # the layouts coincide for one-hot data; "lists" is version 2's only one
            del d["sparse_layout"]
        if d["schema_version"] < 2:
            del d["multi_hot_sizes"]
        d["num_dense"] = NUM_DENSE
        d["num_sparse"] = NUM_SPARSE
        return d


def _fail(path: Path, key: str, msg: str) -> DatasetError:
    return DatasetError(f"{path}: {key}: {msg}")


# Counts and table sizes must fit the int64 tensors they end up in.
_MAX_INT = 2**63 - 1


def _reject_constant(name: str) -> Any:
    """`json.loads` hook for NaN/Infinity: not JSON, and no count or AUC may be one."""
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    """`json.loads` hook for floats: a literal like 1e999 would silently become inf."""
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is out of the range of a double")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads` hook for objects: a key given twice would silently keep only its last value."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r:.60} appears twice in one object")
        obj[key] = value
    return obj


def _load_json(path: Path) -> Any:
    """The parsed contents of `path`, every way of failing turned into one `DatasetError`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")  # explicit: never the locale's encoding; a leading BOM is harmless
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DatasetError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line} column {column})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise DatasetError(f"{path}: invalid JSON: nested too deeply") from None
    except ValueError as e:  # the hooks above, and integers too long to convert
        raise DatasetError(f"{path}: invalid JSON: {e}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(path: Path, key: str, value: Any, low: int) -> int:
    """`value` as an int in ``[low, 2^63)``, else a `DatasetError` naming `key`."""
    if not _is_int(value) or not low <= value <= _MAX_INT:
        what = "a positive integer" if low == 1 else "a non-negative integer" if low == 0 else "an integer"
        raise _fail(path, key, f"{value!r:.80} is not {what} below 2^63")
    return value


def _check_object(path: Path, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, key, f"must be a JSON object, got {type(value).__name__} {value!r:.60}")
    return value


def _check_file_name(path: Path, key: str, name: Any) -> str:
    """A shard path as metadata.json lists it: a relative path that stays inside the dataset dir."""
    if not isinstance(name, str) or not name:
        raise _fail(path, key, f"{name!r:.80} is not a non-empty string")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(path, key, f"{name!r:.80} is not a valid file name (unpaired surrogate)") from None
    if "\x00" in name:
        raise _fail(path, key, f"{name!r:.80} is not a valid file name (NUL character)")
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute():
        raise _fail(path, key, f"{name!r:.80} is absolute; files are relative to the dataset directory")
    if ".." in pure.parts:
        raise _fail(path, key, f"{name!r:.80} leaves the dataset directory ('..')")
    return name


def _check_files(path: Path, key: str, files: Any) -> list[str]:
    if not isinstance(files, list):
        raise _fail(path, key, f"must be a list of relative paths, got {type(files).__name__} {files!r:.60}")
    names = [_check_file_name(path, f"{key}[{i}]", f) for i, f in enumerate(files)]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if PurePosixPath(name) in seen:  # the same shard twice would double its rows' weight
            raise _fail(path, f"{key}[{i}]", f"{name!r:.80} is listed twice")
        seen.add(PurePosixPath(name))
    return names


def _check_split(path: Path, name: str, info: Any) -> SplitInfo:
    key = f"splits.{name}"
    info = _check_object(path, key, info)
    for field_name in ("rows", "positives", "files"):
        if field_name not in info:
            raise _fail(path, f"{key}.{field_name}", "missing (each split needs rows, positives and files)")
    rows = _check_int(path, f"{key}.rows", info["rows"], 0)
    positives = _check_int(path, f"{key}.positives", info["positives"], 0)
    if positives > rows:
        raise _fail(path, f"{key}.positives", f"{positives} is more than the split's {rows} rows")
    return SplitInfo(rows=rows, positives=positives, files=_check_files(path, f"{key}.files", info["files"]))


def _check_splits(path: Path, raw: Any) -> dict[str, SplitInfo]:
    splits: dict[str, SplitInfo] = {}
    for name, info in _check_object(path, "splits", raw).items():
        if name not in SPLITS:
            raise _fail(path, f"splits.{name:.40}", f"unknown split (expected one of {', '.join(SPLITS)})")
        splits[name] = _check_split(path, name, info)
    return splits


def _check_cardinalities(path: Path, cards: Any) -> list[int]:
    if not (isinstance(cards, list) and len(cards) == NUM_SPARSE):
        raise _fail(path, "cardinalities", f"must be a list of {NUM_SPARSE} integers, got {cards!r:.80}")
    return [_check_int(path, f"cardinalities[{i}]", c, 1) for i, c in enumerate(cards)]


def _check_multi_hot_sizes(path: Path, version: int, raw: dict[str, Any]) -> list[int]:
    """`multi_hot_sizes` of a version-2 file (absent: one-hot); a version-1 file must not have it."""
    if "multi_hot_sizes" not in raw:
        return one_hot_sizes()
    sizes = raw["multi_hot_sizes"]
    if version < 2:
        raise _fail(path, "multi_hot_sizes", "is a schema_version 2 key (this file says version 1)")
    if not (isinstance(sizes, list) and len(sizes) == NUM_SPARSE):
        raise _fail(path, "multi_hot_sizes", f"must be a list of {NUM_SPARSE} integers, got {sizes!r:.80}")
    for i, size in enumerate(sizes):
        if not _is_int(size) or not 1 <= size <= MAX_MULTI_HOT_SIZE:
            raise _fail(path, f"multi_hot_sizes[{i}]", f"{size!r:.80} is not an integer in [1, {MAX_MULTI_HOT_SIZE}]")
    return list(sizes)


def _check_choice(path: Path, version: int, raw: dict[str, Any], key: str, since: int, choices: tuple[str, ...],
                  default: str) -> str:
    """A key that schema version `since` added, one of `choices` (absent: `default`); older files must not have it
    (``sparse_layout``, version 3; ``dense_format``, version 4)."""
    if key not in raw:
        return default
    value = raw[key]
    if version < since:
        raise _fail(path, key, f"is a schema_version {since} key (this file says version {version})")
    if not (isinstance(value, str) and value in choices):
        raise _fail(path, key, f"{value!r:.80} is not {' or '.join(map(repr, choices))}")
    return value


def _check_extra(path: Path, extra: Any) -> dict[str, Any]:
    """`extra` is free-form, except `oracle_auc`, which the trainer reads and prints."""
    extra = _check_object(path, "extra", extra)
    if "oracle_auc" in extra:
        for split, auc in _check_object(path, "extra.oracle_auc", extra["oracle_auc"]).items():
            if auc is not None and (isinstance(auc, bool) or not isinstance(auc, (int, float)) or not 0 <= auc <= 1):
                raise _fail(path, f"extra.oracle_auc.{split:.40}", f"{auc!r:.80} is not null or a number in [0, 1]")
    return dict(extra)


def _check_constants(path: Path, raw: dict[str, Any]) -> None:
    """Keys that only restate this code's constants must restate them exactly."""
    for key, expected in (("num_dense", NUM_DENSE), ("num_sparse", NUM_SPARSE), ("missing_sparse", MISSING_SPARSE)):
        if key in raw and not (_is_int(raw[key]) and raw[key] == expected):
            raise _fail(path, key, f"{raw[key]!r:.80} is not {expected} (the only supported value)")


def read_metadata(dataset_dir: str | os.PathLike) -> Metadata:
    """Load and validate `DIR/metadata.json`.

    A version-1 file (no ``multi_hot_sizes``) reads as one-hot; its `schema_version` is kept as
    read. A file without ``sparse_layout`` (every version-1 and 2 file) reads as "lists", one without
    ``dense_format`` (every file before version 4) as "counts". Every defect
    (unreadable or non-UTF-8 bytes, invalid or too deeply nested JSON, NaN/Infinity, a wrong type or
    range of any known key, shard paths outside the dataset directory) raises a `DatasetError` naming
    the file and the key; nothing else escapes.
    """
    path = Path(dataset_dir) / "metadata.json"
    if not path.is_file():  # (a directory of that name: "missing" sent the user looking for a file that is there)
        what = "not a file" if path.exists() else "missing (not a dataset directory, or its writer did not finish)"
        raise DatasetError(f"{path}: {what}")
    raw = _load_json(path)
    if not isinstance(raw, dict):
        raise _fail(path, "<root>", "must be a JSON object")
    version = raw.get("schema_version")
    if not (_is_int(version) and version in SUPPORTED_SCHEMA_VERSIONS):
        raise _fail(path, "schema_version", f"{version!r:.80} is not a supported version "
                    f"({', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))})")
    cards = _check_cardinalities(path, raw.get("cardinalities"))
    sizes = _check_multi_hot_sizes(path, version, raw)
    hashing = raw.get("hashing", "modulus")
    if not (isinstance(hashing, str) and hashing in ("modulus", "vocabulary")):
        raise _fail(path, "hashing", f"{hashing!r:.80} is not 'modulus' or 'vocabulary'")
    _check_constants(path, raw)
    return Metadata(
        cardinalities=cards,
        multi_hot_sizes=sizes,
        hashing=hashing,
        splits=_check_splits(path, raw.get("splits", {})),
        schema_version=version,
        missing_sparse=MISSING_SPARSE,
        extra=_check_extra(path, raw.get("extra", {})),
        sparse_layout=_check_choice(path, version, raw, "sparse_layout", 3, SPARSE_LAYOUTS, "lists"),
        dense_format=_check_choice(path, version, raw, "dense_format", 4, DENSE_FORMATS, "counts"),
    )


def write_json_atomic(path: str | os.PathLike, obj: Any, nan_as_null: bool = False) -> None:
    """Write JSON to a temporary file in the same directory, fsync, then rename over `path`. `nan_as_null`: NaN and
    infinities are written as null (strict JSON: Python writes NaN, which jq and JSON.parse refuse)."""
    if nan_as_null:
        obj = _finite_or_null(obj)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os_errors_named(path), os.fdopen(fd, "w") as f:  # (a write's error names no file)
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp creates 0600; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _finite_or_null(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return obj


def write_metadata(dataset_dir: str | os.PathLike, meta: Metadata) -> None:
    """Write `metadata.json` atomically (it is the last file a writer produces)."""
    write_json_atomic(Path(dataset_dir) / "metadata.json", meta.to_json())
