"""Raw Criteo click logs (Kaggle ``train.txt``, Terabyte ``day_N``, TSV or CSV, plain or gzip) to a dataset.

The dataset follows the contract in `dlrm.data.schema`: ``train/``, ``validation/`` and ``test/``
parquet shards written with `arrow_schema()`, an optional ``vocab/`` directory, and
``metadata.json`` written last. Multi-hot fields (``--multi-hot-sizes``) are stored in the layout of
``--sparse-layout``: "slots" (default; one int64 column a slot, -2 in an empty one, schema version
3, read 1.6-2x faster) or "lists" (one ``list<int64>`` column, version 2); a resumed run keeps the
layout it started with.

Pipeline (``python -m dlrm.preprocess --help`` for the options)::

    1. count pass   every input is read once (gzip decompressed as a stream); it counts the lines,
                    detects the format, records the byte offset where every chunk of
                    ``chunk_rows`` lines starts and samples the lines (`line_sample`; inputs sharing
                    most of their lines are refused, `same_content`, or kept with a warning
                    under ``--allow-shared-rows``) (parallel over files; a big plain
                    file is counted in byte ranges by all workers, `scan_file_parallel`).
    2. parse pass   every chunk is parsed by a vectorized numpy tokenizer (`parse_chunk`),
                    each line is given a split from its global line number (`SplitPlan`), and the
                    chunk's rows of each split become one shard ``<split>/part-FFFF-CCCCCC.parquet``
                    (FFFF = input file, CCCCCC = chunk of that file). Chunks run in worker
                    processes; plain files are read by the workers from the recorded offsets,
                    gzip files are decompressed by reader threads of the main process.
    3. tables       the distinct values (and, for vocabulary hashing, their frequencies) of the
                    train rows are merged in the main process (`DistinctCounter`).
    4. finish       vocabularies, then ``metadata.json``; the progress directory is removed.

Memory: at most two chunks per worker are in flight (``--chunk-rows`` lines each), whatever the
input size; the main process holds the distinct values of the train split (4 bytes per value, 8
with frequencies).

Bad input, ``--on-bad-line stop`` (default): the run fails with one line ``FILE:LINE: column C: 'VALUE'
...`` for the first bad line and writes no metadata.json; finished shards stay (complete, recorded)
so that a run with the same inputs resumes, and a run that finished nothing removes what it made.
``skip``: bad lines are dropped and counted per reason (`BAD_LINE_REASONS`) in the log and in
``metadata.extra["bad_lines"]``, the first one's message in the log and ``metadata.extra["first_bad_line"]``.
Reasons: wrong number of fields (a plain file cut mid-line included: the message says the file ends
there without a newline), label not 0/1, count not an integer (``260.0`` is one), category not 1 to 8
hex digits (or, in a file that ends without a newline, a last value of fewer than 8: a copy cut inside
it, `cut_line`), empty file, corrupt gzip (a truncated stream keeps its complete lines in skip mode;
damage inside the stream, where the decompressed bytes cannot be trusted, drops the whole file).

Replacing (``--overwrite`` of a complete dataset): the new dataset is built in ``OUT/.preprocess-new/`` and swapped
in once complete (`replace`), so a failure or a stop keeps the old one; the same command without --overwrite resumes.

Resuming: the output directory holds ``_progress/`` while a run is unfinished: ``manifest.json``
(options, input fingerprints and the count pass), ``done.jsonl`` (one line per finished chunk,
appended after its shards were renamed into place) and ``stats.npz`` (a periodic checkpoint of the
distinct-value tables). A run started again with the same inputs and options skips the finished
chunks and re-derives the table statistics of finished chunks that the checkpoint does not cover
from their train shards, so the result is identical to an uninterrupted run: shard names and
contents and the split of every line depend only on the inputs and options, never on timing or on
the number of workers.

Before anything is written, every option, the inputs (each an existing, readable file, given once:
another spelling of a path, a symlink or a hard link to a file already listed is refused, and so is a
copy of its data, plain or gzip'ed, or of its rows in other bytes or order, or a part of them, `same_content`; an
archive such as Kaggle's ``dac.tar.gz``, or a bzip2, xz or zstd file, is named as such, `input_kinds`) and the output
location are checked (`options`; the copies of rows after the count pass, `same_content.same_rows`); a run that
fails before it finished a chunk removes what it created, so the corrected command starts afresh.

Modules (this package re-exports the names other code uses)::

    constants   field layout, defaults, option names
    errors      PreprocessError, BadLine, BadLineError
    parse       the vectorized chunk parser (`parse_chunk`)
    scan        the count pass (`scan_file`, `scan_file_parallel`; a UTF-8 byte-order mark is skipped)
    input_kinds archives and codecs the preprocessor does not read, named from their magic bytes
    cut_line    a file cut off inside its last value
    line_endings lines ended by a carriage return alone, named as such
    same_content two inputs of the same data (a copy; plain and gzip'ed) or rows (CRLF, BOM, reordered, a part), refused
    line_sample the count pass's content-defined sample of each input's lines, for `same_content.same_rows`
    splits      `SplitPlan`, the counter-based `random_uniform`
    stats       `DistinctCounter`, per-chunk `sparse_stats`
    worker      one chunk in a worker process (parse, split, write shards)
    schedule    running the chunks inline or in the pool; recording finished ones
    options     checks of options, inputs and output location (before anything is written)
    output      the output directory: refusal to clobber, manifest, progress, cleanup
    replace     --overwrite of a complete dataset: staged beside it, swapped in whole, a stopped swap finished
    finish      vocabularies, metadata.json, the summary
    empty_splits the summary's advice for an empty train or validation split, true for the input at hand
    run         `preprocess`: the steps in order
    cli         ``python -m dlrm.preprocess``
"""

