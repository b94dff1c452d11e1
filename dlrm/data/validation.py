"""Per-file checks of the parquet shards: schema, labels, nulls, and the files a split lists.

A shard is untrusted input: `open_shard` checks its schema (against the dataset's
``multi_hot_sizes``: a multi-hot feature is a ``list<int64>`` column, or one int64 column a slot in the
"slots" layout, whichever the file's schema holds: `file_layout`; the dense columns int32 counts
or float32 values, as the dataset's ``dense_format`` says) and pre-checks its labels
from the footer statistics when a loader opens it, and `check_table` checks every decoded row
group (labels 0 or 1, lists no longer than their feature's size, float dense values finite, nulls
replaced by the policy of
data/README.md), counting the replacements in a `NullTally` that logs them once per file. Every problem is a `DatasetError` naming the file,
and where it can, the column and the row.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm.data.arrow_numpy import numpy_of
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    DenseFormat,
    MISSING_DENSE,
    MISSING_SPARSE,
    NUM_DENSE,
    NUM_SPARSE,
    PAD_SPARSE,
    SPARSE_COLUMNS,
    DatasetError,
    Metadata,
    SparseLayout,
    arrow_schema,
    is_multi_hot,
    one_hot_sizes,
    slot_column,
)
from dlrm.logging_setup import run_logger


def check_utf8_path(path: str | Path) -> None:
    """`DatasetError` unless `path` is valid UTF-8: pyarrow opens files by a UTF-8 path and raised a bare
    UnicodeEncodeError (a traceback) for a name that is not (a Latin-1 name on Linux reads as surrogates)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise DatasetError(f"{str(path)!r}: the path is not valid UTF-8, which pyarrow cannot open; rename it") from None


def _no_rows_advice(meta: Metadata, split: str) -> str:
    """How to preprocess again for rows in the empty `split`: what the preprocessor's summary advised (true for the
    options and lines metadata.json records: "a --validation-fraction above 0" was said to a dataset of 1e-300), else
    (a train or validation split of another writer, a test split, a record that does not read) in general."""
    extra = meta.extra
    if extra.get("source") == "dlrm.preprocess" and split in ("train", "validation"):
        from dlrm.data.preprocess.empty_splits import advice

        try:
            return "preprocess again: " + advice(split, extra["options"], int(extra["total_lines"]),
                                                 int(extra["inputs"][-1]["lines"]))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):  # metadata.json is untrusted input
            pass
    return (f"preprocess again with more lines, or a --validation-fraction / --test-fraction above 0 with --split "
            f"random, for a '{split}' split to use")


def split_files(dataset_dir: str | Path, meta: Metadata, split: str, check_positives: bool = False) -> list[Path]:
    """The parquet files of `split`, checked to exist and to hold the rows metadata.json says (their footers: a shard
    replaced, truncated to fewer row groups or from another dataset shows here, before any training). `check_positives`:
    the split's ``positives`` too, where its files' label statistics tell (`_LabelClasses`: the split a run evaluates,
    whose positives decide whether it has an AUC; the writers of other splits' counts are not held to it)."""
    where = Path(dataset_dir) / "metadata.json"
    if split not in meta.splits:
        # the splits it has: `--eval-only --split test` of data/sample (train and validation only) named none
        held = ", ".join(meta.splits) or "none"
        raise DatasetError(f"{where}: splits: has no '{split}' split (it has: {held})")
    files = [Path(dataset_dir) / f for f in meta.splits[split].files]
    for f in files:
        if f.is_dir():  # Spark, pyarrow.dataset and Dask write a "file" train.parquet that is a folder of part files
            raise DatasetError(f"{f}: listed in metadata.json splits.{split}, is a directory (the output of Spark or "
                               "pyarrow.dataset?): list the parquet files inside it instead")
        if not f.is_file():  # a glob pattern (train/*.parquet) read as missing, as if its files were not there
            name = str(f.relative_to(dataset_dir))
            matches = sum(m.is_file() for m in Path(dataset_dir).glob(name)) if set("*?[") & set(name) else 0
            raise DatasetError(f"{f}: listed in metadata.json splits.{split} but missing" + (
                " (a pattern, which metadata.json does not expand: list the "
                f"{f'{matches} files' if matches > 1 else 'file'} it matches)" if matches else ""))
    _check_distinct(where, {split: meta.splits[split].files}, files)
    if not files:  # (a preprocessed split of 0 rows: a 7-line input's sequential split, --validation-fraction 0)
        rows = meta.splits[split].rows
        raise DatasetError(f"{where}: splits.{split}: lists no files" + (
            f" (the split has no rows: {_no_rows_advice(meta, split)})" if rows == 0 else ""))
    rows, classes = 0, _LabelClasses()
    for f in files:
        check_utf8_path(f)
        try:
            footer = pq.ParquetFile(f).metadata
            rows += footer_rows(f, footer)
            classes.add(footer)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{f}: not a readable parquet file ({e})") from None
    if rows != meta.splits[split].rows:
        raise DatasetError(f"{where}: splits.{split}.rows is {meta.splits[split].rows:,} but its {len(files)} file(s) "
                           f"hold {rows:,} rows")
    if check_positives:
        classes.check(where, split, meta.splits[split].rows, meta.splits[split].positives)
    return files


