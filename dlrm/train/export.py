"""Evaluate a checkpoint, and export an inference artifact that takes raw Criteo values (the dense
features as the dataset stores them: counts, or float values)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from dlrm.config import Config, ConfigError, KernelsConfig
from dlrm.config_checks import export_name_problem
from dlrm.data.loader import ParquetLoader, split_files, transform_dense
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.distributed.checkpoint import shard_refusal
from dlrm.model.dlrm import DLRM, build_model
from dlrm.errors import TrainingStopped
from dlrm.mapped_load import check_unchanged, reading
from dlrm.stop_signal import (EXIT_INTERRUPTED, raise_pending, signal_stop_inside, signals_deferred,
                               stop_signal_name)
from dlrm import checkpoint as ckpt
from dlrm.train.fast_path import resolve_fast_path
from dlrm.train.checkpointer import checkpoint_step
from dlrm.train.reporting import eval_scalars, open_writer, tables_record, write_summary
from dlrm.train.run_dir import RunDirectory
from dlrm.train.setup import as_trained


def model_from_checkpoint(cfg: Config, path: Path, tables, device: torch.device, portable: bool = False) -> DLRM:
    """The model stored in `path`, built as training resolved it (kernels, and with them the tables'
    storage: bf16 tables need the Triton embedding) or, `portable`, from PyTorch modules only (fp32
    tables: an exported program must not need this package's Triton ops)."""
    return _built_from_checkpoint(cfg, path, tables, device, portable)[0]


def _built_from_checkpoint(cfg: Config, path: Path, tables, device: torch.device,
                           portable: bool = False) -> tuple[DLRM, Config]:
    """`model_from_checkpoint`'s model and the config it was built from (its "auto" settings resolved)."""
    if device.type == "cpu":  # the model in the host's memory, the file mapped beside it: weighed before either
        from dlrm.train import builder
        from dlrm.train.checkpoint_memory import refuse_checkpoint_shortfall

        refuse_checkpoint_shortfall(cfg, tables, Path(path), portable, builder._host_memory())
    # (before the mapping: a cp over it while the model is built and loaded is seen; truncated, its pages past the
    # end read: a one-line error, not SIGBUS)
    with reading([path]) as stamps:
        state = ckpt.load_checkpoint(path, mmap=True, read="model")  # (the optimizers' state is never read)
        if "rank" in state:  # one rank's shard: its table rows were refused as "sparse_arch.weight has shape (299,
            # 4) in the checkpoint, (598, 4) here", which reads as other data or another config, not as a shard
            raise ConfigError(shard_refusal(Path(path), state, lambda manifest: "merge its manifest for one process "
                                            f"first: python -m dlrm.distributed.merge {manifest} OUT.pt"))
        if portable:
            cfg = copy.deepcopy(cfg)
            cfg.kernels = KernelsConfig("torch", "torch", "torch", "torch")
            cfg.model.embedding_dtype = "fp32"
        else:
            cfg, _ = resolve_fast_path(cfg, device, multi_hot=tables.multi_hot)
        # an export's PyTorch copy is not logged as "kernels: embedding=torch, ...": after a training run with Triton
        # kernels (`--export` after training), that line ended the log as if the run had trained with the PyTorch ones
        model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, device,
                            multi_hot_sizes=tables.multi_hot_sizes, log_kernels=not portable)
        ckpt.check_compatible(state, model, tables.cardinalities, cfg.to_dict()["model"], path, tables.multi_hot_sizes,
                              tables.dense_format, tables.hashing, tables.vocabs)
        _check_no_rounding(state["model"], model, path, cfg.model.embedding_dtype)
        model.load_state_dict(state["model"])
        check_unchanged(stamps)
    return model.eval(), cfg


def _check_no_rounding(saved: dict, model: DLRM, path: Path, embedding_dtype: str) -> None:
    """Refuse a checkpoint whose floating tensors the model would store narrower (fp32 tables in a bf16-table model
    built from this config): `load_state_dict` rounds them silently, and `--eval-only` reported that other model's
    AUC as the checkpoint's. bf16 tables loading into fp32 ones (how they evaluate on a CPU) are exact."""
    for key, own in model.state_dict().items():
        value = saved.get(key)  # (a missing key: load_state_dict names it)
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and own.is_floating_point()
                and torch.finfo(own.dtype).bits < torch.finfo(value.dtype).bits):
            held = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(value.dtype, str(value.dtype))
            raise ConfigError(f"{path}: model.embedding_dtype differs: the checkpoint holds {key} in {held}, this "
                              f"config's {embedding_dtype!r} would round it to {own.dtype} (set model.embedding_dtype "
                              f'"{held}")')


