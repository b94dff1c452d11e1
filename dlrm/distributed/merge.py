"""``python -m dlrm.distributed.merge CHECKPOINT OUT``: a sharded checkpoint as one file for one GPU.

The result loads with ``train.py --resume OUT``, ``--eval-only --checkpoint OUT`` and ``--export``.
Every expected failure (a missing or unreadable file, shards that do not fit together, an OUT that
exists or cannot be written) is one error line and exit status 2; OUT is then left untouched.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
from loguru import logger

from dlrm.config import ConfigError
from dlrm.config_checks import MAX_NAME_BYTES
from dlrm.errors import TrainingStopped
from dlrm.distributed import same_run
from dlrm.distributed.checkpoint import SPARSE_WEIGHT, _named_shards, merge
from dlrm.data.output_dirs import check_export_place
from dlrm.logging_setup import configure_logging
from dlrm.mapped_load import check_unchanged, reading
from dlrm.stop_signal import StopAtOnce, raise_pending, take_pending
from dlrm.checkpoint import load_checkpoint, write_atomic
from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand


def check_out_path(out: Path) -> None:
    """Refuse, before any work, an OUT that exists (a dangling symlink too: writing would replace it, as
    ``--export`` refuses), that cannot be created because a file stands where a directory must, or that lies
    in what a run, a dataset or a sweep owns (`dlrm.data.output_dirs.check_export_place`)."""
    if os.path.lexists(out):
        raise ConfigError(f"{out}: already exists; remove it or choose another path")
    if len(os.fsencode(out.name)) > MAX_NAME_BYTES:  # (found by the final link, after the whole merge)
        raise ConfigError(f"{out}: a file name of {len(os.fsencode(out.name))} bytes is too long (at most "
                          f"{MAX_NAME_BYTES})")
    ancestor = out.absolute().parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{out}: cannot write it: {ancestor} is not a directory")
    # not among a run's checkpoints (its pruning and --resume read every step-*.pt there as its own), in a dataset
    # (a tool's --overwrite replaces it whole) or a sweep, as train.py's --export is refused there
    check_export_place(out, flag="OUT", written="the merged checkpoint")
    from dlrm.run_paths import atomic_temp, check_room

    check_room("OUT", os.path.dirname(os.path.abspath(out)), atomic_temp(out.name), shown=str(out))  # (after the merge)


def check_same_run(manifest_path: Path) -> None:
    """Raise a one-line ConfigError naming two shard files and the first key that differs when the shards
    the manifest names were not saved by one run at one step (e.g. a shard copied from another run: the
    plan and shapes may fit, the merge would silently mix two models)."""
    sharded = load_checkpoint(manifest_path)["sharded"]
    same_run.check_same_run([manifest_path.parent / name for name in sharded["shards"]],
                            "merge the shards of one checkpoint")


def own_best(state: dict[str, Any], out: Path, checkpoint: Path) -> None:
    """The best evaluation's checkpoint that the merged `state` (written as `out`) records: `out` itself when it is
    at the best's step (the best's model), else none. The shards record the sharded run's best.pt, a manifest of
    shards one process cannot load (a one-process run resumed from `out` reported it as its best's checkpoint)."""
    stats = state.get("run_stats")
    best = stats.get("best") if isinstance(stats, dict) else None
    if not isinstance(best, dict):
        return
    here = best.get("step") == state["position"]["step"]
    if not here and best.get("checkpoint"):
        logger.info(f"{checkpoint}: the best evaluation (step {best.get('step')}) is in {best['checkpoint']}, not in "
                    f"this checkpoint; merge that one too for its model")
    state["run_stats"] = {**stats, "best": {**best, "checkpoint": str(out.absolute()) if here else None}}


def merge_to_file(checkpoint: Path, out: Path) -> dict:
    """Merge the sharded `checkpoint` and write it atomically to `out`, which must not exist."""
    check_out_path(out)
    written = False
    # the shards are memory-mapped until OUT is written (its dense tensors are rank 0's, read by the write): one
    # written in place meanwhile (cp over it) gave OUT another file's bytes at the first one's offsets, without a word;
    # one truncated, its pages past the end read, killed the merge (SIGBUS) without a word: a one-line error
    try:
        with reading([checkpoint, *(checkpoint.parent / name for name in _named_shards(checkpoint))]) as stamps:
            state = merge(checkpoint)
            check_same_run(checkpoint)
            own_best(state, out, checkpoint)
            # a SIGTERM whose stop a library dropped (torch's import, a catch-all in the loads): stopped before OUT is
            # written (lost, the merge wrote OUT and exited 0 as if none had come)
            raise_pending()
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out, state, replace=False)  # nor an OUT that appeared while the merge ran
            written = True
            check_unchanged(stamps)
    except ConfigError:
        if written:
            out.unlink(missing_ok=True)  # (this merge's own OUT: it did not exist before, `replace=False`)
        raise
    return state


@click.command(cls=OneLineUsageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=NonEmptyPath("the manifest of a sharded checkpoint", dir_okay=False))
@click.argument("out", type=NonEmptyPath("the merged checkpoint to write", dir_okay=False))
def main(checkpoint: str, out: str) -> None:
    """Merge the sharded CHECKPOINT (its step-*.pt manifest) into the one-process checkpoint OUT."""
    configure_logging()
    try:
        # SIGTERM raises (as in train.py): its default action killed the merge before write_atomic removed the
        # temporary file beside OUT (as large as the checkpoint), which nothing removes later
        with StopAtOnce():
            state = merge_to_file(Path(checkpoint), Path(out))
            # one whose stop was dropped after OUT was written: nothing left to stop (as train.py's `LateSignals`),
            # said below (forgotten by `StopAtOnce`'s end, the merge exited 0 without a word)
            late = take_pending()
    except ConfigError as e:
        logger.error(str(e))
        sys.exit(2)
    except TrainingStopped as e:
        logger.warning(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # click's own answer was "Aborted!" and exit 1 (a bug's code); OUT's temporary is gone
        logger.error("interrupted (Ctrl-C)")
        sys.exit(130)
    except MemoryError as e:  # (a shard beyond ulimit -v: `dlrm.mapped_load.raise_if_out_of_memory`'s line) a traceback
        logger.error(str(e) or "out of host memory merging the shards")
        sys.exit(4)
    except OSError as e:  # OUT's directory cannot be created or written
        logger.error(f"{out}: cannot write ({e.strerror or e})")
        sys.exit(2)
    rows = state["model"][SPARSE_WEIGHT].shape[0]
    logger.info(f"{out}: step {state['position']['step']}, {rows:,} embedding rows merged from {checkpoint}")
    if late is not None:
        logger.warning(f"{signal.Signals(late).name} arrived after the merge finished ({out} written): nothing left to "
                       "stop, exit 0")


if __name__ == "__main__":
    main()
