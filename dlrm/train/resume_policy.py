"""Which config changes a resumed run may make, and the check that refuses the others.

A resumed run must continue the trajectory its checkpoint started. Keys that only change how the
run is observed or executed (logging, checkpoint cadence, profiling, kernel and compile choices,
data placement and prefetch, device; the evaluations' cadence and split unless the run stops early) are
free; the run's length (``train.epochs``, ``train.max_steps``, ``train.min_steps``) may change and is logged, unless
it moves the end of a learning-rate decay the steps already trained followed (`check_schedule_length`); every other
difference (batch size, model, data, optimizer, schedule, seed, ...) is refused unless
``--allow-config-change`` names its key. Also the checkpoint a ``--resume`` names, its saved config, and whether its
run already ended (moved here from `dlrm.train.trainer`, which stays under the modules' 600 lines).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional

from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import Config, ConfigError, config_from_dict
from dlrm.distributed.env import DistEnv
from dlrm.json_file import SUMMARY_LIMIT, read_json
from dlrm.logging_setup import run_logger
from dlrm.train.checkpointer import BEST_NAME, checkpoint_step
from dlrm.train.optim import lr_multiplier
from dlrm.train.run_dir import (BRANCH_NAME, LOCK_NAME, _same_file, branch_start, restart_leftovers, restart_refusal,
                                run_of)
from dlrm.train.train_data import epoch_steps, run_length

# dotted prefixes: a key equal to one or under it is free
FREE_KEYS = (
    "log", "checkpoint", "profile", "kernels", "name",
    "train.log_every", "train.compile", "train.cuda_graph", "train.device", "train.baseline", "train.allow_swap",
    "train.check_host_memory", "data.prefetch", "data.placement", "data.gpu_memory_share", "data.eval_batch_size",
    "distributed",  # the sharding plan is checked against the checkpoint's where it matters
)
# Free too, unless the run stops early: train.early_stopping counts evaluations (every train.eval_every steps) of a
# metric on a split (data.eval_split), so they decide where it stops, and are refused as a trajectory key is. (Another
# eval_split also makes the recorded best another split's: the trainer starts the best afresh.)
EVAL_KEYS = ("train.eval_every", "data.eval_split")
LENGTH_KEYS = ("train.epochs", "train.max_steps", "train.min_steps")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


# A run takes these from its dataset and records those (`dlrm.train.setup.as_trained`); the checkpoint's own sizes are
# compared with the data's at the restore (`dlrm.checkpoint.check_compatible`). Compared here, a run or sweep trial
# recorded with the config file's (null, or configs/kaggle.json's published sizes) was refused for sizes none trained.
DATASET_KEYS = ("model.cardinalities", "model.multi_hot_sizes")


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, checkpoint value, this run's value) for every leaf that differs; ``data.path`` given another way
    (relative against absolute, through a symlink) to the same directory does not differ, nor do `DATASET_KEYS`."""
    a, b = _flatten(saved), _flatten(current)
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing) and not (k == "data.path" and _same_dir(a.get(k), b.get(k)))
            and k not in DATASET_KEYS]