def evaluate_checkpoint(cfg: Config, path: Path, split: str) -> dict:
    """AUC, logloss and accuracy of a checkpoint on `split`; written to a new run's summary.json.

    A SIGTERM or Ctrl-C before the summary is written stops it as `TrainingStopped` (128 + the signal) whose line says
    the evaluation was stopped, by which signal, and that nothing was written (its new run directory is removed): the
    log said "the run failed before its first step", then "outside the training steps (no checkpoint written now)"
    or "interrupted (Ctrl-C)", which speak of a training run."""
    from dlrm.train.metric_text import auc_text

    try:
        summary = _evaluated(cfg, path, split)
    except (TrainingStopped, KeyboardInterrupt) as e:  # (a second signal's SystemExit passes: it stops at once)
        raise TrainingStopped(getattr(e, "exit_code", EXIT_INTERRUPTED),
                              f"--eval-only: {stop_signal_name(e)} stopped the evaluation of {path}; nothing written"
                              ) from None
    metrics, step = summary, summary["step"]
    # which model: given a run directory, its best.pt or its newest checkpoint was evaluated, and the line said neither
    of = f"{path}" + (f", step {step}" if step is not None else "")
    oracle = f" (oracle AUC {summary['oracle_auc']:.4f})" if summary["oracle_auc"] is not None else ""
    logger.info(f"{split}: AUC {auc_text(metrics)}, logloss {metrics['logloss']:.4f}, accuracy {metrics['accuracy']:.4f}"
                f"{oracle} ({of})")
    return summary


def _evaluated(cfg: Config, path: Path, split: str) -> dict:
    """`evaluate_checkpoint`'s evaluation and summary.json (its run directory removed if it fails or is stopped)."""
    from dlrm.train.step import EvalForward, compile_mode_on, precision_on, set_matmul_precision, warn_precision_on
    from dlrm.train.trainer import build_for_data, evaluate

    # data.path absolute, as a training run records it (dlrm.train.trainer): config.json and summary.json held it as
    # typed, which names other data (or none) from another working directory
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=os.path.abspath(cfg.data.path)))
    device, data_dir, meta, tables = build_for_data(cfg)
    cfg = as_trained(cfg, tables)  # config.json and summary.json: the dataset's table sizes, which it evaluates with
    # the resolved config evaluates as training did: train.compile "auto" is eager on the CPU; given "auto" as it is,
    # EvalForward compiled the forward there (Inductor's bf16 rounds otherwise: another logloss than training's)
    # the step it holds, said with the metrics and TensorBoard's x: read (mapped) before the model takes its memory;
    # after it, under ulimit -v, the file's mapping failed and the step went missing from the line and summary.json
    step = checkpoint_step(Path(path))
    model, resolved = _built_from_checkpoint(cfg, Path(path), tables, device)
    batch_size = cfg.data.eval_batch_size or 4 * cfg.data.batch_size
    loader = ParquetLoader(split_files(data_dir, meta, split), batch_size, device, prefetch=cfg.data.prefetch,
                           shuffle_buffer_rows=cfg.data.shuffle_buffer_rows,  # the memory the config allows
                           multi_hot_sizes=meta.multi_hot_sizes, dense_format=meta.dense_format)
    with RunDirectory.create(cfg, evaluation=True) as run_dir:  # removed again if the evaluation fails
        t0 = time.perf_counter()
        set_matmul_precision(resolved.train.precision)
        warn_precision_on(resolved.train.precision, device, "the evaluation")
        metrics = evaluate(EvalForward(model, resolved.train.precision, device, resolved.train.compile, batch_size),
                           loader)
        # the numbers in TensorBoard too, as a training run's evaluations are (they were in summary.json only: the
        # evaluation of a checkpoint on the test split could not be seen beside the runs' curves)
        writer = open_writer(run_dir.path)
        try:  # a split other than validation (data.eval_split's default, whose eval/* are the training runs' curves)
            # as eval/<split>/*, as a run names its evaluations of another split (`Trainer._eval_tag`): --split test's
            # were eval/*, read in TensorBoard as a validation evaluation
            eval_scalars(writer, metrics, step or 0, "eval" if split == "validation" else f"eval/{split}")
        finally:
            writer.close()
        summary = {**metrics, "split": split, "checkpoint": str(path), "step": step, "rows": loader.num_rows,
                   "wall_s": time.perf_counter() - t0, "device": str(device), "config": cfg.to_dict(),
                   # what it evaluated with, where the config may say "auto" (as a training run's summary says)
                   "resolved": {"kernels": vars(resolved.kernels), "compile": resolved.train.compile.enabled,
                                "compile_mode": compile_mode_on(resolved.train.compile, device)
                                if resolved.train.compile.enabled else None,
                                "precision": precision_on(resolved.train.precision, device),  # (tf32: fp32 on a CPU)
                                "device": str(device), "batch_size": batch_size, "data_path": cfg.data.path,
                                "tables": tables_record(tables)},
                   # the best AUC achievable on the split, as a training run's summary and last line give it (a
                   # synthetic dataset's planted teacher; null for real data)
                   "oracle_auc": meta.extra.get("oracle_auc", {}).get(split)}
        raise_pending()  # a SIGTERM whose stop a library dropped (torch's import): stopped here, nothing written
        write_summary(run_dir.path / "summary.json", summary)  # a failed write names the file
        run_dir.started()
    return summary


