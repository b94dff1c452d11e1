"""The range and cross-field checks of a run configuration, one function per section (`check_sections` runs them in a
fixed order; `dlrm.config.validate` calls it after normalising the shorthands). Each raises `ConfigError` naming the
key and the value in one line. The dataclasses they check are `dlrm.config`'s (named here for types only)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from dlrm.config_parse import INT64_MAX, _as_float32
from dlrm.data.schema import MAX_MULTI_HOT_SIZE, NUM_SPARSE
from dlrm.errors import ConfigError

if TYPE_CHECKING:
    from dlrm.config import (
        Config,
        DataConfig,
        EarlyStoppingConfig,
        ModelConfig,
        OptimConfig,
        ProfileConfig,
        ScheduleConfig,
        TrainConfig,
    )

RUN_NAME = re.compile(r"[\w.+-]+")
"""What a run directory's name may hold: `dlrm.train.run_dir.run_name`'s rule, checked here with the config so that
a name the run would refuse fails before the dataset is read and the model built (it used to fail after)."""
MAX_NAME_BYTES = 255
"""A file name's limit on Linux file systems: a longer run name failed to create its directory (after the model was
built), leaving --tb-dir behind, created empty."""
DEFAULT_RUN_NAME_SUFFIX = len("-20261130-160000")
"""The "-<date>-<time>" that `name` gets when it becomes the default run name."""

COMPILE_MODES_WITH_CUDA_GRAPHS = ("reduce-overhead", "max-autotune")  # a whole-step graph cannot hold theirs

MAX_SIZE = 2**31 - 1
"""Upper bound of widths, batch sizes and table sizes: larger values cannot be allocated, and
some would overflow the int64 element counts torch computes, failing with a confusing error."""



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
    """Every interaction stacks the bottom MLP's output with the F embeddings into [B, F+1, D]
    (`dlrm.model.archs.InteractionArch`), so its last width must be D for "cat" and "dcn" as for
    "dot"; the cross network of "dcn" needs at least one layer of rank at least 1 (checked whatever
    the interaction, so a config never carries an impossible value)."""
    _positive("model.cross_layers", m.cross_layers, maximum=MAX_SIZE)
    _positive("model.cross_rank", m.cross_rank, maximum=MAX_SIZE)
    if m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(
            f"model.bottom_mlp[-1]: {m.bottom_mlp[-1]} must equal model.embedding_dim ({m.embedding_dim}) "
            f"for the {m.interaction} interaction (the dense vector is stacked with the embeddings)"
        )


def check_sections(cfg: "Config") -> None:
    """Every section's checks in a fixed order: the first bad key raises."""
    _check_profile(cfg.profile)
    _check_data(cfg.data)
    _check_model(cfg.model)
    _check_optimizers(cfg.optim)
    _check_regularization(cfg.optim, cfg.model)
    _check_schedule(cfg.optim.schedule)
    _check_cuda_graph(cfg)
    _check_embedding_dtype(cfg)
    _check_kernels(cfg)
    _check_train(cfg.train)
    _check_outputs(cfg)


def _check_profile(p: ProfileConfig) -> None:
    """The profiler schedule: step counts, `active` at least 1."""
    _positive("profile.wait", p.wait, allow_zero=True)
    _positive("profile.warmup", p.warmup, allow_zero=True)
    _positive("profile.active", p.active)
    _positive("profile.repeat", p.repeat, allow_zero=True)


def _check_data(d: DataConfig) -> None:
    """The dataset's path, sizes of batches and buffers, and the device-memory share of placement "auto"."""
    if d.path == "":  # Path("") is silently the working directory (an unset shell variable: --data "$DIR")
        raise ConfigError('data.path: empty path (a dataset directory; "." for the working directory)')
    _positive("data.batch_size", d.batch_size, maximum=MAX_SIZE)
    _positive("data.eval_batch_size", d.eval_batch_size, maximum=MAX_SIZE)
    _positive("data.shuffle_buffer_rows", d.shuffle_buffer_rows, maximum=MAX_SIZE)
    _positive("data.prefetch", d.prefetch, maximum=MAX_SIZE)
    if not 0.0 < d.gpu_memory_share <= 1.0:
        raise ConfigError(f"data.gpu_memory_share: {d.gpu_memory_share!r} must be within (0, 1]")
    _positive("data.max_rows_per_table", d.max_rows_per_table, maximum=MAX_SIZE)


