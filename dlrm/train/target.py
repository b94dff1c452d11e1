"""``train.early_stopping.target``: stop at the first evaluation whose metric reaches a quality target.

MLPerf's time to train: DLRM-DCNv2 stops at validation AUC >= 0.80275, evaluated 20 times an epoch. With
metric auc the target is reached at AUC >= target, with logloss at logloss <= target. The evaluator asks
`TargetTracker.observe` after each evaluation; the run then stops as an early stop does (checkpoint, best.pt).

Time to target: T, the seconds of training (the training loops of this and earlier sessions, evaluations
excluded), and W, the wall-clock seconds (each session's from its start, start-up, evaluations and checkpoints
included: earlier sessions' up to the checkpoint this one resumed, which records them as ``run_stats.wall_s``; the
time a killed session spent after its last checkpoint is lost work, redone and counted by the next). W added earlier
sessions' training loops (T's measure) to this session's wall clock, a sum of two clocks. The evaluations' seconds
are kept in the checkpoint's ``run_stats.eval_s`` (those inside its ``train_s``), the reached target in
``run_stats.target``, so a resume continues the clocks and knows that the run already ended there. A checkpoint
written before ``wall_s`` was recorded continues W from its ``train_s`` (the nearest it knows).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.logging_setup import counted
from dlrm.train.meter import RunStats

NAMES = {"auc": "AUC", "logloss": "logloss"}


def meets(metric: str, value: Any, target: Optional[float]) -> bool:
    """Whether `value` of `metric` reaches `target` (AUC: at or above it; logloss: at or below; NaN never)."""
    if target is None or isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    return value >= target if metric == "auc" else value <= target


def already_reached(early, carried: dict, stats: RunStats) -> Optional[str]:
    """Why a resumed run whose checkpoint holds `carried` (its run_stats' extras) and `stats` already reached this
    run's target (`early`, ``train.early_stopping``), or None: the target it recorded reaching, or a best evaluation
    that reaches it (a target set since, allowed by --allow-config-change)."""
    if early is None or early.target is None:
        return None
    name = NAMES[early.metric]
    rec = carried.get("target")
    if isinstance(rec, dict) and rec.get("metric") == early.metric and meets(early.metric, rec.get("value"),
                                                                             early.target):
        return f"{name} {rec['value']:.5f} reached target {early.target} at step {rec.get('step')}"
    best = stats.best
    if best is not None and best.get("metric") == early.metric and meets(early.metric, best.get(early.metric),
                                                                         early.target):
        return f"its best {name} {best[early.metric]:.5f} (step {best.get('step')}) reaches target {early.target}"
    return None


class TargetTracker:
    """Watches the evaluations for ``train.early_stopping.target`` and keeps the time-to-target clock.

    Args:
        early: ``train.early_stopping`` (None, or its target None: nothing to watch; the clock still runs).
        carried: the resumed checkpoint's run_stats extras (``eval_s``, ``target``), or {}.
        stats: the run's totals (``train_s``: earlier sessions' training loops).
        t_start, loop_start: this session's start and its training loop's (``time.perf_counter``).
        steps_per_epoch: for the epoch the target was reached in.
        extra: the checkpointer's dict of run_stats extras, kept up to date here (written in every checkpoint).
        ended: this session only makes the summary of a run that ended at the resumed checkpoint (`Trainer._start`).
    """

    def __init__(self, early, carried: dict, stats: RunStats, t_start: float, loop_start: float,
                 steps_per_epoch: int, extra: dict, ended: bool = False) -> None:
        self.metric = early.metric if early is not None else "auc"
        self.target = early.target if early is not None else None
        self.prior_train_s, self.t_start, self.loop_start = stats.train_s, t_start, loop_start
        self.steps_per_epoch, self.extra = max(steps_per_epoch, 1), extra
        self.eval_s_before = float(carried.get("eval_s") or 0.0)  # within stats.train_s
        # earlier sessions' wall clock up to the resumed checkpoint (none recorded: its training time, the nearest)
        wall = carried.get("wall_s")
        self.wall_s_before = float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) \
            else float(stats.train_s)
        self.session_eval_s = 0.0
        self.reached: Optional[dict] = None
        self.just_reached = False
        self.loop_ended = False
        extra["eval_s"], extra["wall_s"] = self.eval_s_before, self.wall_s_before
        rec = carried.get("target")
        if ended and isinstance(rec, dict) and rec.get("metric") == self.metric \
                and meets(self.metric, rec.get("value"), self.target):
            # the run's time to target is the one recorded: its final evaluation here, of the same model, took for a
            # first reaching, reported this session's clock (the wall time restarted at the resume)
            self.reached = dict(rec)
        else:
            extra.pop("target", None)  # a target the run reaches again (an allowed other target) is this session's

    def observe(self, pos: ckpt.Position, metrics: dict, eval_s: float, writer) -> None:
        """After the evaluation at `pos` (which took `eval_s`): record the target when this is the first to reach it."""
        self.session_eval_s += eval_s
        if not self.loop_ended:  # within the train_s a checkpoint now records (`StepMeter.update_train_s`): so is eval_s
            self.extra["eval_s"] = self.eval_s_before + self.session_eval_s
        if self.reached is not None or not meets(self.metric, metrics.get(self.metric), self.target):
            return
        now = time.perf_counter()
        train_s = self.prior_train_s - self.eval_s_before + (now - self.loop_start) - self.session_eval_s
        wall_s = self.wall_s_before + (now - self.t_start)
        self.reached = {"metric": self.metric, "target": self.target, "value": float(metrics[self.metric]),
                        "step": pos.step, "epoch": pos.step / self.steps_per_epoch, "train_s": train_s,
                        "wall_s": wall_s}
        self.just_reached = True
        self.extra["target"] = dict(self.reached)
        writer.add_scalar("train/time_to_target_s", train_s, pos.step)
        logger.info(f"reached target {NAMES[self.metric]} {self.target} at step {pos.step} "
                    f"(epoch {self.reached['epoch']:.2f}) after {train_s:.1f} s of training (evaluation time "
                    f"excluded) / {wall_s:.1f} s wall ({NAMES[self.metric]} {self.reached['value']:.5f})")

    def update_wall(self) -> None:
        """Bring ``run_stats.wall_s`` (the checkpoints' record of W's clock) up to now; called as a checkpoint is
        written (`Checkpointer.clock`)."""
        self.extra["wall_s"] = self.wall_s_before + (time.perf_counter() - self.t_start)

    def session_finished(self) -> None:
        """The training loop ended (``stats.train_s`` now holds this session): so does ``eval_s`` (the last
        evaluation, after the loop, is in neither)."""
        self.extra["eval_s"] = self.eval_s_before + self.session_eval_s
        self.loop_ended = True

    def summary(self, steps: int, best: Optional[dict]) -> dict:
        """summary.json's keys (None without a target); logs a run that ended without reaching it."""
        if self.target is None:
            return {"target_reached": None, "target_step": None, "time_to_target_s": None,
                    "time_to_target_wall_s": None}
        if self.reached is None:
            shown = f"; best {best[self.metric]:.5f} at step {best['step']}" \
                if best and best.get("metric") == self.metric else ""
            logger.info(f"target {NAMES[self.metric]} {self.target} not reached in {counted(steps, 'step')}{shown}")
            return {"target_reached": False, "target_step": None, "time_to_target_s": None,
                    "time_to_target_wall_s": None}
        return {"target_reached": True, "target_step": self.reached.get("step"),
                "time_to_target_s": self.reached.get("train_s"), "time_to_target_wall_s": self.reached.get("wall_s")}
