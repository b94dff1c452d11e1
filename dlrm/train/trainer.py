"""The training loop, readable top to bottom: build, train with periodic eval, summarize."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Optional

import torch
from loguru import logger
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from dlrm.config import Config
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import write_json_atomic
from dlrm.model.dlrm import build_loss, build_model
from dlrm.train.metrics import evaluate_logits
from dlrm.train.optim import build_optimizers, build_schedulers
from dlrm.train.profiling import make_profiler, top_ops_table
from dlrm.train.setup import dataset_tables, load_dataset_metadata, make_run_dir, resolve_device, seed_everything
from dlrm.train.step import EvalForward, TrainStep, compile_counters

WARMUP_STEPS = 3
"""Steps timed apart as warm-up (compilation, autotuning, allocator growth) before throughput windows."""


def evaluate(forward: EvalForward, loader: ParquetLoader) -> dict[str, float]:
    """AUC, logloss and accuracy over the whole split (logits gathered on the device, one sync)."""
    forward.model.eval()
    logits, labels = [], []
    for batch in loader:
        logits.append(forward(batch))
        labels.append(batch.labels)
    forward.model.train()
    return evaluate_logits(torch.cat(logits), torch.cat(labels))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: Config, run_dir: Optional[Path] = None) -> dict:
    """Train a DLRM as `cfg` says; returns the summary also written to summary.json."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.train.device)
    data_dir, meta = load_dataset_metadata(cfg)
    tables = dataset_tables(cfg, meta, data_dir)
    seed_everything(cfg.train.seed, cfg.train.deterministic)

    d = cfg.data
    eval_batch_size = d.eval_batch_size or 4 * d.batch_size
    train_loader = ParquetLoader(
        split_files(data_dir, meta, "train"), d.batch_size, device, shuffle=d.shuffle, seed=cfg.train.seed,
        drop_last=d.drop_last, prefetch=d.prefetch, shuffle_buffer_rows=d.shuffle_buffer_rows,
    )
    eval_loader = ParquetLoader(split_files(data_dir, meta, d.eval_split), eval_batch_size, device, prefetch=d.prefetch)
    total_steps = len(train_loader) * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    if total_steps == 0:
        raise ValueError(f"{data_dir}: the train split has {train_loader.num_rows} rows, fewer than one batch of {d.batch_size}")

    model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, device)
    optimizers = build_optimizers(model, cfg.optim)
    schedulers = build_schedulers(optimizers, cfg.optim.schedule, total_steps)
    if cfg.train.compile.enabled:
        c = cfg.train.compile
        logger.info(f"torch.compile: mode {c.mode}, fullgraph {c.fullgraph}")
    train_step = TrainStep(model, build_loss(cfg.kernels), optimizers, cfg.train.precision, device, cfg.train.compile)
    eval_forward = EvalForward(model, cfg.train.precision, device, cfg.train.compile, eval_batch_size)
    logger.info(
        f"device {device}, precision {cfg.train.precision}, {sum(p.numel() for p in model.parameters()):,} parameters "
        f"({sum(tables.cardinalities):,} embedding rows, hashing {tables.hashing}), "
        f"{train_loader.num_rows:,} train rows, {len(train_loader)} steps/epoch, {total_steps} steps"
    )

    run_dir = make_run_dir(cfg) if run_dir is None else run_dir
    writer = SummaryWriter(str(run_dir))
    counters_before = compile_counters()
    step, samples, loss_steps = 0, 0, 0
    loss_sum = torch.zeros((), device=device)  # accumulated on the device; read at log steps only
    losses: list[tuple[int, float]] = []
    window_rates: list[float] = []
    warmup_s = float("nan")
    loop_start = window_start = time.perf_counter()
    window_samples = 0
    bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
    with make_profiler(cfg.profile, run_dir, device) as prof:
        for epoch in range(cfg.train.epochs):
            if step >= total_steps:
                break
            train_loader.set_epoch(epoch)
            batches = iter(train_loader)
            while step < total_steps:
                with record_function("data"):
                    batch = next(batches, None)
                if batch is None:
                    break
                loss_sum += train_step(batch)
                for sched in schedulers:
                    sched.step()
                step += 1
                loss_steps += 1
                samples += len(batch)
                window_samples += len(batch)
                bar.update(1)
                if prof is not None:
                    prof.step()

                if step == WARMUP_STEPS:
                    synchronize(device)  # intended sync, once: separates warm-up from steady state
                    window_start = time.perf_counter()
                    warmup_s, window_samples = window_start - loop_start, 0
                if step % cfg.train.log_every == 0 or step == total_steps:
                    mean_loss = loss_sum.item() / loss_steps  # intended host sync: logging interval
                    loss_sum.zero_()
                    loss_steps = 0
                    losses.append((step, mean_loss))
                    now = time.perf_counter()
                    if step > WARMUP_STEPS and window_samples:
                        window_rates.append(window_samples / (now - window_start))
                    window_start, window_samples = now, 0
                    writer.add_scalar("train/loss", mean_loss, step)
                    writer.add_scalar("train/lr_dense", optimizers[0].param_groups[0]["lr"], step)
                    writer.add_scalar("train/lr_sparse", optimizers[1].param_groups[0]["lr"], step)
                    if window_rates:
                        writer.add_scalar("train/samples_per_sec", window_rates[-1], step)
                        bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{window_rates[-1]:,.0f}")
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total_steps:
                    log_eval(writer, evaluate(eval_forward, eval_loader), step)
            batches.close()  # stops the loader's thread when max_steps ends an epoch early
    bar.close()
    train_s = time.perf_counter() - loop_start

    metrics = log_eval(writer, evaluate(eval_forward, eval_loader), step)
    counters = {k: v - counters_before[k] for k, v in compile_counters().items()}
    if cfg.train.compile.enabled:
        logger.info(f"torch.compile: {counters['graphs']} graphs compiled, {counters['graph_breaks']} graph breaks")
    ops = top_ops_table(prof, device)
    if ops is not None:
        logger.info("top operators by " + ("device" if device.type == "cuda" else "CPU") + " time:\n" + ops)
        writer.add_text("profile/top_ops", "```\n" + ops + "\n```", step)
    samples_per_sec = statistics.median(window_rates) if window_rates else samples / train_s
    summary = {
        **metrics,
        "split": d.eval_split,
        "steps": step,
        "samples": samples,
        "samples_per_sec": samples_per_sec,
        "warmup_s": warmup_s,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "final_train_loss": losses[-1][1] if losses else None,
        "train_losses": losses,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "compile": counters,
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
        + f"; {step} steps, {samples:,} samples, {samples_per_sec:,.0f} samples/s, {summary['wall_s']:.1f}s"
    )
    return summary


def log_eval(writer: SummaryWriter, metrics: dict[str, float], step: int) -> dict[str, float]:
    for k, v in metrics.items():
        writer.add_scalar(f"eval/{k}", v, step)
    logger.info(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
