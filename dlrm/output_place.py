"""Where a command writes: never into a directory that belongs to something else.

A run's directory is ``log.tb_dir/<run name>``. Where ``log.tb_dir`` lay inside a sweep (`check_outside_sweep`),
another run's directory or its ``checkpoints/`` folder, or the dataset the run reads, the new run was written there
without a word: among a sweep's trials (shown by ``--logdir <sweep>`` as one of them, listed by none of its records),
inside a run whose ``--resume``, pruning and ``summary.json`` know nothing of it, among a dataset's split files (a
tool's ``--overwrite`` replaced the whole folder, the run's checkpoints with it). Each is refused in one line naming
a place outside it. A ``--tb-dir`` that is a file was refused as "cannot create ... (File exists)". So is an
``--export`` file there (`dlrm.data.output_dirs.check_export_place`): written into a run's checkpoints/ (which its
pruning and --resume read as the run's own), a dataset (replaced whole, the program with it, by a tool's --overwrite)
or a sweep.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from dlrm.config import Config
from dlrm.config_checks import accepted_stem, fitted_name
from dlrm.data.output_dirs import is_run_directory
from dlrm.errors import ConfigError
from dlrm.json_file import read_json
from dlrm.path_checks import check_path, path_problem


def sweep_holding(tb_dir: str) -> Optional[Path]:
    """The sweep directory (one holding ``sweep.json``, `dlrm.sweep_resume.RECORD`) that a run under `tb_dir` would
    be written into: `tb_dir` itself, its setting directory's sweep (a trial's ``log.tb_dir``) or a trial's; else
    None."""
    here = Path(os.path.abspath(tb_dir))
    for candidate in (here, here.parent, here.parent.parent):
        try:  # a sweep's record (a small file), not any file of that name in a directory above the TensorBoard root
            record = read_json(candidate / "sweep.json")
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "sets" in record and "seeds" in record:
            return candidate
    return None


def free_name(parent: Path, name: str) -> str:
    """`name`, or ``name-2``, ``name-3``, ... : the first that `parent` holds nothing of (cut to a file name's length),
    without a leading '.' or '-' (`accepted_stem`: an old sweep ``-s``'s advice was ``--run-name -s-00-seed-0``,
    which the run it advised then refused)."""
    name = accepted_stem(name)
    n, candidate = 1, fitted_name(name, "")
    while os.path.lexists(parent / candidate):
        n += 1
        candidate = fitted_name(name, f"-{n}")
    return candidate


def _sweep_advice(sweep: Path, where: Path, run_name: Optional[str]) -> tuple[str, Optional[str]]:
    """("add --tb-dir <beside the sweep> [--run-name <free>]", the setting's number when `where` is a setting's)."""
    setting = where.name[:2] if where.parent == sweep and where.name[:2].isdigit() else None
    advice = f"add --tb-dir {sweep.parent}"
    if run_name is not None:  # (without one the default <config>-<date>-<time> is new there)
        stem = re.sub(r"[^\w.+-]", "_", "-".join(x for x in (sweep.name, setting, run_name) if x))
        advice += f" --run-name {free_name(sweep.parent, stem)} (free)"
    return advice, setting


def check_outside_sweep(config_path: str, cfg: Config) -> None:
    """Refuse a new run (or --eval-only, --compare) whose directory would be inside a sweep's, in one line naming a
    free place outside it. A sweep trial's config.json names the trial's setting directory as ``log.tb_dir``: given
    back as --config with the --run-name its refusal named (or any), the new run was written among the sweep's
    trials, where `--logdir <sweep>` showed it as one of them (with other HParams columns) and the sweep's records
    did not list it."""
    sweep = sweep_holding(cfg.log.tb_dir)
    if sweep is None:
        return
    where = Path(os.path.abspath(cfg.log.tb_dir))
    advice, setting = _sweep_advice(sweep, where, cfg.log.run_name)
    raise ConfigError(f"{config_path}: the run would be written into the sweep {sweep} (log.tb_dir {where}), which "
                      f"holds that sweep's trials only: {advice} to run this config outside it"
                      + (" (`train.py --resume` of a trial continues it in place)" if setting else ""))


def check_branch_outside_sweep(checkpoint: str, cfg: Config) -> None:
    """Refuse a branch (``--resume CHECKPOINT --run-name NEW``, NEW not the checkpoint's own run) whose new run would
    be inside a sweep, as `check_outside_sweep` refuses a new run: from a trial's checkpoint with the trial's
    config.json (``log.tb_dir`` its setting's directory), the branch was written among the sweep's trials, a
    ``seed-<k>``'s sibling no record of the sweep lists. ``--resume`` without ``--run-name`` (or naming the trial)
    continues the trial in place, as before."""
    from dlrm.train.run_dir import _same_file, run_of  # (torch: a --resume imports it anyway)

    sweep = sweep_holding(cfg.log.tb_dir)
    if sweep is None or cfg.log.run_name is None:
        return
    source = run_of(Path(checkpoint))
    target = Path(cfg.log.tb_dir) / cfg.log.run_name
    if source is not None and _same_file(target, source):  # the trial itself, in place
        return
    where = Path(os.path.abspath(cfg.log.tb_dir))
    advice, _ = _sweep_advice(sweep, where, cfg.log.run_name)
    raise ConfigError(f"--resume: the branch {cfg.log.run_name!r} from {checkpoint} would be written into the sweep "
                      f"{sweep} (log.tb_dir {where}), which holds that sweep's trials only: {advice} to branch "
                      "outside it (`--resume` without --run-name continues the trial in place)")


def check_tb_dir(tb_dir: str, flag: str, data_paths: tuple[str, ...] = (), owners: bool = True) -> None:
    """Refuse, in one line naming `flag`, a TensorBoard root that is no directory or lies in what belongs to something
    else: another run's directory (its ``checkpoints/`` too), the dataset at one of `data_paths` or any other. (A sweep's
    directory is `check_outside_sweep`'s, whose advice names a free run name.) `owners` False: only the first (a
    ``--resume`` by name, whose run is already where it is)."""
    check_path(flag, tb_dir)  # (a 300-byte name: `is_dir` below raised ENAMETOOLONG, "a bug in dlrm")
    here = Path(os.path.abspath(tb_dir))
    for path in (here, *here.parents):
        if os.path.lexists(path):  # the deepest part that exists must be a directory to create the rest in
            if not path.is_dir():
                what = "a dangling symbolic link" if path.is_symlink() and not path.exists() else "a file"
                where = f"{tb_dir} is" if path == here else f"{tb_dir}: {path} is"
                raise ConfigError(f"{flag}: {where} {what}, not a directory; pick another --tb-dir")
            break
    if not owners:
        return
    real = Path(os.path.realpath(here))
    # the run's own dataset, and any other (its metadata.json, as the data tools write every dataset)
    datasets = [Path(os.path.realpath(data)) for data in data_paths if path_problem(data) is None]  # (those: refused
    # as the data they are, by the run's own check)
    datasets += [p for p in (real, *real.parents) if (p / "metadata.json").is_file()]
    for dataset in datasets:
        if dataset.is_dir() and (real == dataset or dataset in real.parents):
            raise ConfigError(f"{flag}: {tb_dir} is inside the dataset {dataset}, which a tool's --overwrite replaces "
                              f"whole (runs written there with it); pick a --tb-dir outside it (--tb-dir "
                              f"{dataset.parent / 'tb_logs'})")
    for path in (real, *real.parents):
        if is_run_directory(path):
            raise ConfigError(f"{flag}: {tb_dir} is inside the run directory {path}, which holds that run's files "
                              f"only; pick a --tb-dir outside it (--tb-dir {path.parent})")
