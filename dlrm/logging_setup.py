"""One loguru format for every command-line entry point (train.py, preprocess, synthetic, merge)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import warnings
from typing import Iterator, Optional, TextIO

from loguru import logger
from tqdm import tqdm

# A progress bar's redraws, at most one per this many seconds, where its stream is not a terminal (README: "Console
# output"): tqdm's 0.1 s wrote a `\r` copy of the bar ten times a second into a nohup/SLURM/CI log
FILE_BAR_INTERVAL_S = 60.0

# the columns a progress bar leaves free at the end of a terminal's line (tqdm's own width leaves one): the `^C` a
# terminal echoes for Ctrl-C after the bar then ends on the last column instead of wrapping `C` to the next line
CTRL_C_ECHO_COLUMNS = 2

# the errors of a write to a console that is gone or never was: its reader (EPIPE, ECONNRESET of a socket), its
# descriptor (EBADF: closed, or open read-only through a launcher script), its terminal (EIO, ENXIO: hung up)
_CONSOLE_GONE = (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.EIO, errno.ENXIO)

# the terminal's cursor-up code, with which tqdm comes back from a bar below the first (the evaluation bar under the
# training bar) to the first bar's line
_CURSOR_UP = "\x1b[A"

run_logger = logger.bind(same_on_every_rank=True)
"""The logger of a record that every rank of a torchrun run makes alike (a warning about the config or the dataset):
rank 0 logs it and the other ranks, which log warnings and errors (`log_as_rank`), leave it out. Through `logger`
every rank repeated it, `[rank 1] ...` after rank 0's line (one copy a rank: 8 on a node of 8 GPUs)."""


def counted(n: int, noun: str, fmt: str = "", plural: str | None = None) -> str:
    """`n` and `noun`, the noun in the plural unless `n` is 1: `plural`, or the noun with an "s" (a run of one step
    said "1 steps/epoch, 1 steps"; "worker process" took the "s" as well: "3 worker processs"). `fmt` formats the
    number ("," for thousands separators).

        >>> counted(1, "step"), counted(703, "step"), counted(0, "file"), counted(12345, "row", ",")
        ('1 step', '703 steps', '0 files', '12,345 rows')
        >>> [counted(n, "worker process", plural="worker processes") for n in (1, 3)]
        ['1 worker process', '3 worker processes']
    """
    return f"{n:{fmt}} {noun if n == 1 else plural or noun + 's'}"