def _same_dir(old: Any, new: Any) -> bool:
    try:
        return isinstance(old, str) and isinstance(new, str) and os.path.samefile(old, new)
    except OSError:  # either one is gone: compare them as written
        return False


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], allowed: Iterable[str], source: str,
                        whose: str = "the checkpoint's", loads_checkpoint: bool = True) -> None:
    """Raise a one-line ConfigError listing the trajectory-changing keys not in `allowed`.

    Args:
        saved: the checkpoint's config (as ``Config.to_dict()``).
        current: this run's resolved config.
        allowed: dotted keys (or prefixes) from ``--allow-config-change``.
        source: the checkpoint path, for the messages.
        loads_checkpoint: whether the resume then loads a checkpoint of `saved`'s model, which fixes the model keys
            `ckpt.fixed_model_keys` names; False for a run restarted from step 0 (`restart_config`), which loads
            none: every key is the flag's there.
    """
    allowed = tuple(allowed)
    early = any((c.get("train") or {}).get("early_stopping") for c in (saved, current))
    refused, free = [], []
    for key, old, new in config_changes(saved, current):
        shown = f"{key}: {_show(old)} -> {_show(new)}"
        if _under(key, FREE_KEYS) or (_under(key, EVAL_KEYS) and not early):
            free.append((key, old, new, shown))
            continue
        if _under(key, EVAL_KEYS):
            shown += " (train.early_stopping counts its evaluations)"
        if _under(key, LENGTH_KEYS):
            logger.info(f"--resume: run length changed, {shown}")
        elif _under(key, allowed):
            run_logger.warning(f"--resume: config change allowed by --allow-config-change, {shown}")
        else:
            refused.append((key, shown))
    _say_free_changes(free)
    if refused:
        # the model keys the checkpoint's tensors fix: --allow-config-change lets them through here, and the checkpoint
        # then fails to load into the other model (`ckpt.check_compatible`); advised for them, it cost a second try.
        # None without a checkpoint to load (a restart from step 0: "fixed by the checkpoint" named one that does not
        # exist and left out the flag that restarts it), nor for a saved `model` that is no mapping (a damaged
        # config.json, refused as any other difference; `.get` on it was an AttributeError, exit 1 as a bug)
        saved_model = saved.get("model")
        fixed = ({f"model.{k}" for k in ckpt.fixed_model_keys(saved_model)}
                 if loads_checkpoint and isinstance(saved_model, dict) else set())
        keys = ",".join(k for k, _ in refused if k not in fixed)
        fixed_keys = [k for k, _ in refused if k in fixed]
        raise ConfigError(f"--resume {source}: the config differs from {whose} in what changes training "
                          f"({'; '.join(s for _, s in refused[:4])}{'; ...' if len(refused) > 4 else ''}); "
                          f"resume with {whose} values" + (f", or pass --allow-config-change {keys}" if keys else "")
                          + (f" ({', '.join(fixed_keys)}: fixed by the checkpoint, whose model loads only into its own "
                             "architecture; another one is a new run, without --resume)" if fixed_keys else ""))


def _say_free_changes(free: list[tuple[str, Any, Any, str]]) -> None:
    """Say the settings a resumed session takes from its own command line where they differ from the run's (they were
    taken without a word): a resume without the first command line's ``--checkpoint-every`` checkpointed only at a
    signal and at its end, and a crash lost every step since the resume, unsaid."""
    if not free:
        return
    # (run_logger: every torchrun rank checks the same configs; rank 1 repeated the warning as `[rank 1] ...`)
    run_logger.info("--resume: this session's own settings differ from the run's: " + "; ".join(s for *_, s in free))
    for key, old, new, _ in free:
        if key == "checkpoint.every" and isinstance(old, int) and old > 0 and not (isinstance(new, int) and new <= old):
            run_logger.warning(f"--resume: checkpoint.every {_show(old)} -> {_show(new)}: this session checkpoints "
                           f"{'only at a signal and at its end' if not new else 'less often'}; give "
                           f"--checkpoint-every {old} again to keep the run's cadence")


def _show(value: Any) -> str:
    text = repr(value) if value is not None else "null"
    if text.startswith("<object"):
        return "(absent)"
    if len(text) <= 40:
        return text
    # a path's end tells two paths apart (data.path: the same temporary or home directory in front)
    return "..." + text[-37:] if isinstance(value, str) and "/" in value else text[:37] + "..."


