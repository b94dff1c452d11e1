"""``data.placement: "auto"``: hold the data in GPU memory when it fits, stream it otherwise.

The estimate is deliberately simple and stated in the log line: the train and evaluation splits at
`device_bytes_per_row` each (`dlrm.data.device_loader`: dense float32, every sparse slot as a 32-bit
pattern, labels) against ``data.gpu_memory_share`` of the device memory that is free before the model
is built, less what the embedding tables (in ``model.embedding_dtype``) and their fp32 optimizer state
will take (`rank_table_bytes`: under torchrun the rows the sharding plan gives each rank, and with
vocabulary hashing the int64 keys every rank holds), on the rank where the least is left.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from loguru import logger

from dlrm.config import Config, ConfigError
from dlrm.data.schema import Metadata
from dlrm.data.shuffle_seed import check_resumed_shuffle
from dlrm.distributed.sharding import plan_sharding
from dlrm.logging_setup import run_logger
from dlrm.model.dlrm import _TABLE_DTYPES


def device_bytes_per_row(multi_hot_sizes: list[int]) -> int:
    """Bytes a row takes in a device-resident split (`dlrm.data.device_loader`): 13 float32 dense values, one
    int32 a sparse slot (26 one-hot; MLPerf DLRM-DCNv2's multi-hot rows hold 214), a float32 label."""
    return 13 * 4 + sum(multi_hot_sizes) * 4 + 4


DEVICE_BYTES_PER_ROW = device_bytes_per_row([1] * 26)
"""`device_bytes_per_row` of a one-hot dataset."""


def table_row_bytes(cfg: Config) -> int:
    """One embedding row's weights (``model.embedding_dtype``) plus its sparse optimizer state (fp32)."""
    dim = cfg.model.embedding_dim
    state = {"sgd": 0, "adagrad": 4 * dim, "rowwise_adagrad": 4}[cfg.optim.sparse.name]
    return dim * _TABLE_DTYPES[cfg.model.embedding_dtype].itemsize + state


def vocabulary_key_bytes(cardinalities: list[int], hashing: str) -> int:
    """What every rank holds of vocabulary hashing besides its rows: the int64 key of every vocabulary value
    (`dlrm.model.hashing.keyed_vocabulary`, a table's rows less its out-of-vocabulary row); 0 under modulus hashing."""
    return 8 * sum(int(c) - 1 for c in cardinalities) if hashing == "vocabulary" else 0


def table_bytes(cfg: Config, cardinalities: list[int], world_size: int = 1) -> int:
    """Embedding weights plus the sparse optimizer's state on one rank, were the rows spread evenly
    (`rank_table_bytes` counts the rows the sharding plan gives each rank)."""
    return int(sum(cardinalities) / world_size * table_row_bytes(cfg))


def rank_table_bytes(cfg: Config, cardinalities: list[int], world_size: int = 1, hotness: Optional[list[int]] = None,
                     hashing: str = "modulus", memory_per_rank: Optional[int] = None) -> list[int]:
    """What each rank's embedding holds on its device: weights and sparse optimizer state of its rows, and with
    vocabulary hashing the int64 key of every vocabulary value (`dlrm.model.hashing.keyed_vocabulary`: every rank
    holds all of them, a table's rows less its out-of-vocabulary row).

    A rank's rows are those of the sharding plan the build makes (`dlrm.train.builder.make_sharding`, from the same
    settings; ``memory_per_rank`` is its limit, the keys counted in it), not ``1/W`` of the tables: table-wise
    tables go whole to one rank (MLPerf DLRM-DCNv2 on 2 ranks: 1.6 times the even share, 15 GiB more, on one of
    them)."""
    row = table_row_bytes(cfg)
    keys = vocabulary_key_bytes(cardinalities, hashing)
    if world_size == 1:
        return [sum(cardinalities) * row + keys]
    plan = plan_sharding(list(cardinalities), world_size, cfg.distributed.sharding, cfg.distributed.row_wise_min_rows,
                         hotness, cfg.distributed.balance, row, memory_per_rank, keys)
    return [plan.local_rows(q) * row + keys for q in range(world_size)]


def choose_placement(cfg: Config, meta: Metadata, cardinalities: list[int], device: torch.device,
                     world_size: int = 1) -> str:
    """"stream" or "gpu" for ``data.placement``; explicit settings are returned as they are."""
    if cfg.data.placement != "auto":
        return cfg.data.placement
    if device.type != "cuda":
        logger.info("data.placement auto: stream (no CUDA device)")
        return "stream"
    rows = sum(meta.splits[s].rows for s in ("train", cfg.data.eval_split) if s in meta.splits)
    need = rows * device_bytes_per_row(meta.multi_hot_sizes)
    frees, total = _free_memory(device, world_size)
    # the rank's own tables from its own free memory: the ranks hold different shares of the rows
    tables = rank_table_bytes(cfg, cardinalities, world_size, meta.multi_hot_sizes, meta.hashing,
                              int(total * _table_memory_fraction()))
    free = min(f - t for f, t in zip(frees, tables))
    budget = max(free, 0) * cfg.data.gpu_memory_share
    choice = "gpu" if need <= budget else "stream"
    shown_need, shown_free, shown_budget = _shown_gib(need, max(free, 0), budget)
    logger.info(f"data.placement auto: {choice} (train + {cfg.data.eval_split}: {rows:,} rows, {shown_need} GiB on "
                f"the device; {cfg.data.gpu_memory_share:.0%} of the {shown_free} GiB free after the "
                f"tables is {shown_budget} GiB)")
    return choice


def _shown_gib(need: float, free: float, budget: float) -> tuple[str, str, str]:
    """`need`, `free` and `budget` in GiB as the log line states them: the need to 2 decimals, the others to 1, unless
    the rounded numbers would contradict the choice (7.44 GiB needed "of 7.4 GiB" and placed on the GPU, 7.46 "of
    7.5" and streamed); then all to as many decimals as it takes to read the choice off them."""
    fits = need <= budget
    digits = (2, 1)
    while digits[0] < 12 and (float(f"{need / 2**30:.{digits[0]}f}") <= float(f"{budget / 2**30:.{digits[1]}f}")) != fits:
        digits = (max(digits) + 1,) * 2
    return (f"{need / 2**30:.{digits[0]}f}", f"{free / 2**30:.{digits[1]}f}", f"{budget / 2**30:.{digits[1]}f}")


def _table_memory_fraction() -> float:
    from dlrm.train.builder import TABLE_MEMORY_FRACTION  # (the builder imports this module)

    return TABLE_MEMORY_FRACTION


def _free_memory(device: torch.device, world_size: int) -> tuple[list[int], int]:
    """(the device memory free on each rank, the least total memory of any rank, which `make_sharding` plans with):
    this rank's alone in one process, every rank's under torchrun (two gathers at start-up), so every rank decides
    alike. cudaMemGetInfo's total is the device properties' total memory, which `make_sharding` reads.

    Every rank must place the data alike: each loads the whole split and takes its slice of every global batch, and
    the two loaders shuffle differently, so a rank streaming beside one holding its split in GPU memory (less free
    memory on one GPU) took its slices from other global batches: rows trained twice an epoch, others never."""
    free, total = torch.cuda.mem_get_info(device)
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        frees: list = [None] * world_size
        torch.distributed.all_gather_object(frees, free)
        totals: list = [None] * world_size
        torch.distributed.all_gather_object(totals, total)
        return frees, min(totals)
    return [free] * world_size, total


def resumed_placement(cfg: Config, state: dict, chosen: str, allowed: Iterable[str] = (), source: object = "") -> str:
    """The placement a resumed run reads its batches with: `chosen` (`choose_placement`'s), unless the checkpoint's run
    used another (its ``data_placement`` in `state`, the checkpoint `source`; absent when it does not say) and
    ``data.shuffle`` is on.

    The two loaders shuffle differently (`dlrm.data.device_loader.device_permutation` permutes the whole split, the
    stream loader row groups and shuffle buffers), so the placement decides which rows form a shuffled epoch's batches:
    "auto" then takes the checkpoint's placement (it resolves by the device memory free at the start, which a resume
    need not find again), and another explicit placement is refused unless ``--allow-config-change data.placement``
    names it. Unshuffled, both give the rows in file order: any placement resumes the same batches. A stream-loader
    run of a seed >= 2**32 checkpointed before its shuffle changed is refused too (`check_resumed_shuffle`)."""
    allowed = tuple(allowed)
    saved = _saved_placement(state)
    if saved is None and cfg.data.shuffle and _configured_placement(state) == "auto":  # (written 11-23..11-30)
        run_logger.warning(f"--resume: {source or 'the checkpoint'} does not record which placement its run's "
                           f"data.placement \"auto\" chose; resuming with {chosen}: if that run used the other, the "
                           "shuffled batches from here on differ from the ones it would have trained on")
    placement = _resumed_placement(cfg, saved, chosen, allowed)
    check_resumed_shuffle(cfg, state, placement, allowed, source)
    return placement


def _saved_placement(state: dict) -> Optional[str]:
    """The placement the checkpoint's run read its batches with: its ``data_placement``, or, in a checkpoint written
    before that key existed (2026-11-30), its config's data.placement when explicit ("stream", the default until
    "auto" came, or "gpu": every version used an explicit one as it is). Unknown (None) only for "auto" there: taken
    for unknown, a run of the old default "stream" resumed with "auto" held its split in GPU memory where it fit, and
    an explicit "gpu" one streamed on a CPU, silently training other shuffled batches."""
    if state.get("data_placement") is not None:
        return state["data_placement"]
    placement = _configured_placement(state)
    return placement if placement in ("stream", "gpu") else None


def _configured_placement(state: dict) -> Optional[str]:
    """The data.placement of the checkpoint's config, as written (None: none there)."""
    config = state.get("config")
    data = config.get("data") if isinstance(config, dict) else None
    return data.get("placement") if isinstance(data, dict) else None


def _resumed_placement(cfg: Config, saved: Optional[str], chosen: str, allowed: Iterable[str]) -> str:
    if saved is None or saved == chosen or not cfg.data.shuffle:
        return chosen
    if cfg.data.placement == "auto":
        logger.info(f"data.placement auto: {saved}, the placement of the run resumed (its shuffled batches; "
                    f"{chosen} would shuffle other ones)")
        return saved
    if any(k in ("data", "data.placement") for k in allowed):
        run_logger.warning(f"--resume: data.placement {saved} -> {chosen} allowed by --allow-config-change: the "
                           "shuffled batches from here on differ from the ones the run would have trained on")
        return chosen
    raise ConfigError(f"data.placement: {chosen!r}, where the run resumed read its batches with {saved!r}: the two "
                      f"shuffle differently, so the run would train on other batches; resume with {saved!r} (or "
                      f"\"auto\"), or pass --allow-config-change data.placement")
