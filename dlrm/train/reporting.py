"""What a run reports: TensorBoard scalars and hparams, summary.json, and the final log line."""

from __future__ import annotations

import platform
import sys
from typing import Any, Optional

import torch
from loguru import logger
from torch.utils.tensorboard import SummaryWriter

from dlrm.config import Config


class NoWriter:
    """Stands in for the SummaryWriter on ranks other than 0 (they write no run files)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def versions() -> dict[str, str]:
    """Library versions recorded in summary.json, so numbers can be traced to what produced them."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "absent"
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def log_train(writer: SummaryWriter, step: int, loss: float, optimizers, samples_per_sec: Optional[float],
              data_wait_fraction: Optional[float] = None) -> None:
    """The logging interval's scalars: loss, learning rates, throughput, data wait."""
    writer.add_scalar("train/loss", loss, step)
    # float(): a device-tensor lr (train.cuda_graph) is read here, at the logging interval
    writer.add_scalar("train/lr_dense", float(optimizers[0].param_groups[0]["lr"]), step)
    writer.add_scalar("train/lr_sparse", float(optimizers[1].param_groups[0]["lr"]), step)
    if samples_per_sec is not None:
        writer.add_scalar("train/samples_per_sec", samples_per_sec, step)
    if data_wait_fraction is not None:
        writer.add_scalar("train/data_wait_fraction", data_wait_fraction, step)


def log_eval(writer: SummaryWriter, metrics: dict[str, float], step: int) -> dict[str, float]:
    for k, v in metrics.items():
        writer.add_scalar(f"eval/{k}", v, step)
    logger.info(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def log_hparams(writer: SummaryWriter, cfg: Config, batch_size: int, metrics: dict[str, float]) -> None:
    writer.add_hparams(
        {"batch_size": batch_size, "embedding_dim": cfg.model.embedding_dim, "dense_lr": cfg.optim.dense.lr,
         "sparse_lr": cfg.optim.sparse.lr, "precision": cfg.train.precision, "interaction": cfg.model.interaction},
        {"hparam/auc": metrics["auc"], "hparam/logloss": metrics["logloss"], "hparam/accuracy": metrics["accuracy"]},
        run_name="hparams",
    )


def final_line(summary: dict[str, Any]) -> str:
    """The one line that ends a run: the metrics, the oracle when known, the run's totals."""
    return (
        f"{summary['split']}: AUC {summary['auc']:.4f}, logloss {summary['logloss']:.4f}, "
        f"accuracy {summary['accuracy']:.4f}"
        + (f" (oracle AUC {summary['oracle_auc']:.4f})" if summary.get("oracle_auc") is not None else "")
        + f"; {summary['steps']} steps, {summary['samples']:,} samples, {summary['samples_per_sec']:,.0f} samples/s"
        + (f" (waiting for data {summary['data_wait_fraction']:.0%} of the time)"
           if summary.get("data_wait_fraction") is not None else "")
        + f", {summary['wall_s']:.1f}s"
        + _best_clause(summary)
    )


def _best_clause(summary: dict[str, Any]) -> str:
    best = summary.get("best")
    if not best or best.get("step") == summary["steps"]:
        return ""
    return (f"; best {best['metric']} {best[best['metric']]:.4f} at step {best['step']}"
            + (" (early stopped)" if summary.get("early_stopped") else "") + f", kept as {best.get('checkpoint')}")
