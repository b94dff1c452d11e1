"""Audit of the training loop (dlrm/train/trainer.py, step.py): the run's length (train.min_steps past one epoch,
train.max_steps, the epochs that takes), the samples it counts with a partial last batch, the evaluation cadence and
the final evaluation, summary.json's final_train_loss, a NaN in the last logging window, the loss share of a rank
(`TrainStep._share`) and the padded evaluation of a last partial batch (`EvalForward`). Each expectation is computed
here from the dataset's sizes, not read back from the trainer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.config import CompileConfig, ModelConfig, load_config
from dlrm.data.batch import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.errors import NonFiniteLoss
from dlrm.model.dlrm import build_model
from dlrm.train import step as step_mod
from dlrm.train.trainer import Trainer, train
from tests.conftest import make_dataset

TRAIN_ROWS, BATCH = 100, 16  # 6 full batches and 4 rows left over
BASE = {
    "data": {"batch_size": BATCH, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 4, "eval_every": None, "device": "cpu", "seed": 3},
    "checkpoint": {"every": None},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_loop") / "ds"
    make_dataset(root, {"train": TRAIN_ROWS, "validation": 40}, row_group_size=16)
    return root


def config(tmp_path, dataset, name, **sections):
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(dataset)
    for section, values in sections.items():
        raw[section].update(values)
    (tmp_path / f"{name}.json").write_text(json.dumps(raw))
    return load_config(tmp_path / f"{name}.json", {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_min_steps_past_one_epoch_trains_exactly_that_many_steps_and_evaluates_at_the_end(tmp_path, dataset):
    """drop_last: 6 steps an epoch; train.min_steps 15 needs a third epoch (ceil(15 / 6)) and stops at step 15.
    Logging windows at 4, 8, 12 and the partial one at 15; evaluations every 5 steps and, at 15, the final one only
    (once), whose metrics are the summary's; final_train_loss is the last window's; samples/s and the data wait are
    the steady-state windows'."""
    cfg = config(tmp_path, dataset, "min", data={"drop_last": True}, train={"min_steps": 15, "eval_every": 5})
    trainer = Trainer(cfg)
    summary = trainer.fit()
    assert summary["steps"] == 15
    assert summary["samples"] == 15 * BATCH
    assert [s for s, _ in summary["train_losses"]] == [4, 8, 12, 15]
    assert summary["final_train_loss"] == summary["train_losses"][-1][1]
    assert summary["final_train_loss"] != summary["train_losses"][0][1]
    run_dir = tmp_path / "tb" / "min"
    assert sorted(scalars(run_dir, "train/loss")) == [4, 8, 12, 15]
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/logloss")] == [5, 10, 15]  # the cadence; the final evaluation once
    logloss = scalars(run_dir, "eval/logloss")
    assert summary["logloss"] == pytest.approx(logloss[15], rel=1e-6)
    assert logloss[15] != pytest.approx(logloss[10], rel=1e-6)  # the last evaluation is not the one before
    meter = trainer.meter  # the steady state: every closed window's samples over their seconds, not the loop's
    assert meter.steady_samples == (15 - 3) * BATCH  # the windows after the 3 warm-up steps
    assert summary["samples_per_sec"] == pytest.approx(meter.steady_samples / meter.steady_s, rel=1e-9)
    assert summary["data_wait_fraction"] == pytest.approx(meter.steady_wait / meter.steady_s, rel=1e-9)


def test_max_steps_and_a_kept_partial_batch_count_each_sample_once(tmp_path, dataset):
    """Without drop_last an epoch is 7 steps (6 x 16 rows and one of 4); two epochs cut by train.max_steps 13 are the
    whole first epoch (100 samples) and 6 full batches of the second."""
    cfg = config(tmp_path, dataset, "max", data={"drop_last": False}, train={"epochs": 2, "max_steps": 13})
    summary = train(cfg)
    assert summary["steps"] == 13
    assert summary["samples"] == TRAIN_ROWS + 6 * BATCH
    assert [s for s, _ in summary["train_losses"]] == [4, 8, 12, 13]


