"""What a run reports: TensorBoard scalars, hparams and profile summaries, summary.json, and the final
log line."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import struct
import sys
import typing
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger
from torch.utils.tensorboard import SummaryWriter

from dlrm.checkpoint import write_files_atomic
from dlrm.config import Config, ConfigError, _field_type
from dlrm.data.schema import NUM_SPARSE, write_json_atomic
from dlrm.logging_setup import counted
from dlrm.train.logloss_check import constant_reference, flag_clause, logloss_flag
from dlrm.train.metric_text import auc_text, auc_undefined
from dlrm.train.run_dir import run_dir_present
from dlrm.train.sessions import absolute_paths, drop_earlier_hparams, with_sessions


class NoWriter:
    """Stands in for the SummaryWriter on ranks other than 0 (they write no run files)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def open_writer(run_dir: Path, purge_step: Optional[int] = None) -> SummaryWriter:
    """The run's SummaryWriter, whose failed event-file write (a full disk, a quota) stops the run at its next
    TensorBoard call with one line naming the event file.

    Its events are written by a background thread, which died of such an error with a traceback on stderr ("Exception
    in thread"); the training thread then stopped with a line naming no file. Here the thread keeps the error, as
    its own would be kept, without dying (later events are dropped), and the writer raises it, named, at its next
    call. A TensorBoard whose writer is laid out otherwise keeps its own behaviour."""
    writer = SummaryWriter(str(run_dir), purge_step=purge_step)
    if purge_step is not None:
        # A second SessionLog.START: TensorBoard's Python loader (plugin_event_accumulator, what `tensorboard
        # --load_fast=false` and a TensorBoard without its data server read) takes a run's first START for the run's
        # start, not a restart, and purges nothing. A run's first session writes none, so a resume from an earlier
        # checkpoint showed the stopped session's later points next to its own (8, 10, 8, 10); the data server and
        # event_accumulator purge at either START.
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        writer._get_file_writer().add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
    events = getattr(writer._get_file_writer(), "event_writer", None)
    worker = getattr(getattr(events, "_async_writer", None), "_worker", None)
    if hasattr(worker, "_record_writer") and hasattr(worker, "exception"):
        worker._record_writer = _KeptWriteError(worker, getattr(events, "_file_name", str(run_dir)))
    return writer


def close_quietly(writer: Optional[SummaryWriter]) -> None:
    """Close a failed run's writer: its event-writer thread and open event file outlived the run (one more a failed
    trial in a sweep's process). An error while closing (the full disk that failed the run) is not the run's error."""
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.close()


class _KeptWriteError:
    """The event writer thread's record writer, whose first OSError becomes the thread's `exception` (which the
    writer raises in the caller's thread: tensorboard's `_AsyncWriter._check_worker_status`), naming `path`."""

    def __init__(self, worker, path: str) -> None:
        self._worker, self._records, self._path = worker, worker._record_writer, os.fsdecode(path)

    def _kept(self, call, *args) -> None:
        if self._worker.exception is not None:
            return  # the run stops at its next TensorBoard call: nothing more is written
        try:
            call(*args)
        except OSError as e:
            try:  # the run directory removed: said so (its file "not found" was reported as a bug in dlrm)
                run_dir_present(Path(self._path).parent)
                # (an OSError without an errno, built with one, read "[Errno None] ...")
                self._worker.exception = OSError(e.errno, e.strerror or str(e), self._path) if e.errno is not None \
                    else OSError(f"{e}: {self._path!r}")
            except ConfigError as gone:
                self._worker.exception = gone

    def write(self, data: bytes) -> None:
        self._kept(self._records.write, data)

    def flush(self) -> None:
        self._kept(self._records.flush)

    def close(self) -> None:
        self._records.close()


