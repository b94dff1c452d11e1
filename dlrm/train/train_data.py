"""The run's data: its training and evaluation loaders (streamed from parquet or held in device memory), its effective
batch size and its length in steps (`TrainData`), and the log lines about them, said once (by rank 0) for the loader
the run trains with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from loguru import logger

from dlrm.config import Config, ConfigError
from dlrm.data.batch import batches_per_epoch
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import NUM_SPARSE, DatasetError, is_multi_hot
from dlrm.data.validation import check_apart
from dlrm.distributed.env import DistEnv
from dlrm.logging_setup import counted, run_logger
from dlrm.train.setup import Tables, dataset_tables, load_dataset_metadata, resolve_device

__all__ = ["SLOW_MULTI_HOT_CODECS", "TrainData", "build_for_data", "make_loader"]


# Codecs whose decompression costs multi-hot rows more than LZ4 (zstd: 1.3x in MLPerf's rows, 16 readers, H200 host).
SLOW_MULTI_HOT_CODECS = {"ZSTD", "GZIP", "BROTLI"}


def _log_multi_hot_hints(loader: ParquetLoader) -> None:
    """Say so when multi-hot rows stream from files that the host decodes slower than it could: list columns
    (`python -m dlrm.data.relayout` rewrites them as slot columns) or a slow codec."""
    if "lists" in loader.layouts:
        logger.info("data: multi-hot rows stream from list columns, which the host decodes 2-3x slower than slot "
                    "columns: `python -m dlrm.data.relayout --data DIR --output NEW` rewrites the dataset in slot "
                    "columns; MLPerf DLRM-DCNv2 then trains 1.25-1.53x faster streaming "
                    "(benchmarks/results/sparse_layout_mlperf.md)")
    slow = sorted(c.lower() for c in loader.codecs & SLOW_MULTI_HOT_CODECS)
    if slow:
        logger.info(f"data: multi-hot rows stream from {'/'.join(slow)} files, whose decoding is most of the "
                    f"loader's work: LZ4 files (--compression lz4 when preprocessing, generating or relayouting) "
                    f"stream 1.1-1.4x faster (benchmarks/results/loader_layouts_final_mlperf.md)")


def make_loader(cfg: Config, files: list[Path], batch_size: int, device: torch.device, train: bool,
                env: DistEnv = DistEnv(), placement: Optional[str] = None, multi_hot_sizes: Optional[list[int]] = None,
                dense_format: str = "counts", hints: bool = True):
    """The loader `placement` (default ``data.placement``, "stream" or "gpu") asks for: streamed from
    parquet, or the whole split in device memory; in a distributed run it delivers this rank's slice
    of every global batch. `multi_hot_sizes`, `dense_format`: the dataset's (metadata.json). `hints`: a streamed
    multi-hot training loader logs how its files could stream faster (`_log_multi_hot_hints`)."""
    d = cfg.data
    ranks = dict(rank=env.rank, world_size=env.world_size, multi_hot_sizes=multi_hot_sizes, dense_format=dense_format)
    if (placement or d.placement) == "gpu":  # (on a CPU device in host memory: `TrainData.build` says so, once)
        return DeviceLoader(files, batch_size, device, shuffle=train and d.shuffle, seed=cfg.train.seed,
                            drop_last=train and d.drop_last, pad_ranks=not train, **ranks)
    if train:
        # chain_epochs: the producer decodes the next epoch's first buffers while this epoch's last
        # batches train, so an epoch boundary does not drain the pipeline (issue #19)
        loader = ParquetLoader(files, batch_size, device, shuffle=d.shuffle, seed=cfg.train.seed,
                               drop_last=d.drop_last, prefetch=d.prefetch, shuffle_buffer_rows=d.shuffle_buffer_rows,
                               chain_epochs=True, **ranks)
        if hints and is_multi_hot(multi_hot_sizes):
            _log_multi_hot_hints(loader)
        return loader
    # an evaluation sees every row (a last batch with fewer rows than ranks: padding rows, Batch.pad); buffers as set
    return ParquetLoader(files, batch_size, device, prefetch=d.prefetch, pad_ranks=True,
                         shuffle_buffer_rows=d.shuffle_buffer_rows, **ranks)


def _log_min_steps(cfg: Config, total: int, by_epochs: int, steps_per_epoch: int) -> None:
    """Say what train.min_steps made of the run's length: the steps and epochs it trains (train.max_steps may cap
    them below train.min_steps, or leave them within train.epochs)."""
    t = cfg.train
    capped = f"; train.max_steps {t.max_steps} caps it there" if total < t.min_steps else ""
    if total > by_epochs:
        # the epochs as trained: 200 steps of 66-step epochs are 3 epochs and 2 steps of a 4th ("4 epochs of 66 steps"
        # read as 264 steps)
        full, rest = divmod(total, max(steps_per_epoch, 1))
        epochs = (f"{full} epoch{'s' * (full != 1)} of {steps_per_epoch} step{'s' * (steps_per_epoch != 1)}"
                  + (f" and {rest} step{'s' * (rest != 1)} of epoch {full + 1}" if rest else ""))
        logger.info(f"train.min_steps {t.min_steps}: {counted(total, 'step')}, {epochs} "
                    f"(train.epochs {t.epochs} would give {by_epochs}){capped}")
    else:
        logger.info(f"train.min_steps {t.min_steps}: no effect, train.max_steps {t.max_steps} ends the run at "
                    f"{counted(total, 'step')}, within train.epochs {t.epochs} ({counted(by_epochs, 'step')})")


def _warn_rows_short(where: Path, meta, files: list[Path]) -> None:
    """Warn of one-hot features whose table is a row or two short of their values: ids 0..n-1 (pandas' ``cat.codes``,
    a label encoder) with -1 for missing in a table of n rows put id n-1 on row 0 with the missing values (modulus
    hashing: row ``(value + 1) mod n``): two categories merged without a word. Told from the train files' footer
    statistics of its first files (no row read): values spanning more than the table's rows, by at most 2 (a wider
    span is hashing by choice, or hashes); a feature whose values look hashed or lack statistics is dropped at once,
    so real hashes cost one footer."""
    if meta.hashing != "modulus":
        return
    cards = meta.cardinalities
    seen = {f: None for f in range(NUM_SPARSE) if meta.multi_hot_sizes[f] == 1}  # feature: (min, max) so far
    for path in files[:8]:  # a few footers tell: ids already below their table's size (MLPerf's) span it all along
        if not seen:
            return
        try:
            with pq.ParquetFile(path) as reader:  # (read fine by the loader just made)
                footer = reader.metadata
        except (OSError, pa.ArrowException):  # (changed since: the loader's own read will say so)
            return
        for g in range(footer.num_row_groups):
            rg = footer.row_group(g)
            for c in range(rg.num_columns) if rg.num_rows else ():
                name = rg.column(c).path_in_schema
                f = int(name[7:]) if name.startswith("SPARSE_") and name[7:].isdigit() else None
                if f not in seen:
                    continue
                stats = rg.column(c).statistics
                lo, hi = (stats.min, stats.max) if stats is not None and stats.has_min_max else (-2, 0)
                lo, hi = (lo, hi) if seen[f] is None else (min(lo, seen[f][0]), max(hi, seen[f][1]))
                if lo < -1 or hi - lo + 1 > cards[f] + 2:
                    del seen[f]
                else:
                    seen[f] = (lo, hi)
    short = [f for f, span in seen.items() if span is not None and span[1] - span[0] + 1 > cards[f]]
    if short:
        said = ", ".join(f"SPARSE_{f} holds {seen[f][0]}..{seen[f][1]} in {cards[f]} rows" for f in short)
        run_logger.warning(f"{where}: cardinalities: {said}: a value v takes row (v + 1) mod rows, so two of "
                           "its values share a row (merged categories); rows as many as the values' span keep them "
                           "apart (ids 0..n-1 with -1 for missing need n + 1)")


def build_for_data(cfg: Config) -> tuple[torch.device, Path, object, Tables]:
    """The device, the dataset directory, its metadata and its tables."""
    device = resolve_device(cfg.train.device)
    data_dir, meta = load_dataset_metadata(cfg)
    return device, data_dir, meta, dataset_tables(cfg, meta, data_dir)


def run_length(epochs: int, max_steps: Optional[int], min_steps: Optional[int], steps_per_epoch: int) -> int:
    """A run's length in steps: `epochs` of `steps_per_epoch`, raised to `min_steps`, capped by `max_steps` (the
    ``train`` keys of those names; a resume computes its checkpoint's run's length with it too).

    Example:
        >>> run_length(2, None, None, 703), run_length(2, 200, None, 703), run_length(1, 500, 2000, 100)
        (1406, 200, 500)
    """
    total = steps_per_epoch * epochs
    if min_steps is not None:
        total = max(total, min_steps)
    return total if max_steps is None else min(total, max_steps)


def epoch_steps(rows: int, batch_size: int, drop_last: bool, world_size: int = 1) -> int:
    """Steps an epoch of a train split of `rows` rows takes at `batch_size` (`TrainData.build`'s: its loader's batches,
    or one batch of the whole split when it is smaller than a batch; a resume computes its checkpoint's epochs so).

    Example:
        >>> epoch_steps(100, 8, True), epoch_steps(100, 8, False), epoch_steps(86, 128, True)
        (12, 13, 1)
    """
    steps = batches_per_epoch(rows, batch_size, drop_last, world_size)
    return 1 if steps == 0 and world_size <= rows < batch_size else steps


@dataclass
class TrainData:
    """The run's loaders, its effective batch size, its length in steps and the epochs that takes; `ranks`: the world
    size its epochs are counted in (`build`'s)."""

    train: object
    eval: object
    batch_size: int
    total_steps: int
    epochs: int
    ranks: int = 1

    @classmethod
    def build(cls, cfg: Config, data_dir: Path, meta, device: torch.device, env: DistEnv,
              placement: str, trained_ranks: Optional[int] = None) -> "TrainData":
        """`trained_ranks`: the world size of the checkpoint a resume continues (`dlrm.checkpoint.trained_world_size`;
        None: this run's). Its epochs are kept: on N ranks an epoch's last batch of fewer than N rows is left out, so a
        merged N-rank checkpoint resumed by one process trained that batch, which the run it continues never did (a
        step more an epoch: its position's epoch ended a batch later, the run's length and a decay's end moved)."""
        d = cfg.data
        files = split_files(data_dir, meta, "train")
        if meta.splits["train"].rows == 0:  # (its files' footers agree: `split_files`) "data.batch_size: 256 is more
            # than the 0 rows" was said of a split of empty files: a smaller batch size would not have helped
            raise DatasetError(f"{data_dir / 'metadata.json'}: splits.train: its {len(files)} file(s) hold no rows; "
                               "nothing to train on")
        batch_size = d.batch_size
        ranks = max(env.world_size, trained_ranks or 1)
        sizes = meta.multi_hot_sizes
        if placement == "gpu" and device.type != "cuda":  # (each loader made said it: two or three times a run)
            run_logger.warning("data.placement 'gpu' on a CPU device: the splits are held in host memory instead")
        # the hints once, for the loader the run trains with (a split smaller than a batch makes a second one: the
        # hint was logged twice), and by rank 0 only (every rank logged it under torchrun)
        loader = make_loader(cfg, files, batch_size, device, train=True, env=env, placement=placement,
                             multi_hot_sizes=sizes, dense_format=meta.dense_format, hints=False)
        loader.epoch_ranks = ranks
        if len(loader) == 0 and ranks <= loader.num_rows < batch_size:
            # A split smaller than one batch (the 100-line real Criteo sample holds 86 train rows): train on all
            # of it as one batch an epoch rather than refuse; said, and recorded as the summary's batch_size.
            run_logger.warning(f"data.batch_size: {batch_size} is more than the {loader.num_rows} rows of "
                               f"{data_dir}/train: training with batch {loader.num_rows} instead (one batch an epoch)")
            batch_size = loader.num_rows
            if isinstance(loader, DeviceLoader):  # the split is in memory already: a second loader held it twice
                loader.rebatch(batch_size)
            else:
                loader.close()
                loader = make_loader(cfg, files, batch_size, device, train=True, env=env, placement=placement,
                                     multi_hot_sizes=sizes, dense_format=meta.dense_format, hints=False)
                loader.epoch_ranks = ranks
        if len(loader) != epoch_steps(loader.num_rows, batch_size, d.drop_last, env.world_size):
            run_logger.info(f"data: the checkpoint's run counts its epochs on {ranks} ranks, which leave out the last "
                            f"batch of {counted(loader.num_rows % batch_size, 'row')} (fewer rows than ranks): this "
                            f"run keeps those epochs, {counted(len(loader), 'step')} each (not {len(loader) + 1})")
        if env.is_main:
            _warn_rows_short(data_dir / "metadata.json", meta, files)
        if env.is_main and is_multi_hot(sizes) and isinstance(loader, ParquetLoader):
            _log_multi_hot_hints(loader)
        t = cfg.train
        by_epochs, total = len(loader) * t.epochs, run_length(t.epochs, t.max_steps, t.min_steps, len(loader))
        raised = t.min_steps is not None and by_epochs < t.min_steps
        if raised:  # said after max_steps: "200 steps, 200 epochs" was logged of a --max-steps 5 run, which trained 5
            _log_min_steps(cfg, total, by_epochs, len(loader))
        elif t.max_steps is not None and 0 < total < t.max_steps:  # a --max-steps 20 run trained 2 steps without a word
            logger.info(f"train.max_steps {t.max_steps}: no effect, train.epochs {t.epochs} ends the run at "
                        f"{counted(total, 'step')} ({counted(len(loader), 'step')} an epoch; --epochs for a longer run)")
        if total == 0:
            raise ConfigError(f"data.batch_size: {batch_size} is more than the {loader.num_rows} rows of {data_dir}/train")
        eval_files = split_files(data_dir, meta, d.eval_split, check_positives=True)  # (one class: no AUC)
        check_apart(data_dir, meta, files, d.eval_split, eval_files)
        eval_loader = make_loader(cfg, eval_files, d.eval_batch_size or 4 * d.batch_size, device, train=False, env=env,
                                  placement=placement, multi_hot_sizes=sizes, dense_format=meta.dense_format)
        return cls(loader, eval_loader, batch_size, total, max(cfg.train.epochs, math.ceil(total / max(len(loader), 1))),
                   ranks)

    def say_unknown_ranks(self, drop_last: bool, source: str) -> None:
        """Say, where it matters, that the checkpoint `source` a resume continues records no world size (written before
        checkpoints recorded it): its epochs are taken as this run's, which a merged checkpoint of more ranks than the
        rows of an epoch's last batch did not have (they left that batch out)."""
        rows, steps = self.train.num_rows, len(self.train)
        rest = rows % self.batch_size
        if steps != epoch_steps(rows, self.batch_size, drop_last, max(rows, 1)):  # (more ranks than rows: any rest)
            run_logger.info(f"--resume {source}: the checkpoint records no world size (written before checkpoints "
                            f"recorded it), so its epochs are taken as this run's, {counted(steps, 'step')} each; "
                            f"merged from a run of more than {counted(rest, 'rank')}, which left out the last batch of "
                            f"{counted(rest, 'row')}, it counted {steps - 1}")
