"""The output directory: refusing to clobber it, the manifest and progress of an unfinished run,
and the cleanup after a failed one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dlrm.data.output_dirs import lock_name
from dlrm.data.preprocess.constants import _OUTPUT_OPTIONS, PROGRESS_DIR, RECORDLESS_SPARSE_LAYOUT
from dlrm.data.preprocess.errors import PreprocessError
from dlrm.data.preprocess.replace import replacement_names
from dlrm.data.preprocess.scan import FileScan
from dlrm.data.schema import SPLITS
from dlrm.json_file import read_json


def _fingerprint(path: Path) -> dict:
    """What identifies an input between a run and its resumption: resolved path, size, mtime."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remove_dataset(out: Path) -> None:
    """Remove what a run writes into ``out`` (metadata.json, splits, vocab, progress); nothing else.
    metadata.json goes first: a removal cut short (Ctrl-C, a kill) must not leave it claiming a complete
    dataset whose shards are gone."""
    (out / "metadata.json").unlink(missing_ok=True)
    for name in (*SPLITS, "vocab", PROGRESS_DIR, *replacement_names()):  # (a replacement's, left without its dataset)
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)


def _check_output(out: Path, opts: dict, fingerprints: list[dict], overwrite: bool) -> dict | None:
    """Refuse to clobber a dataset or resume an incompatible run; returns the manifest to resume.

    With ``overwrite`` nothing is refused and nothing is removed yet: the run removes an unfinished
    run only once its inputs have been counted (`_remove_dataset`), so that a run that fails
    before that leaves it as it was; a complete dataset stays until the new one replaces it
    (`dlrm.data.preprocess.replace`: then ``out`` is the staging directory).
    """
    if overwrite:
        return None
    if (out / "metadata.json").exists():
        raise PreprocessError(f"{out} already holds a complete dataset (metadata.json); use --overwrite to replace it "
                              "(it stays until the new one is complete)")
    manifest_path = out / PROGRESS_DIR / "manifest.json"
    if manifest_path.is_file():
        manifest = _read_manifest(manifest_path)
        diffs = _manifest_diffs(manifest, opts, fingerprints)
        if diffs:
            raise PreprocessError(
                f"{out} holds an unfinished run with different settings: {'; '.join(diffs)}; "
                "use the same settings to resume it, or --overwrite to start over"
            )
        return manifest
    # anything else there is not ours to write next to: another dataset's split directory, the user's files
    held = _foreign_entries(out)
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise PreprocessError(
            f"{out} is not empty ({shown}) and holds no unfinished run of this tool ({PROGRESS_DIR}/manifest.json); "
            "choose an empty or new --output, or use --overwrite to write the dataset into it (replacing only "
            "its metadata.json, train/, validation/, test/ and vocab/)"
        )
    return None


def _foreign_entries(out: Path) -> list[str]:
    """The names in ``out`` (if it is a directory) but the empty directories of a run's own names,
    which is all a run killed before writing its manifest leaves."""
    if not out.is_dir():
        return []
    ours = (*SPLITS, "vocab", PROGRESS_DIR)
    return sorted(p.name for p in out.iterdir() if not (p.name in ours and p.is_dir() and not any(p.iterdir()))
                  # `output_lock`'s, in an output whose parent is not writable: named after the real path (an
                  # output given as a symlink held .TARGET.lock, refused as a foreign entry)
                  and p.name != lock_name(out))


def _read_manifest(path: Path) -> dict:
    """The manifest of an unfinished run, checked for the structure a resume relies on."""
    try:
        manifest = read_json(path)
        if not isinstance(manifest.get("options"), dict) or not all(
            isinstance(d, dict) and "path" in d for d in manifest["inputs"]
        ):
            raise ValueError("unexpected structure")
        for d in manifest.get("scans") or []:
            FileScan(**d)  # a missing or unknown field raises TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PreprocessError(f"{path}: unreadable ({e}); use --overwrite to start over") from None
    return manifest


def _manifest_diffs(manifest: dict, opts: dict, fingerprints: list[dict]) -> list[str]:
    """How this run's inputs and output options differ from those of the unfinished run."""
    diffs = []
    old_paths = [d["path"] for d in manifest["inputs"]]
    new_paths = [d["path"] for d in fingerprints]
    if old_paths != new_paths:
        diffs.append(f"inputs: {old_paths} (earlier run) vs {new_paths} (now)")
    else:
        for old, new in zip(manifest["inputs"], fingerprints):
            if old != new:
                diffs.append(f"input {new['path']} changed since the earlier run (size or modification time)")
    old_opts = manifest["options"]
    for k in _OUTPUT_OPTIONS:
        if old_opts.get(k) != opts[k]:
            if k == "on_bad_line" and old_opts.get(k) == "stop" and opts[k] == "skip":
                continue  # chunks finished in stop mode had no bad line: same result in skip mode
            diffs.append(_option_diff(k, old_opts.get(k), opts[k]))
    return diffs + _multi_hot_diffs(old_opts, opts)


