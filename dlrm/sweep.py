"""``python -m dlrm.sweep``: train a grid of config settings over several seeds and say which won.

    python -m dlrm.sweep --config configs/criteo-small.json --data data/small-real-voc \\
        --set optim.sparse.lr=0.005,0.01,0.03 --set model.dropout=0,0.2 --seeds 3

Every ``--set KEY=V1,V2,...`` lists values of one dotted config key (the keys of `dlrm.config`; values
are JSON, else plain strings; commas inside [...] or {...} stay in the value); several ``--set``
make the product. Each setting is trained once per seed (``train.seed`` = 0 .. seeds-1, so every
setting sees the same initialisations and batch orders) through `dlrm.train.trainer.train`, each
trial in its own TensorBoard run ``<sweep dir>/<NN-setting>/seed-<k>/``. Every setting is validated
before the first trial: a bad key or value is one line naming it, exit code 2, as are two settings that would train
the same config (as their runs train it: what the device and the dataset decide resolved), or one whose dataset is
missing (`dlrm.sweep_checks`); only then are the grid's inert keys told (warnings).

The sweep directory (``<tb-dir>/<run-name>``, default ``tb_logs/<config>-sweep-<date>-<time>``, with ``-2``,
``-3``, ... when another sweep started in the same second holds that name) gets:

* ``sweep.md`` / ``sweep.csv``: per setting the mean and standard deviation over seeds (undefined, "n/a", for one
  finished seed) of the final validation AUC and logloss (and of the built-in baseline's AUC when the runs fitted it),
  best first (a setting whose mean AUC is NaN last); ``trials.csv``: every trial; in both CSVs a value that is
  missing or undefined (a failed trial's, a one-class split's NaN AUC: null in summary.json) is an empty cell;
* TensorBoard HParams (one run per setting under ``hparams/``): a session of the same columns as its trials' (every
  run's keys and the swept ones, ``log.sweep_keys``), its means over the seeds as ``hparam/auc``, ``hparam/logloss``,
  ``hparam/accuracy``, and ``sweep/auc_std``, ``sweep/logloss_std``, ``sweep/seeds``, ``sweep/failed_trials``;
* the verdict, also the last log line: the winner, its margin over the runner-up, and that margin
  against the seed noise, the standard error of the per-seed (paired) AUC differences: "within
  the seed noise" unless the margin is at least twice that.

The tables and ``hparams/`` are one report, written as a whole or not at all (`dlrm.sweep_report`).

A trial that fails while it runs (a diverged loss, a data error, out of memory, a bug) does not end the sweep: the
other trials run, the failed one is a row of ``trials.csv`` (``status``: ``failed: <reason>``) and of the list under
``sweep.md``'s table, its setting ranks after those whose trials all finished and is left out of the verdict, and
once the tables are written the sweep exits with the first failure's code (dlrm.cli's). A config error a trial's run
raises (a device that is absent, say) ends the sweep, as do Ctrl-C and a signal (the trial's checkpoint is kept).

A sweep records its grid in ``sweep.json`` before its first trial; one that stopped (Ctrl-C, a signal, a crash, a time
limit) or had failed trials is finished in the same directory by ``python -m dlrm.sweep --resume <sweep dir>``:
finished trials are gathered, not trained again; an interrupted one resumes from its checkpoint; one without a
checkpoint, or failed, is trained afresh (what it left moved aside, as ``seed-<k>.failed`` or ``.interrupted``); then
the tables cover every trial once. Every finished trial's summary is checked against its trial's config first, and
no trial may be in another process's hands. Options
given with ``--resume`` must match the record (`dlrm.sweep_resume`).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

import click
from loguru import logger

from dlrm.config import ConfigError, closest_config_key, config_keys, load_config
from dlrm.config_checks import MAX_NAME_BYTES, check_dependent_keys, leading_name_problem
from dlrm.errors import DatasetError, TrainingStopped, failure_reason
from dlrm.logging_setup import counted
from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand
from dlrm.path_checks import check_path
from dlrm.run_paths import check_room, sweep_deepest
# (the results and the verdict: dlrm.sweep_results, named here as they always were)
from dlrm.sweep_results import (NOISE_FACTOR, SettingResult, Verdict, _mean, _std, label,  # noqa: F401
                               verdict)
from dlrm.train.metric_text import auc_text

# -- the grid ---------------------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
    """Split `text` at the commas outside brackets and quotes: ``"1,[2,3],x"`` -> ``["1", "[2,3]", "x"]``.

    Example:
        >>> split_values('0.01,[64,16],{"a": 1, "b": 2}')
        ['0.01', '[64,16]', '{"a": 1, "b": 2}']
    """
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "[{":
            depth += 1
        elif not quoted and ch in "]}":
            depth -= 1
        elif not quoted and depth == 0 and ch == ",":
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (0.01, true, null, [64, 16]), else the plain string.

    Example:
        >>> [parse_value(v) for v in ("0.01", "true", "cat", "[64, 16]")]
        [0.01, True, 'cat', [64, 16]]
    """
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_set(option: str) -> tuple[str, list[Any]]:
    """One ``--set KEY=V1,V2`` option -> (key, values); a one-line `ConfigError` names what is wrong."""
    key, sep, values = option.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {option!r}: expected KEY=VALUE[,VALUE...], e.g. optim.sparse.lr=0.005,0.01")
    known = config_keys()
    if key not in known:
        close = closest_config_key(key, known)
        hint = f" (did you mean {close}?)" if close else ""
        raise ConfigError(f"--set {key}: not a config key{hint}")
    if key == "train.seed":
        raise ConfigError("--set train.seed: the seeds come from --seeds (0 .. seeds-1)")
    if key == "log" or key.startswith("log."):  # every trial is written under the sweep's own directory
        raise ConfigError(f"--set {key}: each trial's run directory is <--tb-dir>/<--run-name>/<setting>/seed-<N>; "
                          "set --tb-dir and --run-name for the sweep")
    texts = split_values(values)
    if any(t == "" for t in texts):
        raise ConfigError(f"--set {key}: empty value in {values!r}")
    parsed = [parse_value(t) for t in texts]
    from dlrm.sweep_checks import _holds

    if key == "train" and any(_holds(v, ["seed"]) for v in parsed):  # (train.seed is then set over it: seed 0 trained
        # under the label 'train={"seed": 5}')
        raise ConfigError(f"--set {key}: a value sets train.seed; the seeds come from --seeds (0 .. seeds-1)")
    if len({json.dumps(_same_value(v), sort_keys=True) for v in parsed}) != len(parsed):
        raise ConfigError(f"--set {key}: a value is listed twice in {values!r}")
    return key, parsed


