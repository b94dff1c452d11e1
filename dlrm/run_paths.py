"""The longest paths a command writes under the directory it is given, checked before any work.

`dlrm.path_checks` refuses a ``--tb-dir`` that is itself over PATH_MAX; one just under it passed, and the run then
failed where it first wrote deeper: the SummaryWriter's event file at the start ("a bug in dlrm (OSError)", a
traceback, the run directory left behind), or a checkpoint, a profiler trace, a sweep's later trial after training
time was spent. Each command adds here, to the absolute length of the directory it was given, the longest relative
path it may write under it, every part at its widest (a pid of 7 digits, the host's name, a step of 12 digits, a
temporary's random part), and refuses in one line naming the flag and the bytes that path would need (exit 2,
nothing created). tests/test_path_room.py runs the tiny config at the limit and one byte over it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable, Optional

from dlrm.path_checks import PATH_MAX, absolute_size, shown_path

PID = "9" * 7  # Linux's pid_max is at most 4194304 (2**22)
STEP = "9" * 12  # ``step-%08d``: wider past 10**8 steps
RANK = "9" * 5  # a rank and a world size
RANDOM = "x" * 8  # tempfile's random part (mkstemp, mkdtemp), and secrets.token_hex(4)
UNIX_TIME = "9" * 10  # seconds (an event file's name), nanoseconds: 19
NANOS = "9" * 19
DEFAULT_NAME_SUFFIX = "-20261130-160000-999"  # a default run name's "-<date>-<time>", "-2".."-999" when taken


def run_files(evaluates_only: bool = False, host: Optional[str] = None) -> list[str]:
    """The longest relative path of each kind a run writes in its directory (`evaluates_only`: an --eval-only run,
    which writes its events, config.json and summary.json only)."""
    host = socket.gethostname() if host is None else host
    files = [f"events.out.tfevents.{UNIX_TIME}.{host}.{PID}.9999",  # tensorboard's EventFileWriter
             f".summary.json.{RANDOM}.tmp"]  # (dlrm.checkpoint's write of a report)
    if evaluates_only:
        return files
    trace = f"{host}_{PID}.{NANOS}.pt.trace.json.gz"  # (dlrm.train.profiling.trace_handler)
    return files + [
        # a sharded checkpoint's shard written beside an existing one, through write_atomic's temporary
        f"checkpoints/.step-{STEP}.rank{RANK}-of-{RANK}.pt.pending.{PID}-{RANDOM}.tmp",
        f"checkpoints/.best-step-{STEP}.rank{RANK}-of-{RANK}.pt.pending.{PID}-{RANDOM}.tmp",
        f".{trace}.{RANDOM}.tmp.gz",
        f"profile_timeline_{STEP}.999.png",
    ]


def longest(paths: list[str]) -> str:
    return max(paths, key=lambda p: len(os.fsencode(p)))


def check_room(flag: str, directory: str, deepest: str, error: Optional[Callable[[str], Exception]] = None,
               shown: Optional[str] = None, advice: Optional[str] = None) -> None:
    """Raise `error` (default `dlrm.errors.ConfigError`, exit 2) when `directory`/`deepest` would be over PATH_MAX:
    ``"<flag>: <shown>: the deepest path written there (.../<deepest>) would need N bytes (at most 4095); pick a
    shorter <flag>"``. `shown`: the value the user gave, when `directory` is its parent (a file, a dataset built in a
    temporary sibling); `advice`: what to do instead of picking a shorter value (an existing directory written in
    place, which no flag moves)."""
    size = absolute_size(directory) + 1 + len(os.fsencode(deepest))
    if size >= PATH_MAX:
        if error is None:
            from dlrm.errors import ConfigError

            error = ConfigError
        raise error(f"{flag}: {shown_path(directory if shown is None else shown)}: the deepest path written there "
                    f"(.../{shown_path(deepest, 60)}) would need {size} bytes (at most {PATH_MAX - 1}); "
                    f"{advice or 'pick a shorter ' + flag.split(': ')[-1]}")


def run_deepest(run_name: Optional[str], name: str, evaluates_only: bool = False,
                variants: Optional[str] = None) -> str:
    """The deepest path a new run writes under its ``log.tb_dir``: ``<run name>/`` (`name` and the default's
    `DEFAULT_NAME_SUFFIX` when `run_name` is None), a --compare's ``<variant>/`` (the longest of `variants`, as given),
    then its longest file."""
    parts = [run_name if run_name is not None else name + DEFAULT_NAME_SUFFIX]
    if variants is not None:
        parts.append(longest([v.strip() for v in variants.split(",")] or [""]))
    return "/".join([*parts, longest(run_files(evaluates_only))])


def sweep_resume_room(directory: Path, slugs: list[str], seeds: int) -> None:
    """Refuse a sweep's --resume whose directory (moved deeper since, or resumed on a host of a longer name) has no
    room for its deepest trial (`sweep_deepest`): a trial's event file, or the report's HParams, failed with "a bug in
    dlrm (OSError)" after the trials before it had trained."""
    deepest = sweep_deepest(directory.name, slugs, seeds)[len(directory.name) + 1:]  # (under the directory itself)
    check_room("--resume", str(directory), deepest, advice="move the sweep directory to a shorter path and --resume it "
               "there")


def export_temp(target: Path) -> str:
    """The longest name an export writes beside `target` (`dlrm.train.export`'s temporary)."""
    stem = "n" * min(len(os.fsencode(target.name)), 64)  # (`dlrm.checkpoint.temp_stem(name, 64)`'s length)
    return longest([target.name, f".{stem}.{PID}-{RANDOM}.tmp.pt2"])


def atomic_temp(name: str) -> str:
    """The longest of `name` and the temporary `dlrm.checkpoint.write_atomic` writes beside it (its name cut to 200
    bytes, `temp_stem`)."""
    return longest([name, f".{'n' * min(len(os.fsencode(name)), 200)}.{PID}-{RANDOM}.tmp"])


def sweep_deepest(name: str, slugs: list[str], seeds: int) -> str:
    """The deepest path a sweep writes under its --tb-dir: ``<name>/<setting>/seed-<k>/`` (a trial moved aside by a
    --resume: ``seed-<k>.interrupted-<n>``) and a run's longest file, or its HParams' (``.hparams-old.<random>.tmp/
    hparams/<setting>/`` and an event file, `dlrm.sweep_report.write_report`)."""
    setting = longest(slugs)
    trial = f"{name}/{setting}/seed-{seeds - 1}.interrupted-999/{longest(run_files())}"
    hparams = f"{name}/.hparams-old.{RANDOM}.tmp/hparams/{setting}/{longest(run_files(evaluates_only=True))}"
    return longest([trial, hparams])


# The data tools build a dataset in a temporary sibling of its directory and rename it into place (a relayout's copy
# keeps its input's relative paths, `dlrm.data.relayout`); preprocess writes inside its --output.
SYNTHETIC_FILES = ["validation/part-99999999.parquet", f".metadata.json.{RANDOM}.tmp"]
MLPERF_FILES = ["validation/day-99-part-99999999.parquet.tmp", f".metadata.json.{RANDOM}.tmp"]
PREPROCESS_DEEPEST = f".preprocess-new/validation/.part-99999999-99999999.parquet.{PID}.tmp"


def dataset_temp(name: str, temp: str, files: list[str]) -> str:
    """The deepest path written beside a dataset directory `name`: its temporary sibling ``.<name><temp>`` and the
    longest of `files` inside, or the finished dataset's own (a lock's name is shorter)."""
    return longest([f".{name}{temp}/{longest(files)}", f"{name}/{longest(files)}"])
