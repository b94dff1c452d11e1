"""The one way to build a training run: a resolved config -> model, loss, optimizers, schedules,
train step and evaluation forward.

``train.py`` (through :mod:`dlrm.train.trainer`), every benchmark and the tests build runs here, so
a benchmark measures what users run. In a distributed run the builder also makes the sharded
embedding and the DistributedDataParallel wrapper of the dense parts and passes them in: the model
itself knows nothing of torch.distributed.

Example:
    >>> from dlrm.config import Config, validate
    >>> cfg = validate(Config())
    >>> cfg.model.cardinalities = [10] * 26
    >>> run = build_run(cfg, tables_from_config(cfg), torch.device("cpu"), total_steps=10)
    >>> type(run.train_step).__name__, len(run.optimizers)
    ('TrainStep', 2)
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from loguru import logger

from dlrm.config import Config, ConfigError, DenseOptimConfig, ModelConfig
from dlrm.data.schema import NUM_DENSE
from dlrm.distributed.env import DistEnv
from dlrm.distributed.sharding import ShardingPlan, plan_sharding
from dlrm.errors import address_limits, is_out_of_memory
from dlrm.logging_setup import run_logger
from dlrm.model.dlrm import _TABLE_DTYPES, DLRM, build_loss, build_model
from dlrm.train.fast_path import resolve_fast_path
from dlrm.train.graphed_step import graph_train_step
from dlrm.train.host_memory import HostMemory, host_key, mem_available, read_host_memory
from dlrm.train.optim import build_optimizers, build_schedulers
from dlrm.train.placement import table_bytes, table_row_bytes, vocabulary_key_bytes
from dlrm.train.setup import Tables
from dlrm.train.step import EvalForward, TrainStep, set_matmul_precision, warn_precision_on


@dataclass
class Run:
    """Everything a training run steps, evaluates and checkpoints.

    Args:
        model: the uncompiled DLRM (its state_dict is what checkpoints hold).
        loss_fn: (logits [B], labels [B]) -> scalar.
        optimizers: (dense, sparse).
        schedulers: one LR schedule per optimizer.
        train_step: ``batch -> loss`` (0-dim device tensor); compiled / graphed as configured.
        eval_forward: ``batch -> logits [B]`` without gradients.
        plan: the embedding sharding plan of a distributed run, else None.
        config: the config the run was built from, every "auto" resolved (`dlrm.train.fast_path`).
        fast_path: what each "auto" became and why (recorded in summary.json).
    """

    model: DLRM
    loss_fn: Callable
    optimizers: tuple
    schedulers: list
    train_step: Callable
    eval_forward: EvalForward
    plan: Optional[ShardingPlan] = None
    config: Optional[Config] = None
    fast_path: dict = field(default_factory=dict)


def tables_from_config(cfg: Config) -> Tables:
    """Table sizes for a run without a dataset (benchmarks): ``model.cardinalities``, capped by
    ``data.max_rows_per_table``; modulus hashing."""
    if cfg.model.cardinalities is None:
        raise ConfigError("model.cardinalities: needed when no dataset is given")
    cap = cfg.data.max_rows_per_table
    return Tables([min(c, cap) if cap else c for c in cfg.model.cardinalities], None, "modulus", cfg.model.multi_hot_sizes)


# The share of the smallest GPU's memory a rank's tables and their optimizer state may take under
# distributed.balance "cost": the rest is for activations, the dense parts and the exchange (one H100 holds
# MLPerf DLRM-DCNv2's 204M bf16 rows, 49 GiB with row-wise Adagrad, 62% of its 80 GB, at batch 65536).
TABLE_MEMORY_FRACTION = 0.75


def make_sharding(cfg: Config, tables: Tables, env: DistEnv, device: torch.device) -> Optional[ShardingPlan]:
    """The embedding sharding plan of a distributed run (logged with each rank's share), else None."""
    if not env.distributed:
        return None
    row_bytes = table_row_bytes(cfg)
    memory = None
    if device.type == "cuda":  # every rank must plan alike: the smallest GPU's memory (one gather at start-up)
        memory = int(min(env.all_gather_object(torch.cuda.get_device_properties(device).total_memory))
                     * TABLE_MEMORY_FRACTION)
    # every rank holds all the vocabulary keys (ShardedSparseArch's vocab_keys): the limit must leave room for them
    plan = plan_sharding(tables.cardinalities, env.world_size, cfg.distributed.sharding,
                         cfg.distributed.row_wise_min_rows, tables.multi_hot_sizes, cfg.distributed.balance,
                         row_bytes, memory, vocabulary_key_bytes(tables.cardinalities, tables.hashing))
    for q in range(env.world_size):
        if plan.local_rows(q) == 0:
            # 'row' already splits every table, in blocks of ceil(n / W) rows: tables that small leave the last ranks
            # none, and advising 'row' there sent the user back to the same refusal
            advice = ("use fewer ranks (every table is split in blocks of ceil(rows / ranks) rows: "
                      f"{max(tables.cardinalities, default=0):,} rows at most here)"
                      if plan.row_wise_tables() == list(range(len(tables.cardinalities))) else "use 'row'")
            if advice != "use 'row'" and len(tables.cardinalities) >= env.world_size:
                # (whole tables give every rank one at least: 'auto' with a small row_wise_min_rows, or 'row', on tables
                # of fewer rows than ranks named fewer ranks alone)
                advice += ", or 'table' (whole tables, at least one a rank)"
            raise ConfigError(f"distributed.sharding: {cfg.distributed.sharding!r} leaves rank {q} without "
                              f"embedding rows ({len(tables.cardinalities)} tables, {env.world_size} ranks); {advice}")
    logger.info(f"embedding sharding ({cfg.distributed.sharding}, balancing {cfg.distributed.balance}) over "
                f"{env.world_size} ranks:\n"
                + plan.describe(cfg.model.embedding_dim, _TABLE_DTYPES[cfg.model.embedding_dtype].itemsize,
                                tables.multi_hot_sizes))
    return plan


def _sharded_sparse_arch(cfg: Config, tables: Tables, plan: ShardingPlan, env: DistEnv) -> Callable:
    """A function building this rank's `ShardedSparseArch` (build_model calls it in its RNG order),
    its shard stored in ``model.embedding_dtype`` as one process stores the whole tables."""
    from dlrm.distributed.sharded_embedding import ShardedSparseArch

    return lambda: ShardedSparseArch(tables.cardinalities, cfg.model.embedding_dim, plan, env.rank, tables.vocabs,
                                     kernel=cfg.kernels.embedding, hotness=tables.multi_hot_sizes,
                                     dtype=_TABLE_DTYPES[cfg.model.embedding_dtype],
                                     # a lazy sparse weight decay must not reach the rows masked lookups point at
                                     skip_masked_updates=cfg.optim.sparse.weight_decay > 0)


def _log_memory(env: DistEnv, model: DLRM, device: torch.device) -> None:
    """Parameters and device memory of every rank, logged by rank 0 (one gather at start-up)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    for q, (p, a) in enumerate(env.all_gather_object((params, allocated))):
        logger.info(f"rank {q}: parameters {p / 2**20:,.1f} MiB"
                    + (f", CUDA memory allocated {a / 2**20:,.1f} MiB" if a is not None else ""))


# the config keys that size each part `dense_layer_parameters` counts
_PART_KEYS = {"the bottom MLP": ("model.bottom_mlp",), "the cross network": ("model.cross_rank", "model.cross_layers"),
              "the top MLP": ("model.top_mlp",)}


def _now(m: ModelConfig, key: str):
    return getattr(m, key.split(".", 1)[1])


def dense_layer_parameters(m: ModelConfig, num_features: int) -> dict[str, int]:
    """The parameters of each dense part `build_model` makes of ``m`` over `num_features` tables (weights and biases,
    the input multiples' zero columns included): "the bottom MLP", "the cross network" (dcn only), "the top MLP"."""
    def chain(width: int, widths: list[int]) -> int:
        total = 0
        for w in widths:
            total, width = total + width * w + w, w
        return total

    f, d = num_features, m.embedding_dim
    interaction = d + (f + 1) * f // 2 if m.interaction == "dot" else (f + 1) * d
    parts = {"the bottom MLP": chain(NUM_DENSE - NUM_DENSE % -m.bottom_mlp_input_multiple, m.bottom_mlp)}
    if m.interaction == "dcn":  # LowRankCrossNet: per layer W [N, r], V [r, N] and a bias [N]
        parts["the cross network"] = m.cross_layers * (2 * (f + 1) * d * m.cross_rank + (f + 1) * d)
    parts["the top MLP"] = chain(interaction - interaction % -m.top_mlp_input_multiple, m.top_mlp)
    return parts


def _host_memory() -> HostMemory:
    """The host's memory, its cgroups' limits and this process's rlimits, read now (`dlrm.train.host_memory`)."""
    return read_host_memory()


def _least(*values: Optional[int]) -> Optional[int]:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _available_host_memory() -> Optional[int]:
    """The host's memory a build could take (MemAvailable, bytes), within this process's own limits (`_process_room`:
    under `ulimit -v` or a cgroup's memory.max, a scheduler's job, the tables were blamed for an oversized cross
    network, as MemAvailable left room for it); None where /proc/meminfo does not say it."""
    return _least(mem_available(), _process_room())


def _process_room() -> Optional[int]:
    """What this process may still allocate under its own limits (bytes), None where none is set: its rlimits
    (`ulimit -v`, `ulimit -d`) and its cgroups' memory limits (`dlrm.train.host_memory`)."""
    memory = _host_memory()
    return _least(memory.cgroup, memory.process)


def dense_training_copies(optim: DenseOptimConfig) -> int:
    """fp32 values a dense parameter takes in training: itself, its gradient, and its optimizer state (Adam 2, Adagrad
    1, SGD 1 with momentum)."""
    state = {"adam": 2, "adagrad": 1}.get(optim.name, 1 if optim.momentum else 0)
    return 2 + state


def dense_layers_text(cfg: Config, num_features: int) -> Optional[str]:
    """For an out-of-memory step: the dense layers' training memory and the key that shrinks them, where it is 1 GiB
    or more (a cross network of an oversized model.cross_rank), else None. The step's advice named the batch size and
    the tables alone."""
    parts = dense_layer_parameters(cfg.model, num_features)
    need = 4 * sum(parts.values()) * dense_training_copies(cfg.optim.dense)
    if need < 2**30:
        return None
    part = max(parts, key=parts.get)
    keys = " or ".join(f"{k} (now {_now(cfg.model, k)})" for k in _PART_KEYS[part])
    return (f"shrink {part}: {keys}; the dense layers take {need / 2**30:,.1f} GiB with their gradients and "
            f"{cfg.optim.dense.name}'s state")


def _dense_parts_text(m: ModelConfig, num_features: int, table_bytes_: int,
                      room: Optional[int] = None) -> Optional[tuple[str, str]]:
    """What to say of an out-of-memory build whose dense layers (fp32 parameters) outweigh the tables, and the key to
    shrink: a cross network of model.cross_rank 2**31 - 1 (1.7 TiB) was reported as its 0.0-GiB tables, with
    data.max_rows_per_table as the cure. None where the tables are the larger part, or where both fit in `room` (the
    memory free before the build, where known): then neither ran it out, other processes or this one's splits held
    the memory, and "shrink model.cross_rank (now 512)" of MLPerf's 61 MB of dense layers had replaced the tables'
    message, which says what was free and held (and advises streaming a split held in GPU memory)."""
    parts = dense_layer_parameters(m, num_features)
    total = sum(parts.values())
    if total * 4 <= table_bytes_ or (room is not None and total * 4 + table_bytes_ <= room):
        return None
    part = max(parts, key=parts.get)
    keys = " or ".join(f"{k} (now {_now(m, k)})" for k in _PART_KEYS[part])
    return (f"its dense layers hold {total:,} fp32 parameters = {total * 4 / 2**30:,.1f} GiB, {part} "
            f"{parts[part]:,} of them", f"shrink {keys}")


def refuse_dense_layers_beyond_memory(m: ModelConfig, num_features: int, device: torch.device,
                                      copies: int = 1, check_host: bool = True) -> None:
    """A ConfigError naming the key when the dense layers' fp32 parameters alone exceed the device's memory (the host's
    RAM on a CPU, the GPU's on CUDA). model.cross_layers 1,000,000,000 (every value up to 2**31 - 1 passes the config's
    checks) built one small layer after another until the host swapped and the kernel's OOM killer ended the run
    without a word; nothing of the build fails at once there, as one oversized allocation does. `copies`: the fp32
    values a parameter takes in training (`dense_training_copies`: gradients and optimizer state, which the first step
    allocates); the memory: the device's whole, or this process's limits where lower (`_process_room`). `check_host`
    False (train.check_host_memory): on the CPU a warning instead."""
    parts = dense_layer_parameters(m, num_features)
    need = 4 * sum(parts.values()) * copies
    if device.type == "cuda":
        memory, where = torch.cuda.mem_get_info(device)[1], "the GPU's"  # (free, total) bytes
    else:
        memory, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's"
        room = _process_room()
        if room is not None and room < memory:
            memory, where = room, "this process's (ulimit -v, ulimit -d, or its cgroup's memory.max or memory.high)"
    if need <= memory:
        return
    part = max(parts, key=parts.get)
    # the cross network's key that stands out first: its layers when they outnumber its rank (MLPerf: 3 of rank 512)
    key, *others = sorted(_PART_KEYS[part], key=lambda k: -_now(m, k)) if part == "the cross network" else _PART_KEYS[part]
    text = (f"{key}: {_now(m, key)}" + "".join(f" (with {k} {_now(m, k)})" for k in others)
            + f" makes {part} {parts[part]:,} fp32 parameters, the dense layers {need / 2**30:,.1f} GiB"
            + (" with their gradients and optimizer state" if copies > 1 else "")
            + f": more than {where} {memory / 2**30:,.1f} GiB of memory")
    if device.type != "cuda" and not check_host:
        run_logger.warning(f"host memory: {text}; going on: train.check_host_memory is false")
        return
    raise ConfigError(text)


def _tables_size_text(cfg: Config, tables: Tables) -> tuple[str, int]:
    """("embedding tables hold R rows x D x dtype = G GiB[, the sparse optimizer's state ...][, their vocabularies'
    keys ...]", those bytes in all) of one process holding every table."""
    rows, dim = sum(tables.cardinalities), cfg.model.embedding_dim
    weights = rows * dim * _TABLE_DTYPES[cfg.model.embedding_dtype].itemsize
    state = table_bytes(cfg, tables.cardinalities) - weights
    # vocabulary hashing's int64 key of every value, on the device beside the rows (`placement` counts them)
    keys = vocabulary_key_bytes(tables.cardinalities, tables.hashing)
    text = (f"embedding tables hold {rows:,} rows x {dim} x {cfg.model.embedding_dtype} = {weights / 2**30:,.1f} GiB"
            + (f", the sparse optimizer's state {state / 2**30:,.1f} GiB more" if state else "")
            + (f", their vocabularies' keys {keys / 2**30:,.1f} GiB more" if keys else ""))
    return text, weights + state + keys


def _size(n: int) -> str:
    """`n` bytes in GiB, in MiB below 1 GiB (a refusal of "0.0 GiB, more than the 0.0 GiB available" said nothing)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def resume_read_bytes(path, env: DistEnv = DistEnv()) -> int:
    """What a resume's restore maps beside the built model and its optimizers (`Checkpointer.restore`): the checkpoint,
    or this rank's shard of a sharded one (its manifest names it); 0 without a resume, or unreadable. Memory-mapped
    (`dlrm.mapped_load`), it takes the page cache's memory, not this process's, but as much of its address space, which
    ``ulimit -v`` and ``ulimit -d`` bound (a private writable mapping counts toward both)."""
    if path is None:
        return 0
    path = Path(path)
    if env.distributed:
        from dlrm.distributed.checkpoint import _named_shards  # (the manifest: small)

        shards = _named_shards(path)
        path = path.parent / shards[env.rank] if env.rank < len(shards) else path
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def refuse_host_memory_shortfall(cfg: Config, tables: Tables, memory: HostMemory, env: DistEnv = DistEnv(),
                                 plan: Optional[ShardingPlan] = None, resume_bytes: int = 0) -> None:
    """A MemoryError (exit 4) before a CPU build whose tables (weights, sparse optimizer state, vocabulary keys) and
    dense layers (with their gradients and dense optimizer state) exceed the memory this process may take (`memory`,
    `dlrm.train.host_memory`: the host's MemAvailable, its cgroups' limits, this process's rlimits; unknown: nothing
    refused). A CPU allocation of tables larger than the available memory but within the kernel's overcommit
    succeeds, and the OOM killer ended the run while their initial values were written, without a word (a GPU's
    allocation fails at once, and `tables_named_if_out_of_memory` names the tables). The dense layers alone are
    weighed against the whole RAM before this (`refuse_dense_layers_beyond_memory`); where they are the larger part,
    they are named with the key that shrinks them, as after an out-of-memory build.

    Free swap is not counted unless ``train.allow_swap`` (a run whose tables live in swap crawls: refused, the line
    naming the key, when swap would have held them); beyond the memory and free swap together it is refused either
    way (the tables' initial values touch every page: the OOM killer). Under torchrun (gloo, `plan` the sharding
    plan) the ranks of one host share its memory: each weighs its own shard of the tables, the vocabulary keys and
    its replica of the dense layers (with DDP's gradient buckets); the ranks gather what each needs and the memory
    each reads, and all of them reach the same verdict from the same numbers: the same error on every rank (said once,
    `found_alike`), raised before any of them builds. `resume_bytes`: the checkpoint (a rank's shard) a resume maps
    beside them (`resume_read_bytes`): weighed against this process's rlimits only (the page cache holds its pages)."""
    num_features = len(tables.cardinalities)
    # DistributedDataParallel's gradient buckets: one more copy of the dense gradients (no gradient_as_bucket_view)
    copies = dense_training_copies(cfg.optim.dense) + (1 if env.distributed else 0)
    dense_bytes = 4 * sum(dense_layer_parameters(cfg.model, num_features).values()) * copies
    tables_text, tables_bytes = _tables_size_text(cfg, tables)
    if plan is not None:  # this rank's rows; every rank holds all the vocabulary keys
        tables_bytes = (plan.local_rows(env.rank) * table_row_bytes(cfg)
                        + vocabulary_key_bytes(tables.cardinalities, tables.hashing))
    ranks = env.all_gather_object((host_key(), socket.gethostname(), tables_bytes, memory, resume_bytes))
    text = _shortfall_text(cfg, tables, tables_text, ranks, dense_bytes, env.distributed, bool(resume_bytes))
    if text is None:
        return
    if not cfg.train.check_host_memory:  # the user's word that the estimate is wrong here: told, every rank goes on
        if env.is_main:
            run_logger.warning(f"host memory: {text}; going on: train.check_host_memory is false (short of memory, "
                               "the OOM killer ends the run without a word)")
        return
    exc = MemoryError(text)
    exc.dlrm_refused = True  # said as it is (`dlrm.cli.out_of_memory_message`): nothing was built
    if env.distributed:
        exc.found_alike = True  # every rank raises it from the same numbers: said once (`dlrm.cli.report_failure`)
    raise exc


def _shortfall_text(cfg: Config, tables: Tables, tables_text: str, ranks: list[tuple], dense_bytes: int,
                    distributed: bool, resuming: bool = False) -> Optional[str]:
    """The refusal of `refuse_host_memory_shortfall` from every rank's (host key, host name, table bytes,
    HostMemory, the bytes of the checkpoint its resume maps), or None where the model fits (told where it fits only
    with swap, under train.allow_swap)."""
    advice = functools.partial(_shortfall_advice, cfg, tables, tables_text, dense_bytes,
                               max(r[2] for r in ranks), distributed, resuming)
    for q, (_, name, t, memory, mapped) in enumerate(ranks):  # a process's own rlimits first: swap lifts neither
        if memory.process is not None and t + dense_bytes + mapped > memory.process:
            who = f"rank {q} on host {name} needs" if distributed else "the model needs"
            shard = "checkpoint shard" if distributed else "checkpoint"
            also = f", and the {shard} it resumes from maps {_size(mapped)} more (memory-mapped)" if mapped else ""
            return advice(f"{who} {_size(t + dense_bytes)} of host memory with its optimizers' state{also}, more than "
                          f"the {_size(memory.process)} {'it' if distributed else 'this process'} may take (ulimit -v, "
                          "ulimit -d)", host=False)
        if memory.process is not None and t + dense_bytes + mapped + memory.reserved > memory.process:
            # the model fits, what the run maps after it does not (`dlrm.train.host_memory.later_address_space`):
            # libgomp's exit 1 from C, a segfault or an error blaming the data followed; the limit is the cause
            who = f"rank {q} on host {name}" if distributed else "this process"
            short = t + dense_bytes + mapped + memory.reserved - memory.process
            model = f"the model{' and checkpoint' if mapped else ''}"
            return (f"{who} may map {_size(memory.process)} more under {address_limits()}, "
                    f"less than the {_size(t + dense_bytes + mapped)} of {model} "
                    f"and the {_size(memory.reserved)} a run's threads (stacks, malloc arenas) and buffers map beside "
                    f"it: raise the limit (ulimit -v unlimited, or {_size(short)} more at least)")
    hosts: dict[str, list[int]] = {}
    for q, rank in enumerate(ranks):
        hosts.setdefault(rank[0], []).append(q)
    for qs in hosts.values():  # the ranks of one host draw from its memory (and their cgroup's) together
        need = sum(ranks[q][2] + dense_bytes for q in qs)
        ram, ram_source = _tightest([ranks[q][3].shared() for q in qs])
        if ram is None or need <= ram:
            continue
        swap = min(ranks[q][3].swap() for q in qs)
        total, total_source = _tightest([ranks[q][3].shared(with_swap=True) for q in qs])
        name = ranks[qs[0]][1]
        who = ("the model needs" if not distributed else f"rank {qs[0]} on host {name} needs" if len(qs) == 1
               else f"the {len(qs)} ranks on host {name} need")
        if cfg.train.allow_swap and need <= total:
            run_logger.warning(f"host memory: {who} {_size(need)}, more than the {_size(ram)} {ram_source}: "
                               f"{_size(need - ram)} of it will be in swap (train.allow_swap true), and training "
                               "will be slow")
            continue
        room, source = (total, total_source) if cfg.train.allow_swap else (ram, ram_source)
        text = advice(f"{who} {_size(need)} of host memory with {'their' if len(qs) > 1 else 'its'} optimizers' "
                      f"state, more than the {_size(room)} {source}", host=True)
        if cfg.train.allow_swap:
            return text
        if swap and need <= total:  # the user's to choose: it would run, slowly
            return (f"{text}, or set train.allow_swap true to go on with {_size(need - ram)} of it in swap (of "
                    f"{_size(swap)} free; a run that swaps is slow)")
        if swap:
            return (f"{text} (with train.allow_swap true the {_size(swap)} of free swap would not hold the other "
                    f"{_size(need - ram)} either)")
        return f"{text} (there is no free swap for train.allow_swap to count)"
    return None


def _tightest(rooms: list[tuple[Optional[int], str]]) -> tuple[Optional[int], str]:
    """The least known room of `rooms` ((bytes or None, where it comes from)), or (None, "")."""
    known = [r for r in rooms if r[0] is not None]
    return min(known, key=lambda r: r[0]) if known else (None, "")


def _shortfall_advice(cfg: Config, tables: Tables, tables_text: str, dense_bytes: int, largest: int,
                      distributed: bool, resuming: bool, head: str, host: bool) -> str:
    """`head` with what takes the memory and the key that shrinks it: the dense layers' where they are the larger
    part (`_dense_parts_text`), else the tables' cap (under torchrun, where the host's memory is short, or more
    hosts: each holds the dense layers and the vocabulary keys once a rank)."""
    dense = _dense_parts_text(cfg.model, len(tables.cardinalities), largest)
    if dense is not None and resuming:  # (the checkpoint fixes the dense layers' keys too: "shrink" was a dead end)
        dense = (dense[0], "resume it on a host with more free memory" if not distributed
                 else "resume it on hosts with more free memory")
    if not distributed:
        if dense is not None:
            return f"{head}: {dense[0]} (its {tables_text}): {dense[1]}"
        return f"{head}: its {tables_text}, its dense layers {_size(dense_bytes)}: " + (
            # (data.max_rows_per_table cannot change on a resume: the checkpoint holds the tables' rows)
            "resume it on a host with more free memory" if resuming else "cap the tables with data.max_rows_per_table")
    keys = " and the vocabulary keys" if tables.hashing == "vocabulary" else ""
    what = (f"each rank holds its shard of the embedding tables (the largest {_size(largest)} with the sparse "
            f"optimizer's state{keys}) and the dense layers ({_size(dense_bytes)} with their gradients, DDP's "
            "buckets and the dense optimizer's state)")
    if dense is not None:
        return f"{head}: {what}; {dense[0]}: {dense[1]}"
    if resuming:
        return f"{head}: {what}: resume it on hosts with more free memory" + (
            ", or spread the ranks over more hosts" if host else "")
    return f"{head}: {what}: cap the tables with data.max_rows_per_table" + (
        ", or spread the ranks over more hosts" if host else "")


# A resume's advice: the checkpoint fixes the tables' rows (a data.max_rows_per_table that differs is refused against
# it) and the dense layers' shapes (`ckpt.fixed_model_keys`), and a one-process checkpoint resumes in one process only
RESUME_KEEPS = ("a resume keeps the checkpoint's tables and layers (data.max_rows_per_table cannot cap them; their "
                "sizes change only in a new run)")


@contextlib.contextmanager
def tables_named_if_out_of_memory(cfg: Config, tables: Tables, device: torch.device, env: DistEnv,
                                  resuming: bool = False):
    """Running out of memory while the model and its optimizers are built is the tables' doing (they are nearly all
    of it, MLPerf's 204M rows most of all): the error leaves with ``dlrm_tables``, their size (and the GPU's free
    memory before the build) and what makes them fit, which `dlrm.cli.out_of_memory_message` says in place of advice
    on the batch size, which the build does not depend on. Unless the dense layers are the larger part (a cross network
    of an oversized model.cross_rank) and the two do not fit in the memory free before the build: then the error names
    them and the key that shrinks them (`_dense_parts_text`). `resuming`: a resume, whose checkpoint fixes both: it
    is told to run where there is more memory (and to stream splits it held in GPU memory), as no key shrinks them.
    One process only: a rank's share of sharded tables is its plan's."""
    free = held = None
    if device.type == "cuda" and not env.distributed:
        free = torch.cuda.mem_get_info(device)  # (free, total) bytes: one query at start-up, not the step's
        # what this process holds before the build: the splits under data.placement "gpu" (loaded first), which the
        # advice on the tables alone left out, and which "stream" gives back
        held = torch.cuda.memory_allocated(device)
    # the memory the build could take: what the dense layers are weighed against (`_dense_parts_text`)
    room = free[0] if free is not None else (_available_host_memory() if device.type != "cuda" else None)
    try:
        yield
    except BaseException as exc:
        if is_out_of_memory(exc) and not env.distributed:
            tables_text, tables_bytes = _tables_size_text(cfg, tables)
            gpu_text = ""
            if free is not None:
                gpu_text = f"; {free[0] / 2**30:,.1f} GiB of the GPU's {free[1] / 2**30:,.1f} GiB were free"
                if held:
                    gpu_text += f", this process held {held / 2**30:,.1f} GiB already"
            dense = _dense_parts_text(cfg.model, len(tables.cardinalities), tables_bytes, room)
            if resuming:  # (the cap, bf16 tables, sharding and the dense keys were advised: each refused on a resume)
                what = f"{dense[0]} (its {tables_text})" if dense is not None else f"its {tables_text}"
                where = "a GPU" if device.type == "cuda" else "a host"
                stream = ', or stream the data (data.placement "stream": no split in GPU memory)' if held else ""
                exc.dlrm_tables = (f"{what}{gpu_text}: {RESUME_KEEPS}: resume it on {where} with more free "
                                   f"memory{stream}")
                raise
            if dense is not None:  # the tables are not what ran out: the advice on them would not help
                exc.dlrm_tables = f"{dense[0]} (its {tables_text}){gpu_text}: {dense[1]}"
                raise
            text = f"its {tables_text}{gpu_text}: cap them with data.max_rows_per_table"
            if device.type == "cuda":  # (bf16 tables need the Triton embedding: a GPU's)
                text += (", store them in bf16 (model.embedding_dtype)" if cfg.model.embedding_dtype == "fp32" else "")
                if held:
                    text += ", stream the data (data.placement \"stream\": no split in GPU memory)"
                text += ", or shard them over several GPUs under torchrun"
            exc.dlrm_tables = text
        raise


def rounding_seed_start(seed: int) -> int:
    """The first stochastic-rounding seed of bf16 tables in a run of ``train.seed`` ``seed``: the seed's low 31
    bits in the high half of the int64 counter, whose low half then counts steps (the update advances it by
    one). So runs of different seeds draw different rounding bits (two seeds apart by a multiple of 2**31
    share them), streams never overlap within 2**32 steps, and seed 0 starts at 0 as before."""
    return (seed % 2**31) << 32


def start_rounding_seed(model: torch.nn.Module, seed: int) -> None:
    """Set every bf16 table's stochastic-rounding seed (the buffers named ``sr_seed``, on every rank the same) to
    `rounding_seed_start` (a resumed run then loads its checkpoint's)."""
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1] == "sr_seed":
            buffer.fill_(rounding_seed_start(seed))


def warn_cross_rank_at_width(m: ModelConfig, num_features: int) -> None:
    """Say when a DCN's ``model.cross_rank`` is at least the cross network's width N = (F + 1) D: each layer's
    ``W_l V_l`` (N x r times r x N) can then be any N x N matrix, what a full-rank layer holds in N^2 weights, at
    2 r / N times those weights and multiply-adds, so the rank saves nothing. The default rank is MLPerf's 512
    (N = 3456 there); a small model (D = 8: N = 216) kept it without a word, its cross network 4.7x a full-rank one."""
    width = (num_features + 1) * m.embedding_dim
    if m.interaction != "dcn" or m.cross_rank < width:
        return
    run_logger.warning(
        f"model.cross_rank {m.cross_rank} is at least the cross network's width {width} ({num_features + 1} x "
        f"model.embedding_dim {m.embedding_dim}): each layer's W V can then be any {width} x {width} matrix, as a "
        f"full-rank layer's, at {2 * m.cross_rank / width:.1f}x its weights and work; a rank below {width // 2} saves "
        f"work (TorchRec's guidance: near {max(width // 4, 1)})")


def build_run(cfg: Config, tables: Tables, device: torch.device, total_steps: int, env: DistEnv = DistEnv(),
              eval_batch_size: Optional[int] = None, resume_from: Optional[Path] = None) -> Run:
    """Build the parts of a run as `cfg` says ("auto" settings resolved here, for this device).

    Args:
        cfg: the validated config (not modified).
        tables: table sizes and vocabularies (`dlrm.train.setup.dataset_tables` or `tables_from_config`).
        device: where the model lives.
        total_steps: the run's length (LR schedules depend on it).
        env: the process group (one process by default).
        eval_batch_size: the evaluation batch (a compiled evaluation pads to it); default 4 x batch.
        resume_from: the checkpoint a resume restores after the build (on the CPU its mapping weighed against the
            process's rlimits; a refusal, and running out of memory in the build, advise no cap of the tables).
    """
    cfg, fast_path = resolve_fast_path(cfg, device, env.distributed, tables.multi_hot, total_steps)
    if env.distributed and cfg.train.compile.enabled and cfg.train.compile.fullgraph:
        # DDP's forward (its reducer's bookkeeping before the dense parts run) cannot be traced: Dynamo breaks the graph
        # there, which fullgraph turns into an Unsupported traceback at the first step, on every rank
        raise ConfigError("train.compile.fullgraph: true cannot compile a run of several processes (the dense parts' "
                          "DistributedDataParallel forward breaks the graph); set it false")
    refuse_dense_layers_beyond_memory(cfg.model, len(tables.cardinalities), device,
                                      dense_training_copies(cfg.optim.dense), cfg.train.check_host_memory)
    if device.type == "cpu" and not env.distributed:
        refuse_host_memory_shortfall(cfg, tables, _host_memory(), resume_bytes=resume_read_bytes(resume_from))
    warn_cross_rank_at_width(cfg.model, len(tables.cardinalities))
    plan = make_sharding(cfg, tables, env, device)
    if device.type == "cpu" and env.distributed:  # each rank's share of the tables: its plan's (the same on every rank)
        env.barrier()  # every rank's data loaded before any of them reads what is left of the host's memory
        refuse_host_memory_shortfall(cfg, tables, _host_memory(), env, plan, resume_read_bytes(resume_from, env))
    sparse_arch = _sharded_sparse_arch(cfg, tables, plan, env) if plan is not None else None
    # one block for the model and its optimizers (the sparse optimizer's state: as large, for adagrad): the GPU's free
    # memory is said as it was before the tables; queried again before the optimizers, it was what the tables had
    # left (3 GiB "free" of 80 beside 49 GiB of tables that had taken the rest)
    with tables_named_if_out_of_memory(cfg, tables, device, env, resuming=resume_from is not None):
        model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, device, sparse_arch=sparse_arch,
                            compiled=bool(cfg.train.compile.enabled), multi_hot_sizes=tables.multi_hot_sizes)
        start_rounding_seed(model, cfg.train.seed)
        dense_forward = None  # one process: the model's own forward_from_embeddings
        if env.distributed:
            from dlrm.distributed.data_parallel import wrap_dense_parts

            # the buckets rebuilt before the first step: a resumed run reduces as the uninterrupted one (3+ ranks)
            dense_forward = wrap_dense_parts(model, device, (len(tables.cardinalities), cfg.model.embedding_dim))
            _log_memory(env, model, device)
        optimizers = build_optimizers(model, cfg.optim, cfg.train.deterministic)
    schedulers = build_schedulers(optimizers, cfg.optim.schedule, total_steps)
    if cfg.train.compile.enabled:
        logger.info(f"torch.compile: mode {cfg.train.compile.mode}, fullgraph {cfg.train.compile.fullgraph}")
    set_matmul_precision(cfg.train.precision)
    warn_precision_on(cfg.train.precision, device, "the run")
    loss_fn = build_loss(cfg.kernels)
    step = TrainStep(model, loss_fn, optimizers, cfg.train.precision, device, cfg.train.compile,
                     dense_forward=dense_forward)
    if cfg.train.cuda_graph and device.type == "cuda" and not env.distributed and not model.sparse_arch.compilable:
        raise ConfigError(f"train.cuda_graph: {type(model.sparse_arch).__name__} has sparse gradients with "
                          "data-dependent shapes, which a CUDA graph cannot replay; use kernels.embedding \"triton\"")
    step = graph_train_step(step, cfg.train.cuda_graph, env.distributed)
    eval_forward = EvalForward(model, cfg.train.precision, device, cfg.train.compile,
                               eval_batch_size or 4 * cfg.data.batch_size, dense_forward=dense_forward)
    return Run(model, loss_fn, optimizers, schedulers, step, eval_forward, plan, cfg, fast_path)
