"""The evaluator's bookkeeping without a model or a run directory (`dlrm.train.evaluator`): which evaluation is the
best, when early stopping's patience runs out, what is logged at which step, and the model's mode around an
evaluation."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dlrm.config import EarlyStoppingConfig
from dlrm.data.batch import Batch
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.evaluator import Evaluator, evaluate
from dlrm.train.meter import RunStats
from dlrm.train.metrics import evaluate_logits


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


class Checkpointer:
    best_path = Path("/run/checkpoints/best.pt")

    def __init__(self):
        self.saved = []

    def save_best(self, run, pos, stats):
        self.saved.append(pos.step)
        return self.best_path


def make_evaluator(monkeypatch, results, early=None, stats=None):
    """An Evaluator whose evaluations return `results` (dicts of metrics) in turn."""
    queue = list(results)
    monkeypatch.setattr(evaluator_mod, "evaluate", lambda forward, loader, env: dict(queue.pop(0)))
    cfg = SimpleNamespace(train=SimpleNamespace(early_stopping=early))
    writer, checkpointer = Writer(), Checkpointer()
    ev = Evaluator(SimpleNamespace(eval_forward=None), [], cfg, writer, checkpointer, stats or RunStats())
    return ev, writer, checkpointer


def metrics(auc, logloss):
    return {"auc": auc, "logloss": logloss, "accuracy": 0.75}


def test_early_stopping_on_logloss_needs_a_drop_above_min_delta_and_stops_after_patience(monkeypatch):
    results = [metrics(0.70, 0.50), metrics(0.71, 0.495), metrics(0.69, 0.48), metrics(0.72, 0.48),
               metrics(0.73, 0.49), metrics(0.74, 0.47)]  # fmt: skip
    early = EarlyStoppingConfig(metric="logloss", patience=2, min_delta=0.01)
    ev, writer, checkpointer = make_evaluator(monkeypatch, results, early)
    seen = []
    for step in (10, 20, 30, 40, 50):
        ev(SimpleNamespace(step=step))
        seen.append((ev.stats.evals_since_best, ev.should_stop))
    # 0.495 is 0.005 better: not enough; 0.48 is 0.02 better: the best; 0.48 again and 0.49 worse: patience 2 runs out
    assert seen == [(0, False), (1, False), (0, False), (1, False), (2, True)]
    assert checkpointer.saved == [10, 30]
    assert ev.stats.best == {"step": 30, "metric": "logloss", **metrics(0.69, 0.48),
                             "checkpoint": "/run/checkpoints/best.pt"}


def test_early_stopping_on_auc_a_plateau_is_no_improvement(monkeypatch):
    """Higher AUC is better; with min_delta 0 an equal AUC does not reset the patience."""
    results = [metrics(0.70, 0.5), metrics(0.70, 0.4), metrics(0.71, 0.6), metrics(0.705, 0.3)]
    ev, _, checkpointer = make_evaluator(monkeypatch, results, EarlyStoppingConfig(metric="auc", patience=2))
    seen = []
    for step in (1, 2, 3, 4):
        ev(SimpleNamespace(step=step))
        seen.append((ev.stats.evals_since_best, ev.should_stop))
    assert seen == [(0, False), (1, False), (0, False), (1, False)]
    assert checkpointer.saved == [1, 3] and ev.stats.best["auc"] == 0.71 and ev.stats.best["step"] == 3


def test_without_early_stopping_the_best_is_by_auc_and_training_never_stops(monkeypatch):
    results = [metrics(0.8, 0.4)] + [metrics(0.7, 0.3)] * 5
    ev, _, checkpointer = make_evaluator(monkeypatch, results)
    for step in range(1, 7):
        ev(SimpleNamespace(step=step))
        assert not ev.should_stop
    assert checkpointer.saved == [1] and ev.stats.evals_since_best == 5


def test_a_best_chosen_by_another_metric_is_replaced_by_the_first_evaluation(monkeypatch):
    """A run resumed with early stopping on logloss after it kept its best by AUC: that best says nothing about
    logloss, so the first evaluation becomes the best, whatever its logloss."""
    old = {"step": 5, "metric": "auc", **metrics(0.9, 0.1), "checkpoint": "old.pt"}
    stats = RunStats(best=dict(old), evals_since_best=3)
    ev, _, checkpointer = make_evaluator(monkeypatch, [metrics(0.6, 0.45)],
                                         EarlyStoppingConfig(metric="logloss", patience=1), stats)
    ev(SimpleNamespace(step=8))
    assert checkpointer.saved == [8] and stats.best["metric"] == "logloss" and stats.evals_since_best == 0


def test_each_evaluation_is_logged_at_its_own_step(monkeypatch):
    ev, writer, _ = make_evaluator(monkeypatch, [metrics(0.7, 0.5), metrics(0.8, 0.4)])
    assert ev(SimpleNamespace(step=12)) == metrics(0.7, 0.5)
    ev(SimpleNamespace(step=24))
    assert sorted(writer.scalars) == sorted(
        [(f"eval/{k}", v, s) for s, m in ((12, metrics(0.7, 0.5)), (24, metrics(0.8, 0.4))) for k, v in m.items()])


class Forward:
    """Logits of fake batches (carried in their dense column 0); records the model's mode at each call."""

    def __init__(self):
        self.model = torch.nn.Dropout(0.5)
        self.modes = []

    def __call__(self, batch):
        self.modes.append(self.model.training)
        return batch.dense[:, 0].clone()