def write_summary(path: Path, summary: dict[str, Any], sessions: bool = False,
                  resumed_config: Optional[dict] = None) -> None:
    """summary.json, atomically (NaN written as null: a one-class AUC); a failed write names the file (the error of a
    write or fsync of an open file names none). Its paths are made absolute, in `summary` too (`absolute_paths`);
    `sessions` (a training run's): with the run's earlier sessions, from the summary.json it replaces
    (`with_sessions`; `resumed_config`: the config of the checkpoint the session resumed)."""
    run_dir_present(Path(path).parent)  # (write_json_atomic makes its directory)
    absolute_paths(summary)
    if sessions:
        with_sessions(summary, Path(path), resumed_config)
    try:
        write_json_atomic(path, summary, nan_as_null=True)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


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


def model_text(model: torch.nn.Module, cfg: Config, tables) -> str:
    """The start line's model: its parameters (the embedding counted whole: a sharded run's rank holds only its rows,
    which were counted as the model's), its tables (`dlrm.train.setup.Tables`), and what sets a DCN or multi-hot model
    apart (the cross network; the values a sample pools, which only the torch embedding's own line said, not the
    Triton one's).

        >>> from dlrm.config import Config, ModelConfig
        >>> from dlrm.model.dlrm import build_model
        >>> cfg = Config(model=ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcn",
        ...                                cross_layers=2, cross_rank=3))
        >>> from dlrm.train.setup import Tables
        >>> model_text(build_model(cfg.model, [5] * 26), cfg, Tables([5] * 26, None, "modulus"))
        '3,061 parameters (130 embedding rows, hashing modulus; dcn: 2 cross layers of rank 3 over 108 inputs)'
    """
    tables_of = {id(p) for p in model.sparse_arch.parameters()}  # (this rank's rows, of whichever embedding kernel)
    dense = sum(p.numel() for p in model.parameters() if id(p) not in tables_of)
    rows, m, sizes = sum(tables.cardinalities), cfg.model, tables.multi_hot_sizes
    parts = [f"{rows:,} embedding rows, hashing {tables.hashing}"]
    if m.interaction == "dcn":
        parts.append(f"dcn: {counted(m.cross_layers, 'cross layer')} of rank {m.cross_rank} over "
                     f"{(len(tables.cardinalities) + 1) * m.embedding_dim} inputs")
    if tables.multi_hot:  # the dataset's sizes (they win over model.multi_hot_sizes)
        parts.append(f"multi-hot: {sum(sizes)} values a sample sum-pooled into {len(sizes)} features")
    return f"{dense + rows * m.embedding_dim:,} parameters ({'; '.join(parts)})"


def tables_record(tables) -> dict[str, Any]:
    """The tables a run used (`dlrm.train.setup.Tables`: the dataset's), as summary.json's "resolved" names them."""
    return {"cardinalities": list(tables.cardinalities), "hashing": tables.hashing,
            "multi_hot_sizes": list(tables.multi_hot_sizes or [1] * len(tables.cardinalities)),
            "dense_format": tables.dense_format}


def resolved_settings(run, cfg: Config, data, tables, placement: str, device: torch.device, world_size: int,
                      baseline: bool) -> dict[str, Any]:
    """summary.json's "resolved": in one place, every setting the session decided at its start and trained with, where
    the config may say "auto" or something else (it named the kernels, compile, step graph and placement only: the
    compile mode, the device, the batch after a small split's adjustment, the dataset's tables and hashing, the
    sharding plan and whether the baseline was fitted were in log lines alone, or nowhere). `run`: the built
    `dlrm.train.builder.Run` (its config has no "auto" left); `data`: the trainer's `TrainData`; `tables`: the
    dataset's (`dlrm.train.setup.Tables`); `baseline`: whether train.baseline fitted the logistic regression."""
    from dlrm.train.step import compile_mode_on, precision_on

    c = run.config.train.compile
    return {"kernels": vars(run.config.kernels), "compile": c.enabled, "cuda_graph": run.config.train.cuda_graph,
            "placement": placement,
            # (None when eager; combo kernels and the CUDA-graph modes are CUDA's: off the GPU, compiled without them)
            "compile_mode": compile_mode_on(c, device) if c.enabled else None,
            "combo_kernels": bool(c.enabled and c.combo_kernels is True and device.type == "cuda"),
            "device": str(device), "precision": precision_on(run.config.train.precision, device),  # (tf32: fp32 on a CPU)
            "seed": cfg.train.seed,
            "batch_size": data.batch_size, "eval_batch_size": cfg.data.eval_batch_size or 4 * cfg.data.batch_size,
            "steps": data.total_steps, "steps_per_epoch": len(data.train), "data_path": cfg.data.path,
            "tables": tables_record(tables), "world_size": world_size, "sharding": run.plan.to_dict() if run.plan is not None else None,
            "baseline": baseline}