def _check_model(m: ModelConfig) -> None:
    """The network's shape: widths, the interaction's and the logit's constraints, table sizes."""
    _positive("model.embedding_dim", m.embedding_dim, maximum=MAX_SIZE)
    for key in ("top_mlp_input_multiple", "bottom_mlp_input_multiple"):
        _positive(f"model.{key}", getattr(m, key), maximum=MAX_SIZE)
    for name in ("bottom_mlp", "top_mlp"):
        widths = getattr(m, name)
        if not widths:
            raise ConfigError(f"model.{name}: must list at least one layer width")
        for i, w in enumerate(widths):
            _positive(f"model.{name}[{i}]", w, maximum=MAX_SIZE)
    _check_interaction(m)
    if m.top_mlp[-1] != 1:
        raise ConfigError(f"model.top_mlp[-1]: {m.top_mlp[-1]} must be 1 (the logit)")
    if m.multi_hot_sizes is not None:
        if not isinstance(m.multi_hot_sizes, list) or len(m.multi_hot_sizes) != NUM_SPARSE:
            # what it got, as model.cardinalities' error says it ([3] * 25 read as if no list had been given)
            got = (f"{len(m.multi_hot_sizes)} entries" if isinstance(m.multi_hot_sizes, list)
                   else repr(m.multi_hot_sizes))
            raise ConfigError(f"model.multi_hot_sizes: must be a list of {NUM_SPARSE} positive integers, got {got}")
        for i, c in enumerate(m.multi_hot_sizes):
            _positive(f"model.multi_hot_sizes[{i}]", c, maximum=MAX_MULTI_HOT_SIZE)
    if m.cardinalities is not None:
        if len(m.cardinalities) != NUM_SPARSE:
            raise ConfigError(f"model.cardinalities: has {len(m.cardinalities)} entries, expected {NUM_SPARSE}")
        for i, c in enumerate(m.cardinalities):
            _positive(f"model.cardinalities[{i}]", c, maximum=MAX_SIZE)


def _check_optimizers(o: OptimConfig) -> None:
    """Learning rates and eps of both optimizers, and SGD's momentum."""
    for key, opt in (("optim.dense", o.dense), ("optim.sparse", o.sparse)):
        _positive(f"{key}.lr", opt.lr)
        _positive(f"{key}.eps", opt.eps)
    _positive("optim.dense.momentum", o.dense.momentum, allow_zero=True)


def _check_regularization(o: OptimConfig, m: ModelConfig) -> None:
    """Weight decay of both optimizers and the model's dropout (issue #21's regularizers)."""
    _positive("optim.dense.weight_decay", o.dense.weight_decay, allow_zero=True)
    _positive("optim.sparse.weight_decay", o.sparse.weight_decay, allow_zero=True)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout: {m.dropout!r} must be within [0, 1)")


def _check_schedule(s: ScheduleConfig) -> None:
    """Step counts of the learning-rate schedule and its final factor."""
    for key in ("warmup_steps", "decay_start_step", "decay_steps"):
        _positive(f"optim.schedule.{key}", getattr(s, key), allow_zero=True)
    if not (0.0 <= s.end_factor <= 1.0):
        raise ConfigError(f"optim.schedule.end_factor: {s.end_factor!r} must be within [0, 1]")