class ConsoleStream:
    """sys.stderr, whose reader may go away (`train.py 2>&1 | head -1`, a killed `tee`): the first BrokenPipeError
    ends the console output, not the process. It was raised by the next write (the training bar's first draw) and
    failed the run as a bug (exit 1) that had lost nothing but its console: the new run directory was removed.
    The other errors of a console gone (`_CONSOLE_GONE`) end it alike: a stderr closed from the start (`2>&-`)
    through a launcher script (pyenv's `python` shim, a bash script) reaches Python with fd 2 held read-only on that
    script, so sys.stderr is not None and its first write raised EBADF (exit 1, the run directory or the tool's
    output removed); a terminal hung up raises EIO. An OSError that leaves the console there (`_CONSOLE_GONE` does not hold it: a full disk under
    `2> run.log`, a non-blocking stderr's full pipe) loses that write only, not the run's later lines."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.reader_gone = stream, False
        self.last_char = "\n"  # the last character written: whether a log record starts a line of its own
        # a torchrun rank other than 0 (`log_as_rank`): rank 0's progress bar is drawn on this same console (the
        # ranks inherit torchrun's stderr) by another process, so `last_char` does not say whether a line is open
        self.bar_elsewhere = False
        self.shared = False  # a torchrun rank's console, which the other ranks write into too

    def write(self, text: str) -> int:
        # a cursor-up alone keeps the column, so `last_char` still says whether the cursor is at a line's start: tqdm
        # clears a second bar with "\n", blanks, "\r" and a cursor-up, which leaves the cursor at the start of the
        # first bar's line; taken for an unfinished line, a record then (Ctrl-C's, during an evaluation) began with a
        # newline, an empty line left on the screen above it
        if text and text.replace(_CURSOR_UP, ""):
            self.last_char = text[-1]
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except OSError as e:  # (BrokenPipeError among them)
                self._write_failed(e)
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except OSError as e:
                self._write_failed(e)

    def _write_failed(self, e: OSError) -> None:
        # every OSError ended the console for good: one EAGAIN of a non-blocking stderr (a pipe full for a moment), or
        # ENOSPC of a disk that frees up again, left the rest of an hours-long run without a line, its summary and a
        # later error's line among them. Those lose the one write; a console gone or never there stops the writes.
        if isinstance(e, BrokenPipeError) or e.errno in _CONSOLE_GONE:
            self.reader_gone = True

    def write_record(self, text: str) -> None:
        """A log record (loguru's sink), on a line of its own. A progress bar's line has no newline until the bar
        closes: a record written after it (an evaluation's line, a warning) was glued to it, on a terminal and, in a
        log file (nohup, SLURM, `> run.log 2>&1`), for good (`train: 25%|...| 5/20 [...]12:00:01 INFO    step 5: eval
        auc ...`). On a terminal the bars are cleared, the record written and the bars redrawn below it (tqdm.write's
        way); in a file, whose `\r` copies of a bar stay, the bar's line is ended with a newline first (clearing and
        redrawing there would add a copy of the bar a record)."""
        if _interactive(self):
            with tqdm.external_write_mode(file=self):
                if self.bar_elsewhere:  # whatever rank 0's bar left on the line is erased (ANSI "erase line"): the
                    # record takes the line, and rank 0 redraws its bar below at its next update (it was glued to it)
                    self.write("\r\x1b[2K")
                elif self.last_char not in "\r\n":  # (a cleared bar leaves the cursor at the start of its line)
                    self.write("\n")
                elif self.last_char == "\r":  # a bar's line, cleared: erased to its end (tqdm blanks the bar's
                    self.write("\x1b[2K")  # own width, not the `^C` the terminal echoed after it, on the last columns)
                self.write(text)
        else:
            if self._line_open():
                self.write("\n")
            self.write(text)
        self.flush()

    @contextlib.contextmanager
    def native_output(self) -> Iterator[None]:
        """A block in which native code may write to fd 2 behind this stream (torch's profiler: kineto's C++ writes
        `USDT:... profiler_start` and `profiler_stop` as a trace starts and stops): its lines start lines of their
        own, as a record's. They were glued to the end of the training bar's line (`train:   2%|█  | 6/300
        [...]USDT:...`), on a terminal under a half-drawn copy of the bar that stayed there. On a terminal the bars are
        cleared and drawn again after the block, below what it wrote; in a file the bar's line is ended first."""
        if _interactive(self):
            with tqdm.external_write_mode(file=self):
                if self.last_char not in "\r\n":
                    self.write("\n")
                self.flush()  # (what Python holds reaches fd 2 before the native lines)
                yield
        else:
            if self._line_open():
                self.write("\n")
            self.flush()
            yield

    def _line_open(self) -> bool:
        """Whether the console's last line, in a file or a pipe, is unfinished (a bar's). Under torchrun (`shared`)
        the ranks write into one console, and another rank's bar or record is not in this one's `last_char`: in a
        regular file (`> run.log 2>&1`, nohup) its last byte says it; in a pipe (`| tee`, CI) nothing does, and a
        rank other than 0 (`bar_elsewhere`) starts its record with a newline (an empty line where no bar was open,
        rather than a warning glued to rank 0's bar for good)."""
        if self.shared or self.bar_elsewhere:
            last = _last_byte(self.stream)
            if last is not None:
                return last not in (b"", b"\n")
        return self.bar_elsewhere or self.last_char != "\n"

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ... (loguru's and tqdm's checks) of the stream
        return getattr(self.stream, name)


class ProgressBar(tqdm):
    """tqdm, its line CTRL_C_ECHO_COLUMNS short of a terminal's width (tqdm's own: one), following the terminal's
    size as tqdm does. Ctrl-C typed during a run is echoed by the terminal as `^C` where the cursor is, after the bar:
    `^` took tqdm's free column and `C` wrapped to the next line, where the bar's next redraw and the SIGINT warning
    went, and the bar's copy above stayed on the screen for good. Now the cursor rests on the last column and the next
    `\\r` (a redraw, a record's clearing) is on the bar's own line. In a file (no width) it is tqdm's bar.

        >>> import io
        >>> def line(bar_class):
        ...     out = io.StringIO()
        ...     with bar_class(total=4, file=out, ncols=40, ascii=True) as bar:
        ...         bar.update(2)
        ...     return out.getvalue().split("\\r")[-1].rstrip("\\n")
        >>> len(line(tqdm)), len(line(ProgressBar))
        (40, 39)
    """

    @property
    def format_dict(self) -> dict:
        fmt = super().format_dict
        if fmt.get("ncols"):  # (None in a file; a disabled bar's has none)
            fmt["ncols"] = max(fmt["ncols"] - (CTRL_C_ECHO_COLUMNS - 1), 1)
        return fmt


class RecordSink:
    """loguru's sink: each record through `ConsoleStream.write_record` (on a line of its own, not after a bar's)."""

    def __init__(self, console: ConsoleStream) -> None:
        self.console = console

    def write(self, text: str) -> None:
        self.console.write_record(text)


@contextlib.contextmanager
def native_output() -> Iterator[None]:
    """`ConsoleStream.native_output` of stderr (nothing where `configure_logging` did not wrap it: the Python API)."""
    if isinstance(sys.stderr, ConsoleStream):
        with sys.stderr.native_output():
            yield
    else:
        yield


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` (Python's warnings: torch's UserWarnings, a library's DeprecationWarning): into a
    ConsoleStream as a record, on lines of its own. Python wrote it after the training bar's text, on its line
    (`train:  50%|█████  | 149/300 [...]/path/x.py:5: UserWarning: ...`), under which the bar went on: on a terminal
    that half-drawn copy of the bar stayed on the screen, in a log file the warning was glued to the bar for good."""
    stream = sys.stderr if file is None else file
    if stream is None:  # (Python's own: no stderr, nothing shown)
        return
    text = warnings.formatwarning(message, category, filename, lineno, line)
    try:
        if isinstance(stream, ConsoleStream):
            stream.write_record(text)
        else:
            stream.write(text)
    except OSError:  # (as Python's: a stream that cannot take it loses the warning, not the run)
        pass


def _last_byte(stream: TextIO) -> Optional[bytes]:
    """The last byte of the regular file `stream` writes to (b"" when empty), read through /proc/self/fd (stderr is
    opened write-only by the shell's `2>`); None for a pipe, a terminal, or where that cannot be read."""
    try:
        fd = stream.fileno()
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size == 0:
            return b""
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            f.seek(info.st_size - 1)
            return f.read(1)
    except (AttributeError, ValueError, OSError):
        return None


def _interactive(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def bar_interval(stream: Optional[TextIO] = None) -> dict:
    """tqdm's redraw interval for a bar on `stream` (stderr): its default where a terminal shows it, else
    FILE_BAR_INTERVAL_S, and there the bar's line is the current one (``position`` 0). Redraws forced by
    set_postfix/refresh are the caller's to avoid (refresh=False)."""
    stream = sys.stderr if stream is None else stream
    interactive = _interactive(stream)
    # maxinterval too: tqdm's monitor thread forces a redraw of a bar quiet for maxinterval (10 s). position 0: a bar
    # opened while another is (a checkpoint's of 1 GiB or more, written during training) took the next line, reached
    # with "\n" and left with the terminal's cursor-up code: `\x1b[A` in every redraw, in a file that has no cursor
    return {} if interactive else {"mininterval": FILE_BAR_INTERVAL_S, "maxinterval": FILE_BAR_INTERVAL_S,
                                   "position": 0}


def log_as_rank(rank: int) -> None:
    """A torchrun rank other than 0: rank 0 speaks for the run; this one logs its own warnings and errors, named
    `[rank N]`, not the records `run_logger` makes on every rank alike."""
    logger.remove()
    # a ConsoleStream (stderr's, or of a stderr that `configure_logging` did not wrap: the Python API) that knows rank
    # 0's bar may hold the shared console's line: this rank's records were glued to the end of it
    console = sys.stderr if isinstance(sys.stderr, ConsoleStream) else ConsoleStream(sys.stderr)
    console.bar_elsewhere = console.shared = True
    logger.add(RecordSink(console), level="WARNING", colorize=False,
               filter=lambda record: not record["extra"].get("same_on_every_rank"),
               format=f"[rank {rank}] {{time:HH:mm:ss}} {{level: <7}} {{message}}")


def _torchrun_world() -> int:
    """WORLD_SIZE under torchrun, else 1 (also for a value that is no number)."""
    world = os.environ.get("WORLD_SIZE", "")
    return int(world) if world.isdigit() else 1


def _torchrun_rank() -> int:
    """This process's rank under torchrun (RANK, WORLD_SIZE > 1), else 0 (also for values that are no numbers:
    `dlrm.distributed.env.init_distributed` says what is wrong with them)."""
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() and _torchrun_world() > 1 else 0


def configure_logging(level: str = "INFO", ranks: bool = False) -> None:
    """Send loguru's records to stderr as `HH:MM:SS LEVEL message`, replacing its default sink; stderr becomes a
    ConsoleStream. Colours only on a terminal and without NO_COLOR (https://no-color.org): loguru's own choice
    ignores NO_COLOR and, under CI=true with GITHUB_ACTIONS (GITLAB_CI, ...) or PYCHARM_HOSTED set, colours the real
    stderr whatever it is, so `train.py 2> train.log` in a CI job wrote escape codes into the file. `ranks`: a command
    that runs as torchrun's ranks (train.py): a rank other than 0 logs as `log_as_rank` says from the start (not the
    tools, which a launcher's RANK and WORLD_SIZE of a node must not quieten). Python's warnings go to the console as
    records (`_show_warning`)."""
    if sys.stderr is None:
        # started with stderr closed (`2>&-`, a launcher that closes it): loguru refused the None sink with a
        # TypeError (exit 1, nothing trained). The output is discarded, and fd 2 (the lowest free descriptor) taken
        # by /dev/null, not by the next file opened, which torch's C++ warnings would then write into.
        sys.stderr = open(os.devnull, "w")
    if not isinstance(sys.stderr, ConsoleStream):
        sys.stderr = ConsoleStream(sys.stderr)
    try:
        colorize = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    except (AttributeError, ValueError, OSError):
        colorize = False
    warnings.showwarning = _show_warning
    if ranks and _torchrun_world() > 1:
        sys.stderr.shared = True  # rank 0's too: in a file, a line the others ended is not left open again
    if ranks and _torchrun_rank():
        # from the start: the records before the process group is joined (the config's warnings, the dataset's)
        # were printed by every rank, at INFO too, with nothing saying which rank
        log_as_rank(_torchrun_rank())
        return
    logger.remove()
    logger.add(RecordSink(sys.stderr), level=level, colorize=colorize,
               format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
