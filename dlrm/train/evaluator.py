"""Evaluation during and after training: metrics, the best evaluation's checkpoint, early stopping.

Every evaluation is logged to TensorBoard (``eval/*``). The best one so far (by
``train.early_stopping.metric``, AUC when early stopping is off) is remembered in the run's
`RunStats` (so it survives a resume) and its model is written as ``checkpoints/best.pt``, which
``--eval-only`` and ``--export`` use when given the run directory. With ``train.early_stopping``,
training stops after `patience` evaluations in a row without an improvement of more than
`min_delta`, or (``target``, `dlrm.train.target`) at the first evaluation that reaches the target.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from loguru import logger

from dlrm.config import Config
from dlrm.distributed.env import DistEnv
from dlrm.errors import ConfigError, DatasetError, NonFiniteLoss
from dlrm import checkpoint as ckpt
from dlrm.logging_setup import ProgressBar, bar_interval, counted, run_logger
from dlrm.train.builder import Run
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.meter import RunStats
from dlrm.train.metrics import evaluate_logits
from dlrm.train.reporting import NoWriter, log_eval
from dlrm.train.target import TargetTracker

# Seconds an evaluation runs before its progress bar appears (a long split streamed from parquet: MLPerf's 89M
# validation rows; the training bar stands still meanwhile). Into a file or pipe a bar is drawn once a minute at most.
EVAL_BAR_DELAY_S = 5.0


def evaluate(forward, loader, env: DistEnv = DistEnv()) -> dict[str, float]:
    """AUC, logloss and accuracy over the whole split (logits gathered on the device, one sync);
    in a distributed run over every rank's rows, the same numbers on every rank.

    An evaluation longer than `EVAL_BAR_DELAY_S` shows a progress bar (rank 0's batches: rate and ETA), removed when
    it ends on a terminal (into a file, drawn once a minute, its last copy stays); a shorter one, most (a split in GPU
    memory takes about a second), shows nothing."""
    forward.model.eval()
    logits, labels = [], []
    interval = bar_interval()  # {} on a terminal
    # its total: tqdm's len(loader), which a loader of unknown length (a DataLoader over an IterableDataset) fails with
    # a TypeError that tqdm catches (a bar without a total) and `hasattr(loader, "__len__")` did not. Left in a file:
    # removed there, the bar (on the training bar's line, position 0) wrote blanks over that line, an empty line in
    # the log where the training's progress and the evaluation's were
    with ProgressBar(loader, desc="eval", unit="batch", leave=bool(interval), dynamic_ncols=True,
                     disable=not env.is_main, delay=EVAL_BAR_DELAY_S, **interval) as bar:
        for batch in bar:
            logits.append(batch.real(forward(batch)))  # a padding row (Batch.pad) is not the split's
            labels.append(batch.real(batch.labels))
    forward.model.train()
    if not logits:  # torch.cat's "expected a non-empty list of Tensors" traceback (--eval-only on an empty split)
        raise DatasetError(f"{_split_name(loader)}: the evaluation split holds no rows; nothing to evaluate")
    return evaluate_logits(env.all_gather_rows(torch.cat(logits)), env.all_gather_rows(torch.cat(labels)))


def _split_name(loader) -> str:
    """The evaluation split's directory, from its loader's files (or "the evaluation split")."""
    files = getattr(loader, "files", None)
    return str(Path(files[0]).parent) if files else "the evaluation split"


class Evaluator:
    """Evaluates `run` on `loader`, keeps the best evaluation's checkpoint and decides early stops.

    Args:
        run: the run's parts (its ``eval_forward`` is used).
        loader: the evaluation split.
        cfg: the run's config (``train.early_stopping``).
        writer: TensorBoard writer.
        checkpointer: writes best.pt.
        stats: the run's totals; ``stats.best`` and ``stats.evals_since_best`` are updated here.
        env: the process group.
        target: watches ``train.early_stopping.target`` (`dlrm.train.target`), or None.
        stop_if_diverged: the trainer's loss and weight checks, or None: when given, an evaluation whose logloss is
            NaN or Inf (some logit is: the model diverged) calls it (it names a NaN loss's step or a NaN/Inf weight),
            then raises `NonFiniteLoss`, before the evaluation is recorded or written as best.pt; also called before
            a new best's best.pt is written here (not deferred).
        split: the evaluation split's metadata (`SplitInfo`: rows, positives), or None. A split of one class has no
            AUC (NaN): early stopping on AUC is refused (ConfigError), and without early stopping the best evaluation
            is the one of the lowest logloss (by the undefined AUC every evaluation was "best": best.pt the latest).
        tag: the TensorBoard prefix of the evaluations' scalars (``eval``; ``eval/<split>`` for another split than
            the one the run's ``eval/*`` curve is of: `dlrm.train.trainer.Trainer._eval_tag`).
    """

    def __init__(self, run: Run, loader, cfg: Config, writer, checkpointer: Checkpointer, stats: RunStats,
                 env: DistEnv = DistEnv(), target: Optional[TargetTracker] = None,
                 stop_if_diverged: Optional[Callable[[], None]] = None, split=None, tag: str = "eval") -> None:
        self.run, self.loader, self.writer, self.env, self.target = run, loader, writer, env, target
        self.tag = tag
        self.stop_if_diverged = stop_if_diverged
        self.checkpointer, self.stats = checkpointer, stats
        self.early = cfg.train.early_stopping
        self.metric = self.early.metric if self.early else "auc"
        self.min_delta = self.early.min_delta if self.early else 0.0
        if split is not None and split.rows > 0 and split.positives in (0, split.rows) and self.metric == "auc":
            one_class = (f"data.eval_split {cfg.data.eval_split!r} holds one class ({split.rows:,} rows, "
                         f"{split.positives:,} positives): its AUC is undefined")
            if self.early is not None:  # a patience that never ran out, a target never reached: trained to the end
                raise ConfigError(f"train.early_stopping.metric 'auc': {one_class}; use metric 'logloss' or another "
                                  f"split")
            self.metric = "logloss"
            run_logger.warning(f"{one_class}; the best evaluation (best.pt) is the one of the lowest logloss")
        if getattr(loader, "num_rows", None) == 0:
            # said before training: found at the end, the run's last evaluation raised a traceback and the training
            # since the last checkpoint was lost (the last checkpoint is saved after that evaluation)
            raise DatasetError(f"{_split_name(loader)}: data.eval_split {cfg.data.eval_split!r} holds no rows; "
                               f"nothing to evaluate (choose another split)")

    _pending_best: Optional[ckpt.Position] = None  # a best evaluation whose best.pt `write_best` writes

    def __call__(self, pos: ckpt.Position, defer_best: bool = False, counted: bool = True,
                 logged: bool = True) -> dict[str, float]:
        """Evaluate at `pos`: log, and keep best.pt when this is the best evaluation so far.

        `defer_best`: record the evaluation in ``stats`` now and write best.pt in `write_best`, after the step's
        checkpoint (which then holds this evaluation, and which best.pt links to).
        `counted`: False for an evaluation off the ``train.eval_every`` grid (a run's last, at a ``train.max_steps``
        that is not a multiple): one without improvement is not counted towards early stopping's patience (a longer
        run makes no evaluation there; a resume would stop earlier than it); a new best is recorded all the same (kept
        as best.pt), while patience goes on comparing the grid's evaluations with the grid's best (`RunStats.grid_best`).
        `logged`: False for an evaluation TensorBoard already holds (a run resumed at its end, whose last checkpoint
        holds that step's evaluation): a second ``eval/*`` point at the same step drew a vertical segment."""
        t = time.perf_counter()
        writer = self.writer if logged else NoWriter()
        metrics = log_eval(writer, evaluate(self.run.eval_forward, self.loader, self.env), pos.step, self.tag)
        if self.target is not None:  # before the best: best.pt's run_stats then record a target it reached
            self.target.observe(pos, metrics, time.perf_counter() - t, writer)
        self.checkpointer.evaluated_step = pos.step  # a checkpoint at this step holds this evaluation
        improves = self._improves(metrics[self.metric])
        # early stopping compares the grid's evaluations with the grid's best: an off-grid best (a session's last
        # evaluation, at a max_steps that is not a multiple) is kept, but a longer run makes no evaluation there, and
        # compared with it a resume counted the uninterrupted run's gains as none and stopped before it did
        grid = self.stats.best if self.stats.grid_best is None else self.stats.grid_best
        grid_gain = counted and self.stats.grid_best is not None and self._gain(metrics[self.metric], grid)
        if self.stop_if_diverged is not None and not math.isfinite(metrics["logloss"]):
            # a model that diverged between the loss checks (which see only logging windows, checkpoints and the end:
            # its first evaluation wrote it as best.pt), or whose finite weights overflow its outputs (a huge learning
            # rate: the run finished "successfully", AUC null). Finite logits always give a finite logloss, also on a
            # one-class split (whose AUC alone is NaN).
            self.stop_if_diverged()  # a NaN loss's step or a NaN/Inf weight, named first
            raise NonFiniteLoss(f"evaluation at step {pos.step}: logloss {metrics['logloss']} (the model's outputs are "
                                f"NaN or Inf: it diverged); stopped; {self.checkpointer.last_good(self.stats.best)}")
        if improves and not defer_best and self.stop_if_diverged is not None:
            # best.pt now: never of a NaN/Inf weight that this evaluation did not read (an overflowed embedding row
            # that no evaluation row looks up; its metrics finite). A deferred one follows the checkpoint's own check
            self.stop_if_diverged()
        if improves:
            # the totals first: best.pt stores them, and a run resumed from it (--resume .../best.pt --run-name NEW)
            # must take this evaluation as its best (with the previous best it kept a worse later one as best.pt)
            self.stats.best = {"step": pos.step, "metric": self.metric, **metrics,
                               "checkpoint": str(self.checkpointer.best_path)}
            if counted:
                self.stats.grid_best, self.stats.evals_since_best = None, 0
            else:  # the grid's best stays what it was ({}: none yet), and so does the count
                self.stats.grid_best = {} if grid is None else grid
            if defer_best:  # (written after the step's checkpoint, whose check looks at the weights first)
                self._pending_best = ckpt.Position(pos.step, pos.epoch, pos.batch)
            else:
                self.checkpointer.save_best(self.run, pos, self.stats)
        elif grid_gain:  # a gain over the grid's best: the uninterrupted run's new best (best.pt keeps the better)
            self.stats.grid_best = {"step": pos.step, "metric": self.metric, self.metric: metrics[self.metric]}
            self.stats.evals_since_best = 0
        elif counted:
            self.stats.evals_since_best += 1
        return metrics

    def write_best(self) -> None:
        """Write the best.pt that a ``defer_best`` evaluation left to write, if any."""
        if self._pending_best is not None:
            pos, self._pending_best = self._pending_best, None
            self.checkpointer.save_best(self.run, pos, self.stats)

    def _improves(self, value: float) -> bool:
        return self._gain(value, self.stats.best)

    def _gain(self, value: float, best: Optional[dict]) -> bool:
        """Whether `value` improves on the evaluation `best` (None or {}: there is none)."""
        # a NaN best (AUC of a one-class split or of NaN logits, logloss of an overflowed model) is no best: nothing
        # compares above it
        if best is None or best.get("metric") != self.metric or math.isnan(best[self.metric]):
            return True
        gain = value - best[self.metric] if self.metric == "auc" else best[self.metric] - value
        return gain > self.min_delta

    @staticmethod
    def patience_ran_out(early, stats: RunStats) -> bool:
        """Whether early stopping (`early`, ``train.early_stopping``) already stopped the run whose totals are
        `stats`: its last `patience` evaluations of this metric did not improve (a resume then has nothing to do)."""
        best = stats.best
        # patience null: no plateau stop (the run stops at its target only)
        return (early is not None and early.patience is not None and best is not None
                and best.get("metric") == early.metric and stats.evals_since_best >= early.patience)

    @property
    def should_stop(self) -> bool:
        """Early stopping's patience ran out, or the last evaluation reached its target (logged there); never
        without ``train.early_stopping``."""
        if self.target is not None and self.target.just_reached:
            return True
        if self.early is None or self.early.patience is None or self.stats.evals_since_best < self.early.patience:
            return False
        best = self.stats.best
        logger.info(f"early stopping: no {self.metric} improvement above {self.min_delta} in "
                    f"{counted(self.stats.evals_since_best, 'evaluation')}; best {best[self.metric]:.4f} at step {best['step']}")
        return True
