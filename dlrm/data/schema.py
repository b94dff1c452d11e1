"""The on-disk dataset contract: column names, missing-value conventions and `metadata.json`.

A dataset is a directory::

    DIR/
      metadata.json          # written last; its presence marks a complete dataset
      train/*.parquet
      validation/*.parquet
      test/*.parquet         # optional
      vocab/SPARSE_<i>.npy   # only for hashing mode "vocabulary": sorted int64 values per feature
                             # (`read_vocabulary` checks them)

Columns (in this order):
  ``label``            int8, 0 or 1
  ``DENSE_0..DENSE_12`` int32, integer counts; a missing count is stored as 0
  ``SPARSE_0..SPARSE_25`` the 32-bit Criteo hash (the hex string read as an integer):
                       int64 for a one-hot feature (``multi_hot_sizes[f] == 1``), where a missing
                       category is stored as ``MISSING_SPARSE`` (-1); ``list<int64>`` for a
                       multi-hot feature (``multi_hot_sizes[f] > 1``): 0 to ``multi_hot_sizes[f]``
                       values per row (an empty list: no value; a longer list is a `DatasetError`
                       naming file, column and row)
Files from other writers may declare columns nullable; the loaders then read a null count as 0,
a null category as -1, a null list as an empty list and a null value inside a list as -1 (logged
once per file) and refuse a null label (`dlrm.data.loader.check_table`).

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
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
"""Versions `read_metadata` accepts: 1 (one-hot only, no ``multi_hot_sizes``) and 2."""
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


from dlrm.errors import DatasetError  # noqa: E402,F401 - defined low (dlrm.errors), raised here


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


def arrow_schema(multi_hot_sizes: list[int] | None = None):
    """The pyarrow schema every shard is written with: a multi-hot feature (size > 1) is a
    ``list<int64>`` column, every other column as in version 1 (None: one-hot)."""
    import pyarrow as pa

    sizes = multi_hot_sizes if multi_hot_sizes is not None else one_hot_sizes()
    fields = [pa.field(LABEL_COLUMN, pa.int8(), nullable=False)]
    fields += [pa.field(c, pa.int32(), nullable=False) for c in DENSE_COLUMNS]
    fields += [pa.field(c, pa.list_(pa.int64()) if size > 1 else pa.int64(), nullable=False)
               for c, size in zip(SPARSE_COLUMNS, sizes)]
    return pa.schema(fields)


def slots_to_list_array(slots):
    """A multi-hot feature's slots, int64 numpy [n, size] (values first, `PAD_SPARSE` after them),
    as the ``list<int64>`` array of its column (the inverse of `dlrm.data.host_arena.list_slots`)."""
    import numpy as np
    import pyarrow as pa

    valid = slots != PAD_SPARSE
    offsets = np.zeros(slots.shape[0] + 1, dtype=np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(slots[valid], pa.int64()))


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
        schema_version: the contract version (`SCHEMA_VERSION`).
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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["schema_version"] < 2:  # read from a version-1 file: written back as one
            if self.is_multi_hot:  # ...unless it became multi-hot, which version 1 cannot say
                d["schema_version"] = SCHEMA_VERSION
            else:
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
    read. Every defect (unreadable or non-UTF-8 bytes, invalid or too deeply nested JSON, NaN/Infinity,
    a wrong type or range of any known key, shard paths outside the dataset directory) raises a
    `DatasetError` naming the file and the key; nothing else escapes.
    """
    path = Path(dataset_dir) / "metadata.json"
    if not path.is_file():
        raise DatasetError(f"{path}: missing (not a dataset directory, or its writer did not finish)")
    raw = _load_json(path)
    if not isinstance(raw, dict):
        raise _fail(path, "<root>", "must be a JSON object")
    version = raw.get("schema_version")
    if not (_is_int(version) and version in SUPPORTED_SCHEMA_VERSIONS):
        raise _fail(path, "schema_version", f"{version!r:.80} is not the supported version 1 or 2")
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
    )


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to a temporary file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the result is an ordinary readable file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_metadata(dataset_dir: str | os.PathLike, meta: Metadata) -> None:
    """Write `metadata.json` atomically (it is the last file a writer produces)."""
    write_json_atomic(Path(dataset_dir) / "metadata.json", meta.to_json())


def vocab_path(dataset_dir: str | os.PathLike, feature: int) -> Path:
    """Where the sorted vocabulary of sparse feature `feature` lives (hashing mode "vocabulary")."""
    return Path(dataset_dir) / "vocab" / f"{SPARSE_COLUMNS[feature]}.npy"


def _read_npy_header(fh, path: Path) -> tuple[tuple[int, ...], Any, int]:
    """(shape, dtype, data offset) of an open ``.npy`` file, from its header alone."""
    import numpy as np

    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, EOFError, OSError, SyntaxError, TypeError) as e:
        raise DatasetError(f"{path}: not a readable .npy array ({e})") from None
    return shape, dtype, fh.tell()


def read_vocabulary(dataset_dir: str | os.PathLike, feature: int, cardinality: int):
    """The sorted vocabulary of sparse feature `feature` as int64 numpy, validated against the contract.

    The file must be a plain ``.npy`` (no pickles) holding a 1-D integer array, strictly
    increasing (sorted, no duplicates: the hashing's binary search silently misplaces values
    otherwise), of ``cardinality - 1`` values (row 0 is the out-of-vocabulary row) and exactly as
    long as its header says. The header is checked before any data is read, so a corrupt header
    cannot ask for a huge allocation. Raises `DatasetError` naming the file.
    """
    import numpy as np

    path = vocab_path(dataset_dir, feature)
    if not path.is_file():
        raise DatasetError(f"{path}: vocabulary file missing (metadata.json says hashing 'vocabulary')")
    try:
        with open(path, "rb") as fh:
            shape, dtype, offset = _read_npy_header(fh, path)
            if dtype.kind not in "iu" or len(shape) != 1:
                raise DatasetError(f"{path}: must hold a 1-D integer array, holds {dtype} of shape {shape}")
            if shape[0] != cardinality - 1:
                raise DatasetError(f"{path}: holds {shape[0]} values but metadata.json cardinalities[{feature}] "
                                   f"is {cardinality} (a vocabulary of {cardinality - 1} values plus row 0)")
            size = os.fstat(fh.fileno()).st_size
            if size != offset + shape[0] * dtype.itemsize:
                raise DatasetError(f"{path}: is {size} bytes, its header promises {offset + shape[0] * dtype.itemsize} "
                                   "(truncated or corrupt)")
            values = np.fromfile(fh, dtype=dtype, count=shape[0])
    except OSError as e:
        raise DatasetError(f"{path}: cannot be read ({e.strerror or e})") from None
    return _checked_vocabulary(path, values)


def _checked_vocabulary(path: Path, values):
    """`values` as int64, checked to fit int64 and to be strictly increasing."""
    import numpy as np

    if values.dtype.kind == "u" and values.size and int(values.max()) > _MAX_INT:
        raise DatasetError(f"{path}: value {int(values.max())} does not fit int64")
    values = values.astype(np.int64)
    bad = np.flatnonzero(values[1:] <= values[:-1])
    if bad.size:
        i = int(bad[0]) + 1
        raise DatasetError(f"{path}: not strictly increasing (sorted, unique) at index {i}: "
                           f"{int(values[i - 1])} then {int(values[i])}")
    return values
