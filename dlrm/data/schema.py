"""The on-disk dataset contract: column names, missing-value conventions and `metadata.json`.

A dataset is a directory::

    DIR/
      metadata.json          # written last; its presence marks a complete dataset
      train/*.parquet
      validation/*.parquet
      test/*.parquet         # optional
      vocab/SPARSE_<i>.npy   # only for hashing mode "vocabulary": sorted int64 values per feature

Columns (in this order):
  ``label``            int8, 0 or 1
  ``DENSE_0..DENSE_12`` int32, integer counts; a missing count is stored as 0
  ``SPARSE_0..SPARSE_25`` int64, the 32-bit Criteo hash (the hex string read as an integer);
                       a missing category is stored as ``MISSING_SPARSE`` (-1)

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
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 1
NUM_DENSE = 13
NUM_SPARSE = 26
LABEL_COLUMN = "label"
DENSE_COLUMNS = [f"DENSE_{i}" for i in range(NUM_DENSE)]
SPARSE_COLUMNS = [f"SPARSE_{i}" for i in range(NUM_SPARSE)]
ALL_COLUMNS = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
MISSING_SPARSE = -1
MISSING_DENSE = 0
SPLITS = ("train", "validation", "test")
HashingMode = Literal["modulus", "vocabulary"]


class DatasetError(ValueError):
    """A dataset on disk does not follow the contract; the message names the file and field."""


def arrow_schema():
    """The pyarrow schema every shard is written with."""
    import pyarrow as pa

    fields = [pa.field(LABEL_COLUMN, pa.int8(), nullable=False)]
    fields += [pa.field(c, pa.int32(), nullable=False) for c in DENSE_COLUMNS]
    fields += [pa.field(c, pa.int64(), nullable=False) for c in SPARSE_COLUMNS]
    return pa.schema(fields)


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
        hashing: "modulus" or "vocabulary".
        splits: per split name, its `SplitInfo`.
        schema_version: the contract version (`SCHEMA_VERSION`).
        missing_sparse: the stored value of a missing category.
        extra: free-form provenance (generator settings, oracle AUC, bad-line counts, ...).
    """

    cardinalities: list[int]
    hashing: str = "modulus"
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    missing_sparse: int = MISSING_SPARSE
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_dense"] = NUM_DENSE
        d["num_sparse"] = NUM_SPARSE
        return d


def _fail(path: Path, key: str, msg: str) -> DatasetError:
    return DatasetError(f"{path}: {key}: {msg}")


def read_metadata(dataset_dir: str | os.PathLike) -> Metadata:
    """Load and validate `DIR/metadata.json`; raises `DatasetError` naming file and key."""
    path = Path(dataset_dir) / "metadata.json"
    if not path.is_file():
        raise DatasetError(f"{path}: missing (not a dataset directory, or its writer did not finish)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise _fail(path, "<root>", "must be a JSON object")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise _fail(path, "schema_version", f"{version!r} is not the supported version {SCHEMA_VERSION}")
    cards = raw.get("cardinalities")
    if not (isinstance(cards, list) and len(cards) == NUM_SPARSE):
        raise _fail(path, "cardinalities", f"must be a list of {NUM_SPARSE} integers, got {cards!r:.80}")
    for i, c in enumerate(cards):
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise _fail(path, f"cardinalities[{i}]", f"{c!r} is not a positive integer")
    hashing = raw.get("hashing", "modulus")
    if hashing not in ("modulus", "vocabulary"):
        raise _fail(path, "hashing", f"{hashing!r} is not 'modulus' or 'vocabulary'")
    splits: dict[str, SplitInfo] = {}
    for name, info in (raw.get("splits") or {}).items():
        if name not in SPLITS:
            raise _fail(path, f"splits.{name}", f"unknown split (expected one of {', '.join(SPLITS)})")
        try:
            splits[name] = SplitInfo(rows=int(info["rows"]), positives=int(info["positives"]), files=list(info["files"]))
        except (KeyError, TypeError, ValueError) as e:
            raise _fail(path, f"splits.{name}", f"needs rows, positives and files ({e})") from None
    return Metadata(
        cardinalities=list(cards),
        hashing=hashing,
        splits=splits,
        schema_version=version,
        missing_sparse=int(raw.get("missing_sparse", MISSING_SPARSE)),
        extra=dict(raw.get("extra") or {}),
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
