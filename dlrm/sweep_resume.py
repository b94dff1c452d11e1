"""``python -m dlrm.sweep --resume <sweep dir>``: finish a sweep that Ctrl-C, a signal, a crash or a time limit stopped.

Every sweep records what it trains in ``<sweep dir>/sweep.json`` before its first trial: the config file (absolute
path), the ``--set`` lists in order (``data.path`` values absolute), ``--seeds``, the ``--data`` (absolute: a resume
from elsewhere trains on the same data)/``--device`` overrides, the config every trial starts from, resolved, and the
working directory (``cwd``: a relative data.path of the config file names the data there, from wherever resumed),
and each dataset's metadata.json SHA-256 (``datasets``) and its files' stamps (``dataset_files``: metadata.json's
SHA-256, each split file's size and parquet footer's SHA-256, `dlrm.data.dataset_stamps`): a resume on a dataset
replaced or rewritten since is refused (`check_datasets_unchanged`).
``--resume DIR`` reads it back, so the directory alone is enough; ``--config``, ``--set``, ``--seeds``, ``--data``
(resolved against the working directory of the resume) and ``--device`` may be given again, and whatever is given (and the config file, which may have
been edited since) must match the record: a difference is refused in one line naming it (exit 2); ``log`` and
``name`` are free (each trial's directory is the sweep's). The sweep then goes on in the same directory, trial by
trial (`trial_state`):

* a trial whose run wrote its ``summary.json`` finished: it is not trained again, its summary is gathered;
* a trial without a summary but with a checkpoint (stopped by a signal, a crash after a ``checkpoint.every``
  save, a failed trial that had saved) is resumed from its newest checkpoint by the trainer's ``--resume``
  machinery, in place (a signal's stop continues bit for bit);
* a trial with neither (killed before its first checkpoint, or it failed) is trained afresh in its directory; what
  an earlier attempt left there is first moved aside to ``seed-<k>.failed`` (a trial that failed: the sweep marks
  its directory, `mark_failed`) or ``seed-<k>.interrupted`` (``-2``, ``-3``, ... when taken), said in the log, never
  deleted; TensorBoard shows its events as the run of that name.

Every finished trial's summary.json is checked against its trial's config before anything trains (`check_gathered`):
one that records another config (hand-edited, another sweep's) is refused in one line naming it.

The tables (sweep.md, sweep.csv, trials.csv) and ``hparams/`` are written anew over all trials, each once. One process
at a time runs a sweep: it holds an ``flock`` on its ``sweep.json`` (a second ``--resume`` while the first, or the
original sweep, runs is refused, naming the directory and, where a trial it trains names it, that process), and a
resume is refused before anything trains while another process writes one of its trials (`check_trials_free`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from dlrm.checkpoint import list_checkpoints, move_to_new, write_files_atomic
from dlrm.config import ConfigError, load_config
from dlrm.data.schema import write_json_atomic
from dlrm.json_file import SUMMARY_LIMIT, read_json, read_regular_file
from dlrm.logging_setup import counted
from dlrm.run_paths import sweep_resume_room
from dlrm.train.resume_policy import config_changes, with_defaults
from dlrm.train.run_dir import lock_holder

RECORD = "sweep.json"
FORMAT = 1
FAILED_MARK = "sweep_trial_failed.txt"  # in a failed trial's run directory: why it failed (`mark_failed`)
_FREE = ("log", "name")  # config keys a resume may change: every trial's directory is the sweep's own


class SweepLock:
    """An exclusive ``flock`` on ``<sweep dir>/sweep.json`` for as long as a process runs the sweep's trials."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def acquire(cls, directory: Path) -> "SweepLock":
        fd = os.open(directory / RECORD, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                # the holder, where a trial it trains names it (`RunLock`): the sweep's lock file holds the record
                held = next(((d, h) for d in _trial_dirs(directory) for h in [lock_holder(d)] if h is not None), None)
                by = "" if held is None else f" ({held[1]}, training {held[0]})"
                raise ConfigError(f"--resume: {directory} is in use by another sweep process{by}; one process at a "
                                  "time runs a sweep (wait for it to end)") from None
            raise
        return cls(fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _trial_dirs(directory: Path) -> list[Path]:
    """The trial run directories (``<setting>/seed-<k>``) in the sweep directory `directory`, as they are on disk."""
    return sorted(p for p in directory.glob("*/seed-*") if re.fullmatch(r"seed-\d+", p.name) and p.is_dir())


def check_trials_free(directory: Path, sets: list, seeds: int) -> None:
    """Refuse, in one line naming the trial's directory and its holder, a resume while another process writes one of
    the sweep's trials (a ``train.py --resume`` of it). Found by the trial's own run when the sweep reached it, the
    refusal came after the trials before it had trained (and ended the sweep there)."""
    from dlrm.sweep import grid, slug

    for i, setting in enumerate(grid(sets)):
        for k in range(seeds):
            run_dir = directory / slug(i, setting) / f"seed-{k}"
            holder = lock_holder(run_dir)
            if holder is not None:
                raise ConfigError(f"--resume: trial {run_dir} is in use by {holder}; a run has one writer at a time: "
                                  "wait for that process to end, then resume the sweep")


def absolute_data(base: dict[str, Any]) -> dict[str, Any]:
    """`base` with its ``data.path`` (``--data``) made absolute against the working directory: recorded as given, a
    relative path resumed from elsewhere named other data under an equal string (the config check saw no change)."""
    path = base.get("data.path")
    if isinstance(path, str) and path:  # (anything else is the config check's to refuse, as given)
        return {**base, "data.path": os.path.abspath(path)}
    return base


def absolute_sets(sets: list[tuple[str, list[Any]]], refuse_twice: bool = True) -> list[tuple[str, list[Any]]]:
    """`sets` with the values of ``--set data.path=...`` made absolute against the working directory, as
    `absolute_data` makes --data: recorded as given, a resume from elsewhere trained the trials left on other data
    under the same labels, in the same tables."""
    out = [(k, [os.path.abspath(v) if k == "data.path" and isinstance(v, str) and v else v for v in values])
           for k, values in sets]
    for (key, given), (_, values) in zip(sets, out):
        # two names of one directory: one setting trained twice, and a record that --resume refuses
        if refuse_twice and len(set(map(json.dumps, values))) != len(values):
            raise ConfigError(f"--set {key}: {json.dumps(given)[:200]} names one directory twice")
    return out


def resolved(config: str, base: dict[str, Any], sets: list) -> dict[str, Any]:
    """The first setting's config (seed 0), as ``Config.to_dict()``: the keys no --set sweeps are every trial's (the
    file alone may be invalid: a value every setting mends)."""
    first = {k: values[0] for k, values in sets if values}
    return load_config(config, {**base, **first, "train.seed": 0}).to_dict()


def write_record(directory: Path, config: str, sets: list[tuple[str, list[Any]]], seeds: int,
                 base: dict[str, Any]) -> SweepLock:
    """Write ``sweep.json`` (what `resume_sweep` reads back) and hold the sweep's lock."""
    # cwd: what the config file's own relative data.path is read against, by this session and by a --resume from
    # anywhere (dlrm.sweep._run_trials)
    record = {"format": FORMAT, "config": str(Path(config).resolve()), "sets": [[k, list(v)] for k, v in sets],
              "seeds": seeds, "base": base, "resolved": resolved(config, base, sets), "cwd": os.getcwd(),
              **dataset_records(dataset_digests(config, base, sets, os.getcwd()))}
    # Written under a name of this process's own, locked, then given its name only if no record is there: two sweeps
    # of one --run-name started together both found the directory empty (`dlrm.sweep.sweep_directory`), and the
    # second's rename replaced the first's record (a --resume then trained the other grid) and locked the new file,
    # beside the first's lock on the replaced one: both sweeps ran their trials in one directory.
    staging = directory / f".{RECORD}.{os.getpid()}.tmp"
    fd = -1
    try:
        try:
            write_json_atomic(staging, record)
            fd = os.open(staging, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no other process has it
            move_to_new(staging, directory / RECORD, f"--run-name: {directory} was taken by another sweep started at "
                        "the same time; pick another name")
        except OSError as e:
            raise ConfigError(f"--tb-dir: cannot write {directory / RECORD} ({e.strerror or e})") from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    return SweepLock(fd)


def dataset_digests(config: str, base: dict[str, Any], sets: list, workdir: str,
                    settings: Optional[list[dict[str, Any]]] = None) -> dict[str, dict[str, str]]:
    """The stamps of each dataset that the trials of `settings` (default: the whole grid of `sets`) read
    (`dlrm.data.dataset_stamps`: metadata.json's SHA-256, every split file's size and parquet footer's SHA-256), by its
    path as they read it (`workdir`: what a relative data.path is read against); a dataset whose metadata.json cannot
    be read here is left out (its runs refuse it)."""
    from dlrm.data.dataset_stamps import METADATA, dataset_stamps
    from dlrm.sweep import grid

    paths = dict.fromkeys(os.path.normpath(os.path.join(workdir, load_config(config, {**base, **s}).data.path))
                          for s in (grid(sets) if settings is None else settings))
    digests = {path: dataset_stamps(path) for path in paths}
    return {path: stamps for path, stamps in digests.items() if stamps[METADATA][:1].isdigit()}


def dataset_records(digests: dict[str, dict[str, str]]) -> dict[str, dict]:
    """sweep.json's ``datasets`` (each dataset's metadata.json SHA-256, as versions before 2026-12-04 wrote and read
    them: one of those resumes a newer sweep still, comparing that much) and ``dataset_files`` (its files' stamps)."""
    from dlrm.data.dataset_stamps import METADATA

    return {"datasets": {path: stamps[METADATA].split(":")[1] for path, stamps in digests.items()},
            "dataset_files": digests}


def check_datasets_unchanged(directory: Path, record: dict[str, Any], config: str, base: dict[str, Any], sets: list,
                             left: list[dict[str, Any]], workdir: str) -> None:
    """Refuse, in one line naming the file, a resume whose trials left to train would read a dataset other than the
    one the sweep began on (a file of it differs from the stamps sweep.json recorded, `dlrm.data.dataset_stamps`:
    regenerated, re-preprocessed, a parquet file rewritten or truncated): the finished trials were gathered and the
    rest trained on the new data, all in one table and verdict, without a word.
    A record made before the digests (no ``datasets``) is not checked; one made before the stamps (2026-12-04: no
    ``dataset_files``, the SHA-256 of metadata.json alone) is checked for that, with a warning that its files are
    not."""
    from dlrm.data.dataset_stamps import METADATA, is_stamps, stamp_change

    recorded, files = record.get("datasets"), record.get("dataset_files")
    recorded, files = (x if isinstance(x, dict) else {} for x in (recorded, files))
    for path, stamps in dataset_digests(config, base, sets, workdir, left).items():
        if path in files:
            if not is_stamps(files[path]):
                raise ConfigError(f"--resume: {directory / RECORD}: dataset_files: {path!r:.80} must map its files to "
                                  f"their stamps (file name -> \"size:sha256\"), got {json.dumps(files[path])[:60]}")
            change = stamp_change(files[path], stamps)
        elif isinstance(recorded.get(path), str):  # 2026-12-02 .. 12-04: the SHA-256 of metadata.json alone
            change = None if stamps[METADATA].endswith(f":{recorded[path]}") else f"{METADATA} changed"
            if change is None:
                logger.warning(f"--resume: {directory / RECORD} (written by an earlier version) records only the "
                               f"SHA-256 of {path}'s metadata.json: a change to its parquet files that kept "
                               "metadata.json (rewritten in place, replaced by hand) is not checked")
        else:
            continue
        if change is not None:
            raise ConfigError(f"--resume: the dataset {path} is not the one the sweep in {directory} began on: "
                              f"since {RECORD} recorded it, {change}; its trials left would train on other data than "
                              "the finished ones they are compared with; put that dataset back, or start a new sweep")


def read_record(directory: Path) -> dict[str, Any]:
    """The record of the sweep in `directory`; a one-line `ConfigError` when there is none or it is malformed."""
    path = directory / RECORD
    if not directory.is_dir():
        what = "a file, not a sweep directory" if directory.exists() else "no such sweep directory"
        raise ConfigError(f"--resume: {directory}: {what}")
    if not path.is_file():
        from dlrm.output_place import sweep_holding

        # a setting's or a trial's directory (the one a stopped trial's log names): its sweep is resumed as a whole
        outer = sweep_holding(str(directory.parent))
        if outer is not None:
            raise ConfigError(f"--resume: {directory} is inside the sweep {outer}; a sweep is resumed as a whole: "
                              f"--resume {outer}")
        # a sweep of a version before 2026-11-30 (3799839) wrote its report and trials but no record: it is a sweep
        # (called "not the directory of a sweep", the user was left to wonder what else it was), just not resumable
        trial_configs = sorted(directory.glob("*/seed-*/config.json"))
        if _swept_by_a_recording_version(trial_configs):
            raise ConfigError(f"--resume: {directory} is a sweep whose {RECORD} (its grid, written when it started) is "
                              f"missing: it cannot be resumed without it; put {RECORD} back, or run the sweep again "
                              "under another --run-name (its trials and report stay where they are)")
        if any((directory / name).is_file() for name in ("sweep.md", "sweep.csv", "trials.csv")) or trial_configs:
            raise ConfigError(f"--resume: {directory} is a sweep made by a version before 2026-11-30, which recorded "
                              f"no {RECORD} (its grid): it cannot be resumed; run the sweep again under another "
                              "--run-name (its trials and report stay where they are)")
        raise ConfigError(f"--resume: {directory} holds no {RECORD}: not the directory of a sweep (sweeps record their "
                          "grid there when they start; one made before that cannot be resumed)")
    try:
        record = read_json(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: {path}: not readable as JSON ({e})") from None
    ok = (isinstance(record, dict) and record.get("format") == FORMAT and isinstance(record.get("config"), str)
          and isinstance(record.get("sets"), list)
          and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and isinstance(s[1], list)
                  for s in record["sets"])
          and isinstance(record.get("seeds"), int) and not isinstance(record["seeds"], bool) and record["seeds"] >= 1
          and isinstance(record.get("base"), dict) and isinstance(record.get("resolved"), dict)
          # (a record made before it has none: the config's data.path is then read here, as it was)
          and (record.get("cwd") is None or isinstance(record["cwd"], str) and os.path.isabs(record["cwd"])))
    if not ok:
        raise ConfigError(f"--resume: {path}: not a sweep record of format {FORMAT} (config, sets, seeds, base, resolved, "
                          "cwd)")
    if record["seeds"] > 2**63:  # (as `dlrm.sweep.run_sweep` refuses --seeds: else "command line: train.seed: ...")
        raise ConfigError(f"--resume: {path}: seeds: {record['seeds']} must be <= 2**63 (train.seed 0 .. seeds-1 fits "
                          "in int64)")
    _check_recorded_sets(path, record["sets"])
    from dlrm.config import config_keys

    unknown = [k for k in record["base"] if k not in config_keys()]
    if unknown:  # (else "command line: ...: unknown key", of a command line that had not given it)
        raise ConfigError(f"--resume: {path}: base: {unknown[0]!r:.60} is not a config key")
    return record


def _swept_by_a_recording_version(trial_configs: list[Path]) -> bool:
    """Whether a trial's config.json names its swept keys (``log.sweep_keys``, written by sweeps since 2026-12-01):
    then its version wrote sweep.json before the trial, and a sweep without one lost it (deleted, moved). Without
    that mark the files cannot tell: a version before 2026-11-30 wrote none (and, from 2026-11-30 to 2026-12-01,
    one that wrote it marked no trial), called older as the likelier."""
    for path in trial_configs:
        try:
            raw = read_json(path)
        except (OSError, ValueError):
            continue
        log = raw.get("log") if isinstance(raw, dict) else None
        if isinstance(log, dict) and isinstance(log.get("sweep_keys"), list):
            return True
    return False


def _check_recorded_sets(path: Path, sets: list) -> None:
    """What `dlrm.sweep.parse_set` refuses on the command line, refused in the record too (an edited sweep.json
    resumed with a value listed twice trained it twice, as two settings; one with a log.* key or train.seed swept
    keys the sweep owns)."""
    from dlrm.config import config_keys
    from dlrm.sweep import _same_value
    from dlrm.sweep_checks import _holds, check_nested_sets

    known = config_keys()
    for key, values in sets:
        # (a key that is none, or given twice: refused by the grid as "command line: ...: unknown key" and "--set: a key
        # is given twice", of a command line that had given no --set)
        if key not in known:
            raise ConfigError(f"--resume: {path}: sets: {key!r:.60} is not a config key")
        if [k for k, _ in sets].count(key) > 1:
            raise ConfigError(f"--resume: {path}: sets: {key!r:.60} is given twice")
        if key == "train.seed" or key == "log" or key.startswith("log."):
            raise ConfigError(f"--resume: {path}: sets: {key!r:.60} cannot be swept (--set refuses it)")
        if key == "train" and any(_holds(v, ["seed"]) for v in values):
            raise ConfigError(f"--resume: {path}: sets: 'train': a value sets train.seed, which --seeds gives (--set "
                              "refuses it)")
        if not values:
            raise ConfigError(f"--resume: {path}: sets: {key!r:.60} has no values")
        if len({json.dumps(_same_value(v), sort_keys=True) for v in values}) != len(values):
            raise ConfigError(f"--resume: {path}: sets: {key!r:.60}: a value is listed twice in "
                              f"{json.dumps(values)[:60]}")
    try:  # (a key swept alone and inside a swept section's value: a new sweep refuses it, `dlrm.sweep.run_sweep`)
        check_nested_sets([(k, v) for k, v in sets])
    except ConfigError as e:
        raise ConfigError(f"--resume: {path}: sets: {e}") from None


def _shown(value: Any) -> str:
    """A config value of `reconcile`'s message; a key one side lacks ("config_changes"' marker, a bare object) is
    "(absent)": it was shown as "<object object at 0x...>"."""
    return "(absent)" if type(value) is object else json.dumps(value, default=str)


def _show_sets(sets: list) -> str:
    return " ".join(f"--set {k}={','.join(json.dumps(v) for v in values)}" for k, values in sets) or "no --set"


def reconcile(directory: Path, record: dict[str, Any], config: Optional[str], sets: Optional[list], seeds: Optional[int],
              base: Optional[dict[str, Any]]) -> tuple[str, list[tuple[str, list[Any]]], int, dict[str, Any]]:
    """(config, sets, seeds, base) of the sweep: the record's, where the command line gives none; what it gives must
    match, and so must the config file as it is now (a one-line `ConfigError` names every difference)."""
    where = f"{directory / RECORD}"
    differences = []
    recorded_sets = [(k, v) for k, v in record["sets"]]
    if sets is not None and recorded_sets == absolute_sets(recorded_sets, refuse_twice=False):  # (a record made before: as given)
        sets = absolute_sets(sets)  # compared resolved, as --data is
    # compared as JSON: 1 and 1.0 are one config value but two trial directories (`slug`)
    if sets is not None and json.dumps([[k, v] for k, v in sets]) != json.dumps(record["sets"]):
        differences.append(f"{_show_sets(sets)} (recorded: {_show_sets(record['sets'])})")
    if seeds is not None and seeds != record["seeds"]:
        differences.append(f"--seeds {seeds} (recorded: {record['seeds']})")
    recorded = record["base"].get("data.path")
    if isinstance(recorded, str) and os.path.isabs(recorded):  # (no --data recorded, or a record made before: as given)
        base = absolute_data(base or {})  # compared resolved: relative to this working directory
    given = set(base or {})  # (--data, --device: what the command line gives; the rest of `base` is the record's)
    base = {**record["base"], **(base or {})}
    if config is None and not os.path.isfile(record["config"]):  # (moved or renamed since: say where to name it)
        raise ConfigError(f"--resume: {record['config']}: the config file {where} records is not found (or not a "
                          "regular file); give --config with its path now")
    config = config if config is not None else record["config"]
    given_sets = {k: json.dumps(v) for k, v in sets or []}
    check_recorded_values(where, config, base, recorded_sets, seeds or record["seeds"],
                          {k: "sets" for k, v in recorded_sets if given_sets.get(k) != json.dumps(v)}
                          | {k: "base" for k in record["base"] if k not in given})
    # the record with today's defaults for the keys added since an older version wrote it (train.early_stopping.target:
    # compared as absent, every sweep of early stopping recorded before it was refused as "started otherwise")
    changed = [(k, old, new) for k, old, new in config_changes(with_defaults(record["resolved"]),
                                                               resolved(config, base, record["sets"]))
               if not any(k == p or k.startswith(p + ".") for p in _FREE)]
    if changed:
        shown = ", ".join(f"{k}: {_shown(old)} -> {_shown(new)}" for k, old, new in changed)
        differences.append(f"the config ({config}, with --data/--device) differs in {shown}")
    if differences:  # (a differing --set is named as such: the config is compared on the recorded grid's first setting)
        raise ConfigError(f"--resume: the sweep in {directory} was started otherwise ({where}): "
                          + "; ".join(differences) + "; resume it as it started, or start a new sweep")
    return config, recorded_sets if sets is None else sets, record["seeds"] if seeds is None else seeds, base


def check_recorded_values(where: str, config: str, base: dict[str, Any], sets: list, seeds: int,
                          recorded: dict[str, str]) -> None:
    """Refuse, naming the record `where`, a value of the `recorded` keys (key -> "sets" or "base": what sweep.json
    alone gives, not the command line) that a setting's config refuses: load_config names every override "command
    line" (`dlrm.config._blame_overrides`), and a hand-edited record was blamed on a command line of `--resume DIR`
    alone. Any other error is left to the checks after (`reconcile`, `dlrm.sweep.check_settings`), said as before."""
    from dlrm.sweep import grid

    if not recorded:  # (the command line gives every key: its errors are its own)
        return
    for setting in grid(sets):
        try:
            load_config(config, {**base, **setting, "train.seed": seeds - 1})
        except ConfigError as e:
            rest = str(e).removeprefix("command line: ")
            named = [k for k in {**base, **setting} if rest.startswith((f"{k}:", f"{k} ", f"{k}[", f"{k}."))]
            if rest != str(e) and named and all(k in recorded for k in named):
                raise ConfigError(f"--resume: {where}: {recorded[named[0]]}: {rest}") from None


def mark_failed(run_dir: Path, reason: Optional[str]) -> None:
    """Record in `run_dir` (where the failed trial kept one) that its trial failed, and why (`reason`; None: remove
    the mark, the trial has finished since). Without it a ``--resume`` took a failed trial's directory for an
    interrupted one's and moved it aside as ``seed-<k>.interrupted``. A mark that cannot be written is said, not
    fatal (the failure may be a full disk): the directory is then named as interrupted."""
    mark = run_dir / FAILED_MARK
    try:
        if reason is None:
            mark.unlink(missing_ok=True)
        elif run_dir.is_dir() and not run_dir.is_symlink():  # renamed into place: a handed-over trial's mark that
            write_files_atomic(run_dir, {FAILED_MARK: reason + "\n"})  # links to a user's file is replaced, not written
    except OSError as e:
        logger.warning(f"sweep: cannot {'remove' if reason is None else 'write'} {mark} ({e.strerror or e})")


def gathered_summary(run_dir: Path, cfg_dict: dict[str, Any], name: str) -> Optional[dict]:
    """The summary of the trial `name` (config `cfg_dict`) in `run_dir` if it finished, else None; a one-line
    `ConfigError` when its summary.json records another config (hand-edited, another sweep's or version's run)."""
    summary = _read_summary(run_dir / "summary.json")
    if summary is None:
        return None
    saved = summary.get("config")
    if saved is not None and not isinstance(saved, dict):  # hand-edited: config_changes raised AttributeError
        raise ConfigError(f"--resume: {run_dir / 'summary.json'}: key 'config' must be a JSON object (the run's "
                          f"config), got {type(saved).__name__} {json.dumps(saved)[:40]}")
    # (an older version's summary: today's defaults for the keys added since, as the record's in `reconcile`)
    changed = [k for k, _, _ in config_changes(with_defaults(saved) if saved else {}, cfg_dict)
               if not any(k == p or k.startswith(p + ".") for p in _FREE)]
    if saved is not None and changed:
        raise ConfigError(f"--resume: {run_dir / 'summary.json'} is not of {name}: its config differs in "
                          f"{', '.join(changed[:5])}; move {run_dir} away to train this trial afresh")
    return summary


def check_gathered(config: str, base: dict[str, Any], sets: list, seeds: int, directory: Path, workdir: str) -> None:
    """Every finished trial's summary against its trial's config (`gathered_summary`), before anything trains: checked
    as the sweep reached each one, a foreign summary was refused only after the trials before it had trained (and
    what failed ones left had been moved aside)."""
    from dlrm.sweep import SettingResult, grid, trials

    results = [SettingResult(i, s) for i, s in enumerate(grid(sets))]
    for _, _, _, _, cfg, run_dir, name in trials(config, base, results, seeds, directory, workdir):
        gathered_summary(run_dir, cfg.to_dict(), name)


def trial_state(run_dir: Path, cfg_dict: dict[str, Any], name: str) -> tuple[Optional[dict], Optional[Path]]:
    """(its summary, None) for a trial that finished; (None, newest checkpoint) for one to resume; (None, None) for one
    to train afresh, with what an earlier attempt left in `run_dir` moved aside first (never deleted): to
    ``seed-<k>.failed`` where the trial failed (`mark_failed`), else ``seed-<k>.interrupted``."""
    summary = gathered_summary(run_dir, cfg_dict, name)
    if summary is not None:
        return summary, None
    # through a symbolic link too (a trial moved to another disk and linked back): the trainer resumes such a run in
    # place (`dlrm.train.run_dir.run_of`); taken for "nothing", it was moved aside and trained again from step 0
    checkpoints = list_checkpoints(run_dir) if run_dir.is_dir() else []
    if checkpoints:
        return None, checkpoints[-1]
    if run_dir.is_symlink() or run_dir.exists():
        if run_dir.is_dir() and not run_dir.is_symlink() and all(p.name == ".lock" for p in run_dir.iterdir()):
            return None, None  # an empty directory: the fresh run takes it (RunDirectory.create)
        failure = _failure(run_dir)
        aside = _free_name(run_dir, "interrupted" if failure is None else "failed")
        if run_dir.is_dir() and not run_dir.is_symlink():
            from dlrm.train.run_dir import RunLock

            RunLock.acquire(run_dir).release()  # a run still writing there (another process): refused, named
        run_dir.rename(aside)
        # (its events stay in TensorBoard, as the run <setting>/<aside's name>: named for what it was)
        what = ("stopped before its first checkpoint" if failure is None else
                f"it failed in an earlier session: {failure}")
        logger.warning(f"sweep --resume: {name} has neither a summary nor a checkpoint ({what}): what it left is "
                       f"moved to {aside}; the trial is trained afresh")
    return None, None


def _failure(run_dir: Path) -> Optional[str]:
    """The reason `mark_failed` recorded in `run_dir` (None: no failure recorded, the trial was interrupted)."""
    try:  # a regular file of a line (a handed-over sweep's FIFO of that name hung --resume, /dev/zero read without end)
        mark = read_regular_file(run_dir / FAILED_MARK, 1 << 20)
    except OSError:
        return None
    return mark.decode("utf-8", "replace").strip() or "failed"


def _read_summary(path: Path) -> Optional[dict]:
    """A finished run's summary (None: none, or not one a run wrote at its end: unreadable, no metrics)."""
    try:
        summary = read_json(path, SUMMARY_LIMIT)  # (a long run's: every logged loss)
    except (OSError, ValueError):
        return None
    # a NaN metric (a one-class split's AUC) is written as null: the run finished all the same
    finished = isinstance(summary, dict) and type(summary.get("steps")) is int and all(
        k in summary and (summary[k] is None or type(summary[k]) in (int, float)) for k in ("auc", "logloss"))
    # and the AUCs of its best evaluation and baseline, which the report reads too: a hand-edited {"baseline": "x"} (or
    # a string AUC there) made the sweep's report a TypeError or ValueError traceback
    finished = finished and all(summary.get(k) is None or (isinstance(summary[k], dict) and (
        summary[k].get("auc") is None or type(summary[k].get("auc")) in (int, float))) for k in ("best", "baseline"))
    if not finished:
        return None
    return summary


def _free_name(run_dir: Path, what: str) -> Path:
    for n in range(1, 1000):
        aside = run_dir.with_name(f"{run_dir.name}.{what}" + (f"-{n}" if n > 1 else ""))
        if not aside.exists() and not aside.is_symlink():
            return aside
    raise ConfigError(f"--resume: {run_dir}: 999 earlier attempts are kept beside it; remove some")


def resume_sweep(directory: str | Path, config: Optional[str] = None, sets: Optional[list] = None,
                 seeds: Optional[int] = None, base: Optional[dict[str, Any]] = None, train_fn=None):
    """Finish the sweep in `directory` (see the module docstring); returns (directory, verdict) as `run_sweep`.

    Args:
        directory: the sweep directory (``<tb-dir>/<run-name>`` of the sweep).
        config, sets, seeds, base: None takes the record's; given, they must match it.
        train_fn: ``(cfg, run_dir=...) -> summary`` and ``(cfg, resume=checkpoint) -> summary``;
            `dlrm.train.trainer.train` by default.
    """
    from dlrm import sweep

    directory = Path(os.path.abspath(directory))  # as a new sweep's (`dlrm.sweep.sweep_directory`): trials.csv's paths
    record = read_record(directory)
    from dlrm.sweep_checks import check_options_and_sets

    # --data or --device given beside the recorded --set of its key: dropped without a word, as by a new sweep
    check_options_and_sets(base or {}, record["sets"], str(directory / RECORD))
    config, sets, seeds, base = reconcile(directory, record, config, sets, seeds, base)
    settings = sweep.grid(sets)
    # (moved deeper since: a trial's event file over PATH_MAX was "a bug in dlrm" after the trials before it trained)
    sweep_resume_room(directory, [sweep.slug(i, s) for i, s in enumerate(settings)], seeds)
    # checked (the device's rules too) only the settings with a trial left to train: `_run_trials` gathers the
    # finished ones, training nothing, where checked all a resume of a sweep whose trials had all finished (killed
    # while writing its report) was refused on another machine than theirs ("CUDA is not available"), report unmade
    left = [s for i, s in enumerate(settings) if any(
        _read_summary(directory / sweep.slug(i, s) / f"seed-{k}" / "summary.json") is None for k in range(seeds))]
    sweep.check_settings(config, base, left, seeds)
    check_gathered(config, base, sets, seeds, directory, record.get("cwd") or os.getcwd())
    check_datasets_unchanged(directory, record, config, base, sets, left, record.get("cwd") or os.getcwd())
    if train_fn is None:
        from dlrm.sweep_checks import check_datasets
        from dlrm.train.trainer import train as train_fn

        # (their data as the trials read it; the grid's rivals were refused when it began, or it began so)
        check_datasets(config, base, left, record.get("cwd") or os.getcwd())
    lock = SweepLock.acquire(directory)
    try:  # (the sweep is this process's now: a trial another process writes is refused before anything trains)
        check_trials_free(directory, sets, seeds)
    except BaseException:
        lock.release()
        raise
    logger.info(f"sweep --resume: {counted(len(settings), 'setting')} x {counted(seeds, 'seed')} = "
                f"{counted(len(settings) * seeds, 'run')} in "
                f"{directory}; finished trials are gathered, interrupted ones resumed, failed ones tried again")
    return sweep.run_and_finish(config, base, sets, seeds, directory, train_fn, lock, created=False, resume=True,
                                workdir=record.get("cwd") or os.getcwd())
