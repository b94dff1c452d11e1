"""Typed run configuration: one dataclass per concern, loaded from JSON and validated.

Every error names the key path and the offending value in one line, e.g.
``configs/x.json: optim.dense.lr: -1.0 must be > 0``, and is raised before any work starts.
The file is untrusted: bytes that are not UTF-8, JSON nested too deeply, integers beyond int64
(or Python's int->str limit), floats that are not finite in float32 (or, where they must be
> 0, underflow to 0 there), NaN/Infinity literals and strings holding NUL are all such errors.
This is the only module that reads a config file; everything else receives `Config` objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from dlrm.data.schema import NUM_SPARSE

Activation = Literal["relu", "sigmoid", "gelu", "squared_relu", "none"]
KernelChoice = Literal["auto", "torch", "triton"]
Auto = Literal["auto"]


from dlrm.errors import ConfigError  # noqa: E402,F401 - defined low (dlrm.errors), raised and caught everywhere


@dataclass
class DataConfig:
    """Where batches come from and how they are cut."""

    path: str = "data/sample"
    """Dataset directory (see data/README.md); relative paths resolve against the working directory."""
    batch_size: int = 512
    """Training batch size B."""
    eval_batch_size: Optional[int] = None
    """Evaluation batch size; defaults to 4 x batch_size."""
    drop_last: bool = True
    """Drop the last partial training batch (fixed shapes: nothing recompiles); False keeps it."""
    shuffle: bool = True
    """Seeded shuffle of row-group order and of rows within the shuffle buffer."""
    shuffle_buffer_rows: int = 1_000_000
    """Rows shuffled together, and the unit the stream loader decodes and copies to the device (two
    such buffers live on the device, 264 bytes a row); a split smaller than this is shuffled as a whole."""
    prefetch: int = 2
    """Shuffle buffers decoded ahead by the background threads (each about shuffle_buffer_rows rows:
    many batches); on CUDA the next one is also copied to the device on a side stream while the
    current one is cut into batches. Costs prefetch + 1 pinned host arenas of 165 bytes a row
    (269 when sparse values need int64)."""
    placement: Literal["auto", "stream", "gpu"] = "auto"
    """stream: read parquet row groups as training goes; gpu: load each split into device memory once
    (about 160 bytes a row) and cut batches from a device-side permutation; auto: gpu when the train
    and evaluation splits take at most `gpu_memory_share` of the device memory left free after the
    embedding tables (and their optimizer state), stream otherwise (and always on the CPU); logged."""
    gpu_memory_share: float = 0.25
    """With placement "auto": the largest share of free device memory the data may take."""
    eval_split: Literal["validation", "test"] = "validation"
    """Split evaluated during and after training."""
    max_rows_per_table: Optional[int] = None
    """Cap on each embedding table's rows (modulus hashing only); None keeps the dataset's sizes."""


@dataclass
class ModelConfig:
    """DLRM shape (TorchRec notation: B batch, F sparse features, D embedding dim)."""

    embedding_dim: int = 16
    """D: width of every embedding row and of the bottom MLP's output."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """Layer widths of the DenseArch after the 13 dense inputs; the last must equal embedding_dim."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])
    """Layer widths of the OverArch; the last must be 1 (the logit)."""
    interaction: Literal["dot", "cat"] = "dot"
    """dot: dense vector + strictly-lower-triangle pairwise dots; cat: plain concatenation."""
    activation: Activation = "relu"
    """Activation between MLP layers (none after the last OverArch layer)."""
    top_mlp_input_multiple: int = 1
    """Append zero columns to the interaction output so the OverArch's input width is a multiple
    of this (8: 367 -> 368 for Kaggle, 479 -> 480 for Terabyte, as NVIDIA's DLRM pads), which
    aligns the first top-MLP GEMM's reduction dimension for tensor cores. The extra inputs are
    always zero, so their weights get zero gradients and the model computes the same function;
    1: no padding."""
    cardinalities: Optional[list[int]] = None
    """Table sizes for runs without a dataset (synthetic benchmarks); a dataset's metadata wins otherwise."""
    dropout: float = 0.0
    """Dropout probability between MLP layers (after each hidden layer's activation, in the bottom
    and the top MLP; never on the logit); 0 turns it off. Training only: evaluation sees the whole net."""