def _check_kernels(cfg: Config) -> None:
    if cfg.kernels.interaction == "gluon" and cfg.model.interaction != "dcn":
        raise ConfigError(f'kernels.interaction: "gluon" is the DCN cross layer\'s, not {cfg.model.interaction!r}\'s')
    if cfg.kernels.interaction == "triton" and cfg.model.interaction == "cat":
        # there is no Triton cat interaction: the model was built with the torch one while the log said triton
        raise ConfigError('kernels.interaction: "triton" has no kernel for model.interaction "cat" (only "dot" and '
                          '"dcn"); set kernels.interaction "torch" or "auto"')
    if cfg.kernels.mlp not in ("fused", "wgrad"):
        return
    if cfg.model.activation != "relu":
        raise ConfigError(f'kernels.mlp: "{cfg.kernels.mlp}" needs model.activation "relu", not {cfg.model.activation!r}')
    if cfg.model.dropout and cfg.kernels.mlp == "fused":
        raise ConfigError('kernels.mlp: "fused" has no dropout; set model.dropout 0 or kernels.mlp "torch"')


def _check_embedding_dtype(cfg: Config) -> None:
    """bf16 tables need the Triton embedding ("auto" is checked again once resolved, in dlrm.train.fast_path)."""
    if cfg.model.embedding_dtype == "bf16" and cfg.kernels.embedding == "torch":
        raise ConfigError('model.embedding_dtype: "bf16" needs kernels.embedding "triton" (its fused update '
                          "rounds stochastically; the torch embedding would lose small updates to bf16 rounding)")


def _check_cuda_graph(cfg: Config) -> None:
    """What an explicit `train.cuda_graph: true` needs ("auto" turns itself off where these rules
    say no, in dlrm.train.fast_path)."""
    o, t = cfg.optim, cfg.train
    if t.cuda_graph is not True:
        return
    if cfg.kernels.embedding == "torch" and t.compile.enabled is False:
        raise ConfigError("train.cuda_graph: needs kernels.embedding \"triton\", or \"torch\" with train.compile "
                          "(the eager torch embedding's sparse gradients have data-dependent shapes, which a CUDA "
                          "graph cannot replay; compiled, it updates its rows in the backward with static shapes)")  # fmt: skip
    if o.dense.name == "adagrad" and o.dense.fused is True:
        raise ConfigError("train.cuda_graph: optim.dense.fused true with adagrad (torch's fused Adagrad runs on the "
                          "CPU only); leave it null: dlrm.train.adagrad.CapturableAdagrad is used on CUDA")  # fmt: skip
    if o.dense.name != "adagrad" and o.dense.fused is False:
        raise ConfigError("train.cuda_graph: needs optim.dense.fused true or null (the fused optimizer reads "
                          "its learning rate from a device tensor the graph can replay)")  # fmt: skip
    if t.compile.enabled is not False and t.compile.mode in COMPILE_MODES_WITH_CUDA_GRAPHS:
        raise ConfigError(f"train.cuda_graph: cannot be combined with train.compile.mode \"{t.compile.mode}\" (its "
                          "CUDA graphs would nest in this one); use \"default\" or a max-autotune without them")


def _check_train(t: TrainConfig) -> None:
    """The loop's seed, length, evaluation cadence, early stopping and logging cadence."""
    if not 0 <= t.seed <= INT64_MAX:  # numpy's SeedSequence refuses negatives; torch's seed is 64-bit
        raise ConfigError(f"train.seed: {t.seed} must be within [0, 2**63)")
    _positive("train.epochs", t.epochs)
    _positive("train.max_steps", t.max_steps)
    _positive("train.min_steps", t.min_steps)
    _positive("train.eval_every", t.eval_every)
    if t.early_stopping is not None:
        if t.eval_every is None:
            raise ConfigError("train.early_stopping: needs train.eval_every (it stops after evaluations)")
        _positive("train.early_stopping.patience", t.early_stopping.patience)
        _positive("train.early_stopping.min_delta", t.early_stopping.min_delta, allow_zero=True)
        _check_target(t.early_stopping)
    _positive("train.log_every", t.log_every)
    if t.deterministic and t.compile.combo_kernels is True:
        raise ConfigError("train.compile.combo_kernels: true cannot run with train.deterministic (Inductor keeps the "
                          "combos that time faster, and refuses to time kernels in deterministic mode)")