def _check_distinct(where: Path, listed: dict[str, list[str]], files: list[Path]) -> None:
    """`DatasetError` naming the key of the second entry of `listed` (split -> its names in metadata.json, in the
    order of `files`, their paths) that is the same file as an earlier one: a symbolic or hard link, which the check of
    the names (`dlrm.data.schema`) cannot see, doubled a shard's rows in training without a word; a file of the train
    split listed in the evaluation split too had the run evaluate on rows it trains on, its AUC and best.pt too good."""
    seen: dict[object, tuple[str, int, str]] = {}
    keys = [(split, i, name) for split, names in listed.items() for i, name in enumerate(names)]
    for (split, i, name), path in zip(keys, files):
        # its real path (symbolic links), and for a file of several hard links its inode: not for every file, as some
        # network and FUSE file systems number their files 0 or otherwise alike
        st = path.stat()
        ids = [os.path.realpath(path)] + ([(st.st_dev, st.st_ino)] if st.st_ino and st.st_nlink > 1 else [])
        first = next((seen[key] for key in ids if key in seen), (split, i, name))
        seen.update((key, first) for key in ids)
        if first != (split, i, name):
            where_first = f"splits.{first[0]}.files[{first[1]}] {first[2]!r:.80}"
            why = ("its rows would count twice" if first[0] == split else
                   "the run would evaluate on rows it trains on; each split needs files of its own")
            raise DatasetError(f"{where}: splits.{split}.files[{i}]: {name!r:.80} is the same file as {where_first}: "
                               f"{why}")


def check_apart(dataset_dir: str | Path, meta: Metadata, train: list[Path], split: str, files: list[Path]) -> None:
    """`DatasetError` unless the evaluation `split`'s `files` and the train split's `train` (both from `split_files`)
    are different files, links resolved: a split listed with the other's shards evaluated the model on its own
    training rows, and nothing said so."""
    _check_distinct(Path(dataset_dir) / "metadata.json",
                    {"train": meta.splits["train"].files, split: meta.splits[split].files}, train + files)


