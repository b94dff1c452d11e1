"""The exceptions an expected failure of a run raises, importable without torch.

`dlrm.cli` maps each to a one-line message and an exit code (see its module docstring); it
imports them from here at module level, so its handlers exist even when the failure (or a
Ctrl-C) comes before the slow trainer import.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from importlib import metadata
from typing import Iterator

from loguru import logger

__all__ = ["ConfigError", "DatasetError", "NonFiniteLoss", "TrainingStopped", "EXIT_BUG", "EXIT_PEER_LOST",
           "PeerLost", "report_bug", "this_rank_only", "found_alike", "is_peer_lost", "peer_lost_message",
           "dlrm_version", "named_os_error", "os_errors_named"]

class ConfigError(ValueError):
    """A config key is unknown, mistyped or out of range; the message names the key path."""


class DatasetError(ValueError):
    """A dataset on disk does not follow the contract; the message names the file and field."""


def named_os_error(e: OSError, path: str | os.PathLike) -> OSError:
    """`e` naming `path` when it names no file (a failed write or fsync of an open file names none: the error line
    said "No space left on device" without saying where). Torch-free, for the data tools' worker processes too."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror or os.strerror(e.errno), str(path))


@contextlib.contextmanager
def os_errors_named(path: str | os.PathLike) -> Iterator[None]:
    """Raise an OSError of the block that names no file as `named_os_error` naming `path` (the file written)."""
    try:
        yield
    except OSError as e:
        named = named_os_error(e, path)
        if named is e:
            raise
        raise named from None  # (the original says nothing more)


@contextlib.contextmanager
def found_alike() -> Iterator[None]:
    """A phase of a torchrun run, after the ranks met, whose bad input every rank finds alike (the checks of a
    --resume against its checkpoint's config, made by each rank on the same files): its ConfigError or DatasetError is
    said once, as one before the ranks met (`dlrm.cli.report_failure`); every rank printed it, `[rank 1] ...` after
    rank 0's line."""
    try:
        yield
    except (ConfigError, DatasetError) as e:
        if not getattr(e, "this_rank_only", False):
            e.found_alike = True  # type: ignore[attr-defined]
        raise


def this_rank_only(exc: BaseException) -> BaseException:
    """`exc` (returned), marked as a failure of this torchrun rank alone (its RANK, LOCAL_RANK, GPU): every rank
    that makes it says it, where a bad config or dataset, found alike by every rank before they meet, is said once
    (`dlrm.cli.report_failure`)."""
    exc.this_rank_only = True  # type: ignore[attr-defined]
    return exc


EXIT_BUG = 1
"""Exit code of every entry point for an unexpected exception."""


EXIT_PEER_LOST = 5
"""Exit code of a rank of a distributed run whose peer rank died (see `is_peer_lost`)."""

# What a collective raises (a RuntimeError, torch's DistBackendError) on a rank whose peer's process is gone (a
# `kill -9` of one rank, the out-of-memory killer, a lost host): gloo's TCP transport finds its sockets closed by the
# kernel; NCCL reports ncclRemoteError ("remote process exited or there was a network error").
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited or there was a network error")
# What gloo raises on a rank whose collective waited the process group's timeout (`distributed.timeout_s`) for a
# peer that hangs: stopped (SIGSTOP, a debugger), deadlocked, its host frozen. ("Timed out waiting 5000ms for send
# operation to complete", "... for recv operation ...")
_PEER_TIMEOUT = re.compile(r"Timed out waiting \d+ ?ms for \w+ operation")


class PeerLost(RuntimeError):
    """The other ranks of a distributed run never joined this one (exit 5, as for `is_peer_lost`); the message is
    the whole line."""


def is_peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure because another rank's process died, or did not answer within the
    process group's timeout. The surviving ranks reported it as a bug in dlrm (gloo's traceback, exit 1), where the
    rank that died or hung was at fault, not the code."""
    text = str(exc)
    if isinstance(exc, PeerLost):
        return True
    if not isinstance(exc, RuntimeError) or not ("gloo" in text or "NCCL" in text):
        return False
    return any(t in text for t in _PEER_LOST) or _PEER_TIMEOUT.search(text) is not None


def peer_lost_message(exc: BaseException) -> str:
    """One line for `is_peer_lost`'s failure: gloo's reason without its source location and advice."""
    if isinstance(exc, PeerLost):
        return str(exc)
    reason = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0]).split(". This is typically")[0]
    rank = f"rank {os.environ['RANK']}: " if os.environ.get("RANK") is not None else ""
    if _PEER_TIMEOUT.search(reason):
        return (f"{rank}another rank of this distributed run did not answer within the process group's timeout "
                f"(distributed.timeout_s; it hangs, or is gone): {reason}; stopped; --resume continues the run from "
                "its last checkpoint, if it wrote one")
    # (a peer that stopped on its own error, a bad config say, reads the same here: its line names that error)
    return (f"{rank}another rank of this distributed run is gone (stopped by "
            f"its own error, logged by it, or killed: out of memory, its host lost): {reason}; stopped; --resume "
            "continues the run from its last checkpoint, if it wrote one")


class TrainingStopped(Exception):
    """Training ended early on a signal, after writing a checkpoint; `exit_code` is 128 + signal. `agreed`: every rank
    of a torchrun run stops with this same line (they agreed on the signal), which rank 0 says for all."""

    def __init__(self, exit_code: int, message: str, agreed: bool = False):
        super().__init__(message)
        self.exit_code, self.agreed = exit_code, agreed


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


def dlrm_version() -> str:
    """The installed package's version, for the bug report line."""
    try:
        return metadata.version("dlrm-triton")
    except metadata.PackageNotFoundError:
        return "(version unknown: not installed)"


