"""``data.placement: "auto"``: hold the data in GPU memory when it fits, stream it otherwise.

The estimate is deliberately simple and stated in the log line: the train and evaluation splits at
`DEVICE_BYTES_PER_ROW` each (`dlrm.data.device_loader`: dense float32, sparse as 32-bit patterns,
labels) against ``data.gpu_memory_share`` of the device memory that is free before the model is
built, less what the embedding tables and their optimizer state will take.
"""

from __future__ import annotations

import torch
from loguru import logger

from dlrm.config import Config
from dlrm.data.schema import Metadata

DEVICE_BYTES_PER_ROW = 13 * 4 + 26 * 4 + 4
"""Bytes a row takes in a device-resident split (`dlrm.data.device_loader`)."""


def table_bytes(cfg: Config, cardinalities: list[int], world_size: int = 1) -> int:
    """Embedding weights plus the sparse optimizer's state on one rank (fp32)."""
    rows = sum(cardinalities) / world_size
    per_row = {"sgd": 1.0, "rowwise_adagrad": 1.0 + 1.0 / cfg.model.embedding_dim, "adagrad": 2.0}
    return int(rows * cfg.model.embedding_dim * 4 * per_row[cfg.optim.sparse.name])


def choose_placement(cfg: Config, meta: Metadata, cardinalities: list[int], device: torch.device,
                     world_size: int = 1) -> str:
    """"stream" or "gpu" for ``data.placement``; explicit settings are returned as they are."""
    if cfg.data.placement != "auto":
        return cfg.data.placement
    if device.type != "cuda":
        logger.info("data.placement auto: stream (no CUDA device)")
        return "stream"
    rows = sum(meta.splits[s].rows for s in ("train", cfg.data.eval_split) if s in meta.splits)
    need = rows * DEVICE_BYTES_PER_ROW
    free = torch.cuda.mem_get_info(device)[0] - table_bytes(cfg, cardinalities, world_size)
    budget = max(free, 0) * cfg.data.gpu_memory_share
    choice = "gpu" if need <= budget else "stream"
    logger.info(f"data.placement auto: {choice} (train + {cfg.data.eval_split}: {rows:,} rows, {need / 2**30:.2f} GiB on "
                f"the device; {cfg.data.gpu_memory_share:.0%} of the {max(free, 0) / 2**30:.1f} GiB free after the "
                f"tables is {budget / 2**30:.1f} GiB)")
    return choice
