"""Command line: `python train.py --config PATH [overrides]` (click).

Every expected failure prints one ERROR line on stderr (no traceback) and exits non-zero:

====== ==========================================================================================
code   meaning
====== ==========================================================================================
0      success; also after a SIGINT/SIGTERM that came once the results were all written (said in
       a line: `dlrm.stop_signal.LateSignals`)
1      a bug in dlrm: an unexpected exception; its traceback, then a line saying so (with the version)
2      bad input: command line (click's usage errors too), config file, dataset, checkpoint,
       --export path, Triton unavailable for a requested Triton kernel, a file that cannot be
       written or read (disk full, over quota or a file size limit, read-only file system, no permission)
3      the training loss became NaN or Inf (the line names the last good checkpoint)
4      out of memory (host or GPU): retry with a smaller data.batch_size, or cap the embedding
       tables with data.max_rows_per_table (while the model is built: the tables' size, and what makes them fit;
       a --resume, whose checkpoint fixes the tables, is told to run where there is more memory)
5      another rank of a distributed run is gone (killed, out of memory, its own error): --resume continues
128+n  stopped by signal n after writing a checkpoint (143: SIGTERM, 130: SIGINT during training);
       SIGTERM outside the training steps stops at once, without one (a new run's directory removed)
130    interrupted by Ctrl-C (KeyboardInterrupt) outside the training loop
====== ==========================================================================================

The exception classes are imported here at module level from light modules (`dlrm.errors`,
no torch), so the handlers exist whenever the failure (or a Ctrl-C) happens; the trainer itself
is imported late, which keeps --help and config errors fast.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import json
import os
import sys
from pathlib import Path
from typing import Optional, Union

import click
from loguru import logger

from dlrm.config import Config, closest_config_key, config_keys, load_config
from dlrm.config_checks import check_default_run_name, export_name_problem, free_run_name
from dlrm.data.output_dirs import check_export_place
from dlrm.distributed import said_once
from dlrm.distributed.said_once import node_other_rank as _node_other_rank
from dlrm.errors import (EXIT_PEER_LOST, ConfigError, DatasetError, NonFiniteLoss, TrainingStopped, is_out_of_memory,
                         is_peer_lost, peer_lost_message, report_bug, as_limit_failure)
from dlrm.logging_setup import configure_logging, run_logger
from dlrm.one_line_usage import NonEmptyPath, OneLineUsageCommand
from dlrm.output_place import check_branch_outside_sweep, check_outside_sweep, check_tb_dir
from dlrm.path_checks import check_path
from dlrm.run_paths import check_room, export_temp, run_deepest
from dlrm.stop_signal import LateSignals, StopAtOnce, signal_stop_inside
from dlrm.train.oom_advice import one_line as _one_line, out_of_memory_message, resume_state
from dlrm.train.resume_room import check_resume_room

EXIT_BAD_INPUT = 2
EXIT_NON_FINITE_LOSS = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_INTERRUPTED = 130

# OSErrors that are the environment's fault, not the program's: reported in one line. EFBIG: a file larger than the
# file system takes (FAT32's 4 GiB, a 50 GB checkpoint) or `ulimit -f` allows (it was reported as a bug in dlrm).
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def cli_overrides(*, data, device, batch_size, epochs, max_steps, seed, run_name, tb_dir, checkpoint_every, split,
                  compile_, compile_mode, profile, kernels, baseline=None) -> dict:
    """Dotted config keys set on the command line (options left out are absent)."""
    overrides = {
        "data.path": data,
        "train.device": device,
        "data.batch_size": batch_size,
        "train.epochs": epochs,
        "train.max_steps": max_steps,
        "train.seed": seed,
        "log.run_name": run_name,
        "log.tb_dir": tb_dir,
        "checkpoint.every": checkpoint_every,
        "data.eval_split": split,
        "train.baseline": baseline,
    }
    if compile_mode is not None:
        if compile_ is False:
            raise ConfigError(f"--compile-mode {compile_mode} contradicts --no-compile")
        overrides["train.compile.enabled"] = True
        overrides["train.compile.mode"] = compile_mode
    elif compile_ is not None:
        overrides["train.compile.enabled"] = compile_
    if profile:
        overrides["profile.enabled"] = True
    if kernels is not None:
        overrides.update({f"kernels.{k}": kernels for k in ("embedding", "interaction", "mlp", "loss")})
    return {k: v for k, v in overrides.items() if v is not None}


def parse_allowed_changes(text: Optional[str]) -> list[str]:
    """The dotted config keys of `--allow-config-change a.b,c.d`, each checked to exist."""
    if text is None:
        return []
    keys = [k.strip() for k in text.split(",")]
    known = config_keys()
    for key in keys:
        if not key:
            raise ConfigError(f"--allow-config-change: empty key in {text!r} (comma-separated dotted keys, "
                              "e.g. data.batch_size,optim.dense.lr)")
        if key not in known:
            close = closest_config_key(key, known)
            hint = f" (did you mean {close}?)" if close else " (e.g. data.batch_size, optim.dense.lr)"
            raise ConfigError(f"--allow-config-change: {key!r} is not a config key{hint}")
    return keys


def check_export_path(path: str) -> Path:
    """Refuse, before any training, an --export path that could not (or must not) be written."""
    target = Path(path)
    if target.suffix != ".pt2":
        raise ConfigError(f"--export: {path} must end in .pt2 (torch.export's program format)")
    if os.path.lexists(target):
        raise ConfigError(f"--export: {path} already exists; remove it or choose another path")
    parent = target.parent
    if not parent.is_dir():
        state = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"--export: directory {parent} {state}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--export: directory {parent} is not writable")
    problem = export_name_problem(target)
    if problem:
        raise ConfigError(problem)
    check_export_place(target)  # not in a run's checkpoints/, a dataset or a sweep
    check_room("--export", str(parent), export_temp(target), shown=path)  # (its temporary: after the whole run)
    return target


def load_with_kernels_shortcut(config_path: str, overrides: dict, inert_keys: Optional[str] = None,
                               decided: tuple[str, ...] = ()) -> Config:
    """`load_config`, where ``--kernels triton`` (every component at once) leaves the interaction of a "cat" model to
    torch, said in the log: there is no Triton cat interaction, and an explicit ``kernels.interaction "triton"`` for
    one is refused (`dlrm.config_checks`), but the shortcut means "Triton wherever it has a kernel"."""
    shortcut = all(overrides.get(f"kernels.{k}") == "triton" for k in ("embedding", "interaction", "mlp", "loss"))
    try:
        return load_config(config_path, overrides, inert_keys, decided)
    except ConfigError as e:
        if not shortcut:
            raise
        error = e
    # another error: its own message
    cfg = load_config(config_path, {**overrides, "kernels.interaction": "torch"}, inert_keys, decided)
    if cfg.model.interaction != "cat":
        raise error
    logger.info('--kernels triton: model.interaction "cat" has no Triton kernel; kernels.interaction "torch"')
    return cfg


# Options that only act on training: a run that trains nothing (--eval-only, or --export of a --checkpoint) ignored
# them without a word (`--eval-only --profile` wrote no trace, `--eval-only --baseline` fitted none).
TRAINING_ONLY = {"profile.enabled": "--profile", "train.baseline": "--baseline",
                 "checkpoint.every": "--checkpoint-every", "train.epochs": "--epochs", "train.max_steps": "--max-steps",
                 "train.seed": "--seed"}  # an evaluation and an export draw nothing at random
# ... and the options naming the evaluated split and the run directory, which a bare export of a --checkpoint does not
# make either (`--checkpoint C --export M --split test` exported C, exit 0; with --eval-only they act); so is
# torch.compile, which compiles training and evaluation only (the export traces the eager model: `--compile-mode X`
# was ignored without a word), and --kernels triton (the export's model has the PyTorch kernels, `load_for_export`)
# --batch-size sets the evaluation's batches only (`--checkpoint C --export M --batch-size 8` exported C, exit 0: the
# program's batch dimension is dynamic); --tb-dir, like --run-name, places a run directory, which it does not make
EVALUATION_ONLY = {"data.eval_split": "--split", "log.run_name": "--run-name", "train.compile.mode": "--compile-mode",
                   "train.compile.enabled": "--compile", "kernels.embedding": "--kernels",
                   "data.batch_size": "--batch-size", "log.tb_dir": "--tb-dir"}
# ... of which these values say what a bare export does (the export has neither torch.compile nor Triton kernels)
EXPORT_ACCEPTS = {"train.compile.enabled": False, "kernels.embedding": "torch"}
# Options that --compare's variants set themselves (dlrm.train.compare.variant_config: each variant's kernels, and
# whether and in which mode it is compiled): `--compare eager,compiled --compile-mode max-autotune` trained the
# compiled variant in its own mode and the eager one eagerly, ignoring the option without a word.
SET_BY_VARIANTS = {"train.compile.mode": "--compile-mode", "train.compile.enabled": "--compile/--no-compile",
                   "kernels.embedding": "--kernels"}


def check_modes(*, eval_only: bool, compare: Optional[str], resume: Optional[str], export_path: Optional[str],
                checkpoint_path: Optional[str], allowed_changes: list[str], overrides: Optional[dict] = None) -> None:
    """Refuse option combinations whose one part would otherwise be silently ignored."""
    # An empty path (an unset shell variable: --export "$OUT") must not read as an option left out: --export ""
    # trained a whole run and exported nothing, --checkpoint "" --export M trained a new run instead.
    if export_path == "":
        raise ConfigError("--export: empty path (name the .pt2 file to write)")
    if checkpoint_path == "":
        raise ConfigError("--checkpoint: empty path (a .pt file or a run directory)")
    if compare is not None:
        for flag, given in (("--eval-only", eval_only), ("--resume", resume), ("--export", export_path)):
            if given:
                raise ConfigError(f"--compare cannot be combined with {flag}")
        ignored = [flag for key, flag in SET_BY_VARIANTS.items() if (overrides or {}).get(key) is not None]
        if ignored:
            raise ConfigError(f"{ignored[0]}: --compare's variants set the kernels and torch.compile themselves (each "
                              "variant's name says them); leave it out, or name the variants to compare")
    if eval_only and resume is not None:
        raise ConfigError("--eval-only cannot be combined with --resume (evaluate a --checkpoint instead)")
    if eval_only and not checkpoint_path:
        raise ConfigError("--eval-only: needs --checkpoint PATH")
    if checkpoint_path and not (eval_only or export_path):
        raise ConfigError("--checkpoint: only used with --eval-only or --export (to continue training use --resume)")
    if resume is not None and checkpoint_path:  # with --export: the checkpoint was exported, the resume never ran
        raise ConfigError("--resume cannot be combined with --checkpoint (--resume continues training from its own "
                          "checkpoint; export a --checkpoint in a run of its own)")
    if resume not in (None, "latest") and os.path.isdir(resume):
        # `--resume tb_logs/r1` (the run directory, as --checkpoint takes one) said "checkpoint not found" of a
        # directory that exists; --resume PATH is a checkpoint file, and a run is resumed by its name
        run_dir = Path(resume)
        if run_dir.name == "checkpoints" and not (run_dir / "checkpoints").is_dir():
            run_dir = run_dir.parent  # a run's checkpoints/ folder
        how = (f"resume the run by name (--tb-dir {run_dir.parent} --run-name {run_dir.name} --resume) or give one "
               "of its checkpoints/step-*.pt" if (run_dir / "checkpoints").is_dir()
               else "give a run's checkpoints/step-*.pt")
        raise ConfigError(f"--resume: {resume} is a directory, not a checkpoint file: {how}")
    if eval_only or (export_path and checkpoint_path):
        ignored = [flag for key, flag in TRAINING_ONLY.items()  # (by identity: --seed 0 is given, == False)
                   if (overrides or {}).get(key) is not None and (overrides or {}).get(key) is not False]
        if ignored:
            mode = "--eval-only" if eval_only else "--export of a --checkpoint"
            raise ConfigError(f"{ignored[0]}: acts only on training, and {mode} trains nothing (leave it out)")
    if export_path and checkpoint_path and not eval_only:
        # (--no-compile and --kernels torch say what the export does: accepted, as --no-baseline is by --eval-only;
        # those two only: any option of the value torch or false was, `--run-name torch` ignored without a word)
        given = overrides or {}
        ignored = [flag for key, flag in EVALUATION_ONLY.items()
                   if given.get(key) is not None and not (key in EXPORT_ACCEPTS and given[key] == EXPORT_ACCEPTS[key])]
        if ignored:
            raise ConfigError(f"{ignored[0]}: acts only on an evaluation or a training run, and --export of a "
                              "--checkpoint makes neither (leave it out, or add --eval-only)")
    if allowed_changes and resume is None:
        raise ConfigError("--allow-config-change: only applies with --resume")
    if world_size_from_env() > 1 and (eval_only or export_path):
        raise ConfigError("--eval-only and --export run in one process (not under torchrun): merge a sharded "
                          "checkpoint first with python -m dlrm.distributed.merge CHECKPOINT OUT")


def world_size_from_env() -> int:
    """The processes of this run, as torchrun's WORLD_SIZE says (1 without it)."""
    # read as dlrm.distributed.env._env_int reads it (that module imports torch): int(), empty = unset. Compared as
    # text, "01" (one process to init_distributed) got the torchrun refusal, and so did "abc", not an integer.
    text = os.environ.get("WORLD_SIZE", "")
    try:
        return int(text) if text.strip() else 1
    except ValueError:
        raise ConfigError(f"environment variable WORLD_SIZE={text!r} is not an integer (set by torchrun "
                          "--nproc-per-node N)") from None