def report_bug(exc: BaseException) -> int:
    """Print an unexpected exception's traceback, then one line saying it is a bug; return `EXIT_BUG`."""
    traceback.print_exception(exc, file=sys.stderr)
    logger.error(f"this is a bug in dlrm {dlrm_version()} ({type(exc).__name__}): please report it with the "
                 "traceback above")
    return EXIT_BUG


def failure_reason(exc: BaseException) -> str:
    """A failed trial's (or --compare variant's) reason on one line: the message of an error of ours (it says what
    went wrong), otherwise the exception's type and message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines)
    if not isinstance(exc, (ConfigError, DatasetError, NonFiniteLoss)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or GPU memory ran out. torch is looked up only if already imported: if it is not,
    the exception cannot be one of its classes (and importing it here would be slow)."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom_class = getattr(torch, "OutOfMemoryError", None) if torch is not None else None  # = torch.cuda.OutOfMemoryError
    if oom_class is not None and isinstance(exc, oom_class):
        return True
    # torch's CPU allocator reports failure as a plain RuntimeError
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


# What a failure under this process's own address-space limit looks like where it is not torch's allocator's: a
# shared library that cannot be mapped (an import), a thread whose stack or malloc arena cannot be mapped (Python's,
# pyarrow's, wrapped in a DatasetError blaming the data file), mmap's ENOMEM. Measured under `ulimit -v` with
# configs/sample.json on a 2-core machine (2026-12-05): 1.0 GB "libtriton.so: failed to map segment from shared
# object" (exit 1, "a bug"), 1.5 GB "can't start new thread" (exit 1), 2.0-2.5 GB torch's "can't allocate memory"
# (exit 4, advising a smaller batch), 2.75 GB pyarrow's "Failed to launch worker thread: Resource temporarily
# unavailable" (exit 2, the parquet file named as unreadable).
_LIMIT_FAILURES = ("failed to map segment", "can't start new thread", "cannot allocate memory", "can't allocate memory",
                   "failed to launch worker thread", "thread creation failed", "out of memory")


def address_limits() -> str:
    """This process's finite address-space limits as a user sets them ("ulimit -v 2.0 GiB (RLIMIT_AS)"), "" where
    none is set."""
    import resource

    said = []
    for limit, flag, name in ((resource.RLIMIT_AS, "-v", "RLIMIT_AS"), (resource.RLIMIT_DATA, "-d", "RLIMIT_DATA")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            said.append(f"ulimit {flag} {soft / 2**30:,.1f} GiB ({name})")
    return ", ".join(said)


def as_limit_failure(exc: BaseException) -> BaseException:
    """`exc`, or where it is a failure to map memory (`_LIMIT_FAILURES`, or a MemoryError) while this process runs under
    an address-space limit (`address_limits`), a MemoryError saying so in one line with what to do (exit 4, said as it
    is: `dlrm_refused`). A refusal of ours (already naming the limits) and a GPU's out-of-memory pass as they are."""
    if getattr(exc, "dlrm_refused", False) or type(exc).__name__ == "OutOfMemoryError":
        return exc
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    if not (isinstance(exc, MemoryError) or any(s in text.lower() for s in _LIMIT_FAILURES)):
        return exc
    limits = address_limits()
    if not limits:
        return exc
    text = text if len(text) <= 300 else text[:297] + "..."
    new = MemoryError(f"out of address space under this process's limit, {limits} ({type(exc).__name__}: {text}): "
                      "raise it (ulimit -v unlimited; configs/sample.json takes 3.1 GiB on a 2-core machine, a larger "
                      "model or more cores more), or make the run smaller (data.batch_size, data.max_rows_per_table)")
    new.dlrm_refused = True  # type: ignore[attr-defined]
    return new
