"""SIGTERM outside a run's training steps: raise `TrainingStopped` where it arrives, so the run's own cleanup runs.

Below `dlrm.distributed` in the layers (pyproject.toml's import contract), so that every entry point can use it:
train.py and `dlrm.train.trainer.train`, ``python -m dlrm.sweep``, ``python -m dlrm.distributed.merge``. The training
steps themselves stop gracefully instead (`dlrm.train.signals.GracefulStop`).
"""

from __future__ import annotations

import signal
from typing import Optional

from dlrm.errors import TrainingStopped


class StopAtOnce:
    """Context manager (a whole run, around `GracefulStop`'s loop): SIGTERM raises `TrainingStopped` (exit 143) where
    it arrives, as Ctrl-C raises KeyboardInterrupt, so the run's own cleanup runs. Left to its default action, a SIGTERM
    while a run started (its checkpoint restored, say) killed the process before `RunDirectory.abandon`: the new run
    directory stayed, and its name was refused from then on ("already exists"). A handler set by whoever started the
    process (ignored, say) is left as it is."""

    def __init__(self) -> None:
        self._previous: Optional[object] = None

    @staticmethod
    def _handle(signum, frame) -> None:
        raise TrainingStopped(128 + signum, f"{signal.Signals(signum).name}: stopped at once, outside the training "
                                            "steps (no checkpoint written now)")

    def __enter__(self) -> "StopAtOnce":
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
