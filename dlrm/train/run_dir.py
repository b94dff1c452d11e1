"""A run owns its directory: one writer at a time, resumes that cannot clobber, failed starts cleaned up.

``tb_logs/<run-name>/`` holds a run's TensorBoard events, ``config.json``, ``summary.json`` and
``checkpoints/``. The rules, each enforced here and tested in tests/test_run_dir.py:

* **One writer.** The directory's ``.lock`` file is held with ``fcntl.flock`` for the whole run and
  names the holder's pid and host; a second process (a second ``--resume`` of the same run, say)
  is refused with that pid. The kernel drops the lock when its holder dies, so a lock left by a
  killed run is stale by construction: it is taken over, and the log says so. Its holder removes the
  file when it lets go, once summary.json or checkpoints/ marks the directory (`RunLock.release`).
  What a resume decided before it held the lock is checked again under it: a later checkpoint that
  another process saved meanwhile is refused, not trained over.
* **A new run never reuses a name.** A non-empty directory is refused (use ``--resume``); a run without
  ``--run-name`` whose default name (``<config>-<date>-<time>``) another run started in the same second holds gets
  the first free ``<name>-2``, ``<name>-3``, ...
* **A resume writes only into a run.** ``--resume`` of a checkpoint outside a run's ``checkpoints/`` (a copy
  elsewhere) needs ``--run-name NEW``: its folder is not a run to continue in place.
* **A resume writes only into its own run.** ``--resume PATH`` continues the run the checkpoint
  belongs to; a ``--run-name`` naming another run is an error, unless that name is new: then the
  checkpoint's run is copied into a fresh run of that name (said in the log) and the original is
  never written. Resuming from a checkpoint that is not its run's latest would overwrite the later
  ones, so it is refused with that hint.
* **A branch stopped before its first checkpoint goes on from its start.** A new run continued from a checkpoint
  records it (``branched_from.json``: the file and its step); ``--resume`` of it with no step checkpoint yet goes on
  from there (`branch_start`), not from the best.pt it linked (its source run's best step, earlier) nor from step 0.
* **A run stopped before its first checkpoint starts again.** ``--resume`` (latest) of a run directory that is missing,
  or holds only what a run writes before its first checkpoint (`restart_leftovers`: config.json of the same run, its
  TensorBoard events, the lock, profiler traces, temporary files), starts the run from step 0 there, the earlier
  events removed at its first step (they would show twice); anything else there is refused, named.
* **A failed start leaves nothing behind.** A directory this process created is removed again if
  the run fails before its first training step (it holds only what the start wrote).

The resolved absolute path is logged whenever it differs from what was typed (absolute
``--tb-dir``, ``..``, symbolic links), so a user always knows where a run writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from loguru import logger

from dlrm.checkpoint import list_checkpoints, remove_stale_temp_files
from dlrm.checkpoint_schema import v1_numpy_globals
from dlrm.config import Config, ConfigError
from dlrm.config_checks import free_run_name
from dlrm.data.schema import write_json_atomic
from dlrm.data.output_dirs import RUN_MARKS
from dlrm.mapped_load import load_mapped
from dlrm.file_lock import LockHeld, NotALockFile, name_holder, remove_held, try_lock_named
from dlrm.stop_signal import stop_signal_name
from dlrm.json_file import read_json

_VALID_NAME = re.compile(r"[\w.+-]+")
_RUN_CHECKPOINT = re.compile(r"(?:step-\d{8,}|best)\.pt")  # the names a run gives its checkpoints
LOCK_NAME = ".lock"
BRANCH_NAME = "branched_from.json"
"""A branch's start (`RunDirectory.for_resume`): ``{"checkpoint": path, "step": N}``. A branch killed before its first
step checkpoint held only best.pt, a link to its source run's best step's model (earlier than N, or none): its
``--resume`` went on from there (or from step 0) and trained other steps than the branch, silently."""


def run_name(cfg: Config) -> str:
    """The run's name: ``log.run_name``, or ``<config>-<date>-<time>``; validated."""
    name = cfg.log.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not _VALID_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(f"log.run_name: {name!r} may hold only letters, digits and . _ + -")
    return name


def describe_path(path: Path) -> str:
    """`path` as typed, plus where it really is when that differs (absolute, .., symlinks)."""
    real = Path(os.path.realpath(path))
    return str(path) if str(real) == str(path) else f"{path} (resolves to {real})"


