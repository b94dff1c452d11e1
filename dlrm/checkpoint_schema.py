"""The on-disk form of a checkpoint (format 2): plain data only, so loading one never runs code.

A format-2 file holds only tensors, ints, floats, strings, bools, None, and lists, tuples and
dicts of them: what ``torch.load(..., weights_only=True)`` reads without calling anything but
torch's own tensor rebuilders. In memory the trainer keeps the natural forms (the config as a
dict, RNG states as ``random.getstate()`` / ``np.random.get_state()`` tuples); `to_disk` and
`from_disk` convert between the two:

    in memory                          on disk (format 2)
    config: dict                       config_json: str (JSON text)
    rng.python: (3, (625 ints), gauss) rng.python: {version, state: int64 tensor [625], gauss}
    rng.numpy: ("MT19937", uint32 ndarray [624], pos, has_gauss, cached_gaussian)
                                       rng.numpy: {algorithm, key: int64 tensor [624], pos, has_gauss, cached_gaussian}
    rng.torch / rng.cuda: uint8 tensors, unchanged

Three kinds of file, told apart by their keys:

- a checkpoint: format_version, model, optimizers, schedulers, position, rng, cardinalities,
  config_json, and optionally run_stats, multi_hot_sizes, dense_format, data_placement, hashing,
  vocabulary_digest, shuffle_scheme, dataset_stamps, world_size and train_rows;
- a shard of a sharded checkpoint: a checkpoint's keys plus rank and plan;
- the manifest of a sharded checkpoint: format_version, position, cardinalities, config_json, sharded, and
  optionally data_placement, shuffle_scheme, dataset_stamps, world_size and train_rows.

world_size: the ranks whose epochs the position counts (`dlrm.checkpoint.trained_world_size`); a shard's and a
manifest's is their plan's. train_rows: the train split's rows those epochs count (a resume's schedule check).

`validate` checks a loaded file against these (every required key, no other, each of its type)
and raises a one-line ConfigError naming the file and the key. `upgrade_v1` turns a format-1 file
(the config as a dict, the RNG states as pickled tuples with a numpy array) into format 2.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrm.config import ConfigError
from dlrm.data.dataset_stamps import is_stamps
from dlrm.data.shuffle_seed import SHUFFLE_SCHEME

FORMAT_VERSION = 2

_CHECKPOINT_KEYS = ("format_version", "model", "optimizers", "schedulers", "position", "rng", "cardinalities",
                    "config_json")
_SHARD_KEYS = _CHECKPOINT_KEYS + ("rank", "plan")
_MANIFEST_KEYS = ("format_version", "position", "cardinalities", "config_json", "sharded")
# Absent in older files: run totals unknown; one-hot; counts; the placement ("auto" resolved) unknown; the
# hashing and vocabularies unknown (not checked). vocabulary_digest: only with hashing "vocabulary". shuffle_scheme:
# only for train.seed >= 2**32, whose stream shuffle changed (`dlrm.data.shuffle_seed`). dataset_stamps: since
# 2026-12-04, the data's files as the run read them (`dlrm.data.dataset_stamps`; a resume on changed ones is refused).
# world_size: unknown (`dlrm.checkpoint.trained_world_size`). train_rows: unknown (`resume_policy.checkpoint_rows`).
_OPTIONAL_KEYS = ("run_stats", "multi_hot_sizes", "dense_format", "data_placement", "hashing", "vocabulary_digest",
                  "shuffle_scheme", "dataset_stamps", "world_size", "train_rows")
_MANIFEST_OPTIONAL = ("data_placement", "shuffle_scheme", "dataset_stamps", "world_size", "train_rows")
_SHARD_FILE = re.compile(r"(?:best-)?step-\d{8,}\.rank\d+-of-\d+\.pt")  # best-: a sharded best.pt's
_PLAIN_LEAVES = (bool, int, float, str, type(None))
_MAX_DEPTH = 32  # deeper nesting is no state of ours; the limit keeps the recursive checks bounded
_MAX_POSITION = 2**62  # far beyond any run; an int64 holds it and the step after it
_MT_WORDS = 624  # Mersenne Twister state words (Python's and NumPy's MT19937)


def _numpy_reconstruct():
    """numpy's ndarray unpickling helper (numpy 2 moved numpy.core to numpy._core)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def v1_numpy_globals() -> dict[str, Any]:
    """What ``np.random.get_state()``'s uint32 array in a format-1 file needs to unpickle, by name.

    Only numpy's array and dtype constructors: they build arrays of data and call nothing else
    (the array's items are themselves unpickled under the same allowlist). Both module names of
    the helper are listed, as a file written under numpy 1.x names numpy.core.
    """
    reconstruct = _numpy_reconstruct()
    names = {
        "numpy._core.multiarray._reconstruct": reconstruct,
        "numpy.core.multiarray._reconstruct": reconstruct,
        "numpy.ndarray": np.ndarray,
        "numpy.dtype": np.dtype,
    }
    if hasattr(np, "dtypes"):  # numpy >= 1.25 may name the dtype's class
        names["numpy.dtypes.UInt32DType"] = np.dtypes.UInt32DType
    return names