def log_train(writer: SummaryWriter, step: int, loss: float, lrs: tuple[float, float],
              samples_per_sec: Optional[float], data_wait_fraction: Optional[float] = None) -> None:
    """The logging interval's scalars: loss, learning rates (dense, sparse: those `step` trained with), throughput,
    data wait."""
    writer.add_scalar("train/loss", loss, step)
    writer.add_scalar("train/lr_dense", lrs[0], step)
    writer.add_scalar("train/lr_sparse", lrs[1], step)
    if samples_per_sec is not None:
        writer.add_scalar("train/samples_per_sec", samples_per_sec, step)
    if data_wait_fraction is not None:
        writer.add_scalar("train/data_wait_fraction", data_wait_fraction, step)


def eval_scalars(writer: SummaryWriter, metrics: dict[str, float], step: int, tag: str = "eval") -> None:
    """An evaluation's TensorBoard scalars ``eval/*`` (an undefined AUC as the text ``eval/auc_undefined``); `tag`:
    another prefix (``eval/<split>``: a resumed run's evaluations of another split than its ``eval/*`` curve's)."""
    for k, v in metrics.items():
        if k == "auc" and auc_undefined(v):
            if isinstance(writer, SummaryWriter):  # (not NoWriter, nor a stand-in with scalars only)
                add_markdown(writer, f"{tag}/auc_undefined", f"AUC {auc_text(metrics)}: undefined on this split", step)
            continue
        writer.add_scalar(f"{tag}/{k}", v, step)


def log_eval(writer: SummaryWriter, metrics: dict[str, float], step: int, tag: str = "eval") -> dict[str, float]:
    """An evaluation's scalars ``eval/*`` and log line. An undefined AUC (a one-class split's NaN) is said so, in the
    line and as TensorBoard text ``eval/auc_undefined``, and no ``eval/auc`` scalar is written (it read "auc nan", a NaN
    point)."""
    eval_scalars(writer, metrics, step, tag)
    logger.info(f"step {step}: eval " + ", ".join(f"{k} {auc_text(metrics) if k == 'auc' else format(v, '.4f')}"
                                                    for k, v in metrics.items()))
    return metrics


HPARAM_METRICS = ("auc", "logloss", "accuracy")
SWEEP_METRICS = ("sweep/auc_std", "sweep/logloss_std", "sweep/seeds", "sweep/failed_trials")
"""A sweep setting's session metrics beside its ``hparam/*`` (the means over its seeds; `dlrm.sweep_report`)."""