def warn_distributed_in_one_process(cfg: Config) -> None:
    """Name the `distributed` keys a run of one process sets (all of them act under torchrun alone): a run that forgot
    torchrun trained one process without a word about them. Told, not refused: one file serves both launches."""
    changed = [f"{f.name} {json.dumps(getattr(cfg.distributed, f.name))}" for f in dataclasses.fields(cfg.distributed)
               if getattr(cfg.distributed, f.name) != f.default]
    if changed and world_size_from_env() <= 1:
        # (WORLD_SIZE 1: no torchrun, or torchrun of one process, which trains as one too)
        logger.warning(f"distributed: {', '.join(changed)} set, but this run is one process (they act under "
                       "torchrun --nproc-per-node N, N > 1): ignored")


def is_triton_unavailable(exc: BaseException) -> bool:
    """A Triton kernel was requested where Triton cannot run (kernels._backend, which imports
    torch, is consulted only when already loaded)."""
    backend = sys.modules.get("kernels._backend")
    return backend is not None and isinstance(exc, backend.TritonUnavailableError)


def _said_once_per_node(exc: BaseException):
    """The logger of bad input `exc`: under torchrun, one found before the ranks joined the process group (the
    config, the command line, the dataset's metadata) is found alike by every rank, and only each node's first rank
    (LOCAL_RANK 0: rank 0 on one machine) says it; `torchrun --nproc-per-node 2 train.py --config bad.json` printed
    it twice, once as `[rank 1] ...` (each rank still exits 2). Not a rank's own (`this_rank_only`: its RANK, GPU),
    and not one after the ranks met, which one rank may make alone (rank 0's on_main part, a file only it reads),
    unless made where every rank checks the same (`found_alike`: a --resume's config against its checkpoint's), or
    found so when the ranks compared what they met (`dlrm.distributed.env.agree_on_input_error`: a data error met
    mid-epoch)."""
    joined = "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_available() \
        and sys.modules["torch.distributed"].is_initialized()
    if getattr(exc, "this_rank_only", False) or (joined and not getattr(exc, "found_alike", False)):
        return logger
    # (every node's files are its own: the first rank of each says what it found; run_logger's filter, on the
    # other ranks only, leaves out a record bound with same_on_every_rank true)
    return logger.bind(same_on_every_rank=_node_other_rank())


