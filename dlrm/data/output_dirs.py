"""Where the data tools write (the generator, `dlrm.data.relayout`, `dlrm.data.mlperf_import`): a dataset directory is
built in a temporary sibling and renamed into place whole, so these check, before any work, that the target may be
written (`check_target`, `check_parent_writable`), that it does not overlap the input being read (`check_apart`), and
swap the finished directory in (`replace_dir`). Every refusal is one `click.ClickException` line."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import click


def check_target(path: Path, overwrite: bool, what: str) -> None:
    """Raise a one-line `click.ClickException` unless `path` may be (over)written."""
    if what == "directory" and path.is_symlink() and not path.exists():  # the finished dataset's rename onto it
        # failed (ENOTDIR), after all the work
        raise click.ClickException(f"{path} is a dangling symbolic link (to {os.readlink(path)}); remove it or name "
                                   "another path")
    if path.is_dir() and what == "file":
        raise click.ClickException(f"{path} is a directory, expected a file path for the raw TSV")
    if path.exists() and not path.is_dir() and what == "directory":
        raise click.ClickException(f"{path} exists and is not a directory")
    occupied = path.is_file() or (path.is_dir() and any(path.iterdir()))
    if occupied and not overwrite:
        raise click.ClickException(f"refusing to overwrite non-empty {path} (pass --overwrite to replace it)")


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
    old = None
    try:  # the setting aside too: a Ctrl-C or SIGTERM as it returned left the user's `out` under the hidden name
        if out.is_dir() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the dataset is an ordinary readable directory
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


def check_parent_writable(path: Path, option: str) -> None:
    """Raise a one-line `click.ClickException` unless `path` could be created: its nearest
    existing ancestor must be a writable directory (checked before any work starts)."""
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise click.ClickException(f"{option} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise click.ClickException(f"{option} {path}: directory {ancestor} is not writable")