@dataclass
class DenseOptimConfig:
    """Optimizer for the MLP parameters."""

    name: Literal["sgd", "adagrad", "adam"] = "adam"
    lr: float = 1e-3
    eps: float = 1e-8
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    fused: Optional[bool] = None
    """torch.optim's fused implementation (one kernel for all parameters' update instead of a
    few per parameter group); None: fused for sgd and adam on CUDA (torch has no fused CUDA
    Adagrad), the default implementation otherwise."""


@dataclass
class SparseOptimConfig:
    """Optimizer for the embedding table, applied to the touched rows only."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad"] = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    weight_decay: float = 0.0
    """L2 on the embedding rows, lazily: ``weight_decay * w[r]`` is added to the gradient of every
    row r a batch touches (rows a batch does not use are left alone: no dense pass over the tables)."""


@dataclass
class ScheduleConfig:
    """Learning-rate multiplier: linear warm-up, then constant, then decay to end_factor."""

    warmup_steps: int = 0
    decay: Literal["none", "linear", "cosine"] = "none"
    decay_start_step: int = 0
    """Step at which decay begins (after warm-up)."""
    decay_steps: int = 0
    """Steps over which the multiplier falls to end_factor (0 = to the end of training)."""
    end_factor: float = 0.0


@dataclass
class OptimConfig:
    dense: DenseOptimConfig = field(default_factory=DenseOptimConfig)
    sparse: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class CompileConfig:
    """torch.compile settings; in JSON, `train.compile` may also be just true, false or "auto"."""

    enabled: Union[bool, Auto] = True
    """true, false, or "auto": compiled on CUDA, eager on the CPU (dlrm.train.fast_path)."""
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """reduce-overhead uses CUDA graphs (CUDA only)."""
    fullgraph: bool = False
    """Fail instead of splitting the graph at a break."""


@dataclass
class ProfileConfig:
    """torch.profiler schedule and options (short, small traces by default)."""

    enabled: bool = True
    wait: int = 5
    warmup: int = 3
    active: int = 5
    repeat: int = 1
    record_shapes: bool = True
    profile_memory: bool = False
    with_stack: bool = False


@dataclass
class EarlyStoppingConfig:
    """Stop training when the evaluation metric has not improved for `patience` evaluations in a row
    (evaluations every ``train.eval_every`` steps); the best evaluation's checkpoint is best.pt."""

    metric: Literal["auc", "logloss"] = "auc"
    """What "better" means: higher AUC, or lower logloss."""
    patience: int = 3
    """Evaluations without an improvement of more than `min_delta` before training stops."""
    min_delta: float = 0.0
    """The smallest change that counts as an improvement."""