class RanksCommand(OneLineUsageCommand):
    """click's command, whose usage errors (`--bogus`, `--batch-size x`) are one line (`OneLineUsageCommand`), which
    under torchrun only each machine's first rank prints (every rank exits 2 as click exits): every rank printed
    click's four lines (Usage, Try, Error)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not (standalone_mode and _node_other_rank()):
            return super().main(*args, standalone_mode=standalone_mode, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as e:  # (the first rank shows it: click's standalone handling)
            said_once.wait_until_rank_zero_said(e)  # (exiting at once, it got the first rank killed unheard)
            sys.exit(e.exit_code)
        except click.Abort:
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)  # (--help's click.Exit: its code; a run: main's sys.exit)


def report_failure(exc: BaseException, cfg: Optional[Config], resuming: Union[bool, str, None] = False) -> int:
    """Log `exc` as its one line (a bug: its traceback and a line saying so); return the exit code. A line said once
    for a torchrun run (rank 0's, each machine's first rank's) is out before any other rank returns: one that exited
    first got it killed by torchrun's agent (`dlrm.distributed.said_once`). `resuming`: a --resume (out of memory,
    it is not told to change what its checkpoint fixes): True, or the flag's value, which `resume_state` weighs."""
    code, said_once_for_all = _report(exc, cfg, resuming)
    if said_once_for_all:
        said_once.wait_until_rank_zero_said(exc, cfg.distributed.timeout_s if cfg is not None else None)
    return code


