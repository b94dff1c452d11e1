"""torch.profiler into TensorBoard: one `step()` per training step, gzipped Chrome traces in the run dir.

View with `tensorboard --logdir tb_logs` (PyTorch Profiler tab, from the `profile` extra) or open
the `*.pt.trace.json.gz` file in https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import torch
from loguru import logger
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from dlrm.config import ProfileConfig


def make_profiler(cfg: ProfileConfig, run_dir: Path, device: torch.device):
    """A started-on-enter profiler writing into `run_dir`, or a null context when disabled."""
    if not cfg.enabled:
        return contextlib.nullcontext(None)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    logger.info(
        f"profiling: wait {cfg.wait}, warmup {cfg.warmup}, active {cfg.active}, repeat {cfg.repeat} steps; "
        f"traces go to {run_dir}"
    )
    return profile(
        activities=activities,
        schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
        on_trace_ready=tensorboard_trace_handler(str(run_dir), use_gzip=True),
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
        with_stack=cfg.with_stack,
    )


def top_ops_table(prof, device: torch.device, rows: int = 15) -> Optional[str]:
    """The operators and kernels that took the most device time (CPU time on a CPU run)."""
    if prof is None:
        return None
    try:
        averages = prof.key_averages()
    except (AssertionError, RuntimeError):  # no active window completed (run shorter than the schedule)
        return None
    if not len(averages):
        return None
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return averages.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)


def trace_files(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).glob("*.pt.trace.json.gz"))
