"""What a DCN or multi-hot run reports, where the dot model's equivalent was right: its HParams session (the cross
network and the values a sample pooled were missing: runs of another rank, depth or hotness were told apart by
nothing), its start line (the cross network and, with the Triton embedding, the pooling unnamed; under torchrun
rank 0's shard of the tables counted as the model's parameters), a checkpoint of another cross network refused
naming the config key (it named a tensor's shape or state_dict keys), a sweep over the table sizes or values per
feature, which a run takes from the dataset (it trained the same model under each value), and the reason a DCN model
on the CPU gets the torch interaction (it was told the Triton cross layer measured slower, not that there is no GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import Config, ConfigError, ModelConfig, load_config
from dlrm.data import synthetic
from dlrm.data.schema import NUM_SPARSE, read_metadata
from dlrm.model.dlrm import build_model
from dlrm.train.setup import Tables
from dlrm.train.trainer import train
from tests.conftest import REPO
from tests.test_tensorboard_summaries import hparams_session_groups

MLPERF = REPO / "configs" / "mlperf-dcnv2.json"
SIZES = [1] * NUM_SPARSE
SIZES[0], SIZES[9], SIZES[20] = 3, 4, 2  # 26 + 2 + 3 + 1 = 32 values a sample
# configs/mlperf-dcnv2.json shrunk to the CPU as tests/test_multihot_train.py shrinks it
SHRINK = {"model.embedding_dim": 4, "model.bottom_mlp": [8, 4], "model.top_mlp": [8, 1], "model.cross_rank": 3,
          "model.cross_layers": 2, "model.embedding_dtype": "fp32", "train.precision": "fp32", "data.batch_size": 32,
          "train.device": "cpu", "train.compile": False, "train.max_steps": 2, "train.log_every": 1,
          "train.baseline": False, "optim.schedule.warmup_steps": 0}


@pytest.fixture(scope="module")
def multi_hot(tmp_path_factory):
    out = tmp_path_factory.mktemp("tbdcn") / "mh"
    synthetic.generate(out, 160, seed=3, cardinalities="tiny", multi_hot_sizes=SIZES, validation_fraction=0.2,
                       test_fraction=0.0)
    return out


def _config(dataset, tmp_path, run_name, **overrides):
    return load_config(MLPERF, {**SHRINK, "data.path": str(dataset), "log.tb_dir": str(tmp_path / "tb"),
                                "log.run_name": run_name, **overrides})


def test_a_dcn_multi_hot_run_names_its_cross_network_and_hotness_in_hparams_and_its_start_line(multi_hot, tmp_path):
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:  # the config's own multi_hot_sizes (MLPerf's, 214 a sample) lose to the dataset's
        summary = train(_config(multi_hot, tmp_path, "mh"))
    finally:
        logger.remove(sink)
    assert summary["steps"] == 2
    meta = read_metadata(multi_hot)
    assert meta.multi_hot_sizes == SIZES
    (group,) = hparams_session_groups(tmp_path / "tb")
    hp = group["hparams"]
    assert (hp["interaction"], hp["cross_layers"], hp["cross_rank"]) == ("dcn", 2, 3)
    assert hp["multi_hot_values"] == sum(SIZES) == 32
    (start,) = [line for line in lines if line.startswith("device cpu, precision fp32, ")]
    model = ckpt.load_checkpoint(summary["checkpoint"])["model"]
    params = sum(t.numel() for t in model.values())
    assert f"{params:,} parameters ({sum(meta.cardinalities):,} embedding rows, hashing modulus; " in start
    assert f"dcn: 2 cross layers of rank 3 over {27 * 4} inputs; " in start
    assert "multi-hot: 32 values a sample sum-pooled into 26 features)" in start

    # a checkpoint of another cross network: refused naming the key (its tensors' shapes and keys said it before)
    from dlrm.train.export import model_from_checkpoint
    from dlrm.train.trainer import build_for_data

    for key, value, message in (("model.cross_rank", 5, "model.cross_rank differs: checkpoint 3, this run 5"),
                                ("model.cross_layers", 3, "model.cross_layers differs: checkpoint 2, this run 3")):
        cfg = _config(multi_hot, tmp_path, "other", **{key: value})
        tables = build_for_data(cfg)[3]
        with pytest.raises(ConfigError, match=rf": {message}$"):
            model_from_checkpoint(cfg, summary["checkpoint"], tables, torch.device("cpu"))


def _experiment_hparams(logdir) -> list[str]:
    """The hparam columns TensorBoard's HParams dashboard shows (its plugin's /experiment)."""
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import hparams_plugin
    from werkzeug.test import Client
    from werkzeug.wrappers import Response

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    context = base_plugin.TBContext(logdir=str(logdir), multiplexer=mux,
                                    data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)))
    app = hparams_plugin.HParamsPlugin(context).get_plugin_apps()["/experiment"]
    response = Client(app, Response).post("/experiment", data=json.dumps({"experimentName": ""}),
                                          content_type="application/json")
    assert response.status_code == 200, response.get_data(as_text=True)
    return sorted(h["name"] for h in json.loads(response.get_data(as_text=True))["hparamInfos"])


@pytest.mark.parametrize("first", ["dot", "dcn"])
def test_the_dashboard_shows_the_cross_network_and_hotness_whichever_run_it_reads_first(tmp_path, first):
    """TensorBoard takes the columns from one run's experiment summary (the first it finds): a dot run's must name
    the DCN and multi-hot keys too (0, 0 and 26 there), or beside it the DCN runs' cross_rank was no column."""
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.train.reporting import log_hparams

    runs = {"dot": (Config(model=ModelConfig(interaction="dot")), None),
            "dcn": (Config(model=ModelConfig(interaction="dcn", cross_layers=2, cross_rank=8)), SIZES)}
    for prefix, name in (("a", first), ("b", "dcn" if first == "dot" else "dot")):
        cfg, sizes = runs[name]
        with SummaryWriter(str(tmp_path / f"{prefix}-{name}")) as w:
            log_hparams(w, cfg, 32, {"auc": 0.7, "logloss": 0.5, "accuracy": 0.75}, 1, sizes)
    assert _experiment_hparams(tmp_path) == ["batch_size", "compile", "cross_layers", "cross_rank", "dense_lr",
                                             "embedding_dim", "interaction", "kernels", "multi_hot_values", "precision",
                                             "seed", "sparse_lr", "steps"]
    groups = {g["name"]: g["hparams"] for g in hparams_session_groups(tmp_path)}
    dot, dcn = groups[f"{'a' if first == 'dot' else 'b'}-dot"], groups[f"{'a' if first == 'dcn' else 'b'}-dcn"]
    assert (dot["cross_layers"], dot["cross_rank"], dot["multi_hot_values"]) == (0, 0, NUM_SPARSE)
    assert (dcn["cross_layers"], dcn["cross_rank"], dcn["multi_hot_values"]) == (2, 8, sum(SIZES))


