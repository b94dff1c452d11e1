"""Whether the shards a manifest names were saved by one run at one step: what ``python -m dlrm.distributed.merge``
and a sharded ``--resume`` both check before using them.

A shard copied from another run of the same config, seed and step (on a dataset regenerated in place, under the same
run name) fits its manifest's plan, shapes, config and position; only the dense layers (DistributedDataParallel's,
the same on every rank of one run at one step) tell it apart. Merged, it gave one model of two runs' parts; resumed,
each rank trained its own dense layers from then on, silently, and every later checkpoint held both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from dlrm import checkpoint_schema as schema
from dlrm.config import ConfigError
from dlrm.mapped_load import load_mapped

# What a shard records of the run and the moment it was saved: equal in every shard of one checkpoint.
RUN_KEYS = ("config", "position", "cardinalities")


def first_difference(a: Any, b: Any, key: str = "") -> Optional[str]:
    """The first dotted key (in `a`'s order, then `b`'s) whose values differ; None if `a` equals `b`."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            found = first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))
            if found is not None:
                return found
        return None
    return None if a == b else key


def run_record(path: Path) -> dict[str, Any]:
    """The `RUN_KEYS` the shard at `path` recorded, and its dense model tensors (``dense``). Called once the file was
    read and checked whole (`dlrm.checkpoint.load_checkpoint`), so it is read again with its tensors memory-mapped:
    only the dense tensors compared are read, not the embedding table nor its optimizer state (a second full read of
    every shard doubled a large merge's time, and a rank's memory at a resume)."""
    allowed = [(obj, name) for name, obj in schema.v1_numpy_globals().items()]  # format 1's NumPy RNG state
    disk = load_mapped(str(path), allowed)  # (a name not UTF-8 too)
    if "config_json" in disk:  # format 2; format 1 holds the config dict itself
        disk["config"] = json.loads(disk["config_json"])
    record = {key: disk[key] for key in RUN_KEYS}
    record["dense"] = {k: v for k, v in disk["model"].items() if not k.startswith("sparse_arch.")}
    return record


def _dense_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Optional[str]:
    """The first dense model tensor (``model.<name>``) that two shards of one checkpoint would hold alike and do not."""
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k), b.get(k)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            return f"model.{k}"
    return None


def record_difference(a: dict[str, Any], b: dict[str, Any]) -> Optional[str]:
    """The first key (``config.<key>``, ``position.step``, ``model.<name>``, ...) whose values two `run_record`s
    differ in; None when the two shards are of one run at one step."""
    return (first_difference({k: v for k, v in a.items() if k != "dense"},
                             {k: v for k, v in b.items() if k != "dense"}) or _dense_difference(a["dense"], b["dense"]))


def check_same_run(paths: list[Path], remedy: str) -> None:
    """Raise a one-line ConfigError naming the first shard of `paths` and the first other one that was not saved by
    its run at its step, with the key that differs, then `remedy` (what the command's user can do)."""
    first = run_record(paths[0])
    for path in paths[1:]:
        key = record_difference(first, run_record(path))
        if key is not None:
            raise _different(paths[0], path, key, remedy)


def _different(first: Path, other: Path, key: str, remedy: str) -> ConfigError:
    return ConfigError(f"{first}, {other}: shards of different runs or steps ({key} differs); {remedy}")


def check_resumed_shard(manifest_path: Path, shards: list[str], rank: int) -> None:
    """At a resume of the checkpoint whose manifest at `manifest_path` names `shards`: rank `rank`'s shard compared
    with rank 0's (each rank but 0 compares its own, so the ranks read one file each beside their own, not every
    shard). A shard of another run raises on its rank; the others learn of it in the resume's agreed load
    (`dlrm.distributed.checkpoint.restore_agreed`), so every rank stops before its first step."""
    if rank == 0:
        return
    d = Path(manifest_path).parent
    try:
        first = run_record(d / shards[0])
    except Exception:  # noqa: BLE001 - damaged, missing, not a shard: rank 0 reads and checks that file whole in the
        return  # same agreed load and names what is wrong with it (raised here, torch's own error on a truncated file,
        # "OSError: [Errno 22] Invalid argument", naming no file, was a bug's traceback on every rank but 0, exit 1)
    key = record_difference(first, run_record(d / shards[rank]))
    if key is not None:
        raise _different(d / shards[0], d / shards[rank], key, f"{manifest_path} names shards of two runs: put this "
                         "run's own shard back, or resume from another of its checkpoints")