@dataclass
class TrainConfig:
    """The loop: length, precision, device, evaluation and logging cadence."""

    epochs: int = 1
    max_steps: Optional[int] = None
    """Stop after this many steps even if epochs remain."""
    eval_every: Optional[int] = None
    """Evaluate every N steps (always at the end). The best evaluation's model is kept as
    checkpoints/best.pt, which --eval-only and --export use when given the run directory."""
    early_stopping: Optional[EarlyStoppingConfig] = None
    """null (train to the end), or when to stop early (needs eval_every)."""
    baseline: Union[bool, Auto] = "auto"
    """Also fit an L2 logistic regression on the same split, loader and hashing after training and
    report its AUC/logloss next to the DLRM's (`dlrm.train.baseline`); "auto": on when the train
    split has at most 2,000,000 rows and the run is one process."""
    log_every: int = 50
    """Steps between host syncs for logging (loss, samples/s)."""
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    """fp32: IEEE fp32 everywhere. tf32: fp32 weights and activations, matmuls on TF32 tensor cores
    (CUDA only; ~10-bit mantissa products, fp32 accumulation; a no-op on the CPU). bf16: autocast
    to bfloat16 (fp32 weights and optimizer state)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    deterministic: bool = False
    """torch.use_deterministic_algorithms and deterministic kernels."""
    compile: Union[bool, Auto, CompileConfig] = "auto"
    """false, true, "auto" (compiled on CUDA, eager on the CPU), or {"enabled": ..., "mode": ...,
    "fullgraph": ...}; normalised to a CompileConfig."""
    cuda_graph: Union[bool, Auto] = "auto"
    """Capture the whole training step (forward, backward, the Triton embedding's fused update, the
    dense optimizer) in one CUDA graph after 3 warm-up steps and replay it: no per-step host launch
    cost, which bounds small batches. Needs kernels.embedding "triton", a fused dense optimizer (sgd
    or adam) and compile mode other than reduce-overhead; on the CPU it is ignored with a warning.
    "auto": on when the run allows it on CUDA (dlrm.train.fast_path says why not otherwise)."""


@dataclass
class KernelsConfig:
    """Which implementation each component uses. "auto" (the default) takes the fastest one measured
    correct on the run's device (dlrm.train.fast_path: on CUDA the Triton embedding and dot
    interaction, PyTorch MLPs and loss; on the CPU PyTorch everywhere); "torch" or "triton" force one."""

    embedding: KernelChoice = "auto"
    interaction: KernelChoice = "auto"
    mlp: KernelChoice = "auto"
    loss: KernelChoice = "auto"


@dataclass
class LogConfig:
    tb_dir: str = "tb_logs"
    """Root of the TensorBoard runs."""
    run_name: Optional[str] = None
    """Run directory name under tb_dir; default: <config name>-<date>-<time>."""


@dataclass
class CheckpointConfig:
    """When to write checkpoints into tb_logs/<run>/checkpoints/ (always at the end of training)."""

    every: Optional[int] = None
    """Steps between checkpoints; None writes only the final one."""
    keep: int = 3
    """Newest checkpoints kept; older ones are deleted after a new one is complete."""


@dataclass
class DistributedConfig:
    """Multi-process training under ``torchrun --nproc-per-node N`` (ignored in a single process).

    The MLPs are replicated with DistributedDataParallel; the embedding tables are sharded and
    the lookups exchanged with all_to_all (`dlrm.distributed.sharded_embedding`).
    """

    sharding: Literal["auto", "table", "row"] = "auto"
    """table: every table whole on one rank (tables spread to balance rows); row: every table's
    rows split into one block per rank; auto: table-wise, except tables with at least
    `row_wise_min_rows` rows, which are split row-wise."""
    row_wise_min_rows: int = 10_000_000
    """The table size from which "auto" shards a table row-wise."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto: nccl on CUDA, gloo on the CPU."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    profile: Union[bool, ProfileConfig] = False
    """false, true, or the profiler settings; normalised to a ProfileConfig."""
    name: str = "run"
    """Short name of the config (defaults to the file's stem)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading and validation

MAX_CONFIG_BYTES = 16 << 20
"""A config file larger than this is refused unread (real ones are a few KB)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_SIZE = 2**31 - 1
"""Upper bound of widths, batch sizes and table sizes: larger values cannot be allocated, and
some would overflow the int64 element counts torch computes, failing with a confusing error."""
_MAX_INT_TEXT = 40
"""JSON integers with more characters than this are not converted (Python refuses above 4300
digits, and anything this long is out of int64 range anyway)."""


class _HugeInt:
    """Stands in for a JSON integer too long to convert, so the error can name its key."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


def _parse_int(text: str) -> Any:
    """json's parse_int: an int, or a `_HugeInt` for text too long to convert safely."""
    return int(text) if len(text) <= _MAX_INT_TEXT else _HugeInt(text)