def run_of(checkpoint: Path) -> Optional[Path]:
    """The run `checkpoint` belongs to (``<run>/checkpoints/*.pt``, where a run writes every checkpoint:
    `dlrm.checkpoint.checkpoint_dir`), or None for a checkpoint elsewhere (a copy).

    The path as given first: a run's ``checkpoints/`` may be a symbolic link to another disk, and resolved, the
    link target's parent was taken for the run (the run's own checkpoint refused as another run's, or written
    beside). Then the path resolved: a symbolic link to a run's checkpoint file. Either way it must look like a run's
    (`_in_run`): a copy kept in a folder of the user's that happens to be called checkpoints/
    (models/checkpoints/mine.pt) was taken for a run's, and `--resume` of it wrote events, .lock, checkpoints and
    summary.json (over one there) into models/."""
    given = Path(os.path.abspath(checkpoint))
    if given.parent.name == "checkpoints" and _in_run(given):
        return given.parent.parent
    real = given.resolve()
    return real.parent.parent if real.parent.name == "checkpoints" and _in_run(real) else None


def run_dir_present(run_dir: Path) -> None:
    """Refuse to write into a run directory that was removed while the run wrote it (a cleanup job, a mistaken rm):
    the saves' ``mkdir(parents=True)`` made it again, empty of the earlier checkpoints, best.pt, config.json and the
    lock, and the run finished with exit 0, its summary naming a best.pt that no longer existed."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"{run_dir}: the run directory is gone (removed while the run wrote it, with its "
                          "checkpoints); stopped without writing it again")


# What a run writes before its first checkpoint: config.json (and `write_json_atomic`'s temporary file of it), the lock,
# TensorBoard's event files, the profiler's traces; in checkpoints/, only a save's temporary files (killed while writing)
# and a distributed save's shards (killed before their manifest)
# (a trace's temporary file, `dlrm.train.profiling.trace_handler`, too: a session killed while it saved the trace)
_TRACE_TEMP = re.compile(r"\.[^/]+\.pt\.trace\.json\.gz\.[a-z0-9_]{8}\.tmp\.gz")
_BEFORE_FIRST = re.compile(r"config\.json|\.config\.json\..+\.tmp|\.lock|events\.out\.tfevents\..+"
                           r"|.+\.pt\.trace\.json(?:\.gz)?|" + _TRACE_TEMP.pattern)
_SAVE_TEMP = re.compile(r"\.[^/]+\.pt\.[^/]*\.tmp")
# the shards of a distributed run's save (`dlrm.distributed.checkpoint.shard_name`) killed before the manifest naming
# them was written: what its first save leaves as a one-process run's leaves a temporary file (refused, the job
# requeued with one command line could never run again). best.pt's shards too (``best-step-N.rankQ-of-W.pt``): an
# evaluation before the first checkpoint (train.eval_every < checkpoint.every) killed before best.pt's manifest
_ORPHAN_SHARD = re.compile(r"(?:best-)?step-\d{8,}\.rank\d+-of-\d+\.pt")
# `write_json_atomic`'s temporary file of a run file (summary.json, config.json): ".<name>.<8 random characters>.tmp"
_JSON_TEMP = re.compile(r"\.[^/]+\.json\.[a-z0-9_]{8}\.tmp")
# an event file's rewrite without its HParams (`dlrm.train.sessions.drop_earlier_hparams`) killed before its rename
_EVENTS_REWRITE_TEMP = re.compile(r"\.hparams-rewrite\.[0-9a-f]{8}\.tmp")


def restart_leftovers(path: Path) -> Optional[list[str]]:
    """What a run directory without a checkpoint holds when that is only what a run writes before its first
    checkpoint (names, sorted; [] for a missing or empty one), or None when it holds anything else (a best.pt, a
    summary.json, a file of the user's): a ``--resume`` may start such a run from step 0 (`RunDirectory.create`)."""
    path = Path(path)
    if not path.exists():
        return None if path.is_symlink() else []
    if not path.is_dir():
        return None
    names = sorted(p.name for p in path.iterdir())
    for name in names:
        sub = path / name
        if name == "checkpoints" and sub.is_dir():  # (a link to another disk's directory too)
            if not all((_SAVE_TEMP.fullmatch(p.name) or _ORPHAN_SHARD.fullmatch(p.name)) and p.is_file()
                       for p in sub.iterdir()):
                return None
        elif not (_BEFORE_FIRST.fullmatch(name) and sub.is_file() and not sub.is_symlink()):
            return None
    return names


def branch_start(run: Path) -> Optional[tuple[Path, int]]:
    """(the checkpoint, its step) the branch `run` started from (`BRANCH_NAME`), or None: not a branch, or a
    record that does not read as one (then it is refused as anything else there is)."""
    try:
        record = read_json(Path(run) / BRANCH_NAME)
        checkpoint, step = record["checkpoint"], record["step"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not isinstance(checkpoint, str) or not checkpoint or type(step) is not int or step < 0:
        return None
    return Path(checkpoint), step


def _restartable_branch(path: Path, checkpoint: Path) -> bool:
    """Whether `path` is the branch from `checkpoint` stopped before its first step checkpoint (or summary). Refused
    when that file no longer holds the branch's start step (a best.pt replaced by a later best): going on from it
    trained another branch than the one started there, under its name, as ``--resume`` (`branch_resume`) refuses."""
    start = branch_start(path)
    if not (start is not None and _same_file(start[0], checkpoint) and not list_checkpoints(path)
            and not (path / "summary.json").exists()):
        return False
    from dlrm.train.checkpointer import checkpoint_step  # (that module imports this one)
    held = checkpoint_step(checkpoint)
    if held != start[1]:
        holds = "no readable step" if held is None else f"step {held}"
        raise ConfigError(f"--resume: {path} is a branch started from {checkpoint} at step {start[1]} and stopped "
                          f"before its first checkpoint; that file holds {holds} now (replaced since), so it cannot "
                          f"go on from its start: --resume it with --run-name {path.name} alone (from its own best.pt, "
                          "where that holds its start), or pick another --run-name")
    return True


def restart_refusal(path: Path) -> str:
    """The one line refusing ``--resume`` of `path`, a run directory with no checkpoint and more than a run writes
    before its first one: what is there, and what to do."""
    shown = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in Path(path).iterdir())[:6]) \
        if Path(path).is_dir() else "not a directory"
    return (f"--resume: {path} holds no checkpoint (checkpoints/step-*.pt) but more than a run writes before its first "
            f"one ({shown}); it cannot be resumed nor started again there: move it away or pick another --run-name")


