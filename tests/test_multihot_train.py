"""configs/mlperf-dcnv2.json end to end on a tiny multi-hot dataset, on the CPU (issue #22).

The config's shapes shrunk (D 8, cross rank 4, fp32 tables and precision), its multi-hot sizes and
table sizes replaced by the dataset's (metadata.json wins): training with the torch kernels
(PooledSparseArch) and with Triton kernels (TritonPooledEmbedding and the rest, under the
interpreter), exact resume from a checkpoint, `--export` (the program takes the [B, L] slots,
PAD_SPARSE included) and `--eval-only` through train.py's command line. The data are variable-fill
(lists of 1..s values, padded with PAD_SPARSE) unless a test says otherwise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.data import synthetic
from dlrm.data.loader import ParquetLoader, split_files, transform_dense
from dlrm.data.schema import NUM_SPARSE, PAD_SPARSE, read_metadata
from dlrm.logging_setup import configure_logging
from dlrm.model.pooled_sparse import PooledSparseArch
from dlrm.train.trainer import train
from tests.conftest import REPO

MLPERF = REPO / "configs" / "mlperf-dcnv2.json"
SIZES = [1] * NUM_SPARSE
SIZES[0], SIZES[2], SIZES[9], SIZES[20], SIZES[21] = 3, 2, 4, 3, 2  # L = 26 + 2 + 1 + 3 + 2 + 1 = 35
WIDTH = sum(SIZES)
# multi-hot only where the synthetic data never miss a value (a missing value is an empty list, all
# PAD): fixed fill then has no PAD slot at all
FIXED_SIZES = [1] * NUM_SPARSE
FIXED_SIZES[0], FIXED_SIZES[4], FIXED_SIZES[9], FIXED_SIZES[22] = 3, 2, 4, 2

# Triton runs on CUDA where there is one (the CPU has no interpreter there: conftest sets it only
# without CUDA); torch runs beside it on the same device, so the two are compared like for like
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHRINK = {"model.embedding_dim": 8, "model.bottom_mlp": [16, 8], "model.top_mlp": [16, 8, 1], "model.cross_rank": 4,
          "model.embedding_dtype": "fp32", "train.precision": "fp32", "data.batch_size": 32, "data.shuffle": True,
          "train.device": DEVICE, "train.compile": False, "train.max_steps": 6, "train.log_every": 2, "train.deterministic": True,
          "train.baseline": False, "checkpoint.every": 3, "checkpoint.keep": 5}
TRITON = {f"kernels.{k}": "triton" for k in ("embedding", "interaction", "mlp", "loss")}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Written once for the run's workers (`computed_once`: each worker wrote them again, 1.4 s in CI); read only."""
    from tests.shared_once import computed_once

    def make(root):
        for fill, sizes in (("variable", SIZES), ("fixed", FIXED_SIZES)):
            synthetic.generate(root / fill, 400, seed=2, cardinalities="tiny", multi_hot_sizes=sizes,
                               multi_hot_fill=fill, validation_fraction=0.2, test_fraction=0.0)

    root = computed_once(tmp_path_factory, "multihot-train-datasets", make)
    return {fill: root / fill for fill in ("variable", "fixed")}


@pytest.fixture(autouse=True)
def _restore_logging():
    """The command line's main() points loguru at CliRunner's stderr, closed afterwards: point it back."""
    yield
    configure_logging()


def config(dataset, tmp_path, run_name, **overrides):
    return load_config(MLPERF, {**SHRINK, "data.path": str(dataset), "log.tb_dir": str(tmp_path / "tb"),
                                "log.run_name": run_name, **overrides})


def final_checkpoint(tmp_path, run_name) -> dict:
    return ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "tb" / run_name)[-1])


def test_dataset_is_multi_hot_with_pad_slots(datasets):
    """The variable-fill data have PAD slots, and whole features of PAD (a missing value); the
    fixed-fill data have none."""
    for fill, sizes, pads in (("variable", SIZES, True), ("fixed", FIXED_SIZES, False)):
        meta = read_metadata(datasets[fill])
        assert meta.multi_hot_sizes == sizes
        loader = ParquetLoader(split_files(datasets[fill], meta, "train"), 320, multi_hot_sizes=sizes)
        (batch,) = list(loader)
        assert batch.sparse.shape == (320, sum(sizes))
        assert bool((batch.sparse == PAD_SPARSE).any()) == pads, fill
    start = sum(SIZES[:21])
    meta = read_metadata(datasets["variable"])
    (batch,) = list(ParquetLoader(split_files(datasets["variable"], meta, "train"), 320, multi_hot_sizes=SIZES))
    assert bool((batch.sparse[:, start:start + 2] == PAD_SPARSE).all(1).any())  # feature 21 empty in some rows