def check_dataset_unchanged(saved: dict[str, Any], state: dict[str, Any], stamps: Optional[dict[str, str]],
                            data_dir: str, allowed: Iterable[str], source: str) -> None:
    """Refuse a resume whose dataset's files changed since the checkpoint was written (their stamps, which it records,
    differ from `stamps`, this run's: `dlrm.data.dataset_stamps`), unless ``--allow-config-change data.path``; allowed,
    warn. The checkpoint's data was compared only by its table sizes, multi-hot sizes, dense format and vocabularies:
    a dataset regenerated in place, a parquet file rewritten or truncated resumed at once, and the run's later steps
    trained on other rows than its earlier ones, without a word.

    Args:
        saved: the checkpoint's config (`saved_config`): under another data.path (which `check_resume_config` let
            through only under --allow-config-change) the data is another by design, and not compared.
        state: the checkpoint (a sharded one's manifest); stamps: this run's data's, None: not known (not compared).
        data_dir: this run's data.path; allowed, source: ``--allow-config-change``'s keys, the checkpoint (messages).
    """
    from dlrm.data.dataset_stamps import stamp_change

    old = (saved.get("data") or {}).get("path") if isinstance(saved.get("data"), dict) else None
    if stamps is None or not (old == data_dir or _same_dir(old, data_dir)):
        return
    recorded = state.get("dataset_stamps")
    if recorded is None:  # (written before 2026-12-04)
        run_logger.warning(f"--resume {source}: the checkpoint records no stamps of its data's files (written by an "
                           f"earlier version): a change to {data_dir}'s files since that kept its table sizes is not "
                           "checked")
        return
    change = stamp_change(recorded, stamps)
    if change is None:
        return
    if _under("data.path", tuple(allowed)):
        run_logger.warning(f"--resume {source}: the dataset {data_dir} changed since the checkpoint was written: "
                           f"{change}; resuming on it as it is (allowed by --allow-config-change data.path)")
        return
    raise ConfigError(f"--resume {source}: the dataset {data_dir} is not the one the checkpoint was trained on: "
                      f"since it was written, {change}; the resumed steps would train on other data than the steps "
                      "before; put that dataset back, or pass --allow-config-change data.path to resume on it as it is")


def checkpoint_rows(saved: dict[str, Any], state: dict[str, Any], stamps: Optional[dict[str, str]], data_dir: str,
                    rows: int) -> Optional[int]:
    """The train split's rows whose epochs the checkpoint `state` counted (its run's steps an epoch: the end of a decay
    to the run's end, `check_schedule_length`): its ``train_rows``; one that records none (an earlier version's),
    this run's `rows` where its data is this run's (the same data.path, `saved`'s, and its files' `stamps` as recorded,
    or not recorded); None: unknown (another data.path, or its files changed since).

    This run's rows were taken for the checkpoint's under another data.path, or on data changed in place (both allowed
    by ``--allow-config-change data.path``): 100 train rows regenerated as 200 moved a decay's end from step 36 to 75
    and raised the learning rate at the resume step unsaid (the two runs' lengths were both counted as 75)."""
    if type(state.get("train_rows")) is int:
        return state["train_rows"]
    old = (saved.get("data") or {}).get("path") if isinstance(saved.get("data"), dict) else None
    if not (old == data_dir or _same_dir(old, data_dir)):
        return None
    from dlrm.data.dataset_stamps import stamp_change

    recorded = state.get("dataset_stamps")
    return None if stamps is not None and recorded is not None and stamp_change(recorded, stamps) else rows


