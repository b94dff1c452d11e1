"""The host memory `--eval-only` and `--export` take on the CPU, weighed before the checkpoint is read (exit 4, one line),
as a training run's model is before its build (`dlrm.train.builder.refuse_host_memory_shortfall`).

Neither trains: no gradients, no optimizer state built. The model is built and the checkpoint's weights copied into it,
and an export then serializes the model's weights twice more (torch.export.save: `torch.save` into a BytesIO, then its
`getvalue()` copy). Measured on 10.4M rows x 16 fp32 with row-wise Adagrad (a 674.5 MiB checkpoint; the model 634.8
MiB), when the checkpoint was read whole: the peak resident memory above the interpreter's was 1.3 GiB for --eval-only
and 2.0 GiB for --export; short of it, the OOM killer ended them without a word. The checkpoint is memory-mapped now
(`dlrm.mapped_load`): its pages are the page cache's, which the kernel drops under pressure, not this process's memory,
but they take as much of its address space, which ``ulimit -v`` and ``ulimit -d`` bound: weighed there.
"""

from __future__ import annotations

import os
from pathlib import Path

from dlrm.config import Config
from dlrm.logging_setup import run_logger
from dlrm.model.dlrm import _TABLE_DTYPES
from dlrm.train.host_memory import HostMemory
from dlrm.train.placement import vocabulary_key_bytes


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def checkpoint_host_need(cfg: Config, tables, path: Path, export: bool) -> tuple[int, str]:
    """(bytes, what they are) an evaluation (`export` False) or an export of the checkpoint at `path` takes of the
    host's memory at its peak: the model (its weights as built: fp32 tables for an export, the vocabulary keys, the
    dense layers), for an export with two serialized copies of its weights. (The checkpoint's mapping:
    `mapped_bytes`.)"""
    from dlrm.train.builder import dense_layer_parameters

    rows, dim = sum(tables.cardinalities), cfg.model.embedding_dim
    itemsize = 4 if export else _TABLE_DTYPES[cfg.model.embedding_dtype].itemsize
    model = (rows * dim * itemsize + vocabulary_key_bytes(tables.cardinalities, tables.hashing)
             + 4 * sum(dense_layer_parameters(cfg.model, len(tables.cardinalities)).values()))
    if export:
        return 3 * model, (f"the model ({_size(model)}) and the two copies of its weights torch.export.save "
                           "serializes")
    return model, f"the model ({_size(model)})"


def mapped_bytes(path: Path) -> int:
    """The address space the checkpoint at `path` takes memory-mapped: its size (torch.save's zip does not compress);
    0 where it cannot be read (the load names the file)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def refuse_checkpoint_shortfall(cfg: Config, tables, path: Path, export: bool, memory: HostMemory) -> None:
    """A MemoryError (exit 4, said as it is) where `checkpoint_host_need` exceeds `memory` (`HostMemory`: this
    process's rlimits, which swap does not lift, with the checkpoint's mapping (`mapped_bytes`); the host's
    MemAvailable and its cgroups' limits, with free swap under train.allow_swap). Nothing is refused where the memory is unknown; with train.check_host_memory false the refusal
    is a warning."""
    need, what = checkpoint_host_need(cfg, tables, path, export)
    mode = "--export" if export else "--eval-only"
    head = f"{mode} of {path} needs {_size(need)} of host memory, {what}"
    text, mapped = None, mapped_bytes(path)
    limited = memory.process is not None and need + mapped + memory.reserved > memory.process
    if limited and need + mapped > memory.process:
        text = (f"{head}, and maps the checkpoint ({_size(mapped)}) beside it, more than the {_size(memory.process)} "
                "this process may take (ulimit -v, ulimit -d)")
    elif limited:  # the model and the mapping fit, what the evaluation or the export maps after them does not (as a
        # training run's check counts it, `dlrm.train.host_memory.later_address_space`: it died later, of libgomp's
        # "Thread creation failed" or a segfault)
        short = need + mapped + memory.reserved - memory.process
        text = (f"{head}, and maps the checkpoint ({_size(mapped)}) and {_size(memory.reserved)} for its threads "
                f"(stacks, malloc arenas) and buffers beside it, more than the {_size(memory.process)} this process "
                f"may take (ulimit -v, ulimit -d; {_size(short)} more at least)")
    else:
        ram, ram_source = memory.shared()
        if ram is not None and need > ram:
            swap = memory.swap()
            total, total_source = memory.shared(with_swap=True)
            if cfg.train.allow_swap and need <= total:
                run_logger.warning(f"host memory: {head}, more than the {_size(ram)} {ram_source}: "
                                   f"{_size(need - ram)} of it will be in swap (train.allow_swap true)")
                return
            if cfg.train.allow_swap:
                text = f"{head}, more than the {_size(total)} {total_source}"
            else:
                text = f"{head}, more than the {_size(ram)} {ram_source}" + (
                    f" (or set train.allow_swap true to go on with {_size(need - ram)} of it in swap, of "
                    f"{_size(swap)} free)" if swap and need <= total else "")
    if text is None:
        return
    if not cfg.train.check_host_memory:  # the user's word that the estimate is wrong here: told, and it goes on
        run_logger.warning(f"host memory: {text}; going on: train.check_host_memory is false (short of memory, the "
                           "OOM killer ends it without a word)")
        return
    # (its tables' sizes are the checkpoint's: data.max_rows_per_table, a training run's cure, cannot shrink them)
    gpu = "" if export else " on a GPU (--device cuda: the model is built in the GPU's memory)"
    exc = MemoryError(f"{text}: " + (f"raise those limits{', or run it' + gpu if gpu else ''}" if limited
                                     else f"run it on a host with more free memory{', or' + gpu if gpu else ''}"))
    exc.dlrm_refused = True  # said as it is (`dlrm.cli.out_of_memory_message`): nothing was read
    raise exc
