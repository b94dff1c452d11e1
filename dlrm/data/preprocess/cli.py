"""``python -m dlrm.preprocess``: the click command around `preprocess`.

Exit codes (as `dlrm.cli`'s): 0 done; 2 an expected failure (a bad option, input or output
directory, a bad line, a full disk...), printed as one line ``error: ...``; 4 out of memory (a
worker killed or a MemoryError: the same command with a smaller ``--chunk-rows`` or fewer
``--workers`` resumes); 1 an unexpected exception, a bug: its traceback, then one line saying so;
130 interrupted (Ctrl-C); 143 SIGTERM (which takes Ctrl-C's path: `dlrm.stop_signal.Terminated`).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from dlrm.data.preprocess.constants import DEFAULT_CHUNK_ROWS, DEFAULT_MAX_ROWS_PER_TABLE, DEFAULT_ROW_GROUP_ROWS
from dlrm.data.preprocess.errors import InterruptedBeforeReplacing, InterruptedWhenComplete, PreprocessError
from dlrm.data.preprocess.options import CODECS
from dlrm.data.preprocess.run import preprocess

EXIT_FAILURE = 2  # an expected failure, reported in one line
EXIT_BUG = 1  # = dlrm.errors.EXIT_BUG (not imported here: spawned workers import this package)
EXIT_OUT_OF_MEMORY = 4
PROG_NAME = "python -m dlrm.preprocess"


def build_cli():
    """The click command behind ``python -m dlrm.preprocess`` (tests invoke it with CliRunner)."""
    import click

    from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand

    # existence and the rest are checked by `preprocess`
    input_type = NonEmptyPath("a raw Criteo file", path_type=Path)
    output_type = NonEmptyPath('the dataset directory to write; "." for the working directory', path_type=Path)

    @click.command(cls=OneLineUsageCommand, context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("more_inputs", nargs=-1, type=input_type, metavar="[INPUT]...")
    @click.option("--input", "-i", "inputs", multiple=True, type=input_type, metavar="FILE",
                  help="Raw file (TSV or CSV, plain or .gz); repeat, or list the files as arguments. Order matters.")
    @click.option("--output", "-o", required=True, type=output_type, metavar="DIRECTORY",
                  help="Dataset directory to write.")
    @click.option("--format", "input_format", type=click.Choice(["auto", "tsv", "csv"]), default="auto",
                  show_default=True, help="Input format; auto detects it from each file's first line.")
    @click.option("--split", type=click.Choice(["sequential", "random", "days"]), default="sequential",
                  show_default=True,
                  help="sequential: Kaggle 6/7 train, last 1/7 halves test|validation; days: Terabyte day_0..22 "
                  "train, day_23 halves test|validation; random: per line from (seed, line number).")
    @click.option("--validation-fraction", type=float, default=0.05, show_default=True, help="--split random.")
    @click.option("--test-fraction", type=float, default=0.05, show_default=True, help="--split random.")
    @click.option("--seed", type=int, default=0, show_default=True, help="--split random.")
    @click.option("--hashing", type=click.Choice(["modulus", "vocabulary"]), default="modulus", show_default=True,
                  help="modulus: a table of the feature's distinct train values + 1 rows (at most "
                  "--max-rows-per-table), a value on row (value + 1) mod rows (values collide: about 63% share a row); "
                  "vocabulary: a row for each value seen --min-frequency times in train, row 0 for rarer, unseen and "
                  "missing values.")
    @click.option("--min-frequency", type=_MinFrequency(), default="1", show_default=True, metavar="N|auto",
                  help="--hashing vocabulary: values seen at least this often in train get their own row; auto: "
                  "picked from the train split's size: clip(round(0.15 * sqrt(train rows)), 2, 50), e.g. 14 for 8,572 train rows (dlrm.data.preprocess.frequency).")
    @click.option("--max-rows-per-table", type=click.IntRange(min=0), default=DEFAULT_MAX_ROWS_PER_TABLE,
                  show_default=True, help="--hashing modulus: cap of a table's rows (0: no cap).")
    @click.option("--chunk-rows", type=click.IntRange(min=1), default=DEFAULT_CHUNK_ROWS, show_default=True,
                  help="Lines per chunk: the unit of work and of resuming; at most one shard per split per chunk.")
    @click.option("--row-group-rows", type=click.IntRange(min=1), default=DEFAULT_ROW_GROUP_ROWS, show_default=True)
    @click.option("--compression", default="zstd", show_default=True,
                  help=f"Parquet codec ({', '.join(CODECS)}). Multi-hot rows stream ~1.3x faster from lz4 files, "
                       "~1.4x the bytes of zstd (benchmarks/results/stream_training_mlperf.md).")
    @click.option("--compression-level", type=int, default=None, help="Codec level (default: the codec's).")
    @click.option("--workers", type=click.IntRange(min=1), default=None,
                  help="Worker processes [default: min(cores, 8)], at most one a chunk; 1 runs in this process.")
    @click.option("--on-bad-line", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
                  help="stop: fail naming the first bad line; skip: drop bad lines, count them per reason.")
    @click.option("--allow-shared-rows", is_flag=True,
                  help="Keep inputs that share most of their rows (a concatenation of day files given beside them, "
                  "a copy of a file under another name), with a warning naming both files and the share, instead of "
                  "refusing them: their shared rows are read twice. One file named twice (the same path, a link) is "
                  "refused still. An unfinished run that kept them resumes with it only.")
    @click.option("--overwrite", is_flag=True, help="Replace a dataset or an unfinished run in --output (a complete "
                  "dataset stays until the new one is complete).")
    @click.option("--checkpoint-interval", type=float, default=300.0, show_default=True,
                  help="Seconds between checkpoints of the table statistics (resuming re-reads the train shards "
                  "of chunks finished after the last one).")
    @click.option("--progress/--no-progress", default=True, show_default=True, help="tqdm progress bar.")
    @click.option("--multi-hot-sizes", default=None, metavar="mlperf|S1,...,S26",
                  help="Multi-hot categorical fields: the most values per field (26 sizes, or mlperf); a field "
                       "holds hex values separated by ',' (TSV only). Default: one-hot.")
    @click.option("--sparse-layout", default=None, metavar="slots|lists",
                  help="Multi-hot fields on disk: slots, one int64 column a slot (SPARSE_<f>_<j>, -2 in an empty "
                       "one; schema version 3, read 1.6-2x faster) or lists, one list<int64> column (version 2). "
                       "[default: slots; a resumed run keeps its own]")
    def command(more_inputs, inputs, output, **kwargs):
        """Preprocess raw Criteo click logs into a dataset directory (parquet shards + metadata.json).

        Inputs: Kaggle train.txt / Terabyte day_N (TAB-separated, no header) or the CSV variant with
        a label,I1..I13,C1..C26 header (counts may be written as 260.0); plain or gzip (an archive
        such as Kaggle's dac.tar.gz is refused: extract its train.txt); each file once. Stored
        values: a missing or negative count becomes 0 (counts above 2^31-1 are clipped), a missing
        category becomes -1; categories are the 32-bit hex hashes read as integers.

        Options, inputs and the output directory are checked before anything is written. A run
        that stops (bad input, a kill) keeps the shards it finished (recorded in
        OUTPUT/_progress/); the same command run again resumes from them and ends with the same
        output as an uninterrupted run; a run that stops before finishing any removes what it
        made. metadata.json is written last. Exit codes: 0 done, 2 an error (one line), 4 out of
        memory, 1 a bug (traceback), 130 interrupted (Ctrl-C), 143 SIGTERM.
        """
        all_inputs = [*inputs, *more_inputs]
        if not all_inputs:
            _fail("no input files (use --input PATH or list them as arguments)")
        _refuse_unused_options(kwargs)
        _run(all_inputs, output, kwargs)

    return command


# options given on the command line that the chosen mode would ignore: (option, mode key, the mode they need)
_MODE_OPTIONS = (("validation_fraction", "split", "random"), ("test_fraction", "split", "random"),
                 ("seed", "split", "random"), ("max_rows_per_table", "hashing", "modulus"))


def _refuse_unused_options(kwargs: dict) -> None:
    """Refuse an option given on the command line that its mode ignores (``--validation-fraction 0.2`` with the
    default sequential split, ``--max-rows-per-table`` with vocabulary hashing): it was silently dropped, and the
    dataset was not the one asked for. Defaults (not given) are fine."""
    import click
    from click.core import ParameterSource

    from dlrm.data.schema import SPARSE_LAYOUTS

    ctx = click.get_current_context()
    for name, mode, needed in _MODE_OPTIONS:
        if kwargs[mode] != needed and ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            _fail(f"{flag} {kwargs[name]}: applies to --{mode} {needed} only (this run has --{mode} {kwargs[mode]})")
    if ctx.get_parameter_source("sparse_layout") == ParameterSource.COMMANDLINE and kwargs["sparse_layout"] in \
            SPARSE_LAYOUTS:  # (a bad value is named as such by `check_options`)
        # one-hot fields are one int64 column in either layout: the same files, the option not even recorded
        from dlrm.data.preprocess.options import _check_multi_hot_sizes

        try:
            one_hot = _check_multi_hot_sizes(kwargs["multi_hot_sizes"]) is None
        except PreprocessError:
            return  # a bad --multi-hot-sizes: named as such by `check_options`
        if one_hot:
            _fail(f"--sparse-layout {kwargs['sparse_layout']}: applies to multi-hot fields only (this run is one-hot: "
                  "give --multi-hot-sizes, or leave the option out)")


def _MinFrequency():
    """The click type of --min-frequency: an integer >= 1, or "auto"."""
    import click

    class MinFrequency(click.ParamType):
        name = "N|auto"

        def convert(self, value, param, ctx):
            if isinstance(value, int) or value == "auto":
                return value
            try:
                number = int(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not an integer or auto", param, ctx)
            if number < 1:
                self.fail(f"{number} must be >= 1 (or auto)", param, ctx)
            return number

    return MinFrequency()


def _run(inputs: list[Path], output: Path, kwargs: dict) -> None:
    """`preprocess`, with every way it can end turned into a message and an exit code."""
    from concurrent.futures.process import BrokenProcessPool

    from dlrm.stop_signal import StopAtOnce, interruption

    # the command that resumes: this one, but without --overwrite, with which a run starts over
    same = "the same command without --overwrite" if kwargs.get("overwrite") else "the same command"
    try:
        # SIGTERM raises as Ctrl-C does: its default action skipped the cleanup (a run that finished no chunk left
        # its progress records, which refused a corrected command) and left the worker processes running
        with StopAtOnce(interrupt=True):
            preprocess(inputs, output, **kwargs)
    except (PreprocessError, OSError) as e:  # bad input or options, a refused or full output: expected
        _fail(" ".join(str(e).split()))
    except (MemoryError, BrokenProcessPool):  # a worker killed by the kernel's OOM killer breaks the pool
        # (--chunk-rows is one of the options a resumed run must keep: a smaller one starts over)
        _fail(f"out of memory (or a worker process was killed): {same} with fewer --workers resumes from the finished "
              "chunks; a smaller --chunk-rows starts over (with --overwrite)", EXIT_OUT_OF_MEMORY)
    except KeyboardInterrupt as e:  # Ctrl-C (130), or SIGTERM (`Terminated`: 143)
        code, what = interruption(e)
        how = "" if what == "Ctrl-C" else f" ({what})"  # Ctrl-C's lines as they always were
        if isinstance(e, InterruptedWhenComplete):
            # still 130 (143), not 0: a script running this in a loop must stop; the line says no rerun is needed
            _fail(f"interrupted{how} after the dataset in {output} was complete (metadata.json written); it is "
                  "usable as it is", code)
        if isinstance(e, InterruptedBeforeReplacing):  # the count pass of an --overwrite: nothing of OUT touched yet
            _fail(f"interrupted{how} before --overwrite removed or replaced anything: {output} is as it was; the same "
                  "command (with --overwrite) starts over", code)
        if not _run_to_resume(output):
            if kwargs.get("overwrite") and (output / "metadata.json").is_file():
                # the replacement finished no chunk and was removed: without --overwrite the command is refused
                # ("already holds a complete dataset; use --overwrite"), which the line used to advise
                _fail(f"interrupted{how} before the replacement finished a chunk: {output} holds its dataset as it "
                      "was; the same command (with --overwrite) starts the replacement over", code)
            # a run that finished no chunk removes what it made: there were no "finished chunks" to resume from
            _fail(f"interrupted{how} before any chunk was finished (nothing was kept); the same command starts over",
                  code)
        _fail(f"interrupted{how}; {same} resumes from the finished chunks", code)
    except Exception as e:
        _report_bug(e)


def _run_to_resume(output: Path) -> bool:
    """Whether ``output`` holds an unfinished run to resume: its own, or a replacement's
    (`dlrm.data.preprocess.replace`)."""
    from dlrm.data.preprocess.constants import PROGRESS_DIR
    from dlrm.data.preprocess.replace import STAGING

    return any((d / PROGRESS_DIR / "manifest.json").is_file() for d in (output, output / STAGING))


def _report_bug(exc: Exception):
    """The traceback, then one line saying that this is a bug (as `dlrm.errors.report_bug` words it)."""
    from dlrm.errors import dlrm_version

    traceback.print_exception(exc, file=sys.stderr)
    _fail(f"this is a bug in dlrm {dlrm_version()} ({type(exc).__name__}): please report it with the traceback above",
          EXIT_BUG)


def _fail(message: str, code: int = EXIT_FAILURE):
    """Print ``error: message`` on stderr and exit with ``code``."""
    import click

    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dlrm.preprocess``: the dlrm log format on stderr, then the command."""
    from dlrm.logging_setup import configure_logging

    configure_logging()
    build_cli()(args=argv, prog_name=PROG_NAME)
