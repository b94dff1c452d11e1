"""The process group of a ``torchrun`` launch, and the collectives the training loop uses.

In a plain ``python train.py`` (no ``WORLD_SIZE`` > 1 in the environment) `DistEnv` is a single
process and every method is a no-op, so the loop has one code path.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from loguru import logger

from dlrm.config import ConfigError, DistributedConfig
from dlrm.errors import DatasetError, NonFiniteLoss, PeerLost, TrainingStopped, is_out_of_memory, this_rank_only
from dlrm.logging_setup import log_as_rank


@dataclass(frozen=True)
class DistEnv:
    """Rank `rank` of `world_size` processes (``rank 0 of 1`` when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory, TensorBoard, reports and summaries."""
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns `t`)."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along dim 0 (ranks may hold different row counts)."""
        if not self.distributed:
            return t
        n = torch.tensor([t.shape[0]], device=t.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        sizes_host = [int(s.item()) for s in sizes]  # intended host sync: evaluation only
        top = max(sizes_host)
        padded = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:s] for p, s in zip(parts, sizes_host)])

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def on_main(self, part: Callable[[], Any], what: str) -> Any:
        """What rank 0's `part()` returns, on every rank; where it raises, every rank raises (the others an error
        naming rank 0, `failure_error`). A bare broadcast after it left the others waiting for rank 0 until the
        process group's timeout, or dying with gloo's "Connection closed by peer" traceback."""
        result, error = None, None
        if self.is_main:
            try:
                result = part()
            except Exception as e:  # noqa: BLE001 - raised below, once the others know of it
                error = e
        if self.distributed:
            result, failed = self.broadcast_object((result, None if error is None else failure(error)))
            if failed is not None and error is None:
                raise failure_error(failed, 0, what)
        if error is not None:
            raise error
        return result


def failure(e: BaseException) -> tuple:
    """What the other ranks need to report `e`, one rank's failure (picklable: an exception's traceback is not)."""
    if isinstance(e, OSError):
        return ("os", e.errno, e.strerror or str(e), e.filename)
    if isinstance(e, TrainingStopped):  # a SIGTERM there: the others stop with its exit code, not as with a bug
        return ("stopped", e.exit_code, str(e), None)
    if is_out_of_memory(e):  # the others exit 4 as this rank does (a MemoryError's, a CUDA OOM's, a RuntimeError
        # of theirs was a bug's traceback, exit 1); "gpu": the command's line says which memory ran out
        return ("memory", "gpu" if type(e).__name__ == "OutOfMemoryError" else "host", str(e) or type(e).__name__, None)
    for kind, cls in _KINDS.items():  # DatasetError (exit 2) and NonFiniteLoss (3) too, not the "other" kind's bug
        if isinstance(e, cls):
            return (kind, None, str(e), None)
    return ("other", None, str(e), None)


def failure_error(failed: tuple, rank: int, what: str) -> BaseException:
    """The error another rank raises for rank `rank`'s `failed` (`failure`): of the same kind, so that the command
    reports it as that rank does (an OSError keeps its errno and file: one line, exit 2)."""
    error = _relayed_error(failed, rank, what)
    # the failed rank's own line, as it says it (`agree_on_input_error` compares it with that rank's: said once)
    relayed = " ".join(part.strip() for part in failed[2].splitlines() if part.strip())
    error.relayed = relayed  # type: ignore[attr-defined]
    return error


def _relayed_error(failed: tuple, rank: int, what: str) -> BaseException:
    kind, code, message, filename = failed
    line = f"rank {rank} {what}: {message}"
    if kind == "os":
        if code is None:  # an OSError without an errno (io.UnsupportedOperation, a bare OSError("...")): built with
            # one (or given a filename), its line read "[Errno None] rank 1 could not write ..."
            return OSError(f"{line}: {filename!r}" if filename is not None else line)
        return OSError(code, line, filename)
    if kind == "stopped":
        return TrainingStopped(code, line)
    if kind == "memory":
        return torch.OutOfMemoryError(line) if code == "gpu" else MemoryError(line)
    return _KINDS.get(kind, RuntimeError)(line)