def _report(exc: BaseException, cfg: Optional[Config], resuming: Union[bool, str, None] = False) -> tuple[int, bool]:
    """`report_failure`'s line, its exit code, and whether the line was said once for every rank alike."""
    exc = as_limit_failure(exc)  # (under ulimit -v: a thread, library or file that could not be mapped, exit 4)
    if isinstance(exc, (ConfigError, DatasetError)) or is_triton_unavailable(exc):
        env = sys.modules.get("dlrm.distributed.env")  # (imported by a run that joined ranks: none on a config error)
        if env is None:
            _said_once_per_node(exc).error(_one_line(exc))
        else:  # met after the ranks joined: said once if every rank met it, else by each rank that did
            timeout = cfg.distributed.timeout_s if cfg is not None else None
            env.agree_on_input_error(exc, _one_line(exc), lambda line: _said_once_per_node(exc).error(line), timeout)
        # (said once: before the ranks met, unless a rank's own; after, only when found alike)
        joined = env is not None and env._joined()
        return EXIT_BAD_INPUT, not getattr(exc, "this_rank_only", False) and (
            not joined or getattr(exc, "found_alike", False))
    if isinstance(exc, NonFiniteLoss):
        # the ranks of a torchrun run agree on it (reduced checks): rank 0's line says it for all (rank 1's copy was
        # glued to rank 0's progress bar)
        run_logger.error(_one_line(exc))
        return EXIT_NON_FINITE_LOSS, True
    if isinstance(exc, TrainingStopped):
        # agreed by the ranks of a torchrun run: rank 0's line says it for all (rank 1 repeated it as `[rank 1] ...`);
        # a stop of one rank alone (`StopAtOnce`, a failure another rank reported) is that rank's to say
        # (before the ranks met, under torchrun's agent: one every rank got, said by each machine's first rank)
        alike = not exc.agreed and said_once.signal_reaches_every_rank(exc)
        (run_logger if exc.agreed else _said_once_per_node(exc) if alike else logger).warning(_one_line(exc))
        return exc.exit_code, exc.agreed
    if isinstance(exc, KeyboardInterrupt):  # (a Ctrl-C to torchrun reaches every rank: said once, as SIGTERM)
        (_said_once_per_node(exc) if said_once.signal_reaches_every_rank(exc) else logger).error("interrupted (Ctrl-C)")
        return EXIT_INTERRUPTED, False
    if is_out_of_memory(exc):
        if isinstance(resuming, str) or resuming is None:  # the --resume flag's value: what the next one meets
            resuming = resume_state(resuming, cfg)
        # a refusal every rank of a torchrun run makes from the same numbers (`refuse_host_memory_shortfall`): once
        if getattr(exc, "found_alike", False):
            _said_once_per_node(exc).error(out_of_memory_message(exc, cfg, resuming))
            return EXIT_OUT_OF_MEMORY, True
        logger.error(out_of_memory_message(exc, cfg, resuming))
        return EXIT_OUT_OF_MEMORY, False
    if isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
        where = f"{exc.filename}: " if exc.filename else ""
        logger.error(f"file system error: {where}{exc.strerror}")
        return EXIT_BAD_INPUT, False
    if is_peer_lost(exc):  # another rank died: not a bug of this rank's (it printed gloo's traceback, exit 1)
        logger.error(peer_lost_message(exc))
        return EXIT_PEER_LOST, False
    return report_bug(exc), False


