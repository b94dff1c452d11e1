"""Checkpoints: everything needed to continue a run exactly, written so a crash never breaks one.

A checkpoint is one file ``tb_logs/<run>/checkpoints/step-<NNNNNNNN>.pt`` holding the
uncompiled model's state, optimizer and LR-schedule states, the step and data position, the
RNG states (Python, NumPy, torch CPU and CUDA), the table sizes and the resolved config.
It is written to a temporary name, flushed to disk, then renamed; the newest K are kept.

A checkpoint is data, never code: the file holds only tensors, numbers, strings and containers of
them (format 2, see `checkpoint_schema`) and is read with ``torch.load(weights_only=True)``, then
checked key by key, so a crafted file can neither run code nor crash a run with a traceback.
Format-1 files (written before format 2) are converted on load when only numpy's array
constructors are needed to read them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from loguru import logger

from dlrm.config import ConfigError, ModelConfig
from dlrm import checkpoint_schema as schema
from dlrm.errors import named_os_error  # (defined low: the data tools' worker processes use it too)
from dlrm.fast_save import fast_save
from dlrm.file_lock import pid_alive
from dlrm.mapped_load import cpu_storages, load_mapped, raise_if_out_of_memory, read_ahead
from dlrm.stream_save import stream_save
from dlrm.file_modes import file_mode
from dlrm.logging_setup import ProgressBar, bar_interval, run_logger
from dlrm.progress_file import ProgressFile as _ProgressFile, ReadProgress as _ReadProgress
from dlrm.stop_signal import signals_deferred

FORMAT_VERSION = schema.FORMAT_VERSION
_NAME = re.compile(r"step-(\d{8,})\.pt$")
# `write_atomic`'s temporary files of step-*.pt, their shards and best.pt: ".<name>.<pid>-<random>.tmp"
# (before format 2 without the pid)
_TEMP = re.compile(r"\.[^/]+\.pt\.(?:(\d+)-)?[^/]*\.tmp")
_WRITING: set[str] = set()  # absolute paths of the temporary files this process is writing now
PROGRESS_BYTES = 1 << 30
"""A checkpoint whose tensors take at least this many bytes shows a progress bar while it is written (MLPerf
DLRM-DCNv2's bf16 tables and their row-wise Adagrad state: ~53 GB, 86 s on an H200 machine's disk)."""


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done; the next batch is `batch` of `epoch`."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary files never match the name)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def rng_state() -> dict[str, Any]:
    """The random streams a resume continues. CUDA's only where this process started CUDA (a CUDA run has, by its
    first checkpoint): asking `torch.cuda.is_available()` starts it, for a generator a CPU run never uses. On an H200
    host (session 83) the sample's CPU run mapped 15.9 GiB of address space after its host-memory check (which `ulimit
    -v` runs are weighed at), near a CUDA run's whole 22.9: CUDA's start, inferred, not broken down by mapping. Since
    measured (session 87, H200 host, torch 2.11): a CPU training run starts CUDA's driver at its first backward anyway,
    before any checkpoint (the autograd engine counts the devices): +4.1 GiB of address space there, 4 MiB of GPU
    memory (a context takes hundreds), peak 21.0 GiB against 16.7 with the GPU hidden, this function as it is; so
    the inference above was of the wrong cause (`benchmarks/results/gpu_tests_2026-12-05_s87.md`)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """`rng_state`'s streams restored; CUDA's where this process started CUDA (a CUDA run has built its model on the
    GPU by then; a CPU resume of a GPU run's checkpoint uses no CUDA generator, and would start CUDA for it)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def trained_world_size(state: dict[str, Any]) -> Optional[int]:
    """The ranks whose epochs a loaded checkpoint's position counts (on N ranks an epoch's last batch of fewer than N
    rows is left out): its ``world_size``, the torchrun run's ranks, or a merged checkpoint's sharded run's, which a
    one-process session resumed from it keeps (`dlrm.train.train_data.TrainData`); else a shard's or manifest's plan's;
    None when unknown (a one-process or merged file written before checkpoints recorded it)."""
    if type(state.get("world_size")) is int:
        return state["world_size"]
    plan = (state.get("sharded") or {}).get("plan") or state.get("plan")
    return plan["world_size"] if isinstance(plan, dict) and type(plan.get("world_size")) is int else None


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0



def without_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of a checkpoint holding no tensor; mapped (`load_checkpoint(mmap=True)`), one tensor kept, however
    small (the RNG state's), keeps the whole file mapped: its size in address space (``ulimit -v``), its disk space.
    >>> without_tensors({"position": {"step": 3}, "rng": {"torch": torch.zeros(2, dtype=torch.uint8)}})
    {'position': {'step': 3}}"""
    return {k: v for k, v in state.items() if not cpu_storages(v)}

def move_to_new(tmp: Path, path: Path, exists: str) -> None:
    """Rename `tmp` to `path` unless something is there (a file, a symbolic link, dangling or not), even something that
    appeared after an earlier check: then ConfigError(`exists`), and `tmp` is the caller's to remove.

    A hard link makes the check and the rename one step; on a file system without hard links the check comes just
    before the rename."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ConfigError(exists) from None
    except OSError:  # no hard links here
        if os.path.lexists(path):
            raise ConfigError(exists) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def temp_stem(name: str, limit: int = 200) -> str:
    """`name` for a temporary name beside it (`write_atomic`'s, an export's), cut to `limit` bytes (keeping ``.pt``,
    which `_TEMP` looks for): the whole name plus ``.<pid>-<random>.tmp`` overflowed the 255-byte limit for a name
    near it (a merge's OUT, an export), "File name too long" after the whole merge, or training."""
    if len(os.fsencode(name)) <= limit:
        return name
    suffix = ".pt" if name.endswith(".pt") else ""
    cut = os.fsencode(name)[: limit - len(suffix)].decode("utf-8", errors="ignore")
    return cut + suffix


def write_atomic(path: Path, state: dict[str, Any], progress: bool = True, replace: bool = True) -> None:
    """torch.save `state` in format 2 to a temporary file, fsync, rename to `path`.

    `state` is the in-memory form (config dict, RNG tuples); it is converted and checked against
    the schema first, so a file this program could not load again is never written. With `progress`,
    a checkpoint of at least `PROGRESS_BYTES` shows a progress bar (bytes, rate, ETA) while it is written.
    Without `replace`, whatever is at `path`, even what appeared there while this was written, is kept: a ConfigError.
    """
    path = Path(path)
    disk = schema.to_disk(state)
    schema.validate(disk, path)
    fd, tmp = tempfile.mkstemp(prefix=f".{temp_stem(path.name)}.{os.getpid()}-", suffix=".tmp", dir=path.parent)
    _WRITING.add(os.path.abspath(tmp))
    total = tensor_bytes(disk) if progress else 0
    try:
        # redrawn once a minute at most into a file or pipe (`bar_interval`): an 86 s MLPerf save wrote ~860 copies
        with os.fdopen(fd, "wb") as f, ProgressBar(total=total, desc=f"writing {path.name}", unit="B",
                                                   unit_scale=True, dynamic_ncols=True, disable=total < PROGRESS_BYTES,
                                                   **bar_interval()) as bar:
            out = _ProgressFile(f, None if bar.disable else bar)
            try:
                # no CRC-32s (torch.load never checks them); the tensors' bytes streamed in chunk by chunk, or where
                # that cannot be (another torch's layout) torch.save's own copy of each CUDA storage, pinned
                with fast_save(disk):
                    if not stream_save(disk, out, f, tmp, lambda n: bar.update(min(n, max(0, bar.total - bar.n)))):
                        torch.save(disk, out)
            except (OSError, RuntimeError) as e:
                if out.stop is not None:
                    raise out.stop from None
                if out.error is None:
                    raise
                raise named_os_error(out.error, path) from e
            f.flush()
            os.fchmod(f.fileno(), file_mode())  # mkstemp creates 0600; a checkpoint is an ordinary file
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            move_to_new(Path(tmp), path, f"{path}: already exists; remove it or choose another path")
    except RuntimeError as e:
        # torch.save reports a full disk as a zip writer failure ("unexpected pos ..."): say what happened
        Path(tmp).unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < 1 << 30:
            raise OSError(errno.ENOSPC, f"no space left on the device writing the checkpoint ({free / 2**20:,.0f} MiB "
                                        f"free)", str(path)) from e
        raise
    except OSError as e:  # the flush, fsync or rename: named (the temporary's name would mean nothing to a user)
        Path(tmp).unlink(missing_ok=True)
        raise named_os_error(e, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        _WRITING.discard(os.path.abspath(tmp))


def write_files_atomic(directory: Path, files: dict[str, str | bytes]) -> None:
    """Write `files` (name -> text or bytes) in `directory` as one set, for reports of several files (--compare's,
    a sweep's): every one to a temporary file of its own in `directory` (fsync) first, then each renamed over its
    name. A failure while they are written (a full disk, a kill) leaves each file as it was and no temporary: never
    half a file, nor some of a new report beside the rest of an older one."""
    directory = Path(directory)
    temps: list[tuple[Path, Path]] = []
    try:
        for name, content in files.items():
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
                temps.append((Path(tmp), directory / name))
                with os.fdopen(fd, "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, file_mode())  # mkstemp creates 0600; a report is an ordinary file
            except OSError as e:  # the write's error names no file: this one's name (not its temporary's)
                raise named_os_error(e, directory / name) from None
        with signals_deferred():  # all renamed or none: a Ctrl-C or SIGTERM between two mixed the sets
            for tmp, path in temps:
                os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that were killed (`.step-*.pt.*.tmp`, `.best.pt.*.tmp`).

    Kept: the ones this process is writing now and the ones of another live process on this host
    (named by its pid). Returns the removed paths.
    """
    removed = []
    for p in Path(directory).glob(".*.pt.*.tmp"):
        m = _TEMP.fullmatch(p.name)
        if m is None or os.path.abspath(p) in _WRITING:
            continue
        pid = int(m.group(1)) if m.group(1) else None
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
    if removed:
        logger.warning(f"removed {len(removed)} temporary file(s) of interrupted checkpoint writes in {directory}: "
                       f"{', '.join(p.name for p in removed[:3])}")
    return removed


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (with the shard files of sharded ones)."""
    for old in list_checkpoints(run_dir)[:-keep]:
        # with a killed repeated save's shards (``.pt.pending``, ``.pt.previous``: `dlrm.distributed.checkpoint.
        # save_sharded`), each a shard's size, which nothing else removes; those names only (a user's copy is kept)
        # (matched whole: the glob's `*`s also took a user's "step-N.rank0-of-2.old.pt" for a shard, deleted)
        shard_name = re.compile(re.escape(old.stem) + r"\.rank\d+-of-\d+\.pt(\.pending|\.previous)?")
        for shard in old.parent.glob(old.stem + ".rank*-of-*.pt*"):
            if shard_name.fullmatch(shard.name):
                shard.unlink(missing_ok=True)
        old.unlink(missing_ok=True)