from __future__ import annotations

# The private names marked noqa are re-exported for tests. Worker entry points are pickled by their
# defining submodule (``dlrm.data.preprocess.worker._process_chunk``), which spawned workers import.
from dlrm.data.preprocess.cli import build_cli, main
from dlrm.data.preprocess.constants import (
    BAD_LINE_REASONS,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_ROWS_PER_TABLE,
    DEFAULT_ROW_GROUP_ROWS,
    INT32_MAX,
    MANIFEST_VERSION,
    NUM_FIELDS,
    PROGRESS_DIR,
    RAW_COLUMNS,
)
from dlrm.data.preprocess.errors import (
    BadLine,
    BadLineError,
    InterruptedWhenComplete,
    PreprocessError,
    _Interrupted,  # noqa: F401
)
from dlrm.data.preprocess.options import RunOptions, check_inputs, check_options, check_output_location
from dlrm.data.preprocess.parse import ParsedChunk, parse_chunk
from dlrm.data.preprocess.run import preprocess
from dlrm.data.preprocess.scan import FileScan, scan_file, scan_file_parallel
from dlrm.data.preprocess.splits import (
    SplitPlan,
    _splitmix64,  # noqa: F401
    random_uniform,
)
from dlrm.data.preprocess.stats import (
    DistinctCounter,
    _group_counts,  # noqa: F401
    sparse_stats,
)
from dlrm.data.preprocess.worker import (
    _process_chunk,  # noqa: F401
    shard_name,
)

# Tunables (_BLOCK_BYTES, _SCAN_RANGE_BYTES, _PARALLEL_SCAN_MIN_BYTES, ...) are deliberately not
# re-exported: a test that patches one must patch the submodule that reads it (e.g. ``scan``).

__all__ = [
    "BAD_LINE_REASONS",
    "BadLine",
    "BadLineError",
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_MAX_ROWS_PER_TABLE",
    "DEFAULT_ROW_GROUP_ROWS",
    "DistinctCounter",
    "FileScan",
    "INT32_MAX",
    "InterruptedWhenComplete",
    "MANIFEST_VERSION",
    "NUM_FIELDS",
    "PROGRESS_DIR",
    "ParsedChunk",
    "PreprocessError",
    "RAW_COLUMNS",
    "RunOptions",
    "SplitPlan",
    "build_cli",
    "check_inputs",
    "check_options",
    "check_output_location",
    "main",
    "parse_chunk",
    "preprocess",
    "random_uniform",
    "scan_file",
    "scan_file_parallel",
    "shard_name",
    "sparse_stats",
]