def check_schedule_length(saved: dict[str, Any], cfg: Config, step: int, steps_per_epoch: int, total: int, rows: int,
                          allowed: Iterable[str], source: str, world_size: int = 1,
                          saved_rows: Optional[int] = None) -> None:
    """Refuse a run length changed on resume (`LENGTH_KEYS`, or the steps an epoch: `BATCH_KEYS`, the data's rows) that
    moves the end of a learning-rate decay running to the run's end (``optim.schedule.decay_steps`` 0), unless
    ``--allow-config-change`` names every key that moved it; allowed, warn, naming both ends: the run decays to its
    own end, this run's, as ``decay_steps`` 0 asks (the checkpoint's is kept with ``decay_steps`` set, as the refusal
    says).

    The decay of the steps already trained (before `step`) ran towards the checkpoint's run's end; under the new
    length it would have run towards another, so the resumed run is neither run, and its learning rate jumps at `step`
    (up, for a longer run: it was said only as "run length changed"). Both ends are in steps, as the schedule (whose
    position the checkpoint holds) counts: the checkpoint's run's length is its own epochs of its own batch size and
    drop_last over its train split's `saved_rows` (a run of ``train.epochs`` resumed at another ``data.batch_size``, or
    on another dataset, moves the end without a length key changing). Nothing is said where the trained steps'
    learning rates are the same under both lengths (no decay, ``decay_steps`` set, a decay starting at `step` or
    later): the resumed run is then the uninterrupted run of the new length, as for a run without a schedule; nor where
    the new length trains no step (`step` at its end or beyond).

    Args:
        saved: the checkpoint's config (`saved_config`); cfg: this run's.
        step: the checkpoint's step; steps_per_epoch, total, rows: this run's epoch and run length (`TrainData`) and
            its train split's rows; world_size: the ranks the checkpoint's epochs were counted in (an epoch's last
            batch needs a row for each: `dlrm.checkpoint.trained_world_size`, else this run's).
        allowed: ``--allow-config-change``'s keys; source: the checkpoint, for the messages.
        saved_rows: the train rows the checkpoint's epochs counted (`checkpoint_rows`); None: unknown, said.
    """
    schedule = cfg.optim.schedule
    train, data = saved.get("train"), saved.get("data")
    if schedule.decay == "none" or schedule.decay_steps or not isinstance(train, dict) or not isinstance(data, dict):
        return
    changes = config_changes(saved, cfg.to_dict())
    # The first trained step whose multiplier depends on the run's length: later ones differ only if it does (the
    # decay's fraction min(d / span, 1) differs between two spans for d from 1 up to the longer span)
    first = max(schedule.decay_start_step + 1, schedule.warmup_steps)
    if first >= step or step >= total:
        return
    moved = any(k == "data.path" for k, _, _ in changes)
    if saved_rows is None:
        # Its rows unrecorded (an earlier version's checkpoint) and its data not this run's, so its run's length in
        # steps (its epochs of its data's batches) is not known here. A length key changed too still needs its flag:
        # said only, it passed a length change no flag allowed (it was refused)
        lengths = [(k, old, new) for k, old, new in changes if _under(k, LENGTH_KEYS)]
        missing = [k for k, _, _ in lengths if not _under(k, tuple(allowed))]
        where = "under another data.path" if moved else "on data.path, its files changed since"
        unknown = (f"the checkpoint's run length in steps is unknown {where} (its train.epochs counted its own "
                   "data's batches, whose rows it does not record: written by an earlier version), "
                   f"so whether the end of the {schedule.decay} decay "
                   f"(optim.schedule.decay_steps 0: to the run's end) moved is not known: this run's decay ends at "
                   f"step {_decay_end(schedule, total)}, and the learning rate at the resume step {step} is "
                   f"{lr_multiplier(step, schedule, total):.4g} times the configured one")
        if missing:
            shown = "; ".join(f"{k} {_show(old)} -> {_show(new)}" for k, old, new in lengths)
            raise ConfigError(f"--resume {source}: {shown} changes the run's length, and {unknown}; pass "
                              f"--allow-config-change {','.join(missing)} to resume so, or keep the checkpoint's decay "
                              f"with its length in "
                              "\"decay_steps\" in optim.schedule and --allow-config-change optim.schedule.decay_steps")
        run_logger.warning(f"--resume: {unknown}")
        return
    try:
        own_epoch = epoch_steps(saved_rows, int(data.get("batch_size")), bool(data.get("drop_last")), world_size)
        before = run_length(int(train.get("epochs", 1)), train.get("max_steps"), train.get("min_steps"), own_epoch)
    except (TypeError, ValueError, ZeroDivisionError):  # a damaged config.json: refused as any other's differences
        return
    if before == total or lr_multiplier(first, schedule, before) == lr_multiplier(first, schedule, total):
        return
    # what moved the end: a length key, or a batch key that changed the steps an epoch (of a run its epochs end); the
    # train rows are data.path's: changed with it, or, its files changed in place (allowed as data.path), named so
    epoch_moved = own_epoch != steps_per_epoch
    changed = [(k, f"{k} {_show(old)} -> {_show(new)}") for k, old, new in changes
               if _under(k, LENGTH_KEYS) or (_under(k, BATCH_KEYS) and epoch_moved)]
    if epoch_moved and saved_rows != rows and not moved:
        changed.append(("data.path", "data.path's files changed since the checkpoint"))
    if not changed:  # (the same length keys and steps an epoch give the same length: a guard, not a case)
        return
    was, now = lr_multiplier(step, schedule, before), lr_multiplier(step, schedule, total)
    # the steps an epoch (and the rows, where they changed) right after the batch keys that changed them (after a
    # length key listed last, they read as that key's: "data.batch_size 8 -> 16; train.epochs 3 -> 4 (12 -> 6 steps
    # an epoch)")
    shown = [text for _, text in changed]
    batch = [i for i, (k, _) in enumerate(changed) if _under(k, BATCH_KEYS)]
    if batch:
        counts = f"{saved_rows} -> {rows} train rows: " if saved_rows != rows else ""
        shown[batch[-1]] += f" ({counts}{own_epoch} -> {steps_per_epoch} steps an epoch)"
    what = (f"{'; '.join(shown)} moves the end of "
            f"the {schedule.decay} decay (optim.schedule.decay_steps 0: to the run's end) from step "
            f"{_decay_end(schedule, before)} to step {_decay_end(schedule, total)}")
    jump = (f"the learning rate at the resume step {step} goes from {was:.4g} to {now:.4g} times the configured one "
            f"(optim.dense {cfg.optim.dense.lr * was:.4g} -> {cfg.optim.dense.lr * now:.4g}, optim.sparse "
            f"{cfg.optim.sparse.lr * was:.4g} -> {cfg.optim.sparse.lr * now:.4g})")
    # every key that moved it: a batch key is allowed already (`check_resume_config` refused it otherwise, and
    # `check_dataset_unchanged` changed files), and letting it stand for an unnamed length key passed a length change
    # no flag allowed
    missing = [k for k, _ in changed if not _under(k, tuple(allowed))]
    span = _decay_end(schedule, before) - schedule.decay_start_step
    if not missing:  # (the checkpoint's end is a choice too: a decay planned for the run's data, kept on other data)
        run_logger.warning(f"--resume: {what} (allowed by --allow-config-change): {jump}; the checkpoint's end is kept "
                           f"with \"decay_steps\": {span} in optim.schedule and --allow-config-change "
                           "optim.schedule.decay_steps")
        return
    raise ConfigError(f"--resume {source}: {what}, which changes the learning rate of the steps already trained: "
                      f"{jump.replace('goes', 'would go')}; pass --allow-config-change {','.join(missing)} to resume "
                      f"so, or keep the checkpoint's decay (then the end factor) with \"decay_steps\": {span} in "
                      "optim.schedule and --allow-config-change optim.schedule.decay_steps")