def run(*, config_path: str, overrides: dict, eval_only: bool, compare: Optional[str], resume: Optional[str],
        checkpoint_path: Optional[str], export_path: Optional[str], allowed_changes: list[str],
        loaded: list, late: Optional[LateSignals] = None) -> None:
    """Load the config, check the export target, then train, compare, evaluate or export.

    `loaded` receives the Config once it is valid (for the out-of-memory message); `late` begins as a run that
    exports nothing writes its summary.json (its last output).
    """
    trains = not (eval_only or (export_path and checkpoint_path))
    # a key that cannot act is refused for a run that trains; a --resume continues a run that began with this config
    # (told only: refused, it would be stranded), and an evaluation or export of a --checkpoint trains nothing, so
    # the training keys (optimizers, schedule, compile, profile) cannot act there whatever their values
    inert_keys = ("warn" if resume is not None else "refuse") if trains else None
    # --compare's variants compile or not themselves: the file's compile settings act in its compiled variants (they
    # were told "ignored"), or are replaced, which `dlrm.train.compare.run_comparison` says
    decided = ("train.compile.enabled",) if compare is not None else ()
    # paths no file can have (a 300-byte name, ENAMETOOLONG): an OSError of the first check that looked, "a bug"
    for flag, path in (("--resume", resume if resume != "latest" else None), ("--checkpoint", checkpoint_path),
                       ("--export", export_path)):
        check_path(flag, path, under_file=True)  # (afile/x.pt: "checkpoint not found", no flag named)
    cfg = load_with_kernels_shortcut(config_path, overrides, inert_keys, decided)
    loaded.append(cfg)
    tb_flag = "--tb-dir" if "log.tb_dir" in overrides else f"{config_path}: log.tb_dir"
    check_path("--data" if "data.path" in overrides else f"{config_path}: data.path", cfg.data.path, under_file=True)
    check_path(tb_flag, cfg.log.tb_dir)
    # `--resume --run-name NEW` of a run that does not exist starts it from step 0 (`restart_config`): a new run
    new_by_name = resume == "latest" and bool(cfg.log.run_name) and not os.path.lexists(
        Path(cfg.log.tb_dir) / cfg.log.run_name)
    if resume is None and cfg.log.sweep_keys is not None:
        # a sweep trial's config.json given again is a run of its own: kept, its HParams session named the sweep's
        # swept keys and sweep/* metrics (`dlrm.train.reporting.experiment_metrics`), blank columns for every other
        # run of a --logdir whose columns TensorBoard took from it (a --resume of the trial stays the sweep's)
        logger.info(f"{config_path}: log.sweep_keys (a sweep's, on its trials) dropped: this run is one of its own")
        cfg.log.sweep_keys = None
    if trains:
        warn_distributed_in_one_process(cfg)
    if (resume is None or new_by_name) and (eval_only or not (export_path and checkpoint_path)):
        check_outside_sweep(config_path, cfg)  # (before the own-record refusal: its free name was in the sweep too)
    branch = resume not in (None, "latest") and cfg.log.run_name is not None
    if branch:  # (a resume in place continues the run where it is: a sweep's trial too)
        check_branch_outside_sweep(resume, cfg)
    if (resume is None or branch or new_by_name) and (eval_only or not (export_path and checkpoint_path)):
        # a new directory under log.tb_dir: not in another run's directory nor in the dataset (the sweep's is above)
        check_tb_dir(cfg.log.tb_dir, tb_flag, (cfg.data.path,))
    elif resume == "latest":  # (an existing run by name under log.tb_dir: it is where it is)
        check_tb_dir(cfg.log.tb_dir, tb_flag, owners=False)
    # a new run's directory is named, or --eval-only's (with --export too: it evaluates first), or a branch's not there
    # yet; a bare export of a --checkpoint writes none. Before the own-record refusal, whose free name it would refuse
    if (resume is None or ((branch or new_by_name) and not os.path.lexists(Path(cfg.log.tb_dir) / cfg.log.run_name))
            ) and (eval_only or not (export_path and checkpoint_path)):
        try:
            check_default_run_name(cfg)
        except ConfigError as e:
            given = cfg.log.run_name is not None and "log.run_name" in overrides
            raise ConfigError(f"{'command line' if given else config_path}: {e}") from None
        check_room(tb_flag, cfg.log.tb_dir, run_deepest(cfg.log.run_name, cfg.name, eval_only, compare))  # (not mid-run)
    check_resume_room(resume, cfg.log.tb_dir, cfg.log.run_name)  # a resume in place: its run directory, where it is
    if resume is None and compare is None and (eval_only or not export_path or not checkpoint_path):
        check_not_own_record(config_path, cfg, overrides, eval_only)
    export = check_export_path(export_path) if export_path else None
    # imported late: --help and config errors stay fast
    from dlrm.train import export as export_mod
    from dlrm.train.checkpointer import checkpoint_for
    from dlrm.train.trainer import train
    from dlrm.train.setup import dataset_held

    with dataset_held(cfg):  # the dataset held for reading: a tool's --overwrite never replaces it under this run
        if eval_only or (export and checkpoint_path):
            given = Path(checkpoint_path)
            # a run's checkpoints/ folder means its run (it was refused as "a directory without checkpoints/best.pt or
            # step-*.pt" while holding both); a run directory means its best.pt, else its newest checkpoint
            if given.is_dir() and given.name == "checkpoints" and not (given / "checkpoints").is_dir():
                given = given.parent
            checkpoint = checkpoint_for(given)
            if eval_only:
                export_mod.evaluate_checkpoint(cfg, checkpoint, cfg.data.eval_split)
            if export:
                export_mod.export_checkpoint(cfg, checkpoint, export)
        elif compare is not None:
            from dlrm.train.compare import parse_variants, run_comparison

            written = None if late is None else (  # (a signal from the reports' write on: said, exit 0)
                lambda base: late.begin(f"the comparison finished (its reports written in {base})"))
            run_comparison(cfg, parse_variants(compare), train, results_written=written)
        else:
            written = None if export or late is None else (  # (with --export: once it is written, `main`)
                lambda run_dir: late.begin(f"the run finished ({run_dir / 'summary.json'} written)"))
            summary = train(cfg, resume=resume, allow_config_change=allowed_changes, results_written=written)
            if export:  # the best evaluation's model when the run kept one, else the final one
                export_mod.export_trained(cfg, Path(_best_checkpoint(summary) or summary["checkpoint"]), export, summary)


