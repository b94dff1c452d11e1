"""best.pt, the recorded best evaluation and early stopping across a resume (audit helper).

1. A run whose train.max_steps is not a multiple of train.eval_every made its last evaluation after its last
   checkpoint: when that evaluation was the best, best.pt held its model but the checkpoint did not record it, so a
   longer resume kept the older best as "the best" (summary.json named step 2 while best.pt held step 5's model).
2. train.eval_every and data.eval_split were free on a resume: with train.early_stopping they decide when the run
   stops (patience counts evaluations, of a metric on a split); and a best of one split was compared with
   evaluations of another.
3. A sharded checkpoint merged for one process recorded the sharded run's best.pt (a manifest of shards one
   process cannot load) as the best evaluation's checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.distributed.checkpoint import load_for_rank
from dlrm.distributed.env import DistEnv
from dlrm.distributed.merge import merge_to_file
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.fastdist_ranks import failures_on_ranks

CONFIG = {
    "data": {"batch_size": 8, "shuffle": True, "drop_last": False, "shuffle_buffer_rows": 40},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 3, "deterministic": True,
              "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}
EARLY = {"train.early_stopping": {"metric": "auc", "patience": 2}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("best")
    make_dataset(root / "ds", {"train": 100, "validation": 32, "test": 32}, row_group_size=30)
    return root / "ds"


def config(data, tmp_path, name, rank=None, **overrides):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    raw["name"] = name  # not the file's name: one per rank (ranks writing one file could read it half-written)
    path = tmp_path / (f"{name}.json" if rank is None else f"{name}.rank{rank}.json")
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name, **overrides})


def scripted(aucs):
    """Evaluations whose AUCs are `aucs`, in turn (the steps they were made at are recorded in `.steps`)."""
    queue = list(aucs)

    def evaluate(forward, loader, env=None):
        return {"auc": queue.pop(0), "logloss": 0.5, "accuracy": 0.75}

    evaluate.queue = queue
    return evaluate


def best_pt(tmp_path, name):
    return ckpt.load_checkpoint(tmp_path / "tb" / name / "checkpoints" / "best.pt")


def last_state(tmp_path, name):
    return ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / name)[-1])


# -- 1. the last evaluation off the eval_every grid -------------------------------------------------------------------

def test_an_off_grid_best_last_evaluation_is_recorded_in_the_last_checkpoint(data, tmp_path, monkeypatch):
    """max_steps 5, eval_every 2: evaluations at 2 (0.60), 4 (0.55) and the last at 5 (0.70, the best: best.pt). The
    last checkpoint records it; resumed to step 8 (0.58 at 6, 0.57 at 8) the best stays step 5, which best.pt holds
    (the resume named step 2 as the best while best.pt held step 5's model)."""
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.55, 0.70]))
    first = train(config(data, tmp_path, "r", **{"train.max_steps": 5}))
    assert first["steps"] == 5 and first["best"]["step"] == 5
    assert last_state(tmp_path, "r")["run_stats"]["best"]["step"] == 5  # was 2
    assert best_pt(tmp_path, "r")["position"]["step"] == 5
    monkeypatch.setattr(evaluator_mod, "evaluate", ev := scripted([0.58, 0.57]))
    resumed = train(config(data, tmp_path, "r", **{"train.max_steps": 8}), resume="latest")
    assert ev.queue == [] and resumed["resumed_at_step"] == 5 and resumed["steps"] == 8
    assert (resumed["best"]["step"], resumed["best"]["auc"]) == (5, 0.70)  # was (2, 0.60)
    assert best_pt(tmp_path, "r")["position"]["step"] == resumed["best"]["step"]
    assert best_pt(tmp_path, "r")["run_stats"]["best"]["step"] == 5


def test_an_off_grid_last_evaluation_without_improvement_does_not_count_for_patience(data, tmp_path, monkeypatch):
    """Early stopping, patience 2: 0.60 at 2, 0.55 at 4, then the max_steps-5 run's own last evaluation at 5 (0.50,
    no improvement). A longer run makes no evaluation at 5: resumed, the run stops at 6 as the uninterrupted one does
    (counting it, the resume would call the run early-stopped at step 5 and train nothing)."""
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.55, 0.52]))
    full = train(config(data, tmp_path, "full", **EARLY))
    assert (full["steps"], full["early_stopped"], full["best"]["step"]) == (6, True, 2)
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.55, 0.50]))
    first = train(config(data, tmp_path, "r", **EARLY, **{"train.max_steps": 5}))
    assert first["steps"] == 5 and first["best"]["step"] == 2 and first["auc"] == 0.50
    assert last_state(tmp_path, "r")["run_stats"]["evals_since_best"] == 1
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.52]))
    resumed = train(config(data, tmp_path, "r", **EARLY), resume="latest")
    assert (resumed["steps"], resumed["early_stopped"], resumed["best"]["step"]) == (6, True, 2)
    assert best_pt(tmp_path, "r")["position"]["step"] == 2


