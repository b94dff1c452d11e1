""""auto" choices at their boundaries and where an explicit setting beside them must change the pick (audit)."""

import sys

import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm.train.fast_path import AUTOTUNE_MIN_STEPS, AUTOTUNE_MODE, resolve_fast_path
from tests.conftest import REPO

CUDA = torch.device("cuda")


def kaggle(**overrides):
    return load_config(REPO / "configs" / "kaggle.json", overrides)


def test_autotuning_starts_at_exactly_the_minimum_run_length():
    cfg = kaggle(**{"data.batch_size": 65536, "train.precision": "bf16"})
    at, _ = resolve_fast_path(cfg, CUDA, total_steps=AUTOTUNE_MIN_STEPS)
    below, _ = resolve_fast_path(cfg, CUDA, total_steps=AUTOTUNE_MIN_STEPS - 1)
    assert (at.train.compile.mode, below.train.compile.mode) == (AUTOTUNE_MODE, "default")


def test_an_explicit_fused_mlp_in_tf32_keeps_mode_default_in_a_long_run():
    """kernels.mlp "fused" set by hand is the fused MLP "auto" would pick: mode default, no minutes of autotuning."""
    cfg = kaggle(**{"data.batch_size": 65536, "train.precision": "tf32", "kernels.mlp": "fused"})
    resolved, chosen = resolve_fast_path(cfg, CUDA, total_steps=2_000_000)
    assert resolved.train.compile.mode == "default" and resolved.kernels.mlp == "fused"
    assert "matched max-autotune's templates" in chosen["train.compile.mode"]["why"]