def _check_target(e: "EarlyStoppingConfig") -> None:
    """At least one way to stop; a target the metric can reach (AUC in (0, 1], logloss > 0)."""
    if e.patience is None and e.target is None:
        raise ConfigError("train.early_stopping: patience and target are both null: set patience (stop on a "
                          "plateau), target (stop at a quality target) or both")
    if e.target is None:
        return
    auc = e.metric == "auc"
    if not math.isfinite(e.target) or e.target <= 0 or (auc and e.target > 1):
        raise ConfigError(f"train.early_stopping.target: {e.target!r} must be "
                          f"{'in (0, 1] for metric auc' if auc else '> 0 for metric logloss'}")


def _check_outputs(cfg: Config) -> None:
    """Checkpoint cadence, sharding threshold, and the names that become directory names."""
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("distributed.row_wise_min_rows", cfg.distributed.row_wise_min_rows)
    _positive("distributed.timeout_s", cfg.distributed.timeout_s, maximum=10**7)  # timedelta and C++ ms stay finite
    if cfg.distributed.timeout_s is not None and cfg.distributed.timeout_s < 1:  # torch rounds it to whole ms: 1e-4
        # was 0 ms, and every rank "did not join" at once, blaming the others
        raise ConfigError(f"distributed.timeout_s: {cfg.distributed.timeout_s!r} must be >= 1 (seconds)")
    if cfg.log.tb_dir == "":  # Path("") is the working directory: --tb-dir "" wrote the run there, silently
        raise ConfigError('log.tb_dir: empty path (the TensorBoard root; "." for the working directory)')
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"name: {cfg.name!r} must be a non-empty name without '/'")
    if cfg.log.run_name is not None and (not cfg.log.run_name or "/" in cfg.log.run_name or cfg.log.run_name in (".", "..")):
        raise ConfigError(f"log.run_name: {cfg.log.run_name!r} must be a plain directory name")
    if cfg.log.run_name is not None:
        if not RUN_NAME.fullmatch(cfg.log.run_name):
            raise ConfigError(f"log.run_name: {cfg.log.run_name!r} may hold only letters, digits and . _ + - "
                              "(it names the run's directory)")
        if len(cfg.log.run_name.encode()) > MAX_NAME_BYTES:
            raise ConfigError(f"log.run_name: a name of {len(cfg.log.run_name.encode())} bytes is too long for a "
                              f"directory name (at most {MAX_NAME_BYTES})")


def leading_name_problem(name: str, what: str, advice: str = "pick a name that does not") -> Optional[str]:
    """Why `name` (of a new run or sweep directory, `what` the key or flag that gave it) is refused, or None: one that
    begins with '.' was accepted, its directory then missing from ``ls tb_logs`` and from shell globs (``tb_logs/*``,
    which ``du``, ``tar``, ``rm`` are given) while TensorBoard and --resume still found it; one that begins with '-'
    was accepted too, its directory then read as options by the commands given its bare name (``cd tb_logs && rm -r
    -x`` is "rm: invalid option -- 'x'", ``ls -x`` lists the working directory in columns)."""
    if name.startswith("."):
        return f"{what}: {name!r} begins with '.', which hides its directory from ls and from shell globs such as " \
               f"tb_logs/*; {advice}"
    if name.startswith("-"):
        return f"{what}: {name!r} begins with '-', which commands given its directory's name (ls, rm) read as an " \
               f"option; {advice}"
    return None


