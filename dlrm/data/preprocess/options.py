"""Checks that run before a preprocessing run creates anything: options, input files, output location.

Every check raises `PreprocessError` with one line naming the option (as its command-line flag),
the value or the file, so that a bad command fails at once and leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import io
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.data.output_dirs import dangling_link_error, owner_of
from dlrm.data.preprocess.constants import DEFAULT_SPARSE_LAYOUT, PROGRESS_DIR, RECORDLESS_SPARSE_LAYOUT
from dlrm.data.preprocess.errors import PreprocessError
from dlrm.data.preprocess.frequency import AUTO
from dlrm.data.preprocess.input_kinds import unreadable_kind
from dlrm.data.preprocess.same_content import same_bytes
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE, SPARSE_LAYOUTS, SPLITS

SPLIT_MODES = ("sequential", "random", "days")
HASHINGS = ("modulus", "vocabulary")
INPUT_FORMATS = ("auto", "tsv", "csv")
ON_BAD_LINE = ("stop", "skip")
CODECS = ("zstd", "snappy", "lz4", "gzip", "brotli", "none")
_MAX_MIN_FREQUENCY = 2**32 - 1  # the largest count `DistinctCounter` stores (uint32)


@dataclass(frozen=True)
class RunOptions:
    """The validated options of one run (see `preprocess` for their meaning)."""

    input_format: str
    split: str
    validation_fraction: float
    test_fraction: float
    seed: int
    hashing: str
    min_frequency: int | None  # None until "auto" is resolved from the train split's size (`with_min_frequency`)
    max_rows: int | None  # cap of a modulus table; None: no cap
    chunk_rows: int
    row_group_rows: int
    compression: str
    compression_level: int | None
    workers: int
    on_bad_line: str
    overwrite: bool
    checkpoint_interval: float
    progress: bool
    min_frequency_auto: bool = False  # --min-frequency auto: the manifest keeps "auto", resolved per run
    multi_hot_sizes: list[int] | None = None  # --multi-hot-sizes; None: one-hot
    # --sparse-layout of multi-hot data ("lists" when one-hot: both layouts are the same files); None
    # until settled by `with_sparse_layout` when not given (a resumed run keeps the one it recorded)
    sparse_layout: str | None = "lists"
    # --allow-shared-rows: inputs sharing most of their rows are warned of, not refused (`same_content.same_rows`);
    # not an output option (the shards are the same): a resume compares the finding its manifest records instead
    allow_shared_rows: bool = False

    @property
    def count_cap(self) -> int | None:
        """Where the frequency counts saturate (vocabulary hashing with a threshold), else None."""
        if self.hashing != "vocabulary":
            return None
        if self.min_frequency is None:
            raise ValueError("--min-frequency auto is resolved after the count pass (with_min_frequency)")
        return self.min_frequency if self.min_frequency > 1 else None

    def with_min_frequency(self, value: int) -> "RunOptions":
        """These options with "auto" resolved to `value` (the manifest still says "auto")."""
        return dataclasses.replace(self, min_frequency=value)

    def with_sparse_layout(self, recorded: dict | None) -> "RunOptions":
        """These options with the layout settled: the one given, else the one in the options
        `recorded` by the unfinished run this one resumes (`RECORDLESS_SPARSE_LAYOUT` if they lack it),
        else `DEFAULT_SPARSE_LAYOUT` (None: a new run)."""
        if self.sparse_layout is not None:
            return self
        if recorded is None:
            return dataclasses.replace(self, sparse_layout=DEFAULT_SPARSE_LAYOUT)
        layout = recorded.get("sparse_layout", RECORDLESS_SPARSE_LAYOUT)
        if layout not in SPARSE_LAYOUTS:
            raise PreprocessError(f"the unfinished run in the output records sparse_layout {layout!r:.40}, not one of "
                                  f"{', '.join(SPARSE_LAYOUTS)}; use --overwrite to start over")
        return dataclasses.replace(self, sparse_layout=layout)

    def output_options(self) -> dict[str, Any]:
        """The options that change the output (manifest and ``metadata.extra["options"]``);
        options a mode does not use are None, so that they never block a resume."""
        random = self.split == "random"
        return {
            "format": self.input_format,
            "split": self.split,
            "validation_fraction": self.validation_fraction if random else None,
            "test_fraction": self.test_fraction if random else None,
            "seed": self.seed if random else None,
            "hashing": self.hashing,
            "min_frequency": (AUTO if self.min_frequency_auto else self.min_frequency) if self.hashing == "vocabulary" else None,
            "max_rows_per_table": self.max_rows if self.hashing == "modulus" else None,
            "chunk_rows": self.chunk_rows,
            "row_group_rows": self.row_group_rows,
            "compression": self.compression,
            "compression_level": self.compression_level,
            "on_bad_line": self.on_bad_line,
            # only when multi-hot: a one-hot run's options (and a resume of an older run) read as before
            **({"multi_hot_sizes": self.multi_hot_sizes} if self.multi_hot_sizes is not None else {}),
            **({"sparse_layout": self.sparse_layout} if self.multi_hot_sizes is not None else {}),
        }


def check_options(*, input_format: Any, split: Any, validation_fraction: Any, test_fraction: Any, seed: Any,
                  hashing: Any, min_frequency: Any, max_rows_per_table: Any, chunk_rows: Any, row_group_rows: Any,
                  compression: Any, compression_level: Any, workers: Any, on_bad_line: Any, overwrite: Any,
                  checkpoint_interval: Any, progress: Any, multi_hot_sizes: Any = None,
                  sparse_layout: Any = None, allow_shared_rows: Any = False) -> RunOptions:
    """Validate every option of `preprocess` (values from the API or the command line)."""
    split = _check_choice("--split", split, SPLIT_MODES)
    validation_fraction = _check_fraction("--validation-fraction", validation_fraction)
    test_fraction = _check_fraction("--test-fraction", test_fraction)
    if split == "random" and not validation_fraction + test_fraction < 1:
        raise PreprocessError(f"--validation-fraction {validation_fraction:g} + --test-fraction {test_fraction:g} "
                              "must be below 1 (the rest is train)")
    max_rows = None
    if max_rows_per_table is not None:
        max_rows = _check_int("--max-rows-per-table", max_rows_per_table, minimum=0) or None  # 0: no cap
    codec, level = _check_compression(compression, compression_level)
    hashing = _check_choice("--hashing", hashing, HASHINGS)
    auto = min_frequency == AUTO
    if auto and hashing != "vocabulary":
        raise PreprocessError("--min-frequency auto: the frequency threshold applies to --hashing vocabulary only")
    # the frequency counts are uint32 saturating at the threshold (`stats.DistinctCounter`): a larger one
    # overflowed them (a traceback from a worker), and no value is seen more often than that anyway
    threshold = None if auto else _check_int("--min-frequency", min_frequency, minimum=1, maximum=_MAX_MIN_FREQUENCY)
    if threshold is not None and threshold > 1 and hashing != "vocabulary":
        # modulus hashing gives every value its own row: a threshold given with it would be silently ignored
        raise PreprocessError(f"--min-frequency {threshold}: the frequency threshold applies to --hashing vocabulary "
                              "only")
    sizes = _check_multi_hot_sizes(multi_hot_sizes)
    layout = None if sparse_layout is None else _check_choice("--sparse-layout", sparse_layout, SPARSE_LAYOUTS)
    fmt = _check_choice("--format", input_format, INPUT_FORMATS)
    if sizes is not None and fmt == "csv":
        raise PreprocessError("--multi-hot-sizes: needs --format tsv (or auto on TSV files): ',' separates both the "
                              "fields of CSV and the values of a multi-hot field")
    if max_rows == 1 and hashing == "modulus":
        _warn_single_row_tables()
    return RunOptions(
        multi_hot_sizes=sizes,
        sparse_layout=layout if sizes is not None else "lists",  # one-hot: the layouts write the same files
        input_format=fmt,
        split=split,
        validation_fraction=validation_fraction,
        test_fraction=test_fraction,
        # the random split keys its hash with the seed's low 64 bits (`splits.random_uniform`): a seed outside
        # [0, 2**64) silently split as another one did (2**64 as 0, -1 as 2**64 - 1) while the metadata named it
        seed=_check_int("--seed", seed, minimum=0, maximum=2**64 - 1),
        hashing=hashing,
        min_frequency=threshold,
        min_frequency_auto=auto,
        max_rows=max_rows,
        chunk_rows=_check_int("--chunk-rows", chunk_rows, minimum=1),
        # pyarrow takes the row group size as an int64: a larger one was an OverflowError in the worker
        row_group_rows=_check_int("--row-group-rows", row_group_rows, minimum=1, maximum=2**63 - 1),
        workers=_default_workers() if workers is None else _check_int("--workers", workers, minimum=1),
        on_bad_line=_check_choice("--on-bad-line", on_bad_line, ON_BAD_LINE),
        overwrite=bool(overwrite),
        checkpoint_interval=_check_number("--checkpoint-interval", checkpoint_interval),
        progress=bool(progress),
        allow_shared_rows=bool(allow_shared_rows),
        compression=codec,
        compression_level=level,
    )


def _warn_single_row_tables() -> None:
    """Warn of --max-rows-per-table 1, before the work: every table is then one row, and the run said nothing of it
    (only its summary's "26 rows in all"). A warning, not a refusal, as for a --min-frequency that keeps no value
    (`finish._warn_empty_vocabularies`) and for training's data.max_rows_per_table 1: a legal if useless dataset."""
    from loguru import logger

    logger.warning("--max-rows-per-table 1: every table has one row, which every value of its feature shares (and "
                   "the missing ones), so the model learns nothing from the categorical features; give a larger cap "
                   "(0: none)")


def _check_multi_hot_sizes(value: Any) -> list[int] | None:
    """--multi-hot-sizes: None, "one-hot" or all 1 (one-hot: None), "mlperf", or 26 integers >= 1
    (a list, or a string of comma-separated ones)."""
    from dlrm.data.schema import MAX_MULTI_HOT_SIZE, MLPERF_MULTI_HOT_SIZES, NUM_SPARSE, is_multi_hot

    if value is None or value == "one-hot":
        return None
    if value == "mlperf":
        return list(MLPERF_MULTI_HOT_SIZES)
    parts = value.split(",") if isinstance(value, str) else value
    try:
        sizes = [int(p) for p in parts] if isinstance(parts, (list, tuple)) else None
    except (TypeError, ValueError):
        sizes = None
    if sizes is None or len(sizes) != NUM_SPARSE or not all(1 <= s <= MAX_MULTI_HOT_SIZE for s in sizes):
        raise PreprocessError(f"--multi-hot-sizes: {value!r:.80} is not mlperf, one-hot or {NUM_SPARSE} comma-separated "
                              f"integers in [1, {MAX_MULTI_HOT_SIZE}]")
    return sizes if is_multi_hot(sizes) else None


def _default_workers() -> int:
    """Worker processes when none are asked for: one per core, at most 8."""
    return min(os.cpu_count() or 1, 8)


def _check_choice(flag: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise PreprocessError(f"{flag}: {value!r} is not one of {', '.join(choices)}")
    return value


def _check_int(flag: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int, if it is an integer (not a bool) of at least ``minimum`` and at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PreprocessError(f"{flag}: {value!r} is not an integer")
    if minimum is not None and value < minimum:
        raise PreprocessError(f"{flag}: {value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise PreprocessError(f"{flag}: {value} must be at most {maximum}")
    return int(value)


def _check_number(flag: str, value: Any) -> float:
    """``value`` as a float, if it is a real number (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise PreprocessError(f"{flag}: {value!r} is not a number")
    return float(value)


def _check_fraction(flag: str, value: Any) -> float:
    """``value`` as a float in [0, 1)."""
    value = _check_number(flag, value)
    if not 0 <= value < 1:
        raise PreprocessError(f"{flag}: {value:g} must be in [0, 1)")
    return value


def _check_compression(codec: Any, level: Any) -> tuple[str, int | None]:
    """A parquet codec this pyarrow writes, and a level in its range (None: the codec's default)."""
    if not isinstance(codec, str) or codec.lower() not in CODECS:
        raise PreprocessError(f"--compression: {codec!r} is not one of {', '.join(CODECS)}")
    codec = codec.lower()
    if level is not None:
        level = _check_int("--compression-level", level)
        _check_level(codec, level)
    _try_codec(codec, level)
    return codec, level


def _check_level(codec: str, level: int) -> None:
    """The codec takes levels, and ``level`` is within pyarrow's range for it."""
    import pyarrow as pa

    if codec == "none" or not pa.Codec.supports_compression_level(codec):
        raise PreprocessError(f"--compression-level: {codec} has no levels; leave --compression-level out")
    lo, hi = pa.Codec.minimum_compression_level(codec), pa.Codec.maximum_compression_level(codec)
    if not lo <= level <= hi:
        raise PreprocessError(f"--compression-level: {level} is out of range for {codec} ({lo} to {hi})")


def _try_codec(codec: str, level: int | None) -> None:
    """Write a one-row shard in memory: a codec this pyarrow build lacks fails here, not in a worker
    after the output directory was made."""
    import pyarrow.parquet as pq

    from dlrm.data.preprocess.parse import _to_table

    table = _to_table(np.zeros(1, np.int8), np.zeros((NUM_DENSE, 1), np.int32), np.zeros((NUM_SPARSE, 1), np.int64))
    try:
        pq.write_table(table, io.BytesIO(), compression=None if codec == "none" else codec, compression_level=level)
    except Exception as e:  # pyarrow raises ArrowException subclasses and OSError here
        detail = " ".join(str(e).split())
        raise PreprocessError(f"--compression {codec}: this pyarrow cannot write it ({detail})") from None


# --------------------------------------------------------------------------------------------
# input files and the output location


def check_inputs(inputs: Any, split: str, allow_shared_rows: bool = False) -> list[Path]:
    """The input paths, each an existing readable regular file given once (days: in day order). Two files of the same
    bytes are refused too, unless `allow_shared_rows` (``--allow-shared-rows``): then they are kept, as every input
    sharing rows is, with the warning `same_content.same_rows` gives a copy in other bytes (a share of 100%)."""
    if isinstance(inputs, (str, os.PathLike)):
        raise PreprocessError(f"inputs: expected a list of files, got the single path {str(inputs)!r}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise PreprocessError("no input files")
    for p in paths:
        _check_input_file(p)
    _check_distinct(paths, allow_shared_rows)
    if split == "days":
        if len(paths) < 2:
            raise PreprocessError("--split days needs the day files in order (at least 2: train days and the last day)")
        paths = _order_days(paths)
    if not allow_shared_rows:  # (kept under the flag: a reordered copy was, a byte-identical one was refused)
        same_bytes(paths)  # a copy under another name (`same_content`; gzip'ed data is compared after the count pass)
    return paths


def _check_input_file(path: Path) -> None:
    """``path`` exists, is a regular file (after symlinks), can be opened for reading and is text (plain or gzip), not
    an archive or another codec (`dlrm.data.preprocess.input_kinds`)."""
    # a stream (`--input -`, `<(zcat day_0.gz)`, /dev/stdin from a pipe) cannot be read twice, as the count pass and
    # the chunks read a file; "-: no such file" and "/dev/fd/63: not a regular file" did not say so
    stream = "the preprocessor reads each input twice (counting its lines first); write the stream to a file (gzip " \
             "is read as it is)"
    if str(path) == "-" and not path.exists():
        raise PreprocessError(f"-: standard input is not read: {stream}")
    if not path.exists():
        raise PreprocessError(f"{path}: no such file")
    if not path.is_file():
        pipe = path.is_fifo() or path.is_char_device()
        raise PreprocessError(f"{path}: not a regular file" + (f" (a pipe or a device): {stream}" if pipe else ""))
    try:
        with open(path, "rb"):
            pass
        kind = unreadable_kind(path)
    except OSError as e:
        raise PreprocessError(f"{path}: cannot be read ({e.strerror or e})") from None
    if kind is not None:  # read as text it would fail on its first line, naming a field instead of the file's kind
        raise PreprocessError(f"{path}: {kind}; the preprocessor reads plain or gzip text files")


def _check_distinct(paths: list[Path], allow_shared_rows: bool = False) -> None:
    """Refuse a file given twice: another spelling, a symlink or a hard link would duplicate its rows. Under
    ``--allow-shared-rows`` too: one file named twice is a slip of the command line (a glob that also matches a file
    named beside it), where a copy under another name may be a choice; the line says so, as the flag did not help."""
    seen: dict[object, Path] = {}
    for p in paths:
        st = p.stat()
        keys = (("inode", st.st_dev, st.st_ino), ("path", p.resolve()))
        for key in keys:
            if key in seen:
                first = seen[key]
                same = "the same path" if str(first) == str(p) else f"the same file as {first}"
                why = (" (--allow-shared-rows keeps distinct files that share rows, not one file named twice: to "
                       "read its rows twice, give a copy of it)") if allow_shared_rows else ""
                raise PreprocessError(f"{p}: given twice as input ({same}); list every file once{why}")
        for key in keys:
            seen[key] = p


def _order_days(paths: list[Path]) -> list[Path]:
    """``day_N`` inputs in the order of N (logged when that is not the order given)."""
    nums = [re.search(r"day_(\d+)", p.name) for p in paths]
    if all(nums):
        # Two files of one day (day_5 and day_5.gz: a `day_*` glob after `gunzip -k`) trained its rows twice, and
        # with the last day the evaluation rows went into train too: `_check_distinct` sees two files
        seen: dict[int, Path] = {}
        for m, p in zip(nums, paths):
            day = int(m.group(1))
            if day in seen:
                raise PreprocessError(f"--split days: {seen[day]} and {p} are both day {day}: give each day once "
                                      "(its rows would be read twice; the last day's would train as well)")
            seen[day] = p
        ordered = [p for _, p in sorted(zip((int(m.group(1)) for m in nums), paths), key=lambda t: t[0])]
        if ordered != paths:
            from loguru import logger

            logger.info("--split days: inputs ordered by day number: {}", ", ".join(p.name for p in ordered))
        return ordered
    return paths


def check_output_location(out: Path, inputs: list[Path]) -> None:
    """The output is (or can be made as) a writable directory that holds none of the inputs in
    the parts a run replaces."""
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:  # pyarrow opens shards by a UTF-8 path: no loader (nor a resume) could read them
        raise PreprocessError(f"--output {str(out)!r}: the path is not valid UTF-8, which pyarrow (every loader) "
                              "cannot open; choose another name") from None
    from dlrm.run_paths import PREPROCESS_DEEPEST, check_room  # (a shard over PATH_MAX: after the reading before it)

    check_room("--output", str(out), PREPROCESS_DEEPEST, PreprocessError)
    # (a dangling link was "exists and is not a directory", and one above it "cannot be created: LINK is not a
    # directory", without a word of the link: the other data tools' line, `dangling_link_error`, says so)
    dangling = dangling_link_error(out, "--output")
    if dangling is not None:
        raise PreprocessError(dangling)
    if os.path.lexists(out) and not out.is_dir():
        raise PreprocessError(f"{out}: exists and is not a directory")
    base = _nearest_existing(out)
    if not base.is_dir():
        raise PreprocessError(f"{out}: cannot be created: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        if _read_only_file_system(base):  # said "no write permission on B", and a chmod would not help
            where = " (a read-only file system)" if base == out.absolute() else \
                f" ({base} is on a read-only file system)"
        else:
            where = "" if base == out.absolute() else f" (no write permission on {base})"
        raise PreprocessError(f"{out}: not writable{where}")
    owner = owner_of(out)  # a dataset, run or sweep around it: replaced with it, or listing it as its own
    if owner is not None:
        raise PreprocessError(f"--output {out} is inside {owner}, which belongs to it; write the dataset outside it")
    _check_inputs_outside(out, inputs)


def _read_only_file_system(path: Path) -> bool:
    """Whether `path` lies on a file system mounted read-only (where that can be told)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # (no statvfs: Windows)
        return False


def _nearest_existing(path: Path) -> Path:
    """``path`` if it exists, else its nearest existing ancestor."""
    p = path.absolute()
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    return p


def _check_inputs_outside(out: Path, inputs: list[Path]) -> None:
    """An input inside the split, vocab or progress directories would be replaced (--overwrite) or
    mistaken for output."""
    root = out.resolve()
    for p in inputs:
        rp = p.resolve()
        for name in (*SPLITS, "vocab", PROGRESS_DIR):
            if rp.is_relative_to(root / name):
                raise PreprocessError(
                    f"{p}: input inside the output's {name}/ directory; move it or choose another --output"
                )