def check_not_own_record(config_path: str, cfg: Config, overrides: dict, eval_only: bool) -> None:
    """Refuse a new run (or --eval-only) whose --config is an existing run's own config.json, whose log.run_name names
    that run, naming a --run-name that is free: refused by that run's directory, the user was told "pick another
    --run-name (or --resume it)", to --resume an evaluation, and not why the name was taken."""
    name = cfg.log.run_name
    if name is None or "log.run_name" in overrides:
        return
    run_dir = Path(cfg.log.tb_dir) / name
    try:
        own = Path(config_path).resolve() == (run_dir / "config.json").resolve()
    except (OSError, RuntimeError):  # (a link loop: the run directory's own check names it)
        return
    if not own:
        return
    free = free_run_name(run_dir)
    if eval_only:
        raise ConfigError(f"{config_path} is the config.json of run {name!r} itself: its log.run_name names that "
                          f"run's directory, and --eval-only writes a directory of its own: add --run-name {free} (free)")
    raise ConfigError(f"{config_path} is the config.json of run {name!r} itself: its log.run_name names that run, "
                      f"which a new run never overwrites: add --run-name {free} (free) to train a new run with this "
                      "config, or --resume to continue that run")


def _best_checkpoint(summary: dict) -> Optional[str]:
    """The summary's best checkpoint, as a path from this working directory. A finished run's summary (a --resume of
    a run at its end) is its summary.json, which records it as the run saw it: relative to the working directory it
    trained in, or absolute where the run was then. From another working directory, or for a run moved since (with a
    new run of its name at its old place), that named another run's best.pt (exported silently) or none: a checkpoint
    of this run's (``<run name>/checkpoints/<file>``, or any ``checkpoints/<file>`` this run's directory holds now) is
    taken from its run directory as it is now."""
    best = summary.get("best_checkpoint")
    if not best or not summary.get("finished") or not summary.get("run_dir"):
        return best
    recorded, run_dir = Path(best), Path(summary["run_dir"])
    own = run_dir / "checkpoints" / recorded.name
    if recorded.parent.name == "checkpoints" and (own.exists() or (not recorded.is_absolute()
                                                                   and recorded.parent.parent.name == run_dir.name)):
        return str(own)
    return best


