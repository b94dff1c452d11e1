"""Everything a run needs before its first step: device, seeds, dataset tables, run directory."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from loguru import logger

from dlrm.config import Config, ConfigError
from dlrm.data.schema import NUM_SPARSE, Metadata, read_metadata, read_vocabulary, write_json_atomic


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without it is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' was requested but CUDA is not available")
    return torch.device(name)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)


@dataclass
class Tables:
    """Embedding table sizes (after any cap) and, for vocabulary hashing, the vocabularies."""

    cardinalities: list[int]
    vocabs: Optional[list[torch.Tensor]]
    hashing: str


def dataset_tables(cfg: Config, meta: Optional[Metadata], data_dir: Optional[Path]) -> Tables:
    """Table sizes from the dataset's metadata (capped by data.max_rows_per_table) or the config."""
    if meta is None:
        if cfg.model.cardinalities is None:
            raise ConfigError("model.cardinalities: needed when no dataset is given")
        cards = list(cfg.model.cardinalities)
        hashing = "modulus"
    else:
        cards = list(meta.cardinalities)
        hashing = meta.hashing
    vocabs = None
    if hashing == "vocabulary":
        if cfg.data.max_rows_per_table is not None:
            raise ConfigError("data.max_rows_per_table: cannot cap tables of a vocabulary-hashed dataset")
        # Each file is read and checked once here (plain .npy, 1-D integers, sorted, unique, and
        # as long as its cardinality): an unsorted vocabulary trains, silently misplacing values.
        vocabs = [torch.from_numpy(read_vocabulary(data_dir, f, cards[f])) for f in range(NUM_SPARSE)]
    elif cfg.data.max_rows_per_table is not None:
        cards = [min(c, cfg.data.max_rows_per_table) for c in cards]
    return Tables(cards, vocabs, hashing)


def load_dataset_metadata(cfg: Config) -> tuple[Path, Metadata]:
    data_dir = Path(cfg.data.path)
    if not data_dir.is_dir():
        raise ConfigError(f"data.path: {str(data_dir)!r} is not a directory")
    return data_dir, read_metadata(data_dir)


def make_run_dir(cfg: Config) -> Path:
    """Create tb_logs/<run-name>/, refusing to reuse a non-empty one (nothing is overwritten)."""
    name = cfg.log.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not re.fullmatch(r"[\w.+-]+", name):
        raise ConfigError(f"log.run_name: {name!r} may hold only letters, digits and . _ + -")
    run_dir = Path(cfg.log.tb_dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"log.run_name: {str(run_dir)!r} already exists and is not empty; pick another --run-name")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"log.tb_dir: cannot write {str(run_dir)!r} ({e.strerror})") from None
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    logger.info(f"run directory: {run_dir}")
    return run_dir
