"""Typed run configuration: one dataclass per concern, loaded from JSON and validated.

Every error names the key path and the offending value in one line, e.g.
``configs/x.json: optim.dense.lr: -1.0 must be > 0``, and is raised before any work starts.
The file is untrusted: bytes that are not UTF-8, JSON nested too deeply, integers beyond int64
(or Python's int->str limit), floats that are not finite in float32 (or, where they must be
> 0, underflow to 0 there), NaN/Infinity literals and strings holding NUL are all such errors.
This is the only module that reads a config file; everything else receives `Config` objects.
The JSON decoding and per-value type checks are in `dlrm.config_parse`; the range and
cross-field checks (one function per section) in `dlrm.config_checks`, which `validate` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

# The JSON decoding and value conversion live in dlrm.config_parse (which reads no file); its
# names are re-exported here, where callers and tests have always found them.
from dlrm.config_parse import (  # noqa: F401
    _MAX_INT_TEXT,
    FLOAT32_MAX,
    INT64_MAX,
    INT64_MIN,
    _as_float32,
    _build,
    _convert,
    _convert_float,
    _convert_int,
    _convert_str,
    _HugeInt,
    _parse_int,
    _show,
    _type_name,
    parse_config_bytes,
)
from dlrm.config_checks import (  # noqa: F401 - re-exported
    COMPILE_MODES_WITH_CUDA_GRAPHS,
    MAX_SIZE,
    check_inert_keys,
    check_sections,
)

Activation = Literal["relu", "sigmoid", "gelu", "squared_relu", "none"]
KernelChoice = Literal["auto", "torch", "triton"]
InteractionKernelChoice = Literal["auto", "torch", "triton", "gluon"]  # gluon: the DCN cross layer (kernels.cross_ws_op)
MlpKernelChoice = Literal["auto", "torch", "triton", "fused", "wgrad"]
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
    such buffers live on the device, 264 bytes a row); a split smaller than this is shuffled as a whole. The
    evaluation loaders (unshuffled) decode buffers of this size too."""
    prefetch: int = 3
    """Shuffle buffers decoded ahead by the background threads (about shuffle_buffer_rows rows each); on CUDA the
    next is also copied to the device on a side stream while the current one is cut into batches. Costs prefetch + 1
    pinned host arenas of 165 bytes a row (269 with int64 sparse values, ~910 for MLPerf's rows); 3 since 2026-11-29."""
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
    """Cap on each embedding table's rows (modulus hashing folds larger tables to it; a vocabulary-hashed dataset's
    tables must be within it); None keeps the dataset's sizes."""