def _multi_hot_diffs(old: dict, new: dict) -> list[str]:
    """How --multi-hot-sizes and --sparse-layout differ. A run records them only when multi-hot, so a
    record without them means one-hot and, older versions writing nothing else, list columns; a
    layout not given (None) is no difference: the run continues with the recorded one
    (`RunOptions.with_sparse_layout`)."""
    old_sizes, new_sizes = old.get("multi_hot_sizes"), new.get("multi_hot_sizes")
    if old_sizes != new_sizes:
        return [_option_diff("multi_hot_sizes", old_sizes or "one-hot", new_sizes or "one-hot")]
    old_layout, new_layout = old.get("sparse_layout", RECORDLESS_SPARSE_LAYOUT), new.get("sparse_layout")
    if new_sizes is not None and new_layout is not None and new_layout != old_layout:
        return [_option_diff("sparse_layout", old_layout, new_layout)]
    return []


def _option_diff(key: str, old, new) -> str:
    """One difference, named by its flag: ``sparse-layout: 'lists' (earlier run) vs 'slots' (now)``."""
    return f"{key.replace('_', '-')}: {old!r} (earlier run) vs {new!r} (now)"


def _load_done(progress: Path, out: Path) -> dict[tuple[int, int], dict]:
    """The finished chunks recorded in done.jsonl whose shards are all there and readable (a torn
    last record is cut off, a damaged one skipped, a shard missing or damaged since: that chunk is
    redone)."""
    done: dict[tuple[int, int], dict] = {}
    path = progress / "done.jsonl"
    if not path.is_file():
        return done
    text = path.read_bytes()
    if text and not text.endswith(b"\n"):
        # a record torn by a kill: cut it off, so that the next record starts on a line of its own
        keep = text.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(keep)
        text = text[:keep]
    for line in text.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
            if all(_shard_intact(out / s["file"], s["rows"]) for s in rec["shards"].values()):
                done[(rec["file"], rec["chunk"])] = rec
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a damaged record: that chunk is redone
    return done


def _shard_intact(path: Path, rows: int) -> bool:
    """Whether a recorded shard still holds its rows: its parquet footer (written last) reads back
    and counts them. Shards are renamed into place complete, so a failure means it was damaged
    since (truncated, overwritten), and its chunk is redone like that of a missing shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows == rows
    except (OSError, pa.ArrowException):  # missing, unreadable, or not parquet (ArrowInvalid)
        return False


def _remove_temp_files(out: Path) -> None:
    """Remove the temp files of shards, vocabularies, metadata.json and the statistics checkpoint whose write a failure
    or a kill cut short (a resumed run would otherwise finish a dataset that still holds them)."""
    for name in (*SPLITS, "vocab"):
        d = out / name
        if d.is_dir():
            for p in d.glob(".*.tmp"):
                p.unlink(missing_ok=True)
    if out.is_dir():
        for p in out.glob(".metadata.json.*.tmp"):  # `write_json_atomic`'s
            p.unlink(missing_ok=True)
    # a statistics checkpoint a kill cut short (`DistinctCounter.save`): 4-8 bytes a distinct value, 3.5-7 GB for
    # Criteo 1TB, each left until the run finished, and one more for each kill during a save
    if (out / PROGRESS_DIR).is_dir():
        for p in (out / PROGRESS_DIR).glob(".stats.npz.*.tmp"):
            p.unlink(missing_ok=True)


def _first_missing(path: Path) -> Path | None:
    """The topmost of ``path`` and its ancestors that does not exist (what a run would create), or
    None if ``path`` exists."""
    p = path.absolute()
    top = None
    while not os.path.lexists(p):
        top = p
        if p.parent == p:
            break
        p = p.parent
    return top


def _after_failure(out: Path, created: Path | None, done: dict,
                   resume: str = "run again with the same inputs and options", bad_line: bool = False) -> None:
    """A run that failed (bad input, an error, Ctrl-C) after it took over ``out``.

    With no chunk finished, remove what it created (the progress directory, unrecorded shards,
    the split directories, and ``out`` and its parents up to ``created`` if it made them), so that
    the corrected command starts afresh; otherwise keep the finished shards (complete and
    recorded) so that a run with the same inputs resumes from them; ``resume`` says how (`_Run.resume_advice`), and
    after a bad line (`bad_line`) that ``--on-bad-line skip`` resumes too (after Ctrl-C or a full disk it has nothing
    to skip).
    """
    from loguru import logger

    if done:
        logger.warning(
            "{:,} finished chunk(s) kept in {} (no metadata.json: not a dataset yet); {}{} to resume, or with "
            "--overwrite to start over",
            len(done), out, resume, " (or --on-bad-line skip)" if bad_line else "",
        )
        return
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    for name in SPLITS:
        d = out / name
        if not d.is_dir():
            continue
        # no chunk finished, so no shard here is recorded: left, they would block the next run
        for p in [*d.glob("part-*.parquet"), *d.glob(".*.tmp")]:
            p.unlink(missing_ok=True)
        if not any(d.iterdir()):
            d.rmdir()
    if created is not None:
        _remove_empty_dirs(out.absolute(), created)


def _remove_empty_dirs(path: Path, top: Path) -> None:
    """Remove ``path`` and its parents up to ``top`` while they are empty directories."""
    while path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        if path == top or path.parent == path:
            return
        path = path.parent