class _LabelClasses:
    """Which labels a split's files hold, as far as their footers' label statistics tell (min 0: a 0 is there, max 1:
    a 1 is; every row group with statistics: nothing else is). ``positives`` is read by the evaluator alone, to tell a
    split of one class (no AUC: best.pt by logloss, AUC early stopping refused), and was never checked: a hand-written
    metadata.json with positives 0 (not counted) had a split of both classes evaluated as one class, saying only
    "holds one class (..., 0 positives)". Statistics are untrusted, but labels outside 0/1 are refused anyway."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.complete = True  # every non-empty row group's statistics read

    def add(self, footer: pq.FileMetaData) -> None:
        for g in range(footer.num_row_groups):
            rg = footer.row_group(g)
            if rg.num_rows == 0:
                continue
            column = rg.column(0) if rg.num_columns else None
            # an integer label column only: a bool or double one (refused by its type later) compares equal to 0/1
            label = column is not None and column.path_in_schema == LABEL_COLUMN and column.physical_type == "INT32"
            stats = column.statistics if label else None
            if stats is None or not stats.has_min_max or not {stats.min, stats.max} <= {0, 1}:
                self.complete = False  # (labels outside 0/1 are the loaders' error, naming the row)
                continue
            self.seen |= {stats.min, stats.max}

    def check(self, where: Path, split: str, rows: int, positives: int) -> None:
        """`DatasetError` naming ``splits.<split>.positives`` when the statistics contradict which classes it says."""
        said = {label for label, count in ((0, rows - positives), (1, positives)) if count}
        missing = self.seen - said
        extra = said - self.seen if self.complete else set()
        if missing or extra:
            found = " and ".join(f"{label}s" for label in sorted(self.seen)) or "no labels"
            raise DatasetError(f"{where}: splits.{split}.positives: {positives:,} of {rows:,} rows, but the label "
                               f"statistics of its files show {found}"
                               f"{' (both classes)' if len(self.seen) == 2 else ''}; positives must count the rows "
                               "labelled 1")


def footer_rows(path: Path, footer: pq.FileMetaData) -> int:
    """The rows of the file whose parquet footer is `footer`, checked to agree with themselves: the loaders plan and
    size their buffers by the row groups' counts, where the row check against metadata.json took the file's total. A
    footer edited to say a billion rows in one row group sized a 52 GB buffer ("out of host memory: retry with a
    smaller data.batch_size"), and one whose row group says fewer rows than its columns hold had pyarrow read only that
    many: the rest of the rows were left out of training without a word. `DatasetError` naming the file otherwise."""
    total = 0
    for g in range(footer.num_row_groups):
        rg = footer.row_group(g)
        label = rg.num_columns and rg.column(0).path_in_schema == LABEL_COLUMN  # (else the schema check names it)
        values = rg.column(0).num_values if label else rg.num_rows  # the label: one value a row, nulls too
        if rg.num_rows < 0 or values != rg.num_rows:
            raise DatasetError(f"{path}: row group {g}: its footer says {rg.num_rows:,} rows but {values:,} values in "
                               f"its first column (a damaged or edited footer)")
        total += rg.num_rows
    if total != footer.num_rows:
        raise DatasetError(f"{path}: its footer says {footer.num_rows:,} rows but its {footer.num_row_groups} row "
                           f"group(s) hold {total:,} (a damaged or edited footer)")
    return total


def _is_int64_list(t: pa.DataType) -> bool:
    """A list of int64 values, whatever its item field is called (writers say item or element): ``list<int64>``, or
    the ``large_list`` (Polars writes every list column so, and pyarrow reads it back so from Polars' arrow schema) or
    ``fixed_size_list`` (a numpy [n, k] block, a Polars Array) of int64, which parquet stores as the same LIST and
    `check_table` casts to ``list<int64>`` (they were refused: "type large_list<element: int64> is not list<...>")."""
    return ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
            and t.value_type == pa.int64())


def _sizes_hint(names: list[str], column: str, sizes: list[int]) -> str:
    """Words naming the key behind an error about `column`, a sparse column of feature f: how the file (columns
    `names`) holds f, one column or k slot columns, and the dataset's ``multi_hot_sizes[f]`` ("" for another column,
    or a feature the file holds no column of). A multi-hot mismatch (metadata.json says another size than the file
    was written with) read "column SPARSE_6_0: missing" or "type int64 is not list<item: int64>", naming no key."""
    match = re.fullmatch(r"SPARSE_(\d+)(_\d+)?", column)
    f = int(match.group(1)) if match else NUM_SPARSE
    if f >= NUM_SPARSE:
        return ""
    slots = sum(1 for name in names if re.fullmatch(rf"SPARSE_{f}_\d+", name))
    held = (f"{slots} slot column{'s' if slots > 1 else ''}" if slots
            else f"one column {SPARSE_COLUMNS[f]}" if SPARSE_COLUMNS[f] in names else "")
    return (f" (the file holds feature {f} in {held}, the dataset's multi_hot_sizes[{f}] is {sizes[f]}: metadata.json, "
            "or the multi_hot_sizes the loader was given)") if held else ""


def _missing_hint(path: Path, names: list[str], column: str) -> str:
    """Where a missing `column` went, when the file or its path tells ("" otherwise): "column label: missing" was all a
    file said whose column is ``Label``, or one written with the label as a hive partition (``train/label=1/...``:
    pyarrow.dataset and pandas' ``partition_cols`` keep such a column in the folder's name, not in the file)."""
    other = [name for name in names if name.lower() == column.lower()]
    if other:
        return f" (the file has {other[0]}: column names are case-sensitive)"
    folder = next((part for part in Path(path).parts[:-1] if part.startswith(f"{column}=")), None)
    return (f" (its values are in the folder name {folder}, a partition key: write the column into every file)"
            if folder else "")


def _type_error(path: Path, name: str, actual: pa.DataType, want: pa.DataType, names: list[str],
                sizes: list[int]) -> DatasetError:
    """The error of a column of the wrong type; says so when it is a multi-hot or a dense format mismatch."""
    why = ""
    if _is_int64_list(actual) and name in SPARSE_COLUMNS:
        why = (f" (a multi-hot column, but the dataset's multi_hot_sizes[{SPARSE_COLUMNS.index(name)}] is 1: "
               "metadata.json, or the multi_hot_sizes the loader was given)")
    if actual == pa.int64() and _is_int64_list(want):  # the other way round: a one-hot column, sizes[f] > 1
        why = _sizes_hint(names, name, sizes)
    if name in DENSE_COLUMNS and {actual, want} == {pa.int32(), pa.float32()}:
        why = (f" (the dataset's dense_format is {'float' if want == pa.float32() else 'counts'!r}: metadata.json, "
               "or the dense_format the loader was given)")
    if not why:  # pandas writes int64 labels and counts, Spark and DuckDB booleans or doubles: say what to write
        why = f" (write the column as {want}: data/README.md, \"Columns\")"
    return DatasetError(f"{path}: column {name}: type {actual} is not {want}{why}")


def file_layout(schema: pa.Schema, multi_hot_sizes: list[int] | None = None) -> SparseLayout:
    """The sparse layout a shard's schema holds: "slots" when its first multi-hot feature f has the slot
    column ``SPARSE_<f>_0``, else "lists" (one-hot data: "lists", the layouts coincide). `check_schema`
    then holds the whole file to that layout, so a file mixing the two is refused, naming a column."""
    sizes = multi_hot_sizes if multi_hot_sizes is not None else one_hot_sizes()
    if not is_multi_hot(sizes):
        return "lists"
    first = next(f for f, size in enumerate(sizes) if size > 1)
    return "slots" if slot_column(first, 0) in schema.names else "lists"


def check_schema(path: Path, schema: pa.Schema, multi_hot_sizes: list[int] | None = None,
                 layout: SparseLayout | None = None, dense_format: DenseFormat = "counts") -> SparseLayout:
    """`schema` must have exactly `arrow_schema(multi_hot_sizes, layout, dense_format)`'s columns, in its
    order and with its types (nullable fields are accepted: nulls follow `check_table`'s policy; a list's
    item field may have any name); raises `DatasetError` naming the file and the first offending column.
    `layout` None: the file's own (`file_layout`). Returns the layout checked."""
    layout = layout or file_layout(schema, multi_hot_sizes)
    expected = arrow_schema(multi_hot_sizes, layout, dense_format)
    names, sizes = schema.names, multi_hot_sizes if multi_hot_sizes is not None else one_hot_sizes()
    for fld in expected:
        count = names.count(fld.name)
        if count == 0:
            raise DatasetError(f"{path}: column {fld.name}: missing"
                               f"{_sizes_hint(names, fld.name, sizes) or _missing_hint(path, names, fld.name)}")
        if count > 1:
            raise DatasetError(f"{path}: column {fld.name}: appears {count} times")
        actual = schema.field(fld.name).type
        if not (actual == fld.type or (_is_int64_list(fld.type) and _is_int64_list(actual))):
            raise _type_error(path, fld.name, actual, fld.type, names, sizes)
    for name in names:
        if expected.get_field_index(name) < 0:
            slots = " (a multi-hot feature as SPARSE_<f>_<slot> columns)" if layout == "slots" else ""
            # pandas writes a DataFrame's index as a column whenever it is not a plain 0..n-1 range (after a
            # shuffle, a filter, a concat): the column was named, but not where it came from or how to leave it out
            index = ("; pandas wrote the DataFrame's index as this column: write the file with "
                     "to_parquet(..., index=False)") if re.fullmatch(r"__index_level_\d+__", name) else ""
            raise DatasetError(f"{path}: column {name}: not part of the dataset schema (expected exactly "
                               f"{LABEL_COLUMN}, DENSE_0..{NUM_DENSE - 1}, SPARSE_0..{NUM_SPARSE - 1}{slots})"
                               f"{_sizes_hint(names, name, sizes)}{index}")
    for i, (name, want) in enumerate(zip(names, expected.names)):
        if name != want:
            raise DatasetError(f"{path}: column {name}: at position {i}, where {want} belongs (columns out of order)")
    return layout


# The null policy (data/README.md): a null category is the missing category, a null count is a
# missing count (stored as 0); a null label has no meaning, so it is an error, never a guess.
_NULL_FILL = {**{c: MISSING_DENSE for c in DENSE_COLUMNS}, **{c: MISSING_SPARSE for c in SPARSE_COLUMNS}}
_SPARSE_INDEX = set(SPARSE_COLUMNS)


def _label_error(path: Path, group: int, first_row: int, label: pa.ChunkedArray) -> DatasetError:
    """The error for the first null or out-of-range label of a row group (the error path only)."""
    null = pc.is_null(label).to_numpy()
    values = pc.fill_null(label, 0).to_numpy()
    i = int(np.flatnonzero(null | ((values != 0) & (values != 1)))[0])
    where = f"{path}: column {LABEL_COLUMN}: row index {first_row + i} (row group {group})"
    if null[i]:
        return DatasetError(f"{where} is null; every row needs a label 0 or 1")
    return DatasetError(f"{where} holds {int(values[i])}; labels must be 0 or 1")


def check_labels(path: Path, group: int, first_row: int, label: pa.ChunkedArray) -> None:
    """Raise `DatasetError` naming file, column and row unless every label is 0 or 1 (vectorized:
    a null count and one `min_max` over the column)."""
    if label.null_count:
        raise _label_error(path, group, first_row, label)
    if len(label):
        bounds = pc.min_max(label)
        if bounds["min"].as_py() < 0 or bounds["max"].as_py() > 1:
            raise _label_error(path, group, first_row, label)


def list_lengths(column: pa.Array) -> np.ndarray:
    """Values per row (int64 numpy) of a ``list<int64>`` array; a null list has none."""
    lengths = pc.list_value_length(column)
    if lengths.null_count:  # only then: fill_null's scalar 0 (`pa.scalar`) imports pandas, as to_numpy does
        lengths = pc.fill_null(lengths, 0)
    return numpy_of(lengths).astype(np.int64, copy=False)


def _list_error(path: Path, group: int, first_row: int, name: str, lengths: np.ndarray, size: int) -> DatasetError:
    """The error for the first list longer than its feature's size (the error path only)."""
    i = int(np.flatnonzero(lengths > size)[0])
    return DatasetError(f"{path}: column {name}: row index {first_row + i} (row group {group}) holds "
                        f"{int(lengths[i])} values; multi_hot_sizes[{SPARSE_COLUMNS.index(name)}] allows at most {size}")


def _check_list_column(path: Path, group: int, first_row: int, name: str, column: pa.ChunkedArray,
                       size: int) -> tuple[pa.Array, int]:
    """A multi-hot column as one list array of at most `size` values a row, its null lists made
    empty and its null values -1 (`MISSING_SPARSE`); and the number of nulls replaced.
    Vectorized: one length pass and one max, plus a rebuild only when there are nulls."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not pa.types.is_list(array.type):  # large_list or fixed_size_list of int64 (`_is_int64_list`): as list<int64>
        try:
            array = array.cast(pa.list_(pa.int64()))
        except pa.ArrowException as e:  # over 2^31 values in one row group's column: int32 offsets cannot hold them
            raise DatasetError(f"{path}: column {name}: row group {group} cannot be read as a list<int64> ({e}); "
                               "write smaller row groups") from None
    lengths = list_lengths(array)
    if lengths.size and int(lengths.max()) > size:
        raise _list_error(path, group, first_row, name, lengths, size)
    values = array.flatten()  # the values of non-null lists, slicing offsets taken care of
    nulls = array.null_count + values.null_count
    if nulls:
        offsets = np.zeros(lengths.size + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = pc.fill_null(values, pa.scalar(MISSING_SPARSE, pa.int64()))
        array = pa.ListArray.from_arrays(pa.array(offsets), values)
    return array, nulls


def check_finite_dense(path: Path, group: int, first_row: int, table: pa.Table) -> None:
    """Every float dense value of `table` (nulls already replaced) must be finite, else `DatasetError` naming
    file, column and row: a NaN or an infinity would reach the model as it is and poison its weights."""
    for name in DENSE_COLUMNS:
        finite = pc.is_finite(table.column(name))
        if not pc.all(finite, min_count=0).as_py():  # min_count=0: an empty row group is all finite (not null)
            i = int(np.flatnonzero(~finite.to_numpy(zero_copy_only=False))[0])
            value = table.column(name)[i].as_py()
            raise DatasetError(f"{path}: column {name}: row index {first_row + i} (row group {group}) holds {value}; "
                               "float dense values must be finite")


def _slot_nulls(table: pa.Table, names: list[str], replaced: dict[str, int]) -> pa.Table:
    """The slot columns `names` of a "slots" table with their nulls made `PAD_SPARSE` (a slot that
    holds no value), counted in `replaced` under their column names."""
    for name in names:
        column = table.column(name)
        if column.null_count:
            replaced[name] = column.null_count
            filled = pc.fill_null(column, pa.scalar(PAD_SPARSE, column.type))
            table = table.set_column(table.schema.get_field_index(name), name, filled)
    return table


def check_compact(path: Path, group: int, first_row: int, table: pa.Table, bounds: tuple[int, int]) -> None:
    """Every sparse value of `table` (nulls already replaced) in ``bounds`` (``[lo, hi)``), else `DatasetError`
    naming file, column, row and value: the range of the compact int32 form a loader chose because the footers'
    statistics promised it (`dlrm.data.host_arena.compact_sparse_ok`). Statistics that lie (or a file changed since
    it was opened) would otherwise hand the model another value (-5 as 0xFFFFFFFB, 2^32 + 5 as 5) than the int64
    form would. Vectorized: one `min_max` a column."""
    lo, hi = bounds
    for name in table.column_names[1 + NUM_DENSE:]:  # the sparse columns (the schema is checked: label, dense first)
        column = table.column(name)
        values = pc.list_flatten(column) if pa.types.is_list(column.type) else column
        seen = pc.min_max(values)
        if len(values) == 0 or (seen["min"].as_py() >= lo and seen["max"].as_py() < hi):
            continue
        array = column.combine_chunks()
        flat = pc.list_flatten(array) if pa.types.is_list(array.type) else array
        numbers = flat.to_numpy(zero_copy_only=False)
        k = int(np.flatnonzero((numbers < lo) | (numbers >= hi))[0])
        row = pc.list_parent_indices(array)[k].as_py() if pa.types.is_list(array.type) else k
        raise DatasetError(f"{path}: column {name}: row index {first_row + row} (row group {group}) holds {numbers[k]}, "
                           f"outside [{lo}, {hi}) its footer's statistics promised (wrong statistics, or the file "
                           "changed since it was opened)")


def check_table(path: Path, group: int, first_row: int, table: pa.Table,
                multi_hot_sizes: list[int] | None = None, layout: SparseLayout = "lists",
                dense_format: DenseFormat = "counts",
                compact: tuple[int, int] | None = None) -> tuple[pa.Table, dict[str, int]]:
    """A decoded row group checked against the contract, and its nulls replaced by policy.

    Labels must be 0 or 1 and not null (else `DatasetError` naming file, column and row); a null
    dense count or float value becomes 0 (`MISSING_DENSE`; float values must be finite,
    `check_finite_dense`), a null category the missing value -1
    (`MISSING_SPARSE`). A multi-hot column (``multi_hot_sizes[f] > 1``, a list column) must hold at
    most ``multi_hot_sizes[f]`` values a row (else `DatasetError` naming file, column and row); a
    null list becomes an empty one, a null value in a list -1; in the "slots" layout (`layout`, the
    file's, `file_layout`) a null slot holds no value (`PAD_SPARSE`). Returns the table to use and the
    number of nulls replaced per column (``"SPARSE_<f>[]"`` for a list column's, the slot column's
    name for a slot's; empty for the usual table without nulls, which costs one `min_max` and a null
    count a column). `first_row`: the row group's first row within the file (for the messages). `compact`: the
    loader carries sparse values in the compact int32 form, whose range ``[lo, hi)`` every value must lie in
    (`check_compact`).
    """
    check_labels(path, group, first_row, table.column(LABEL_COLUMN))
    sizes = multi_hot_sizes if multi_hot_sizes is not None else one_hot_sizes()
    replaced: dict[str, int] = {}
    for name, fill in _NULL_FILL.items():
        size = sizes[SPARSE_COLUMNS.index(name)] if name in _SPARSE_INDEX else 1
        if size > 1 and layout == "slots":
            table = _slot_nulls(table, [slot_column(SPARSE_COLUMNS.index(name), j) for j in range(size)], replaced)
            continue
        column = table.column(name)
        if size > 1:
            array, nulls = _check_list_column(path, group, first_row, name, column, size)
            if nulls:
                replaced[f"{name}[]"] = nulls
            if nulls or array.type != column.type:  # (a large or fixed-size list: the list<int64> the readers copy)
                table = table.set_column(table.schema.get_field_index(name), name, array)
        elif column.null_count:
            replaced[name] = column.null_count
            filled = pc.fill_null(column, pa.scalar(fill, column.type))
            table = table.set_column(table.schema.get_field_index(name), name, filled)
    if dense_format == "float":
        check_finite_dense(path, group, first_row, table)
    if compact is not None:
        check_compact(path, group, first_row, table, compact)
    return table, replaced


def footer_label_check(path: Path, footer: pq.FileMetaData) -> None:
    """Fail at open, not mid-epoch, on a label the footer's statistics show to be null or out of
    range: only then is that row group's label column read, and `check_labels` names the row.

    Statistics may be missing or wrong (the file is untrusted), so this only moves errors
    earlier; the check of every decoded row group (`check_table`) is the one that guarantees it.
    """
    first_row = 0
    for g in range(footer.num_row_groups):
        try:
            rg = footer.row_group(g)
            stats = rg.column(0).statistics  # the label is column 0 (`check_schema`)
            nulls = stats is not None and stats.has_null_count and stats.null_count > 0
            outside = stats is not None and stats.has_min_max and (stats.min < 0 or stats.max > 1)
            label = None
            if nulls or outside:
                with pq.ParquetFile(path, metadata=footer) as reader:
                    label = reader.read_row_group(g, columns=[LABEL_COLUMN]).column(LABEL_COLUMN)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: row group {g}: cannot be read ({e})") from None
        if label is not None:
            check_labels(path, g, first_row, label)
        first_row += rg.num_rows


def open_shard(path: Path, multi_hot_sizes: list[int] | None = None,
               dense_format: DenseFormat = "counts") -> tuple[pq.FileMetaData, SparseLayout]:
    """The parquet footer of `path` and its sparse layout (`file_layout`), its schema checked
    (`check_schema`, against `multi_hot_sizes`, None: one-hot, and `dense_format`) and its labels
    pre-checked from the statistics (`footer_label_check`); unreadable -> `DatasetError`."""
    check_utf8_path(path)
    try:
        footer = pq.ParquetFile(path).metadata
        schema = footer.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    layout = check_schema(path, schema, multi_hot_sizes, dense_format=dense_format)
    footer_rows(path, footer)
    footer_label_check(path, footer)
    return footer, layout


def open_footer(path: Path, multi_hot_sizes: list[int] | None = None) -> pq.FileMetaData:
    """`open_shard`'s footer alone."""
    return open_shard(path, multi_hot_sizes)[0]


def first_rows(row_groups: list[tuple[int, int, int]]) -> list[int]:
    """For each (file, group, rows) entry, in file order, the group's first row within its file."""
    starts, at, current = [], 0, None
    for fi, _, n in row_groups:
        if fi != current:
            at, current = 0, fi
        starts.append(at)
        at += n
    return starts


# The null warnings this process logged, by (file, its size and mtime, the counts): a run's baseline and --resume's
# loaders read the files again, and each loader's tally said the same warning once more (a run whose train files hold
# nulls printed each file's warning twice: once by the training loader, once by the baseline's, as if it were news)
_REPORTED: set = set()
_REPORTED_LOCK = threading.Lock()


def _first_report(path: Path, counts: dict[str, int]) -> bool:
    """Whether this process has not logged `counts` for `path` as it is now (a rewritten file is news again)."""
    try:
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None
    key = (os.path.abspath(path), stamp, tuple(sorted(counts.items())))
    with _REPORTED_LOCK:
        if key in _REPORTED:
            return False
        _REPORTED.add(key)
        return True


class NullTally:
    """Counts the nulls `check_table` replaced, per file, and logs them once per file (a loguru
    warning) when every row group of the file has been checked; thread-safe (reader threads). A file's warning is
    said once per process (another loader of the same file, unchanged, finds the same nulls: not said again), and
    under torchrun by rank 0 (every rank reads every row group: the same counts)."""

    def __init__(self, files: list[Path], groups_per_file: list[int]):
        self._files = files
        self._left = [set(range(n)) for n in groups_per_file]
        self._counts: list[dict[str, int]] = [{} for _ in files]
        self._lock = threading.Lock()

    def add(self, file_index: int, group: int, replaced: dict[str, int]) -> None:
        """Record row group `group` of file `file_index` as checked, with its replaced nulls."""
        left = self._left[file_index]
        with self._lock:
            if group not in left:  # checked in an earlier epoch: nothing new
                return
            left.discard(group)
            counts = self._counts[file_index]
            for name, n in replaced.items():
                counts[name] = counts.get(name, 0) + n
            if left or not counts:
                return
        self._report(file_index, counts)

    def _report(self, file_index: int, counts: dict[str, int]) -> None:
        """One warning for the file: how many nulls of each kind were replaced, and by what."""
        parts = []
        for names, fill, what in ((DENSE_COLUMNS, MISSING_DENSE, "dense values"),
                                  (SPARSE_COLUMNS, MISSING_SPARSE, "categories (the missing value)")):
            hit = [f"{c} {counts[c]:,}" for c in names if c in counts]
            if hit:
                total = sum(counts[c] for c in names if c in counts)
                parts.append(f"{total:,} null {what} replaced by {fill} ({', '.join(hit)})")
        lists = [f"{c} {counts[c + '[]']:,}" for c in SPARSE_COLUMNS if c + "[]" in counts]
        if lists:
            total = sum(counts[c + "[]"] for c in SPARSE_COLUMNS if c + "[]" in counts)
            parts.append(f"{total:,} null multi-hot lists or values replaced by an empty list or {MISSING_SPARSE} "
                         f"({', '.join(lists)})")
        slots = [(c, n) for c, n in counts.items() if c not in _NULL_FILL and not c.endswith("[]")]
        if slots:
            parts.append(f"{sum(n for _, n in slots):,} null multi-hot slots replaced by no value ({PAD_SPARSE}) "
                         f"({', '.join(f'{c} {n:,}' for c, n in slots)})")
        if _first_report(self._files[file_index], counts):
            run_logger.warning(f"{self._files[file_index]}: {'; '.join(parts)}")

