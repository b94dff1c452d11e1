"""The training loop, readable top to bottom: build (dlrm.train.builder), resume, then steps with
periodic logging, evaluation and checkpoints, then the summary.

The loop (:meth:`Trainer.fit`) only orchestrates: loader -> step -> meter -> evaluator -> checkpointer; a run is made
by `build_run`; the run directory it writes is owned through `RunDirectory` (one writer, no clobbering, cleanups).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from loguru import logger
from torch.profiler import record_function

from dlrm.config import Config, ConfigError
from dlrm.data.dataset_stamps import dataset_stamps
from dlrm.data.loader import Batch
from dlrm.distributed.env import init_distributed
from dlrm.errors import NonFiniteLoss, TrainingStopped, found_alike
from dlrm.json_file import SUMMARY_LIMIT, read_json
from dlrm.logging_setup import ProgressBar, bar_interval, counted, run_logger
from dlrm import checkpoint as ckpt
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.train.baseline import baseline_clause, run_baseline
from dlrm.train.builder import build_run
from dlrm.model.dlrm import named_range
from dlrm.train.checkpointer import EVAL_CURVE_SPLIT, Checkpointer, checkpoint_step
from dlrm.train.meter import WARMUP_STEPS, RunStats, StepMeter
from dlrm.train.evaluator import Evaluator, evaluate
from dlrm.train.placement import choose_placement, resumed_placement
from dlrm.train.profiling import make_profiler, profiles_step, saves_trace
from dlrm.train.reporting import (NoWriter, close_quietly, device_name, final_line, log_hparams, log_profile, model_text,
                                  open_writer, resolved_settings, versions, write_summary, check_logloss)
from dlrm.train.resume_policy import (check_dataset_unchanged, check_position, check_resume_config,
                                      check_schedule_length, checkpoint_rows, checkpoint_to_resume, named_as_current,
                                      saved_config, summarized)
from dlrm.train.run_dir import RunDirectory, _same_file, run_of
from dlrm.train.setup import as_trained, dataset_held, seed_everything, seed_rank
from dlrm.train.signals import FinishAlone, GracefulStop, StopAtOnce, agreed_stop, held_signals, run_hold
from dlrm.train.step import compile_counters, precision_on
from dlrm.train.target import TargetTracker, already_reached
from dlrm.train.train_data import TrainData, build_for_data, make_loader
from dlrm.train.windows import WindowLogging

__all__ = ["NonFiniteLoss", "TrainingStopped", "train", "evaluate", "build_for_data", "make_loader"]


class Trainer(WindowLogging):
    """One training run: built from `cfg`, optionally resumed, trained, evaluated and summarized.

    Args:
        cfg: the resolved config (not modified).
        run_dir: write here instead of tb_logs/<run-name>/ (used by --compare); must not exist yet.
        resume: "latest" (the run's newest checkpoint) or a checkpoint path.
        allow_config_change: dotted config keys a resume may change (``--allow-config-change``).

    Example (not a doctest: a whole training run, ~10 s on 2 cores, writing tb_logs/; tests/test_end_to_end.py
    runs it)::

        summary = Trainer(load_config("configs/sample.json")).fit()
    """

    def __init__(self, cfg: Config, run_dir: Optional[Path] = None, resume: Optional[str] = None,
                 allow_config_change: Sequence[str] = ()) -> None:
        self.t_start = time.perf_counter()
        # data.path as an absolute path (not resolving links): the checkpoints and summary.json record it, so a
        # --resume from another working directory whose config names the data relatively is compared with the data
        # this run read (refused when it is another directory) instead of training on whatever lies there
        self.cfg = cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=os.path.abspath(cfg.data.path)))
        device, data_dir, self.meta, self.tables = build_for_data(cfg)
        self.cfg = cfg = as_trained(cfg, self.tables)  # the dataset's table sizes, recorded as trained
        self.env, self.device = init_distributed(cfg.distributed, device)  # one process unless under torchrun
        with agreed_stop(self.env, self.device, "before the first step", self._stopped_at_start):  # several ranks
            self._start(cfg, data_dir, run_dir, resume, allow_config_change)

    def _start(self, cfg: Config, data_dir: Path, run_dir: Optional[Path], resume: Optional[str],
               allow_config_change: Sequence[str]) -> None:
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        self.resume_from = self.finished = latest = state = None
        self.resumed_at_step: Optional[int] = None  # the step a resumed session starts from (summary.json)
        # its data files' stamps, rank 0's (held for reading: `dataset_held`): every checkpoint records them
        self.data_stamps = self.env.broadcast_object(dataset_stamps(data_dir) if self.env.is_main else None)
        with found_alike():  # every rank checks the same files: a refusal is said once (on_main's copies too)
            if resume is not None:  # (None, None): a run without a checkpoint yet, started from step 0 (`restart`)
                self.resume_from, latest = checkpoint_to_resume(cfg, resume, allow_config_change, self.env)
            if self.resume_from is not None:
                state = ckpt.load_checkpoint(self.resume_from, mmap=True)  # (tensors read by the restore only)
                dist_ckpt.check_resumable_by(self.resume_from, state, self.env)  # (its ranks: before anything else)
                # (summary.json's sessions: this session's config changes; the run's directory, written in place, is
                # no change however the two name it: `named_as_current`)
                self.resumed_config = named_as_current(saved_config(state), cfg.to_dict(), run_of(self.resume_from))
                check_resume_config(self.resumed_config, cfg.to_dict(), allow_config_change, str(self.resume_from))
                check_dataset_unchanged(self.resumed_config, state, self.data_stamps, cfg.data.path,
                                        allow_config_change, str(self.resume_from))
        state = state and ckpt.without_tensors(state)  # (the restore reads them again; one kept maps the file twice)
        # (not the placement's: it weighs each rank's own GPU memory)
        self.placement = choose_placement(cfg, self.meta, self.tables.cardinalities, self.device, self.env.world_size)
        if state is not None:  # the batches the run resumed would train on (shuffled, they depend on the placement)
            self.placement = resumed_placement(cfg, state, self.placement, allow_config_change, self.resume_from)
        # a resume keeps the epochs of the ranks that trained the checkpoint (one process resuming a merged one)
        trained = ckpt.trained_world_size(state) if state is not None else None
        self.data = TrainData.build(cfg, data_dir, self.meta, self.device, self.env, self.placement, trained)
        if state is not None:
            if trained is None:
                self.data.say_unknown_ranks(cfg.data.drop_last, str(self.resume_from))
            step = state["position"]["step"]
            # at its end, and finished: a run stopped by a signal during its last step saved that step but made neither
            # its last evaluation nor its summary, which this session then makes (training no step)
            if step >= self.data.total_steps and self.env.broadcast_object(
                    summarized(self.resume_from, step) if self.env.is_main else None):
                self.finished = self.resume_from
                return  # nothing to build: fit() reports the finished run and changes nothing
            with found_alike():  # a length that moves a decay's end: refused (before the build), or said
                rows = self.data.train.num_rows  # this run's; the checkpoint's end is counted in its own
                check_schedule_length(self.resumed_config, cfg, step, len(self.data.train), self.data.total_steps,
                                      rows, allow_config_change, str(self.resume_from), trained or self.data.ranks,
                                      checkpoint_rows(self.resumed_config, state, self.data_stamps, cfg.data.path, rows))
        self.run = build_run(cfg, self.tables, self.device, self.data.total_steps, self.env,
                             cfg.data.eval_batch_size or 4 * cfg.data.batch_size, self.resume_from)
        seed_rank(cfg.train.seed, self.env.rank)  # after the shared initialization: dropout masks per rank
        self.pos, self.stats = ckpt.Position(), RunStats()
        self.run_dir = self._open_run_dir(run_dir, latest, restart=resume is not None and self.resume_from is None)
        try:  # any failure (a SIGTERM too: `train`) before the first step: the directory is given up (`abandon`)
            self.checkpointer = Checkpointer(self.run_dir.path, cfg, self.tables, self.env, self.placement,
                                             self.data_stamps, self.data.ranks, self.data.train.num_rows, self.run)
            late = self.resume_from is not None and cfg.train.early_stopping is not None  # (`Checkpointer.check_room`)
            self.checkpointer.check_room(self.run, state["position"]["step"] if state else 0, self.data.total_steps, late)
            if self.resume_from is not None:
                self.pos, self.stats = self.checkpointer.restore(self.resume_from, self.run)
                # after the restore's checks (which refuse another world size's): a position the epochs cannot hold
                check_position(vars(self.pos), len(self.data.train), allow_config_change, str(self.resume_from))
                self._forget_another_splits_best(saved_config(state))
                # early stopping ended the run here (patience out, or its target reached, recorded or by the best): finished
                ended = Evaluator.patience_ran_out(cfg.train.early_stopping, self.stats)
                self.finished_target = None if ended else already_reached(cfg.train.early_stopping,
                                                                          self.checkpointer.extra_stats, self.stats)
                # unless stopped (a signal) after that checkpoint, before its summary: this session makes the summary,
                # training no step (`_batches`); taken for finished, the run never got one ("nothing written")
                if (ended or self.finished_target) and not self.env.broadcast_object(
                        summarized(self.resume_from, self.pos.step) if self.env.is_main else None):
                    self.early_stopped, self.finished_target = True, None
                elif ended or self.finished_target:
                    self.run_dir.abandon()  # releases the lock (removes a branch's new directory, which holds nothing)
                    self.finished, self.finished_early = self.resume_from, ended
                    return
                self._unrecorded_last_best()  # (an earlier version's finished run: its summary's best)
                self._keep_best_model()
                self.resumed_at_step = self.pos.step
                ranks = f"; the checkpoint's world size {trained}, this session's {self.env.world_size}" \
                    if trained not in (None, self.env.world_size) else ""  # (a merged one resumed by one process)
                logger.info(f"resumed from {os.path.abspath(self.resume_from)} at step {self.pos.step} "
                            f"(epoch {self.pos.epoch}, batch {self.pos.batch}{ranks})")
            self.checkpointer.check_room(self.run, self.pos.step, self.data.total_steps, not late or self.early_stopped)
            self._log_start()
        except BaseException as e:
            self.run_dir.abandon(e)
            raise

    def _stopped_at_start(self, name: str) -> str:
        """A signal at the start (`agreed_stop`): a new run's directory given up (unless a finished run's start did)."""
        if getattr(self, "run_dir", None) is not None and self.finished is None:
            self.run_dir.abandon(TrainingStopped(128 + signal.Signals[name], name))
        ranks = ", on every rank" if self.env.distributed else ""  # (one process: a signal a library's catch-all hid)
        return f"{name}: stopped before the first step{ranks} (no checkpoint written now)"

    def _forget_another_splits_best(self, saved: dict) -> None:
        """A resume on another data.eval_split (free without early stopping, else allowed): the recorded best is of
        the checkpoint's split, not comparable with this run's evaluations (it stayed the best, and best.pt its model,
        whatever they scored): the best and early stopping's count start afresh, said."""
        old, new = (saved.get("data") or {}).get("eval_split"), self.cfg.data.eval_split
        if old != new:  # its step's evaluation is the old split's: at the run's end, this split's counts (not `again`)
            self.checkpointer.evaluated_step = None
        if old == new or self.stats.best is None:
            return
        run_logger.warning(f"--resume: data.eval_split {old!r} -> {new!r}: the best evaluation so far (step "
                           f"{self.stats.best.get('step')}) is of {old!r}, not compared with those of {new!r}: the best starts "
                           f"afresh, and this run's best {new!r} evaluation replaces {self.checkpointer.best_path}")
        self.stats.best, self.stats.grid_best, self.stats.evals_since_best = None, None, 0

    def _eval_tag(self) -> str:
        """The TensorBoard prefix of this session's evaluations: ``eval`` for the split of the run's ``eval/*`` curve
        (its first session's, in every checkpoint), ``eval/<split>`` for another (a resume that changed eval_split: on
        the same curve, one at the run's end stood at the other split's step, a vertical segment between splits)."""
        extra, split = self.checkpointer.extra_stats, self.cfg.data.eval_split
        # a checkpoint written before this was recorded: the split it was trained with
        resumed = ((self.resumed_config or {}).get("data") or {}).get("eval_split")
        source = run_of(self.resume_from) if self.resume_from is not None else None
        if source is None or not _same_file(source, self.run_dir.path):  # a new run, or a branch: its events hold none
            extra.pop(EVAL_CURVE_SPLIT, None)
            resumed = None
        curve = extra.get(EVAL_CURVE_SPLIT) or resumed or split
        extra[EVAL_CURVE_SPLIT] = curve
        if curve == split:
            return "eval"
        run_logger.info(f"data.eval_split {split!r}: the run's eval/* scalars are of {curve!r}; this session's "
                        f"evaluations of {split!r} are logged as eval/{split}/*")
        return f"eval/{split}"

    def _keep_best_model(self) -> None:
        """The recorded best evaluation's checkpoint must hold that evaluation's model, in this run: a branch
        (``--run-name NEW``) named its source run's best.pt, which that run replaces with later bests (then another
        step's model was this run's best, exported too). A file holding it becomes this run's best.pt, else none."""
        best = self.stats.best
        if not best or not best.get("checkpoint"):
            return

        def find() -> Optional[str]:  # rank 0's: a failure there (adopt_best's ENOSPC) stops every rank (`on_main`)
            source = run_of(self.resume_from) or self.resume_from.resolve().parent.parent
            saved = ckpt.checkpoint_dir(source)  # its best.pt too: a path recorded relative to another directory
            # where it trained, relative or absolute: a run moved since (`mv tb/r arch/r`) finds there, or relative to
            # another working directory, a namesake's file, maybe of the same step (taken first, that other model was
            # linked as this run's best.pt): the last resort, after this run's own files
            recorded = Path(best["checkpoint"])
            own = self.checkpointer.best_path  # last: a restarted branch's link to it (its source's best.pt moved on)
            ours = (saved / own.name, self.resume_from, saved / ckpt.checkpoint_name(best["step"]), own)
            found = next((path for path in (*ours, recorded) if checkpoint_step(path) == best["step"]), None)
            moves = found != recorded or run_of(found) is not None  # also another run's best.pt (an old branch's record),
            # which that run replaces with later bests
            if found is not None and moves and _same_file(found, own):  # a restarted branch's best.pt (named the
                found = own  # source's best.pt, the same file now, which that run replaces with later bests)
            elif found is not None and moves and self.checkpointer.adopt_best(found, self.run.plan is not None):
                logger.warning(f"--resume: the best evaluation's model (step {best['step']}, recorded as "
                               f"{best['checkpoint']}) is {found}: {own} is now a link to it")
                found = own
            if found is None:
                logger.warning(f"--resume: {best['checkpoint']} no longer holds the best evaluation's model (step "
                               f"{best['step']}), nor does a checkpoint of that step: no best checkpoint is named")
            return None if found is None else str(found)
        found = self.env.on_main(find, f"could not make {self.checkpointer.best_path} hold the best model")
        self.stats.best = {**best, "checkpoint": found}

    def _unrecorded_last_best(self) -> None:
        """A run that a version before 2026-11-30 (e4c1c73) finished with a new best at its last evaluation saved its
        last checkpoint before that evaluation and then linked best.pt to it, unrecorded: the checkpoint names the
        older best (no ``evaluated_step``, no ``grid_best``), the run's summary.json the new one. Taken as written, a
        longer resume looked for a file of the older best, warned that best.pt no longer held it, and reported the
        older best as the run's (its model not kept), or made a kept step checkpoint of it best.pt over the better
        model. summary.json's best is taken as this checkpoint's, as this version records it (off the eval_every grid
        the grid's best stays the older one, early stopping's reference)."""
        best, step = self.stats.best, self.pos.step
        source = run_of(self.resume_from) or self.resume_from.resolve().parent.parent
        saved_best = ckpt.checkpoint_dir(source) / self.checkpointer.best_path.name

        def read() -> Optional[dict]:
            if not best or best.get("step", step) >= step or self.checkpointer.evaluated_step is not None \
                    or self.stats.grid_best is not None or best.get("metric") not in best:
                return None
            if checkpoint_step(saved_best) != step:
                return None
            try:
                last = read_json(source / "summary.json", SUMMARY_LIMIT).get("best")
            except (OSError, ValueError, AttributeError):  # none, unreadable or foreign: the checkpoint as it is
                return None
            metric = best.get("metric")
            if not (isinstance(last, dict) and last.get("step") == step and last.get("metric") == metric
                    and isinstance(last.get(metric), (int, float)) and not isinstance(last.get(metric), bool)):
                return None
            return {k: last[k] for k in ("step", "metric", "auc", "logloss", "accuracy") if k in last}

        last = self.env.broadcast_object(read() if self.env.is_main else None)
        if last is None:
            return
        every = self.cfg.train.eval_every
        if every and step % every == 0:  # on the grid: early stopping counted it
            self.stats.grid_best, self.stats.evals_since_best = None, 0
        else:
            metric = best["metric"]
            self.stats.grid_best = {"step": best["step"], "metric": metric, metric: best[metric]}
        self.stats.best = {**last, "checkpoint": str(saved_best)}
        self.checkpointer.evaluated_step = step  # the checkpoint holds that evaluation (not counted twice at the end)
        logger.info(f"--resume: the best evaluation is step {step}'s (its summary.json), made after the checkpoint "
                    f"by an earlier version, which recorded step {best['step']}'s in it")

    def _open_run_dir(self, run_dir: Optional[Path], latest: Optional[Path], restart: bool) -> RunDirectory:
        """Rank 0 creates (or, resuming, takes over) and locks the run directory; others learn its path."""
        opened, refusal = None, None
        if self.env.is_main:
            try:
                if self.resume_from is not None and run_dir is None:
                    opened, _ = RunDirectory.for_resume(self.cfg, self.resume_from, latest)
                else:
                    opened = RunDirectory.create(self.cfg, run_dir, restart)
            except ConfigError as e:
                refusal = str(e)
        # every rank learns the path, or rank 0's refusal (so no rank waits for one that left)
        path, refusal = self.env.broadcast_object((opened.path if opened else None, refusal))
        if refusal is not None:
            raise ConfigError(refusal)
        return opened or RunDirectory(path, None, created=False)

    def _log_start(self) -> None:
        logger.info(f"device {self.device}, precision {precision_on(self.cfg.train.precision, self.device)}, "
                    f"{model_text(self.run.model, self.cfg, self.tables)}, {self.data.train.num_rows:,} train rows, "
                    f"{counted(len(self.data.train), 'step')}/epoch, {counted(self.data.total_steps, 'step')}")

    # -- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to the end (or a signal), evaluate, write summary.json; returns the summary."""
        if self.finished is not None:
            return self._report_finished()
        try:
            with held_signals(self.env) as held:  # several ranks: a signal between agreed phases waits for the next
                return self._fit(held)
        except BaseException as e:
            close_quietly(getattr(self, "writer", None))  # before the directory may go: its thread writes there
            self.run_dir.abandon(e)  # removes the directory only if no step ran
            raise

    def _fit(self, held: GracefulStop) -> dict:
        cfg, env, run, pos = self.cfg, self.env, self.run, self.pos
        writer = open_writer(self.run_dir.path, pos.step + 1 if pos.step else None) if env.is_main else NoWriter()
        self.writer, self.counters_before = writer, compile_counters()
        # a captured step: its ordinary warm-up steps and the capture before the first throughput window
        graph_warmup = getattr(run.train_step, "warmup_steps", None)
        meter = self.meter = StepMeter(self.device, pos.step, self.stats, window=cfg.train.log_every,
                                       warmup_steps=WARMUP_STEPS if graph_warmup is None else graph_warmup + 1)
        self.target = TargetTracker(cfg.train.early_stopping, dict(self.checkpointer.extra_stats), self.stats,
                                    self.t_start, meter.loop_start, len(self.data.train), self.checkpointer.extra_stats,
                                    ended=self.early_stopped)  # (True: an early stop resumed for its summary)
        self.checkpointer.clock = self._clocks  # every checkpoint records the training and wall time up to its step
        evaluator = self.evaluator = Evaluator(run, self.data.eval, cfg, writer, self.checkpointer, self.stats, env, self.target,
                                               self._check_finite, self.meta.splits.get(cfg.data.eval_split),
                                               self._eval_tag())
        # none for a session with no step to train (a run resumed at its end, or at its early stop, for its summary):
        # its full bar was printed twice, at its start and its close, as if it trained
        idle = pos.step >= self.data.total_steps or self.early_stopped
        bar = ProgressBar(total=self.data.total_steps, initial=pos.step, desc="train", unit="step",
                          dynamic_ncols=True, disable=not env.is_main or idle, **bar_interval())
        # `bar` closed on an exception too: left open, a failed run's ERROR line was glued to the bar's line and the
        # bar, closed by the garbage collector at exit, was the log's last line (a sweep's next bar went one line down)
        with bar, make_profiler(cfg.profile, self.run_dir.path, self.device, self.data.total_steps - pos.step) as prof, \
                GracefulStop(defer=env.distributed and not env.is_main) as stop, self._training_batches() as batches:
            stop.take_over(held)  # one held before the loop, and its warning (ranks: agreed at the first window)
            for batch, data_wait in batches:
                loss = run.train_step(batch)
                for sched in run.schedulers:
                    sched.step()
                meter.step(loss, batch.global_len, data_wait)
                pos.step, pos.batch = pos.step + 1, pos.batch + 1
                self.run_dir.started()
                bar.update(1)
                if prof is not None:  # a trace's save (once a profiler cycle): left out of the throughput window
                    if profiles_step(prof):  # and the steps the profiler slowed: their window's rate is not training's
                        meter.mark_profiled()
                    with meter.paused() if saves_trace(prof) else contextlib.nullcontext():
                        prof.step()
                self._read_window(bar)  # the last logging step's, now that this step is queued behind it
                if pos.step % cfg.train.log_every == 0 or pos.step == self.data.total_steps:
                    self._queue_window(stop)
                evaluate_now = cfg.train.eval_every and pos.step % cfg.train.eval_every == 0 \
                    and pos.step != self.data.total_steps
                # not at the last step: the end saves it after the last evaluation, which it must hold (saved here
                # first, the end's save of the same step was a no-op and a resume forgot that evaluation)
                checkpoint_now = cfg.checkpoint.every and pos.step % cfg.checkpoint.every == 0 \
                    and pos.step != self.data.total_steps
                if evaluate_now or checkpoint_now or pos.step == self.data.total_steps:  # (the last step: read before
                    self._read_window(bar)  # the loader stops, not timed as training) now: the device drains anyway
                    meter.snapshot()  # the logging window so far, for the checkpoints (step-N.pt, best.pt)
                if evaluate_now:
                    # named in a profiled step (`trace_summary.AWAY`): its report is of a step without one
                    with meter.paused(), named_range("evaluation"):  # not training time: out of the throughput window
                        # a best at a checkpoint step: best.pt written after that checkpoint, a hard link to it (written
                        # before, it was a second full copy of the model)
                        self.last_eval = evaluator(pos, defer_best=bool(checkpoint_now))
                    if evaluator.should_stop:  # this step's losses logged as at a run's last step (final_train_loss)
                        self.early_stopped = True
                        if pos.step % cfg.train.log_every:  # off the logging grid: not queued above
                            self._queue_window(stop)
                        break
                if checkpoint_now:
                    # the weight check too: a read of every table, not training (`_check_finite`)
                    with meter.paused(), named_range("checkpoint"):
                        self._check_finite()  # never save a checkpoint of a diverged model
                        self.checkpointer.save(run, pos, self.stats)
                        evaluator.write_best()
                if self._stop_requested(stop):
                    break
                if pos.step == self.data.total_steps:
                    break  # no fetch past the last step: the generator's end stopped the loader inside the clock
            else:
                self._ran_out(stop)
            # The last window read and the loop's clock stopped before the loader stops: joining its threads is not
            # training, and a run stopped early (early stopping, a signal, the data running out) read that window after
            # it (with a 1 s join, that window's samples/s was 1/300 of the others'; samples_per_sec and train_s too).
            self._read_window(bar)
            bar.close()
            meter.finish()
            self._stop_loader(batches)
            self.target.session_finished()  # the evaluations' seconds within stats.train_s, for the checkpoints
            self._check_finite()
            meter.snapshot()
            # a signal after the loop's last look (it was swallowed: the run went on to its last evaluation, exit 0): as
            # one during the last step; not after an early stop, whose checkpoint a resume takes for the run's end
            if self._stop_signal or (not self.early_stopped and self._signal_after_loop(stop)):
                writer.close()
                path = self.checkpointer.save(run, pos, self.stats)
                self.run_dir.close()
                raise TrainingStopped(128 + self._stop_signal, f"stopped by signal at step {pos.step}; checkpoint {path}",
                                      agreed=True)  # (the ranks agreed on the signal: the same line on each)
        held.take_over(stop)  # one after the loop's last agreement (its deferred warning too): the next one's (lost)
        # The last evaluation, at the run's last step, unless early stopping just made it: made before the last
        # checkpoint, which then holds it, and best.pt (when it is the best) linked after, so a run resumed from that
        # checkpoint with a larger train.max_steps compares with the best that best.pt holds. At a multiple of
        # train.eval_every it is one of the periodic evaluations a longer run makes there too (early stopping counts
        # it); elsewhere it is this length's own, which a longer run does not make: it counts only as a new best
        # (made after the checkpoint, such a best rewrote best.pt unrecorded, and a resume named an older best).
        # A signal during the last evaluation or its checkpoint stops the run after both, before the baseline's fit
        # and the summary's making (left to a --resume, which makes both: fitted first, the baseline was thrown away):
        # one process at `FinishAlone.release` (stopped at once, it lost every step since the last checkpoint: all of
        # a run without checkpoint.every), several ranks at that phase's agreement (`agreed_stop`; they agreed after
        # the summary's making, and so stopped after the baseline step where one process stopped before it). One
        # during the summary's making: one process stops at once (`StopAtOnce`), several ranks agree at its end.
        stopped = lambda name: (f"stopped by signal ({name}) at step {pos.step}, after its last evaluation; "  # noqa: E731
                                f"checkpoint {self.checkpointer.last}")
        with agreed_stop(env, self.device, "after the last evaluation", stopped, held, followed=True), \
                FinishAlone(env, stopped, held.signum) as alone:
            if not self.early_stopped or self.last_eval is None:  # (None: an early stop resumed for its summary)
                on_grid = bool(cfg.train.eval_every) and pos.step % cfg.train.eval_every == 0
                # resumed at its end from a checkpoint that already holds this step's evaluation (a run killed before
                # its summary): made again for the summary, not counted a second time
                again = self.resumed_at_step == pos.step and self.checkpointer.evaluated_step == pos.step
                best_before = self.stats.best
                self.last_eval = self.evaluator(pos, defer_best=True, counted=on_grid and not again, logged=not again)
                self.final_evaluated = True
                # no step trained (see __init__): that step's checkpoint again, with this evaluation; unless it already
                # held it (`again`) and the evaluation made no new best: written again, it was a new file beside the
                # best.pt linked to the old one (the model twice on disk)
                if self.resumed_at_step == pos.step and not (again and self.stats.best is best_before):
                    self.checkpointer.last = None
            self.checkpointer.save(run, pos, self.stats)
            # the directory now holds that checkpoint: kept on a failure or stop from here (a branch resumed at its
            # end trains no step, and its agreed stop's cleanup removed the checkpoint its line named)
            self.run_dir.started()
            self.evaluator.write_best()  # a hard link to that checkpoint
            if prof is not None and env.is_main:  # the step breakdown of this session's trace, before a held stop: a
                # --resume trains no step and makes none (it said "this run wrote no trace", the trace beside it)
                # at the profiled step: the trace counts its steps from the session's first (`meter.start_step`)
                log_profile(writer, self.run_dir.path, self.device, self.meter.start_step)
            alone.release()  # (one process: the summary's making stops at once again, the checkpoint written)
        with agreed_stop(env, self.device, "before writing the summary", stopped, held, said_alone=True):
            summary = self._finish()
        self.results_written(self.run_dir.path)  # (train.py: a signal from here on stops nothing, `LateSignals`)
        if env.is_main:
            write_summary(self.run_dir.path / "summary.json", summary, sessions=True,  # a failed write names the file
                          resumed_config=self.resumed_config)
        self.run_dir.close()
        logger.info(final_line(summary) + baseline_clause(summary))
        return summary

    def _clocks(self) -> None:
        """The run's clocks up to now, for the checkpoint being written: training time, and the wall clock (W)."""
        self.meter.update_train_s()
        self.target.update_wall()

    def _batches(self) -> Iterator[tuple[Batch, float]]:
        """(batch, seconds waited for it: the host's on the CPU; 0 on CUDA, where the meter's `DataWaitTimer` times
        the device's idle time) from the current position to the run's end, epoch by epoch."""
        pos, loader = self.pos, self.data.train
        # the named range costs a few microseconds a step: only when a profiler records it
        data_range = (lambda: record_function("data")) if self.cfg.profile.enabled else contextlib.nullcontext
        for epoch in range(pos.epoch, self.data.epochs):
            if pos.step >= self.data.total_steps or self.early_stopped:  # (a resumed early stop: no step)
                return
            if epoch != pos.epoch:
                pos.epoch, pos.batch = epoch, 0
            loader.set_epoch(epoch, start_batch=pos.batch)
            batches = iter(loader)
            try:
                while pos.step < self.data.total_steps:
                    with data_range():  # the device's idle time while the host waits (`DataWaitTimer`)
                        batch, waited = self.meter.wait_timer.fetch(lambda: next(batches, None))
                    if batch is None:
                        break
                    yield batch, waited
            finally:
                batches.close()  # stops the loader's thread when the run ends an epoch early (`_stop_loader`)

    @contextlib.contextmanager
    def _training_batches(self) -> Iterator[Iterator[tuple[Batch, float]]]:
        """`_batches`, whose loader stops when the block ends, a failure's too (the loop stops it earlier, as soon as
        its clock stopped: `_stop_loader`)."""
        batches = self._batches()
        try:
            yield batches
        finally:
            self._stop_loader(batches)

    def _stop_loader(self, batches: Iterator) -> None:
        """Stop the training loader: the epoch in flight's thread and one decoding the next epoch ahead (chain_epochs);
        both idempotent."""
        batches.close()
        if hasattr(self.data.train, "close"):
            self.data.train.close()

    def _ran_out(self, stop: GracefulStop) -> None:
        """The loader ended before the run's last step (it yielded fewer batches than its length said): said, and the
        steps since the last logging step logged as the run's last window (none queued them: their loss was in no
        log, TensorBoard point or final_train_loss, and their time in no samples/s)."""
        pos, total = self.pos, self.data.total_steps
        if self.meter.steps_done == 0 or pos.step >= total:  # no step trained (a run resumed at its end)
            return
        # (every rank's loader ends alike: rank 0 says it, not each rank once more as `[rank N]`)
        run_logger.warning(f"data: the training loader ended at step {pos.step} (epoch {pos.epoch}), before the run's "
                       f"{counted(total, 'step')}: the run ends there")
        if pos.step % self.cfg.train.log_every:
            self._queue_window(stop)

    early_stopped = False
    finished_early = False  # the checkpoint resumed is where early stopping ended the run (`__init__`)
    finished_target: Optional[str] = None  # ... where it reached train.early_stopping.target: how (`__init__`)
    final_evaluated = False  # the run's last evaluation was made before its last checkpoint (`_fit`)
    resumed_config: Optional[dict] = None  # the config of the checkpoint this session resumed (`_start`)
    last_eval: Optional[dict] = None  # the metrics of an evaluation at the current step
    results_written: Callable[[Path], None] = staticmethod(lambda run_dir: None)  # (`train`'s)

    # -- the end ----------------------------------------------------------------------------------

    def _finish(self) -> dict:
        cfg, env, writer = self.cfg, self.env, self.writer
        # the last evaluation, unless early stopping just made it at this step
        metrics = self.last_eval if self.early_stopped or self.final_evaluated else self.evaluator(self.pos)
        counters = {k: v - self.counters_before[k] for k, v in compile_counters().items()}
        if self.run.config.train.compile.enabled:
            logger.info(f"torch.compile: {counters['graphs']} graphs compiled, {counters['graph_breaks']} graph breaks")
        # the linear model on the same split, loader and hashing, when train.baseline asks (dlrm.train.baseline)
        # its scalars beside the evaluations' curve: baseline/<split>/* where they are eval/<split>/* (`_eval_tag`)
        tag = "baseline" + self.evaluator.tag[len("eval"):]
        baseline = run_baseline(cfg, self.meta, self.tables, self.device, env.world_size, writer, self.pos.step, tag)
        summary = {**self._summary(metrics, counters, baseline), **self.target.summary(self.pos.step, self.stats.best)}
        check_logloss(summary, self.meta, writer, self.evaluator.tag)  # vs predicting the train click rate: a flag
        # at the last step (an extended run's come after); the multi-hot sizes and settings the run trained with
        log_hparams(writer, cfg, self.data.batch_size, metrics, self.pos.step, self.tables.multi_hot_sizes, summary["resolved"])
        writer.close()
        return summary

    def _summary(self, metrics: dict, counters: dict, baseline: Optional[dict] = None) -> dict:
        d, stats, device = self.cfg.data, self.stats, self.device
        return {
            **metrics, "split": d.eval_split, "steps": self.pos.step,
            "samples": stats.samples,  # the whole run, across resumes
            "samples_per_sec": self.meter.samples_per_sec,  # this session's steady state
            "data_wait_fraction": self.meter.data_wait_fraction, "warmup_s": self.meter.warmup_s,
            "train_s": stats.train_s,  # the whole run's training seconds, across resumes
            "wall_s": time.perf_counter() - self.t_start,  # this session's wall clock, everything included
            "final_train_loss": stats.train_losses[-1][1] if stats.train_losses else None,
            "train_losses": stats.train_losses,
            "best": stats.best,  # the best evaluation (step, metrics, best.pt); the top-level metrics are the last
            "best_checkpoint": (stats.best or {}).get("checkpoint"),
            "early_stopped": self.early_stopped, "batch_size": self.data.batch_size,
            "resumed_from": str(self.resume_from) if self.resume_from is not None else None,
            "resumed_at_step": self.resumed_at_step,  # the step this session started from (None: not resumed)
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "compile": counters, "fast_path": self.run.fast_path,  # what each "auto" setting became on this device, and why
            "resolved": resolved_settings(self.run, self.cfg, self.data, self.tables, self.placement, device,
                                          self.env.world_size, baseline is not None),  # what this session trained with
            "device": str(device), "device_name": device_name(device), "versions": versions(),
            "oracle_auc": self.meta.extra.get("oracle_auc", {}).get(d.eval_split),
            "checkpoint": str(self.checkpointer.last), "run_dir": str(self.run_dir.path),
            "config": self.cfg.to_dict(), "world_size": self.env.world_size, "baseline": baseline,
        }

    def _report_finished(self) -> dict:
        """Resuming a run that already reached its end: say so, write nothing, return its summary."""
        run_dir = run_of(self.finished) or self.finished.resolve().parent.parent
        if self.finished_early:
            logger.info(f"--resume: {self.finished} is where early stopping ended this run (train.early_stopping: "
                        f"{counted(self.stats.evals_since_best, 'evaluation')} without improvement); nothing to train, "
                        f"nothing written")
        elif self.finished_target is not None:
            logger.info(f"--resume: {self.finished} is where this run reached its target (train.early_stopping."
                        f"target: {self.finished_target}); nothing to train, nothing written")
        else:
            logger.info(f"--resume: {self.finished} is at step {self.data.total_steps} or later, the end of this run "
                        f"(train.epochs / train.max_steps); nothing to train, nothing written")
        path = run_dir / "summary.json"
        summary = {}
        if path.is_file():
            try:
                summary = read_json(path, SUMMARY_LIMIT)
            except (OSError, ValueError):
                summary = {}
        return {**summary, "checkpoint": os.path.abspath(self.finished), "run_dir": os.path.abspath(run_dir), "finished": True}


def train(cfg: Config, run_dir: Optional[Path] = None, resume: Optional[str] = None,
          allow_config_change: Sequence[str] = (), results_written: Optional[Callable[[Path], None]] = None) -> dict:
    """Train a DLRM as `cfg` says; returns the summary also written to summary.json (see `Trainer`).
    `results_written(run directory)`: called as summary.json, the run's last output, is about to be written."""
    with StopAtOnce(), dataset_held(cfg), run_hold():  # SIGTERM outside the steps: cleanup; data held; ranks: held
        trainer = Trainer(cfg, run_dir, resume, allow_config_change)
        trainer.results_written = results_written or trainer.results_written
        return trainer.fit()