@click.command(cls=RanksCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", required=True, type=NonEmptyPath("the JSON config file", dir_okay=False),
              help="JSON config file.")
@click.option("--data", type=str, help="Dataset directory (overrides data.path).")
@click.option("--device", type=str, help="auto | cpu | cuda (overrides train.device).")
@click.option("--batch-size", type=int, help="Overrides data.batch_size.")
@click.option("--epochs", type=int, help="Overrides train.epochs.")
@click.option("--max-steps", type=int, help="Overrides train.max_steps.")
@click.option("--seed", type=int, help="Overrides train.seed (0 <= seed < 2**63).")
@click.option("--run-name", type=str, help="Run directory name under the TensorBoard root (overrides log.run_name).")
@click.option("--tb-dir", type=str, help="TensorBoard root directory (overrides log.tb_dir).")
@click.option("--kernels", type=str, help="torch | triton: every component at once (overrides kernels.*).")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile on or off (overrides train.compile).")
@click.option("--compile-mode", default=None,
              type=click.Choice(["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
                                 "max-autotune-gemm"]),
              help="Compile with this torch.compile mode (reduce-overhead, max-autotune: CUDA graphs); implies --compile.")
@click.option("--profile", is_flag=True, default=None, help="Profile a few steps into TensorBoard (overrides profile.enabled).")
@click.option("--baseline/--no-baseline", default=None,
              help="Also fit a logistic regression on the same split and hashing and report it next to the DLRM "
                   "(overrides train.baseline; default \"auto\": small train splits, see dlrm.train.baseline).")
