"""Saving and restoring a run's state: the trainer's one call for checkpoints.

What a checkpoint holds, and how it is written and read safely, is `dlrm.checkpoint`'s
business (and `dlrm.distributed.checkpoint`'s for sharded runs); this module decides *what* state
of a `Run` goes in and puts it back.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from dlrm.config import Config, ConfigError
from dlrm.data.shuffle_seed import shuffle_scheme
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.env import DistEnv
from dlrm.distributed.shutdown_grace import StopGrace
from dlrm.logging_setup import run_logger
from dlrm.mapped_load import check_unchanged, load_mapped, own_copies, reading
from dlrm import checkpoint as ckpt
from dlrm.train.builder import Run
from dlrm.train.checkpoint_room import check_checkpoint_room
from dlrm.train.graphed_step import plain_lr_state_dict
from dlrm.train.meter import RunStats
from dlrm.train.run_dir import _shard_names, run_dir_present
from dlrm.train.setup import Tables

BEST_NAME = "best.pt"
"""The best evaluation's checkpoint, beside the step checkpoints (never pruned)."""
EVAL_CURVE_SPLIT = "eval_curve_split"
"""run_stats' key of the split the run's ``eval/*`` scalars are of (its first session's data.eval_split): a resume on
another split logs its evaluations as ``eval/<split>/*`` (`dlrm.train.trainer.Trainer._eval_tag`)."""