DENSE_INPUT_DTYPES = {"counts": torch.int64, "float": torch.float32}
"""The exported program's dense input dtype for each `dlrm.data.schema.DenseFormat`."""


class RawInputDLRM(nn.Module):
    """Inference wrapper: raw dense values and raw sparse hash values in, click probabilities out.

    Args:
        model: a trained DLRM (its hashing buffers do the raw-value-to-row mapping).
        dense_format: what the model was trained on (`Metadata.dense_format`): "counts", the dense input
            is int64 counts (missing as 0), transformed here as the loaders do; "float", float32 values
            taken as they are.

    Shapes: int64 [B, 13] counts or float32 [B, 13] values, int64 [B, 26] raw hashes (missing as -1;
    [B, L] multi-hot slots) -> float32 [B]. The exported program checks its inputs' dtypes: int32
    hashes (which would wrap values >= 2**31) are refused, not converted, and so is the other dense dtype.

    Example:
        >>> from dlrm.config import ModelConfig
        >>> model = build_model(ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]), [10] * 26)
        >>> probs = RawInputDLRM(model.eval())(torch.randint(0, 50, (3, 13)), torch.randint(-1, 1000, (3, 26)))
        >>> probs.shape, probs.dtype, bool(((probs > 0) & (probs < 1)).all())
        (torch.Size([3]), torch.float32, True)
    """

    def __init__(self, model: DLRM, dense_format: str = "counts") -> None:
        super().__init__()
        self.model = model
        self.dense_format = dense_format

    def forward(self, dense: torch.Tensor, sparse_raw: torch.Tensor) -> torch.Tensor:
        # Runtime checks that stay in the exported graph: int32 hashes would have wrapped values >= 2**31.
        torch.ops.aten._assert_tensor_metadata(sparse_raw, dtype=torch.int64)
        torch.ops.aten._assert_tensor_metadata(dense, dtype=DENSE_INPUT_DTYPES[self.dense_format])
        # A copy in the graph: `vocabulary_rows`' `.contiguous()` is traced on the contiguous example and left out,
        # so a column-major batch (a pandas DataFrame's .values) made torch print a searchsorted warning on stderr
        sparse_raw = sparse_raw.clone(memory_format=torch.contiguous_format)
        return torch.sigmoid(self.model(transform_dense(dense, self.dense_format), sparse_raw).float())


def _sparse_width(model: DLRM) -> int:
    """Columns of the raw sparse input: one per feature, or one per multi-hot slot."""
    return getattr(model.sparse_arch, "num_slots", NUM_SPARSE)


