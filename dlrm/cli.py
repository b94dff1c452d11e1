"""Command line: `python train.py --config PATH [overrides]` (click)."""

from __future__ import annotations

import sys

import click
from loguru import logger

from dlrm.config import ConfigError, load_config
from dlrm.data.schema import DatasetError
from kernels import TritonUnavailableError


def _configure_logging() -> None:
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("--data", type=str, help="Dataset directory (overrides data.path).")
@click.option("--device", type=str, help="auto | cpu | cuda (overrides train.device).")
@click.option("--batch-size", type=int, help="Overrides data.batch_size.")
@click.option("--epochs", type=int, help="Overrides train.epochs.")
@click.option("--max-steps", type=int, help="Overrides train.max_steps.")
@click.option("--seed", type=int, help="Overrides train.seed.")
@click.option("--run-name", type=str, help="Run directory name under the TensorBoard root (overrides log.run_name).")
@click.option("--tb-dir", type=str, help="TensorBoard root directory (overrides log.tb_dir).")
@click.option("--kernels", type=str, help="torch | triton: every component at once (overrides kernels.*).")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile on or off (overrides train.compile).")
@click.option("--profile", is_flag=True, default=None, help="Profile a few steps into TensorBoard (overrides profile.enabled).")
@click.option("--compare", type=str, help="Comma-separated variants to train side by side: "
              "eager,compiled,compiled-cudagraphs,triton,triton+compiled.")
def main(config_path, data, device, batch_size, epochs, max_steps, seed, run_name, tb_dir, kernels, compile_, profile,
         compare) -> None:
    """Train a DLRM on a Criteo-format parquet dataset."""
    _configure_logging()
    overrides = {
        "data.path": data,
        "train.device": device,
        "data.batch_size": batch_size,
        "train.epochs": epochs,
        "train.max_steps": max_steps,
        "train.seed": seed,
        "log.run_name": run_name,
        "log.tb_dir": tb_dir,
    }
    if compile_ is not None:
        overrides["train.compile.enabled"] = compile_
    if profile:
        overrides["profile.enabled"] = True
    if kernels is not None:
        overrides.update({f"kernels.{k}": kernels for k in ("embedding", "interaction", "mlp", "loss")})
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        cfg = load_config(config_path, overrides)
        from dlrm.train.trainer import train  # imported late: --help and config errors stay fast

        if compare is not None:
            from dlrm.train.compare import parse_variants, run_comparison

            run_comparison(cfg, parse_variants(compare), train)
        else:
            train(cfg)
    except (ConfigError, DatasetError, TritonUnavailableError) as e:
        logger.error(str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        logger.error("interrupted")
        sys.exit(130)