def session_hparams(cfg: Config, batch_size: int, multi_hot_sizes: Optional[list[int]] = None,
                    resolved: Optional[dict] = None) -> dict[str, Any]:
    """A run's HParams: the same keys for every run, and a sweep trial's swept keys (``log.sweep_keys``, as dotted
    names, each of one type in every setting: `swept_value`). A sweep's settings under ``hparams/`` name the same
    (`dlrm.sweep_report`), so whichever run's experiment TensorBoard takes its columns from, its rows and the trials'
    fill them.

    Also ``cross_layers`` and ``cross_rank`` (0 and 0 for a model without a cross network) and ``multi_hot_values``
    (values a sample over the 26 features, from `multi_hot_sizes`: the dataset's, which win over
    ``model.multi_hot_sizes``; None: one-hot, 26): without them runs of other cross networks or hotness were told
    apart by nothing. Every run names all of them: the dashboard's columns are those of one run's experiment summary,
    picked arbitrarily, so keys a dot run left out were no columns once its summary was the one picked.

    ``precision``, ``kernels`` and ``compile`` are what the session trained with, from `resolved` (summary.json's
    ``resolved``: `resolved_settings`), else the config's (`kernels_text`, `compile_text`). The config's "tf32" on a CPU
    run is fp32 there, as the start line and summary.json say (the column said "tf32": told apart from fp32 runs that
    trained exactly alike); and without the kernels and compile columns, the runs of a ``--compare`` (one a variant)
    were sessions of the same values. ``steps``: the steps the run was set to train (``train.max_steps`` or its epochs';
    early stopping may end it sooner; a resumed run's, its last session's), a blank cell where unknown: a 60-step run's
    AUC stood beside a 1406-step run's as that of the same settings. ``seed``: the seed the session trained with
    (`resolved`'s, else ``train.seed``), as text (`_seed_text`): two runs that differed only by their seed were
    sessions of the same values. An earlier session's hparams written before a column are no change to a resumed
    one's (`_replace_earlier_hparams` compares the keys both hold).

        >>> from dlrm.config import LogConfig
        >>> session_hparams(Config(log=LogConfig(sweep_keys=["model.dropout", "model.top_mlp"])), 32)["model.top_mlp"]
        '[64, 1]'
    """
    hp = {"batch_size": batch_size, "embedding_dim": cfg.model.embedding_dim, "dense_lr": cfg.optim.dense.lr,
          "sparse_lr": cfg.optim.sparse.lr, "precision": (resolved or {}).get("precision") or cfg.train.precision,
          "interaction": cfg.model.interaction, "kernels": kernels_text(cfg, resolved),
          "compile": compile_text(cfg, resolved), "steps": _steps(cfg, resolved),
          "seed": _seed_text((resolved or {}).get("seed", cfg.train.seed))}
    dcn = cfg.model.interaction == "dcn"
    hp.update(cross_layers=cfg.model.cross_layers if dcn else 0, cross_rank=cfg.model.cross_rank if dcn else 0,
              multi_hot_values=sum(multi_hot_sizes) if multi_hot_sizes is not None else NUM_SPARSE)
    tree = cfg.to_dict()
    for key in cfg.log.sweep_keys or ():
        value = tree
        for part in key.split("."):
            value = value[part]
        hp[key] = swept_value(key, value)
    return hp


def kernels_text(cfg: Config, resolved: Optional[dict] = None) -> str:
    """The kernels a session trained with, as one HParams value: the kernel set where the four parts share it, else
    each part's (`resolved`: summary.json's ``resolved``; else the config's, "auto" perhaps).

        >>> kernels_text(Config(), {"kernels": {"embedding": "triton", "interaction": "triton", "mlp": "torch",
        ...                                     "loss": "torch"}})
        'embedding=triton, interaction=triton, mlp=torch, loss=torch'
    """
    parts = ("embedding", "interaction", "mlp", "loss")
    held = (resolved or {}).get("kernels")
    kernels = held if isinstance(held, dict) else vars(cfg.kernels)
    values = [str(kernels.get(p)) for p in parts]
    return values[0] if len(set(values)) == 1 else ", ".join(f"{p}={v}" for p, v in zip(parts, values))


