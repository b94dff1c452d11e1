"""Where the data tools write (the generator, `dlrm.data.relayout`, `dlrm.data.mlperf_import`): a dataset directory is
built in a temporary sibling and renamed into place whole, so these check, before any work, that the target may be
written (`check_target`, `check_parent_writable`), that it does not overlap the input being read (`check_apart`), and
swap the finished directory in (`replace_dir`). `output_lock` keeps a second run (``python -m dlrm.preprocess`` too)
off an output that one is writing, and `dataset_read_lock` keeps the writers off a dataset that a run reads.
Every refusal is one `click.ClickException` line."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import click
from loguru import logger

from dlrm.errors import ConfigError
from dlrm.file_lock import LockHeld, NotALockFile, name_holder, try_lock_named
from dlrm.file_modes import dir_mode
from dlrm.json_file import read_json
from dlrm.stop_signal import raise_pending


def check_target(path: Path, overwrite: bool, what: str, option: str = "") -> None:
    """Raise a one-line `click.ClickException` unless `path` (given as `option`) may be (over)written."""
    # a dangling link: the finished dataset's rename onto it failed (ENOTDIR), after all the work
    if what == "directory" and (dangling := dangling_link_error(path, option)) is not None:
        raise click.ClickException(dangling)
    if path.is_dir() and what == "file":
        raise click.ClickException(f"{path} is a directory, expected a file path for the raw TSV")
    if what == "file":  # (written as ".<name>.<random>.tmp" beside it, then renamed)
        from dlrm.run_paths import RANDOM, check_room

        check_room(option, os.path.dirname(os.path.abspath(path)), f".{path.name}.{RANDOM}.tmp", click.ClickException,
                   str(path))
    if what == "file" and not overwrite and os.path.lexists(path) and not path.is_file():
        # a FIFO or a link to nothing is no "file" below, yet the finished file's rename replaced it silently; a link
        # to nothing is named so, with its target (`dangling_link_error`'s words): "not a regular file" hid it
        if path.is_symlink() and not path.exists():
            raise click.ClickException(f"refusing to overwrite {option}{' ' if option else ''}{path}: it is a dangling "
                                       f"symbolic link (to {os.readlink(path)}); pass --overwrite to replace the "
                                       "link, or name another path")
        raise click.ClickException(f"refusing to overwrite {path}, not a regular file (pass --overwrite to replace it)")
    if path.exists() and not path.is_dir() and what == "directory":
        raise click.ClickException(f"{path} exists and is not a directory")
    occupied = path.is_file() or (path.is_dir() and any(path.iterdir()))
    if occupied and not overwrite:
        raise click.ClickException(f"refusing to overwrite non-empty {path} (pass --overwrite to replace it)")


def dangling_link_error(path: Path, option: str = "", above_only: bool = False) -> Optional[str]:
    """The one-line refusal of an output `path` that is (unless `above_only`), or lies under, a symbolic link to
    nothing, naming the link and its target; None if it is neither. Every data tool says this line: preprocess said
    "exists and is not a directory" of such a link, and "cannot be created: LINK is not a directory" of ``LINK/out``,
    while under one the other tools created the missing target (an unmounted disk's mount point, on the root disk)."""
    path = Path(path)
    for link in path.parents if above_only else (path, *path.parents):
        if link.is_symlink() and not link.exists():
            where = "" if link == path else f": {link}"
            return (f"{option}{' ' if option else ''}{path}{where} is a dangling symbolic link (to "
                    f"{os.readlink(link)}); remove it or name another path")
    return None


def check_replaceable(path: Path, option: str, error: type[click.ClickException] = click.ClickException) -> None:
    """Refuse, in one line, an --overwrite of a non-empty directory that holds no dataset: the tools replace their
    output whole, and a project folder named by mistake lost every file in it without a word."""
    if not path.is_dir() or not any(path.iterdir()):
        return
    if (path / "metadata.json").is_file() or (path / "_progress").is_dir():  # a dataset, or one preprocess is writing
        return
    shown = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    listed = ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
    raise error(f"{option} {path}: refusing to replace it: it holds no dataset (no metadata.json; it has {listed}), "
                "and --overwrite replaces a dataset only; choose a new or empty directory, or remove it yourself")


RUN_MARKS = ("checkpoints", "summary.json", "compare.md")
"""What only a run writes in its directory (a --compare's: compare.md) besides its lock: once one is there, the run's
lock file may go when it is released (`dlrm.train.run_dir.RunLock.release`) and the directory is still known for a
run's (`is_run_directory`)."""


def is_run_directory(path: Path) -> bool:
    """Whether `path` is a training run's directory (`dlrm.train.run_dir.RunDirectory`): its config.json (a run's,
    with ``log`` and ``data`` sections) beside what only a run writes (`RUN_MARKS`, or its lock)."""
    try:
        record = read_json(path / "config.json")
    except (OSError, ValueError):
        return False
    if not (isinstance(record, dict) and isinstance(record.get("log"), dict) and isinstance(record.get("data"), dict)):
        return False
    return any(os.path.lexists(path / name) for name in (*RUN_MARKS, ".lock"))


def owner_of(path: Path) -> Optional[str]:
    """What a dataset directory at `path` would be written into, or None: a dataset above it (its metadata.json: that
    dataset's --overwrite, or a tool's, replaces it whole, the inner one with it), a training run's directory or a
    sweep's (``sweep.json``), `path` itself included for those two (--overwrite replaced the run or sweep whole)."""
    owner = owning(path)
    return None if owner is None else f"{owner[0]} {owner[1]}"


def owning(path: Path) -> Optional[tuple[str, Path]]:
    """`owner_of`'s owner as ("the dataset" | "the run directory" | "the sweep", its directory), or None."""
    here = Path(os.path.realpath(path))
    for p in (here, *here.parents):
        if p != here and (p / "metadata.json").is_file():
            return "the dataset", p
        if is_run_directory(p):
            return "the run directory", p
        if _is_sweep(p):
            return "the sweep", p
    return None


def _is_sweep(path: Path) -> bool:
    """Whether `path` holds a sweep's record (``sweep.json`` with its grid and seeds), not any file of that name."""
    try:
        record = read_json(path / "sweep.json")
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "sets" in record and "seeds" in record


def check_unowned(path: Path, option: str, error: type[click.ClickException] = click.ClickException) -> None:
    """Refuse, in one line, a dataset output inside another dataset, a run's directory or a sweep (`owner_of`)."""
    owner = owner_of(path)
    if owner is not None:
        raise error(f"{option} {path} is inside {owner}, which belongs to it; write the dataset outside it")


def check_named(out: Path, option: str, error: type[click.ClickException] = click.ClickException,
                temp: str = ".tmp-xxxxxxxx", files: Optional[list[str]] = None) -> None:
    """Refuse ``.`` and ``..`` as a dataset directory a tool renames into place: the rename onto the working directory
    failed (EBUSY) after all the work, leaving its temporary (``..import-partial``, ``..old-*``) there. And an `out`
    whose temporary sibling ``.<name><temp>`` (the generator's ``.tmp-<random>``) with the deepest of `files` (the
    generator's) inside would be over PATH_MAX: "File name too long" at the first shard or the metadata, after the
    work before it (`dlrm.run_paths`)."""
    if out.name in ("", ".."):
        raise error(f"{option} {out}: name the dataset directory itself, not . or .. (it is renamed into place)")
    from dlrm.run_paths import SYNTHETIC_FILES, check_room, dataset_temp

    check_room(option, os.path.dirname(os.path.abspath(out)), dataset_temp(out.name, temp, files or SYNTHETIC_FILES),
               error, str(out))


def check_apart(source_opt: str, source: Path, out_opt: str, out: Path, advice: str,
                 error: type[click.ClickException] = click.ClickException) -> None:
    """Raise a one-line `error` when the output `out` and the input `source` overlap (the same, or one inside the
    other; symlinks resolved): a finished output replaces `out` whole, and --overwrite removes it first, so an
    overlap deletes (part of) the input being read, --overwrite or not."""
    s, o = source.resolve(), out.resolve()
    if s == o:
        raise error(f"{out_opt} {out} is {source_opt} itself; {advice}")
    if s.is_relative_to(o):
        raise error(f"{source_opt} {source} is inside {out_opt} {out}; {advice}")
    if o.is_relative_to(s):
        raise error(f"{out_opt} {out} is inside {source_opt} {source}; {advice}")


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an old `out` is set aside first and removed only after. If the swap fails
    (or is interrupted) after the old `out` was set aside, it is put back where it was before the error goes on."""
    # a SIGTERM whose stop a library's catch-all dropped (the tool's `StopAtOnce`): stopped here, before `out` is
    # touched, as one that was not dropped stops (lost, the tool published its output and exited 0)
    raise_pending()
    old = None
    try:  # the setting aside too: a Ctrl-C or SIGTERM as it returned left the user's `out` under the hidden name
        if out.is_dir() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        os.chmod(tmp, dir_mode())  # mkdtemp creates 0700; the dataset is an ordinary directory
        os.replace(tmp, out)  # rename(2) also replaces an empty directory
    except BaseException:
        if old is not None:
            swapped = not tmp.exists() and out.exists()  # the interrupt came as the rename returned
            if not swapped and (old / out.name).exists():  # the user's directory back where it was
                os.replace(old / out.name, out)
            shutil.rmtree(old, ignore_errors=True)  # now empty (or, swapped after all, the replaced `out`)
        raise
    if old is not None:
        try:
            shutil.rmtree(old)
        except BaseException:  # an interrupt in the removal (a large dataset's takes seconds): `out` was replaced, so
            shutil.rmtree(old, ignore_errors=True)  # none of the old one may stay hidden beside it, half removed
            raise


def recover_replaced(out: Path) -> None:
    """Finish what a killed `replace_dir` of `out` left (call it holding `output_lock(out)`): the old output it set
    aside under ``.<name>.old-<8 random characters>/`` goes back to `out` when `out` is missing (killed between its
    two renames: the user's dataset was gone from its place, hidden), and is removed when `out` is there (killed while
    removing the replaced one: a dataset's worth of disk, TBs for Criteo 1TB, stayed hidden for good)."""
    parent = out.absolute().parent
    if not parent.is_dir():
        return
    pattern = re.compile(re.escape(f".{out.name}.old-") + "[a-z0-9_]{8}")
    for old in sorted(p for p in parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()):
        kept = old / out.name
        if kept.is_dir() and not (out.exists() or out.is_symlink()):
            os.replace(kept, out)
            logger.warning(f"{out}: put back from {old.name}, where a run killed while replacing it had set it aside")
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(path: Path, pattern: str) -> None:
    """Remove what killed runs of the output `path` left beside it under a temporary name: the entries of its parent
    whose name is `pattern` with ``{name}`` the output's name and ``{rand}`` the 8 random characters `tempfile`
    adds (``".{name}.tmp-{rand}"``: the generator's ``mkdtemp``). Call it holding `output_lock(path)`: every run
    that writes such a name holds that lock, so those there are a dead run's. A SIGKILL (the OOM killer,
    ``kill -9``) runs no cleanup: its half-written dataset stayed beside the output for good, one more each kill."""
    parent = path.absolute().parent
    regex = re.compile(re.escape(pattern).replace(re.escape("{name}"), re.escape(path.name))
                       .replace(re.escape("{rand}"), "[a-z0-9_]{8}"))
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if regex.fullmatch(p.name):  # best effort: a leftover that cannot go is no reason to refuse the run
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()


def check_parent_writable(path: Path, option: str) -> None:
    """Raise a one-line `click.ClickException` unless `path` could be created: its nearest
    existing ancestor must be a writable directory (checked before any work starts), reached through no dangling
    symbolic link (`dangling_link_error`)."""
    dangling = dangling_link_error(path, option, above_only=True)
    if dangling is not None:
        raise click.ClickException(dangling)
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise click.ClickException(f"{option} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise click.ClickException(f"{option} {path}: directory {ancestor} is not writable")


@contextlib.contextmanager
def output_lock(path: Path, option: str, error: type[Exception] = click.ClickException,
                inside_ok: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.NAME.lock`` beside the output `path` for the whole run (as a run directory's
    ``.lock``, `dlrm.train.run_dir.RunLock`); a second run writing the same output is refused in one `error` line that
    names the holder. Without it two runs of one output interleaved: both resumed the same unfinished run (preprocess,
    mlperf_import) and wrote into one directory, or the later one replaced the dataset of the other, --overwrite or not.

    Beside, not inside: the tools build the output in a sibling and rename it into place. The kernel drops the lock of
    a process that died, so a file left by a killed run is taken over; the file is removed on release, and the
    directories made for it (the output's missing parents) with it if they are still empty. ``inside_ok`` (an output
    written in place: preprocess): an existing writable output whose parent is not writable (a mount point) holds
    the file itself, under the same name.

    Example:
        >>> out = Path(tempfile.mkdtemp()) / "out"
        >>> with output_lock(out, "--out"):
        ...     with output_lock(out, "--out"):  # any second holder, even one in this process, is refused
        ...         pass
        Traceback (most recent call last):
        ...
        click.exceptions.ClickException: --out ...out: in use by pid ... (its lock ....out.lock); one run writes ...
        >>> list(out.parent.iterdir())  # the lock file went with the run
        []
        >>> out.parent.rmdir()
    """
    # the lock of the output itself, however it is spelled: an output reached through a symlink (`link` -> `out`)
    # locked `.link.lock`, and a second run writing `out` took `.out.lock` at the same time
    real = Path(os.path.realpath(path))
    parent = real.parent
    if inside_ok and real.is_dir() and os.access(real, os.W_OK | os.X_OK) and not os.access(parent, os.W_OK):
        parent = real
    try:
        check_parent_writable(parent / "lock", option)
    except click.ClickException as e:
        raise error(e.format_message().replace(str(parent / "lock"), str(path))) from None
    made = parent
    while not made.parent.exists() and made.parent != made.parent.parent:
        made = made.parent
    made = None if parent.exists() else made  # the topmost directory this creates, removed again if left empty
    parent.mkdir(parents=True, exist_ok=True)
    lock = parent / lock_name(path)
    try:
        fd = _lock_current(lock, shared=False)
    except LockHeld as held:
        raise error(f"{option} {path}: in use by {held.holder} (its lock {lock}); one run writes an output at a "
                    "time: wait for it, or choose another path") from None
    except NotALockFile as e:  # never written through (`dlrm.file_lock._open_lock`)
        raise error(f"{option} {path}: {e.filename}: {e.strerror}") from None
    try:
        name_holder(fd)
        yield
    finally:
        try:
            lock.unlink(missing_ok=True)  # while still held: a process that opened it meanwhile locks a removed file,
        finally:  # sees that, and opens the new one (above)
            os.close(fd)
        if made is not None:
            with contextlib.suppress(OSError):
                _remove_empty_parents(parent, made)


def _lock_current(lock: Path, shared: bool) -> int:
    """`try_lock_named(lock, shared)`'s descriptor, of the file named `lock` now: the holder may have removed the file
    (its release) between our open and flock; then the new one is locked. Raises `LockHeld`."""
    return try_lock_named(lock, shared)[0]


_READER_NOTE = ", a run reading it"  # the end of a reader's line in the lock file (`dataset_read_lock`)
_LEAVING_READER_S = 2.0  # how long a starting reader waits for one that holds the file to remove it
_READING: dict[str, int] = {}  # the lock files this process holds for reading, and how many holds each


@contextlib.contextmanager
def dataset_read_lock(path: Path, option: str, error: type[Exception] = click.ClickException) -> Iterator[None]:
    """Hold a shared ``flock`` on `output_lock`'s file of the dataset `path` while a run reads it. Without it, a tool
    writing that dataset (the generator's, relayout's or an import's ``--overwrite``, preprocess) replaced it under a
    training run, whose later epochs then trained on the new dataset's rows without a word (or whose evaluation
    failed on a file "that cannot be read"). Now the writer is refused while a run reads it, naming the reader, and
    a run is refused in one `error` line while a tool writes it. Readers share the lock; the last one removes the
    file. Where none can be made (a read-only parent: a shared dataset no tool here writes), the run reads unlocked."""
    real = Path(os.path.realpath(path))
    parent = real.parent  # where output_lock puts it, for preprocess's inside_ok too (an output in place)
    if real.is_dir() and os.access(real, os.W_OK | os.X_OK) and not os.access(parent, os.W_OK):
        parent = real
    lock = parent / lock_name(path)
    if str(lock) in _READING:  # held by this process already (`dlrm.cli.run` around `train`): one hold, counted. A
        # second flock of the same file by one process is a second lock on local file systems, but on NFS (POSIX
        # locks, one per process) the inner release dropped the outer hold and removed the file
        _READING[str(lock)] += 1
        try:
            yield
        finally:
            _READING[str(lock)] -= 1
        return
    patience = time.monotonic() + _LEAVING_READER_S
    while True:
        try:
            fd = _lock_current(lock, shared=True)
        except LockHeld as held:
            # the last reader holds the file exclusively for a moment, to remove it (below): a run started then was
            # refused as "being written by" that reader. A writer names itself at once (its line replaces a reader's)
            if held.holder.endswith(_READER_NOTE) and time.monotonic() < patience:
                time.sleep(0.01)
                continue
            raise error(f"{option} {path}: being written by {held.holder} (its lock {lock}); wait for it to finish") \
                from None
        except OSError:  # no lock file can be made there (read-only, missing): nothing writes it here either
            fd = -1
        break
    _READING[str(lock)] = 1
    try:
        if fd >= 0:
            name_holder(fd, note=_READER_NOTE)  # a writer refused names this reader (the last to start)
        yield
    finally:
        del _READING[str(lock)]
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other reader: remove the file (as output_lock)
                lock.unlink(missing_ok=True)
            except OSError:
                pass  # another reader holds it, and removes it
            finally:
                os.close(fd)


def lock_name(path: Path) -> str:
    """The name of `output_lock`'s file for the output `path`: its real path's (``.NAME.lock``), so that a tool that
    looks for it (preprocess, whose output may hold it) finds it under a symlinked spelling too."""
    return f".{Path(os.path.realpath(path)).name}.lock"


def _remove_empty_parents(path: Path, top: Path) -> None:
    """Remove `path` and its parents up to `top` while they are empty directories."""
    while path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        if path == top or path.parent == path:
            return
        path = path.parent


def check_export_place(target: Path, flag: str = "--export", written: str = "the program") -> None:
    """Refuse, in one line naming a free path outside it, an ``--export`` file inside what another thing owns: a
    dataset, a run's directory (its ``checkpoints/`` too) or a sweep (`owner_of`), as a new run's --tb-dir there is
    refused (`dlrm.output_place.check_tb_dir`). Written there without a word, the program sat among a run's
    checkpoints, or went with a dataset that a tool's --overwrite replaced whole. `flag` names the option or argument
    in the message, `written` what the file is (``python -m dlrm.distributed.merge``'s OUT: "the merged checkpoint")."""
    owner = owning(target)
    if owner is None:
        return
    what, where = owner
    place = target
    while (above := owning(place)) is not None and above[1].parent != above[1]:  # beside the owner, unless that is
        place = above[1].parent / target.name  # owned too (a trial's: beside its sweep)
    free, n = place, 1
    while os.path.lexists(free):
        n += 1
        free = place.with_name(f"{target.stem}-{n}{target.suffix}")
    raise ConfigError(f"{flag}: {target} is inside {what} {where}, which holds its own files only; write "
                      f"{written} outside it ({flag} {free} is free)")