def test_an_explicit_template_mode_keeps_pytorch_mlps_beside_the_gluon_cross_layers(monkeypatch):
    import kernels.cross_ws_op

    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    monkeypatch.setattr(kernels.cross_ws_op, "gluon_hopper_available", lambda device: True)
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json", {"data.batch_size": 65536})
    resolved, _ = resolve_fast_path(cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.kernels.interaction == "gluon" and resolved.kernels.mlp == "fused"
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json",
                      {"data.batch_size": 65536, "train.compile.mode": "max-autotune-no-cudagraphs"})
    resolved, chosen = resolve_fast_path(cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.kernels.interaction == "gluon" and resolved.kernels.mlp == "torch", chosen["kernels.mlp"]
    assert "max-autotune GEMM templates" in chosen["kernels.mlp"]["why"]


def test_the_compiled_multi_hot_torch_embedding_keeps_the_ordinary_step():
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json",
                      {"kernels.embedding": "torch", "model.embedding_dtype": "fp32"})
    resolved, chosen = resolve_fast_path(cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.train.compile.enabled is True and resolved.train.cuda_graph is False
    assert "EmbeddingBag" in chosen["train.cuda_graph"]["why"]


def test_dense_adagrad_with_fused_true_keeps_the_ordinary_step():
    try:
        cfg = kaggle(**{"optim.dense.name": "adagrad", "optim.dense.fused": True})
    except ConfigError:
        pytest.fail("fused Adagrad should be a valid config (it runs on the CPU)")
    resolved, chosen = resolve_fast_path(cfg, CUDA)
    assert resolved.train.cuda_graph is False and "fused Adagrad" in chosen["train.cuda_graph"]["why"]


def test_a_graphing_compile_mode_of_an_eager_run_leaves_the_step_graph_on():
    """The mode of a run that does not compile makes no CUDA graphs: the step graph stays."""
    cfg = kaggle(**{"train.compile": {"enabled": False, "mode": "reduce-overhead"}})
    resolved, chosen = resolve_fast_path(cfg, CUDA)
    assert resolved.train.cuda_graph is True, chosen["train.cuda_graph"]


def test_an_eager_cuda_run_resolves_combo_kernels_off_and_logs_nothing():
    cfg = kaggle(**{"train.compile.enabled": False, "train.precision": "bf16", "data.batch_size": 2048})
    resolved, chosen = resolve_fast_path(cfg, CUDA)
    assert resolved.train.compile.combo_kernels is False and "train.compile.combo_kernels" not in chosen
    assert "train.compile.mode" not in chosen and resolved.train.compile.mode == "default"


def test_bf16_tables_where_auto_cannot_pick_triton_are_a_config_error():
    cfg = kaggle(**{"model.embedding_dtype": "bf16"})
    with pytest.raises(ConfigError, match="model.embedding_dtype"):
        resolve_fast_path(cfg, torch.device("cpu"))
    assert resolve_fast_path(cfg, CUDA)[0].kernels.embedding == "triton"


def test_without_triton_auto_takes_pytorch_on_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    resolved, chosen = resolve_fast_path(kaggle(), CUDA)
    assert vars(resolved.kernels) == {"embedding": "torch", "interaction": "torch", "mlp": "torch", "loss": "torch"}
    assert chosen["kernels.embedding"]["why"] == "triton is not installed"


def test_the_fused_mlp_beside_gluon_cross_layers_is_for_bf16_only():
    """Measured beside the Gluon cross layers in bf16 only: an explicit Gluon interaction in tf32 keeps the tf32 rule
    (the fused MLP from batch 65536), so PyTorch MLPs at 32768."""
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json",
                      {"data.batch_size": 32768, "train.precision": "tf32", "kernels.interaction": "gluon"})
    resolved, chosen = resolve_fast_path(cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.kernels.mlp == "torch", chosen["kernels.mlp"]


def test_auto_mlp_follows_the_runs_tables_not_the_configs_sizes():
    """The dataset's multi-hot sizes win over model.multi_hot_sizes (dlrm.train.setup.dataset_tables): a multi-hot
    dataset under a config without sizes keeps PyTorch MLPs (the wgrad MLPs were measured on one-hot models only), and
    a one-hot dataset under a multi-hot config takes them."""
    one_hot_cfg = kaggle(**{"data.batch_size": 8192, "train.precision": "bf16"})
    assert resolve_fast_path(one_hot_cfg, CUDA)[0].kernels.mlp == "wgrad"
    resolved, chosen = resolve_fast_path(one_hot_cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.kernels.mlp == "torch", chosen["kernels.mlp"]
    multi_hot_cfg = kaggle(**{"data.batch_size": 8192, "train.precision": "bf16", "model.multi_hot_sizes": [3] * 26})
    assert resolve_fast_path(multi_hot_cfg, CUDA, multi_hot=False)[0].kernels.mlp == "wgrad"


@pytest.mark.parametrize("overrides", [{"model.activation": "sigmoid"}, {"model.interaction": "cat"}])
def test_long_tf32_runs_autotune_where_the_fused_mlp_was_not_measured_against_the_templates(overrides):
    """Mode default in long tf32 runs only where the fused MLP matched the templates (ReLU, the dot interaction)."""
    cfg = kaggle(**{"data.batch_size": 65536, "train.precision": "tf32", **overrides})
    resolved, chosen = resolve_fast_path(cfg, CUDA, total_steps=2_000_000)
    assert resolved.train.compile.mode == AUTOTUNE_MODE, chosen["train.compile.mode"]


def test_the_wgrad_mlps_need_relu():
    cfg = kaggle(**{"data.batch_size": 8192, "train.precision": "bf16", "model.activation": "sigmoid"})
    assert resolve_fast_path(cfg, CUDA)[0].kernels.mlp == "torch"


def test_an_explicit_mlp_kernel_is_kept():
    cfg = kaggle(**{"data.batch_size": 65536, "train.precision": "tf32", "kernels.mlp": "torch"})
    resolved, chosen = resolve_fast_path(cfg, CUDA, total_steps=1000)
    assert resolved.kernels.mlp == "torch" and "kernels.mlp" not in chosen


@pytest.mark.parametrize("overrides, kw", [
    ({"data.batch_size": 65536}, {}),
    ({"data.batch_size": 8192, "train.precision": "bf16"}, {}),
    ({"optim.dense.fused": False}, {}),
    ({"distributed.backend": "gloo"}, {"distributed": True}),
])
def test_what_is_recorded_is_what_was_resolved(overrides, kw):
    resolved, chosen = resolve_fast_path(kaggle(**overrides), CUDA, total_steps=1000, **kw)
    where = {"train.compile": resolved.train.compile.enabled, "train.cuda_graph": resolved.train.cuda_graph,
             "train.compile.mode": resolved.train.compile.mode,
             "train.compile.combo_kernels": resolved.train.compile.combo_kernels,
             **{f"kernels.{k}": v for k, v in vars(resolved.kernels).items()}}
    assert {k: v["value"] for k, v in chosen.items()} == {k: where[k] for k in chosen}
    assert set(chosen) >= {"kernels.mlp", "train.cuda_graph"}