def _show(value: Any, limit: int = 80) -> str:
    """repr() of a user-given value for an error message: one line, at most ~`limit` characters,
    and never an exception of its own (huge ints and deep nesting make repr() raise)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_MAX_INT_TEXT:
        return f"<integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # too deep, or holds an int beyond Python's int->str limit
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "an object"
    if tp is bool:
        return "true/false"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against type `tp`; return it (dataclasses built recursively)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {_show(value)}")
        return _build(tp, value, key)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:  # Optional[X]: X's own message is the precise one
            return _convert(value, non_null[0], key)
        for arg in non_null:  # an object goes to the dataclass member, whose message names the inner key
            if isinstance(value, dict) and dataclasses.is_dataclass(arg):
                return _convert(value, arg, key)
        for arg in non_null:
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {_show(value)} is not {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp) or isinstance(value, bool):
            raise ConfigError(f"{key}: {_show(value)} is not one of {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {_show(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        return _convert_int(value, key)
    if tp is float:
        return _convert_float(value, key)
    if tp is str:
        return _convert_str(value, key)
    raise TypeError(f"unsupported config type {tp!r} at {key}")  # a bug in this module, not user input


def _convert_int(value: Any, key: str) -> int:
    """An integer within int64 (every integer ends up in a tensor, a numpy array or a C API)."""
    if isinstance(value, _HugeInt):
        raise ConfigError(f"{key}: {value!r} is out of range (integers must fit in int64)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {_show(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"{key}: {_show(value)} is out of range (integers must fit in int64)")
    return value


def _convert_float(value: Any, key: str) -> float:
    """A number that is finite in float32, the precision every float setting is used in."""
    if isinstance(value, _HugeInt):
        raise ConfigError(f"{key}: {value!r} overflows float32 (|x| must be <= 3.4e38)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise ConfigError(f"{key}: {_show(value)} overflows float32 (|x| must be <= 3.4e38)") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}: {number!r} must be a finite number")
    if abs(number) > FLOAT32_MAX:
        raise ConfigError(f"{key}: {number!r} overflows float32 (|x| must be <= 3.4e38)")
    return number


def _convert_str(value: Any, key: str) -> str:
    """A string that can become a file name or a log line (no NUL, no lone surrogate)."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{key}: {_show(value)} is not valid Unicode text") from None
    if "\0" in value:
        raise ConfigError(f"{key}: {_show(value)} must not contain a NUL character")
    return value