@dataclass
class ModelConfig:
    """DLRM shape (TorchRec notation: B batch, F sparse features, D embedding dim)."""

    embedding_dim: int = 16
    """D: width of every embedding row and of the bottom MLP's output."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """Layer widths of the DenseArch after the 13 dense inputs; the last must equal embedding_dim."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])
    """Layer widths of the OverArch; the last must be 1 (the logit)."""
    interaction: Literal["dot", "cat", "dcn"] = "dot"
    """dot: dense vector + strictly-lower-triangle pairwise dots; cat: plain concatenation; dcn: the
    concatenation [B, (F+1) D] through a low-rank cross network (DCNv2, TorchRec's LowRankCrossNet:
    ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``), output as wide as its input."""
    cross_layers: int = 3
    """dcn: cross layers (MLPerf DLRM-DCNv2: 3)."""
    cross_rank: int = 512
    """dcn: rank r of each layer's W_l [(F+1) D, r] V_l [r, (F+1) D] factorisation (MLPerf: 512). A rank at or above
    the width (F+1) D saves nothing over a full-rank layer, and a run says so at its start (D = 8: 216 wide)."""
    activation: Activation = "relu"
    """Activation between MLP layers (none after the last OverArch layer)."""
    top_mlp_input_multiple: int = 1
    """Zeros appended to the interaction output up to a multiple of this (8: 367 -> 368, 479 -> 480): an
    aligned top-MLP GEMM, the same function (the extra weights get zero gradients); 1: none. The Kaggle
    and Terabyte configs set 8 (Kaggle bf16 1.613 -> 1.543 ms a step; PERF.md, eleventh run)."""
    bottom_mlp_input_multiple: int = 1
    """The same for the 13 dense inputs (8: 13 -> 16); no gain measured, so the configs leave it at 1."""
    cardinalities: Optional[list[int]] = None
    """Table sizes for runs without a dataset (synthetic benchmarks); a dataset's metadata wins otherwise."""
    multi_hot_sizes: Optional[list[int]] = None
    """Values per sample of each sparse feature (26 ints; MLPerf DLRM-DCNv2: 3, 2, 1, 2, 6, ...: 214
    lookups a sample), each feature's values sum-pooled into one embedding. For runs without a
    dataset (synthetic benchmarks); a dataset's metadata (``multi_hot_sizes``) wins otherwise.
    None: one value per feature (the 2019 DLRM), unless the dataset says otherwise."""
    embedding_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage of the embedding tables. "bf16" halves their memory and traffic (MLPerf's 204M x 128
    tables are 104 GB in fp32, 52 GB in bf16: only bf16 fits one 80 GB H100); the lookup accumulates
    in fp32 and the fused sparse update computes in fp32 and writes back with stochastic rounding
    (unbiased), so small updates are not lost to bf16's 8-bit mantissa. Needs kernels.embedding
    "triton" (the kernel that rounds stochastically)."""
    dropout: float = 0.0
    """Dropout probability between MLP layers (after each hidden layer's activation, in the bottom
    and the top MLP; never on the logit); 0 turns it off. Training only: evaluation sees the whole net."""


@dataclass
class DenseOptimConfig:
    """Optimizer for the MLP parameters."""

    name: Literal["sgd", "adagrad", "adam"] = "adam"
    """torch.optim's SGD, Adagrad (on CUDA, unless fused, its foreach twin without the host sync, which a captured
    step can hold: `dlrm.train.adagrad`, whether train.cuda_graph is on or not) or Adam over the MLPs' parameters."""
    lr: float = 1e-3
    """Base learning rate (optim.schedule scales it)."""
    eps: float = 1e-8
    """Adagrad's and Adam's term added to the denominator (SGD has none)."""
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 added to every gradient (torch.optim's ``weight_decay``, coupled, also for Adam)."""
    fused: Optional[bool] = None
    """torch.optim's fused implementation (one kernel for all parameters' update instead of a
    few per parameter group); None: fused for sgd and adam on CUDA (torch has no fused CUDA
    Adagrad), the default implementation otherwise."""


@dataclass
class SparseOptimConfig:
    """Optimizer for the embedding table, applied to the touched rows only."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad"] = "rowwise_adagrad"
    """sgd; adagrad (a sum per element, as big as the table); rowwise_adagrad (one sum per row: the mean of its
    squared gradient, as TorchRec's and MLPerf's)."""
    lr: float = 0.05
    """Base learning rate (optim.schedule scales it)."""
    eps: float = 1e-8
    """The Adagrads' term added to the denominator (SGD has none)."""
    weight_decay: float = 0.0
    """L2 on the embedding rows, lazily: ``weight_decay * w[r]`` is added to the gradient of every
    row r a batch touches (rows a batch does not use are left alone: no dense pass over the tables)."""


@dataclass
class ScheduleConfig:
    """Learning-rate multiplier: linear warm-up, then constant, then decay to end_factor."""

    warmup_steps: int = 0
    """Steps over which the multiplier rises linearly to 1 (step s of them: (s + 1) / warmup_steps); 0: none."""
    decay: Literal["none", "linear", "cosine"] = "none"
    """The shape of the fall from 1 to end_factor after decay_start_step."""
    decay_start_step: int = 0
    """Step at which decay begins, counted from step 0 (not from the warm-up's end): one below warmup_steps starts
    the decay inside the warm-up, whose end then drops the multiplier at once (facebookresearch/dlrm refuses that)."""
    decay_steps: int = 0
    """Steps over which the multiplier falls to end_factor (0 = to the end of training)."""
    end_factor: float = 0.0
    """The multiplier at the decay's end, kept after it."""


@dataclass
class OptimConfig:
    dense: DenseOptimConfig = field(default_factory=DenseOptimConfig)
    """The MLPs' (and the cross network's) optimizer."""
    sparse: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    """The embedding tables' optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """One learning-rate multiplier for both optimizers."""


@dataclass
class CompileConfig:
    """torch.compile settings; in JSON, `train.compile` may also be just true, false or "auto"."""

    enabled: Union[bool, Auto] = True
    """true, false, or "auto": compiled on CUDA, eager on the CPU (dlrm.train.fast_path)."""
    mode: Literal["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
                  "max-autotune-gemm"] = "auto"
    """reduce-overhead: CUDA graphs (CUDA only). max-autotune: Inductor's Triton GEMM templates (fused epilogues)
    timed against cuBLAS per shape at the first steps, every other kernel tuned, CUDA graphs; its -no-cudagraphs
    form and max-autotune-gemm (the GEMMs alone) combine with train.cuda_graph. "auto": dlrm.train.fast_path."""
    fullgraph: bool = False
    """Fail instead of splitting the graph at a break."""
    combo_kernels: Union[bool, Auto] = "auto"
    """Inductor's combo kernels (CUDA): independent small kernels (casts, sums) as one launch; "auto": fast_path."""




@dataclass
class ProfileConfig:
    """torch.profiler schedule and options (short, small traces by default)."""

    enabled: bool = True
    """Profile the run; false keeps the settings for a run given `--profile`."""
    wait: int = 5
    """Steps trained unprofiled before each cycle (the first steps compile and warm the caches)."""
    warmup: int = 3
    """Steps the profiler runs but discards before recording (its own start-up kept out of the trace)."""
    active: int = 5
    """Steps recorded in each cycle's trace (at least 1)."""
    repeat: int = 1
    """Cycles of wait + warmup + active steps, each its own trace file; 0: cycles until the run ends."""
    record_shapes: bool = True
    """Record each operator's input shapes (the trace's "Input Dims")."""
    profile_memory: bool = False
    """Record tensor allocations and frees (the trace's memory events; slower, larger traces)."""
    with_stack: bool = False
    """Record the Python stack of each operator (much larger traces)."""


@dataclass
class EarlyStoppingConfig:
    """Stop training when the evaluation metric has not improved for `patience` evaluations in a row, or when it
    reaches `target` (evaluations every ``train.eval_every`` steps); the best evaluation's checkpoint is best.pt."""

    metric: Literal["auc", "logloss"] = "auc"
    """What "better" means: higher AUC, or lower logloss."""
    patience: Optional[int] = 3
    """Evaluations without an improvement of more than `min_delta` before training stops; null: no plateau stop
    (then `target` must be set)."""
    min_delta: float = 0.0
    """An improvement is a change of more than this (strictly: with 0, any gain counts, a tie does not)."""
    target: Optional[float] = None
    """A quality target (MLPerf's time to train; DLRM-DCNv2: auc 0.80275): stop at the first evaluation with AUC >=
    target (metric auc, in (0, 1]) or logloss <= target (metric logloss, > 0); summary.json reports target_reached,
    target_step and time_to_target_s (training seconds, evaluations excluded). null: no target."""


@dataclass
class TrainConfig:
    """The loop: length, precision, device, evaluation and logging cadence."""

    epochs: int = 1
    """Passes over the train split (max_steps and min_steps may shorten or lengthen the run)."""
    max_steps: Optional[int] = None
    """Stop after this many steps even if epochs remain."""
    min_steps: Optional[int] = None
    """Train at least this many steps, with more epochs when the train split is small (a split of a
    few hundred rows is one batch an epoch); max_steps still caps it."""
    eval_every: Optional[int] = None
    """Evaluate every N steps (always at the end). The best evaluation's model is kept as
    checkpoints/best.pt, which --eval-only and --export use when given the run directory."""
    early_stopping: Optional[EarlyStoppingConfig] = None
    """null (train to the end), or when to stop early (needs eval_every)."""
    baseline: Union[bool, Auto] = "auto"
    """Also fit an L2 logistic regression on the same split, loader and hashing after training and report its
    AUC/logloss next to the DLRM's (`dlrm.train.baseline`); "auto": on one process, up to 2M train rows (CPU: 20k) of 26
    sparse values (multi-hot: as many values)."""
    log_every: int = 50
    """Steps between logging windows (loss, lr, samples/s), each read once the next step is queued: no drain."""
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    """fp32: IEEE fp32 everywhere. tf32: fp32 weights and activations, matmuls on TF32 tensor cores (CUDA only;
    ~10-bit mantissa products, fp32 accumulation; on the CPU a warning and fp32). bf16: autocast (fp32 weights and state)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA when there is a GPU, else the CPU; "cuda" without one is refused."""
    seed: int = 0
    """Seeds the initial weights, the shuffling, dropout (each rank its own stream) and the bf16 tables' stochastic
    rounding: a run is repeatable, bitwise on a GPU only under train.deterministic."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms and deterministic kernels (no Inductor combo kernels: they are timed)."""
    allow_swap: bool = False
    """On the CPU, count the host's free swap as memory the model may take: a model (tables, dense layers, optimizer
    state) larger than the available memory is refused before the build (exit 4, the line naming this key where swap
    would hold the rest) unless true, since a run whose tables are swapped crawls; beyond the memory and free swap
    together it is refused either way. No effect on CUDA."""
    check_host_memory: bool = True
    """On the CPU, refuse a training run, --eval-only or --export whose model (with its optimizers' state, or the
    checkpoint read beside it) exceeds the memory this process may take (exit 4, before the build). false: where that
    estimate is wrong for this system (memory the kernel would free that MemAvailable or the cgroup's usage does not
    count), the refusal is logged as a warning with its numbers and the run goes on, at the risk of the OOM killer
    ending it without a word. No effect on CUDA."""
    compile: Union[bool, Auto, CompileConfig] = "auto"
    """false, true, "auto" (compiled on CUDA, eager on the CPU), or {"enabled": ..., "mode": ...,
    "fullgraph": ...}; normalised to a CompileConfig."""
    cuda_graph: Union[bool, Auto] = "auto"
    """Capture the whole training step (forward, backward, the Triton embedding's fused update, the
    dense optimizer) in one CUDA graph after 3 warm-up steps and replay it: no per-step host launch
    cost, which bounds small batches. Needs kernels.embedding "triton" (or "torch" with train.compile),
    a fused dense optimizer (sgd or adam) or adagrad (dlrm.train.adagrad.CapturableAdagrad on CUDA) and a
    compile mode without CUDA graphs of its own (not reduce-overhead or max-autotune); on the CPU it
    is ignored with a warning.
    "auto": on when the run allows it on CUDA (dlrm.train.fast_path says why not otherwise)."""


@dataclass
class KernelsConfig:
    """Which implementation each component uses. "auto" (the default) takes the fastest one measured correct on the
    run's device (dlrm.train.fast_path: on CUDA the Triton embedding and dot interaction, on Hopper the Gluon DCN
    cross layer, PyTorch MLPs and loss; on the CPU PyTorch everywhere); "torch", "triton", "gluon" force one."""

    embedding: KernelChoice = "auto"
    """torch: PyTorch ops (sparse gradients and an eager sparse optimizer; compiled, the update in the backward,
    dlrm.model.fused_sparse); triton: the Triton lookup whose backward applies the update itself
    (kernels.embedding)."""
    interaction: InteractionKernelChoice = "auto"
    """torch: the eager dot products or cross network; triton: the Triton dot interaction, or the DCN cross layer
    with its epilogue fused (kernels.cross); gluon: the DCN cross layer as a warp-specialized Gluon kernel
    (Hopper, bf16)."""
    mlp: MlpKernelChoice = "auto"
    """torch: nn.Linear; triton: the Triton linear kernel per layer; fused: kernels.mlp.FusedMLP (cuBLASLt
    bias+ReLU epilogues, weight gradients on a side stream in 32 bits, in series in 16; relu, no dropout); wgrad:
    nn.Linear forward, dW and db from one Triton GEMM with the ReLU mask and bias sum fused (kernels.wgrad; relu)."""
    loss: KernelChoice = "auto"
    """torch: BCE with logits; triton: the fused sigmoid, BCE and gradient kernel (kernels.loss)."""


@dataclass
class LogConfig:
    tb_dir: str = "tb_logs"
    """Root of the TensorBoard runs."""
    run_name: Optional[str] = None
    """Run directory name under tb_dir; default: <config name>-<date>-<time>."""
    sweep_keys: Optional[list[str]] = None
    """Set by ``python -m dlrm.sweep`` on its trials: the swept keys, which the run's HParams session names beside its
    own columns, in the sweep's experiment (`dlrm.train.reporting.session_hparams`); None: a run of its own."""


@dataclass
class CheckpointConfig:
    """When to write checkpoints into tb_logs/<run>/checkpoints/ (always at the end of training)."""

    every: Optional[int] = None
    """Steps between checkpoints; None writes only the final one."""
    keep: int = 3
    """Newest checkpoints kept; older ones are deleted after a new one is complete."""
    check_room: bool = True
    """Before the first step, refuse a run whose disk cannot hold its first checkpoint (exit 2; a later one: a
    warning naming its step), weighed from the model's and optimizers' state and the free bytes of checkpoints/
    (`dlrm.train.checkpoint_room`). false: warn instead, where the free bytes do not say what a file will take."""


@dataclass
class DistributedConfig:
    """Multi-process training under ``torchrun --nproc-per-node N`` (ignored in one process: train.py names the keys
    set in a warning): the MLPs replicated with DDP, the tables sharded, lookups exchanged with all_to_all
    (`dlrm.distributed`)."""

    sharding: Literal["auto", "table", "row"] = "auto"
    """table: every table whole on one rank (spread as `balance` says); row: every table's rows split
    into one block per rank; auto: tables of `row_wise_min_rows` rows or more row-wise as `balance` says."""
    balance: Literal["cost", "lookups", "rows"] = "cost"
    """cost: tables placed, and in "auto" big ones split, for the least step cost (busiest rank's lookups and
    pooled features sent) within 75% of GPU memory (`dlrm.distributed.sharding`); lookups: lookups even, every
    big table split (2026-11-28); rows: the rows even, every big table split (before); checkpoints need theirs."""
    row_wise_min_rows: int = 10_000_000
    """The table size from which "auto" may shard a table row-wise."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto: nccl on CUDA, gloo on the CPU."""
    timeout_s: Optional[float] = None
    """Seconds a rank waits in a collective (and for the others to join) before it stops: a peer rank that hangs
    (stopped, deadlocked, its host frozen) or, on NCCL, died. gloo: one line, exit 5; NCCL: its watchdog aborts the
    rank, naming the collective. null: torch's default (10 minutes on NCCL, 30 on gloo). Set it above the longest
    time one rank may spend alone while the others wait: a checkpoint's writes, rank 0's summary, compile."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """The dataset and how it is loaded."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The DLRM's shape (a dataset's metadata.json gives the table sizes and values a sample)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The dense and sparse optimizers and the learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """The implementation of each component."""
    log: LogConfig = field(default_factory=LogConfig)
    """Where the run's directory goes and what it is called."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written and how many are kept."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Several processes under torchrun."""
    profile: Union[bool, ProfileConfig] = False
    """false, true, or the profiler settings; normalised to a ProfileConfig (`--profile` turns it on)."""
    name: str = "run"
    """Short name of the config (defaults to the file's stem)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading and validation

MAX_CONFIG_BYTES = 16 << 20
"""A config file larger than this is refused unread (real ones are a few KB)."""


def validate(cfg: Config) -> Config:
    """Cross-field and range checks, section by section in a fixed order; raises `ConfigError` naming the first
    bad key. Normalises the bool/"auto" shorthands of `train.compile` and `profile` into their dataclasses."""
    if isinstance(cfg.train.compile, (bool, str)):  # true | false | "auto"
        cfg.train.compile = CompileConfig(enabled=cfg.train.compile)
    if isinstance(cfg.profile, bool):
        cfg.profile = ProfileConfig(enabled=cfg.profile)
    check_sections(cfg)
    unknown = [k for k in cfg.log.sweep_keys or () if k not in config_keys()]
    if unknown:  # (an HParams column of nothing: its value is looked up in the config at the run's end)
        raise ConfigError(f"log.sweep_keys: {unknown[0]!r} is not a config key")
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




def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any], source: str) -> None:
    """Set dotted keys (e.g. {"data.batch_size": 64}) in the raw config, creating parent objects.

    A section given in its short form (`"compile": true` means {"enabled": true}) is expanded; a parent the file
    gives a value its type does not take is the error the file alone gets (never hidden by the override).
    A section is set before the keys inside it, so both apply in any order ({"optim.dense.lr": 0.5, "optim.dense":
    {...}}: the section applied second used to replace the key); values are copied, never written into."""
    for dotted, value in sorted(overrides.items(), key=lambda item: item[0].count(".")):  # stable: same depth, as given
        value = copy.deepcopy(value)  # a key inside it is written below: the caller's (a sweep grid's shared) object
        node = raw
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            child = node.get(p)
            if p in node and not isinstance(child, dict):
                section = ".".join(parents[: i + 1])
                # a section the overrides set too (a sweep's --set train=5 beside its train.seed): theirs, not the
                # file's
                child = _short_form(child, section, "command line" if section in overrides else source)
            node[p] = {} if child is None else child
            node = node[p]
        node[leaf] = value


def _short_form(value: Any, path: str, source: str) -> Optional[dict[str, Any]]:
    """The object that the file's non-object `value` of section `path` stands for: None for a null the section
    allows (an absent optional section), {"enabled": value} for a shorthand such as `"compile": "auto"`."""
    tp = _field_type(path)
    section = next((a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)), None)
    try:
        if section is None:
            raise ConfigError(f"{path}: expected an object, got {_show(value)}")
        _convert(value, tp, path)  # a value the section does not take: the file's own error
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return None if value is None else {"enabled": value}


def _field_type(dotted: str) -> Any:
    """The declared type of `Config`'s dotted key `dotted` (None where there is no such key)."""
    tp: Any = Config
    for name in dotted.split("."):
        cls = next((a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)), None)
        hints = typing.get_type_hints(cls) if cls is not None else {}
        if name not in hints:
            return None
        tp = hints[name]
    return tp