def check_default_run_name(cfg: "Config") -> None:
    """A new run without `log.run_name` is named ``<name>-<date>-<time>``: `name` (the config file's stem unless set)
    must then be a valid start of a directory name; a `log.run_name` naming a new directory must not begin with '.'
    or '-' (`leading_name_problem`). Checked by `dlrm.cli` where a run directory is named: a new run, a branch,
    --compare and --eval-only (an export of a --checkpoint writes none, so a config file "my config.json" serves it);
    not for a run --resume continues in place, which exists already."""
    if cfg.log.run_name is not None:
        hidden = leading_name_problem(cfg.log.run_name, "log.run_name")
    else:  # (".x.json" named the run ".x-<date>-<time>", "-x.json" "-x-<date>-<time>")
        hidden = leading_name_problem(cfg.name, "name (the config file's name unless set, which begins the default "
                                     "run name)", 'set "name" or pass --run-name')
    if hidden:
        raise ConfigError(hidden)
    if cfg.log.run_name is not None:
        return
    if not RUN_NAME.fullmatch(cfg.name):
        raise ConfigError(f"name: {cfg.name!r} (the config file's name unless set) begins the default run name and "
                          'may hold only letters, digits and . _ + -; set "name" or pass --run-name')
    if len(cfg.name.encode()) + DEFAULT_RUN_NAME_SUFFIX > MAX_NAME_BYTES:
        raise ConfigError(f"name: a name of {len(cfg.name.encode())} bytes is too long to begin the default run name "
                          f"(at most {MAX_NAME_BYTES - DEFAULT_RUN_NAME_SUFFIX}); set a shorter \"name\" or pass --run-name")


def free_run_name(path: Path) -> str:
    """A name beside `path` that no directory holds now: ``<name>-2``, ``<name>-3``, ... (what an advice to "pick
    another --run-name" can name). A sweep's trial (``<sweep>/<setting>/seed-<k>``) keeps its
    whole name, ``seed-0-2``: ``seed-2`` was the sweep's own trial of seed 2, which a stopped sweep had not run yet (a
    run put there by that advice made `sweep --resume` refuse the trial)."""
    trial = re.fullmatch(r"seed-\d+", path.name) and (path.parent.parent / "sweep.json").is_file()
    # r-2's is r-3 (a date-time suffix stays)
    stem = path.name if trial else re.sub(r"-\d{1,3}$", "", path.name) or path.name
    stem = accepted_stem(stem)
    n = 2
    while os.path.lexists(path.parent / fitted_name(stem, f"-{n}")):
        n += 1
    return fitted_name(stem, f"-{n}")


def accepted_stem(stem: str) -> str:
    """`stem` without the leading '.' and '-' a new run's name may not begin with (`leading_name_problem`), or "run"
    when nothing else is left: an existing run named ``-x`` (made before such names were refused; it still resumes)
    was advised ``--run-name -x-2``, which the same command then refused."""
    return stem.lstrip(".-") or "run"


def fitted_name(stem: str, suffix: str) -> str:
    """``stem + suffix``, `stem` cut (on a character boundary) so the name fits a directory name
    (`MAX_NAME_BYTES`): a run name near the limit was advised a free name the file system refuses
    (ENAMETOOLONG)."""
    room = MAX_NAME_BYTES - len(os.fsencode(suffix))
    data = os.fsencode(stem)
    if len(data) > room:
        stem = data[:room].decode("utf-8", errors="ignore") or stem[:1]
    return stem + suffix


def export_name_problem(target: Path) -> Optional[str]:
    """Why `target` cannot name an export file, or None. Found only when the program was written (after a whole
    training run with --export), a name not in UTF-8 (torch's archive writer takes UTF-8 names: an AttributeError
    traceback, then an abort) or too long for a file name (ENAMETOOLONG) was a traceback, "a bug in dlrm"."""
    try:
        str(target).encode("utf-8")
    except UnicodeEncodeError:
        return f"--export: {str(target)!r} is not valid UTF-8, which torch.export.save cannot write; rename it"
    size = len(os.fsencode(target.name))
    if size > MAX_NAME_BYTES:
        return f"--export: a file name of {size} bytes is too long (at most {MAX_NAME_BYTES})"
    return None