def _in_run(checkpoint: Path) -> bool:
    """Whether `checkpoint` (in a checkpoints/ directory) is a run's: named as a run names its checkpoints, or in a
    directory `RunDirectory.create` made (its lock file, its config.json)."""
    run = checkpoint.parent.parent
    return (_RUN_CHECKPOINT.fullmatch(checkpoint.name) is not None or (run / LOCK_NAME).is_file()
            or (run / "config.json").is_file())


def is_run_checkpoint(checkpoint: Path) -> bool:
    """Whether `checkpoint` is in a run's ``checkpoints/`` directory (`run_of`)."""
    return run_of(checkpoint) is not None


def _claim_default(cfg: Config) -> Path:
    """A new directory for a run without ``log.run_name``: ``<config>-<date>-<time>``, or with ``-2``, ``-3``, ...
    when a run started in the same second (or an hour's repeat at a DST change) holds that name. Made here (one
    ``mkdir``, which only one process can win), so two runs started at once never share one."""
    base = run_name(cfg)
    parent = Path(cfg.log.tb_dir)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"log.tb_dir: cannot create {str(parent)!r} ({e.strerror})") from None
    for n in range(1, 1000):
        path = parent / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"log.tb_dir: cannot create {str(path)!r} ({e.strerror})") from None
    raise ConfigError(f"log.tb_dir: {str(parent)!r} holds {base!r} and 998 more of its name; set --run-name")