def test_trains_with_torch_and_with_triton_kernels(datasets, tmp_path):
    eager = train(config(datasets["variable"], tmp_path, "torch", **{"kernels.embedding": "torch"}))
    triton = train(config(datasets["variable"], tmp_path, "triton", **TRITON))
    for summary in (eager, triton):
        assert summary["steps"] == 6 and 0.0 < summary["auc"] < 1.0
        losses = [l for _, l in summary["train_losses"]]
        assert len(losses) == 3 and all(np.isfinite(losses))
    # the same model from the same seed: the Triton run tracks the eager one
    for (s1, l1), (s2, l2) in zip(eager["train_losses"], triton["train_losses"]):
        assert s1 == s2 and l2 == pytest.approx(l1, abs=1e-4)
    assert triton["auc"] == pytest.approx(eager["auc"], abs=1e-3)
    a, b = final_checkpoint(tmp_path, "torch")["model"], final_checkpoint(tmp_path, "triton")["model"]
    assert list(a) == list(b)
    assert a["sparse_arch.weight"].shape == (sum(read_metadata(datasets["variable"]).cardinalities), 8)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kernels", ["torch", "triton", "triton-bf16"])
def test_resume_gives_the_uninterrupted_runs_weights(datasets, tmp_path, kernels):
    """"triton-bf16": bf16 tables, whose fp32 Adagrad sums must come back fp32 (not cast to the table's
    dtype) and whose stochastic-rounding seed must go on where it stopped."""
    over = {"kernels.embedding": "torch"} if kernels == "torch" else TRITON
    if kernels != "torch" and DEVICE == "cpu":  # the other Triton kernels hold no state a resume restores; under the
        over = {"kernels.embedding": "triton"}  # CPU's interpreter they were most of this test's time
    if kernels == "triton-bf16":
        over = {**over, "model.embedding_dtype": "bf16"}
    # 4 steps, resumed at step 2 (a checkpoint every 2): the same property as at 6 and 4, with a third fewer steps,
    # which under the CPU's Triton interpreter were nearly all of this test's time
    over = {**over, "checkpoint.every": 2, "train.max_steps": 4}
    full = train(config(datasets["variable"], tmp_path, "full", **over))
    train(config(datasets["variable"], tmp_path, "parts", **{**over, "train.max_steps": 2}))
    resumed = train(config(datasets["variable"], tmp_path, "parts", **over), resume="latest")
    assert resumed["steps"] == 4 and resumed["resumed_from"] and resumed["resumed_at_step"] == 2
    assert resumed["train_losses"] == full["train_losses"]  # bit for bit
    assert resumed["auc"] == full["auc"]
    a, b = final_checkpoint(tmp_path, "full"), final_checkpoint(tmp_path, "parts")
    assert a["position"] == b["position"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        assert oa["state"].keys() == ob["state"].keys() and oa["state"]
        for pid, st in oa["state"].items():
            for name, value in st.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][pid][name])), (pid, name)


def _config_file(tmp_path, dataset, **overrides) -> str:
    """configs/mlperf-dcnv2.json shrunk, as a file for train.py's command line."""
    raw = json.loads(MLPERF.read_text())
    for dotted, value in {**SHRINK, "data.path": str(dataset), **overrides}.items():
        section, *rest = dotted.split(".")
        node = raw.setdefault(section, {})
        for key in rest[:-1]:
            node = node.setdefault(key, {})
        node[rest[-1]] = value
    path = tmp_path / "mlperf-small.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_export_and_eval_only_from_the_command_line(datasets, tmp_path):
    from dlrm.cli import main
    from dlrm.train.export import model_from_checkpoint
    from dlrm.train.trainer import build_for_data

    cfg = config(datasets["variable"], tmp_path, "exp", **{"train.max_steps": 4})
    summary = train(cfg)
    run_dir = tmp_path / "tb" / "exp"
    cfg_file = _config_file(tmp_path, datasets["variable"])
    common = ["--config", cfg_file, "--device", "cpu", "--checkpoint", str(run_dir)]

    res = CliRunner().invoke(main, [*common, "--export", str(tmp_path / "mh.pt2")])  # (a bare export: no --tb-dir)
    assert res.exit_code == 0, res.output
    assert f"[B, {WIDTH}]" in res.output  # the program takes one column per slot
    _, _, _, tables = build_for_data(cfg)
    assert tables.multi_hot_sizes == SIZES
    model = model_from_checkpoint(cfg, summary["checkpoint"], tables, torch.device("cpu"))
    assert type(model.sparse_arch) is PooledSparseArch
    program = torch.export.load(str(tmp_path / "mh.pt2")).module()
    rng = np.random.default_rng(0)
    for batch in (1, 3, 33):
        counts = torch.from_numpy(rng.integers(-2, 5000, (batch, 13)))
        raw = torch.from_numpy(rng.integers(-1, 2**32, (batch, WIDTH)))
        raw[:, 1:3] = PAD_SPARSE  # feature 0: one value, two empty slots
        raw[0, 26:30] = PAD_SPARSE  # feature 9 of sample 0: all slots empty
        torch.testing.assert_close(program(counts, raw), model.predict(transform_dense(counts), raw), rtol=1e-6, atol=1e-7)

    res = CliRunner().invoke(main, [*common, "--eval-only", "--tb-dir", str(tmp_path / "tb"), "--run-name", "ev"])
    assert res.exit_code == 0, res.output
    ev = json.loads((tmp_path / "tb" / "ev" / "summary.json").read_text())
    assert ev["split"] == "validation" and ev["rows"] == read_metadata(datasets["variable"]).splits["validation"].rows
    # the run's last checkpoint is its final model, which the run evaluated at its end
    assert ev["auc"] == pytest.approx(summary["auc"], abs=1e-9)
    assert ev["logloss"] == pytest.approx(summary["logloss"], abs=1e-6)