def _decay_end(schedule: Any, total: int) -> int:
    """The step where `schedule`'s decay to the run's end reaches its end factor, in a run of `total` steps."""
    return schedule.decay_start_step + max(total - schedule.decay_start_step, 1)


# What a batch index counts: allowed to change, a checkpoint's position counts other batches (then not checked)
BATCH_KEYS = ("data.batch_size", "data.drop_last", "data.path")


def check_position(position: dict[str, int], batches: int, allowed: Iterable[str], source: str) -> None:
    """Refuse a checkpoint whose loader position this run's data cannot hold: its epoch's next batch beyond the
    `batches` of an epoch, or an epoch and batch that do not add up to its step. Resumed, the loader skipped the rest
    of the epoch (or every epoch: the run ended at once, "done") and trained on other batches than the run it continues.

    Negative values are the schema's (`dlrm.checkpoint_schema`)."""
    if any(_under(key, tuple(allowed)) for key in BATCH_KEYS):
        return
    step, epoch, batch = position["step"], position["epoch"], position["batch"]
    if batch > batches:
        raise ConfigError(f"--resume {source}: position.batch {batch} is beyond the {batches} batches of an epoch of "
                          f"this run's data (a damaged checkpoint, or other data at data.path)")
    # The steps before this epoch's `batch`: each earlier epoch trained one at least, none before epoch 0. Not
    # `epoch * batches`: a run resumed under --allow-config-change data.batch_size (or drop_last, path) counted its
    # earlier epochs in other batches, and its later checkpoints, resumed with their own config, were refused.
    earlier = step - batch
    if earlier < epoch or (epoch == 0 and earlier != 0):
        detail = "epoch 0's steps are its batches" if epoch == 0 else \
            f"{earlier} steps left to the {epoch} earlier epochs, which train one at least each"
        raise ConfigError(f"--resume {source}: position.epoch {epoch}, batch {batch} do not match position.step {step} "
                          f"({detail}; a damaged checkpoint, or other data at data.path)")


