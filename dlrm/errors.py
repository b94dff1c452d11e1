"""The exceptions an expected failure of a run raises, importable without torch.

`dlrm.cli` maps each to a one-line message and an exit code (see its module docstring); it
imports them from here at module level, so its handlers exist even when the failure (or a
Ctrl-C) comes before the slow trainer import.
"""

from __future__ import annotations

from dlrm.config import ConfigError
from dlrm.data.schema import DatasetError

__all__ = ["ConfigError", "DatasetError", "NonFiniteLoss", "TrainingStopped"]


class TrainingStopped(Exception):
    """Training ended early on a signal, after writing a checkpoint; `exit_code` is 128 + signal."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""
