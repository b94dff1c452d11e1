"""The host memory `--eval-only` and `--export` take on the CPU, weighed before the checkpoint is read (exit 4, one line),
as a training run's model is before its build (`dlrm.train.builder.refuse_host_memory_shortfall`).

Neither trains: no gradients, no optimizer state built. But the checkpoint is read whole (`dlrm.checkpoint.load_checkpoint`:
its tables, its sparse and dense optimizers' state) while the model it loads into is built beside it, and an export then
serializes the model's weights twice more (torch.export.save: `torch.save` into a BytesIO, then its `getvalue()` copy).
Measured on 10.4M rows x 16 fp32 with row-wise Adagrad (a 674.5 MiB checkpoint; the model 634.8 MiB): the peak resident
memory above the interpreter's was 1.3 GiB for --eval-only and 2.0 GiB for --export, against the 674.5 MiB a training
run is weighed with; short of it, the OOM killer ended them without a word.
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
    """(bytes, what they are) an evaluation (`export` False) or an export of the checkpoint at `path` takes at its
    peak: the file read whole beside the model (its weights as built: fp32 tables for an export, the vocabulary keys,
    the dense layers), and for an export the model with two serialized copies of its weights, the larger."""
    from dlrm.train.builder import dense_layer_parameters

    rows, dim = sum(tables.cardinalities), cfg.model.embedding_dim
    itemsize = 4 if export else _TABLE_DTYPES[cfg.model.embedding_dtype].itemsize
    model = (rows * dim * itemsize + vocabulary_key_bytes(tables.cardinalities, tables.hashing)
             + 4 * sum(dense_layer_parameters(cfg.model, len(tables.cardinalities)).values()))
    try:
        stored = os.stat(path).st_size  # its tensors are stored whole (torch.save's zip does not compress)
    except OSError:
        stored = 0  # (the load names the file)
    loading = stored + model
    text = f"the checkpoint read whole ({_size(stored)}, its optimizers' state too) beside the model ({_size(model)})"
    if export and 3 * model > loading:
        return 3 * model, (f"the model ({_size(model)}) and the two copies of its weights torch.export.save "
                           "serializes")
    return loading, text


def refuse_checkpoint_shortfall(cfg: Config, tables, path: Path, export: bool, memory: HostMemory) -> None:
    """A MemoryError (exit 4, said as it is) where `checkpoint_host_need` exceeds `memory` (`HostMemory`: this
    process's rlimits, which swap does not lift; the host's MemAvailable and its cgroups' limits, with free swap under
    train.allow_swap). Nothing is refused where the memory is unknown; with train.check_host_memory false the refusal
    is a warning."""
    need, what = checkpoint_host_need(cfg, tables, path, export)
    mode = "--export" if export else "--eval-only"
    head = f"{mode} of {path} needs {_size(need)} of host memory, {what}"
    text = None
    if memory.process is not None and need > memory.process:
        text = f"{head}, more than the {_size(memory.process)} this process may take (ulimit -v, ulimit -d)"
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
    limited = memory.process is not None and need > memory.process
    gpu = "" if export else " on a GPU (--device cuda: the model is built in the GPU's memory)"
    exc = MemoryError(f"{text}: " + (f"raise those limits{', or run it' + gpu if gpu else ''}" if limited
                                     else f"run it on a host with more free memory{', or' + gpu if gpu else ''}"))
    exc.dlrm_refused = True  # said as it is (`dlrm.cli.out_of_memory_message`): nothing was read
    raise exc