def checkpoint_to_resume(cfg: Config, resume: str, allowed: Iterable[str] = (),
                         env: Optional[DistEnv] = None) -> tuple[Optional[Path], Optional[Path]]:
    """(the checkpoint `--resume` names, the newest checkpoint of the run it belongs to); (None, None): the run
    ``--resume`` names has no checkpoint yet, and starts from step 0 in its directory (`restart_config`). Rank 0
    looks, every rank takes its answer (`env`): ranks that looked apart could part, one resuming, one starting."""
    if resume == "latest":
        if not cfg.log.run_name:
            raise ConfigError("--resume: name the run to resume with --run-name (or give a checkpoint path)")
        run = Path(cfg.log.tb_dir) / cfg.log.run_name

        def look() -> Optional[str]:
            if ckpt.list_checkpoints(run):
                return str(ckpt.resolve_resume("latest", run))
            best = ckpt.checkpoint_dir(run) / BEST_NAME
            start = branch_start(run)
            if start is not None and not (run / "summary.json").exists():
                return str(branch_resume(run, best, *start))
            if (run / BRANCH_NAME).exists() and not (run / "summary.json").exists():  # (taken for no branch, it went
                # on from the best.pt it linked, its source's earlier best step: what the record is there to prevent)
                raise ConfigError(f"--resume: {run / BRANCH_NAME} does not read as a branch's start (a JSON "
                                  '{"checkpoint": path, "step": N}); ' f"{run} holds no step checkpoint, so where it "
                                  "goes on is unknown: move it away or pick another --run-name")
            if best.is_file() and not (run / "summary.json").exists():
                # killed after an evaluation saved best.pt, before the first step checkpoint (train.eval_every <
                # checkpoint.every): best.pt holds its step's whole training state, the latest the run saved; it was
                # refused as more than a run writes before its first checkpoint, a dead end for a requeued job
                logger.info(f"--resume: {run} has no step checkpoint yet; going on from {best}, the latest state its "
                            "run saved")
                return str(best)
            restart_config(run, cfg.to_dict(), allowed)
            return None
        found = (env or DistEnv()).on_main(look, "refused the resume")
        return (Path(found), Path(found)) if found is not None else (None, None)
    path = Path(resume)
    if not path.is_file():
        raise ConfigError(f"--resume: {path}: checkpoint not found")
    run = run_of(path)
    listed = ckpt.list_checkpoints(run) if run is not None else []
    return path, (listed[-1] if listed else None)


def branch_resume(run: Path, best: Path, start: Path, step: int) -> Path:
    """What ``--resume`` of the branch `run` (started from `start` at `step`, `branch_start`), which has no step
    checkpoint yet, goes on from: its best.pt when an evaluation after its start made it (the latest state it saved),
    else its start. Its best.pt is otherwise its source run's best step's model, at `step` or earlier: going on from
    it trained steps the branch never trained (under its config), and from step 0 (none) the whole run."""
    own = checkpoint_step(best) if best.is_file() else None
    if own is not None and own > step:
        logger.info(f"--resume: {run} has no step checkpoint yet; going on from {best} (step {own}), the latest state "
                    "its run saved")
        return best
    held = checkpoint_step(start)
    if held == step:
        return start
    if own == step:  # (a link to the start's model: it outlives the start's pruning)
        return best
    what = "is gone" if not start.exists() else ("is not a readable checkpoint" if held is None else
                                                 f"holds step {held} now")
    raise ConfigError(f"--resume: {run} is a branch started from {start} at step {step} and stopped before its first "
                      f"checkpoint; that file {what} (pruned or replaced since), so it cannot go on from its start: "
                      "move it away and branch again, or pick another --run-name")