def _same_value(value: Any) -> Any:
    """`value` with every number as a float, so that 0 and 0.0 (one config value) compare as duplicates."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # (a bool stays itself)
        return float(value)
    if isinstance(value, list):
        return [_same_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _same_value(v) for k, v in value.items()}
    return value


def grid(sets: list[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """The product of the ``--set`` lists, as override dicts, in the order given.

    Example:
        >>> grid([("a", [1, 2]), ("b", ["x"])])
        [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'x'}]
    """
    keys = [k for k, _ in sets]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--set: a key is given twice ({', '.join(k for k in keys if keys.count(k) > 1)})")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in sets))] if sets else [{}]


def slug(index: int, setting: dict[str, Any]) -> str:
    """A directory name for a setting: its index and a filesystem-safe, shortened label."""
    text = "+".join(f"{'.'.join(k.split('.')[-2:])}={json.dumps(v)}" for k, v in setting.items()) or "defaults"
    safe = "".join(c if c.isalnum() or c in "._=-+" else "_" for c in text)
    return f"{index:02d}-{safe[:80]}"


# -- outputs ----------------------------------------------------------------------------------------


def write_tables(directory: Path, results: list[SettingResult], keys: list[str], text: str) -> None:
    """sweep.csv, sweep.md and trials.csv, and the HParams under ``hparams/``, as one report (`dlrm.sweep_report`)."""
    from dlrm.sweep_report import write_report

    write_report(directory, results, keys, text)


# -- running ----------------------------------------------------------------------------------------


def sweep_directory(tb_dir: str, run_name: Optional[str], config: str, data_paths: tuple[str, ...] = (),
                    settings: Sequence[dict[str, Any]] = (), seeds: int = 1) -> tuple[Path, bool]:
    """The new, empty sweep directory (an existing non-empty one is refused: nothing is overwritten), and whether
    this call created it. `data_paths`: the datasets its trials read (no --tb-dir inside one); `settings` and `seeds`:
    its trials, whose deepest file must fit under --tb-dir (`dlrm.run_paths.sweep_deepest`)."""
    # an empty value (an unset variable): --tb-dir "" wrote into the working directory, --run-name "" took the default
    if tb_dir == "":
        raise ConfigError('--tb-dir: empty path (the TensorBoard root; "." for the working directory)')
    name = f"{Path(config).stem}-sweep-{time.strftime('%Y%m%d-%H%M%S')}" if run_name is None else run_name
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"--run-name: {name!r} must be a plain directory name")
    hidden = leading_name_problem(name, "--run-name") if run_name is not None else leading_name_problem(
        name, f"--config {config}: the default sweep name", "pass --run-name")
    if hidden:  # (its trials were hidden with it: tb_logs/.s/<setting>/seed-0; rm -r -s read as options)
        raise ConfigError(hidden)
    if len(os.fsencode(name)) > MAX_NAME_BYTES:  # (as log.run_name's: mkdir raised ENAMETOOLONG, "a bug in dlrm")
        raise ConfigError(f"--run-name: a name of {len(os.fsencode(name))} bytes is too long for a directory name "
                          f"(at most {MAX_NAME_BYTES})")
    # absolute: the trials' run directories (their summary.json, checkpoints) and trials.csv's run_dir name it; under
    # a relative --tb-dir (the default tb_logs) trials.csv named paths valid only from where the sweep was started
    directory = Path(os.path.abspath(tb_dir)) / name
    from dlrm.output_place import check_tb_dir, sweep_holding

    outer = sweep_holding(tb_dir)  # (a sweep among another's trials: shown and listed as part of it, as a run was)
    if outer is not None:
        raise ConfigError(f"--tb-dir: {directory.parent} is inside the sweep {outer}, which holds that sweep's trials "
                          f"only; pick a --tb-dir outside it (--tb-dir {outer.parent})")
    # a file there ("cannot create ... (File exists)"), another run's directory, a dataset the trials read
    check_tb_dir(tb_dir, "--tb-dir", data_paths)
    # (a trial's checkpoint over PATH_MAX: "a bug in dlrm" after the trials before it had trained)
    check_room("--tb-dir", tb_dir, sweep_deepest(name + ("-999" if run_name is None else ""),
                                                 [slug(i, s) for i, s in enumerate(settings)] or [slug(0, {})], seeds))
    if run_name is None:
        return _claim_default_directory(directory), True
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"--run-name: {directory} already exists; pick another name")
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--tb-dir: cannot create {directory} ({e.strerror or e})") from None
    return directory, created


def _claim_default_directory(directory: Path) -> Path:
    """A new directory for a sweep without --run-name: `directory` (``<config>-sweep-<date>-<time>``), or the first
    free ``-2``, ``-3``, ... when another sweep started in the same second holds it (refused as "--run-name ...
    already exists" though none was given, or, still empty, shared: the two sweeps' trials collided). One ``mkdir``
    claims it, which only one process wins, as `dlrm.train.run_dir` does for a run's default name."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--tb-dir: cannot create {directory.parent} ({e.strerror or e})") from None
    for n in range(1, 1000):
        candidate = directory if n == 1 else directory.with_name(f"{directory.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"--tb-dir: cannot create {candidate} ({e.strerror or e})") from None
    raise ConfigError(f"--tb-dir: {directory.parent} holds {directory.name} and 998 more of its name; pass --run-name")


def check_settings(config: str, base: dict[str, Any], settings: list[dict[str, Any]], seeds: int) -> None:
    """Load every setting's config before training: the first bad one raises, naming its key and value."""
    from dlrm.train.setup import check_device_rules  # (torch: not for --help)

    for setting in settings:
        try:
            check_device_rules(load_config(config, {**base, **setting, "train.seed": seeds - 1}))
        except ConfigError as e:
            # an error the config file or --data/--device make without any setting (a missing file, a bad device)
            # is theirs: not blamed on the first --set (a setting may also mend the file's value: then it is fine)
            try:
                check_device_rules(load_config(config, {**base, "train.seed": seeds - 1}))
            except ConfigError as without:
                if str(without) == str(e):
                    raise without from None
            raise ConfigError(f"--set {label(setting)}: {e}") from None


def run_sweep(config: str, sets: list[tuple[str, list[Any]]], seeds: int, base: Optional[dict[str, Any]] = None,
              tb_dir: str = "tb_logs", run_name: Optional[str] = None, train_fn=None) -> tuple[Path, Optional[Verdict]]:
    """Train every setting of the grid with seeds 0 .. seeds-1; write the tables; return (directory, verdict).

    Args:
        config: the config file every trial starts from.
        sets: (dotted key, values) per ``--set`` (see `parse_set`).
        seeds: trials per setting.
        base: overrides applied to every trial (``--data``, ``--device``, ...).
        tb_dir, run_name: where the sweep directory goes.
        train_fn: ``(cfg, run_dir=...) -> summary``; `dlrm.train.trainer.train` by default.

    Example (not a doctest: six training runs on `data/small-real`, which the README's command makes)::

        directory, v = run_sweep("configs/criteo-small.json", [("optim.sparse.lr", [0.005, 0.01])], 3,
                                 {"data.path": "data/small-real"})
    """
    if seeds < 1:
        raise ConfigError(f"--seeds: {seeds} must be >= 1")
    if seeds > 2**63:  # (the seeds are 0 .. seeds-1: named as train.seed's error, "command line: train.seed: ...")
        raise ConfigError(f"--seeds: {seeds} must be <= 2**63 (train.seed 0 .. seeds-1 fits in int64)")
    from dlrm.sweep_resume import absolute_data, absolute_sets, write_record

    base = absolute_data(dict(base or {}))  # the trials and sweep.json: --data as the working directory names it now
    sets = absolute_sets(sets)  # and --set data.path=... alike
    settings = grid(sets)
    from dlrm.sweep_checks import check_nested_sets, check_options_and_sets

    check_nested_sets(sets)  # a key swept both alone and inside a section's value: which one trains?
    check_options_and_sets(base, sets)  # nor --data beside --set data.path
    check_settings(config, base, settings, seeds)
    # a new sweep's whole grid (--resume: checked when it began); its warnings told once nothing is refused
    told = check_dependent_keys(config, base, settings, warn=False)
    from dlrm.sweep_checks import check_datasets, check_same_configs

    check_same_configs(config, base, settings)  # nor two settings of one config (a dot model under two cross_rank)
    if train_fn is None:  # (a train_fn of its own may read no dataset)
        from dlrm.train.trainer import train as train_fn

        check_datasets(config, base, settings, os.getcwd())  # a setting's missing dataset: not after the others trained
    for line in told:
        logger.warning(line)

    data_paths = tuple(sorted({load_config(config, {**base, **setting}).data.path for setting in settings}))
    directory, created = sweep_directory(tb_dir, run_name, config, data_paths, settings, seeds)
    try:
        lock = write_record(directory, config, sets, seeds, base)  # what --resume reads back
    except BaseException:
        _remove_empty_directories(directory, keep_root=not created)
        raise
    logger.info(f"sweep: {counted(len(settings), 'setting')} x {counted(seeds, 'seed')} = "
                f"{counted(len(settings) * seeds, 'run')} into {directory}")
    return run_and_finish(config, base, sets, seeds, directory, train_fn, lock, created, resume=False,
                          workdir=os.getcwd())


_STOPPED_LINE = "_sweep_stopped_line"


def stopped_line(exc: BaseException, line: Optional[str] = None) -> Optional[str]:
    """The sweep's "stopped; --resume finishes it" line that `exc` (what ended the sweep) carries to `main`, which logs
    it after `exc`'s own report; with `line`: attach it (an exception that takes no attribute: logged now)."""
    if line is None:
        return getattr(exc, _STOPPED_LINE, None)
    if not isinstance(exc, (Exception, KeyboardInterrupt)):  # (a second signal's SystemExit: `main` reports none)
        logger.info(line)
        return line
    try:
        setattr(exc, _STOPPED_LINE, line)
    except (AttributeError, TypeError):
        logger.info(line)
    return line


def run_and_finish(config: str, base: dict[str, Any], sets: list[tuple[str, list[Any]]], seeds: int, directory: Path,
                   train_fn, lock, created: bool, resume: bool, workdir: str) -> tuple[Path, Optional[Verdict]]:
    """The trials (on `resume`, those `dlrm.sweep_resume.trial_state` leaves to do), then `_finish`; `lock` (the
    sweep's, `SweepLock`) is released at the end. `workdir`: the working directory the sweep started in (sweep.json's
    ``cwd``), against which the config file's own relative data.path is read."""
    results = [SettingResult(i, s) for i, s in enumerate(grid(sets))]
    try:
        try:
            from dlrm.train.setup import DatasetHolds  # (torch: not for --help)

            with DatasetHolds() as holds:  # a tool's --overwrite of a dataset between two trials is refused
                first_failure = _run_trials(config, base, results, seeds, directory, train_fn, holds, resume,
                                            workdir)
        except BaseException:  # a config error, Ctrl-C or a signal ended the sweep: keep what its trials wrote, and
            # only that (a trial that failed before its first step removed its own run directory, not the empty
            # <setting>/ and sweep directories above it, and the same --run-name was then refused as "already exists")
            _remove_empty_directories(directory, keep_root=True)
            if not resume and [p.name for p in directory.iterdir()] == ["sweep.json"]:
                (directory / "sweep.json").unlink()  # nothing trained: no sweep to resume, the name is free again
                _remove_empty_directories(directory, keep_root=not created)
            else:
                # said by `main` after the error's own line ("stopped by signal at step N; checkpoint ..."), which
                # it reports: logged here, the sweep's conclusion came before the trial's stop it follows from
                exc = sys.exc_info()[1]
                # a refusal (a dataset changed since, a bad setting) repeats on --resume until its cause is fixed
                fixed = "once the error above is fixed, " if isinstance(exc, (ConfigError, DatasetError)) else ""
                stopped_line(exc, f"sweep: stopped; {fixed}`python -m dlrm.sweep --resume {directory}` finishes it "
                             "(the finished trials are kept; a stopped one resumes from its last checkpoint, or "
                             "starts again if it wrote none)")
            raise
        return _finish(directory, results, sets, seeds, first_failure, resume)
    finally:
        lock.release()


def trials(config: str, base: dict[str, Any], results: list[SettingResult], seeds: int, directory: Path,
           workdir: Optional[str] = None):
    """Every trial of the sweep, in order: (number from 1, its setting's result, seed, overrides, config, run
    directory, name for the log)."""
    total = len(results) * seeds
    for trial, (r, seed) in enumerate(itertools.product(results, range(seeds)), start=1):
        # log.sweep_keys: its HParams session names the swept keys, as the settings' under hparams/ do (one experiment)
        overrides = {**base, **r.setting, "train.seed": seed, "log.sweep_keys": list(r.setting)}
        cfg = load_config(config, overrides)
        if workdir is not None and not os.path.isabs(cfg.data.path):
            # the config file's own data.path (--data and --set data.path are recorded absolute): read where the sweep
            # started, as --data is. A --resume from another working directory trained the trials left on what that
            # name held there, and refused the finished ones ("not of" their trial: they recorded the first place).
            overrides["data.path"] = os.path.normpath(os.path.join(workdir, cfg.data.path))
            cfg = load_config(config, overrides)
        run_dir = directory / slug(r.index, r.setting) / f"seed-{seed}"
        # the trial's run directory as its config names it, from its first session on: the trainer's --resume of it
        # names it so (below), and a first session recorded log.tb_dir "tb_logs" and log.run_name null, which every
        # resumed trial then said as settings it changed ("log.run_name: null -> 'seed-0'"), in summary.json's
        # sessions too. Absolute: a --resume from another working directory names the same directory
        overrides.update({"log.tb_dir": os.path.abspath(run_dir.parent), "log.run_name": run_dir.name})
        cfg = load_config(config, overrides)
        yield trial, r, seed, overrides, cfg, run_dir, f"sweep trial {trial}/{total} ({label(r.setting)}, seed {seed})"


def _run_trials(config: str, base: dict[str, Any], results: list[SettingResult], seeds: int, directory: Path,
                train_fn, holds, resume: bool = False, workdir: Optional[str] = None) -> Optional[BaseException]:
    """Every trial in turn, its summary or its failure into `results`; returns the first failure's exception. On
    `resume`, a finished trial's summary is gathered and an interrupted one resumed from its checkpoint."""
    from dlrm.sweep_resume import mark_failed, trial_state
    from dlrm.train.compare import release_memory

    first_failure: Optional[BaseException] = None
    for trial, r, seed, overrides, cfg, run_dir, name in trials(config, base, results, seeds, directory, workdir):
        done, checkpoint = trial_state(run_dir, cfg.to_dict(), name) if resume else (None, None)
        if done is not None:
            r.summaries.append(done)
            # (its AUC null: a one-class split's, which ended the resume with a format TypeError)
            logger.info(f"{name}: finished earlier ({run_dir / 'summary.json'}): AUC {auc_text(done)}")
            continue
        release_memory()  # as train.py alone: no compiled graph (its recompile limit) nor model of the trials before
        try:
            holds.hold(cfg)  # until the sweep ends: its trials compared on one dataset
            if checkpoint is not None:  # in place: the trainer's --resume of run <setting dir>/seed-<k>
                logger.info(f"{name}: resuming from {checkpoint}")
                summary = train_fn(cfg, resume=str(checkpoint))
                if not all(isinstance(summary.get(k), (int, float)) for k in ("auc", "logloss", "steps")):
                    # its run had ended (early stopping's checkpoint) but its summary.json is gone: no metrics
                    raise ConfigError(f"{checkpoint} ended its run, whose summary.json is missing; move {run_dir} "
                                      "away to train this trial afresh")
            else:
                summary = train_fn(cfg, run_dir=run_dir)
        except ConfigError as e:  # a setting only its run can refuse (a device, a size): say which trial it was
            raise ConfigError(f"{name}: {e}") from None
        except TrainingStopped:  # a signal (Ctrl-C, SIGTERM) stopped the trial after its checkpoint: stop the sweep
            raise
        except Exception as e:  # one trial's failure: the others still run (KeyboardInterrupt is no Exception)
            r.failed[seed] = failure_reason(e)
            logger.error(f"{name} failed: {r.failed[seed]}; the sweep goes on")
            mark_failed(run_dir, r.failed[seed])  # what it kept: a --resume moves it aside as failed, not "interrupted"
            if first_failure is None:
                # its frames' locals (the failed run's model and tensors) freed; the traceback stays for the report
                traceback.clear_frames(e.__traceback__)
                first_failure = e
            continue
        mark_failed(run_dir, None)  # (a failed trial resumed from its checkpoint: it has finished now)
        r.summaries.append(summary)
        logger.info(f"sweep trial {trial}/{len(results) * seeds}: {label(r.setting)}, seed {seed}: "
                    f"AUC {auc_text(summary)}, logloss {summary['logloss']:.4f}")
    return first_failure


def _remove_empty_directories(directory: Path, keep_root: bool) -> None:
    """Remove the empty directories in `directory`, and (unless `keep_root`) itself if it is left empty; never a
    file."""
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    if not keep_root and directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()


def _finish(directory: Path, results: list[SettingResult], sets: list[tuple[str, list[Any]]], seeds: int,
            first_failure: Optional[BaseException], resume: bool = False) -> tuple[Path, Optional[Verdict]]:
    """The verdict, the tables and HParams; then the first failed trial's exception, if a trial failed."""
    total = len(results) * seeds
    complete = [r for r in results if r.complete]
    if complete:
        result = verdict(complete)
        result.left_out = len(results) - len(complete)
        text = result.text()
    else:
        result, text = None, "no setting finished all its trials: no verdict"
    # an earlier session's report: replaced, not added to (said: its tables were replaced without a word)
    earlier = [n for n in ("sweep.md", "sweep.csv", "trials.csv", "hparams") if resume and (directory / n).exists()]
    try:
        write_tables(directory, results, [k for k, _ in sets], text)
    except BaseException as e:  # Ctrl-C, a signal, a full disk: said as a stop during a trial is ("interrupted
        # (Ctrl-C)" alone left the user without the command that writes the report)
        fixed = "" if isinstance(e, (KeyboardInterrupt, TrainingStopped)) else "once the error above is fixed, "
        stopped_line(e, f"sweep: stopped while writing its report; {fixed}`python -m dlrm.sweep --resume {directory}` "
                     "writes it (the finished trials are gathered, not trained again)")
        raise
    if earlier:
        logger.info(f"sweep --resume: the earlier session's report in {directory} ({', '.join(earlier)}) replaced by "
                    "this one's (all trials)")
    logger.info(f"sweep table: {directory / 'sweep.md'}")
    logger.info(f"sweep {text}")
    if first_failure is not None:  # the tables are written: now the non-zero exit (the first failure's code)
        failed = [(r, seed) for r in results for seed in r.failed]
        names = "; ".join(f"{label(r.setting)}, seed {seed}" for r, seed in failed)
        logger.error(f"sweep: {len(failed)} of {total} trials failed ({names}); their reasons are listed in "
                     f"{directory / 'sweep.md'} and trials.csv; the first:")
        raise first_failure
    return directory, result


@click.command(cls=OneLineUsageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=NonEmptyPath("the JSON config file", dir_okay=False),
              help="JSON config file (required, except with --resume: the sweep's own by default).")
@click.option("--set", "sets", multiple=True, metavar="KEY=V1,V2",
              help="A dotted config key and the values to try (JSON, else strings); repeat for the product.")
@click.option("--seeds", type=int, default=3, show_default=True, help="Trials per setting (train.seed 0 .. N-1).")
@click.option("--data", type=str, help="Dataset directory (overrides data.path in every trial).")
@click.option("--device", type=str, help="auto | cpu | cuda (overrides train.device).")
@click.option("--tb-dir", type=str, default="tb_logs", show_default=True, help="Where the sweep directory goes.")
@click.option("--run-name", type=str, help="The sweep directory's name [default: <config>-sweep-<date>-<time>].")
@click.option("--resume", "resume_dir", type=str, metavar="SWEEP_DIR",
              help="Finish the stopped sweep in SWEEP_DIR, as its sweep.json records it (options given must match).")
def main(config_path, sets, seeds, data, device, tb_dir, run_name, resume_dir) -> None:
    """Train a grid of settings over several seeds; tables, HParams and the winner against the seed noise.

    Exit codes as train.py's (dlrm.cli): 0 done, 2 a bad key, value or option (one line), 1 a bug; when a trial
    failed, the first failed trial's code (3 a diverged loss, 4 out of memory, ...), after the tables are written;
    130 Ctrl-C, 143 SIGTERM (--resume SWEEP_DIR finishes the sweep).
    """
    from dlrm.cli import report_failure, world_size_from_env
    from dlrm.logging_setup import configure_logging
    from dlrm.stop_signal import StopAtOnce, take_pending

    ctx = click.get_current_context()
    given = {name: ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT for name in ("seeds", "tb_dir")}
    if resume_dir is None and config_path is None:
        raise click.UsageError("Missing option '--config'.")
    configure_logging(ranks=True)  # (under torchrun, refused below: rank 0 says it, the others stay quiet)
    try:
        with StopAtOnce():  # SIGTERM raises, as in train.py: its default action skipped the sweep's cleanup
            if world_size_from_env() > 1:
                # every rank ran the whole grid: each made a sweep directory of its own (the second `<name>-2`, with
                # a copy of the tables), or, with --run-name, was told the one another rank had just made existed
                raise ConfigError(f"dlrm.sweep runs its trials in one process, not under torchrun (WORLD_SIZE "
                                  f"{world_size_from_env()}: every rank would run the whole sweep): start it with "
                                  "python -m dlrm.sweep")
            for flag, path in (("--data", data), ("--tb-dir", tb_dir), ("--resume", resume_dir)):
                # (a 300-byte name: an OSError of the first check to look, "a bug in dlrm"; --data afile/x: "data.path:
                # ... does not exist"; --tb-dir's own check names a file on the way)
                check_path(flag, path, under_file=flag != "--tb-dir")
            base = {k: v for k, v in (("data.path", data), ("train.device", device)) if v is not None}
            if resume_dir is None:
                run_sweep(config_path, [parse_set(s) for s in sets], seeds, base, tb_dir, run_name)
            else:
                if run_name is not None or given["tb_dir"]:
                    raise ConfigError("--resume: the sweep directory is SWEEP_DIR; --tb-dir and --run-name do not go "
                                      "with it")
                if resume_dir == "":
                    raise ConfigError("--resume: an empty path is no sweep directory")
                from dlrm.sweep_resume import resume_sweep
                resume_sweep(resume_dir, config_path, [parse_set(s) for s in sets] if sets else None,
                             seeds if given["seeds"] else None, base)
            # a SIGTERM whose stop a library dropped once the report was written: nothing left to stop (as train.py's
            # `LateSignals`), said; forgotten by `StopAtOnce`'s end, the sweep exited 0 without a word
            late = take_pending()
        if late is not None:
            logger.warning(f"{signal.Signals(late).name} arrived after the sweep finished (its report written): "
                           "nothing left to stop, exit 0")
    except (Exception, KeyboardInterrupt) as e:
        code = report_failure(e, None)
        if stopped_line(e) is not None:  # after the stop's own line, which it follows from
            logger.info(stopped_line(e))
        sys.exit(code)


if __name__ == "__main__":
    main()