def load_config(path: str | Path, overrides: Optional[dict[str, Any]] = None,
                inert_keys: Optional[Literal["refuse", "warn"]] = None, decided: tuple[str, ...] = ()) -> Config:
    """Read a JSON config file, apply dotted-key `overrides` (e.g. {"data.batch_size": 64}), validate.

    `inert_keys` (a training run of train.py): a key the file or the overrides set that cannot act under the rest of
    the config (`dlrm.config_checks.check_inert_keys`) is refused, or only logged ("warn"); None checks nothing.
    `decided`: keys the run's mode sets itself (--compare's variants), whose dependent keys are not checked."""
    path = Path(path)
    raw = parse_config_bytes(read_config_bytes(path), str(path))
    given = copy.deepcopy(raw) if inert_keys else {}  # the file's own keys (overrides are written into `raw`)
    raw.setdefault("name", path.stem)
    apply_overrides(raw, overrides or {}, str(path))
    try:
        cfg = config_from_dict(raw, str(path))
    except ConfigError as e:
        raise _blame_overrides(e, str(path), overrides or {}) from None
    if inert_keys:
        check_inert_keys(cfg, given, overrides or {}, str(path), refuse=inert_keys == "refuse", decided=decided)
    return cfg


def _blame_overrides(error: ConfigError, source: str, overrides: dict[str, Any]) -> ConfigError:
    """A value that came from the command line (an override) is named as such, not as the config file's."""
    message, prefix = str(error), f"{source}: "
    rest = message[len(prefix):] if message.startswith(prefix) else None
    # "key[i]:" too: an element of a list the override gave (model.multi_hot_sizes[0]) was blamed on the file; and
    # "key.sub:", a key inside a section the override gave whole (a sweep's --set 'model={...}', which replaces the
    # file's section)
    if rest is not None and any(rest.startswith((f"{key}:", f"{key} ", f"{key}[", f"{key}.")) for key in overrides):
        return ConfigError(f"command line: {rest}")
    return error