def test_fixed_fill_trains_with_sparse_weight_decay(datasets, tmp_path):
    """No PAD slots: the torch and Triton embeddings' lazy weight decay agree (with PAD slots the
    eager EmbeddingBag touches each table's row 0 with a zero gradient, which it then decays)."""
    over = {"optim.sparse.weight_decay": 0.01, "optim.sparse.lr": 0.05, "train.max_steps": 4}
    eager = train(config(datasets["fixed"], tmp_path, "wd-torch", **over, **{"kernels.embedding": "torch"}))
    triton = train(config(datasets["fixed"], tmp_path, "wd-triton", **over, **{"kernels.embedding": "triton"}))
    assert eager["steps"] == triton["steps"] == 4 and 0.0 < triton["auc"] < 1.0
    a, b = final_checkpoint(tmp_path, "wd-torch")["model"], final_checkpoint(tmp_path, "wd-triton")["model"]
    torch.testing.assert_close(b["sparse_arch.weight"], a["sparse_arch.weight"], rtol=1e-4, atol=1e-6)


def test_bf16_tables_on_the_cpu_are_refused(datasets, tmp_path):
    """(Multi-hot tables sharded over ranks are tested in tests/test_distributed.py.)"""
    with pytest.raises(ConfigError, match=r'^model\.embedding_dtype: "bf16" needs kernels\.embedding "triton"'):
        train(config(datasets["variable"], tmp_path, "bf16", **{"model.embedding_dtype": "bf16", "train.device": "cpu"}))

def test_compiled_step_of_the_mlperf_model_is_one_graph():
    """The MLPerf model whose lookup builds the DCN input (`DLRM.concat_in_lookup`): whether the step takes that path
    is decided when the step is built, and Dynamo traces `TrainStep._full_loss` (forward and loss) as one graph, with
    no graph break as it runs. On the GPU machine's torch 2.11 the same decision inside the traced function, a
    comparison of two bound methods, made Dynamo give up on the whole frame: the loss and its backward ran as eager
    ops (twenty-fourth run; torch 2.13 here compares bound methods, so only a GPU run of this test covers that)."""
    import sys

    from dlrm.config import validate
    from dlrm.train.builder import build_run, tables_from_config
    from dlrm.train.step import TrainStep

    sys.path.append(str(REPO / "benchmarks"))
    from _common import synthetic_batches

    shrunk = {k: v for k, v in SHRINK.items() if k.startswith("model.")}
    cfg = load_config(MLPERF, {**shrunk, "kernels.embedding": "triton", "train.compile": True, "train.precision": "fp32",
                               "train.cuda_graph": False, "data.batch_size": 16})  # the step itself, not its graph
    validate(cfg)
    tables = tables_from_config(cfg)
    tables.cardinalities[:] = [min(c, 50) for c in tables.cardinalities]
    device = torch.device(DEVICE)  # Triton's interpreter on the CPU, the kernels themselves on a GPU
    run = build_run(cfg, tables, device, total_steps=4)
    step = run.train_step
    assert isinstance(step, TrainStep) and step.embedding_in_graph and step.model.concat_in_lookup
    assert step.lookup_builds_concat
    batch = synthetic_batches(1, 16, device, multi_hot_sizes=cfg.model.multi_hot_sizes)[0]
    explained = torch._dynamo.explain(step._full_loss)(batch.dense, batch.sparse, batch.labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    # and as the step runs it (explain had reported one graph on the GPU for the old code too): Dynamo's counters
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(step._full_loss, backend="eager")(batch.dense, batch.sparse, batch.labels).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # another dense forward (a distributed run's DDP wrapper) takes the lookup-then-concatenate path
    other = TrainStep(step.model, step.loss_fn, step.optimizers, "fp32", device, cfg.train.compile,
                      dense_forward=lambda dense, embeddings: step.model.forward_from_embeddings(dense, embeddings))
    assert not other.lookup_builds_concat