def test_the_last_evaluation_is_in_the_last_checkpoint_at_a_checkpoint_every_step(data, tmp_path, monkeypatch):
    """checkpoint.every 2 and max_steps 4: the loop saved step 4 before the last evaluation (0.70 at 4, the best),
    and the end's save of the same step was a no-op: the last checkpoint lacked it, and a resume to step 6 (0.65)
    took step 6 for the best, where the uninterrupted run's is step 4."""
    every = {"checkpoint.every": 2}
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.70]))
    first = train(config(data, tmp_path, "r", **every, **{"train.max_steps": 4}))
    assert first["best"]["step"] == 4 and best_pt(tmp_path, "r")["position"]["step"] == 4
    assert last_state(tmp_path, "r")["run_stats"]["best"]["step"] == 4  # was 2
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.65]))
    resumed = train(config(data, tmp_path, "r", **every, **{"train.max_steps": 6}), resume="latest")
    assert (resumed["best"]["step"], resumed["best"]["auc"]) == (4, 0.70)  # was (6, 0.65)
    assert best_pt(tmp_path, "r")["position"]["step"] == 4


def test_a_best_evaluation_at_a_checkpoint_step_links_best_pt_to_it(data, tmp_path, monkeypatch):
    """eval_every and checkpoint.every 2: the best evaluation (step 2) was made before step 2's checkpoint, so best.pt
    was a second full copy of the model (MLPerf's 50 GB twice), not the hard link to step-2.pt that it is at the
    run's last step; the checkpoint and best.pt both record that evaluation."""
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.70, 0.60, 0.50]))
    summary = train(config(data, tmp_path, "r", **{"checkpoint.every": 2, "train.max_steps": 6}))
    d = tmp_path / "tb" / "r" / "checkpoints"
    assert summary["best"]["step"] == 2 and os.path.samefile(d / "best.pt", d / "step-00000002.pt")  # was a copy
    assert ckpt.load_checkpoint(d / "step-00000002.pt")["run_stats"]["best"]["step"] == 2
    assert best_pt(tmp_path, "r")["position"]["step"] == 2


def test_a_resume_after_the_last_checkpoint_does_not_count_the_last_evaluation_twice(data, tmp_path, monkeypatch):
    """A run killed after its last checkpoint (which holds its last evaluation) but before summary.json (e.g. in the
    baseline's training): the resume makes the evaluation and the summary again, training no step; the evaluation
    at that step, already counted, counted a second time (early stopping's count 2 for 1), so a longer resume stopped
    an evaluation early."""
    from dlrm.train import trainer as trainer_mod

    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.55]))
    monkeypatch.setattr(trainer_mod, "run_baseline", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError, match="killed"):
        train(config(data, tmp_path, "r", **EARLY, **{"train.max_steps": 4}))
    assert last_state(tmp_path, "r")["run_stats"]["evals_since_best"] == 1
    assert not (tmp_path / "tb" / "r" / "summary.json").exists()
    monkeypatch.undo()
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.55]))
    again = train(config(data, tmp_path, "r", **EARLY, **{"train.max_steps": 4}), resume="latest")
    assert again["resumed_at_step"] == 4 and again["auc"] == 0.55 and again["best"]["step"] == 2
    assert last_state(tmp_path, "r")["run_stats"]["evals_since_best"] == 1  # was 2
    assert (tmp_path / "tb" / "r" / "summary.json").is_file()


# -- 2. eval_every and eval_split on a resume ------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("train.eval_every", 3), ("data.eval_split", "test")])
def test_with_early_stopping_eval_every_and_eval_split_are_refused_unless_allowed(data, tmp_path, monkeypatch,
                                                                                 key, value):
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.55, 0.50, 0.40]))
    train(config(data, tmp_path, "r", **EARLY, **{"train.max_steps": 4}))
    before = sorted(p.name for p in (tmp_path / "tb" / "r" / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=rf"{key}: .* -> .*train.early_stopping.*--allow-config-change {key}$"):
        train(config(data, tmp_path, "r", **EARLY, **{key: value}), resume="latest")  # was trained on
    assert sorted(p.name for p in (tmp_path / "tb" / "r" / "checkpoints").iterdir()) == before
    allowed = train(config(data, tmp_path, "r", **EARLY, **{key: value, "train.max_steps": 6}), resume="latest",
                    allow_config_change=[key])
    assert allowed["resumed_at_step"] == 4 and allowed["steps"] == 6


def test_a_resume_on_another_eval_split_does_not_compare_with_the_old_splits_best(data, tmp_path, monkeypatch):
    """No early stopping: eval_split may change, but the best of validation (0.90 at step 2) is no best of test
    evaluations: the resumed run's best is its own best test evaluation, held by best.pt (it kept validation's)."""
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.90, 0.80]))
    first = train(config(data, tmp_path, "r", **{"train.max_steps": 4}))
    assert first["best"]["step"] == 2
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.60, 0.65]))
    resumed = train(config(data, tmp_path, "r", **{"train.max_steps": 8, "data.eval_split": "test"}),
                    resume="latest")
    assert resumed["split"] == "test" and (resumed["best"]["step"], resumed["best"]["auc"]) == (8, 0.65)  # was 2
    assert best_pt(tmp_path, "r")["position"]["step"] == 8


