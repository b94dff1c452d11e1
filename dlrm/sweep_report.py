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
from dlrm.sweep import SettingResult, _std, label, slug
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
        os.chmod(fresh, 0o755)  # mkdtemp makes it 0700; hparams/ is an ordinary readable directory
        write_hparams(fresh, results)
        write_files_atomic(directory, tables)
        target = directory / "hparams"
        old = None
        if target.is_dir() and not target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=".hparams-old.", suffix=".tmp", dir=directory))
            os.replace(target, old / "hparams")
        os.replace(fresh, target)
        if old is not None:
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
    """One TensorBoard HParams run per setting under `directory` (swept keys -> metrics)."""
    from torch.utils.tensorboard.summary import hparams

    from dlrm.train.reporting import open_writer

    # Each setting's run written as SummaryWriter.add_hparams writes it (its experiment, session summaries and metric
    # scalars in DIRECTORY/<slug>), by open_writer: on a full disk an OSError naming the event file (add_hparams's own
    # inner writer's thread died of it with a traceback, and the error raised here named no file)
    with open_writer(directory):  # the sweep's own events file, as before
        pass
    for r in results:
        if not r.summaries:  # every trial of it failed: no metric to show
            continue
        swept = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in r.setting.items()}
        aucs, losses = r.values("auc"), r.values("logloss")
        metrics = {"sweep/auc_mean": statistics.fmean(aucs), "sweep/auc_std": _std(aucs),
                   "sweep/logloss_mean": statistics.fmean(losses),
                   "sweep/failed_trials": len(r.failed)}  # its means are of fewer seeds
        # an undefined AUC (a one-class split's) is no HParams metric: left out, not shown as NaN
        metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
        with open_writer(directory / slug(r.index, r.setting)) as writer:
            for summary in hparams(swept or {"setting": "defaults"}, metrics):
                writer._get_file_writer().add_summary(summary)
            for tag, value in metrics.items():
                writer.add_scalar(tag, value)
