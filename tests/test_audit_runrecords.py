"""What a run's files record against what it did (audit runrecords): config.json, summary.json's config and every
checkpoint's config hold the dataset's table sizes the run trained (they held the config file's `model.cardinalities`
and `model.multi_hot_sizes`: null, or other sizes), without a resume of a run recorded the old way being refused;
summary.json's "resolved" states every setting the run decided at its start (device, precision, the batch after a
small split's adjustment, the compile mode as compiled, the dataset's tables and hashing, the sharding plan, whether
the baseline was fitted; --eval-only's summary too), its wall_s counts the baseline's fit, and the last logging
window's samples/s leaves out the train loader's shutdown."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import CompileConfig, Config, ConfigError, load_config
from dlrm.data.schema import NUM_SPARSE
from dlrm.distributed.sharding import plan_sharding
from dlrm.train import trainer as trainer_mod
from dlrm.train.compare import run_comparison
from dlrm.train.export import evaluate_checkpoint
from dlrm.train.reporting import resolved_settings
from dlrm.train.resume_policy import check_resume_config
from dlrm.train.setup import Tables
from dlrm.train.step import compile_mode_on
from dlrm.train.trainer import train
from tests.conftest import make_dataset

CARD = 11  # make_dataset's table size


def _config(tmp_path: Path, **model) -> Path:
    """A tiny run on a one-hot dataset of 40 train rows (tables of 11 rows) whose config file names other sizes."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16}, cardinality=CARD)
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], **model},
           "train": {"epochs": 1, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 5, "baseline": False},
           "checkpoint": {"every": 2, "keep": 10}, "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    return tmp_path / "c.json"


def test_config_json_summary_and_checkpoints_record_the_datasets_table_sizes(tmp_path):
    """The config file says 7-row tables of 2 values a feature; the dataset has 11-row one-hot tables, which the run
    trains (as the checkpoint's own `cardinalities` said). config.json, summary.json's config and the checkpoint's
    config said 7 and 2: a run compared by its config.json looked like another model than it trained."""
    config = _config(tmp_path, cardinalities=[7] * NUM_SPARSE, multi_hot_sizes=[2] * NUM_SPARSE)
    summary = train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))
    run = tmp_path / "tb" / "r"
    state = ckpt.load_checkpoint(run / "checkpoints" / "step-00000002.pt")
    assert state["cardinalities"] == [CARD] * NUM_SPARSE  # what trained
    for recorded in (json.loads((run / "config.json").read_text()), summary["config"], state["config"]):
        assert recorded["model"]["cardinalities"] == [CARD] * NUM_SPARSE
        assert recorded["model"]["multi_hot_sizes"] == [1] * NUM_SPARSE
    assert summary["resolved"]["tables"] == {"cardinalities": [CARD] * NUM_SPARSE, "hashing": "modulus",
                                             "multi_hot_sizes": [1] * NUM_SPARSE, "dense_format": "counts"}


def test_a_run_recorded_with_the_config_files_sizes_resumes_and_other_changes_are_still_refused(tmp_path):
    """A checkpoint saved before the sizes were recorded holds the config file's (null here): its resume, whose config
    now holds the dataset's, is not refused for them (nor for another model.cardinalities in the file, which trains
    nothing else); a change that trains otherwise still is."""
    config = _config(tmp_path)
    first = train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))
    saved = dict(first["config"], model={**first["config"]["model"], "cardinalities": None, "multi_hot_sizes": None})
    check_resume_config(saved, first["config"], (), "old.pt")  # raised "model.cardinalities: null -> [11, ...]"
    changed = dict(first["config"], optim={**first["config"]["optim"], "dense": {**first["config"]["optim"]["dense"],
                                                                                 "lr": 0.5}})
    with pytest.raises(ConfigError, match="optim.dense.lr"):
        check_resume_config(saved, changed, (), "old.pt")
    # the file's (inert) sizes changed on the way: the run goes on, recording the dataset's
    over = {"log.run_name": "r", "model.cardinalities": [9] * NUM_SPARSE}
    resumed = train(load_config(config, over), resume="latest")
    assert resumed["resumed_at_step"] == 2 and resumed["steps"] == 5
    assert resumed["config"]["model"]["cardinalities"] == [CARD] * NUM_SPARSE


