"""The synthetic generator's writers: rows as parquet shards (one-hot columns; multi-hot features as
``list<int64>`` columns or one int64 column a slot, `dlrm.data.schema.SparseLayout`) and as
Kaggle-format raw TSV lines, vectorised (`dlrm.data.synthetic` decides what the rows are; this module
only writes them). Both layouts store the same in-memory slots, so the rows never depend on the layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import click
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dlrm.data.schema import (
    NUM_DENSE,
    NUM_SPARSE,
    SparseLayout,
    arrow_schema,
    feature_columns,
    is_multi_hot,
    slot_offsets,
)
from dlrm.data.output_dirs import replace_dir
from dlrm.file_modes import file_mode
from dlrm.data.teacher import _U64, Rows

ROW_GROUP_ROWS = 1 << 17
"""Rows per parquet row group (~10 MB decoded): large enough to compress well, small enough
for a loader to shuffle and prefetch row groups."""
COMPRESSION = "zstd"
SPARSE_LAYOUT: SparseLayout = "slots"
"""The writers' default layout of multi-hot features: the loaders read slot columns 1.6-2x faster than lists."""


def stored_layout(sizes: Optional[list[int]], layout: str) -> str:
    """The layout a dataset of `sizes` written in `layout` is in: `layout` when multi-hot; "lists" when
    one-hot, where both layouts are the same files and `dlrm.data.schema.read_metadata` reads "lists"."""
    return layout if is_multi_hot(sizes) else "lists"


def _table(labels: np.ndarray, rows: Rows, sparse: np.ndarray, sizes: Optional[list[int]] = None,
           layout: str = SPARSE_LAYOUT) -> pa.Table:
    """Rows as an arrow table with the dataset schema (`sizes`: multi-hot sizes, None: one-hot; `layout`:
    how multi-hot features are stored, the same values either way)."""
    cols = [pa.array(labels, pa.int8())]
    cols += [pa.array(rows.dense[:, j]) for j in range(NUM_DENSE)]
    if not is_multi_hot(sizes):
        cols += [pa.array(sparse[:, f]) for f in range(NUM_SPARSE)]
        return pa.Table.from_arrays(cols, schema=arrow_schema())
    offsets = slot_offsets(sizes)
    for f in range(NUM_SPARSE):
        cols += feature_columns(sparse[:, offsets[f] : offsets[f + 1]], layout)
    return pa.Table.from_arrays(cols, schema=arrow_schema(sizes, layout))


class _SplitWriter:
    """Writes one split as parquet files of `rows_per_file` rows, in row groups of `ROW_GROUP_ROWS`
    (`options`: more pyarrow writer arguments, `dlrm.data.schema.write_options`)."""

    def __init__(self, root: Path, split: str, rows_per_file: int, schema: Optional[pa.Schema] = None,
                 compression: str = COMPRESSION, options: Optional[dict] = None) -> None:
        self.root, self.split, self.rows_per_file = root, split, rows_per_file
        self.compression = None if compression == "none" else compression
        self.options = options or {}
        self.schema = schema if schema is not None else arrow_schema()
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
            self._writer = pq.ParquetWriter(self.root / rel, self.schema, compression=self.compression,
                                            **self.options)
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


MULTI_HOT_SEPARATOR = ","
"""Separates the hex values of a multi-hot field in the raw TSV (never part of a hex token)."""


def _hex_lists(block: np.ndarray) -> np.ndarray:
    """Slots [n, s] (values >= 0 first, `PAD_SPARSE` after them) as comma-separated 8-digit hex
    strings (object array; an empty list is None), vectorised: each value becomes 9 bytes (hex and
    a comma), empty slots and the comma after a row's last value become NUL, which numpy's bytes
    type strips from the end."""
    n, size = block.shape
    valid = block >= 0
    chars = np.zeros((n, size, 9), dtype=np.uint8)
    nibbles = (np.maximum(block, 0).astype(np.uint64)[..., None] >> _NIBBLE_SHIFTS) & _U64(0xF)
    chars[..., :8] = _HEX_DIGITS[nibbles]
    chars[..., 8] = ord(MULTI_HOT_SEPARATOR)
    chars[~valid] = 0
    count = valid.sum(axis=1)
    last = np.flatnonzero(count)
    chars[last, count[last] - 1, 8] = 0
    text = chars.reshape(n, 9 * size).view(f"S{9 * size}").ravel().astype(str).astype(object)
    text[count == 0] = None
    return text


def _tsv_block(labels: np.ndarray, rows: Rows, sparse: np.ndarray, sizes: Optional[list[int]] = None) -> str:
    """Rows in Kaggle's train.txt format: label, I1..I13, C1..C26, tab-separated, missing = empty;
    a multi-hot feature's values are joined by `MULTI_HOT_SEPARATOR` (an empty list: empty)."""
    cols: dict[str, object] = {"label": labels}
    for j in range(NUM_DENSE):
        cols[f"I{j + 1}"] = pd.array(rows.dense[:, j], dtype="Int32")
        cols[f"I{j + 1}"][rows.dense_missing[:, j]] = pd.NA
    offsets = slot_offsets(sizes)
    for f in range(NUM_SPARSE):
        if offsets[f + 1] - offsets[f] > 1:
            cols[f"C{f + 1}"] = _hex_lists(sparse[:, offsets[f] : offsets[f + 1]])
            continue
        column = sparse[:, offsets[f]]
        text = _hex8(np.maximum(column, 0))
        text[column < 0] = None
        cols[f"C{f + 1}"] = text
    return pd.DataFrame(cols).to_csv(sep="\t", header=False, index=False, na_rep="", lineterminator="\n")


def publish(tmp: Path, out: Path, tsv_tmp: Path | None, tsv_path: Path | None) -> None:
    """Rename the finished dataset `tmp` to `out` and the raw TSV `tsv_tmp` (if any) to `tsv_path`."""
    try:
        replace_dir(tmp, out)
    finally:
        # The TSV goes with the dataset once that is in place (`tmp` gone), even when an interrupt came as the
        # replaced --out was being removed: the caller then removed the new TSV, and the user's old one stayed
        # beside the new dataset.
        if tsv_tmp is not None and not tmp.exists():
            os.chmod(tsv_tmp, file_mode())  # mkstemp makes 0600; the finished file gets an ordinary file's mode
            os.replace(tsv_tmp, tsv_path)


def refuse_one_hot_options(multi_hot_sizes: Optional[str], parse) -> None:
    """Refuse ``--multi-hot-fill`` or ``--sparse-layout`` given on the command line for one-hot data (no
    --multi-hot-sizes, ``one-hot``, or all sizes 1): neither can act on one-hot features, and both were silently
    dropped (the same dataset as without them, the command recorded without them). `parse`: the generator's
    --multi-hot-sizes parser; a value it refuses is left to `dlrm.data.synthetic.generate` to report."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [name for name in ("multi_hot_fill", "sparse_layout")
             if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    try:
        sizes = None if multi_hot_sizes is None else parse(multi_hot_sizes)
    except click.BadParameter:
        return  # `generate` names the bad --multi-hot-sizes
    if given and not is_multi_hot(sizes):
        flag = "--" + given[0].replace("_", "-")
        raise click.ClickException(f"{flag} {ctx.params[given[0]]}: applies to multi-hot features only (this run is "
                                   "one-hot: give --multi-hot-sizes, or leave the option out)")