def restart_config(run: Path, current: dict[str, Any], allowed: Iterable[str]) -> None:
    """Check that ``--resume`` may start `run`, which has no checkpoint, from step 0: a run killed before its first
    checkpoint (SIGKILL, out of memory, a pre-empted job) left config.json, events and its lock there, and neither
    --resume ("no checkpoint") nor a new start ("not empty") took it; a job requeued with one command line could never
    run. Its config.json must be this run's (compared as a checkpoint's config is); anything else there is refused."""
    leftovers = restart_leftovers(run)
    if leftovers is None:
        raise ConfigError(restart_refusal(run))
    source = run / "config.json"
    if source.name in leftovers:
        try:
            saved = read_json(source)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--resume: {source}: not readable as JSON ({e}); {run} holds no checkpoint: move it "
                              "away or pick another --run-name") from None
        if not isinstance(saved, dict):
            raise ConfigError(f"--resume: {source}: not a run's config (a JSON {type(saved).__name__})")
        check_resume_config(named_as_current(with_defaults(saved), current, run), current, allowed, str(source),
                            whose="the stopped run's config.json", loads_checkpoint=False)
    elif any(name != LOCK_NAME and not name.endswith(".tmp") for name in leftovers):
        raise ConfigError(restart_refusal(run))  # events or traces without the config.json a run writes first
    what = "the run stopped before its first one" if leftovers else "a new run"
    logger.info(f"--resume: {run} holds no checkpoint yet ({what}): starting it from step 0")


def summarized(checkpoint: Path, step: int) -> bool:
    """Whether the run `checkpoint` belongs to ended at `step` (a later summary.json: that run extended since)."""
    try:
        summary = read_json((run_of(checkpoint) or Path(checkpoint).resolve().parent.parent) / "summary.json",
                            SUMMARY_LIMIT)
        return summary["steps"] == step
    except (OSError, ValueError, TypeError, KeyError):
        return False


_RUN_NAMING = ("tb_dir", "run_name")  # the log keys that name a run's directory


def named_as_current(saved: dict, current: dict, run: Optional[Path]) -> dict:
    """`saved` (the config of a checkpoint or config.json of `run`) with its ``log.tb_dir`` and ``log.run_name`` as
    `current` gives them when this session writes `run` itself (a resume in place: `current` names `run`, or no run at
    all); else `saved` as it is (a branch: a new directory, a change its record keeps). The two name one directory
    however they are spelled: compared as settings, a resume of a run started without --run-name (recorded null) by
    the name it got said ``log.run_name: null -> 'c-20261201-183337'`` as a change of its own, and one by checkpoint
    path ``log.run_name: 'r1' -> null`` (``log.tb_dir`` too, spelled otherwise), in the log and in summary.json's
    ``sessions``."""
    log, own = saved.get("log"), current.get("log")
    if run is None or not isinstance(log, dict) or not isinstance(own, dict):
        return saved
    name, tb_dir = own.get("run_name"), own.get("tb_dir")
    if name is not None and not (isinstance(tb_dir, str) and _same_file(Path(tb_dir) / name, Path(run))):
        return saved
    return {**saved, "log": {**log, **{k: own[k] for k in _RUN_NAMING if k in own}}}


def saved_config(state: dict) -> dict:
    """A checkpoint's config with today's defaults filled in (keys added since it was written)."""
    return with_defaults(state["config"])


def with_defaults(config: dict) -> dict:
    """A config an older version recorded (a checkpoint's, a sweep's, a summary's) with today's defaults filled in for
    the keys added since (as is, if it does not parse: the comparison then names what differs)."""
    try:
        return config_from_dict(config).to_dict()
    except ConfigError:
        return config