def compile_text(cfg: Config, resolved: Optional[dict] = None) -> str:
    """Whether and how a session was compiled, as one HParams value: "off", the compile mode it compiled in, and
    "+step-graph" with the whole step in one CUDA graph (`resolved`: summary.json's ``resolved``; else the config's,
    "auto" where it says so).

        >>> compile_text(Config(), {"compile": True, "compile_mode": "default", "cuda_graph": True})
        'default+step-graph'
    """
    if resolved and isinstance(resolved.get("compile"), bool):
        enabled, mode, graph = resolved["compile"], resolved.get("compile_mode"), resolved.get("cuda_graph")
    else:
        c = cfg.train.compile  # (a bool or "auto" before `validate` makes it a section)
        enabled, mode = (c.enabled, c.mode) if hasattr(c, "enabled") else (c, "default")
        graph = cfg.train.cuda_graph
    if enabled == "auto" or graph == "auto":
        return "auto"
    return (str(mode) if enabled else "off") + ("+step-graph" if graph is True else "")


def _steps(cfg: Config, resolved: Optional[dict]) -> float:
    """The steps the run was set to train (`resolved`'s, the session's plan; else ``train.max_steps``), NaN where
    unknown (a blank cell: the column is a number's)."""
    return _whole((resolved or {}).get("steps", cfg.train.max_steps))


def _whole(value: Any) -> float:
    """`value` where it is a whole number, else NaN (a blank cell: the column is a number's; true is no number)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else math.nan


def _seed_text(value: Any) -> str:
    """A seed as its HParams value: decimal text, "" (a blank cell) where it is no whole number. HParams numbers are
    float64, so seeds 2**53 and 2**53 + 1 (train.seed goes to 2**63 - 1) both showed 9007199254740992; text in every
    run and sweep setting, not only above 2**53: TensorBoard types a column by one run's experiment, and a column of
    numbers and text failed the dashboard's sorting (`swept_value`).

        >>> _seed_text(2**53 + 1), _seed_text(None)
        ('9007199254740993', '')
    """
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else ""


def swept_value(key: str, value: Any) -> Any:
    """A swept key's HParams value, of one type whatever the setting (the type its config field declares): the
    dashboard sorts and filters a column by comparing its sessions' values, and a column of two types
    (``--set data.max_rows_per_table=null,1000``: "null" beside 1000; ``train.compile.enabled=auto,false``) failed
    its every request once sorted ("'<' not supported between instances of 'float' and 'str'"). A number's null is
    NaN (a blank cell there); a key of several kinds (null, "auto" or a bool beside another), a list or a section is
    JSON text, as the sweep's tables show it.

        >>> [swept_value(k, v) for k, v in (("train.max_steps", None), ("optim.dense.fused", True), ("train.seed", 3))]
        [nan, 'true', 3]
    """
    def kinds(tp: Any) -> set:
        if typing.get_origin(tp) is typing.Literal:
            return {type(a) for a in typing.get_args(tp)}
        args = typing.get_args(tp)
        return set().union(*map(kinds, args)) if typing.get_origin(tp) is typing.Union else {tp}

    declared = kinds(_field_type(key))
    if declared - {type(None)} and declared - {type(None)} <= {int, float}:
        return math.nan if value is None else value
    if declared in ({bool}, {str}) and isinstance(value, (bool, str)):  # (never null)
        return value
    return json.dumps(value)


def experiment_metrics(cfg: Config) -> tuple[str, ...]:
    """The metric columns of a run's HParams experiment: a sweep trial's names its settings' too (one experiment)."""
    return tuple(f"hparam/{k}" for k in HPARAM_METRICS) + (SWEEP_METRICS if cfg.log.sweep_keys is not None else ())


