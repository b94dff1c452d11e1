"""The training loop, readable top to bottom: build, train with periodic eval, summarize."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F_
from loguru import logger
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from dlrm.config import Config
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import write_json_atomic
from dlrm.model.dlrm import DLRM, build_model
from dlrm.train.metrics import evaluate_logits
from dlrm.train.optim import build_optimizers, build_schedulers
from dlrm.train.setup import dataset_tables, load_dataset_metadata, make_run_dir, resolve_device, seed_everything


def autocast_context(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: DLRM, loader: ParquetLoader, device: torch.device, precision: str) -> dict[str, float]:
    """AUC, logloss and accuracy over the whole split (logits gathered on the device, one sync)."""
    model.eval()
    logits, labels = [], []
    for batch in loader:
        with autocast_context(device, precision):
            logits.append(model(batch.dense, batch.sparse).float())
        labels.append(batch.labels)
    model.train()
    return evaluate_logits(torch.cat(logits), torch.cat(labels))


def train(cfg: Config) -> dict:
    """Train a DLRM as `cfg` says; returns the summary also written to summary.json."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.train.device)
    data_dir, meta = load_dataset_metadata(cfg)
    tables = dataset_tables(cfg, meta, data_dir)
    seed_everything(cfg.train.seed, cfg.train.deterministic)

    d = cfg.data
    train_loader = ParquetLoader(
        split_files(data_dir, meta, "train"), d.batch_size, device, shuffle=d.shuffle, seed=cfg.train.seed,
        drop_last=d.drop_last, prefetch=d.prefetch, shuffle_buffer_rows=d.shuffle_buffer_rows,
    )
    eval_loader = ParquetLoader(
        split_files(data_dir, meta, d.eval_split), d.eval_batch_size or 4 * d.batch_size, device, prefetch=d.prefetch
    )
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    if total_steps == 0:
        raise ValueError(f"{data_dir}: the train split has {train_loader.num_rows} rows, fewer than one batch of {d.batch_size}")

    model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, device)
    optimizers = build_optimizers(model, cfg.optim)
    schedulers = build_schedulers(optimizers, cfg.optim.schedule, total_steps)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        f"device {device}, precision {cfg.train.precision}, {n_params:,} parameters "
        f"({sum(tables.cardinalities):,} embedding rows, hashing {tables.hashing}), "
        f"{train_loader.num_rows:,} train rows, {steps_per_epoch} steps/epoch, {total_steps} steps"
    )

    run_dir = make_run_dir(cfg)
    writer = SummaryWriter(str(run_dir))
    log_every, eval_every = cfg.train.log_every, cfg.train.eval_every
    step, samples = 0, 0
    loss_sum = torch.zeros((), device=device)  # accumulated on the device; read at log steps only
    loss_steps = 0
    window_start, window_samples = time.perf_counter(), 0
    samples_per_sec = float("nan")
    metrics: dict[str, float] = {}
    bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
    for epoch in range(cfg.train.epochs):
        train_loader.set_epoch(epoch)
        for batch in train_loader:
            with autocast_context(device, cfg.train.precision):
                logits = model(batch.dense, batch.sparse)
            loss = F_.binary_cross_entropy_with_logits(logits.float(), batch.labels)
            loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in schedulers:
                sched.step()
            loss_sum += loss.detach()
            loss_steps += 1
            step += 1
            samples += len(batch)
            window_samples += len(batch)
            bar.update(1)

            if step % log_every == 0 or step == total_steps:
                mean_loss = loss_sum.item() / loss_steps  # intended host sync: logging interval
                loss_sum.zero_()
                loss_steps = 0
                now = time.perf_counter()
                samples_per_sec = window_samples / (now - window_start)
                window_start, window_samples = now, 0
                writer.add_scalar("train/loss", mean_loss, step)
                writer.add_scalar("train/lr_dense", optimizers[0].param_groups[0]["lr"], step)
                writer.add_scalar("train/lr_sparse", optimizers[1].param_groups[0]["lr"], step)
                writer.add_scalar("train/samples_per_sec", samples_per_sec, step)
                bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{samples_per_sec:,.0f}")
            if eval_every and step % eval_every == 0 and step != total_steps:
                metrics = log_eval(writer, evaluate(model, eval_loader, device, cfg.train.precision), step)
            if step >= total_steps:
                break
        if step >= total_steps:
            break
    bar.close()

    metrics = log_eval(writer, evaluate(model, eval_loader, device, cfg.train.precision), step)
    wall_s = time.perf_counter() - t_start
    summary = {
        **metrics,
        "split": d.eval_split,
        "steps": step,
        "samples": samples,
        "samples_per_sec": samples_per_sec,
        "wall_s": wall_s,
        "device": str(device),
        "oracle_auc": meta.extra.get("oracle_auc", {}).get(d.eval_split),
        "run_dir": str(run_dir),
        "config": cfg.to_dict(),
    }
    writer.add_hparams(
        {"batch_size": d.batch_size, "embedding_dim": cfg.model.embedding_dim, "dense_lr": cfg.optim.dense.lr,
         "sparse_lr": cfg.optim.sparse.lr, "precision": cfg.train.precision, "interaction": cfg.model.interaction},
        {"hparam/auc": metrics["auc"], "hparam/logloss": metrics["logloss"], "hparam/accuracy": metrics["accuracy"]},
        run_name="hparams",
    )
    writer.close()
    write_json_atomic(Path(run_dir) / "summary.json", summary)
    logger.info(
        f"{d.eval_split}: AUC {metrics['auc']:.4f}, logloss {metrics['logloss']:.4f}, accuracy {metrics['accuracy']:.4f}"
        + (f" (oracle AUC {summary['oracle_auc']:.4f})" if summary["oracle_auc"] is not None else "")
        + f"; {step} steps, {samples:,} samples in {wall_s:.1f}s"
    )
    return summary


def log_eval(writer: SummaryWriter, metrics: dict[str, float], step: int) -> dict[str, float]:
    for k, v in metrics.items():
        writer.add_scalar(f"eval/{k}", v, step)
    logger.info(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
