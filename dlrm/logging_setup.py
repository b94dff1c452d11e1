"""One loguru format for every command-line entry point (train.py, preprocess, synthetic, merge)."""

from __future__ import annotations

import os
import sys
from typing import Optional, TextIO

from loguru import logger

# A progress bar's redraws, at most one per this many seconds, where its stream is not a terminal (README: "Console
# output"): tqdm's 0.1 s wrote a `\r` copy of the bar ten times a second into a nohup/SLURM/CI log
FILE_BAR_INTERVAL_S = 60.0


class ConsoleStream:
    """sys.stderr, whose reader may go away (`train.py 2>&1 | head -1`, a killed `tee`): the first BrokenPipeError
    ends the console output, not the process. It was raised by the next write (the training bar's first draw) and
    failed the run as a bug (exit 1) that had lost nothing but its console: the new run directory was removed."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.reader_gone = stream, False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self.reader_gone = True
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self.reader_gone = True

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ... (loguru's and tqdm's checks) of the stream
        return getattr(self.stream, name)


def bar_interval(stream: Optional[TextIO] = None) -> dict:
    """tqdm's redraw interval for a bar on `stream` (stderr): its default where a terminal shows it, else
    FILE_BAR_INTERVAL_S. Redraws forced by set_postfix/refresh are the caller's to avoid (refresh=False)."""
    stream = sys.stderr if stream is None else stream
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError, OSError):
        interactive = False
    # maxinterval too: tqdm's monitor thread forces a redraw of a bar quiet for maxinterval (10 s)
    return {} if interactive else {"mininterval": FILE_BAR_INTERVAL_S, "maxinterval": FILE_BAR_INTERVAL_S}


def configure_logging(level: str = "INFO") -> None:
    """Send loguru's records to stderr as `HH:MM:SS LEVEL message`, replacing its default sink; stderr becomes a
    ConsoleStream. Colours only on a terminal and without NO_COLOR (https://no-color.org): loguru's own choice
    ignores NO_COLOR and, under CI=true with GITHUB_ACTIONS (GITLAB_CI, ...) or PYCHARM_HOSTED set, colours the real
    stderr whatever it is, so `train.py 2> train.log` in a CI job wrote escape codes into the file."""
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
    logger.remove()
    logger.add(sys.stderr, level=level, colorize=colorize,
               format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