def _as_float32(value: float) -> float:
    """`value` rounded to float32 (the caller has checked it is within float32 range)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        # A key with a newline or other unprintable character is shown quoted, so the error stays one line.
        shown = key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else _show(key)
        path = f"{prefix}.{shown}" if prefix else shown
        if key not in names:
            raise ConfigError(f"{path}: unknown key (expected one of {', '.join(sorted(names))})")
        kwargs[key] = _convert(value, hints[key], path)
    return cls(**kwargs)


def _positive(key: str, value: Any, allow_zero: bool = False, maximum: Optional[int] = None) -> None:
    """Raise unless `value` (None passes) is > 0 (>= 0 with `allow_zero`) and at most `maximum`.

    A float that must be > 0 must also stay > 0 in float32, where it is used: 1e-50 would
    silently become 0 there (a zero learning rate or a division by a zero eps).
    """
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} must be a finite number")
    if not (value > 0 or (allow_zero and value == 0)):
        raise ConfigError(f"{key}: {value!r} must be {'>= 0' if allow_zero else '> 0'}")
    if isinstance(value, float) and not allow_zero and _as_float32(value) == 0:
        raise ConfigError(f"{key}: {value!r} underflows to 0 in float32 (must be >= 1.4e-45)")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}: {value!r} must be <= {maximum}")


def _check_interaction(m: "ModelConfig") -> None:
    """Both interactions stack the bottom MLP's output with the F embeddings into [B, F+1, D]
    (`dlrm.model.archs.InteractionArch`), so its last width must be D for "cat" as for "dot"."""
    if m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(
            f"model.bottom_mlp[-1]: {m.bottom_mlp[-1]} must equal model.embedding_dim ({m.embedding_dim}) "
            f"for the {m.interaction} interaction (the dense vector is stacked with the embeddings)"
        )


def validate(cfg: Config) -> Config:
    """Cross-field and range checks; raises `ConfigError` naming the first bad key."""
    if isinstance(cfg.train.compile, (bool, str)):  # true | false | "auto"
        cfg.train.compile = CompileConfig(enabled=cfg.train.compile)
    if isinstance(cfg.profile, bool):
        cfg.profile = ProfileConfig(enabled=cfg.profile)
    p = cfg.profile
    _positive("profile.wait", p.wait, allow_zero=True)
    _positive("profile.warmup", p.warmup, allow_zero=True)
    _positive("profile.active", p.active)
    _positive("profile.repeat", p.repeat, allow_zero=True)
    d, m, o, t = cfg.data, cfg.model, cfg.optim, cfg.train
    _positive("data.batch_size", d.batch_size, maximum=MAX_SIZE)
    _positive("data.eval_batch_size", d.eval_batch_size, maximum=MAX_SIZE)
    _positive("data.shuffle_buffer_rows", d.shuffle_buffer_rows, maximum=MAX_SIZE)
    _positive("data.prefetch", d.prefetch, maximum=MAX_SIZE)
    if not 0.0 < d.gpu_memory_share <= 1.0:
        raise ConfigError(f"data.gpu_memory_share: {d.gpu_memory_share!r} must be within (0, 1]")
    _positive("data.max_rows_per_table", d.max_rows_per_table, maximum=MAX_SIZE)
    _positive("model.embedding_dim", m.embedding_dim, maximum=MAX_SIZE)
    _positive("model.top_mlp_input_multiple", m.top_mlp_input_multiple, maximum=MAX_SIZE)
    for name in ("bottom_mlp", "top_mlp"):
        widths = getattr(m, name)
        if not widths:
            raise ConfigError(f"model.{name}: must list at least one layer width")
        for i, w in enumerate(widths):
            _positive(f"model.{name}[{i}]", w, maximum=MAX_SIZE)
    _check_interaction(m)
    if m.top_mlp[-1] != 1:
        raise ConfigError(f"model.top_mlp[-1]: {m.top_mlp[-1]} must be 1 (the logit)")
    if m.cardinalities is not None:
        if len(m.cardinalities) != NUM_SPARSE:
            raise ConfigError(f"model.cardinalities: has {len(m.cardinalities)} entries, expected {NUM_SPARSE}")
        for i, c in enumerate(m.cardinalities):
            _positive(f"model.cardinalities[{i}]", c, maximum=MAX_SIZE)
    for key, opt in (("optim.dense", o.dense), ("optim.sparse", o.sparse)):
        _positive(f"{key}.lr", opt.lr)
        _positive(f"{key}.eps", opt.eps)
    _positive("optim.dense.momentum", o.dense.momentum, allow_zero=True)
    _positive("optim.dense.weight_decay", o.dense.weight_decay, allow_zero=True)
    _positive("optim.sparse.weight_decay", o.sparse.weight_decay, allow_zero=True)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout: {m.dropout!r} must be within [0, 1)")
    s = o.schedule
    for key in ("warmup_steps", "decay_start_step", "decay_steps"):
        _positive(f"optim.schedule.{key}", getattr(s, key), allow_zero=True)
    if not (0.0 <= s.end_factor <= 1.0):
        raise ConfigError(f"optim.schedule.end_factor: {s.end_factor!r} must be within [0, 1]")
    if t.cuda_graph is True:  # "auto" turns itself off where these rules say no (dlrm.train.fast_path)
        if cfg.kernels.embedding != "triton":
            raise ConfigError("train.cuda_graph: needs kernels.embedding \"triton\" (the torch embedding's sparse "
                              "gradients have data-dependent shapes, which a CUDA graph cannot replay)")  # fmt: skip
        if o.dense.name not in ("sgd", "adam"):
            raise ConfigError(f"train.cuda_graph: needs optim.dense.name \"sgd\" or \"adam\", not {o.dense.name!r} "
                              "(torch has no fused CUDA Adagrad, whose learning rate a graph could replay)")  # fmt: skip
        if o.dense.fused is False:
            raise ConfigError("train.cuda_graph: needs optim.dense.fused true or null (the fused optimizer reads "
                              "its learning rate from a device tensor the graph can replay)")  # fmt: skip
        if t.compile.enabled is not False and t.compile.mode == "reduce-overhead":
            raise ConfigError("train.cuda_graph: cannot be combined with train.compile.mode \"reduce-overhead\" "
                              "(its CUDA graphs would be captured inside this one); use mode \"default\"")  # fmt: skip
    if not 0 <= t.seed <= INT64_MAX:  # numpy's SeedSequence refuses negatives; torch's seed is 64-bit
        raise ConfigError(f"train.seed: {t.seed} must be within [0, 2**63)")
    _positive("train.epochs", t.epochs)
    _positive("train.max_steps", t.max_steps)
    _positive("train.eval_every", t.eval_every)
    if t.early_stopping is not None:
        if t.eval_every is None:
            raise ConfigError("train.early_stopping: needs train.eval_every (it stops after evaluations)")
        _positive("train.early_stopping.patience", t.early_stopping.patience)
        _positive("train.early_stopping.min_delta", t.early_stopping.min_delta, allow_zero=True)
    _positive("train.log_every", t.log_every)
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("distributed.row_wise_min_rows", cfg.distributed.row_wise_min_rows)
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"name: {cfg.name!r} must be a non-empty name without '/'")
    if cfg.log.run_name is not None and (not cfg.log.run_name or "/" in cfg.log.run_name or cfg.log.run_name in (".", "..")):
        raise ConfigError(f"log.run_name: {cfg.log.run_name!r} must be a plain directory name")
    return cfg


def config_from_dict(raw: dict[str, Any], source: str = "<config>") -> Config:
    """Build and validate a `Config`; errors are prefixed with `source`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    try:
        return validate(_build(Config, raw, ""))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def read_config_bytes(path: Path) -> bytes:
    """The file's bytes; a missing, unreadable or oversized file is a one-line `ConfigError`."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (or not a regular file)")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size:,} bytes is too large for a config file (at most {MAX_CONFIG_BYTES:,})")
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None


def parse_config_bytes(data: bytes, source: str) -> dict[str, Any]:
    """Decode UTF-8 JSON holding an object; every malformation is a one-line `ConfigError`.

    Integers too long to convert become `_HugeInt` placeholders (rejected by `config_from_dict`
    with their key); NaN and Infinity literals become floats that it rejects the same way.
    """
    try:
        text = data.decode("utf-8-sig")  # a leading BOM (some Windows editors write one) is harmless
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line} column {column})") from None
    try:
        raw = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid config: JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    return raw


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any], source: str) -> None:
    """Set dotted keys (e.g. {"data.batch_size": 64}) in the raw config, creating parent objects."""
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            child = node.get(p)
            if child is None or isinstance(child, bool) or child == "auto":  # `"compile": true` means {"enabled": true}
                child = node[p] = {} if child is None else {"enabled": child}
            node = child
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {p}: expected an object, got {_show(node)}")
        node[leaf] = value


def load_config(path: str | Path, overrides: Optional[dict[str, Any]] = None) -> Config:
    """Read a JSON config file, apply dotted-key `overrides` (e.g. {"data.batch_size": 64}), validate."""
    path = Path(path)
    raw = parse_config_bytes(read_config_bytes(path), str(path))
    raw.setdefault("name", path.stem)
    apply_overrides(raw, overrides or {}, str(path))
    return config_from_dict(raw, str(path))


def config_keys() -> set[str]:
    """Every dotted key of `Config` after normalisation: leaves ("optim.dense.lr",
    "train.compile.mode") and the sections holding them ("optim.dense", "optim"). These are
    the names `--allow-config-change` accepts (a section stands for all its keys)."""
    return set(_dotted_keys(Config, ""))


def _dotted_keys(cls: type, prefix: str):
    """Yield the dotted keys under dataclass `cls`, sections included; a `bool | Dataclass`
    field is a section (validate() normalises the bool into the dataclass)."""
    for name, tp in typing.get_type_hints(cls).items():
        dotted = f"{prefix}{name}"
        yield dotted
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if nested:
            yield from _dotted_keys(nested[0], dotted + ".")
