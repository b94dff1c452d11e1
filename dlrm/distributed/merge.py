"""``python -m dlrm.distributed.merge CHECKPOINT OUT``: a sharded checkpoint as one file for one GPU.

The result loads with ``train.py --resume OUT``, ``--eval-only --checkpoint OUT`` and ``--export``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from loguru import logger

from dlrm.config import ConfigError
from dlrm.distributed.checkpoint import merge
from dlrm.train.checkpoint import write_atomic


@click.command()
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
def main(checkpoint: str, out: str) -> None:
    """Merge the sharded CHECKPOINT (its step-*.pt manifest) into the one-process checkpoint OUT."""
    from dlrm.cli import _configure_logging

    _configure_logging()
    try:
        if Path(out).exists():
            raise ConfigError(f"{out}: already exists; remove it or choose another path")
        state = merge(Path(checkpoint))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(out), state)
    except ConfigError as e:
        logger.error(str(e))
        sys.exit(2)
    rows = state["model"]["sparse_arch.weight"].shape[0]
    logger.info(f"{out}: step {state['position']['step']}, {rows:,} embedding rows merged from {checkpoint}")


if __name__ == "__main__":
    main()