# Config keys that act only where another key has one of some values (`dlrm.model.archs.InteractionArch` builds the
# cross network for "dcn" alone; `dlrm.train.optim.build_optimizers` gives momentum to SGD alone, eps to the others;
# `dlrm.train.optim.lr_multiplier` reads the decay's keys only once a decay is chosen; `dlrm.train.placement` weighs
# gpu_memory_share for placement "auto" alone; `dlrm.train.step` and `dlrm.train.profiling` read their sections' keys
# only when compiling or profiling): a sweep over one of them where no setting has such a value trained the same model
# under each of its values, then named a "winner" among them; a single run that set one trained as without it, silently.
DEPENDENT_KEYS = {
    "model.cross_layers": ("model.interaction", ("dcn",)),
    "model.cross_rank": ("model.interaction", ("dcn",)),
    "optim.dense.momentum": ("optim.dense.name", ("sgd",)),
    "optim.dense.eps": ("optim.dense.name", ("adagrad", "adam")),
    "optim.sparse.eps": ("optim.sparse.name", ("adagrad", "rowwise_adagrad")),
    **{f"optim.schedule.{key}": ("optim.schedule.decay", ("linear", "cosine"))
       for key in ("decay_start_step", "decay_steps", "end_factor")},
    "data.gpu_memory_share": ("data.placement", ("auto",)),
    "train.allow_swap": ("train.device", ("auto", "cpu")),  # the host memory check is the CPU's
    "train.check_host_memory": ("train.device", ("auto", "cpu")),
    # placement "gpu" trains and evaluates from the split in memory (`dlrm.train.trainer.make_loader`)
    "data.prefetch": ("data.placement", ("auto", "stream")),
    "data.shuffle_buffer_rows": ("data.placement", ("auto", "stream")),
    **{f"train.compile.{key}": ("train.compile.enabled", (True, "auto"))
       for key in ("mode", "fullgraph", "combo_kernels")},
    **{f"profile.{key}": ("profile.enabled", (True,))
       for key in ("wait", "warmup", "active", "repeat", "record_shapes", "profile_memory", "with_stack")},
}

# Where a key of `DEPENDENT_KEYS` that cannot act in a training run still acts, by the key it depends on or by its own
# name: a file keeps it for those runs, so a training run is told, not refused. The train.py flags that turn a key on
# (`"compile": {"enabled": false, "mode": ...}` with --compile), and --eval-only's and --export's evaluation, which
# streams its split whatever the placement (`dlrm.train.export`).
KEPT_FOR = {"train.compile.enabled": "a run with --compile", "profile.enabled": "a run with --profile",
            "data.prefetch": "--eval-only, which streams", "data.shuffle_buffer_rows": "--eval-only, which streams"}


# Config keys a training run never reads: the dataset's metadata.json gives the table sizes and the values per feature
# (`dlrm.train.setup.dataset_tables`; the config's serve runs without a dataset, the benchmarks). A sweep over one
# trained the same model under each value (a warning per trial at most), then named a "winner" among them.
DATASET_KEYS = {
    "model.cardinalities": "sweep data.max_rows_per_table to cap the dataset's tables",
    "model.multi_hot_sizes": "make a dataset of each value with `python -m dlrm.data.synthetic --multi-hot-sizes` or "
                             "`python -m dlrm.preprocess --multi-hot-sizes` and sweep data.path over them",
}