def test_evaluate_runs_the_model_in_eval_mode_over_every_batch_then_back_to_training():
    """Every batch's rows count, less a batch's padding rows (`Batch.pad`: a rank without a row of an evaluation's
    last batch gets a copy of its last row, which must not count twice)."""
    rng = np.random.default_rng(3)
    sizes, pads = (3, 1, 127, 2), (0, 1, 0, 1)
    batches = [Batch(torch.tensor(rng.normal(size=(n, 13)), dtype=torch.float32), torch.zeros(n, 26, dtype=torch.int64),
                     torch.tensor(rng.integers(0, 2, n), dtype=torch.float32), pad=p) for n, p in zip(sizes, pads)]
    forward = Forward()
    got = evaluate(forward, batches)
    assert forward.modes == [False] * len(sizes) and forward.model.training
    real = [slice(0, n - p) for n, p in zip(sizes, pads)]
    want = evaluate_logits(torch.cat([b.dense[r, 0] for b, r in zip(batches, real)]),
                           torch.cat([b.labels[r] for b, r in zip(batches, real)]))
    assert got == pytest.approx(want, rel=1e-12)
    padded = evaluate_logits(torch.cat([b.dense[:, 0] for b in batches]), torch.cat([b.labels for b in batches]))
    assert got != pytest.approx(padded, rel=1e-6)  # the padding rows change the metrics: they were left out


def test_an_undefined_first_evaluation_does_not_stay_the_best(monkeypatch):
    """AUC is NaN while the evaluation split holds one class only (or logloss NaN for a model that overflowed): such
    an evaluation ranks below any real one, so a later real one replaces it as best.pt (a NaN best compared as
    never beaten would keep the first model for the rest of the run and stop it after `patience` evaluations)."""
    nan = float("nan")
    results = [metrics(nan, 0.5), metrics(0.6, 0.4), metrics(0.65, 0.3), metrics(nan, nan), metrics(0.64, 0.2)]
    ev, _, checkpointer = make_evaluator(monkeypatch, results, EarlyStoppingConfig(metric="auc", patience=2))
    seen = []
    for step in (1, 2, 3, 4, 5):
        ev(SimpleNamespace(step=step))
        seen.append((ev.stats.evals_since_best, ev.should_stop))
    assert checkpointer.saved == [1, 2, 3] and ev.stats.best["step"] == 3
    assert seen == [(0, False), (0, False), (0, False), (1, False), (2, True)]


def _batches(n: int) -> list[Batch]:
    return [Batch(torch.zeros(2, 13), torch.zeros(2, 26, dtype=torch.int64), torch.tensor([0.0, 1.0]))
            for _ in range(n)]


def test_a_long_evaluation_shows_a_bar_of_its_batches_removed_at_its_end(monkeypatch):
    """Past EVAL_BAR_DELAY_S (0 here) the evaluation draws "eval" with its batch count, and on a terminal clears the
    line when it ends (leave=False): the evaluation's record follows on a clean line. Rank 0 only."""
    import io
    import sys

    import dlrm.train.evaluator as evaluator

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(evaluator, "EVAL_BAR_DELAY_S", 0.0)
    monkeypatch.setattr(sys, "stderr", Terminal())
    evaluate(Forward(), _batches(3))
    err = sys.stderr.getvalue()
    assert "eval:   0%|" in err and "0/3 [" in err and err.endswith("\r") and "\n" not in err, repr(err)
    monkeypatch.setattr(sys, "stderr", Terminal())
    rank_1 = SimpleNamespace(is_main=False, all_gather_rows=lambda t: t)  # (its peers' rows left out here)
    evaluate(Forward(), _batches(3), rank_1)
    assert sys.stderr.getvalue() == ""


def test_into_a_file_a_long_evaluations_bar_is_left_as_its_last_copy(monkeypatch, capsys):
    """Into a file or pipe (nohup, SLURM, `| tee`) the bar shares the training bar's line (position 0): removed there,
    it wrote blanks over that line, which `cat` and `tail` showed empty where the training's progress and the
    evaluation's were; its last copy stays instead, the line ended, as every other bar's is in a file."""
    import dlrm.train.evaluator as evaluator

    monkeypatch.setattr(evaluator, "EVAL_BAR_DELAY_S", 0.0)
    evaluate(Forward(), _batches(3))
    err = capsys.readouterr().err
    assert err.endswith("\n") and "3/3 [" in err.rsplit("\r", 1)[-1], repr(err)


def test_a_loader_of_unknown_length_evaluates_with_a_bar_of_no_total(monkeypatch, capsys):
    """A DataLoader over an IterableDataset has __len__, which raises TypeError: its evaluation ran into that
    TypeError (tqdm's own look at the length catches it: a bar counts batches without a total)."""
    import dlrm.train.evaluator as evaluator

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_batches(3))

    monkeypatch.setattr(evaluator, "EVAL_BAR_DELAY_S", 0.0)
    metrics = evaluate(Forward(), torch.utils.data.DataLoader(Stream(), batch_size=None))
    assert set(metrics) >= {"auc", "logloss"} and "3batch [" in capsys.readouterr().err


def test_a_short_evaluation_draws_nothing(capsys):
    evaluate(Forward(), _batches(3))
    assert capsys.readouterr().err == ""
