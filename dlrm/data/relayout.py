"""Rewrite a dataset's multi-hot features in another sparse layout (and, if asked, another codec, or its
dense counts as the float values the model takes).

    python -m dlrm.data.relayout --data data/mlperf-syn --output data/mlperf-syn-slots
    python -m dlrm.data.relayout --data data/mlperf-syn --output data/mlperf-zstd --sparse-layout lists \
        --compression zstd

A dataset written before the "slots" layout existed (schema version 2: one ``list<int64>`` column a
multi-hot feature) is read 1.6-2x slower than the same rows in slot columns, one int64 column a slot
(`dlrm.data.schema`, version 3), and MLPerf DLRM-DCNv2 trains 1.3-1.45x slower streaming it
(benchmarks/results/sparse_layout_mlperf.md). This makes the slot copy
without preprocessing or generating again: every file of every split is read row group by row group,
checked as the loaders check it (schema, labels, list lengths, nulls replaced by the same policy),
and written with the same path, row groups and rows, the multi-hot features in ``--sparse-layout``;
label, dense and one-hot columns are copied as they are. ``vocab/`` is copied, ``metadata.json``
gets the new layout (version 3 for slots) and an ``extra.relayout`` record of where it came from.
``--dense-format float`` stores a counts dataset's dense columns as float32 ``log1p(max(x, 0))``, the
loaders' own transform (`dlrm.data.batch.transform_dense`), so the copy trains exactly as the original
(``dense_format`` "float", schema version 4); a float dataset keeps its values (there are no counts to
recover from them).

A slot column keeps a row's values first and -2 (no value) after them; going back to lists drops
the -2s after a row's last value (a -2 between two values, as another writer may store it, stays), so
lists -> slots -> lists gives back the same lists (less any -2s a list ends with, which the loaders read as the
same empty slots either way) and slots -> lists -> slots the same slots.
``--output`` is written whole into a temporary directory beside it and renamed into place at the end: it
never holds a half-written dataset (a failed run removes the temporary directory and the parents of
``--output`` it made), and an existing non-empty ``--output`` is refused unless ``--overwrite`` (an
``--output`` that is ``--data``, holds it or lies inside it is refused even then).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
from click.core import ParameterSource
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from loguru import logger

from dlrm.data.batch import transform_dense

from dlrm.data.host_arena import list_slots
from dlrm.data.preprocess.options import CODECS
from dlrm.data.preprocess.output import _first_missing, _remove_empty_dirs
from dlrm.data.schema import (
    NUM_SPARSE,
    SPARSE_COLUMNS,
    SPARSE_LAYOUTS,
    DENSE_COLUMNS,
    DENSE_FORMATS,
    PAD_SPARSE,
    DatasetError,
    DenseFormat,
    Metadata,
    SparseLayout,
    arrow_schema,
    feature_columns,
    read_metadata,
    slot_column,
    write_options,
    write_metadata,
)
from dlrm.data.output_dirs import (check_apart, check_named, check_parent_writable, check_replaceable, check_target,
                                   check_unowned, dataset_read_lock, output_lock, recover_replaced, remove_stale_temps,
                                   replace_dir)
from dlrm.data.validation import NullTally, check_table, check_utf8_path, first_rows, open_shard, split_files
from dlrm.data.vocabulary import read_vocabulary
from dlrm.errors import report_bug
from dlrm.logging_setup import ProgressBar, configure_logging, counted
from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand
from dlrm.stop_signal import EXIT_INTERRUPTED, StopAtOnce, interruption

EXIT_BAD_INPUT = 2


def table_in_layout(table: pa.Table, sizes: list[int], source: SparseLayout, layout: SparseLayout,
                    dense_format: DenseFormat = "counts") -> pa.Table:
    """`table` (checked rows in the `source` layout) with its multi-hot features in `layout`
    (`arrow_schema(sizes, layout, dense_format)`); every other column as it is."""
    schema = arrow_schema(sizes, layout, dense_format)
    if source == layout:
        return table.cast(schema)  # the same columns; nullability as this project writes it
    arrays = {name: table.column(name) for name in table.column_names}
    for f, size in enumerate(sizes):
        if size == 1:
            continue
        if layout == "slots":  # one list column -> size slot columns, -2 after each row's values
            slots = list_slots(arrays.pop(SPARSE_COLUMNS[f]), size)
            arrays.update(zip((slot_column(f, j) for j in range(size)), feature_columns(slots, "slots")))
        else:  # size slot columns -> one list column, the -2s after each row's last value dropped
            block = np.stack([arrays.pop(slot_column(f, j)).to_numpy() for j in range(size)], axis=1)
            arrays[SPARSE_COLUMNS[f]] = slots_as_lists(block)
    return pa.Table.from_arrays([arrays[name] for name in schema.names], schema=schema)


def slots_as_lists(slots: np.ndarray) -> pa.ListArray:
    """A feature's slots, int64 [n, size], as a ``list<int64>`` array holding each row's slots up to its last value.

    Only the `PAD_SPARSE` slots after a row's last value are dropped: a -2 between two values (another writer's
    row [5, -2, 7]) stays in the list, where the loaders read it back into the same slot (`list_slots`), so
    slots -> lists -> slots gives back the same slots. Dropping every -2 (`dlrm.data.schema.slots_to_list_array`,
    right for the writers' values-first rows) moved the 7 into the middle slot: the same pooled sum, not the
    same data."""
    n, size = slots.shape
    filled = slots != PAD_SPARSE
    # each row's length: 1 + the index of its last value (0 for a row of -2s only)
    lengths = np.where(filled.any(axis=1), size - np.argmax(filled[:, ::-1], axis=1), 0)
    keep = np.arange(size) < lengths[:, None]
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(slots[keep], pa.int64()))


def dense_as_float(table: pa.Table) -> pa.Table:
    """`table` with its dense counts (int32) replaced by the model's float32 input, ``log1p(max(x, 0))``
    computed by `transform_dense` itself (the same bits the loaders would compute on the CPU)."""
    counts = np.stack([table.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
    values = transform_dense(torch.from_numpy(counts)).numpy()
    for j, name in enumerate(DENSE_COLUMNS):
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(values[:, j], pa.float32()))
    return table


def relayout_file(src: Path, dst: Path, sizes: list[int], layout: SparseLayout, codec: str | None,
                  dense_format: DenseFormat = "counts", out_dense: DenseFormat | None = None) -> int:
    """`src` (its dense columns in `dense_format`) rewritten to `dst` in `layout` (row group by row group,
    each checked as the loaders check it), `codec` (None: the file's own) and `out_dense` (None: as they
    are; "float" from counts: `dense_as_float`); its rows. Raises `DatasetError` naming `src` on a bad file."""
    out_dense = out_dense or dense_format
    footer, source = open_shard(src, sizes, dense_format)
    if codec is None:
        codec = footer.row_group(0).column(0).compression.lower() if footer.num_row_groups else "none"
        codec = "none" if codec == "uncompressed" else codec
    groups = [(0, g, footer.row_group(g).num_rows) for g in range(footer.num_row_groups)]
    dst.parent.mkdir(parents=True, exist_ok=True)
    rows = 0
    # the nulls replaced, in the loaders' one warning a file: the copy holds none, so no loader would say it
    nulls = NullTally([src], [footer.num_row_groups])
    with pq.ParquetFile(src, metadata=footer) as reader, \
            pq.ParquetWriter(dst, arrow_schema(sizes, layout, out_dense), compression=None if codec == "none" else codec,
                             **write_options(sizes, layout)) as writer:
        for (_, g, n), first in zip(groups, first_rows(groups)):
            try:
                table = reader.read_row_group(g)
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{src}: row group {g}: cannot be read ({e})") from None
            table, replaced = check_table(src, g, first, table, sizes, source, dense_format)
            nulls.add(0, g, replaced)
            if out_dense != dense_format:
                table = dense_as_float(table)
            writer.write_table(table_in_layout(table, sizes, source, layout, out_dense), row_group_size=max(1, n))
            rows += n
    return rows


def relayout(data: Path, output: Path, layout: SparseLayout, codec: str | None = None, workers: int | None = None,
             overwrite: bool = False, dense_format: DenseFormat | None = None, layout_given: bool = False) -> Metadata:
    """Write `data`'s every split into `output` in `layout` (and `codec`, None keeps each file's; and
    `dense_format`, None or the dataset's keeps the dense columns, "float" turns counts into the model's
    float input); the new metadata. `output` appears only when every file is done. `layout_given`: `layout` was
    asked for (--sparse-layout on the command line), refused for a one-hot dataset, where it cannot act."""
    # --data held for reading (`dataset_read_lock`) from before its metadata.json is read: a tool's --overwrite of it
    # between that read and the lock made a copy of the new dataset's files under the old one's metadata (other
    # table sizes and counts), exit 0
    with dataset_read_lock(data, "--data"):
        return _checked_relayout(data, output, layout, codec, workers, overwrite, dense_format, layout_given)


def _checked_relayout(data: Path, output: Path, layout: SparseLayout, codec: str | None, workers: int | None,
                      overwrite: bool, dense_format: DenseFormat | None, layout_given: bool = False) -> Metadata:
    """`relayout`, holding --data for reading."""
    meta = read_metadata(data)
    if layout_given and not meta.is_multi_hot:
        # one-hot columns are the same in either layout: the copy was the same files (schema version 2), exit 0, its
        # log line naming the layout asked for as if it had been written
        raise click.ClickException(f"--sparse-layout {layout}: {data} is one-hot (no multi-hot feature to lay out); "
                                   "leave the option out")
    out_dense = dense_format or meta.dense_format
    if out_dense not in DENSE_FORMATS or (out_dense == "counts" and meta.dense_format == "float"):
        raise click.ClickException(f"--dense-format: {out_dense!r:.40} is not one of keep, float ({data} holds "
                                   f"{meta.dense_format}; float values cannot be turned back into counts)")
    for path in (data, output):  # pyarrow opens (and writes) files by a UTF-8 path only
        check_utf8_path(path)
    if meta.hashing == "vocabulary":
        # vocab/ is copied as it is: a missing, truncated or unsorted vocabulary file made a copy (exit 0) that no
        # run can train on. Checked as training reads them (`read_vocabulary`), before anything is written.
        for f in range(NUM_SPARSE):
            read_vocabulary(data, f, meta.cardinalities[f])
    # the copy keeps the input's relative paths (its split files, vocab/), in a ".relayout-<random>" sibling first
    check_named(output, "--output", temp=".relayout-xxxxxxxx", files=[*(f for info in meta.splits.values()
                                                                          for f in info.files), "vocab/C26.npy"])
    check_apart("--data", data, "--output", output, "write the copy somewhere else")
    check_target(output, overwrite, "directory", "--output")
    check_unowned(output, "--output")  # (no dataset inside another, a run or a sweep)
    check_replaceable(output, "--output")  # (--overwrite of a folder that holds no dataset)
    check_parent_writable(output, "--output")
    # one run of an --output at a time: a second one's copy was silently replaced by the first's at its end
    with output_lock(output, "--output"):
        recover_replaced(output)  # what a run killed while replacing --output left (`replace_dir`)
        check_target(output, overwrite, "directory", "--output")  # again, under the lock: another may have finished
        # meanwhile
        check_replaceable(output, "--output")
        return _relayout(data, output, layout, codec, workers, meta, out_dense)


def _relayout(data: Path, output: Path, layout: SparseLayout, codec: str | None, workers: int | None, meta: Metadata,
              out_dense: DenseFormat) -> Metadata:
    """`relayout`'s work, its arguments checked and its --output locked."""
    # a split without rows lists no files (the preprocessor's tiny inputs, a fraction 0): nothing to rewrite, and
    # `split_files` refuses it (a loader must not open it); its entry is kept as it is
    files = [(split, f) for split, info in meta.splits.items() if info.files or info.rows
             for f in split_files(data, meta, split)]
    created = _first_missing(output.parent)  # the directories made for --output, removed again on a failure
    tmp: Path | None = None
    started = time.perf_counter()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(output, ".{name}.relayout-{rand}")  # a killed run's (this one holds --output's lock)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.relayout-", dir=output.parent))
        if (data / "vocab").is_dir():
            shutil.copytree(data / "vocab", tmp / "vocab")
        sizes = meta.multi_hot_sizes
        pool = ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1))  # pyarrow and numpy release the GIL
        try:
            jobs = [pool.submit(relayout_file, f, tmp / f.relative_to(data), sizes, layout, codec, meta.dense_format,
                                out_dense) for _, f in files]
            rows = sum(job.result() for job in ProgressBar(jobs, desc="relayout", unit="file", disable=None))
        finally:
            # On a failure (a bad file, Ctrl-C) the files still queued are dropped, not all rewritten first (a
            # `with` block's exit waits for every one of them); those being written finish before `tmp` goes.
            pool.shutdown(wait=True, cancel_futures=True)
        record = {"from": str(data), "from_layout": meta.sparse_layout, "compression": codec or "kept",
                  "from_dense_format": meta.dense_format}
        new = Metadata(cardinalities=meta.cardinalities, multi_hot_sizes=sizes, hashing=meta.hashing,
                       splits=meta.splits, schema_version=meta.schema_version,
                       extra={**meta.extra, "relayout": record}, sparse_layout=layout, dense_format=out_dense)
        write_metadata(tmp, new)
        replace_dir(tmp, output)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) and tmp is not None and not tmp.exists():  # renamed into place whole:
            # only the removal of the replaced --output (--overwrite) was cut; not "--output was not written"
            raise InterruptedWhenComplete(output, interruption(e)[0]) from None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:  # a failed run leaves nothing behind, not even the parents of --output it made
            _remove_empty_dirs(output.parent.absolute(), created)
        raise
    seconds = time.perf_counter() - started
    shape = layout if meta.is_multi_hot else "one-hot"  # (one-hot columns have no layout: "slots" at version 2 misled)
    logger.info(f"wrote {output} ({shape}, dense {out_dense}, schema version {new.written_version}): {counted(len(files), 'file')}, "
                f"{counted(rows, 'row', ',')} "
                f"in {seconds:.1f}s")
    return new