def test_a_one_hot_dot_run_keeps_its_start_line():
    from dlrm.train.reporting import model_text

    cfg = Config(model=ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]))
    cards = [5 + f for f in range(NUM_SPARSE)]
    model = build_model(cfg.model, cards)
    text = model_text(model, cfg, Tables(cards, None, "vocabulary", [1] * NUM_SPARSE))
    assert text == f"{sum(p.numel() for p in model.parameters()):,} parameters ({sum(cards):,} embedding rows, " \
                   "hashing vocabulary)"


def test_the_start_line_counts_the_whole_tables_of_a_sharded_model():
    """Rank 0 of two holds about half the rows: they were counted as the model's parameters."""
    from dlrm.distributed.sharded_embedding import ShardedSparseArch
    from dlrm.distributed.sharding import plan_sharding
    from dlrm.train.reporting import model_text

    cfg = Config(model=ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcn",
                                   cross_layers=2, cross_rank=3))
    cards = [10 + f for f in range(NUM_SPARSE)]
    plan = plan_sharding(cards, 2, "table", 10**7, SIZES)
    whole = build_model(cfg.model, cards, multi_hot_sizes=SIZES)
    shard = build_model(cfg.model, cards, multi_hot_sizes=SIZES,
                        sparse_arch=lambda: ShardedSparseArch(cards, 4, plan, 0, hotness=SIZES))
    assert shard.sparse_arch.weight.shape[0] == plan.local_rows(0) < sum(cards)
    tables = Tables(cards, None, "modulus", SIZES)
    count = sum(p.numel() for p in whole.parameters())
    assert model_text(shard, cfg, tables) == model_text(whole, cfg, tables)
    assert model_text(shard, cfg, tables).startswith(f"{count:,} parameters ({sum(cards):,} embedding rows")


@pytest.mark.parametrize("key, values", [
    ("model.multi_hot_sizes", [SIZES, [1] * NUM_SPARSE]),
    ("model.cardinalities", [[5] * NUM_SPARSE, [7] * NUM_SPARSE]),
])
def test_a_sweep_over_what_the_dataset_decides_is_refused(multi_hot, tmp_path, key, values):
    """The dataset's metadata.json wins over both: each setting trained the dataset's tables, the same model."""
    from click.testing import CliRunner

    from dlrm import sweep

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"interaction": "dcn"}, "train": {"device": "cpu"}}))
    res = CliRunner().invoke(sweep.main, ["--config", str(config), "--set", f"{key}={','.join(map(json.dumps, values))}",
                                          "--seeds", "1", "--tb-dir", str(tmp_path / "tb"), "--data", str(multi_hot)])
    assert res.exit_code == 2, res.output
    assert f"--set {key}: a training run takes it from the dataset's metadata.json" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("interaction", ["dot", "dcn", "cat"])
def test_without_a_gpu_the_interaction_kernel_is_torch_for_that_reason(interaction):
    """summary.json's fast_path and the "auto on cpu" line: a dcn (or cat) model on the CPU was told the Triton cross
    layer measured slower than the torch one, not that there is no GPU, as the dot model is."""
    from dlrm.config import config_from_dict
    from dlrm.train.fast_path import resolve_fast_path

    cfg = config_from_dict({"model": {"interaction": interaction}})
    resolved, chosen = resolve_fast_path(cfg, torch.device("cpu"))
    assert resolved.kernels.interaction == "torch"
    assert chosen["kernels.interaction"]["why"] == chosen["kernels.embedding"]["why"] == "no CUDA device (cpu)"
    on_gpu = resolve_fast_path(cfg, torch.device("cuda"))[1]["kernels.interaction"]  # resolution reads the type only
    assert ("dot interaction, not" in on_gpu["why"]) == (interaction != "dot")
