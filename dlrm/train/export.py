"""Evaluate a checkpoint, and export an inference artifact that takes raw Criteo values."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from dlrm.config import Config, ConfigError, KernelsConfig
from dlrm.data.loader import ParquetLoader, split_files, transform_dense
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE, write_json_atomic
from dlrm.model.dlrm import DLRM, build_model
from dlrm import checkpoint as ckpt
from dlrm.train.fast_path import resolve_fast_path
from dlrm.train.run_dir import RunDirectory


def model_from_checkpoint(cfg: Config, path: Path, tables, device: torch.device, portable: bool = False) -> DLRM:
    """The model stored in `path`, built as training resolved it (kernels, and with them the tables'
    storage: bf16 tables need the Triton embedding) or, `portable`, from PyTorch modules only (fp32
    tables: an exported program must not need this package's Triton ops)."""
    state = ckpt.load_checkpoint(path)
    if portable:
        cfg = copy.deepcopy(cfg)
        cfg.kernels = KernelsConfig("torch", "torch", "torch", "torch")
        cfg.model.embedding_dtype = "fp32"
    else:
        cfg, _ = resolve_fast_path(cfg, device, multi_hot=tables.multi_hot)
    model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, device,
                        multi_hot_sizes=tables.multi_hot_sizes)
    ckpt.check_compatible(state, model, tables.cardinalities, cfg.to_dict()["model"], path, tables.multi_hot_sizes)
    model.load_state_dict(state["model"])
    return model.eval()


def evaluate_checkpoint(cfg: Config, path: Path, split: str) -> dict:
    """AUC, logloss and accuracy of a checkpoint on `split`; written to a new run's summary.json."""
    from dlrm.train.step import EvalForward, set_matmul_precision
    from dlrm.train.trainer import build_for_data, evaluate

    device, data_dir, meta, tables = build_for_data(cfg)
    model = model_from_checkpoint(cfg, Path(path), tables, device)
    batch_size = cfg.data.eval_batch_size or 4 * cfg.data.batch_size
    loader = ParquetLoader(split_files(data_dir, meta, split), batch_size, device, prefetch=cfg.data.prefetch,
                           multi_hot_sizes=meta.multi_hot_sizes)
    with RunDirectory.create(cfg) as run_dir:  # removed again if the evaluation fails
        t0 = time.perf_counter()
        set_matmul_precision(cfg.train.precision)
        metrics = evaluate(EvalForward(model, cfg.train.precision, device, cfg.train.compile, batch_size), loader)
        summary = {**metrics, "split": split, "checkpoint": str(path), "rows": loader.num_rows,
                   "wall_s": time.perf_counter() - t0, "device": str(device), "config": cfg.to_dict()}
        write_json_atomic(run_dir.path / "summary.json", summary)
        run_dir.started()
    logger.info(f"{split}: AUC {metrics['auc']:.4f}, logloss {metrics['logloss']:.4f}, accuracy {metrics['accuracy']:.4f}")
    return summary


class RawInputDLRM(nn.Module):
    """Inference wrapper: raw dense counts and raw sparse hash values in, click probabilities out.

    Args:
        model: a trained DLRM (its hashing buffers do the raw-value-to-row mapping).

    Shapes: int64 [B, 13] counts (missing as 0), int64 [B, 26] raw hashes (missing as -1) -> float32 [B].
    The exported program checks its inputs' dtypes: int32 hashes (which would wrap values >= 2**31)
    are refused, not converted.
    """

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense_counts: torch.Tensor, sparse_raw: torch.Tensor) -> torch.Tensor:
        # A runtime check that stays in the exported graph: int32 hashes would have wrapped values >= 2**31.
        torch.ops.aten._assert_tensor_metadata(sparse_raw, dtype=torch.int64)
        torch.ops.aten._assert_tensor_metadata(dense_counts, dtype=torch.int64)
        return torch.sigmoid(self.model(transform_dense(dense_counts), sparse_raw).float())


def _sparse_width(model: DLRM) -> int:
    """Columns of the raw sparse input: one per feature, or one per multi-hot slot."""
    return getattr(model.sparse_arch, "num_slots", NUM_SPARSE)


def export_model(model: DLRM, path: Path) -> Path:
    """Write a `torch.export` program (batch size dynamic) to `path` (conventionally *.pt2)."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"--export: {path} already exists; remove it or choose another path")
    if not path.parent.is_dir():
        raise ConfigError(f"--export: directory {path.parent} does not exist")
    device = next(model.parameters()).device
    wrapper = RawInputDLRM(model).eval()
    example = (
        torch.zeros(4, NUM_DENSE, dtype=torch.int64, device=device),
        torch.zeros(4, _sparse_width(model), dtype=torch.int64, device=device),
    )
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(wrapper, example, dynamic_shapes=({0: batch}, {0: batch}))
    tmp = path.with_name(f".tmp-{path.name}")  # torch.export.save wants a name ending in .pt2
    torch.export.save(program, str(tmp))
    tmp.replace(path)
    logger.info(f"exported inference program to {path} (inputs: raw dense counts [B, 13], raw sparse hashes "
                f"[B, {_sparse_width(model)}])")
    return path


def export_checkpoint(cfg: Config, checkpoint: Path, path: Path) -> Path:
    """Export the model stored in `checkpoint` (see `export_model`)."""
    from dlrm.train.trainer import build_for_data

    device, _, _, tables = build_for_data(cfg)
    return export_model(model_from_checkpoint(cfg, checkpoint, tables, device, portable=True), path)
