"""``python -m dlrm.distributed.merge CHECKPOINT OUT``: a sharded checkpoint as one file for one GPU.

The result loads with ``train.py --resume OUT``, ``--eval-only --checkpoint OUT`` and ``--export``.
Every expected failure (a missing or unreadable file, shards that do not fit together, an OUT that
exists or cannot be written) is one error line and exit status 2; OUT is then left untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from loguru import logger

from dlrm.config import ConfigError
from dlrm.distributed.checkpoint import SPARSE_WEIGHT, merge
from dlrm.logging_setup import configure_logging
from dlrm.checkpoint import write_atomic


def merge_to_file(checkpoint: Path, out: Path) -> dict:
    """Merge the sharded `checkpoint` and write it atomically to `out`, which must not exist."""
    if out.exists():
        raise ConfigError(f"{out}: already exists; remove it or choose another path")
    state = merge(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, state)
    return state


@click.command()
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
def main(checkpoint: str, out: str) -> None:
    """Merge the sharded CHECKPOINT (its step-*.pt manifest) into the one-process checkpoint OUT."""
    configure_logging()
    try:
        state = merge_to_file(Path(checkpoint), Path(out))
    except ConfigError as e:
        logger.error(str(e))
        sys.exit(2)
    except OSError as e:  # OUT's directory cannot be created or written
        logger.error(f"{out}: cannot write ({e.strerror or e})")
        sys.exit(2)
    rows = state["model"][SPARSE_WEIGHT].shape[0]
    logger.info(f"{out}: step {state['position']['step']}, {rows:,} embedding rows merged from {checkpoint}")


if __name__ == "__main__":
    main()
