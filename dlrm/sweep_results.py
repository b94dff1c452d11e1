"""A sweep's results (`SettingResult`: the trials of one setting) and its verdict (`verdict`: which setting won, by
how much, against the seed noise), as `dlrm.sweep` ranks and reports them (re-exported there)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from dlrm.train.metric_text import auc_text

NOISE_FACTOR = 2.0
"""A margin counts as more than seed noise when it is at least this many standard errors."""


def label(setting: dict[str, Any]) -> str:
    """``key=value`` pairs of a setting, for tables and logs ("defaults" when nothing is set)."""
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in setting.items()) or "defaults"


@dataclass
class SettingResult:
    """The trials of one setting: one summary per seed, in seed order."""

    index: int
    setting: dict[str, Any]
    summaries: list[dict] = field(default_factory=list)  # the trials that finished, in seed order
    failed: dict[int, str] = field(default_factory=dict)  # seed -> why that trial failed

    def values(self, key: str) -> list[float]:
        return [math.nan if s[key] is None else float(s[key]) for s in self.summaries]  # null: NaN in summary.json

    def baseline_aucs(self) -> list[float]:
        aucs = [s["baseline"]["auc"] for s in self.summaries if s.get("baseline")]
        return [math.nan if a is None else float(a) for a in aucs]

    @property
    def complete(self) -> bool:
        """Every trial finished: only such settings take part in the verdict (the per-seed pairing needs every seed,
        and a setting that failed on a seed, a diverged one say, is no safe pick)."""
        return bool(self.summaries) and not self.failed

    @property
    def auc_mean(self) -> float:
        return _mean(self.values("auc"))

    def mean_auc_text(self) -> str:
        """The mean AUC for the verdict: "n/a (one class)" where a trial's was undefined (it read "nan")."""
        losses = [s.get("logloss") for s in self.summaries]
        return auc_text({"auc": self.auc_mean, "logloss": _mean([math.nan if v is None else v for v in losses])})

    def rank_key(self) -> tuple[bool, bool, float]:
        """Sort key, best first with ``reverse=True``: a setting with a failed trial ranks after those whose trials
        all finished; a NaN mean AUC (a trial's AUC was NaN) ranks last (NaN compares False with everything, so
        sorting by it alone leaves the order arbitrary)."""
        mean = self.auc_mean
        return (self.complete, not math.isnan(mean), mean if not math.isnan(mean) else 0.0)

    def trials(self) -> list[tuple[int, Optional[dict], Optional[str]]]:
        """(seed, summary or None, failure reason or None) for every trial, in seed order."""
        done = iter(self.summaries)
        return [(seed, None, self.failed[seed]) if seed in self.failed else (seed, next(done), None)
                for seed in range(len(self.summaries) + len(self.failed))]

    def row(self) -> dict[str, Any]:
        """The setting's line of sweep.csv (its means over the trials that finished)."""
        aucs, losses, base = self.values("auc"), self.values("logloss"), self.baseline_aucs()
        return {"setting": label(self.setting), **{k: json.dumps(v) for k, v in self.setting.items()},
                "seeds": len(aucs), "failed": len(self.failed), "auc_mean": _mean(aucs), "auc_std": _std(aucs),
                "logloss_mean": _mean(losses), "logloss_std": _std(losses),
                "baseline_auc_mean": statistics.fmean(base) if base else None,
                "aucs": " ".join(f"{a:.4f}" for a in aucs)}


def _mean(values: list[float]) -> float:
    """The mean; NaN when no trial finished (`statistics.fmean` raises on an empty list)."""
    return statistics.fmean(values) if values else math.nan


def _std(values: list[float]) -> float:
    """Sample standard deviation; NaN where it is undefined: for fewer than two values (one seed measures no spread:
    it was 0.0, shown as "0.0000" in sweep.md and sweep.csv and as ``sweep/auc_std`` in TensorBoard, as if the seeds
    had agreed), and when a value is NaN or infinite (`statistics.stdev` raises AttributeError on a NaN in Python
    3.11, which ended a sweep with a diverged trial before its tables). The report shows NaN as "n/a", an empty cell
    and no scalar."""
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return math.nan
    return statistics.stdev(values)