def test_resolved_states_what_the_run_used(tmp_path, monkeypatch):
    """A batch larger than the split (trained as one batch of its 40 rows), data.path given relative, the baseline
    fitted: "resolved" names each as used. It held the kernels, compile, step graph and placement only."""
    config = _config(tmp_path)
    monkeypatch.chdir(tmp_path)
    summary = train(load_config(config, {"log.run_name": "r", "data.batch_size": 64, "data.path": "ds",
                                         "train.baseline": True, "train.epochs": 2}))
    resolved = summary["resolved"]
    assert resolved["batch_size"] == summary["batch_size"] == 40 and resolved["eval_batch_size"] == 4 * 64
    assert (resolved["steps"], resolved["steps_per_epoch"]) == (summary["steps"], 1) == (2, 1)
    assert resolved["data_path"] == str(tmp_path / "ds")
    assert (resolved["device"], resolved["precision"], resolved["seed"]) == ("cpu", "fp32", 5)
    assert (resolved["world_size"], resolved["sharding"]) == (1, None)
    assert (resolved["compile"], resolved["compile_mode"], resolved["combo_kernels"]) == (False, None, False)
    assert resolved["baseline"] is True and summary["baseline"]["auc"] == summary["baseline"]["auc"]
    assert resolved["kernels"] == {"embedding": "torch", "interaction": "torch", "mlp": "torch", "loss": "torch"}
    assert resolved["placement"] == "stream"
    on_disk = json.loads((tmp_path / "tb" / "r" / "summary.json").read_text())
    assert on_disk["resolved"] == resolved


def test_resolved_names_the_compile_mode_and_sharding_plan_used():
    """A compiled run's mode as it compiles on its device (reduce-overhead's CUDA graphs are CUDA's: mode default on
    the CPU, which the config and fast_path's record did not say), combo kernels off the GPU, and a distributed run's
    sharding plan (which tables each rank holds: in the start's log lines only)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_mode_on(CompileConfig(enabled=True, mode="reduce-overhead"), cpu) == "default"
    assert compile_mode_on(CompileConfig(enabled=True, mode="reduce-overhead"), cuda) == "reduce-overhead"
    assert compile_mode_on(CompileConfig(enabled=True, mode="max-autotune"), cpu) == "max-autotune-no-cudagraphs"
    assert compile_mode_on(CompileConfig(enabled=True, mode="auto"), cuda) == "default"
    cards = [5] * (NUM_SPARSE - 1) + [50]
    plan = plan_sharding(cards, 2, "table", 10_000_000)
    compiled = CompileConfig(enabled=True, mode="reduce-overhead", combo_kernels=True)
    cfg = Config()
    cfg.train.compile = compiled
    run = SimpleNamespace(config=cfg, plan=plan)
    data = SimpleNamespace(batch_size=32, total_steps=9, train=[0] * 3)
    tables = Tables(cards, None, "modulus", None)
    resolved = resolved_settings(run, cfg, data, tables, "stream", cpu, 2, False)
    assert (resolved["compile"], resolved["compile_mode"], resolved["combo_kernels"]) == (True, "default", False)
    assert resolved_settings(run, cfg, data, tables, "gpu", cuda, 2, False)["combo_kernels"] is True
    assert resolved["sharding"] == plan.to_dict() and resolved["sharding"]["world_size"] == 2
    assert sorted(set(resolved["sharding"]["table_rank"])) == [0, 1]
    assert resolved["tables"]["multi_hot_sizes"] == [1] * NUM_SPARSE and resolved["world_size"] == 2


def test_the_comparison_and_an_evaluation_record_the_datasets_sizes(tmp_path):
    """--compare's own config.json and --eval-only's config.json and summary.json held the config file's sizes too."""
    config = _config(tmp_path, cardinalities=[7] * NUM_SPARSE)
    cfg = load_config(config, {"log.run_name": "cmp", "train.max_steps": 2})
    run_comparison(cfg, ["eager"], train)
    for path in (tmp_path / "tb" / "cmp" / "config.json", tmp_path / "tb" / "cmp" / "eager" / "config.json"):
        assert json.loads(path.read_text())["model"]["cardinalities"] == [CARD] * NUM_SPARSE, path
    checkpoint = tmp_path / "tb" / "cmp" / "eager" / "checkpoints" / "step-00000002.pt"
    summary = evaluate_checkpoint(load_config(config, {"log.run_name": "ev"}), checkpoint, "validation")
    assert summary["config"]["model"]["cardinalities"] == [CARD] * NUM_SPARSE
    recorded = json.loads((tmp_path / "tb" / "ev" / "config.json").read_text())
    assert recorded["model"]["cardinalities"] == [CARD] * NUM_SPARSE
    # and what it evaluated with, where its config says "auto" (kernels, compile) or null (the batch: 4 x 8)
    assert summary["config"]["kernels"]["embedding"] == "auto" and summary["config"]["data"]["eval_batch_size"] is None
    assert summary["resolved"]["kernels"] == {"embedding": "torch", "interaction": "torch", "mlp": "torch",
                                              "loss": "torch"}
    assert (summary["resolved"]["compile"], summary["resolved"]["batch_size"]) == (False, 32)
    assert summary["resolved"]["tables"]["cardinalities"] == [CARD] * NUM_SPARSE


