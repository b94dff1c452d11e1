"""A torchrun rank (tests/test_qa_saidonce77.py) whose report of an error said once for the run is made late on rank 0,
deterministically: the other rank marks the moment it has reported (where `dlrm.distributed.said_once`'s wait
starts), and rank 0's first error line, on its way to stderr, waits for that mark and then `SAID_ONCE_DELAY_S` more.
Without the wait (`SAID_ONCE_UNFIXED=1`: the wait taken out), rank 1 exits at its mark and torchrun's agent, polling
every 0.1 s, kills rank 0 before its line is out.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/said_once_ranks.py train ARGS...
        train.py's command (`dlrm.cli.main`) with ARGS
    ... tests/said_once_ranks.py met KIND
        the ranks meet (gloo), then each raises the same error, KIND `alike` (a ConfigError marked `found_alike`, as
        a --resume refused against its checkpoint's config) or `nan` (NonFiniteLoss), reported as train.py does;
        rank 0 leaves `SAID_ONCE_SLOW_EXIT_S` (0) after its report
"""

import os
import sys
import time
from pathlib import Path

# (read with defaults: pytest's --doctest-modules imports this file too, outside any launch)
MARK = Path(os.environ.get("SAID_ONCE_MARK", "said-once.mark"))
DELAY_S = float(os.environ.get("SAID_ONCE_DELAY_S", "0"))
RANK = int(os.environ.get("RANK", "0"))


class _LateErrorLine:
    """rank 0's stderr, whose first error line (loguru's `ERROR`, click's `error:`) is written only once the other
    rank marked its report, and `DELAY_S` after."""

    def __init__(self, stream):
        self._stream, self._held = stream, False

    def write(self, text):
        if not self._held and ("ERROR" in text or text.startswith("error:")):
            self._held = True
            deadline = time.monotonic() + 30
            while not MARK.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(DELAY_S)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _patch_wait() -> None:
    from dlrm.distributed import said_once

    real = said_once.wait_until_rank_zero_said

    def marked(*args, **kwargs):
        if RANK != 0:
            MARK.touch()
        if not os.environ.get("SAID_ONCE_UNFIXED"):
            real(*args, **kwargs)

    said_once.wait_until_rank_zero_said = marked


def _met(kind: str) -> None:
    import torch

    from dlrm.cli import report_failure
    from dlrm.config import ConfigError, DistributedConfig
    from dlrm.distributed import env
    from dlrm.errors import NonFiniteLoss
    from dlrm.logging_setup import configure_logging

    configure_logging(ranks=True)
    env.init_distributed(DistributedConfig(backend="gloo"), torch.device("cpu"))
    exc = NonFiniteLoss("loss is nan at step 3") if kind == "nan" else ConfigError("--resume: refused alike")
    exc.found_alike = kind != "nan"
    code = report_failure(exc, None)
    if RANK == 0:  # (rank 0 slow to leave after its line: the process group's teardown on a loaded machine)
        time.sleep(float(os.environ.get("SAID_ONCE_SLOW_EXIT_S", "0")))
    env.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    if RANK == 0:
        sys.stderr = _LateErrorLine(sys.stderr)
    _patch_wait()
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "met":
        _met(args[0])
    else:
        from dlrm.cli import main

        main(args, prog_name="train.py")