def check_dependent_keys(config: str, base: dict, settings: list[dict], warn: bool = True) -> list[str]:
    """Refuse a sweep's ``--set`` of a `DEPENDENT_KEYS` key (or of a section whose values vary it) when no setting of
    its grid (`settings`, each loaded from `config` with the overrides `base`) has a value of the key it depends on
    that lets it act, and of a `DATASET_KEYS` key, which no setting's run reads; then the file's own keys, as
    `check_inert_keys` checks those of a run of train.py. Returns the warnings, logged unless `warn` is False (a
    sweep logs them once its other checks passed: told before a refusal of the same settings, one problem read as
    two, the first as if the sweep would go on)."""
    from loguru import logger

    from dlrm.config import load_config, parse_config_bytes, read_config_bytes

    for key, instead in DATASET_KEYS.items():
        if any(key in setting for setting in settings):
            raise ConfigError(f"--set {key}: a training run takes it from the dataset's metadata.json, not the config: "
                              f"its values would train the same model; {instead}")
    given = {key: next((g for g in (_set_as(setting, key) for setting in settings) if g), None)
             for key in DEPENDENT_KEYS}
    keys = [key for key in DEPENDENT_KEYS if given[key]]
    cfgs = [load_config(config, {**base, **setting}).to_dict() for setting in settings] if keys else []
    for key in keys:
        if given[key] != key and len({json.dumps(_value(cfg, key)) for cfg in cfgs}) == 1:
            continue  # a section's value that carries the key unchanged (copied from a config.json: every key in it)
        on, acting = DEPENDENT_KEYS[key]
        values = {_value(cfg, on) for cfg in cfgs}
        if not values & set(acting):
            what = key if given[key] == key else f"{given[key]} ({key})"
            raise ConfigError(f"--set {what}: acts with {on} {' or '.join(map(repr, acting))} only, and every setting "
                              f"of this sweep has {' or '.join(sorted(map(repr, values)))}: its values would train the "
                              "same model")
    # the file's own keys, checked as train.py checks a run of its own (each trial is one: a sweep trained a file
    # keeping momentum beside Adam without a word, which train.py refuses); a setting's --set is its command line
    told: list[tuple] = []
    file_keys = parse_config_bytes(read_config_bytes(Path(config)), config)
    for setting in settings:
        check_inert_keys(load_config(config, {**base, **setting}), file_keys, {**base, **setting}, config, told=told)
    # once a key, naming the settings it cannot act in: said once per value of the key it depends on, as if of one
    # run ("this run has "dot": ignored"), it read as ignored by the whole sweep, the dcn settings' too
    switches: dict[tuple, list[str]] = {}
    for key, value, on, needs, switch, why in told:
        switches.setdefault((key, value, on, needs, why), []).append(switch)
    lines = [f"{key}: {value} has no effect in the {len(seen)} of the {len(settings)} settings with {on} "
             f"{' or '.join(dict.fromkeys(seen))}: it acts with {on} {needs} only: ignored there ({why})"
             for (key, value, on, needs, why), seen in switches.items()]
    for line in lines if warn else ():
        logger.warning(line)
    return lines


