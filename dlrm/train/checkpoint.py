"""Checkpoints: everything needed to continue a run exactly, written so a crash never breaks one.

A checkpoint is one file ``tb_logs/<run>/checkpoints/step-<NNNNNNNN>.pt`` holding the
uncompiled model's state, optimizer and LR-schedule states, the step and data position, the
RNG states (Python, NumPy, torch CPU and CUDA), the table sizes and the resolved config.
It is written to a temporary name, flushed to disk, then renamed; the newest K are kept.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from loguru import logger

from dlrm.config import ConfigError, ModelConfig

FORMAT_VERSION = 1
_NAME = re.compile(r"step-(\d{8,})\.pt$")


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done; the next batch is `batch` of `epoch`."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary files never match the name)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def write_atomic(path: Path, state: dict[str, Any]) -> None:
    """torch.save `state` (with the format version) to a temporary file, fsync, rename to `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (with the shard files of sharded ones)."""
    for old in list_checkpoints(run_dir)[:-keep]:
        for shard in old.parent.glob(old.stem + ".rank*-of-*.pt"):
            shard.unlink(missing_ok=True)
        old.unlink(missing_ok=True)


def save_checkpoint(run_dir: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write atomically (temp file, fsync, rename), then delete all but the newest `keep`."""
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / checkpoint_name(step)
    write_atomic(path, state)
    prune_checkpoints(run_dir, keep)
    logger.info(f"checkpoint: {path}")
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: checkpoint not found")
    try:
        # weights_only=False: the file also carries RNG states and the config (our own files).
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt or foreign file
        raise ConfigError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{path}: not a checkpoint of this program (format_version {state.get('format_version')!r})")
    return state


def resolve_resume(resume: str, run_dir: Path) -> Optional[Path]:
    """`--resume` alone means the run's latest checkpoint; otherwise it is a path."""
    if resume != "latest":
        return Path(resume)
    found = list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {checkpoint_dir(run_dir)}")
    return found[-1]


def check_compatible(state: dict[str, Any], model: torch.nn.Module, cardinalities: list[int], model_cfg: dict, path: Path) -> None:
    """Raise a one-line error naming what differs when the checkpoint cannot load into `model`.

    Kernel choices are not compared: torch and triton modules share state_dict keys.
    """
    saved_cards = state["cardinalities"]
    if list(saved_cards) != list(cardinalities):
        diffs = [f"[{i}] {a} vs {b}" for i, (a, b) in enumerate(zip(saved_cards, cardinalities)) if a != b]
        raise ConfigError(f"{path}: table sizes differ (checkpoint vs this run): {', '.join(diffs[:5])}")
    saved_model = state["config"]["model"]
    for key in ("embedding_dim", "bottom_mlp", "top_mlp", "interaction", "activation", "top_mlp_input_multiple"):
        saved_value = saved_model.get(key, getattr(ModelConfig(), key))  # keys added later: their default
        if saved_value != model_cfg.get(key):
            raise ConfigError(f"{path}: model.{key} differs: checkpoint {saved_value!r}, this run {model_cfg.get(key)!r}")
    own = model.state_dict()
    saved = state["model"]
    if set(own) != set(saved):
        missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        raise ConfigError(f"{path}: state_dict keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in own.items():
        if tuple(saved[k].shape) != tuple(v.shape):
            raise ConfigError(f"{path}: {k} has shape {tuple(saved[k].shape)} in the checkpoint, {tuple(v.shape)} here")