@contextlib.contextmanager
def _frozen(module: nn.Module) -> Iterator[None]:
    """`module`'s trainable parameters with requires_grad off inside the block, given back after it."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


def _save_program(program, tmp: Path, path: Path) -> None:
    """torch.export.save `program` to `tmp`; a failed write (a full disk, a quota, a file size limit) is an OSError
    naming `path`, the file asked for.

    torch's archive writer reports a failed write as a RuntimeError ("unexpected pos ...") and, left unfinished by
    it, writes the archive's end again in its C++ destructor, where a second failure aborted the process (SIGABRT:
    no error line, the temporary file left). The writers in the failure's frames are ended here (where a failure is
    an exception); then one byte appended to the file finds the cause, which the RuntimeError does not say."""
    try:
        torch.export.save(program, str(tmp))
    except RuntimeError as e:
        writer_type = getattr(torch._C, "PyTorchFileWriter", None)
        tb = e.__traceback__
        while tb is not None and writer_type is not None:
            for value in list(tb.tb_frame.f_locals.values()):
                for writer in (value, getattr(value, "archive_file", None)):
                    if isinstance(writer, writer_type):
                        with contextlib.suppress(Exception):  # it fails again, and is marked finished
                            writer.write_end_of_file()
            tb = tb.tb_next
        try:
            with open(tmp, "ab") as f:
                f.write(b"\0")
                f.flush()
        except OSError as cause:
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise


def export_model(model: DLRM, path: Path, dense_format: str = "counts", source: str | None = None) -> Path:
    """Write a `torch.export` program (batch size dynamic) to `path` (conventionally *.pt2); its dense
    input as `RawInputDLRM` takes it for `dense_format`; `source` (the checkpoint and its step) is named in the log."""
    path = Path(path)
    exists = f"--export: {path} already exists; remove it or choose another path"
    if os.path.lexists(path):  # a dangling symbolic link too: the rename would replace it
        raise ConfigError(exists)
    if not path.parent.is_dir():
        raise ConfigError(f"--export: directory {path.parent} does not exist")
    problem = export_name_problem(path)
    if problem:
        raise ConfigError(problem)
    device = next(model.parameters()).device
    wrapper = RawInputDLRM(model, dense_format).eval()
    example = (
        torch.zeros(4, NUM_DENSE, dtype=DENSE_INPUT_DTYPES[dense_format], device=device),
        torch.zeros(4, _sparse_width(model), dtype=torch.int64, device=device),
    )
    batch = torch.export.Dim("batch", min=1)
    # The program holds the parameters themselves and saves each one's requires_grad: saved trainable, its outputs would
    # carry an autograd graph wherever it is called outside no_grad (`.numpy()` refused). Frozen until saved.
    with _frozen(wrapper):
        with torch.no_grad():
            program = torch.export.export(wrapper, example, dynamic_shapes=({0: batch}, {0: batch}))
        # a temporary name of this export's own (torch.export.save wants a name ending in .pt2), created exclusively;
        # `path`'s name cut short in it: a name near the 255-byte limit made it too long (ENAMETOOLONG, a traceback)
        tmp = path.with_name(f".{ckpt.temp_stem(path.name, 64)}.{os.getpid()}-{secrets.token_hex(4)}.tmp.pt2")
        created = False
        try:
            # the file and the mark that it is this export's at once: a Ctrl-C between its creation and the `try`
            # left it beside OUT (seen once); deferred, the signal acts inside the `try`, whose `finally` removes it
            with signals_deferred():
                try:
                    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                except OSError as e:  # a directory that takes no new file: its errno may be none of those the CLI
                    # reports in one line (ENOENT in /proc: "this is a bug in dlrm" and a traceback, naming the
                    # temporary name, never the path asked for)
                    raise ConfigError(f"--export: cannot create a file in {path.parent} ({e.strerror or e})") from None
                created = True
            _save_program(program, tmp, path)
            # a SIGTERM whose stop a library dropped (torch's import, the exporter's catch-alls): stopped before the
            # program is put in place, its temporary removed (lost, the export finished and exited 0)
            raise_pending()
            ckpt.move_to_new(tmp, path, exists)  # never over a file that appeared meanwhile
        finally:
            if created:
                tmp.unlink(missing_ok=True)
    # the missing values' codes too: facebookresearch/dlrm reads a missing category as 0, a value (another row) here
    dense = ("raw dense counts, int64 [B, 13], missing 0" if dense_format == "counts"
             else "dense values, float32 [B, 13]")
    width = _sparse_width(model)
    slots = "" if width == NUM_SPARSE else " (each feature's slots, -2 where empty)"
    of = f" from {source}" if source else ""
    logger.info(f"exported inference program to {path} (inputs: {dense}; raw sparse hashes, int64 "
                f"[B, {width}]{slots}, missing -1){of}")
    return path


def export_checkpoint(cfg: Config, checkpoint: Path, path: Path) -> Path:
    """Export the model stored in `checkpoint` (see `export_model`).

    A SIGTERM or Ctrl-C before the program is in place stops it as `TrainingStopped` (128 + the signal) whose line
    names the export and says nothing was written to `path`: it said "SIGTERM: stopped at once, outside the training
    steps (no checkpoint written now)" or "interrupted (Ctrl-C)", which speak of a training run (`--checkpoint C
    --export OUT` trains nothing). After training, `export_trained` says the run is kept instead."""
    try:
        return _export_checkpoint(cfg, checkpoint, path)
    except (Exception, KeyboardInterrupt) as e:
        # (a SIGTERM inside torch.export's serializer comes wrapped in its error: `signal_stop_inside`)
        stop = e if isinstance(e, KeyboardInterrupt) else signal_stop_inside(e)
        if stop is None:
            raise
        raise TrainingStopped(getattr(stop, "exit_code", EXIT_INTERRUPTED),
                              f"--export: {stop_signal_name(stop)} stopped the export of {checkpoint} to {path}: "
                              "nothing written there") from None


def _export_checkpoint(cfg: Config, checkpoint: Path, path: Path) -> Path:
    from dlrm.train.trainer import build_for_data

    device, _, _, tables = build_for_data(cfg)
    # which model, as --eval-only's line says: given a run directory (or after training), its best.pt or its newest
    # checkpoint was exported, and the line named neither (best.pt's step is not in its name)
    step = checkpoint_step(Path(checkpoint))
    source = f"{checkpoint}" + (f" (step {step})" if step is not None else "")
    return export_model(model_from_checkpoint(cfg, checkpoint, tables, device, portable=True), path, tables.dense_format,
                        source)


def export_trained(cfg: Config, checkpoint: Path, path: Path, summary: dict) -> Path:
    """``--export`` after training (or a ``--resume`` of a finished run): `export_checkpoint`, whose refusal or stop
    says how to export the run, trained and kept (`summary`'s run_dir): the command given again trains nothing but is
    refused ("run directory exists"). A SIGTERM or Ctrl-C there said "stopped at once, outside the training steps (no
    checkpoint written now)" or "interrupted (Ctrl-C)": as if the run were lost, where only the export is missing."""
    try:
        return export_checkpoint(cfg, checkpoint, path)
    except ConfigError as e:  # (OUT made meanwhile, its directory removed)
        raise ConfigError(f"{e} (the run is trained and kept: export it with --checkpoint {summary['run_dir']} "
                          "--export OUT.pt2)") from None
    except MemoryError as e:  # refused before the checkpoint was read (`dlrm.train.checkpoint_memory`)
        if not getattr(e, "dlrm_refused", False):
            raise
        kept = MemoryError(f"{e} (the run is trained and kept: export it with --checkpoint {summary['run_dir']} "
                           "--export OUT.pt2)")
        kept.dlrm_refused = True
        raise kept from None
    except (Exception, KeyboardInterrupt) as e:
        # (a SIGTERM inside torch.export's serializer comes wrapped in its error: `signal_stop_inside`)
        stop = e if isinstance(e, KeyboardInterrupt) else signal_stop_inside(e)
        if stop is None:
            raise
        raise TrainingStopped(getattr(stop, "exit_code", EXIT_INTERRUPTED),
                              f"{stop_signal_name(stop)} stopped the export to {path}: nothing written there; the run "
                              "is trained and kept (its summary.json written): export it with --checkpoint "
                              f"{summary['run_dir']} --export {path}") from None