def log_hparams(writer: SummaryWriter, cfg: Config, batch_size: int, metrics: dict[str, float],
                step: Optional[int] = None, multi_hot_sizes: Optional[list[int]] = None,
                resolved: Optional[dict] = None) -> None:
    """The run's hyperparameters (`session_hparams`) and final metrics for the HParams dashboard, in the run's own
    events.

    `SummaryWriter.add_hparams` would write them into a new ``<run>/hparams`` run, one more entry per
    run in every dashboard's run list; written here, the run itself is the HParams session (its
    ``hparam/auc``, ``hparam/logloss``, ``hparam/accuracy`` scalars are the session's metrics). `resolved`: what the
    session trained with (summary.json's ``resolved``: precision, kernels, compile; `session_hparams`).
    Example (a writer on a temporary directory):

        >>> import tempfile; from dlrm.config import Config
        >>> with tempfile.TemporaryDirectory() as d, SummaryWriter(d) as w:
        ...     log_hparams(w, Config(), 32, {"auc": 0.8, "logloss": 0.45, "accuracy": 0.79})
        ...     sorted(p.name for p in Path(d).iterdir())[0].startswith("events.out.tfevents")
        True
    """
    if isinstance(writer, NoWriter):
        return
    from torch.utils.tensorboard.summary import hparams

    # an undefined AUC (a one-class split's NaN) is no session metric: left out, not shown as NaN
    values = {f"hparam/{k}": metrics[k] for k in HPARAM_METRICS if not (k == "auc" and auc_undefined(metrics[k]))}
    # _get_file_writer(): the writer's own accessor (it reopens the file if the writer was closed)
    file_writer = writer._get_file_writer()
    shown = session_hparams(cfg, batch_size, multi_hot_sizes, resolved)
    _replace_earlier_hparams(writer, shown)
    columns = dict.fromkeys(experiment_metrics(cfg), 0.0)  # (the experiment's metric names; the values are scalars)
    for summary in hparams(shown, columns):
        file_writer.add_summary(summary, step)  # the experiment, session-start and session-end summaries
    for tag, value in values.items():
        writer.add_scalar(tag, value, step)


def _replace_earlier_hparams(writer: SummaryWriter, shown: dict[str, Any]) -> None:
    """A resumed run's HParams session is its last session's (`shown`): TensorBoard keeps the first it reads of a
    run, so an earlier session's, in its own event file, is removed there (`drop_earlier_hparams`; each session's are
    in summary.json's ``sessions``). A failure to rewrite that file is said, not the run's error."""
    if getattr(writer, "log_dir", None) is None:  # (a stand-in writer: no run directory of its own)
        return
    own = getattr(getattr(writer._get_file_writer(), "event_writer", None), "_file_name", None)
    try:
        earlier = drop_earlier_hparams(Path(writer.log_dir), own)
    except OSError as e:
        logger.warning(f"TensorBoard HParams: {e}; the run may show an earlier session's hyperparameters")
        return
    if earlier is not None:
        held = {k: _as_shown(v, shown[k]) for k, v in earlier.items() if k in shown}
        changed = {k: (v, shown[k]) for k, v in held.items() if v != shown[k]
                   and not (v != v and shown[k] != shown[k])}  # (NaN: a swept number key's null, both sides)
        said = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        logger.info("TensorBoard HParams: the run shows this session's hyperparameters, replacing an earlier "
                    "session's" + (f" ({said})" if changed else " (the same values)")
                    + "; each session's are in summary.json's sessions")


def _as_shown(held: Any, shown: Any) -> Any:
    """An earlier session's hparam as this session's of the same key is written: the event file holds every number
    as a float, so an integer setting read back (a batch size) was said as ``batch_size 256.0 -> 128``. A seed an
    earlier version wrote as that float (`_seed_text`), rounded above 2**53, is the same seed as this session's text.

        >>> _as_shown(256.0, 128), _as_shown(9007199254740992.0, "9007199254740993"), _as_shown(5.0, "7")
        (256, '9007199254740993', '5')
    """
    if isinstance(held, float) and isinstance(shown, int) and not isinstance(shown, bool) and held.is_integer():
        return int(held)
    if isinstance(held, float) and isinstance(shown, str) and shown.isdecimal() and held.is_integer():
        return shown if float(int(shown)) == held else str(int(held))
    return held