def test_a_nan_in_the_last_logging_window_stops_the_run(tmp_path, dataset, monkeypatch):
    """No checkpoints, so only the logging windows' reads see the losses: a NaN at step 5 of 6 (window 5-6, read at
    the end) must raise, naming step 5, and write no summary."""
    cfg = config(tmp_path, dataset, "nan", data={"drop_last": True})
    original, calls = step_mod.TrainStep.__call__, {"n": 0}

    def poisoned(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(step_mod.TrainStep, "__call__", poisoned)
    with pytest.raises(NonFiniteLoss, match=r"at step 5; stopped; no checkpoint was written"):
        train(cfg)
    assert calls["n"] == 6
    assert not (tmp_path / "tb" / "nan" / "summary.json").exists()


def test_a_nan_before_an_early_stop_between_logging_steps_stops_the_run(tmp_path, dataset, monkeypatch):
    """Early stopping ends the loop at step 6, an evaluation step between the logging steps 4 and 8: the NaN loss of
    step 5 is in no logging window read yet, so only the end's finite check sees it; it must raise, naming step 5,
    and write no summary (the run is not reported as an early-stopped success)."""
    from dlrm.train import evaluator as evaluator_mod

    cfg = config(tmp_path, dataset, "nan-early", data={"drop_last": True},
                 train={"epochs": 2, "eval_every": 3, "early_stopping": {"metric": "auc", "patience": 1}})
    original, calls = step_mod.TrainStep.__call__, {"n": 0}

    def poisoned(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    evaluations = []

    def first_only(self, value):  # the step-3 evaluation is the best, step 6's not: patience 1 stops at step 6
        evaluations.append(value)
        return len(evaluations) == 1

    monkeypatch.setattr(step_mod.TrainStep, "__call__", poisoned)
    monkeypatch.setattr(evaluator_mod.Evaluator, "_improves", first_only)
    # no step checkpoint; the step-3 evaluation's best.pt (written before the NaN) is named as the good model
    with pytest.raises(NonFiniteLoss, match=r"at step 5; stopped; no step checkpoint was written; \S*best.pt holds "
                                            r"the best evaluation's model \(step 3\)"):
        train(cfg)
    assert calls["n"] == 6 and len(evaluations) == 2  # stopped at step 6, before the logging step 8
    assert not (tmp_path / "tb" / "nan-early" / "summary.json").exists()


@pytest.mark.parametrize("rows,global_rows,world", [(3, 7, 2), (4, 7, 2), (8, 16, 2), (2, 9, 4)])
def test_a_ranks_loss_share_sums_to_the_global_mean_over_the_ranks(rows, global_rows, world):
    """`TrainStep._share`: rank loss x B_rank x W / B_global, so that the ranks' shares summed and divided by W (what
    DDP's averaged gradient and the logged loss do) weight each rank's mean by its rows."""
    fake = SimpleNamespace(model=SimpleNamespace(sparse_arch=SimpleNamespace(world_size=world)))
    batch = Batch(torch.zeros(rows, NUM_DENSE), torch.zeros(rows, NUM_SPARSE, dtype=torch.int64), torch.zeros(rows),
                  global_size=global_rows)
    mean = torch.tensor(0.75)
    got = step_mod.TrainStep._share(fake, mean, batch)
    assert float(got) == pytest.approx(0.75 * rows * world / global_rows, rel=1e-6)


def test_padded_evaluation_of_a_partial_batch_returns_that_batchs_own_logits(monkeypatch):
    """A compiled evaluation pads a last batch of 3 rows to the eval batch of 8 and must return the 3 rows' logits,
    not the padding's (torch.compile replaced by the function itself: the padding is EvalForward's, not Inductor's)."""
    monkeypatch.setattr(step_mod, "_maybe_compile", lambda fn, *a, **k: fn)
    torch.manual_seed(0)
    model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [11] * NUM_SPARSE).eval()
    forward = step_mod.EvalForward(model, "fp32", torch.device("cpu"), CompileConfig(enabled=True), batch_size=8)
    assert forward.pad
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(3, NUM_DENSE, generator=g) * 5
    sparse = torch.randint(0, 11, (3, NUM_SPARSE), generator=g)
    batch = Batch(dense, sparse, torch.zeros(3))
    with torch.no_grad():
        want = model(dense, sparse).float()
    assert len(set(want.tolist())) == 3  # distinct rows: a padding row cannot pass for another
    got = forward(batch)
    assert got.shape == (3,)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("own, other, agreed", [(0, 15, 15), (2, 0, 2), (2, 15, 15), (0, 0, 0)])
def test_ranks_agree_on_the_signal_that_stops_them(own, other, agreed):
    """With several ranks, a logging window carries the largest signal number any rank got (0: none) through an
    all-reduce max; every rank then stops with 128 + that signal, also one that got none itself (it exited 128
    while its neighbour exited 143). Run through the trainer's own window queue and read, with the other rank's
    number standing in for the collective."""
    from dlrm.train.signals import GracefulStop

    reduced = []

    def all_reduce_max(t):
        # only the signal is a vector (the signal, then 1 - got: whether some rank got none); the loss sums and NaN
        # steps are 0-dim
        out = torch.maximum(t, torch.tensor([other, int(not other)])) if t.dim() == 1 else t
        reduced.append(out)
        return out

    env = SimpleNamespace(distributed=True, world_size=2, all_reduce_sum=lambda t: t, all_reduce_max=all_reduce_max)
    losses = SimpleNamespace(total=lambda: torch.tensor(1.5), first_nonfinite_step=lambda: torch.tensor(-1))
    fake_meter = SimpleNamespace(losses=losses, cut_window=lambda step: SimpleNamespace(step=step, steps=3),
                                 close_window=lambda cut, loss: (None, None), rates=[])
    opt = SimpleNamespace(param_groups=[{"lr": 0.1}])
    trainer = SimpleNamespace(meter=fake_meter, env=env, run=SimpleNamespace(optimizers=[opt, opt], schedulers=[]),
                              device=torch.device("cpu"), pos=SimpleNamespace(step=8), _pending=None, _stop_signal=0,
                              writer=SimpleNamespace(add_scalar=lambda *a: None), _raise_if_nonfinite=lambda bad: None)
    stop = GracefulStop()
    stop.signum = own or None
    assert Trainer._stop_requested(trainer, stop) is False  # several ranks: nothing is decided before the read
    Trainer._queue_window(trainer, stop)
    assert [int(t[0]) for t in reduced if t.dim() == 1] == [agreed]
    Trainer._log_window(trainer, SimpleNamespace(set_postfix=lambda **kw: None))
    assert trainer._stop_signal == agreed
    assert Trainer._stop_requested(trainer, stop) is (agreed > 0)