def _advice(path: Path, evaluation: bool = False) -> str:
    """What to do with an existing run directory a new run (`evaluation`: --eval-only's) may not take: only what
    works for what it holds, and for that mode (an evaluation writes a directory of its own: "--resume it" does not
    apply to it), naming a free --run-name."""
    other = f"pick another --run-name (--run-name {free_run_name(path)} is free)"
    holder = lock_holder(path)
    if holder is not None:  # (a run started at the same moment under the same name was told its directory held "a
        # run stopped before its first checkpoint", to --resume, which the running one refuses)
        return f"a run is writing it now ({holder}): {other}"
    if evaluation:  # --eval-only writes its summary into a new directory; it never continues a run
        return f"--eval-only writes its own run directory: {other}"
    if list_checkpoints(path):
        return f"{other}, or --resume it"
    if branch_start(path) is not None and not (path / "summary.json").exists():
        return f"it holds a branch stopped before its first checkpoint: --resume goes on from its start, or {other}"
    if restart_leftovers(path) is not None:  # "--resume it" said "no checkpoint": now it starts the run again
        return ("it holds a run stopped before its first checkpoint: --resume starts it again from step 0 there "
                f"(with the same config), or {other}")
    return f"it holds no checkpoint to --resume: {other}, or move it away"


def lock_holder(path: Path) -> Optional[str]:
    """The line naming the process that holds `path`'s run lock now (`RunLock`), or None (free, or no lock file)."""
    if not (path / LOCK_NAME).is_file():
        return None
    try:
        fd, _ = try_lock_named(path / LOCK_NAME)
    except LockHeld as held:
        return held.holder
    except OSError:
        return None
    os.close(fd)  # (free: released at once, the file as it was)
    return None


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are one file (a path, a symbolic link or a hard link to it)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _same_checkpoint(a: Path, b: Path) -> bool:
    """Whether `a` and `b` hold one checkpoint: one file, or the manifests of one sharded checkpoint's shard files (a
    sharded run's best.pt names hard links to its step's shards when that step was checkpointed: a manifest of its
    own, never the step's file, so best.pt at the latest step was refused as "not the latest checkpoint", resuming it
    in place "would overwrite the later ones", where one process's best.pt, a link to that step's file, resumed)."""
    if _same_file(a, b):
        return True
    names = [_shard_names(p) for p in (a, b)]
    if names[0] is None or names[1] is None or len(names[0]) != len(names[1]):
        return False
    return all(_same_file(Path(a).parent / x, Path(b).parent / y) for x, y in zip(*names))