@click.option("--compare", type=str, help="Comma-separated variants to train side by side (dlrm.train.compare."
              "VARIANTS): eager, auto (what the defaults pick), compiled, compiled+step-graph, triton+compiled, "
              "triton-embedding+cudagraphs, triton-embedding-interaction+step-graph, triton-fused-mlp+step-graph, ... "
              "(a wrong name lists them all).")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints (overrides checkpoint.every).")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Continue the run named by --run-name from its latest checkpoint (one with none yet starts from "
                   "step 0), or from PATH.")
@click.option("--allow-config-change", "allow_config_change", type=str, default=None, metavar="KEYS",
              help="With --resume: comma-separated dotted config keys (e.g. data.batch_size,optim.dense.lr; a "
                   "section such as optim.dense stands for all its keys) in which the resumed run may differ from "
                   "its checkpoint's config (otherwise any change that alters the training trajectory is refused).")
@click.option("--eval-only", is_flag=True, help="Only evaluate --checkpoint on --split.")
@click.option("--checkpoint", "checkpoint_path", type=str,
              help="Checkpoint for --eval-only or --export: a .pt file, or a run directory or its checkpoints/ "
                   "folder (its best.pt, else its newest checkpoint).")
@click.option("--split", type=click.Choice(["validation", "test"]), default=None, help="The split evaluated: by --eval-only, and during training (data.eval_split: best.pt and early stopping follow it).")
@click.option("--export", "export_path", type=str,
              help="Write a torch.export inference program (raw inputs, hashing included) to this new .pt2 file: "
                   "from --checkpoint, or after training from the run's best.pt (its best evaluation's model; "
                   "the last checkpoint where it kept none) (the path is checked first).")
def main(config_path, data, device, batch_size, epochs, max_steps, seed, run_name, tb_dir, kernels, compile_,
         compile_mode, profile, baseline, compare, checkpoint_every, resume, allow_config_change, eval_only, checkpoint_path,
         split, export_path) -> None:
    """Train a DLRM on a Criteo-format parquet dataset (exit codes: see `dlrm.cli`'s docstring)."""
    configure_logging(ranks=True)
    loaded: list = []
    code = 0
    late = said_once.late_signals()  # a SIGINT/SIGTERM once the results are written: said (once a run), exit 0
    if LateSignals.until_exit:  # (train.py) registered before the trainer imports torch: the last exit function
        atexit.register(late.at_exit)
    try:
        overrides = cli_overrides(data=data, device=device, batch_size=batch_size, epochs=epochs, max_steps=max_steps,
                                  seed=seed, run_name=run_name, tb_dir=tb_dir, checkpoint_every=checkpoint_every,
                                  split=split, compile_=compile_, compile_mode=compile_mode, profile=profile,
                                  kernels=kernels, baseline=baseline)
        allowed_changes = parse_allowed_changes(allow_config_change)
        check_modes(eval_only=eval_only, compare=compare, resume=resume, export_path=export_path,
                    checkpoint_path=checkpoint_path, allowed_changes=allowed_changes, overrides=overrides)
        # SIGTERM raises where it arrives (its default action killed the process before any cleanup: an --eval-only
        # run directory kept, an export's temporary file left beside OUT); the training steps stop gracefully
        with StopAtOnce():
            run(config_path=config_path, overrides=overrides, eval_only=eval_only, compare=compare, resume=resume,
                checkpoint_path=checkpoint_path, export_path=export_path, allowed_changes=allowed_changes,
                loaded=loaded, late=late)
            late.begin("the command finished (its results written)")  # (begun already by a run's summary)
    except (Exception, KeyboardInterrupt) as e:  # SystemExit passes: it already carries its code
        known = isinstance(e, (ConfigError, DatasetError, NonFiniteLoss, TrainingStopped, KeyboardInterrupt))
        code = report_failure(e if known else signal_stop_inside(e) or e, loaded[0] if loaded else None, resume)
    finally:
        # Leave a torchrun process group, if this run joined one (without importing torch on the
        # config-error path, which stays fast).
        if "dlrm.distributed.env" in sys.modules:
            sys.modules["dlrm.distributed.env"].shutdown()
    if not code:
        late.say()
    if code or not LateSignals.until_exit:  # (main called by other code, which goes on: its own handlers back)
        late.end()
    if code:
        sys.exit(code)