# -- 3. a merged sharded checkpoint ----------------------------------------------------------------------------------

def _train_on_rank(rank, world, root, name, overrides, aucs):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    evaluator_mod.evaluate = scripted(aucs)  # this child process's own module
    root = Path(root)
    train(config(root / "ds", root, name, rank, **{"distributed.sharding": "row", "distributed.row_wise_min_rows": 5,
                                                   **overrides}))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Two ranks, max_steps 6, evaluations at 2 (0.70, the best), 4 (0.60) and 6 (0.65): (root, checkpoints dir)."""
    root = tmp_path_factory.mktemp("sharded")
    make_dataset(root / "ds", {"train": 100, "validation": 32}, row_group_size=30)
    assert not failures_on_ranks(_train_on_rank, [(2, str(root), "two", {"train.max_steps": 6}, [0.70, 0.60, 0.65])],
                                 2, root)
    return root, ckpt.checkpoint_dir(root / "tb" / "two")


def test_a_merged_checkpoint_names_no_sharded_best_pt(sharded, monkeypatch):
    """Merged: best.pt's merge names itself as the best's checkpoint, step 6's names none (the best's model is not
    in it); both named the sharded best.pt, which one process cannot load. A one-process resume of the merged
    best.pt keeps it as its best's checkpoint."""
    tmp_path, d = sharded
    assert "sharded" in ckpt.load_checkpoint(d / "best.pt")
    merged_best = merge_to_file(d / "best.pt", tmp_path / "best-merged.pt")
    assert merged_best["run_stats"]["best"]["step"] == 2
    # was d/best.pt
    assert merged_best["run_stats"]["best"]["checkpoint"] == str((tmp_path / "best-merged.pt").absolute())
    merged_last = merge_to_file(d / "step-00000006.pt", tmp_path / "last-merged.pt")
    assert merged_last["run_stats"]["best"]["step"] == 2 and merged_last["run_stats"]["evals_since_best"] == 2
    assert merged_last["run_stats"]["best"]["checkpoint"] is None  # was d/best.pt
    on_disk = ckpt.load_checkpoint(tmp_path / "last-merged.pt")["run_stats"]["best"]
    assert on_disk["checkpoint"] is None and on_disk["step"] == 2
    monkeypatch.setattr(evaluator_mod, "evaluate", scripted([0.65]))
    resumed = train(config(tmp_path / "ds", tmp_path, "one", **{"train.max_steps": 4}),
                    resume=str(tmp_path / "best-merged.pt"))
    assert resumed["best"]["step"] == 2 and resumed["best_checkpoint"] == str((tmp_path / "best-merged.pt").absolute())
    assert "sharded" not in ckpt.load_checkpoint(Path(resumed["best_checkpoint"]))


def test_merging_one_shard_names_its_manifest(sharded):
    """A shard given to the merge: it said "not a sharded checkpoint (it already loads in one process)", which a shard
    does not (--resume and --eval-only refuse it); now it names the manifest to merge."""
    tmp_path, d = sharded
    for shard, manifest in (("step-00000006.rank1-of-2.pt", "step-00000006.pt"),
                            ("best-step-00000002.rank0-of-2.pt", "best.pt")):
        with pytest.raises(ConfigError, match=f"{shard}: one shard of a sharded checkpoint; merge its manifest, "
                                              f"{d / manifest}$"):
            merge_to_file(d / shard, tmp_path / "shard-merged.pt")
    assert not (tmp_path / "shard-merged.pt").exists()
    # --resume of a best shard named step-00000002.pt, which the pruning may have removed, not best.pt
    with pytest.raises(ConfigError, match=r"one shard of a sharded checkpoint; resume from its manifest \(best.pt\)$"):
        load_for_rank(d / "best-step-00000002.rank0-of-2.pt", DistEnv(), None)