def save_checkpoint(run_dir: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write atomically (temp file, fsync, rename), then delete all but the newest `keep`.

    Temporary files that an earlier, killed write left in the directory are removed first.
    """
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / checkpoint_name(step)
    remove_stale_temp_files(d)
    write_atomic(path, state)
    prune_checkpoints(run_dir, keep)
    logger.info(f"checkpoint: {path}")
    return path


def _reason(e: BaseException) -> str:
    """One line saying why torch.load failed (its weights-only errors span several lines of advice)."""
    advice = ("Weights only load failed", "In PyTorch", "(1)", "(2)", "Check the documentation", "Please file")
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(advice)]
    text = (specific or lines or [""])[0]
    # torch's archive reader adds general advice on the same line ("... This is an internal miniz error. If you are
    # seeing this error, there is a high likelihood that your checkpoint f"): cut at 200 characters, it ended mid-word
    text = text.split(" This is an internal miniz error")[0]
    return f"{type(e).__name__}: {text[:200]}"


def _globals_needed(path: Path) -> set[str]:
    """The names of the functions and classes the file's pickle would call (read without unpickling)."""
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - the scanner knows fewer opcodes than the loader: the weights-only load decides
        return set()


def _is_export_program(path: Path) -> bool:
    """Whether the zip archive at `path` is a torch.export program (``<name>/archive_format``, no ``data.pkl``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name.rsplit("/", 1)[-1] for name in archive.namelist()]
    except (OSError, zipfile.BadZipFile, ValueError):  # (unreadable: torch.load's error says why)
        return False
    return "archive_format" in names and "data.pkl" not in names


def _read_plain(path: Path, mmap: bool = False) -> Any:
    """torch.load with weights_only=True, nothing else; numpy's array constructors allowed only for a
    file that names them (format 1's NumPy RNG state) and no other function or class. With `mmap`, the tensors are
    memory-mapped (`dlrm.mapped_load`), else read whole with a progress bar."""
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{path}: not a readable checkpoint "
                          "(not a zip archive: truncated, or not written by torch.save)")
    if _is_export_program(path):  # (refused as "failed locating file data.pkl: file not found ... internal miniz error")
        raise ConfigError(f"{path}: a torch.export program (what --export writes), not a checkpoint: give the .pt "
                          "checkpoint (or run directory) it was exported from")
    needed = _globals_needed(path)
    numpy_globals = schema.v1_numpy_globals()
    code = sorted(needed - set(numpy_globals))
    if code:
        raise ConfigError(f"{path}: refused: loading it would call {', '.join(ascii(n) for n in code[:3])}; "
                          "a checkpoint holds data only")
    allowed = [(obj, name) for name, obj in numpy_globals.items()] if needed else []
    if mmap:
        try:
            return load_mapped(str(path), allowed)
        except Exception as e:  # noqa: BLE001 - a file system without mmap, a damaged file: the plain read says which
            raise_if_out_of_memory(e, path, mapped=True)  # (short of address space: not read whole, which needs more)
    size = path.stat().st_size
    try:
        # a bar (bytes, rate, ETA) for a big one: a --resume of MLPerf's (tens of GB) read for minutes without a word
        with torch.serialization.safe_globals(allowed), open(path, "rb") as f, \
                ProgressBar(total=size, desc=f"reading {path.name}", unit="B", unit_scale=True, dynamic_ncols=True,
                            disable=size < PROGRESS_BYTES, **bar_interval()) as bar:
            return torch.load(f if bar.disable else _ReadProgress(f, bar), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read, but memory's, means a corrupt or foreign file
        raise_if_out_of_memory(e, path, mapped=False)
        raise ConfigError(f"{path}: not a readable checkpoint ({_reason(e)})") from None


def load_checkpoint(path: Path, mmap: bool = False, read: Optional[str] = None,
                    say_conversion: bool = True) -> dict[str, Any]:
    """The checkpoint, shard or manifest at `path` in its in-memory form (config dict, RNG tuples).

    Read as data only (see `_read_plain`), then checked against the schema: any problem is a one-line ConfigError naming
    the file. A format-1 file is converted to format 2, said in a warning unless `say_conversion` is False (a resume's
    second read of it). With `mmap`, its tensors are views of the file's pages (`dlrm.mapped_load`: no copy in this
    process's memory, read where used), and `read` ("all" or "model": the tensors the caller uses) is read ahead with a
    progress bar; a CPU tensor kept past the load (an optimizer's state) needs `dlrm.mapped_load.own_copies`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: checkpoint not found")
    raw = _read_plain(path, mmap)
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if type(version) is not int or version not in (1, FORMAT_VERSION):
        what = f"format_version {ascii(version)[:40]}" if isinstance(raw, dict) else f"holds a {type(raw).__name__}"
        raise ConfigError(f"{path}: not a checkpoint of this program ({what})")
    disk = schema.upgrade_v1(raw, path) if version == 1 else raw
    schema.validate(disk, path)
    if mmap and read is not None:  # (after the checks: a file refused is not read)
        read_ahead(disk if read == "all" else disk.get("model"), path.name, PROGRESS_BYTES)
    if version == 1 and say_conversion:
        run_logger.warning(f"converted format 1 checkpoint {path} to format 2 in memory; checkpoints written from now "
                           "on are format 2 (data only, loaded without running code)")
    return schema.from_disk(disk)


def resolve_resume(resume: str, run_dir: Path) -> Optional[Path]:
    """`--resume` alone means the run's latest checkpoint; otherwise it is a path."""
    if resume != "latest":
        return Path(resume)
    found = list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"--resume: no checkpoint in {checkpoint_dir(run_dir)}")
    return found[-1]


def vocabulary_digest(vocabs: Optional[list[torch.Tensor]]) -> Optional[str]:
    """A SHA-256 of the per-feature vocabularies (vocabulary hashing), None without them (modulus hashing): the
    raw-value-to-row mapping a checkpoint's embedding rows were trained under."""
    if vocabs is None:
        return None
    digest = hashlib.sha256()
    for vocab in vocabs:
        values = vocab.to(torch.int64).cpu().contiguous().numpy()
        digest.update(len(values).to_bytes(8, "little"))
        digest.update(values.astype("<i8").tobytes())
    return digest.hexdigest()


def fixed_model_keys(saved_model: dict[str, Any]) -> tuple[str, ...]:
    """The `model` keys (without the section) a checkpoint of this saved model config loads only with: its tensors'
    shapes, or what they compute (the activation). A resume cannot change them, even under --allow-config-change.

        >>> fixed_model_keys({"interaction": "dot"})[:3], fixed_model_keys({"interaction": "dcn"})[-2:]
        (('embedding_dim', 'bottom_mlp', 'top_mlp'), ('cross_layers', 'cross_rank'))
    """
    # a DCN model's cross network too (after "interaction": both are "dcn" there), named as the other keys are: another
    # rank or depth was refused as a tensor's shape or missing state_dict keys, naming no config key
    cross = ("cross_layers", "cross_rank") if saved_model.get("interaction") == "dcn" else ()
    return ("embedding_dim", "bottom_mlp", "top_mlp", "interaction", "activation", "top_mlp_input_multiple",
            "bottom_mlp_input_multiple", *cross)


def check_compatible(state: dict[str, Any], model: torch.nn.Module, cardinalities: list[int], model_cfg: dict, path: Path,
                     multi_hot_sizes: Optional[list[int]] = None, dense_format: str = "counts",
                     hashing: Optional[str] = None, vocabs: Optional[list[torch.Tensor]] = None) -> None:
    """Raise a one-line error naming what differs when the checkpoint cannot load into `model`.

    Kernel choices are not compared: torch and triton modules share state_dict keys. The values
    per feature (`multi_hot_sizes`, None: one each) are: the same tables pool differently otherwise;
    so is the data's `dense_format`: a model trained on log counts means nothing on other values; and so
    are the data's `hashing` and vocabularies (`vocabs`), which map raw values to rows (the model's
    vocabulary buffers are built from the dataset, not loaded): other ones look up other rows. A checkpoint
    written before these were recorded is not checked for them; `hashing` None: not checked either.
    """
    if "model" not in state:
        raise ConfigError(f"{path}: a sharded checkpoint's manifest holds no model; merge it for one process first: "
                          f"python -m dlrm.distributed.merge {path} OUT.pt")
    saved_cards = state["cardinalities"]
    if list(saved_cards) != list(cardinalities):
        diffs = [f"[{i}] {a} vs {b}" for i, (a, b) in enumerate(zip(saved_cards, cardinalities)) if a != b]
        # the data the checkpoint's run read: another dataset is the usual cause (README's `--eval-only` line without
        # the training run's --data evaluated on the config file's data.path, and said only that sizes differ)
        trained_on = (state.get("config") or {}).get("data", {}).get("path")
        on = f"; the checkpoint's run trained on {trained_on} (give its dataset with --data)" if trained_on else ""
        raise ConfigError(f"{path}: table sizes differ (checkpoint vs this run): {', '.join(diffs[:5])}{on}")
    saved_sizes = list(state.get("multi_hot_sizes") or [1] * len(saved_cards))  # older checkpoints: one-hot
    sizes = list(multi_hot_sizes or [1] * len(cardinalities))
    if saved_sizes != sizes:
        raise ConfigError(f"{path}: multi_hot_sizes differ: checkpoint {saved_sizes}, this run's data {sizes}")
    saved_dense = state.get("dense_format", "counts")  # older checkpoints: counts, the only format then
    if saved_dense != dense_format:
        raise ConfigError(f"{path}: dense_format differs: the checkpoint was trained on {saved_dense!r} dense "
                          f"columns, this run's data holds {dense_format!r} (metadata.json)")
    saved_hashing = state.get("hashing")  # older checkpoints: not recorded
    if hashing is not None and saved_hashing is not None:
        if saved_hashing != hashing:
            raise ConfigError(f"{path}: hashing differs: the checkpoint was trained with {saved_hashing!r} hashing, "
                              f"this run's data uses {hashing!r} (metadata.json): the same raw values map to other rows")
        saved_digest, digest = state.get("vocabulary_digest"), vocabulary_digest(vocabs)
        if saved_digest != digest:
            raise ConfigError(f"{path}: vocabulary differs: the checkpoint was trained with other vocabularies than "
                              f"this run's data holds (vocab/SPARSE_*.npy): the same raw values map to other rows")
    saved_model = state["config"]["model"]
    for key in fixed_model_keys(saved_model):
        saved_value = saved_model.get(key, getattr(ModelConfig(), key))  # keys added later: their default
        if saved_value != model_cfg.get(key):
            raise ConfigError(f"{path}: model.{key} differs: checkpoint {saved_value!r}, this run {model_cfg.get(key)!r}")
    own = model.state_dict()
    saved = state["model"]
    if set(own) != set(saved):
        missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        raise ConfigError(f"{path}: state_dict keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in own.items():
        if tuple(saved[k].shape) != tuple(v.shape):
            raise ConfigError(f"{path}: {k} has shape {tuple(saved[k].shape)} in the checkpoint, {tuple(v.shape)} here")
        # load_state_dict copies across kinds silently (int or bool weights became floats, complex ones lost their
        # imaginary part with a warning) and a meta tensor, which holds no values, failed with a traceback
        if saved[k].is_meta or _kind(saved[k].dtype) != _kind(v.dtype):
            held = "a meta tensor (no values)" if saved[k].is_meta else str(saved[k].dtype)
            raise ConfigError(f"{path}: {k} is {held} in the checkpoint, {v.dtype} here")
    if state.get("optimizers"):  # none: a model-only file (--eval-only, --export); a resume needs them (Checkpointer)
        _check_optimizer_state(state, model, path)


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else ("bool" if dtype == torch.bool else "int")


def _check_optimizer_state(state: dict[str, Any], model: torch.nn.Module, path: Path) -> None:
    """The optimizer states fit `model`'s parameters as `dlrm.train.optim.build_optimizers` hands them out: the dense
    optimizer all but the embedding weight (in ``model.parameters()`` order), the sparse one that weight (or one
    optimizer over them all).

    The schema checks only that they are plain data; torch's Optimizer.load_state_dict checks little more, so a
    hand-edited state failed with a traceback (a group of another size at the load; a moment of another shape, a
    missing moment or a string step counter at the first step, or an embedding index error) and a checkpoint with one
    optimizer resumed silently with the other's state fresh."""
    saved = state["optimizers"]
    sparse = model.sparse_arch.weight
    layouts = {1: [list(model.parameters())], 2: [[p for p in model.parameters() if p is not sparse], [sparse]]}
    if len(saved) not in layouts:
        raise ConfigError(f"{path}: checkpoint key 'optimizers' holds {len(saved)} optimizer states, this program "
                          "2 (dense, sparse)")
    expected = layouts[len(saved)]
    for i, (opt, params) in enumerate(zip(saved, expected)):
        key = f"optimizers[{i}]"
        ids = [pid for group in opt["param_groups"] for pid in group["params"]]
        if len(ids) != len(params) or len(set(ids)) != len(ids):
            raise ConfigError(f"{path}: checkpoint key '{key}.param_groups' names {len(ids)} parameters "
                              f"{ascii(ids[:5])[:60]}, the model has {len(params)} distinct ones for it")
        for j, group in enumerate(opt["param_groups"]):
            _check_hyperparameters(group, path, f"{key}.param_groups[{j}]")
        names = None
        for pid, per_param in opt["state"].items():
            if pid not in ids:
                raise ConfigError(f"{path}: checkpoint key '{key}.state.{pid}' is the state of no parameter of "
                                  "its param_groups")
            param = params[ids.index(pid)]
            if names is not None and set(per_param) != names:
                raise ConfigError(f"{path}: checkpoint key '{key}.state.{pid}' holds {sorted(per_param)}, the other "
                                  f"parameters' states {sorted(names)}")
            names = set(per_param)
            for name, value in per_param.items():
                _check_state_value(value, name, param, param is sparse and len(saved) == 2 and _row_wise(state), path,
                                   f"{key}.state.{pid}.{name}")


_NUMBERS = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value",
            "initial_lr")
_FLAGS = ("amsgrad", "maximize", "nesterov", "capturable", "differentiable", "decoupled_weight_decay")


def _is_scalar(value: Any) -> bool:
    """A number (not a bool) or a one-value floating tensor (torch takes tensor learning rates and betas)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return type(value) in (int, float)


def _check_hyperparameters(group: dict, path: Path, key: str) -> None:
    """torch's hyperparameters in a param group, where present, of their types: the load takes the checkpoint's
    (those the config sets are put back after it), and a string "betas" was a TypeError at the first step."""
    for name, value in group.items():
        if name in _NUMBERS:
            ok, what = _is_scalar(value), "a number"
        elif name == "betas":
            ok, what = type(value) in (list, tuple) and len(value) == 2 and all(map(_is_scalar, value)), "two numbers"
        elif name in _FLAGS:
            ok, what = type(value) is bool, "a bool"
        elif name in ("foreach", "fused"):
            ok, what = value is None or type(value) is bool, "a bool or None"
        else:
            continue  # params (checked above) and what other torch versions add
        if not ok:
            raise ConfigError(f"{path}: checkpoint key '{key}.{name}' must be {what}, got {ascii(value)[:40]}")


def _row_wise(state: dict[str, Any]) -> bool:
    """Whether the checkpoint's sparse optimizer keeps one sum per row (a (rows, dim) sum loaded into the row-wise
    update failed at its first step with an index_add_ traceback), by its config; unknown: either is taken."""
    optim = state["config"].get("optim")
    sparse = optim.get("sparse") if isinstance(optim, dict) else None
    name = sparse.get("name") if isinstance(sparse, dict) else None
    return name is None or name == "rowwise_adagrad"


def _check_state_value(value: Any, name: str, param: torch.Tensor, sparse: bool, path: Path, key: str) -> None:
    """A step counter: a number or a one-value tensor; the bf16 tables' rounding seed: a one-value integer tensor;
    anything else: a floating tensor of the parameter's shape (`sparse`: the row-wise sums, one per row)."""
    if name == "step":
        ok = type(value) in (int, float) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                             and _kind(value.dtype) in ("float", "int"))
        count = (value.item() if isinstance(value, torch.Tensor) else value) if ok else 0  # -5 made Adam's bias
        ok = ok and count >= 0 and count < float("inf")  # correction a complex root (a traceback), NaN a NaN loss
        what = "a finite number >= 0 or a one-value tensor of one"
    elif name == "momentum_buffer" and value is None:  # SGD without momentum: older torch kept a None
        ok, what = True, ""
    elif name == "sr_seed":
        ok = isinstance(value, torch.Tensor) and value.numel() == 1 and _kind(value.dtype) == "int"
        what = "a one-value integer tensor"
    else:
        shapes = [tuple(param.shape[:1])] if sparse else [tuple(param.shape)]
        ok = (isinstance(value, torch.Tensor) and not value.is_meta and value.is_floating_point()
              and tuple(value.shape) in shapes)
        what = f"a floating tensor of shape {' or '.join(map(str, shapes))}"
    if not ok:
        got = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
            f"{type(value).__name__} {ascii(value)[:40]}"
        raise ConfigError(f"{path}: checkpoint key {key!r} must be {what}, got {got}")