def test_wall_s_counts_the_baselines_fit(tmp_path, monkeypatch):
    """wall_s is "this session's wall clock, everything included", and the final line prints it as the run's time;
    the baseline (22 s for data/sample's rows on 2 CPU cores) was fitted after it was taken, and left out."""
    fit_s = 0.6

    def slow_baseline(*args, **kwargs):
        time.sleep(fit_s)
        return {"auc": 0.7, "logloss": 0.5, "accuracy": 0.75}

    monkeypatch.setattr(trainer_mod, "run_baseline", slow_baseline)
    config = _config(tmp_path)
    started = time.perf_counter()
    summary = train(load_config(config, {"log.run_name": "r", "train.max_steps": 2}))
    elapsed = time.perf_counter() - started
    assert summary["resolved"]["baseline"] is True
    assert fit_s <= summary["wall_s"] <= elapsed


def test_the_last_logging_window_leaves_the_loaders_shutdown_out(tmp_path, monkeypatch, clock):
    """The last step's logging window was read after the loop had asked for one more batch, which stopped the train
    loader (its producer decoding the next epoch ahead, `chain_epochs`: 35 ms for data/sample, a whole buffer's decode
    for larger data): that time counted as training in the last window's samples/s (TensorBoard's last point) and in
    summary.json's samples_per_sec. Here the shutdown takes 1000 s of the clock the run reads; the run's 20 steps take
    far less (a real sleep of 2 s was less than 20 steps on CI's 2 loaded cores: 21 samples/s)."""
    from dlrm.data.parquet_loader import ParquetLoader

    shutdown_s, original = 1000.0, ParquetLoader.close

    def slow_close(self):
        clock(shutdown_s)
        original(self)

    monkeypatch.setattr(ParquetLoader, "close", slow_close)
    config = _config(tmp_path)
    summary = train(load_config(config, {"log.run_name": "r", "train.epochs": 4, "train.eval_every": None,
                                         "checkpoint.every": None}))
    assert summary["steps"] == 20 and summary["train_losses"][-1][0] == 20
    # with the shutdown inside the windows' seconds, samples/s <= the steady samples (< all 160) / 2 s
    assert summary["samples_per_sec"] > summary["samples"] / shutdown_s


def test_a_session_that_trains_no_step_reports_no_throughput(tmp_path, monkeypatch):
    """A run killed after its last checkpoint, before summary.json (here in the baseline's fit): its resume trains no
    step and makes the last evaluation and the summary. summary.json and the final line said "0 samples/s" for it, a
    throughput the run never had; now null, and the line says no sample was trained in this session."""
    from loguru import logger

    config = _config(tmp_path)
    over = {"log.run_name": "r", "train.max_steps": 4}
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "run_baseline", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            train(load_config(config, over))
    assert not (tmp_path / "tb" / "r" / "summary.json").exists()
    lines = []
    handle = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    try:
        summary = train(load_config(config, over), resume="latest")
    finally:
        logger.remove(handle)
    assert (summary["resumed_at_step"], summary["steps"], summary["samples"]) == (4, 4, 32)
    assert summary["samples_per_sec"] is None
    assert json.loads((tmp_path / "tb" / "r" / "summary.json").read_text())["samples_per_sec"] is None
    final = [line for line in lines if line.startswith("validation: AUC")]
    assert len(final) == 1 and "4 steps, 32 samples (none trained in this session)" in final[0], final
    assert "samples/s" not in final[0]