# ---------------------------------------------------------------------------------------------
# In memory <-> on disk


def encode_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """The RNG states of `rng_state()` as plain tensors and numbers (format 2)."""
    version, internal, gauss = rng["python"]
    algorithm, key, pos, has_gauss, cached_gaussian = rng["numpy"]
    return {
        "python": {"version": int(version), "state": torch.tensor(list(internal), dtype=torch.int64), "gauss": gauss},
        "numpy": {"algorithm": str(algorithm), "key": torch.from_numpy(np.asarray(key).astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": rng["torch"],
        "cuda": rng.get("cuda"),
    }


def decode_rng(disk: dict[str, Any]) -> dict[str, Any]:
    """The structure `set_rng_state` takes, from format 2's plain RNG states (already validated)."""
    py, npy = disk["python"], disk["numpy"]
    return {
        "python": (py["version"], tuple(py["state"].tolist()), py["gauss"]),
        "numpy": (npy["algorithm"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                  npy["cached_gaussian"]),
        "torch": disk["torch"],
        "cuda": disk["cuda"],
    }


def _plain_values(value: Any) -> Any:
    """`value` with numpy scalars turned into Python numbers (a median or a sum over numpy values
    is a numpy scalar, which weights_only loading would refuse)."""
    if isinstance(value, np.generic):
        return value.item()
    if type(value) in (list, tuple):
        return type(value)(_plain_values(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain_values(v) for k, v in value.items()}
    return value


def to_disk(state: dict[str, Any]) -> dict[str, Any]:
    """The format-2 form of an in-memory checkpoint, manifest or shard state."""
    disk: dict[str, Any] = {"format_version": FORMAT_VERSION}
    for key, value in state.items():
        if key == "format_version":
            continue
        if key == "config":
            disk["config_json"] = json.dumps(_plain_values(value))
        elif key == "rng":
            disk["rng"] = encode_rng(value)
        elif key == "model":
            disk["model"] = value  # tensors only; kept as is (its OrderedDict carries module versions)
        else:
            disk[key] = _plain_values(value)
    return disk


def from_disk(disk: dict[str, Any]) -> dict[str, Any]:
    """The in-memory form of a validated format-2 file: the config as a dict, RNG states as tuples."""
    state = {k: v for k, v in disk.items() if k not in ("config_json", "rng")}
    state["config"] = json.loads(disk["config_json"])
    if "rng" in disk:
        state["rng"] = decode_rng(disk["rng"])
    return state


def upgrade_v1(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A format-1 file (config dict, RNG tuples) in format 2's on-disk form, for `validate`.

    The contents are untrusted: whatever cannot be converted is a ConfigError naming the key.
    """
    disk = {k: v for k, v in raw.items() if k not in ("config", "rng")}
    disk["format_version"] = FORMAT_VERSION
    if "config" not in raw:
        raise _fail(path, "config", "missing")
    try:
        disk["config_json"] = json.dumps(raw["config"])
    except (TypeError, ValueError, RecursionError) as e:
        raise _fail(path, "config", f"is not JSON data ({type(e).__name__}: {_first_line(e)})") from None
    if "rng" in raw:
        try:
            disk["rng"] = encode_rng(raw["rng"])
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
            raise _fail(path, "rng", f"is not format 1's RNG states ({type(e).__name__}: {_first_line(e)})") from None
    return disk


# ---------------------------------------------------------------------------------------------
# Validation


def _fail(path: Path, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{path}: checkpoint key {key!r} {problem}")


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:160] if lines else ""


def _got(value: Any) -> str:
    """A short description of a value, for the error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if type(value) in _PLAIN_LEAVES:
        return f"{type(value).__name__} {ascii(value)[:40]}"
    return type(value).__name__


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low  # bool is an int subclass: type(), not isinstance()


def _is_dict(value: Any) -> bool:
    return type(value) in (dict, OrderedDict)


def _check_keys(d: dict, required: tuple, optional: tuple, path: Path, prefix: str = "") -> None:
    """Every required key present, no key other than required and optional ones."""
    for key in required:
        if key not in d:
            raise _fail(path, prefix + key, "missing")
    for key in d:
        if key not in required and key not in optional:
            raise _fail(path, prefix + str(key), "unexpected")


def _expect(ok: bool, value: Any, path: Path, key: str, expected: str) -> None:
    if not ok:
        raise _fail(path, key, f"must be {expected}, got {_got(value)}")


def _check_plain(value: Any, path: Path, key: str, tensors: bool = True, depth: int = 0) -> None:
    """`value` is plain data: numbers, strings, bools, None (tensors if allowed), lists, tuples and
    dicts (str or int keys) of them. Exact types: sets, bytes, numpy arrays, subclasses are refused."""
    if depth > _MAX_DEPTH:
        raise _fail(path, key, f"is nested more than {_MAX_DEPTH} levels deep")
    if type(value) in _PLAIN_LEAVES or (tensors and isinstance(value, torch.Tensor)):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, path, f"{key}[{i}]", tensors, depth + 1)
        return
    if _is_dict(value):
        for k, item in value.items():
            _expect(type(k) in (str, int), k, path, key, "a dict with str or int keys")
            _check_plain(item, path, f"{key}.{k}", tensors, depth + 1)
        return
    kinds = "numbers, strings, bools, None" + (", tensors" if tensors else "") + " and lists/dicts of them"
    raise _fail(path, key, f"must be plain data ({kinds}), got {_got(value)}")


def _check_int_list(value: Any, path: Path, key: str, low: int) -> None:
    ok = type(value) in (list, tuple) and all(_is_int(v, low) for v in value)
    _expect(ok, value, path, key, f"a list of ints >= {low}")


def _check_model(model: Any, path: Path) -> None:
    _expect(_is_dict(model), model, path, "model", "a dict of parameter name -> tensor")
    for name, value in model.items():
        _expect(type(name) is str, name, path, "model", "a dict with str keys")
        ok = isinstance(value, torch.Tensor) and value.layout == torch.strided
        _expect(ok, value, path, f"model.{name}", "a dense tensor")


def _check_optimizers(optimizers: Any, path: Path) -> None:
    """Each entry is an ``Optimizer.state_dict()``: per-parameter state and param groups."""
    _expect(type(optimizers) is list, optimizers, path, "optimizers", "a list of optimizer state_dicts")
    storages: dict[int, str] = {}  # every optimizer's state tensors, by storage (`_check_state_tensor_memory`)
    for i, opt in enumerate(optimizers):
        key = f"optimizers[{i}]"
        _expect(_is_dict(opt), opt, path, key, "an optimizer state_dict (a dict)")
        _check_keys(opt, ("state", "param_groups"), (), path, key + ".")
        state, groups = opt["state"], opt["param_groups"]
        _expect(_is_dict(state), state, path, f"{key}.state", "a dict of parameter index -> dict")
        for pid, per_param in state.items():
            ok = _is_int(pid) and _is_dict(per_param) and all(type(k) is str for k in per_param)
            _expect(ok, per_param, path, f"{key}.state.{pid}", "a dict of str -> state (keyed by an int >= 0)")
            _check_plain(per_param, path, f"{key}.state.{pid}")
            for name, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    _check_state_tensor_memory(value, path, f"{key}.state.{pid}.{name}", storages)
        ok = type(groups) is list and len(groups) > 0 and all(_is_dict(g) for g in groups)
        _expect(ok, groups, path, f"{key}.param_groups", "a non-empty list of dicts")
        for j, group in enumerate(groups):
            _expect(all(type(k) is str for k in group), group, path, f"{key}.param_groups[{j}]", "a dict with str keys")
            if "params" not in group:
                raise _fail(path, f"{key}.param_groups[{j}].params", "missing")
            _check_int_list(group["params"], path, f"{key}.param_groups[{j}].params", 0)
            _check_plain(group, path, f"{key}.param_groups[{j}]")


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of the strided tensor `t` may share one memory location (its strides, smallest first,
    must each step past all the elements of the dimensions before them: what a tensor torch allocates does)."""
    extent = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _check_state_tensor_memory(value: torch.Tensor, path: Path, key: str, storages: dict[int, str]) -> None:
    """An optimizer's state tensor is updated in place, so it must be a strided tensor of its own memory: torch.save
    keeps a tensor's strides and storage sharing, and a hand-made file's moment of stride 0 (``expand``) or in
    another layout (sparse) failed at the first step with a traceback, while two moments of one storage (`storages`:
    the optimizer's state tensors seen so far, by storage) trained silently on each other's values."""
    if value.layout != torch.strided or value.is_meta:
        raise _fail(path, key, f"must be a dense tensor, got one of layout {value.layout}"
                    + (" (meta: no values)" if value.is_meta else ""))
    if _overlaps(value):
        raise _fail(path, key, f"must hold each element in its own memory, got shape {tuple(value.shape)} with "
                    f"strides {value.stride()} (elements overlap)")
    if value.numel():
        ptr = value.untyped_storage().data_ptr()
        if ptr in storages:
            raise _fail(path, key, f"shares its memory with {storages[ptr]} (each state tensor needs its own)")
        storages[ptr] = key


def _replaces_code(key: str) -> bool:
    """Whether a scheduler state key would replace the scheduler's optimizer or one of its methods: load_state_dict
    sets every key as an attribute (an "optimizer" or "step" key made the first step an AttributeError/TypeError)."""
    attr = inspect.getattr_static(torch.optim.lr_scheduler.LambdaLR, key, None)
    return key == "optimizer" or callable(attr) or isinstance(attr, (property, staticmethod, classmethod))


def _check_schedulers(schedulers: Any, path: Path) -> None:
    """LR scheduler state_dicts: plain data whose keys are state, not the scheduler's code; the step (last_epoch) an
    int and the learning rates numbers (a string last_epoch was a TypeError at the first step, a dict without any
    state a KeyError at the load: tracebacks)."""
    _expect(type(schedulers) is list, schedulers, path, "schedulers", "a list of LR scheduler state_dicts")
    for i, sched in enumerate(schedulers):
        key = f"schedulers[{i}]"
        ok = _is_dict(sched) and all(type(k) is str for k in sched)
        _expect(ok, sched, path, key, "a scheduler state_dict (a dict with str keys)")
        _check_plain(sched, path, key)
        for name in sched:
            if _replaces_code(name):
                raise _fail(path, f"{key}.{name}", "unexpected (names the scheduler's optimizer or a method)")
        _check_keys(sched, ("last_epoch", "base_lrs"), tuple(sched), path, key + ".")
        last = sched["last_epoch"]
        _expect(_is_int(last) and last < _MAX_POSITION, last, path, f"{key}.last_epoch", "an int in [0, 2**62)")
        for name in ("base_lrs", "_last_lr"):
            if name in sched:
                value = sched[name]
                # one-value tensors too: a captured step keeps each group's lr as a device tensor (graphed_step)
                _expect(type(value) is list and all(_is_number(v) or _is_one_float(v) for v in value), value, path,
                        f"{key}.{name}", "a list of numbers")
        if "lr_lambdas" in sched:  # LambdaLR's: the state of each group's function (None: a plain function)
            lambdas = sched["lr_lambdas"]
            _expect(type(lambdas) is list and len(lambdas) == len(sched["base_lrs"])
                    and all(f is None or _is_dict(f) for f in lambdas), lambdas, path, f"{key}.lr_lambdas",
                    "a list of None or dicts, one per learning rate")
        if "_step_count" in sched:
            _expect(_is_int(sched["_step_count"]), sched["_step_count"], path, f"{key}._step_count", "an int >= 0")


def _check_position(position: Any, path: Path) -> None:
    _expect(_is_dict(position), position, path, "position", "a dict with int step, epoch, batch")
    _check_keys(position, ("step", "epoch", "batch"), (), path, "position.")
    for key in ("step", "epoch", "batch"):
        _expect(_is_int(position[key]), position[key], path, f"position.{key}", "an int >= 0")
        # bounded: TensorBoard's purge_step (step + 1) is an int64, so a larger step was a ValueError traceback
        _expect(position[key] < _MAX_POSITION, position[key], path, f"position.{key}", "an int < 2**62")


def _check_state_tensor(value: Any, path: Path, key: str, size: int, high: int) -> None:
    """An int64 tensor of `size` values in [0, high)."""
    ok = (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and tuple(value.shape) == (size,)
          and bool((value >= 0).all()) and bool((value < high).all()))
    _expect(ok, value, path, key, f"an int64 tensor of {size} values in [0, {high})")


def _check_python_rng(py: Any, path: Path) -> None:
    """Python's Mersenne Twister: 624 32-bit words and the position (random.setstate checks little)."""
    _expect(_is_dict(py), py, path, "rng.python", "a dict (version, state, gauss)")
    _check_keys(py, ("version", "state", "gauss"), (), path, "rng.python.")
    _expect(type(py["version"]) is int and py["version"] == random.Random.VERSION, py["version"], path,
            "rng.python.version", f"{random.Random.VERSION}")
    _check_state_tensor(py["state"], path, "rng.python.state", _MT_WORDS + 1, 2**32)
    _expect(int(py["state"][-1]) <= _MT_WORDS, py["state"], path, "rng.python.state", f"a position <= {_MT_WORDS} last")
    _expect(py["gauss"] is None or type(py["gauss"]) is float, py["gauss"], path, "rng.python.gauss", "a float or None")


def _check_numpy_rng(npy: Any, path: Path) -> None:
    """NumPy's legacy MT19937 state (np.random.set_state checks neither pos nor has_gauss)."""
    _expect(_is_dict(npy), npy, path, "rng.numpy", "a dict (algorithm, key, pos, has_gauss, cached_gaussian)")
    _check_keys(npy, ("algorithm", "key", "pos", "has_gauss", "cached_gaussian"), (), path, "rng.numpy.")
    algorithm = npy["algorithm"]
    _expect(type(algorithm) is str and algorithm == "MT19937", algorithm, path, "rng.numpy.algorithm", "'MT19937'")
    _check_state_tensor(npy["key"], path, "rng.numpy.key", _MT_WORDS, 2**32)
    pos = npy["pos"]
    _expect(_is_int(pos) and pos <= _MT_WORDS, pos, path, "rng.numpy.pos", f"an int in [0, {_MT_WORDS}]")
    _expect(type(npy["has_gauss"]) is int and npy["has_gauss"] in (0, 1), npy["has_gauss"], path,
            "rng.numpy.has_gauss", "0 or 1")
    _expect(type(npy["cached_gaussian"]) is float, npy["cached_gaussian"], path, "rng.numpy.cached_gaussian", "a float")


def _is_byte_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _check_rng(rng: Any, path: Path) -> None:
    """Types and ranges, then a trial on fresh generators: the global ones are set only on resume."""
    _expect(_is_dict(rng), rng, path, "rng", "a dict (python, numpy, torch, cuda)")
    _check_keys(rng, ("python", "numpy", "torch", "cuda"), (), path, "rng.")
    _check_python_rng(rng["python"], path)
    _check_numpy_rng(rng["numpy"], path)
    _expect(_is_byte_state(rng["torch"]), rng["torch"], path, "rng.torch", "a 1-D uint8 tensor")
    cuda = rng["cuda"]
    ok = cuda is None or (type(cuda) is list and all(_is_byte_state(t) for t in cuda))
    _expect(ok, cuda, path, "rng.cuda", "None or a list of 1-D uint8 tensors")
    state = decode_rng(rng)
    for key, apply in (("python", random.Random().setstate), ("numpy", np.random.RandomState().set_state),
                       ("torch", torch.Generator().set_state)):
        try:
            apply(state[key])
        except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as e:
            raise _fail(path, f"rng.{key}", f"is not a valid generator state ({_first_line(e)})") from None


def _check_config_json(text: Any, path: Path) -> None:
    _expect(type(text) is str, text, path, "config_json", "the config as JSON text")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _fail(path, "config_json", f"is not valid JSON ({_first_line(e)})") from None
    _expect(_is_dict(config), config, path, "config_json", "a JSON object")
    _expect(_is_dict(config.get("model")), config.get("model"), path, "config_json.model", "a JSON object")


def _check_plan(plan: Any, path: Path, key: str) -> None:
    """A ShardingPlan.to_dict(): world_size, the table sizes and each table's owner (-1: row-wise)."""
    _expect(_is_dict(plan), plan, path, key, "a dict (world_size, cardinalities, table_rank)")
    _check_keys(plan, ("world_size", "cardinalities", "table_rank"), (), path, key + ".")
    world = plan["world_size"]
    _expect(_is_int(world, 1), world, path, f"{key}.world_size", "an int >= 1")
    _check_int_list(plan["cardinalities"], path, f"{key}.cardinalities", 1)
    ranks = plan["table_rank"]
    ok = (type(ranks) in (list, tuple) and len(ranks) == len(plan["cardinalities"])
          and all(type(r) is int and -1 <= r < world for r in ranks))
    _expect(ok, ranks, path, f"{key}.table_rank", f"one int in [-1, {world}) per table")


def _check_sharded(sharded: Any, path: Path) -> None:
    _expect(_is_dict(sharded), sharded, path, "sharded", "a dict (world_size, plan, shards)")
    _check_keys(sharded, ("world_size", "plan", "shards"), (), path, "sharded.")
    world = sharded["world_size"]
    _expect(_is_int(world, 1), world, path, "sharded.world_size", "an int >= 1")
    _check_plan(sharded["plan"], path, "sharded.plan")
    _expect(sharded["plan"]["world_size"] == world, sharded["plan"]["world_size"], path, "sharded.plan.world_size",
            f"sharded.world_size ({world})")
    shards = sharded["shards"]
    # bare names of this directory's shard files: a manifest must not point anywhere else
    ok = (type(shards) is list and len(shards) == world
          and all(type(s) is str and _SHARD_FILE.fullmatch(s) for s in shards))
    _expect(ok, shards, path, "sharded.shards", f"a list of {world} shard file names ([best-]step-N.rankQ-of-W.pt)")


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _is_one_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _check_run_stats(stats: Any, path: Path) -> None:
    """The run's totals so far (the trainer's RunStats): plain data; when not empty, samples (int),
    train_s (a number) and train_losses ([step, loss] pairs), and, when there, evals_since_best (int), evaluated_step
    (None or int) and best (None, or the best evaluation: its step, the name of its metric and that metric's value),
    which a resume reads back."""
    ok = _is_dict(stats) and all(type(k) is str for k in stats)
    _expect(ok, stats, path, "run_stats", "a dict with str keys")
    _check_plain(stats, path, "run_stats", tensors=False)
    if not stats:
        return
    _check_keys(stats, ("samples", "train_s", "train_losses"), tuple(stats), path, "run_stats.")
    _expect(_is_int(stats["samples"]), stats["samples"], path, "run_stats.samples", "an int >= 0")
    _expect(_is_number(stats["train_s"]), stats["train_s"], path, "run_stats.train_s", "a number")
    losses = stats["train_losses"]
    ok = type(losses) is list and all(type(p) in (list, tuple) and len(p) == 2 and all(_is_number(x) for x in p)
                                      for p in losses)
    _expect(ok, losses, path, "run_stats.train_losses", "a list of [step, loss] pairs")
    if "evals_since_best" in stats:
        _expect(_is_int(stats["evals_since_best"]), stats["evals_since_best"], path, "run_stats.evals_since_best",
                "an int >= 0")
    # the step whose evaluation the checkpoint holds (`Checkpointer`): a resume at that step does not evaluate
    # again; unchecked, a hand-edited non-int never matched and the evaluation counted twice towards patience
    if "evaluated_step" in stats:
        step = stats["evaluated_step"]
        _expect(step is None or _is_int(step), step, path, "run_stats.evaluated_step", "None or an int >= 0")
    best = stats.get("best")
    ok = best is None or (_is_dict(best) and _is_int(best.get("step")) and type(best.get("metric")) is str
                          and _is_number(best.get(best["metric"])))
    _expect(ok, best, path, "run_stats.best", "None or a dict with the int step, the metric's name and its value")
    grid = stats.get("grid_best")  # early stopping's reference when best is off the eval_every grid (RunStats)
    ok = grid is None or (_is_dict(grid) and (not grid or (_is_int(grid.get("step")) and type(grid.get("metric")) is str
                                                           and _is_number(grid.get(grid["metric"])))))
    _expect(ok, grid, path, "run_stats.grid_best", "None, {} or a dict with the int step, the metric's name and its value")
    # the losses since the last logging step (`StepMeter.snapshot`): a resume puts them back in its first window
    # (unchecked, a malformed list was a float() traceback in RunStats.from_dict, a string read as digit losses)
    if "window_losses" in stats:
        window = stats["window_losses"]
        _expect(type(window) is list and all(_is_number(x) for x in window), window, path,
                "run_stats.window_losses", "a list of numbers")
    # train.early_stopping.target's (dlrm.train.target): a resume reads them back
    if "eval_s" in stats:
        _expect(_is_number(stats["eval_s"]), stats["eval_s"], path, "run_stats.eval_s", "a number")
    if "wall_s" in stats:  # the wall clock up to this checkpoint, across sessions (time_to_target_wall_s goes on)
        _expect(_is_number(stats["wall_s"]), stats["wall_s"], path, "run_stats.wall_s", "a number")
    target = stats.get("target")
    ok = target is None or (_is_dict(target) and _is_int(target.get("step")) and type(target.get("metric")) is str
                            and all(_is_number(target.get(k)) for k in ("value", "train_s", "wall_s")))
    _expect(ok, target, path, "run_stats.target", "None or a dict with the int step, the metric's name, its value, "
            "train_s and wall_s")


def _check_common(disk: dict[str, Any], path: Path) -> None:
    """The keys every kind of file has."""
    _check_position(disk["position"], path)
    cards = disk["cardinalities"]
    _expect(type(cards) is list and len(cards) > 0, cards, path, "cardinalities", "a non-empty list of ints")
    _check_int_list(cards, path, "cardinalities", 1)
    if "multi_hot_sizes" in disk:
        sizes = disk["multi_hot_sizes"]
        _expect(type(sizes) is list and len(sizes) == len(cards), sizes, path, "multi_hot_sizes",
                f"a list of {len(cards)} ints (one per table)")
        _check_int_list(sizes, path, "multi_hot_sizes", 1)
    if "dense_format" in disk:
        _expect(disk["dense_format"] in ("counts", "float"), disk["dense_format"], path, "dense_format",
                "'counts' or 'float'")
    if "hashing" in disk:
        _expect(disk["hashing"] in ("modulus", "vocabulary"), disk["hashing"], path, "hashing",
                "'modulus' or 'vocabulary'")
    if "vocabulary_digest" in disk:
        digest = disk["vocabulary_digest"]
        _expect(type(digest) is str and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest), digest,
                path, "vocabulary_digest", "a SHA-256 hex digest")
    if "data_placement" in disk:
        _expect(disk["data_placement"] in ("stream", "gpu"), disk["data_placement"], path, "data_placement",
                "'stream' or 'gpu'")
    if "dataset_stamps" in disk:
        _expect(is_stamps(disk["dataset_stamps"]), disk["dataset_stamps"], path, "dataset_stamps",
                "a dict of file names to their stamps (strings)")
    if "train_rows" in disk:  # (the rows of the train split its epochs count: a run refuses a split of none)
        _expect(_is_int(disk["train_rows"], 1), disk["train_rows"], path, "train_rows", "an int >= 1")
    if "shuffle_scheme" in disk:
        _expect(type(disk["shuffle_scheme"]) is int and disk["shuffle_scheme"] == SHUFFLE_SCHEME,
                disk["shuffle_scheme"], path, "shuffle_scheme", str(SHUFFLE_SCHEME))
    _check_config_json(disk["config_json"], path)


def _check_training_state(disk: dict[str, Any], path: Path) -> None:
    """The keys of a checkpoint (and of a shard): what resuming loads."""
    _check_model(disk["model"], path)
    _check_optimizers(disk["optimizers"], path)
    _check_schedulers(disk["schedulers"], path)
    # one schedule per optimizer or none: with fewer, the resume silently ran the others from step 0 (another lr)
    count = len(disk["schedulers"])
    _expect(count in (0, len(disk["optimizers"])), count, path, "schedulers",
            f"none or one per optimizer ({len(disk['optimizers'])})")
    _check_rng(disk["rng"], path)
    if "run_stats" in disk:
        _check_run_stats(disk["run_stats"], path)


def validate(disk: Any, path: Path) -> None:
    """Raise a one-line ConfigError naming `path` and the key unless `disk` is a format-2 file."""
    if not _is_dict(disk):
        raise ConfigError(f"{path}: not a checkpoint of this program (holds a {type(disk).__name__}, not a dict)")
    version = disk.get("format_version")
    _expect(type(version) is int and version == FORMAT_VERSION, version, path, "format_version", str(FORMAT_VERSION))
    if "sharded" in disk:
        _check_keys(disk, _MANIFEST_KEYS, _MANIFEST_OPTIONAL, path)
        _check_common(disk, path)
        _check_sharded(disk["sharded"], path)
        _check_world_size(disk, disk["sharded"]["world_size"], path)
        return
    is_shard = "rank" in disk or "plan" in disk
    _check_keys(disk, _SHARD_KEYS if is_shard else _CHECKPOINT_KEYS, _OPTIONAL_KEYS, path)
    _check_common(disk, path)
    _check_training_state(disk, path)
    if is_shard:
        _check_plan(disk["plan"], path, "plan")
        _expect(_is_int(disk["rank"]) and disk["rank"] < disk["plan"]["world_size"], disk["rank"], path, "rank",
                f"an int in [0, {disk['plan']['world_size']})")
    _check_world_size(disk, disk["plan"]["world_size"] if is_shard else None, path)


def _check_world_size(disk: dict[str, Any], plan_world: Any, path: Path) -> None:
    """The optional world_size: an int >= 1; a shard's or manifest's its plan's (`plan_world`)."""
    if "world_size" not in disk:
        return
    world = disk["world_size"]
    _expect(_is_int(world, 1), world, path, "world_size", "an int >= 1")
    if plan_world is not None:
        _expect(world == plan_world, world, path, "world_size", f"the sharding plan's world_size ({plan_world})")