@dataclass
class Verdict:
    """Which setting won, by how much, and how that compares with the seed noise."""

    winner: SettingResult
    runner_up: Optional[SettingResult]
    margin: Optional[float]  # mean AUC difference, winner - runner-up
    noise: Optional[float]  # standard error of the paired per-seed differences
    left_out: int = 0  # settings with a failed trial, not compared
    others: tuple = ()  # the compared settings after the runner-up (named where no setting has an AUC)

    @property
    def tie(self) -> bool:
        """The winner and the runner-up have one mean AUC (to rounding): the grid's order alone put one first."""
        return self.margin is not None and math.isclose(self.margin, 0.0, abs_tol=1e-12)

    @property
    def paired_seeds(self) -> int:
        """The seeds the winner and the runner-up were both trained with: the paired differences the noise is of."""
        return 0 if self.runner_up is None else min(len(self.winner.summaries), len(self.runner_up.summaries))

    @property
    def noise_measured(self) -> bool:
        """Whether there is a seed noise to compare the margin with: two paired seeds or more, and a finite standard
        error above 0 (equal per-seed differences give 0, no spread: any margin was "beyond" it)."""
        return (self.paired_seeds >= 2 and self.noise is not None and math.isfinite(self.noise)
                and self.noise > 0.0)

    @property
    def beyond_noise(self) -> Optional[bool]:
        """Whether the margin is at least `NOISE_FACTOR` standard errors; None where that cannot be said: no runner-up,
        a NaN margin, or no noise measured (one seed, or per-seed differences all equal: a margin is not "beyond" a
        noise of 0 that no spread measured; it read True, while `text` said there was nothing to compare with)."""
        if self.margin is None or math.isnan(self.margin):
            return None
        if self.tie:  # (with equal per-seed AUCs, a margin of 0 was ">= 2 x" a noise of 0)
            return False
        if not self.noise_measured:
            return None
        return self.margin >= NOISE_FACTOR * self.noise

    def _no_auc_text(self) -> str:
        """No winner when no setting has a mean AUC (a one-class validation split, or NaN scores); the mean loglosses
        said beside it, lowest first, as a trial's own best checkpoint falls back to its logloss."""
        ranked = sorted([r for r in (self.winner, self.runner_up) if r is not None] + list(self.others),
                        key=lambda r: (math.isnan(m := _mean(r.values("logloss"))), m))
        losses = ", ".join(f"{label(r.setting)} {_mean(r.values('logloss')):.4f}" for r in ranked)
        return ("no winner: no setting has an AUC (a trial's validation split has one class, or its scores are NaN); "
                f"mean validation logloss, lowest first: {losses}"
                + (f" ({self.left_out} setting(s) with a failed trial left out)" if self.left_out else ""))

    def _of_seeds(self) -> str:
        """"mean of N seeds", or "one seed" (one value is no mean: it read "mean of 1 seeds")."""
        n = len(self.winner.summaries)
        return "one seed" if n == 1 else f"mean of {n} seeds"

    def text(self) -> str:
        if self.runner_up is not None and math.isnan(self.winner.auc_mean):  # NaN ranks last: every setting's is NaN,
            # and the grid's order alone put one first ("best: x=4 (AUC n/a ...)"; in the other order "best: x=8")
            return self._no_auc_text()
        sep = ", " if len(self.winner.summaries) == 1 else " "
        head = f"best: {label(self.winner.setting)} (AUC {self.winner.mean_auc_text()}{sep}{self._of_seeds()})"
        if self.runner_up is None:
            return head + ("; the only setting whose trials all finished" if self.left_out else "; the only setting")
        if self.tie:  # "best: x=1 (...), +0.0000 AUC over x=2": a winner named by the grid's order
            return (f"no winner: {label(self.winner.setting)} and {label(self.runner_up.setting)} tie at AUC "
                    f"{self.winner.mean_auc_text()} ({self._of_seeds()})"
                    + (f" ({self.left_out} setting(s) with a failed trial left out)" if self.left_out else ""))
        margin = "AUC margin n/a" if math.isnan(self.margin) else f"{self.margin:+.4f} AUC"  # (it read "+nan AUC")
        text = f"{head}, {margin} over {label(self.runner_up.setting)} ({self.runner_up.mean_auc_text()})"
        if self.left_out:
            text += f" ({self.left_out} setting(s) with a failed trial left out)"
        if math.isnan(self.margin):
            return text + ("; a trial's AUC is NaN (a one-class validation split, or NaN scores): "
                           "no margin to compare with the seed noise")
        if self.paired_seeds < 2:  # (whatever noise a caller passed: one difference has no spread)
            return text + "; one seed: no estimate of the seed noise (use --seeds 3 or more)"
        if self.noise is None or not math.isfinite(self.noise):
            return text + "; no estimate of the seed noise"
        if self.noise == 0.0:
            return text + "; the per-seed differences are all equal (no spread to compare with)"
        ratio = self.margin / self.noise
        verdict = "beyond" if self.beyond_noise else "within"
        return (text + f"; seed noise (standard error of the paired differences) {self.noise:.4f}: "
                f"{ratio:.1f}x, {verdict} the noise (>= {NOISE_FACTOR:g}x counts)")


def verdict(results: list[SettingResult]) -> Verdict:
    """The winner by mean AUC, its margin over the runner-up and the paired standard error.

    Example:
        >>> r = [SettingResult(0, {"a": 1}, [{"auc": 0.70}, {"auc": 0.72}]),
        ...      SettingResult(1, {"a": 2}, [{"auc": 0.71}, {"auc": 0.74}])]
        >>> v = verdict(r); v.winner.setting, round(v.margin, 4), round(v.noise, 4)
        ({'a': 2}, 0.015, 0.005)
    """
    ranked = sorted(results, key=SettingResult.rank_key, reverse=True)
    winner = ranked[0]
    if len(ranked) == 1:
        return Verdict(winner, None, None, None)
    second = ranked[1]
    diffs = [a - b for a, b in zip(winner.values("auc"), second.values("auc"))]
    noise = _std(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return Verdict(winner, second, winner.auc_mean - second.auc_mean, noise, others=tuple(ranked[2:]))
