"""A sweep's report: ``sweep.md``, ``sweep.csv``, ``trials.csv`` and the TensorBoard HParams under ``hparams/``, written
as one set (see `dlrm.sweep` for what they hold).

Everything is made first, the tables in memory and the HParams in a temporary directory beside ``hparams/``; only then
are the files renamed over their names (`dlrm.checkpoint.write_files_atomic`) and the new ``hparams/`` over the old.
Written in place one after the other, a failure midway (TensorBoard, a full disk, a kill) left half a table, or, on a
``--resume``, this session's tables beside the earlier session's (its ``hparams/`` already deleted): a report of two
sweeps. Now such a failure leaves the earlier report as it was.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from dlrm.checkpoint import write_files_atomic
from dlrm.file_modes import dir_mode
from dlrm.stop_signal import raise_pending, signals_deferred
from dlrm.sweep import slug
from dlrm.sweep_results import SettingResult, _std, label
from dlrm.train.metric_text import auc_text, csv_cell


def write_report(directory: Path, results: list[SettingResult], keys: list[str], text: str) -> None:
    """The tables and the HParams of `results` (`keys`: the swept keys; `text`: the verdict) into `directory`."""
    tables = tables_text(directory, results, keys, text)
    # what a write killed midway left (this process holds the sweep's lock: no other writes here); a temporary
    # hparams directory kept would show in TensorBoard as more HParams runs
    for stale in [*directory.glob(".hparams*.tmp"), *(p for name in tables for p in directory.glob(f".{name}.*.tmp"))]:
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    fresh = Path(tempfile.mkdtemp(prefix=".hparams.", suffix=".tmp", dir=directory))
    try:
        os.chmod(fresh, dir_mode())  # mkdtemp makes it 0700; hparams/ is an ordinary directory
        write_hparams(fresh, results)
        target = directory / "hparams"
        old = None
        # the tables and hparams/ published together: write_files_atomic defers a Ctrl-C or SIGTERM to the end of its
        # renames, where it stopped the sweep before hparams/ was put in place (new tables without their HParams; on a
        # --resume, beside the earlier session's)
        published = False
        try:
            # a SIGTERM whose stop a library dropped (TensorBoard's writer above, a trial's torch): the sweep stops
            # before its report, as on one that was not dropped (lost, it wrote the report and exited 0)
            raise_pending()
            with signals_deferred():
                write_files_atomic(directory, tables)
                if target.is_dir() and not target.is_symlink():
                    old = Path(tempfile.mkdtemp(prefix=".hparams-old.", suffix=".tmp", dir=directory))
                    os.replace(target, old / "hparams")
                os.replace(fresh, target)
                published = True
        finally:
            if published and old is not None:  # (also when the deferred signal raises: it left no stale run)
                shutil.rmtree(old)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # (gone once renamed into place)


def tables_text(directory: Path, results: list[SettingResult], keys: list[str], text: str) -> dict[str, str]:
    """sweep.csv, trials.csv and sweep.md (settings best first, then the failed trials), name -> content."""
    ranked = sorted(results, key=SettingResult.rank_key, reverse=True)
    rows = [r.row() for r in ranked]
    columns = ["setting", *keys, "seeds", "failed", "auc_mean", "auc_std", "logloss_mean", "logloss_std",
               "baseline_auc_mean", "aucs"]
    sweep_csv = io.StringIO(newline="")
    writer = csv.DictWriter(sweep_csv, columns)
    writer.writeheader()
    writer.writerows({k: csv_cell(v) for k, v in row.items()} for row in rows)  # NaN: an empty cell
    trials_csv = io.StringIO(newline="")
    writer = csv.writer(trials_csv)
    writer.writerow(["setting", "seed", "auc", "logloss", "best_auc", "baseline_auc", "steps", "run_dir", "status"])
    for r in results:
        for seed, s, reason in r.trials():
            # where the trial's run is now: the summary's own run_dir is where it ran, which a trial gathered by
            # --resume from a sweep directory moved since no longer names (the old place, or another sweep's run)
            run_dir = directory / slug(r.index, r.setting) / f"seed-{seed}"
            if s is None:  # a failed trial: its run directory if it kept one (it ran steps)
                writer.writerow([label(r.setting), seed, None, None, None, None, None,
                                 str(run_dir) if run_dir.exists() else None, f"failed: {reason}"])
                continue
            # a NaN (this session's one-class AUC) an empty cell, as null read back from summary.json by --resume
            writer.writerow([label(r.setting), seed, *map(csv_cell, (s["auc"], s["logloss"], (s.get("best") or {}).get(
                "auc"), (s.get("baseline") or {}).get("auc"), s["steps"])), str(run_dir), "ok"])
    has_base = any(row["baseline_auc_mean"] is not None for row in rows)
    has_failed = any(r.failed for r in results)  # the column only then: a sweep without failures reads as before
    lines = ["| setting | AUC mean | AUC std | logloss mean | logloss std | seeds |" + (" failed |" if has_failed else "")
             + (" baseline AUC |" if has_base else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if has_failed else "") + (" ---: |" if has_base else "")]
    for row in rows:
        # an undefined AUC (a one-class validation split's: every trial's NaN) reads "n/a (one class)", not "nan"
        # a setting whose trials all failed has no metric at all: "n/a" (it read "n/a (NaN scores)" and a logloss of
        # "nan", as if it had trained to NaN scores; its failures are listed under the table)
        auc = auc_text({"auc": row["auc_mean"], "logloss": row["logloss_mean"]}) if row["seeds"] else "n/a"
        auc_std = _number(row["auc_std"])
        base = (f" {auc_text({'auc': row['baseline_auc_mean'], 'logloss': row['logloss_mean']})} |"
                if row["baseline_auc_mean"] is not None else (" - |" if has_base else ""))
        setting = row["setting"].replace("|", "\\|")  # a bare | (a path's) split the cell: numbers under other heads
        lines.append(f"| {setting} | {auc} | {auc_std} | {_number(row['logloss_mean'])} "
                     f"| {_number(row['logloss_std'])} | {row['seeds']} |"
                     + (f" {row['failed']} |" if has_failed else "") + base)
    failures = [f"- {label(r.setting)}, seed {seed}: {reason}" for r in results for seed, _, reason in r.trials() if reason]
    if failures:
        lines += ["", "Failed trials (their settings rank after the others and are left out of the verdict):", "",
                  *failures]
    return {"sweep.csv": sweep_csv.getvalue(), "trials.csv": trials_csv.getvalue(),
            "sweep.md": "\n".join(lines) + "\n\n" + text + "\n"}


def _number(value: float) -> str:
    """A mean or standard deviation for sweep.md: 4 decimals, "n/a" for NaN (no trial finished, a NaN value)."""
    return "n/a" if math.isnan(value) else f"{value:.4f}"


def write_hparams(directory: Path, results: list[SettingResult]) -> None:
    """One TensorBoard HParams run per setting under `directory`, a session with the columns of its trials' sessions
    (`dlrm.train.reporting.session_hparams`: every run's keys and the swept ones; metrics ``hparam/auc``,
    ``hparam/logloss``, ``hparam/accuracy``, here the means over its finished trials, and ``SWEEP_METRICS``) and the
    same experiment. TensorBoard takes every column from one run's experiment, picked arbitrarily: the settings' named
    only the swept keys and ``sweep/*`` metrics, the trials' only their own keys, so in ``--logdir tb_logs`` one kind
    of row showed blank beside the other."""
    from torch.utils.tensorboard.summary import hparams

    from dlrm.train.reporting import experiment_metrics, open_writer

    # Each setting's run written as SummaryWriter.add_hparams writes it (its experiment, session summaries and metric
    # scalars in DIRECTORY/<slug>), by open_writer: on a full disk an OSError naming the event file (add_hparams's own
    # inner writer's thread died of it with a traceback, and the error raised here named no file)
    # (no events file of hparams/ itself: one holding only its header listed <sweep>/hparams as a run with no data)
    for r in results:
        if not r.summaries:  # every trial of it failed: no metric to show
            continue
        hp, cfg = _setting_hparams(r)
        aucs, losses = r.values("auc"), r.values("logloss")
        accuracies = [float(s["accuracy"]) for s in r.summaries if isinstance(s.get("accuracy"), (int, float))]
        metrics = {"hparam/auc": statistics.fmean(aucs), "hparam/logloss": statistics.fmean(losses),
                   "hparam/accuracy": statistics.fmean(accuracies) if len(accuracies) == len(aucs) else math.nan,
                   "sweep/auc_std": _std(aucs), "sweep/logloss_std": _std(losses), "sweep/seeds": len(aucs),
                   "sweep/failed_trials": len(r.failed)}  # its means are of fewer seeds
        # an undefined AUC (a one-class split's) is no HParams metric: left out, not shown as NaN
        metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
        with open_writer(directory / slug(r.index, r.setting)) as writer:
            for summary in hparams(hp, dict.fromkeys(experiment_metrics(cfg), 0.0)):  # (names: the values are scalars)
                writer._get_file_writer().add_summary(summary)
            for tag, value in metrics.items():
                writer.add_scalar(tag, value)


def _setting_hparams(r: SettingResult):
    """(HParams, config) of setting `r`'s session: its first finished trial's, as that trial's session names them.
    A summary without its run's config (a ``train_fn`` of a test's own): the swept keys alone."""
    keys = list(r.setting)  # (every setting sets the swept keys, in --set order)
    from dlrm.config import Config, ConfigError, LogConfig, config_from_dict
    from dlrm.data.schema import DatasetError, read_metadata
    from dlrm.train.reporting import session_hparams

    first = r.summaries[0]
    try:
        cfg = config_from_dict({**first["config"], "log": {"sweep_keys": keys}})
    except (KeyError, TypeError, ConfigError):
        swept = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in r.setting.items()}
        return swept or {"setting": "defaults"}, Config(log=LogConfig(sweep_keys=keys))
    try:  # the dataset's values a sample, which the trials trained with (they win over model.multi_hot_sizes)
        sizes = read_metadata(cfg.data.path).multi_hot_sizes
    except DatasetError:  # (the dataset gone since, on a --resume that gathered every trial)
        sizes = cfg.model.multi_hot_sizes
    batch = first.get("batch_size")
    # what its trials trained with (summary.json's resolved: "tf32" is fp32 on a CPU), as their sessions say
    resolved = first.get("resolved")
    hp = session_hparams(cfg, batch if isinstance(batch, int) else cfg.data.batch_size, sizes,
                         resolved if isinstance(resolved, dict) else None)
    # its metrics are the means over its trials' seeds: no one seed (the first trial's named it), a blank cell, text
    # as the trials' seeds are (a NaN typed the column a number's in this setting's experiment, text in a trial's)
    return {**hp, "seed": ""}, cfg