def checkpoint_for(path: Path) -> Path:
    """What ``--checkpoint PATH`` means: a checkpoint file as it is; a run directory, its best.pt,
    else its newest step checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return path
    best = ckpt.checkpoint_dir(path) / BEST_NAME
    if best.is_file():
        return best
    found = ckpt.list_checkpoints(path)
    if not found:
        raise ConfigError(f"--checkpoint: {path} is a directory without checkpoints/{BEST_NAME} or step-*.pt")
    return found[-1]


def checkpoint_step(path: Path) -> Optional[int]:
    """The step of the checkpoint (or manifest) at `path`, read without loading its tensors; None when unreadable."""
    try:
        numpy = [(obj, name) for name, obj in ckpt.schema.v1_numpy_globals().items()]  # a format-1 file's RNG state
        state = load_mapped(str(path), numpy)  # (a name not UTF-8 too)
    except Exception:  # noqa: BLE001 - missing, foreign or damaged: it holds no known step
        return None
    # read before the file is checked (`--export` names the step first): whatever else torch.save wrote holds no step.
    # Indexed as it came, a file holding a tensor (`tensor["position"]`) printed torch's two-line "non-tuple sequence
    # for multidimensional indexing" warning above --export's one-line refusal of the file
    position = state.get("position") if isinstance(state, dict) else None
    step = position.get("step") if isinstance(position, dict) else None
    return step if type(step) is int else None  # (bool is an int subclass: type(), not isinstance())


class Checkpointer:
    """Writes ``<run_dir>/checkpoints/step-*.pt`` (sharded in a distributed run) and restores them.

    Args:
        run_dir: the run's directory.
        cfg: the run's config (stored in every checkpoint; decides how many are kept).
        tables: the table sizes (stored, and compared on restore).
        env: the process group.
        placement: the run's data placement, "auto" resolved (stored: a resumed run reads its batches the same way).
        dataset_stamps: the stamps of the run's data files (`dlrm.data.dataset_stamps`), stored: a resume on changed
            data is refused (`dlrm.train.resume_policy.check_dataset_unchanged`); None: not recorded.
        ranks: the world size the run's epochs are counted in (`TrainData.ranks`; stored as ``world_size``, so a
            resume keeps them: `dlrm.checkpoint.trained_world_size`); default: `env`'s.
        train_rows: the train split's rows the run's epochs count (stored: a resume on other data, or on this data
            changed, tells the steps an epoch its checkpoint's run had: `resume_policy.checkpoint_rows`); None: not
            recorded.
        run: the run it will save; under torchrun its shards' sizes are weighed against torchrun's grace after a
            SIGTERM at once (one gather), as each checkpoint's seconds are later (`dlrm.distributed.shutdown_grace`).

    Example (not a doctest: it needs a run in progress, whose trainer holds `run`, the loader
    `position` and the `stats`; tests/test_checkpoint.py exercises it)::

        checkpointer = Checkpointer(run_dir, cfg, tables, env)
        path = checkpointer.save(run, position, stats)
    """

    def __init__(self, run_dir: Path, cfg: Config, tables: Tables, env: DistEnv = DistEnv(),
                 placement: Optional[str] = None, dataset_stamps: Optional[dict[str, str]] = None,
                 ranks: Optional[int] = None, train_rows: Optional[int] = None, run: Optional[Run] = None) -> None:
        # absolute (links kept, as summary.json's paths): the paths this names (`last`, `best_path`) go into log lines
        # and the stats; with a relative --tb-dir a run's first session named them relative, a resumed one absolute
        self.run_dir, self.cfg, self.tables, self.env = Path(os.path.abspath(run_dir)), cfg, tables, env
        # a run directory there at the start (a run's: `RunDirectory` made it) must still be there at each save (one
        # removed meanwhile is refused, not made again empty); a Checkpointer given a new path makes it at its first
        self._dir_at_start = self.run_dir.is_dir()
        self.placement, self.dataset_stamps = placement, dataset_stamps
        self.ranks, self.train_rows = max(env.world_size, ranks or 1), train_rows
        self.last: Optional[Path] = None
        # the step of the run's latest evaluation (the evaluator sets it; a checkpoint at that step records it, in
        # run_stats, so a resume knows that its stats already count that step's evaluation)
        self.evaluated_step: Optional[int] = None
        # run_stats keys beside RunStats' own (`dlrm.train.target`: the evaluations' seconds, a reached target),
        # written in every checkpoint; `restore` reads the checkpoint's back into it
        self.extra_stats: dict[str, Any] = {}
        # brings the stats' train_s up to now before a checkpoint stores them (the trainer's `StepMeter.update_train_s`)
        self.clock: Optional[Callable[[], None]] = None
        # once: the vocabularies do not change (a stand-in for Tables without hashing: nothing recorded)
        self._hashing = getattr(tables, "hashing", None)
        self._vocabs = getattr(tables, "vocabs", None)
        self._vocabulary_digest = ckpt.vocabulary_digest(self._vocabs)
        # torchrun SIGKILLs its ranks 30 s after passing on a SIGTERM: a checkpoint slower than that is lost in such a
        # stop (MLPerf DLRM-DCNv2's 53 GB on two H200s: 65-99 s, and a run stopped at its end saved nothing)
        self.grace = StopGrace(env)
        if run is not None:
            self.grace.check_start(run.model, run.optimizers)

    def check_room(self, run: Run, start: int, total: int, skip: bool = False) -> None:
        """Before the first step (from step `start` of `total`): refuse a run whose disk cannot hold its first
        checkpoint, warn of a later one (`dlrm.train.checkpoint_room`); nothing where `skip`.

        A resume calls it twice, with one `skip` true: before the restore reads the checkpoint's tensors (`start` the
        checkpoint's step), so a refusal does not wait for them (MLPerf DLRM-DCNv2's 53 GB on an H200 machine's 64 GB
        disk, session 87: refused in 16.8 s, against 49.0 s with 32 s of reading when weighed after), unless ``train.early_stopping`` may have ended the run there: only the totals the
        restore reads say, and an ended run trains no step (it makes its summary, or reports it made); then after the
        restore, not for an ended run."""
        if skip:
            return
        c = self.cfg.checkpoint
        check_checkpoint_room(self.run_dir, c.keep, c.every, start, total, run.model, run.optimizers, self.env,
                              refuse=c.check_room)

    def save(self, run: Run, pos: ckpt.Position, stats: RunStats) -> Path:
        """Checkpoint `run` at `pos` (once per step: a second call at the same step returns the first)."""
        if self._saved_here(pos.step):
            return self.last  # this step is already saved in this run
        keep = self.cfg.checkpoint.keep
        start = time.monotonic()
        if run.plan is not None:  # the check and the state inside the save's first agreed part (`_checked_state`)
            self.last = dist_ckpt.save_sharded(self.run_dir, lambda: self._checked_state(run, pos, stats), pos.step,
                                               keep, self.env, run.plan)
        else:
            self.last = ckpt.save_checkpoint(self.run_dir, self._checked_state(run, pos, stats), pos.step, keep)
        self.grace.check_save(time.monotonic() - start, self.last.name)
        return self.last

    def _checked_state(self, run: Run, pos: ckpt.Position, stats: RunStats) -> dict[str, Any]:
        """The state to save, once the run directory is known to be there. In a sharded run called inside the save's
        first agreed part: a failure here on one rank (its view of the run directory gone, the state's gathering)
        raised before it, and the other ranks waited in its collective (gloo's "Connection closed by peer")."""
        if self._dir_at_start:
            run_dir_present(self.run_dir)
        return self._state(run, pos, stats)

    def _saved_here(self, step: int) -> bool:
        """Whether the last checkpoint written or resumed (`last`) is `step`'s in this run's checkpoints/. Those
        directories compared, resolved: checkpoints/ may be a symbolic link to another disk, where the resolved
        checkpoint's grandparent is not the run (the step was saved a second time, best.pt a full copy)."""
        return (self.last is not None and self.last.name == ckpt.checkpoint_name(step)
                and self.last.parent.resolve() == ckpt.checkpoint_dir(self.run_dir).resolve())

    @property
    def best_path(self) -> Path:
        """Where `save_best` writes (``checkpoints/best.pt``; a manifest in a sharded run)."""
        return ckpt.checkpoint_dir(self.run_dir) / BEST_NAME

    def save_best(self, run: Run, pos: ckpt.Position, stats: RunStats) -> Path:
        """Write ``checkpoints/best.pt`` (atomically, over the previous best): a hard link to this step's checkpoint
        when the step was just saved, else a copy of the model; in a sharded run a manifest and its own shards
        (`dlrm.distributed.checkpoint.save_best_sharded`; ``python -m dlrm.distributed.merge`` makes it one file)."""
        path = self.best_path
        saved = self.last if self._saved_here(pos.step) else None
        if run.plan is not None:
            return dist_ckpt.save_best_sharded(path, lambda: self._checked_state(run, pos, stats), pos.step, self.env,
                                               run.plan, self._link, saved)
        if self._dir_at_start:
            run_dir_present(self.run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        if saved is not None and self._link(saved, path):
            return path
        ckpt.write_atomic(path, self._state(run, pos, stats))
        return path

    def adopt_best(self, found: Path, sharded: bool) -> bool:
        """Make this run's best.pt hold the checkpoint at `found` (the recorded best evaluation's model, in another
        run's or another file) without a copy: a hard link; in a sharded run (`sharded`) a manifest of its own linked
        shards (a link to `found`'s manifest named another run's shards). False where links are not supported."""
        path = self.best_path
        path.parent.mkdir(parents=True, exist_ok=True)
        return dist_ckpt.link_best_sharded(found, path, self._link) if sharded else self._link(found, path)

    def last_good(self, best: Optional[dict]) -> str:
        """Where a diverged run's last good model is, for its error line: the last step checkpoint, else the best
        evaluation's checkpoint (`best`: ``RunStats.best``; written only after the weights were checked; one deferred
        to a checkpoint step may not be written yet: read back), else none.
        Without step checkpoints (``checkpoint.every`` off) the line said "no checkpoint was written" beside a good
        best.pt."""
        if self.last:
            return f"the last good checkpoint is {self.last}"
        if best and best.get("checkpoint") and checkpoint_step(Path(best["checkpoint"])) == best["step"]:
            return f"no step checkpoint was written; {best['checkpoint']} holds the best evaluation's model (step {best['step']})"
        return "no checkpoint was written"

    @staticmethod
    def _link(source: Path, path: Path) -> bool:
        """Make `path` a hard link to `source` (this step's checkpoint: the same model), atomically.

        A second full copy would double the disk and the time a save takes: MLPerf DLRM-DCNv2's
        checkpoint is 50 GB, and two of them do not fit the 64 GB disk it was measured on. The
        link outlives the step file's rotation (`checkpoint.keep`). False where links are not
        supported (then the caller writes a copy)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}-link.tmp")
        try:
            tmp.unlink(missing_ok=True)
            os.link(source, tmp)
            os.replace(tmp, path)
            tmp.unlink(missing_ok=True)  # `path` already a link to `source`: rename() of two links of one file does
            return True  # nothing (POSIX) and left tmp (a restarted sharded branch re-links its best shards so)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        except BaseException:  # a SIGTERM (`StopAtOnce`) between link and replace left .best.pt.<pid>-link.tmp
            tmp.unlink(missing_ok=True)
            raise

    def _state(self, run: Run, pos: ckpt.Position, stats: RunStats) -> dict[str, Any]:
        if self.clock is not None:
            self.clock()  # the training time up to this checkpoint, not only earlier sessions'
        return {
            "model": run.model.state_dict(),
            "optimizers": [plain_lr_state_dict(o) for o in run.optimizers],
            "schedulers": [s.state_dict() for s in run.schedulers],
            "position": asdict(pos),
            "rng": ckpt.rng_state(),
            "cardinalities": self.tables.cardinalities,
            "multi_hot_sizes": self.tables.multi_hot_sizes or [1] * len(self.tables.cardinalities),
            "dense_format": self.tables.dense_format,
            **({"hashing": self._hashing} if self._hashing is not None else {}),
            **({"vocabulary_digest": self._vocabulary_digest} if self._vocabulary_digest is not None else {}),
            "config": self.cfg.to_dict(),
            "run_stats": {**stats.to_dict(), **self.extra_stats,
                          **({"evaluated_step": pos.step} if self.evaluated_step == pos.step else {})},
            **({"data_placement": self.placement} if self.placement is not None else {}),
            **({"dataset_stamps": self.dataset_stamps} if self.dataset_stamps is not None else {}),
            **shuffle_scheme(self.cfg.train.seed),  # a seed >= 2**32's stream shuffle (`dlrm.data.shuffle_seed`)
            "world_size": self.ranks,
            **({"train_rows": self.train_rows} if self.train_rows is not None else {}),
        }

    def _fresh_optimizers(self, state: dict[str, Any], path: Path, count: int) -> set[int]:
        """The optimizers (0 dense, 1 sparse) whose saved state is another optimizer's: ``optim.dense.name`` or
        ``optim.sparse.name`` changed, which the resume policy lets through only under ``--allow-config-change``.
        They start afresh (said in the log): torch's load took the other optimizer's state whole, and the first step
        failed with a traceback (KeyError 'sum' or 'dampening', an index_add_ shape error). The checkpoint must
        hold as many optimizers as the run (one over all the parameters failed in torch's load with a ValueError)."""
        if len(state["optimizers"]) != count:
            raise ConfigError(f"{path}: checkpoint key 'optimizers' holds {len(state['optimizers'])} optimizer "
                              f"states, this run has {count} optimizers (dense, sparse)")
        saved, fresh = state["config"].get("optim"), set()
        for i, section in enumerate(("dense", "sparse")[:count]):
            part = saved.get(section) if isinstance(saved, dict) else None
            old = part.get("name") if isinstance(part, dict) else None  # not recorded: not compared
            new = getattr(self.cfg.optim, section).name
            if old is not None and old != new:
                # every rank restores its shard with the same configs: said once (rank 0), not once a rank
                run_logger.warning(f"--resume: optim.{section}.name changed from {old!r} to {new!r}: the checkpoint's "
                               f"{old!r} state cannot continue as {new!r}'s, which starts afresh")
                fresh.add(i)
        return fresh

    def restore(self, path: Path, run: Run) -> tuple[ckpt.Position, RunStats]:
        """Load `path` into the freshly built `run` (after checking it fits); returns its position and
        the run's totals so far. A distributed run loads its rank's shard (same ranks and plan); a failure on any rank
        stops every rank (`dist_ckpt.restore_agreed`: one rank's damaged shard)."""
        return dist_ckpt.restore_agreed(self.env, lambda: self._restore(path, run), path)

    def _restore(self, path: Path, run: Run) -> tuple[ckpt.Position, RunStats]:
        # (before the mapping: a cp over the file, or over a shard, while its tensors are copied out of it is seen;
        # one truncated, its pages past the end read: a one-line error, not SIGBUS)
        with reading([path, *(Path(path).parent / name for name in _shard_names(Path(path)) or [])]) as stamps:
            return self._restore_from(path, run, stamps)

    def _restore_from(self, path: Path, run: Run, stamps: dict) -> tuple[ckpt.Position, RunStats]:
        # (the resume's first read, of its config and position before the build, said a format-1 file's conversion:
        # said here again, each resume warned twice)
        state: dict[str, Any] = dist_ckpt.load_for_rank(path, self.env, run.plan, say_conversion=False)
        ckpt.check_compatible(state, run.model, self.tables.cardinalities, self.cfg.to_dict()["model"], path,
                              self.tables.multi_hot_sizes, self.tables.dense_format, self._hashing,
                              self._vocabs)
        fresh = self._fresh_optimizers(state, path, len(run.optimizers))
        run.model.load_state_dict(state["model"])
        for i, (opt, s) in enumerate(zip(run.optimizers, state["optimizers"])):
            if i not in fresh:
                opt.load_state_dict(s)
        for sched, s in zip(run.schedulers, state["schedulers"]):
            sched.load_state_dict(s)
        # torch.optim keeps a loaded CPU tensor of its parameter's dtype as it is: a view of the memory-mapped file
        own_copies([*run.optimizers, *run.schedulers], state)
        # (before the RNG state's read: another file's bytes there raised "Invalid mt19937 state")
        check_unchanged(stamps)
        if not state["schedulers"]:  # saved without a schedule: one added on resume starts at the checkpoint's step
            for sched in run.schedulers:
                sched.start_at(state["position"]["step"])
        ckpt.set_rng_state(state["rng"])
        self.last = Path(os.path.abspath(path))  # (as a save names it: `__init__`)
        run_stats = state.get("run_stats") or {}
        self.evaluated_step = run_stats.get("evaluated_step")
        self.extra_stats = {k: run_stats[k] for k in ("eval_s", "target", "wall_s", EVAL_CURVE_SPLIT) if k in run_stats}
        return ckpt.Position(**state["position"]), RunStats.from_dict(state.get("run_stats"))