def add_markdown(writer: SummaryWriter, tag: str, text: str, step: Optional[int] = None) -> None:
    """A text summary under exactly `tag` (`SummaryWriter.add_text` appends ``/text_summary`` to it);
    TensorBoard's Text dashboard renders it as Markdown, tables included.

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d, SummaryWriter(d) as w:
        ...     add_markdown(w, "profile/step_breakdown", "| range | host ms |\\n| --- | ---: |\\n| data | 0.1 |")
    """
    if isinstance(writer, NoWriter):
        return
    from tensorboard.plugins.text.summary_v2 import text_pb

    writer._get_file_writer().add_summary(text_pb(tag, text), step)


def add_png(writer: SummaryWriter, tag: str, png: bytes, step: Optional[int] = None) -> None:
    """An image summary holding `png` as it is (no decode and re-encode): TensorBoard's Images dashboard
    shows exactly the file written next to it.

        >>> png = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + struct.pack(">II", 640, 480)
        >>> _png_size(png)
        (640, 480)
    """
    if isinstance(writer, NoWriter):
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = _png_size(png)
    image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=png)  # 4: RGBA
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which follows the 8-byte signature."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return struct.unpack(">II", png[16:24])


def log_profile(writer: SummaryWriter, run_dir: Path, device: torch.device, start_step: int):
    """One profiled step of the session, from the newest trace it wrote (`profiling.own_trace`), where a person
    looks: TensorBoard text ``profile/step_breakdown`` (host and device ms per named range) and
    ``profile/top_kernels`` (top device kernels; CPU ops by self time on a CPU run), image ``profile/timeline``, and
    the same as ``profile_step.md`` and ``profile_timeline.png`` in `run_dir` (`profile_files`: a later session's
    beside an earlier one's). All of it renders offline (the PyTorch Profiler tab's charts load from a CDN).
    `start_step`: the run's step this session started at; the trace's ``ProfilerStep#N`` is the session's step N
    (from 0), the run's step ``start_step + N + 1`` as the loop counts it (train/loss of that step), where the
    entries are logged and which the report names (logged at the session's last step, a resumed session's
    ProfilerStep#3 read as the first session's step). Returns the `trace_summary.StepSummary`, or None
    (said in the log) when the session profiled no step (a resumed run's earlier traces are not its step, and its
    files from them stay). Rank 0 only: it writes run files.

    Example (not a doctest: it needs a run trained with --profile)::

        log_profile(writer, Path("tb_logs/run"), torch.device("cpu"), 0).ranges[0]
        # RangeTime(name='data', host_ms=0.058, device_ms=None)
    """
    from dlrm.train import trace_summary as ts  # matplotlib and the trace parser: only for profiled runs
    from dlrm.train.profiling import own_trace

    mine = own_trace(run_dir)
    if mine is None:  # no step profiled in this session: another file there is another session's or rank's step
        logger.warning(f"profile: {run_dir}: this run wrote no trace (it profiled no step); no step breakdown written")
        return None
    try:
        trace = ts.load_trace(mine)
        summary = ts.summarize_step(trace, start_step=start_step)
    except (ts.TraceError, OSError, EOFError, ValueError, KeyError) as e:  # the run's results stand without it
        logger.warning(f"profile: {run_dir}: {e}; no step breakdown written")
        return None
    # (a step range of another name, from no torch profiler: at the session's first step)
    step = start_step if summary.run_step is None else summary.run_step
    title = f"{Path(run_dir).name}: training step {step} of the run on {device_name(device)}"
    png = ts.timeline_png(trace, title)
    md_name, png_name = profile_files(Path(run_dir), step)
    # one set, each file whole (a full disk: written in place, a half-written profile_step.md or .png replaced a resumed
    # run's, the pair from two sessions, and the error named no file)
    write_files_atomic(Path(run_dir), {md_name: ts.report(summary, title), png_name: png})
    add_markdown(writer, "profile/step_breakdown", ts.step_table(summary), step)
    add_markdown(writer, "profile/top_kernels", ts.top_table(summary), step)
    add_png(writer, "profile/timeline", png, step)
    kept = "" if md_name == "profile_step.md" else " (the earlier session's profile_step.md and .png kept)"
    logger.info(f"profiled step ({run_dir}/{md_name} and {png_name}{kept}, TensorBoard text and images 'profile/' at "
                f"step {step}):\n" + ts.step_table(summary))
    return summary


