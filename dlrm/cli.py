"""Command line: `python train.py --config PATH [overrides]` (click)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from loguru import logger

from dlrm.config import ConfigError, load_config
from dlrm.data.schema import DatasetError
from kernels import TritonUnavailableError


def _configure_logging() -> None:
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")


def cli_overrides(*, data, device, batch_size, epochs, max_steps, seed, run_name, tb_dir, checkpoint_every, split,
                  compile_, compile_mode, profile, kernels) -> dict:
    """Dotted config keys set on the command line (options left out are absent)."""
    overrides = {
        "data.path": data,
        "train.device": device,
        "data.batch_size": batch_size,
        "train.epochs": epochs,
        "train.max_steps": max_steps,
        "train.seed": seed,
        "log.run_name": run_name,
        "log.tb_dir": tb_dir,
        "checkpoint.every": checkpoint_every,
        "data.eval_split": split,
    }
    if compile_mode is not None:
        if compile_ is False:
            raise ConfigError(f"--compile-mode {compile_mode} contradicts --no-compile")
        overrides["train.compile.enabled"] = True
        overrides["train.compile.mode"] = compile_mode
    elif compile_ is not None:
        overrides["train.compile.enabled"] = compile_
    if profile:
        overrides["profile.enabled"] = True
    if kernels is not None:
        overrides.update({f"kernels.{k}": kernels for k in ("embedding", "interaction", "mlp", "loss")})
    return {k: v for k, v in overrides.items() if v is not None}


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
@click.option("--compile-mode", type=click.Choice(["default", "reduce-overhead", "max-autotune"]), default=None,
              help="Compile with this torch.compile mode (reduce-overhead: CUDA graphs); implies --compile.")
@click.option("--profile", is_flag=True, default=None, help="Profile a few steps into TensorBoard (overrides profile.enabled).")
@click.option("--compare", type=str, help="Comma-separated variants to train side by side: eager, compiled, "
              "compiled-cudagraphs, triton, triton+compiled, triton+cudagraphs, triton-embedding+cudagraphs, "
              "triton-embedding-interaction+cudagraphs.")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints (overrides checkpoint.every).")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Continue the run named by --run-name from its latest checkpoint, or from PATH.")
@click.option("--eval-only", is_flag=True, help="Only evaluate --checkpoint on --split.")
@click.option("--checkpoint", "checkpoint_path", type=str, help="Checkpoint for --eval-only or --export.")
@click.option("--split", type=click.Choice(["validation", "test"]), default=None, help="Split for --eval-only.")
@click.option("--export", "export_path", type=str,
              help="Write a torch.export inference program (raw inputs, hashing included) here: from --checkpoint, "
                   "or from the model at the end of training.")
def main(config_path, data, device, batch_size, epochs, max_steps, seed, run_name, tb_dir, kernels, compile_,
         compile_mode, profile, compare, checkpoint_every, resume, eval_only, checkpoint_path, split, export_path) -> None:
    """Train a DLRM on a Criteo-format parquet dataset."""
    _configure_logging()
    try:
        overrides = cli_overrides(data=data, device=device, batch_size=batch_size, epochs=epochs, max_steps=max_steps,
                                  seed=seed, run_name=run_name, tb_dir=tb_dir, checkpoint_every=checkpoint_every,
                                  split=split, compile_=compile_, compile_mode=compile_mode, profile=profile,
                                  kernels=kernels)
    except ConfigError as e:
        logger.error(str(e))
        sys.exit(2)
    try:
        cfg = load_config(config_path, overrides)
        # imported late: --help and config errors stay fast
        from dlrm.train import export as export_mod
        from dlrm.train.trainer import NonFiniteLoss, TrainingStopped, train

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (eval_only or export_path):
            raise ConfigError("--eval-only and --export run in one process (not under torchrun): merge a sharded "
                              "checkpoint first with python -m dlrm.distributed.merge CHECKPOINT OUT")
        if export_path and Path(export_path).exists():
            raise ConfigError(f"--export: {export_path} already exists; remove it or choose another path")
        if eval_only or (export_path and checkpoint_path):
            if not checkpoint_path:
                raise ConfigError("--eval-only: needs --checkpoint PATH")
            if eval_only:
                export_mod.evaluate_checkpoint(cfg, Path(checkpoint_path), cfg.data.eval_split)
            if export_path:
                export_mod.export_checkpoint(cfg, Path(checkpoint_path), Path(export_path))
        elif compare is not None:
            from dlrm.train.compare import parse_variants, run_comparison

            run_comparison(cfg, parse_variants(compare), train)
        else:
            summary = train(cfg, resume=resume)
            if export_path:
                export_mod.export_checkpoint(cfg, Path(summary["checkpoint"]), Path(export_path))
    except (ConfigError, DatasetError, TritonUnavailableError) as e:
        logger.error(str(e))
        sys.exit(2)
    except NonFiniteLoss as e:
        logger.error(str(e))
        sys.exit(3)
    except TrainingStopped as e:
        logger.warning(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        logger.error("interrupted")
        sys.exit(130)
    finally:
        # Leave a torchrun process group, if this run joined one (without importing torch on the
        # config-error path, which stays fast).
        if "dlrm.distributed.env" in sys.modules:
            sys.modules["dlrm.distributed.env"].shutdown()
