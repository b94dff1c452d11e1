"""Offline metrics and throughput numbers (audit helper, session 67): the evaluation's AUC, logloss and accuracy
against a float64 reference written here (exact Mann-Whitney AUC, ties counted half), and the logging windows' rates
on CUDA's clock when a pause falls between a window's cut and its read."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dlrm.train import meter as meter_mod
from dlrm.train.meter import RunStats, StepMeter
from dlrm.train.metrics import evaluate_logits


def reference_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC in float64: each (positive, negative) pair scores 1 when ranked right, 1/2 when tied."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if not len(pos) or not len(neg) or np.isnan(scores).any():
        return math.nan
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def reference_logloss(logits: np.ndarray, labels: np.ndarray) -> float:
    z = logits.astype(np.float64)
    return float(np.mean(np.logaddexp(0.0, -z) + (1 - labels) * z))


@pytest.mark.parametrize("n, ties, seed", [(1, False, 0), (3, False, 1), (3, True, 2), (40, True, 3), (257, False, 4)])
def test_metrics_equal_a_float64_reference(n, ties, seed):
    """bf16-like ties (logits rounded to a few levels), one and three rows, all-positive or all-negative draws."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).astype(np.float64)
    logits = (rng.normal(size=n) * 4).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)
    got = evaluate_logits(torch.tensor(logits), torch.tensor(labels, dtype=torch.float32))
    want = reference_auc(logits.astype(np.float64), labels)
    assert (math.isnan(want) and math.isnan(got["auc"])) or got["auc"] == pytest.approx(want, abs=1e-12)
    assert got["logloss"] == pytest.approx(reference_logloss(logits, labels), rel=1e-12)
    assert got["accuracy"] == pytest.approx(np.mean((logits > 0) == (labels == 1)), abs=1e-15)


def test_saturated_logits_keep_a_finite_logloss():
    got = evaluate_logits(torch.tensor([100.0, -100.0, 100.0]), torch.tensor([1.0, 0.0, 0.0]))
    assert got["auc"] == 0.75 and got["logloss"] == pytest.approx(100 / 3, rel=1e-12) and got["accuracy"] == 2 / 3


def test_nan_logits_have_no_accuracy_either():
    """A model of NaN outputs (finite weights that overflow, evaluated by --eval-only, which has no divergence check)
    had AUC and logloss NaN but an accuracy of the split's negative rate: NaN > 0 is False, a "negative" prediction."""
    got = evaluate_logits(torch.full((4,), float("nan")), torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert math.isnan(got["auc"]) and math.isnan(got["logloss"])
    assert math.isnan(got["accuracy"])  # was 0.75


# ---- a logging window's rate on CUDA's clock -----------------------------------------------------------------


def cuda_clocked_meter(monkeypatch, clock: list) -> StepMeter:
    """A meter that times its windows as on CUDA (each to its read, `StepMeter.close_window`), on a fake clock."""
    monkeypatch.setattr(meter_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # `paused`'s sync
    m = StepMeter(torch.device("cpu"), 0, RunStats(), window=5, warmup_steps=1)
    m.device = torch.device("cuda")  # its device tensors stay on the CPU; only the clock's rule changes
    return m


def run_steps(m: StepMeter, clock: list, pause_at: int, pause_s: float) -> list:
    """The trainer's order (`Trainer._fit`): the step runs, the profiler steps (a trace's save paused), the last window
    is read, a logging step cuts the next; the run's last step reads its window at once. Every step takes 1 s."""
    rates, pending = [], None
    for step in range(1, 21):
        clock[0] += 1.0
        m.step(torch.tensor(0.5), samples=100, data_wait_s=0.0)
        if step == pause_at:
            with m.paused():
                clock[0] += pause_s
        if pending is not None:
            rates.append(m.close_window(pending, 0.5)[0])
            pending = None
        if step % 5 == 0 or step == 20:
            pending = m.cut_window(step)
        if step == 20:
            rates.append(m.close_window(pending, 0.5)[0])
    return rates


def test_on_cuda_a_trace_saved_after_a_logging_step_is_in_no_window(monkeypatch):
    """A profiler's trace saved at the step after a logging step (the default schedule's step 13 under log_every 1,
    2, 3, 4, 6 or 12; every 1001st step of repeat 0 under log_every 1000), paused, happens between that window's cut
    and its read. Timed to its read on CUDA, the window ran the save's 10 s longer (33 samples/s for 100), and the next
    one, which subtracted them again, had no rate: its samples left the steady state, summary.json's samples/s 58."""
    clock = [100.0]
    unpaused = run_steps(cuda_clocked_meter(monkeypatch, clock), clock, pause_at=0, pause_s=0.0)
    m = cuda_clocked_meter(monkeypatch, clock)
    paused = run_steps(m, clock, pause_at=11, pause_s=10.0)
    assert paused == pytest.approx(unpaused)  # the save left out: the windows as without it
    assert paused[1:3] == [pytest.approx(100.0)] * 2  # were 33.3 and None
    assert m.samples_per_sec == pytest.approx(100.0)  # was 58.3


def test_on_cuda_a_pause_inside_a_window_is_still_left_out(monkeypatch):
    """A pause between two cuts (an evaluation step reads its window first, then pauses) stays out of the next
    window as before."""
    clock = [100.0]
    m = cuda_clocked_meter(monkeypatch, clock)
    rates = run_steps(m, clock, pause_at=12, pause_s=10.0)  # the window cut at 10 was read after step 11
    assert rates[2] == pytest.approx(100.0)