def profile_files(run_dir: Path, step: int) -> tuple[str, str]:
    """The names of a session's profile report and timeline in `run_dir`: ``profile_step.md`` and
    ``profile_timeline.png`` where neither is there (a run's first profiled session, the names a run made before
    this change has), else named by the run's profiled `step` (``profile_step_<step>.md``, ``.1``, ``.2``, ... where
    a resume from an earlier checkpoint profiled that step again): a resumed session wrote over the earlier
    session's pair, which TensorBoard still showed as its own.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     first = profile_files(Path(d), 4)
    ...     _ = (Path(d) / "profile_step.md").write_text("")
    ...     first, profile_files(Path(d), 10)
    (('profile_step.md', 'profile_timeline.png'), ('profile_step_10.md', 'profile_timeline_10.png'))
    """
    suffixes = itertools.chain([""], [f"_{step}"], (f"_{step}.{k}" for k in itertools.count(1)))
    for suffix in suffixes:
        names = (f"profile_step{suffix}.md", f"profile_timeline{suffix}.png")
        if not any((run_dir / name).exists() for name in names):
            return names
    raise AssertionError("unreachable")  # pragma: no cover (the counter never ends)


def final_line(summary: dict[str, Any]) -> str:
    """The one line that ends a run: the metrics, the oracle when known, the run's totals."""
    return (
        f"{summary['split']}: AUC {auc_text(summary)}, logloss {summary['logloss']:.4f}, "
        f"accuracy {summary['accuracy']:.4f}"
        + (f" (oracle AUC {summary['oracle_auc']:.4f})" if summary.get("oracle_auc") is not None else "")
        + f"; {counted(summary['steps'], 'step')}, {counted(summary['samples'], 'sample', ',')}"
        + (f", {summary['samples_per_sec']:,.0f} samples/s" if summary.get("samples_per_sec") is not None
           else " (none trained in this session)")
        + (f" (waiting for data {summary['data_wait_fraction']:.0%} of the time)"
           if summary.get("data_wait_fraction") is not None else "")
        + f", {summary['wall_s']:.1f}s"
        + _best_clause(summary)
        + flag_clause(summary)  # a logloss worse than predicting the train click rate (`check_logloss`)
    )


def check_logloss(summary: dict[str, Any], meta, writer: SummaryWriter, tag: str = "eval") -> None:
    """Add the logloss of predicting the train click rate to `summary` (`dlrm.train.logloss_check`), and when the
    run's last logloss is worse, say so in TensorBoard: text ``<tag>/logloss_worse_than_constant`` at the last step,
    beside the ``<tag>/logloss`` curve (`tag`: the evaluations' prefix). The final line says it too (`final_line`)."""
    summary.update(constant_reference(meta, summary["split"]))
    flag = logloss_flag(summary)
    if flag:
        add_markdown(writer, f"{tag}/logloss_worse_than_constant", flag[0].upper() + flag[1:] + ".", summary["steps"])


def _best_clause(summary: dict[str, Any]) -> str:
    best = summary.get("best")
    if not best or best.get("step") == summary["steps"]:
        # a run that stopped early at its best evaluation (a target reached there) said nothing of stopping early:
        # it read as a run that trained to its end
        return "; early stopped" if summary.get("early_stopped") else ""
    value = auc_text(best) if best["metric"] == "auc" else f"{best[best['metric']]:.4f}"
    return (f"; best {best['metric']} {value} at step {best['step']}"
            + (" (early stopped)" if summary.get("early_stopped") else "")
            + (f", kept as {best['checkpoint']}" if best.get("checkpoint") else ", its model not kept"))