def _shard_names(path: Path) -> Optional[list[str]]:
    """The shard file names the sharded manifest at `path` lists; None for any other file. Read memory-mapped: a
    one-process checkpoint (50 GB for MLPerf's) is not loaded to learn that it lists none."""
    try:
        numpy = [(obj, name) for name, obj in v1_numpy_globals().items()]  # a format-1 file's RNG state
        shards = load_mapped(str(path), numpy)["sharded"]["shards"]  # (a name not UTF-8 too)
    except Exception:  # noqa: BLE001 - missing, foreign, damaged or one-process: it lists no shard
        return None
    return list(shards) if isinstance(shards, list) and all(isinstance(x, str) for x in shards) else None


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` naming its holder (pid, host, start time).

    Example (a scratch directory standing in for ``tb_logs/<run>``):
        >>> import os, shutil, tempfile
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> lock = RunLock.acquire(run_dir)
        >>> (run_dir / ".lock").read_text().startswith(f"pid {os.getpid()} on ")   # names its holder
        True
        >>> RunLock.acquire(run_dir)   # any other holder, even one in this process, is refused
        Traceback (most recent call last):
        ...
        dlrm.errors.ConfigError: ...: in use by pid ...; a run directory has one writer at a time ...
        >>> lock.release()
        >>> RunLock.acquire(run_dir).release()   # free again
        >>> shutil.rmtree(run_dir)
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> "RunLock":
        path = Path(run_dir) / LOCK_NAME
        try:
            fd, previous = try_lock_named(path)
        except LockHeld as held:
            raise ConfigError(f"{run_dir}: in use by {held.holder}; a run directory has one writer at a time "
                              "(wait for it, or choose another --run-name)") from None
        except NotALockFile as e:  # (a run directory someone handed over: its .lock a link to one of the user's files)
            raise ConfigError(f"{e.filename}: {e.strerror}") from None
        if previous:  # the holder died without releasing: flock was dropped by the kernel
            logger.warning(f"{path}: stale lock of {previous} (that process is gone); taken over")
        name_holder(fd, since=True)
        return cls(path, fd)

    def release(self) -> None:
        """Drop the lock. The file goes with it where the directory holds what marks it as a run's besides (`RUN_MARKS`:
        a finished run's summary.json, a stopped one's checkpoints/), else it is emptied (the next holder sees no
        stale lock) and kept: it is what marks a run stopped before its first checkpoint for one (`is_run_directory`:
        no --tb-dir nor --export inside it). Removed while still held, and every taker checks that the file it locked
        is still the one named .lock (`try_lock_named`): one that opened it just before takes the new one instead."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
            if any(os.path.lexists(self.path.parent / name) for name in RUN_MARKS):
                with contextlib.suppress(OSError):  # (kept, empty, it is harmless: no failure of a finished run)
                    remove_held(self.path, self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1


class RunDirectory:
    """The directory a run writes, held for the run's lifetime (see the module docstring).

    Use :meth:`create` for a new run and :meth:`for_resume` to continue one; then
    :meth:`started` once the first step ran, and :meth:`close` at the end (or as a context manager).

    Args:
        path: the run directory.
        lock: its held lock (None on ranks other than 0, which write no run files).
        created: this process made the directory (so a failed start may remove it).
    """

    def __init__(self, path: Path, lock: Optional[RunLock], created: bool, evaluation: bool = False) -> None:
        self.path, self.lock, self.created = Path(path), lock, created
        self.evaluation = evaluation  # an --eval-only's: `abandon` says "the evaluation", which has no steps
        self._started = False
        # (`_reopen_branch`, `_clear_for_restart`: the stopped session's events, and a branch's config.json)
        self._replaced_at_start: Optional[tuple[list[Path], Optional[dict]]] = None

    @classmethod
    def create(cls, cfg: Config, path: Optional[Path] = None, restart: bool = False,
               evaluation: bool = False) -> "RunDirectory":
        """A new run's directory (``log.tb_dir/<run name>`` unless `path`), locked, with config.json. `restart`: a
        ``--resume`` of a run with no checkpoint yet (`dlrm.train.resume_policy.checkpoint_to_resume` checked its
        config.json): the directory may hold what that run wrote before its first checkpoint; its events go.
        `evaluation`: the directory of an ``--eval-only`` (a refusal's advice fits it)."""
        claimed = path is None and cfg.log.run_name is None
        if claimed:
            path = _claim_default(cfg)
        path = Path(path) if path is not None else Path(cfg.log.tb_dir) / run_name(cfg)
        if path.is_symlink() and not path.exists():
            raise ConfigError(f"log.run_name: {path} is a dangling symbolic link; remove it or choose another --run-name")
        if path.exists() and not path.is_dir():  # (iterdir below would raise NotADirectoryError: a traceback)
            raise ConfigError(f"log.run_name: {str(path)!r} exists and is not a directory; choose another --run-name")
        if not restart and path.exists() and any(p.name != LOCK_NAME for p in path.iterdir()):
            raise ConfigError(f"log.run_name: {str(path)!r} already exists and is not empty; {_advice(path, evaluation)}")
        created = claimed or not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"log.tb_dir: cannot create {str(path)!r} ({e.strerror})") from None
        try:
            lock = RunLock.acquire(path)
        except OSError as e:
            raise ConfigError(f"log.tb_dir: cannot write {str(path)!r} ({e.strerror})") from None
        except ConfigError:
            raise
        run = cls(path, lock, created, evaluation)
        try:
            if restart:
                run._clear_for_restart()
            write_json_atomic(path / "config.json", cfg.to_dict())
        except OSError as e:
            run.abandon()
            raise ConfigError(f"log.tb_dir: cannot write {str(path)!r} ({e.strerror})") from None
        logger.info(f"run directory: {describe_path(path)}")
        return run

    @classmethod
    def for_resume(cls, cfg: Config, checkpoint: Path, latest: Optional[Path]) -> tuple["RunDirectory", bool]:
        """The directory a resume from `checkpoint` writes, and whether it is a fresh copy.

        Args:
            cfg: this run's config (its ``log.run_name`` may name a new run to branch into).
            checkpoint: the checkpoint resumed from (``<run>/checkpoints/step-*.pt``).
            latest: the newest checkpoint of that run.
        """
        source = run_of(checkpoint) or checkpoint.resolve().parent.parent
        wanted = cfg.log.run_name
        if not is_run_checkpoint(checkpoint):
            # a checkpoint copied elsewhere (models/mine.pt): its grandparent is no run; continuing "in place" wrote
            # events, checkpoints/ and summary.json (replacing one there) into whatever folder that is
            if wanted is None:
                raise ConfigError(f"--resume: {checkpoint} is not in a run's checkpoints/ directory; add --run-name "
                                  "NEW to continue from it in a new run")
        elif wanted is None or _same_file(Path(cfg.log.tb_dir) / wanted, source):
            # (--run-name may name the checkpoint's own run through a symbolic link: tb/r -> elsewhere/real). Compared
            # as directories, not names: --tb-dir NEW --run-name r1 of tb/r1's checkpoint continued tb/r1 in place
            # (written, and refused as "not the latest" from an earlier checkpoint) instead of the new run NEW/r1
            # best.pt is a hard link to its step's checkpoint: the latest one too, when the last evaluation was best
            if latest is not None and not _same_checkpoint(latest, checkpoint):
                raise ConfigError(f"--resume: {checkpoint} is not the latest checkpoint of run {source.name!r} "
                                  f"({latest.name} is); resuming it in place would overwrite the later ones: "
                                  "add --run-name NEW to continue from it in a new run")
            run = cls(source, RunLock.acquire(source), created=False)
            run._check_latest_unchanged(latest)
            run._remove_stale_temps()
            return run, False
        target = Path(cfg.log.tb_dir) / run_name(cfg)
        copied = not is_run_checkpoint(checkpoint)  # its grandparent is no run: not named as one
        if target.exists():
            if _restartable_branch(target, checkpoint):  # this branch again, killed before its first checkpoint
                return cls._reopen_branch(cfg, target, checkpoint), True
            if copied:
                raise ConfigError(f"--resume: {checkpoint} is not in a run's checkpoints/ directory, and --run-name "
                                  f"{wanted!r} names an existing run ({target}); name a new run to continue in")
            raise ConfigError(f"--resume: {checkpoint} belongs to run {source.name!r}, and --run-name {wanted!r} "
                              f"names another existing run ({target}); omit --run-name, or name a new run to "
                              "continue in a copy")
        run = cls.create(cfg, target)
        run._record_start(checkpoint)
        whose = f"from {checkpoint}" if copied else f"run {source.name!r} from {checkpoint.name}"
        logger.info(f"--resume: continuing {whose} in the new run {run.path} (the original "
                    f"{'file' if copied else 'run'} is not written)")
        return run, True

    def _record_start(self, checkpoint: Path) -> None:
        """Write `BRANCH_NAME` in this new branch: where a ``--resume`` before its first step checkpoint goes on."""
        from dlrm.train.checkpointer import checkpoint_step  # (that module imports this one)
        step = checkpoint_step(checkpoint)
        if step is None:  # (unreadable: the restore refuses it in one line)
            return
        try:
            write_json_atomic(self.path / BRANCH_NAME, {"checkpoint": os.path.abspath(checkpoint), "step": step})
        except OSError as e:
            self.abandon()
            raise ConfigError(f"log.tb_dir: cannot write {str(self.path / BRANCH_NAME)!r} ({e.strerror})") from None

    @classmethod
    def _reopen_branch(cls, cfg: Config, path: Path, checkpoint: Path) -> "RunDirectory":
        """The branch from `checkpoint` at `path`, killed before its first step checkpoint, taken again (under its lock:
        one saved meanwhile is refused): its stopped session's temporary files go now, its events at the first step
        (the steps after its start are trained and logged again), when config.json becomes this session's."""
        run = cls(path, RunLock.acquire(path), created=False)
        run._check_latest_unchanged(None)
        try:
            run._remove_stale_temps()
        except OSError as e:
            run.close()
            raise ConfigError(f"log.tb_dir: cannot write {str(path)!r} ({e.strerror})") from None
        # its events and config.json replaced at this session's first step (`started`), not now: a start refused
        # after this (the restore: other table sizes, another world size) removed the stopped session's events
        run._replaced_at_start = (sorted(path.glob("events.out.tfevents.*")), cfg.to_dict())
        logger.info(f"--resume: {path} is a branch from {checkpoint} stopped before its first checkpoint: going on "
                    "from there")
        return run

    def _check_latest_unchanged(self, latest: Optional[Path]) -> None:
        """Under the lock: refuse when the run got a newer checkpoint than `latest` (what this resume looked at before
        taking the lock, seconds earlier: the data and model were built in between) from another process that held
        the run meanwhile (a stopped job still saving as its requeued one started). Resumed from the older one, it
        was trained again in place over the later checkpoints and summary.json of that process, as the "not the
        latest checkpoint" rule forbids."""
        found = list_checkpoints(self.path)
        if found and (latest is None or not _same_file(found[-1], latest)):
            self.close()
            raise ConfigError(f"--resume: {self.path} got a later checkpoint ({found[-1].name}) since this resume "
                              "looked (another process was writing the run); --resume again")

    def _remove_stale_temps(self) -> None:
        """Under the lock (no run writes here now): remove the temporary files a killed session left (`write_json_atomic`'s
        ``.summary.json.<random>.tmp``, ``.config.json.<random>.tmp``, an event file's ``.hparams-rewrite.<random>.tmp``,
        a trace's ``.<trace>.<random>.tmp.gz``;
        checkpoints/: `remove_stale_temp_files`, best.pt's ``.best.pt.<pid>-link.tmp`` too). A resume that trains
        nothing (its run's summary written again) left them for good; only the next checkpoint save removed those in
        checkpoints/."""
        for p in self.path.glob(".*.tmp*"):  # (a trace's ends in .tmp.gz)
            if any(temp.fullmatch(p.name) for temp in (_JSON_TEMP, _EVENTS_REWRITE_TEMP, _TRACE_TEMP)):
                p.unlink(missing_ok=True)
        if (self.path / "checkpoints").is_dir():
            remove_stale_temp_files(self.path / "checkpoints")

    def _clear_for_restart(self) -> None:
        """Under the lock (no run writes here now): refuse what appeared since the resume looked (a checkpoint of a
        process that since ended), and remove the stopped run's event files at the first step (`started`): kept,
        TensorBoard showed each of its steps twice (its curve and the new one's), and the new run logs them all again."""
        if list_checkpoints(self.path) or restart_leftovers(self.path) is None:
            self.close()
            raise ConfigError(f"--resume: {self.path} got a checkpoint since this resume looked; --resume again"
                              if list_checkpoints(self.path) else restart_refusal(self.path))
        # the stopped session's temporary files too (its config.json's, a first save's): `restart_leftovers` accepts
        # them, and without this a restarted run kept them for good (only `for_resume` removed a killed session's)
        self._remove_stale_temps()
        for shard in (self.path / "checkpoints").glob("*step-*.rank*-of-*.pt"):  # no manifest names them (none here)
            if _ORPHAN_SHARD.fullmatch(shard.name):
                shard.unlink()
        # its events at the first step (`started`), not now: a restart that failed before it (out of memory at the
        # first step, a compile error, Ctrl-C) left the run without the only record of the stopped session's curves
        self._replaced_at_start = (sorted(self.path.glob("events.out.tfevents.*")), None)

    def started(self) -> None:
        """The first training step ran: from now on a failure keeps the directory (it has history)."""
        if self._replaced_at_start is not None:  # a reopened branch or restarted run: its stopped session's steps are
            events, config = self._replaced_at_start  # trained again (config: a branch's, written now)
            self._replaced_at_start = None
            try:
                for event_file in events:
                    event_file.unlink(missing_ok=True)
                if config is not None:
                    write_json_atomic(self.path / "config.json", config)
            except OSError as e:
                raise ConfigError(f"log.tb_dir: cannot write {str(self.path)!r} ({e.strerror})") from None
            if events:
                logger.info(f"--resume: removed the {len(events)} TensorBoard event file(s) of the run's stopped "
                            "session (it wrote no checkpoint after this one's start; its steps are trained again)")
        self._started = True

    def abandon(self, cause: Optional[BaseException] = None) -> None:
        """A failed or stopped start: release the lock and remove the directory if this process created it. `cause`:
        what ended it, which the line names when it is a stop (a SIGTERM or Ctrl-C was said as "the run failed")."""
        self.close()
        if self.created and not self._started:
            shutil.rmtree(self.path, ignore_errors=True)
            signal_name = stop_signal_name(cause) if cause is not None else None
            what = "the evaluation" if self.evaluation else "the run"
            how = f"was stopped by {signal_name}" if signal_name else "failed"
            logger.info(f"removed {self.path}: {what} {how}" + ("" if self.evaluation else " before its first step"))

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> "RunDirectory":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon(exc)