# the kinds of error `failure` tells apart by class (the command's exit code differs for each)
_KINDS = {"config": ConfigError, "dataset": DatasetError, "non-finite": NonFiniteLoss}


def _env_int(name: str, default: str | None) -> int:
    """The integer environment variable `name` (torchrun's launch); a malformed value is a one-line ConfigError
    naming it, not int()'s ValueError traceback."""
    text = os.environ.get(name, default) if default is not None else os.environ[name]
    if default is not None and not text.strip():  # set but empty: unset (as dlrm.cli.check_modes reads WORLD_SIZE)
        text = default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer (set by torchrun "
                          "--nproc-per-node N)") from None


def init_distributed(cfg: DistributedConfig, device: torch.device) -> tuple[DistEnv, torch.device]:
    """Join the ``torchrun`` process group (once per process) and pick this rank's device.

    Returns the env and the device: ``cuda:LOCAL_RANK`` for CUDA, the CPU otherwise.
    """
    world_size = _env_int("WORLD_SIZE", "1")
    if world_size <= 1:
        return DistEnv(), device
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"WORLD_SIZE is {world_size} but RANK / MASTER_ADDR are not set: launch with "
                          "torchrun --nproc-per-node N train.py ...")
    # this rank's own variables and GPU: what is wrong with them is this rank's to say (`this_rank_only`), the
    # others may be fine and wait for it
    try:
        rank, local_rank = _env_int("RANK", None), _env_int("LOCAL_RANK", "0")
    except ConfigError as e:
        raise this_rank_only(e) from None
    # A rank outside [0, WORLD_SIZE) never meets the others: init_process_group would wait for the
    # missing ranks until its store times out (30 minutes) instead of saying what is wrong.
    if not 0 <= rank < world_size:
        raise this_rank_only(ConfigError(f"RANK {rank} is not in [0, WORLD_SIZE {world_size}): launch with torchrun "
                                         "--nproc-per-node N"))
    if not 0 <= local_rank < world_size:
        raise this_rank_only(ConfigError(f"LOCAL_RANK {local_rank} is not in [0, WORLD_SIZE {world_size}): launch "
                                         "with torchrun --nproc-per-node N"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise this_rank_only(ConfigError(f"LOCAL_RANK {local_rank}: only {torch.cuda.device_count()} CUDA "
                                             "devices here"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend: 'nccl' needs CUDA devices; use 'gloo' (or 'auto') on the CPU")
    if not dist.is_initialized():
        # env:// rendezvous reads MASTER_PORT: missing or malformed, torch raises a ValueError (a traceback here)
        if "MASTER_PORT" not in os.environ:
            raise ConfigError(f"WORLD_SIZE is {world_size} but MASTER_PORT is not set: launch with "
                              "torchrun --nproc-per-node N train.py ...")
        port = _env_int("MASTER_PORT", None)
        if not 0 <= port <= 65535:
            raise ConfigError(f"environment variable MASTER_PORT={port} is not a port (0 to 65535)")
        # distributed.timeout_s: how long a collective waits for a rank that hangs (torch's default without it)
        timeout = {} if cfg.timeout_s is None else {"timeout": timedelta(seconds=cfg.timeout_s)}
        try:
            dist.init_process_group(backend, device_id=device if backend == "nccl" else None, **timeout)
        except RuntimeError as e:  # torch's DistStoreError / DistNetworkError: "Timed out after 1800 seconds
            # waiting for clients. 1/2 clients joined.", "The client socket has timed out after ...ms while trying to
            # connect to (host, port)." They read as a bug in dlrm (a traceback, exit 1), after half an hour.
            # (under torchrun the agent's store is joined already, and gloo waits there for every peer's address:
            # "wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1", a DistStoreError read as a bug, exit 1)
            if "timed out" not in str(e).lower() and "wait timeout" not in str(e).lower():
                raise
            waited = f"{cfg.timeout_s:g} s (distributed.timeout_s)" if cfg.timeout_s is not None else \
                "torch's default timeout (distributed.timeout_s)"
            raise PeerLost(f"rank {rank}: the other ranks of this distributed run did not join it at "
                           f"{os.environ['MASTER_ADDR']}:{port} within {waited}: {str(e).strip().splitlines()[0]} "
                           "(did every rank start, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)") from None
        if rank != 0:  # rank 0 speaks for the run; the others report only warnings and errors
            log_as_rank(rank)
        logger.info(f"torch.distributed: {world_size} ranks, backend {backend}, device {device} on rank 0")
    return DistEnv(rank, world_size, local_rank), device


def shutdown() -> None:
    """Leave the process group (at the end of the command).

    Collects garbage first: a finished run's DDP wrapper sits in reference cycles that hold the
    gloo process group, which would otherwise be torn down during interpreter exit, where its
    worker threads abort the process ("terminate called without an active exception", about one
    exit in five on the CPU VM).
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


AGREE_WAIT_S = 10.0
"""How long a rank that met bad input after the ranks joined waits for the others to say what they met
(`agree_on_input_error`); at most half the process group's timeout (`distributed.timeout_s`)."""


def agree_on_input_error(exc: BaseException, line: str, say: Callable[[str], None],
                         timeout_s: Optional[float] = None) -> None:
    """Say `line`, the one-line message of `exc` (bad input: a dataset, a config) met after the ranks of a torchrun run
    joined, through `say` (`dlrm.cli`'s logger for it): once for the run when every rank met it alike, else by each
    rank that met it, naming itself.

    Every rank reads every row group of the data (and checks the same config), so a data error met mid-epoch (a row
    group that cannot be read, a bad value, a file deleted since the start) is met by every rank at the same batch,
    and each said it: rank 1's copy as `[rank 1] ...`. One met by one rank alone (its disk, a file changed between
    the ranks' reads) is that rank's to say, and only it knows of it: the others wait in a collective for it. So the
    ranks compare before saying, through the process group's store, not a collective (a rank that met nothing is
    inside the step's): each rank sets what it met; rank 0 waits for the others' (a bounded time: a rank that met
    nothing never sets one), says the line once when all match (`found_alike`: the other ranks, and other nodes'
    first ranks, leave it out), sets its verdict, and waits until the others have read it (it may hold the store);
    the others wait for the verdict, and say their own line, ``rank N: ...``, unless alike. Rank 0 says it before
    any other rank exits (torchrun's agent stops the rest when the first one exits). One process: `say(line)`."""
    if getattr(exc, "this_rank_only", False) or getattr(exc, "found_alike", False) or not _joined():
        say(line)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    wait = AGREE_WAIT_S if timeout_s is None else min(AGREE_WAIT_S, timeout_s / 2)
    # a failure relayed from the rank that met it (`failure_error`: "rank 1 could not resume from X: M") compared as
    # that rank's own line M: alike, rank 0 says it once (its line names the rank); apart, rank 1's truncated shard
    # was said twice, as "rank 1 could not resume from ..." by rank 0 and as "[rank 1] rank 1: ..." by rank 1
    met_line = getattr(exc, "relayed", line)
    with _StopWaiting() as stop:
        try:
            store = dist.PrefixStore("dlrm/input-error", dist.distributed_c10d._get_default_store())
            store.set(f"met/{rank}", met_line)
        except Exception:  # noqa: BLE001 - no store (torch's internals changed, or it is gone): this rank's line
            store = None
        alike = False
        if store is not None and rank == 0:
            met = _wait_for(store, [f"met/{q}" for q in range(1, world)], wait, stop)
            alike = len(met) == world - 1 and all(text == met_line for text in met.values())
            _say(exc, line, say, rank, alike)
            try:
                store.set("verdict", "alike" if alike else "apart")
            except Exception:  # noqa: BLE001
                return
            _wait_for(store, [f"read/{q.split('/')[1]}" for q in met], wait, stop)
            return
        # rank 0's verdict, once it is comparing (within `wait` of this rank, when it met the error too; else it is
        # inside a collective, waiting for this rank)
        if store is not None and _wait_for(store, ["met/0"], wait, stop):
            alike = _wait_for(store, ["verdict"], wait + 1, stop).get("verdict") == "alike"
            try:
                store.set(f"read/{rank}", "1")
            except Exception:  # noqa: BLE001 - rank 0, the store's host outside torchrun, is gone
                pass
        _say(exc, line, say, rank, alike)


def hold_until_rank_zero_said(timeout_s: Optional[float] = None) -> None:
    """After the line of an error every rank raised alike was said once (`found_alike`: a --resume refused against
    its checkpoint's config, `dlrm.train.builder`'s host-memory refusal, a data error the ranks found alike in
    `agree_on_input_error`; a NaN loss, an agreed signal stop): each machine's first rank (LOCAL_RANK 0, rank 0 on
    one machine), which says it, tells the others through the process group's store, and each other rank waits for
    rank 0's word and its own machine's first rank's (at most `AGREE_WAIT_S`, half `timeout_s` if less) before it
    exits. Under torchrun the agent stops the remaining ranks with SIGTERM as soon as one exits: a rank 1 that exited
    first killed rank 0 before its line was out, and the run ended without a word. (Under torchrun's agent only after
    an agreed signal stop: the others wait for the agent itself, `dlrm.distributed.said_once`.) One process, or a
    store that cannot be reached: nothing."""
    if not _joined():
        return
    rank = dist.get_rank()
    first = rank - _env_int("LOCAL_RANK", "0")  # (torchrun numbers a machine's ranks in a row from its first)
    try:
        store = dist.PrefixStore("dlrm/said-alike", dist.distributed_c10d._get_default_store())
        if first == rank:
            store.set(f"said/{rank}", "1")
            if rank == 0:
                return
    except Exception:  # noqa: BLE001 - no store (torch's internals changed, or it is gone)
        return
    wait = AGREE_WAIT_S if timeout_s is None else min(AGREE_WAIT_S, timeout_s / 2)
    with _StopWaiting() as stop:
        _wait_for(store, sorted({"said/0", f"said/{max(first, 0)}"}), wait, stop)


def _say(exc: BaseException, line: str, say: Callable[[str], None], rank: int, alike: bool) -> None:
    """`line` once for the run (`alike`), else as this rank's, naming it (unless it relays another rank's failure,
    `failure_error`'s ``rank Q could not ...``, which names that rank)."""
    if alike:
        exc.found_alike = True  # type: ignore[attr-defined]
        say(line)
    else:
        this_rank_only(exc)
        say(line if re.match(r"rank \d+ ", line) else f"rank {rank}: {line}")


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _wait_for(store, keys: list[str], wait_s: float, stop: "_StopWaiting") -> dict[str, str]:
    """The values of `keys` the store holds within `wait_s` seconds (all of them, or those set by then, or by a signal
    `stop` took); polled, as a key that never comes must not hold the caller past its bound (the store's own wait
    raises only at the process group's timeout)."""
    found: dict[str, str] = {}
    deadline = time.monotonic() + wait_s
    try:
        while not stop.signalled:
            for key in keys:
                if key not in found and store.check([key]):
                    found[key] = store.get(key).decode()
            if len(found) == len(keys) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store's host (rank 0 outside torchrun) is gone: what came so far
        pass
    return found


class _StopWaiting:
    """SIGTERM or SIGINT while the ranks compare their errors ends the waits (torchrun's agent stops this rank once a
    peer exited; a Ctrl-C): the line is said then, as this rank's own. Left to their handlers, the signal killed the
    rank before it said anything, or raised KeyboardInterrupt out of the command's error report (a traceback)."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def __enter__(self) -> "_StopWaiting":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