def check_inert_keys(cfg: "Config", given: dict, overrides: dict, source: str, refuse: bool = True,
                     decided: tuple[str, ...] = (), told: Optional[list[tuple]] = None) -> None:
    """Refuse, in one line naming `source` (the config file) or the command line, a `DEPENDENT_KEYS` key that the file
    (`given`, its JSON as read) or `overrides` set explicitly where the key it depends on leaves it without effect
    (`model.cross_layers` of a "dot" model trained the dot model, silently); defaults are never refused. It is a
    warning instead where the depended-on key is the command line's (a sweep's --set of model.interaction over a file
    keeping cross_layers for its "dcn" settings), where the key acts in other runs of the file (`KEPT_FOR`), where the
    file gives every key (a run's config.json: it records the keys its command line left without effect too; a sweep
    trial's given as --config was refused), and with `refuse` False (a --resume: the run began with this config;
    refusing would strand it mid-way). A key depending on one of `decided` is not checked: the mode sets that key
    itself (--compare's variants, train.compile.enabled: the compile settings act in its compiled variants). `told`:
    a list the warnings are appended to instead of logged, as (key, value, on, needs, switch, why) tuples (a sweep's
    settings: `check_dependent_keys` says each key once)."""
    from dlrm.logging_setup import run_logger

    from dlrm.config import Config, validate

    tree, defaults = cfg.to_dict(), validate(Config()).to_dict()  # (validated: its profile and compile sections whole)
    for key, (on, acting) in DEPENDENT_KEYS.items():
        from_command_line = _holds(overrides, key)
        if on in decided or not (from_command_line or _holds(given, key)):
            continue
        switch = _value(tree, on)
        if switch in acting:
            continue
        value, needs = _value(tree, key), " or ".join(map(json.dumps, acting))
        if value == _value(defaults, key):
            continue  # what the run does without it: a run's config.json (every key written) as a --config trains
        what = (f"{key}: {json.dumps(value)} has no effect: it acts with {on} {needs} only, and this run has "
                f"{json.dumps(switch)}")
        if _holds(overrides, on):
            why = f"{on} set on the command line"
        elif on in KEPT_FOR or key in KEPT_FOR:
            why = f"kept for {KEPT_FOR.get(on) or KEPT_FOR[key]}"
        elif _gives_every_key(given, defaults):
            why = "the file gives every key, as a run's config.json does"
        elif _run_record(source):
            why = "the file is a run's config.json, written by an earlier version"
        elif not refuse:
            why = "the resumed run keeps its config"
        else:
            raise ConfigError(f"{'command line' if from_command_line else source}: {what} (remove it, or set {on})")
        if told is None:
            run_logger.warning(f"{what}: ignored ({why})")
        else:
            told.append((key, json.dumps(value), on, needs, json.dumps(switch), why))


def _gives_every_key(raw: Any, tree: dict) -> bool:
    """Whether the file's JSON `raw` gives every section of the `Config.to_dict` tree `tree`, at every depth, as the
    config.json a run writes does, of this version or an earlier one (a section null where the tree has an object, or
    one where it has null, is given). Sections, not every key: an earlier version's config.json lacks the keys added
    since (``log.sweep_keys``, ``distributed.timeout_s``), and every run's written before them was refused."""
    return isinstance(raw, dict) and all(
        k in raw and (not isinstance(raw[k], dict) or _gives_every_key(raw[k], v))
        for k, v in tree.items() if isinstance(v, dict))


def _run_record(source: str) -> bool:
    """Whether `source` is the config.json of a run directory (beside its summary.json or checkpoints/). One of a
    version before a section was added (``distributed``, 2026-11-23; ``profile`` and ``checkpoint`` earlier) gives not
    every section (`_gives_every_key`), and was refused for a key it recorded without effect (a run of its own,
    trained by that version, could not be trained again from its record)."""
    path = Path(source)
    return path.name == "config.json" and ((path.parent / "summary.json").is_file()
                                           or (path.parent / "checkpoints").is_dir())


def _holds(raw: dict, dotted: str) -> bool:
    """Whether `raw` gives `dotted`: a file's JSON object (nested sections; a section's shorthand, `"compile": false`,
    gives none of its keys) or dotted overrides ("optim.dense.eps", or a section's {"optim.dense": {"eps": ...}})."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        head = ".".join(parts[:i])
        if head not in raw:
            continue
        node = raw[head]
        for part in parts[i:]:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return True
    return False


def _set_as(setting: dict, key: str) -> Optional[str]:
    """The ``--set`` key of `setting` that sets the dotted `key`: itself, or a section holding it in its value
    (``--set 'optim.dense={"momentum": 0.9},{"momentum": 0}'`` on Adam trained one model twice, unrefused); None."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        value = setting.get(".".join(parts[:i]), _ABSENT)
        for part in parts[i:]:
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is not _ABSENT:
            return ".".join(parts[:i])
    return None


_ABSENT = object()


def _value(tree: dict, dotted: str) -> Any:
    """The value of the key `dotted` ("optim.dense.name") in a `Config.to_dict` tree."""
    for part in dotted.split("."):
        tree = tree[part]
    return tree
