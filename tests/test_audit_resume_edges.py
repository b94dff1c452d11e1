"""Exact resume at the edges the other checkpoint tests leave out, on the CPU, the one-hot model and the multi-hot
MLPerf DLRM-DCNv2-shaped one (configs/mlperf-dcnv2.json shrunk, torch kernels).

A run stopped (a signal, or a shorter ``train.max_steps``) and resumed must log the losses, keep the best evaluation,
early-stop and read the batches the uninterrupted run does:

1. a stop between two logging steps: the interrupted logging window's losses were lost, and the first logging step
   after the resume logged the mean of the resumed steps only (0.7339 for 0.7178 at step 20, say), not the
   uninterrupted run's mean of the whole window;
2. a run stopped by ``train.max_steps`` at a multiple of ``train.eval_every``: its last evaluation came after its last
   checkpoint, so a resume forgot it (the best so far, early stopping's count) and early-stopped later than the
   uninterrupted run, with another best;
3. ``--resume`` of a run that early stopping ended trained on (``train.eval_every`` steps more, then stopped again),
   rewriting a finished run's checkpoints and summary;
4. ``data.placement`` is free on a resume, but the stream loader and the device-resident one shuffle differently: a
   resume with another placement (or with "auto" resolving otherwise, on a GPU by the memory free at the start)
   trained on other batches.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.data import synthetic
from dlrm.errors import TrainingStopped
from dlrm.train.trainer import Trainer, train
from tests.conftest import make_dataset
from tests.test_multihot_train import SIZES, config as mlperf_config

ONE_HOT = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": False, "shuffle_buffer_rows": 40},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 4, "device": "cpu", "seed": 3, "deterministic": True, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    make_dataset(root / "one", {"train": 100, "validation": 32}, row_group_size=30)  # 12 full batches and 4 rows
    synthetic.generate(root / "multi", 130, seed=2, cardinalities="tiny", multi_hot_sizes=SIZES,
                       multi_hot_fill="variable", validation_fraction=0.2, test_fraction=0.0)
    return root


def one_hot(data, tmp_path, name, **overrides):
    raw = json.loads(json.dumps(ONE_HOT))
    raw["data"]["path"] = str(data / "one")
    path = tmp_path / "one.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name, **overrides})


def multi_hot(data, tmp_path, name, **overrides):
    over = {"kernels.embedding": "torch", "train.max_steps": None, "train.epochs": 2, "train.log_every": 4,
            "checkpoint.every": 1000, "data.batch_size": 16, "train.baseline": False, **overrides}
    return mlperf_config(data / "multi", tmp_path, name, **over)


def signal_at(monkeypatch, step):
    """SIGTERM as it arrives during `step`: the loop finishes the step, checkpoints and stops (`GracefulStop`)."""
    original = Trainer._stop_requested

    def stop_requested(self, stop):
        if self.pos.step == step and stop.signum is None:
            stop.signum = signal.SIGTERM
        return original(self, stop)

    monkeypatch.setattr(Trainer, "_stop_requested", stop_requested)


def last_state(tmp_path, name):
    return ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / name)[-1])


def assert_same_state(a, b):
    assert a["position"] == b["position"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        for pid, st in oa["state"].items():
            for name, value in st.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][pid][name])), (pid, name)


@pytest.mark.parametrize("model", ["one-hot", "multi-hot"])
def test_a_stop_between_logging_steps_logs_the_uninterrupted_losses(data, tmp_path, monkeypatch, model):
    """Stopped between two logging steps (every 4), twice, then resumed: every logged loss is the uninterrupted
    run's, bit for bit. One-hot: 13 batches an epoch (100 rows of 8, drop_last false), stopped at 6 and at 13 (the
    first epoch's partial last batch); multi-hot: 6 (104 rows of 16, drop_last true), stopped at 6 (an epoch's last
    batch) and 9."""
    make = one_hot if model == "one-hot" else multi_hot
    steps, stops = {"one-hot": (26, (6, 13)), "multi-hot": (12, (6, 9))}[model]
    full = train(make(data, tmp_path, "full"))
    assert full["steps"] == steps and [s for s, _ in full["train_losses"]] == [*range(4, steps, 4), steps]
    for k, stop in enumerate(stops):
        with monkeypatch.context() as m:
            signal_at(m, stop)
            with pytest.raises(TrainingStopped, match=f"at step {stop};"):
                train(make(data, tmp_path, "parts"), resume="latest" if k else None)
        assert ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / "parts")[-1])["position"]["step"] == stop
    resumed = train(make(data, tmp_path, "parts"), resume="latest")
    assert resumed["resumed_at_step"] == stops[-1]
    assert resumed["train_losses"] == full["train_losses"]
    assert resumed["final_train_loss"] == full["final_train_loss"] and resumed["auc"] == full["auc"]
    assert_same_state(last_state(tmp_path, "full"), last_state(tmp_path, "parts"))


# lr 3.0 makes the dense model diverge: the loss is best early and early stopping ends the run after 3 evaluations
# train.seed 5: a run whose best evaluation is its first (step 2) and that early-stops at step 6, the shape the tests
# below need; seed 3 (ONE_HOT's) gave it until 2026-12-01's table init (`kernels.table_layout`), then stopped at 8
EARLY = {"optim.dense.lr": 3.0, "train.epochs": 4, "train.log_every": 2, "train.eval_every": 2,
         "train.early_stopping": {"metric": "logloss", "patience": 2}, "train.seed": 5}


def test_a_run_extended_past_max_steps_keeps_its_last_evaluation(data, tmp_path):
    """Stopped by max_steps 4 (a multiple of eval_every 2), resumed without it: the evaluation at step 4 counts
    as in the uninterrupted run, which early-stops at step 6 with its best at step 2 (the resumed run went on to step
    8 with its best at 4: it forgot the evaluation at 4; stopped at 2, it forgot its only best)."""
    full = train(one_hot(data, tmp_path, "full", **EARLY))
    assert full["early_stopped"] is True and full["steps"] == 6 and full["best"]["step"] == 2
    for stop in (2, 4):
        name = f"max{stop}"
        first = train(one_hot(data, tmp_path, name, **EARLY, **{"train.max_steps": stop}))
        assert first["steps"] == stop
        resumed = train(one_hot(data, tmp_path, name, **EARLY), resume="latest")
        assert (resumed["steps"], resumed["early_stopped"], resumed["best"]) == (6, True, {
            **full["best"], "checkpoint": str(tmp_path / "tb" / name / "checkpoints" / "best.pt")})
        assert resumed["train_losses"] == full["train_losses"] and resumed["logloss"] == full["logloss"]
        assert_same_state(last_state(tmp_path, "full"), last_state(tmp_path, name))
        best = ckpt.load_checkpoint(tmp_path / "tb" / name / "checkpoints" / "best.pt")
        assert best["position"]["step"] == 2  # best.pt holds the best evaluation's model, as summary.json says
        full_best = ckpt.load_checkpoint(tmp_path / "tb" / "full" / "checkpoints" / "best.pt")
        assert torch.equal(best["model"]["sparse_arch.weight"], full_best["model"]["sparse_arch.weight"])


def test_resuming_a_run_early_stopping_ended_trains_no_further(data, tmp_path):
    """The run early-stopped at step 6: `--resume` says it is finished and writes nothing (it trained to step 8,
    stopped again and rewrote the run's checkpoints and summary)."""
    full = train(one_hot(data, tmp_path, "early", **EARLY))
    assert full["early_stopped"] is True and full["steps"] == 6
    run = tmp_path / "tb" / "early"
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    again = train(one_hot(data, tmp_path, "early", **EARLY), resume="latest")
    assert (again.get("finished"), again["steps"], again["early_stopped"]) == (True, 6, True)  # was (None, 8, True)
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before  # nothing written
    # a branch (--run-name NEW) of it has nothing to train either, and leaves no directory behind
    branch = train(one_hot(data, tmp_path, "branch", **EARLY), resume=str(ckpt.list_checkpoints(run)[-1]))
    assert branch["finished"] is True and not (tmp_path / "tb" / "branch").exists()
    # a larger patience (allowed) trains on
    longer = train(one_hot(data, tmp_path, "early", **{**EARLY, "train.early_stopping": {"metric": "logloss",
                                                                                          "patience": 3}}),
                   resume="latest", allow_config_change=["train.early_stopping"])
    assert longer["resumed_at_step"] == 6 and longer["steps"] == 8


@pytest.mark.parametrize("model", ["one-hot", "multi-hot"])
def test_a_resume_reads_the_batches_of_the_placement_it_started_with(data, tmp_path, monkeypatch, model):
    """Started with placement "gpu" (on the CPU: the split held in host memory, `DeviceLoader`), stopped at step 8 (a
    logging step), resumed with "auto" (on the CPU: "stream"): the shuffled batches are the "gpu" run's. An explicit
    other placement is refused unless allowed."""
    make = one_hot if model == "one-hot" else multi_hot
    gpu = {"data.placement": "gpu"}
    full = train(make(data, tmp_path, "full", **gpu))
    with monkeypatch.context() as m:
        signal_at(m, 8)
        with pytest.raises(TrainingStopped):
            train(make(data, tmp_path, "parts", **gpu))
    stopped = ckpt.list_checkpoints(tmp_path / "tb" / "parts")[-1]
    resumed = train(make(data, tmp_path, "parts", **{"data.placement": "auto"}), resume="latest")
    assert resumed["resumed_at_step"] == 8
    assert resumed["train_losses"] == full["train_losses"] and resumed["auc"] == full["auc"]
    assert_same_state(last_state(tmp_path, "full"), last_state(tmp_path, "parts"))
    assert resumed["resolved"]["placement"] == "gpu" and ckpt.load_checkpoint(stopped)["data_placement"] == "gpu"
    with pytest.raises(ConfigError, match=r"data.placement: 'stream', where the run resumed read its batches with "
                                          r"'gpu'.*--allow-config-change data.placement$"):
        train(make(data, tmp_path, "other", **{"data.placement": "stream"}), resume=str(stopped))
    allowed = train(make(data, tmp_path, "other", **{"data.placement": "stream"}), resume=str(stopped),
                    allow_config_change=["data.placement"])
    assert allowed["resolved"]["placement"] == "stream" and allowed["train_losses"] != full["train_losses"]
    # unshuffled, both loaders give the rows in file order: any placement resumes the same batches
    plain = {"data.shuffle": False}
    full = train(make(data, tmp_path, "plain-full", **plain))
    with monkeypatch.context() as m:
        signal_at(m, 8)
        with pytest.raises(TrainingStopped):
            train(make(data, tmp_path, "plain", **plain))
    resumed = train(make(data, tmp_path, "plain", **plain, **gpu), resume="latest")
    assert resumed["resolved"]["placement"] == "gpu" and resumed["train_losses"] == full["train_losses"]
    assert_same_state(last_state(tmp_path, "plain-full"), last_state(tmp_path, "plain"))


def test_a_signal_during_the_last_step_leaves_the_last_evaluation_to_the_resume(data, tmp_path, monkeypatch):
    """SIGTERM during step 13, the last (one epoch): the step is checkpointed and the run stops before its last
    evaluation and summary.json. A resume used to call the run finished ("nothing to train", no summary, no AUC
    ever); it makes them, training no step, as the uninterrupted run made them."""
    one_epoch = {"train.epochs": 1, "train.eval_every": 13}
    full = train(one_hot(data, tmp_path, "full", **one_epoch))
    with monkeypatch.context() as m:
        signal_at(m, 13)
        with pytest.raises(TrainingStopped, match="at step 13;"):
            train(one_hot(data, tmp_path, "last", **one_epoch))
    run = tmp_path / "tb" / "last"
    assert not (run / "summary.json").exists()
    resumed = train(one_hot(data, tmp_path, "last", **one_epoch), resume="latest")
    assert (resumed.get("finished"), resumed.get("resumed_at_step"), resumed.get("auc")) == (None, 13, full["auc"])
    assert resumed["steps"] == 13 and resumed["train_losses"] == full["train_losses"]
    assert resumed["best"]["step"] == 13 and json.loads((run / "summary.json").read_text())["auc"] == full["auc"]
    assert ckpt.load_checkpoint(run / "checkpoints" / "step-00000013.pt")["run_stats"]["best"]["step"] == 13
    assert_same_state(last_state(tmp_path, "full"), last_state(tmp_path, "last"))
    again = train(one_hot(data, tmp_path, "last", **one_epoch), resume="latest")
    assert again["finished"] is True and again["auc"] == full["auc"]