class InterruptedWhenComplete(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: `exit_code`) after --output was renamed into place whole, as the directory it replaced was
    being removed: the new one is complete."""

    def __init__(self, output, exit_code: int = EXIT_INTERRUPTED) -> None:
        super().__init__(str(output))
        self.exit_code = exit_code


@click.command(cls=OneLineUsageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", type=NonEmptyPath("the dataset directory to read", file_okay=False, exists=True,
                                          path_type=Path), required=True,
              help="The dataset directory to read (any schema version).")
@click.option("--output", type=NonEmptyPath(path_type=Path), required=True, help="The dataset directory to create.")
@click.option("--sparse-layout", type=click.Choice(SPARSE_LAYOUTS), default="slots", show_default=True,
              help="slots: one int64 column a multi-hot slot (schema version 3, read 1.6-2x faster); lists: one list "
                   "column a feature (version 2).")
@click.option("--compression", type=click.Choice(("keep", *CODECS)), default="keep", show_default=True,
              help="Parquet codec of the new files (keep: each file's own).")
@click.option("--dense-format", type=click.Choice(("keep", "float")), default="keep", show_default=True,
              help="float: dense counts stored as the model's float32 input, log1p(max(x, 0)) (schema version 4); "
                   "keep: as they are.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Files rewritten at once [default: min(cores, 8)].")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --output directory.")
def main(data, output, sparse_layout, compression, dense_format, workers, overwrite):
    """Rewrite a dataset's multi-hot features in another sparse layout (see the module docstring).

    Exit codes: 0 done; 1 a bug (traceback, then a line saying so); 2 a bad dataset, argument or an
    occupied output; 130 Ctrl-C; 143 SIGTERM. --output is written only when every file is done.
    """
    configure_logging()
    try:  # SIGTERM raises as Ctrl-C does: its default action left the temporary directory beside --output
        with StopAtOnce(interrupt=True):
            given = click.get_current_context().get_parameter_source("sparse_layout") == ParameterSource.COMMANDLINE
            relayout(data, output, sparse_layout, None if compression == "keep" else compression, workers, overwrite,
                     None if dense_format == "keep" else dense_format, layout_given=given)
    except KeyboardInterrupt as e:  # Ctrl-C (130), or SIGTERM (`Terminated`: 143)
        code, what = interruption(e)
        if isinstance(e, InterruptedWhenComplete):  # still 130 (143): a calling script must stop
            logger.error(f"interrupted ({what}) after {output} was complete (metadata.json written); it is usable as "
                         "it is")
        else:
            logger.error(f"interrupted ({what}): --output was not written")
        sys.exit(code)
    except (DatasetError, click.ClickException) as e:
        logger.error(e.format_message() if isinstance(e, click.ClickException) else str(e))
        sys.exit(EXIT_BAD_INPUT)
    except OSError as e:
        logger.error(f"cannot write the dataset: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}")
        sys.exit(EXIT_BAD_INPUT)
    except Exception as e:  # noqa: BLE001 - anything else is a bug: traceback and a line saying so
        sys.exit(report_bug(e))


if __name__ == "__main__":
    main()