def config_keys() -> set[str]:
    """Every dotted key of `Config` after normalisation: leaves ("optim.dense.lr",
    "train.compile.mode") and the sections holding them ("optim.dense", "optim"). These are
    the names `--allow-config-change` accepts (a section stands for all its keys)."""
    return set(_dotted_keys(Config, ""))


def closest_config_key(key: str, known: Optional[set[str]] = None) -> Optional[str]:
    """The config key (of `known`, default `config_keys`) a mistyped `key` most likely meant, None where none is
    close: the last parts are compared, a key of the same section first, the whole key only between equally close last
    parts. Compared whole, the shared section drove the match: "model.pooling" suggested model.bottom_mlp, and
    "model.mlp" kernels.mlp."""
    parent, _, leaf = key.rpartition(".")
    best = None
    for candidate in sorted(config_keys() if known is None else known):
        their_parent, _, their_leaf = candidate.rpartition(".")
        close = difflib.SequenceMatcher(None, leaf, their_leaf).ratio()
        if close >= 0.6:  # (difflib.get_close_matches' cutoff)
            score = (their_parent == parent, close, difflib.SequenceMatcher(None, key, candidate).ratio())
            if best is None or score > best[0]:
                best = (score, candidate)
    return None if best is None else best[1]


def _dotted_keys(cls: type, prefix: str):
    """Yield the dotted keys under dataclass `cls`, sections included; a `bool | Dataclass`
    field is a section (validate() normalises the bool into the dataclass)."""
    for name, tp in typing.get_type_hints(cls).items():
        dotted = f"{prefix}{name}"
        yield dotted
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if nested:
            yield from _dotted_keys(nested[0], dotted + ".")
