""""auto" resolves to the fastest path measured correct on the device, says why, and explicit settings win (issue #19)."""

import json

import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm.train.fast_path import resolve_fast_path
from tests.conftest import REPO

CUDA = torch.device("cuda")  # resolution only looks at the device type; nothing runs on it here


def cfg_with(**overrides):
    return load_config(REPO / "configs" / "kaggle.json", overrides)


def test_kaggle_on_cuda_gets_the_fast_path():
    resolved, chosen = resolve_fast_path(cfg_with(), CUDA)
    k = resolved.kernels
    assert (k.embedding, k.interaction, k.mlp, k.loss) == ("triton", "triton", "torch", "torch")
    assert resolved.train.compile.enabled is True and resolved.train.cuda_graph is True
    assert set(chosen) == {"kernels.embedding", "kernels.interaction", "kernels.mlp", "kernels.loss",
                           "train.compile", "train.cuda_graph", "train.compile.mode", "train.compile.combo_kernels"}
    assert resolved.train.compile.mode == "default"  # the whole step is one graph: no graphs inside it
    assert all(v["why"] for v in chosen.values())


def test_on_the_cpu_auto_is_plain_pytorch():
    resolved, chosen = resolve_fast_path(cfg_with(), torch.device("cpu"))
    assert vars(resolved.kernels) == {"embedding": "torch", "interaction": "torch", "mlp": "torch", "loss": "torch"}
    assert resolved.train.compile.enabled is False and resolved.train.cuda_graph is False
    assert "no CUDA device" in chosen["train.cuda_graph"]["why"]


@pytest.mark.parametrize("overrides, reason", [
    ({"optim.dense.fused": False}, "not a fused SGD or Adam"),
    ({"kernels.embedding": "torch", "train.compile.enabled": False}, "kernels.embedding is torch without train.compile"),
    ({"train.compile": {"mode": "reduce-overhead"}}, "reduce-overhead"),
])
def test_the_step_graph_turns_itself_off_where_it_cannot_run(overrides, reason):
    resolved, chosen = resolve_fast_path(cfg_with(**overrides), CUDA)
    assert resolved.train.cuda_graph is False
    assert reason in chosen["train.cuda_graph"]["why"]


def test_dense_adagrad_gets_the_step_graph():
    """Dense Adagrad is dlrm.train.adagrad.CapturableAdagrad on CUDA, whose captured step trained
    exactly like the ordinary one on the H100 (tests/test_graphed_step.py)."""
    resolved, chosen = resolve_fast_path(cfg_with(**{"optim.dense.name": "adagrad"}), CUDA)
    assert resolved.train.cuda_graph is True and chosen["train.cuda_graph"]["why"] == "one graph launch per step"


def test_the_compiled_torch_embedding_gets_the_step_graph():
    """--kernels torch on a GPU: compiled, the PyTorch embedding updates its rows in the backward with
    static shapes (FusedUpdateSparseArch), so the whole step is captured too."""
    resolved, chosen = resolve_fast_path(cfg_with(**{"kernels.embedding": "torch"}), CUDA)
    assert resolved.train.compile.enabled is True and resolved.train.cuda_graph is True


def test_several_processes_get_the_step_graph_with_the_triton_embedding_on_nccl():
    """The collectives are captured too (dlrm.train.graphed_step); the sharded torch embedding (sparse
    gradients) and gloo (no capturable collectives) keep the ordinary step."""
    resolved, chosen = resolve_fast_path(cfg_with(), CUDA, distributed=True)
    assert resolved.kernels.embedding == "triton" and resolved.train.cuda_graph is True
    resolved, chosen = resolve_fast_path(cfg_with(**{"kernels.embedding": "torch"}), CUDA, distributed=True)
    assert resolved.train.cuda_graph is False and "torch embedding" in chosen["train.cuda_graph"]["why"]
    resolved, chosen = resolve_fast_path(cfg_with(**{"distributed.backend": "gloo"}), CUDA, distributed=True)
    assert resolved.train.cuda_graph is False and "gloo" in chosen["train.cuda_graph"]["why"]


def test_cat_interaction_stays_pytorch():
    resolved, _ = resolve_fast_path(cfg_with(**{"model.interaction": "cat"}), CUDA)
    assert resolved.kernels.interaction == "torch" and resolved.kernels.embedding == "triton"


def test_explicit_settings_win_and_the_input_is_not_modified():
    cfg = cfg_with(**{"kernels.interaction": "torch", "train.compile.enabled": False, "train.cuda_graph": False})
    resolved, chosen = resolve_fast_path(cfg, CUDA)
    assert resolved.kernels.interaction == "torch" and resolved.train.compile.enabled is False
    assert resolved.train.cuda_graph is False and "train.cuda_graph" not in chosen
    assert cfg.kernels.embedding == "auto"  # the caller's config keeps its "auto"


def test_cli_kernels_torch_forces_every_component():
    from dlrm.cli import cli_overrides

    kwargs = dict(data=None, device=None, batch_size=None, epochs=None, max_steps=None, seed=None, run_name=None,
                  tb_dir=None, checkpoint_every=None, split=None, compile_=False, compile_mode=None, profile=None)
    cfg = cfg_with(**cli_overrides(**kwargs, kernels="torch"))
    resolved, _ = resolve_fast_path(cfg, CUDA)
    assert set(vars(resolved.kernels).values()) == {"torch"}
    assert resolved.train.compile.enabled is False and resolved.train.cuda_graph is False


def test_an_explicit_impossible_combination_is_still_a_config_error():
    with pytest.raises(ConfigError, match="train.cuda_graph: needs kernels.embedding"):
        cfg_with(**{"train.cuda_graph": True, "kernels.embedding": "torch", "train.compile.enabled": False})


def test_summary_records_what_auto_chose(tmp_path):
    from dlrm.train.trainer import train

    cfg = load_config(REPO / "configs" / "sample.json",
                      {"data.path": str(REPO / "data" / "sample"), "train.max_steps": 3, "train.device": "cpu",
                       "log.tb_dir": str(tmp_path), "log.run_name": "auto"})
    summary = train(cfg)
    on_disk = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert on_disk["fast_path"]["kernels.embedding"]["value"] == "torch"
    assert on_disk["resolved"]["cuda_graph"] is False and summary["resolved"]["compile"] is False


@pytest.fixture
def no_gluon(monkeypatch):
    """No Gluon cross layers, whatever GPU runs the tests: the MLP rules that do not depend on them."""
    import kernels.cross_ws_op

    monkeypatch.setattr(kernels.cross_ws_op, "gluon_hopper_available", lambda device: False)


@pytest.mark.parametrize("overrides, mlp", [
    # with compile mode "default" (explicit), the fused MLP where it won: tf32 from batch 65536 (+12-15%)
    ({"data.batch_size": 65536, "train.compile.mode": "default"}, "fused"),
    ({"data.batch_size": 131072, "train.compile.mode": "default"}, "fused"),
    ({"data.batch_size": 2048}, "torch"),  # -1% at 2048
    # bf16 from 8192, compiled: the wgrad MLPs (Kaggle +4.7% to +8.0%, Terabyte +1.5% to +2.4%), not the fused one
    # (-14% in bf16)
    ({"data.batch_size": 65536, "train.precision": "bf16", "train.compile.mode": "default"}, "wgrad"),
    ({"data.batch_size": 8192, "train.precision": "bf16"}, "wgrad"),
    ({"data.batch_size": 8191, "train.precision": "bf16"}, "torch"),
    ({"data.batch_size": 4096, "train.precision": "bf16"}, "torch"),  # 0.0% at 4096
    ({"data.batch_size": 2048, "train.precision": "bf16"}, "torch"),  # -8.1% at 2048
    ({"data.batch_size": 65536, "train.precision": "bf16", "train.compile.enabled": False}, "torch"),  # not measured eager
    ({"data.batch_size": 65536, "train.precision": "bf16", "model.interaction": "dcn"}, "torch"),  # nor with DCN
    ({"data.batch_size": 65536, "model.dropout": 0.1, "train.compile.mode": "default"}, "torch"),  # no dropout in it
    ({"data.batch_size": 65536, "model.activation": "sigmoid", "train.compile.mode": "default"}, "torch"),  # nor sigmoid
    # mode "auto" in a short run stays default: the fused MLP
    ({"data.batch_size": 65536}, "fused"),
])
def test_auto_mlp_is_fused_in_tf32_at_large_batches_only(overrides, mlp, no_gluon):
    resolved, chosen = resolve_fast_path(cfg_with(**overrides), CUDA, total_steps=1000)
    assert resolved.kernels.mlp == mlp, chosen["kernels.mlp"]
    assert ("won tf32 at batch 65536" in chosen["kernels.mlp"]["why"]) == (mlp == "fused")
    assert ("won bf16 from batch 8192" in chosen["kernels.mlp"]["why"]) == (mlp == "wgrad")
    assert resolve_fast_path(cfg_with(**overrides), torch.device("cpu"))[0].kernels.mlp == "torch"


@pytest.mark.parametrize("overrides", [{}, {"data.batch_size": 16384}, {"model.multi_hot_sizes": None},
                                       {"model.interaction": "dot"}])
def test_auto_mlp_keeps_pytorch_mlps_for_multi_hot_and_dcn_models(overrides, no_gluon):
    """MLPerf DLRM-DCNv2 at 65536: the wgrad MLPs measured +0.2% to +0.9% on the H100 and -0.9% to -2.3% on an H200
    (results/mlperf_dcnv2_wgrad.md), so "auto" keeps PyTorch MLPs there without the Gluon cross layers (beside them:
    the fused MLP, test_auto_mlp_takes_the_fused_mlp_beside_the_gluon_cross_layers), and on the models not measured."""
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json", overrides)
    resolved, chosen = resolve_fast_path(cfg, CUDA, multi_hot=cfg.model.multi_hot_sizes is not None, total_steps=1000)
    assert resolved.kernels.mlp == "torch", chosen["kernels.mlp"]


LONG = {"total_steps": 2_000_000}


BF16 = {"train.precision": "bf16"}


@pytest.mark.parametrize("overrides, kw, mode", [
    ({"data.batch_size": 65536, **BF16}, LONG, "max-autotune-no-cudagraphs"),
    ({"data.batch_size": 131072, **BF16}, LONG, "max-autotune-no-cudagraphs"),
    ({"data.batch_size": 65536}, {**LONG, "multi_hot": True}, "max-autotune-no-cudagraphs"),  # MLPerf: +2%
    # tf32 without the fused MLP (dropout): the templates
    ({"data.batch_size": 65536, "model.dropout": 0.1}, LONG, "max-autotune-no-cudagraphs"),
    ({"data.batch_size": 65536, **BF16}, {"total_steps": 999_999}, "default"),  # the autotuning would not be repaid
    ({"data.batch_size": 65536, **BF16}, {}, "default"),  # the length is unknown
    ({"data.batch_size": 32768}, LONG, "default"),  # not measured below 65536
    ({"data.batch_size": 65536, "train.cuda_graph": False}, LONG, "reduce-overhead"),  # only inside the step graph
    ({"data.batch_size": 65536}, {**LONG, "distributed": True}, "default"),
])
def test_auto_compile_mode_autotunes_long_runs_inside_the_step_graph_at_batch_65536(overrides, kw, mode):
    """Inductor's max-autotune (without its own CUDA graphs) where it was measured faster, the whole-step graph on and
    batch >= 65536 (+2% to +13% on the Kaggle, Terabyte and MLPerf models), and only in runs long enough to repay its
    2.5-5 minutes of autotuning (0.4M to 1M steps); the reason says so either way."""
    resolved, chosen = resolve_fast_path(cfg_with(**overrides), CUDA, **kw)
    assert resolved.train.compile.mode == mode
    why = chosen["train.compile.mode"]["why"]
    if mode == "max-autotune-no-cudagraphs":
        # PyTorch MLPs in tf32; in bf16 the wgrad MLPs, measured +5.1% with max-autotune too
        mlp = "wgrad" if overrides.get("train.precision") == "bf16" else "torch"
        assert "repaid within this run's 2,000,000 steps" in why and resolved.kernels.mlp == mlp
    elif overrides["data.batch_size"] == 65536 and mode == "default" and "distributed" not in kw:
        assert "repaid only from ~1,000,000 steps" in why
    assert resolve_fast_path(cfg_with(**overrides), torch.device("cpu"), **kw)[0].train.compile.mode == "default"


@pytest.mark.parametrize("config", ["kaggle.json", "terabyte.json"])
def test_long_tf32_runs_take_the_fused_mlp_in_mode_default_without_autotuning(config):
    """In tf32 at 65536 the fused MLP in mode default measured what max-autotune's templates did (Kaggle 26.57M
    against 26.59M samples/s), so even a long run skips the minutes of autotuning and takes the fused MLP."""
    cfg = load_config(REPO / "configs" / config, {"data.batch_size": 65536, "train.precision": "tf32"})
    resolved, chosen = resolve_fast_path(cfg, CUDA, **LONG)
    assert resolved.train.compile.mode == "default" and resolved.kernels.mlp == "fused"
    assert "matched max-autotune's templates" in chosen["train.compile.mode"]["why"]


@pytest.mark.parametrize("precision, hopper, want", [("bf16", True, "gluon"), ("tf32", True, "torch"),
                                                     ("bf16", False, "torch")])
def test_auto_interaction_takes_the_gluon_cross_layer_on_hopper_in_bf16(monkeypatch, precision, hopper, want):
    """The DCN interaction: the Gluon cross layer where it was measured (a Hopper GPU, bf16: +2.5-2.7% for the MLPerf
    step, PERF.md sixteenth run), PyTorch elsewhere; the dot interaction keeps its Triton kernel either way."""
    import kernels.cross_ws_op

    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    monkeypatch.setattr(kernels.cross_ws_op, "gluon_hopper_available", lambda device: hopper)
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json", {"train.precision": precision})
    resolved, chosen = resolve_fast_path(cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.kernels.interaction == want
    assert ("warp-specialized" in chosen["kernels.interaction"]["why"]) == (want == "gluon")
    dot, _ = resolve_fast_path(cfg_with(**{"train.precision": precision}), CUDA)
    assert dot.kernels.interaction == "triton"


@pytest.mark.parametrize("hopper, below, dropout, want", [(True, False, 0.0, "fused"), (True, True, 0.0, "torch"),
                                                          (False, False, 0.0, "torch"), (True, False, 0.1, "torch")])
def test_auto_mlp_takes_the_fused_mlp_beside_the_gluon_cross_layers(monkeypatch, hopper, below, dropout, want):
    """Beside the Gluon cross layers (a Hopper GPU, bf16) from DCN_FUSED_MLP_MIN_BATCH, where it was measured (the MLPerf
    step +1.0-3.2% from 32768 on an H100); PyTorch MLPs below it, without the Gluon layers and with dropout."""
    import kernels.cross_ws_op
    from dlrm.train.fast_path import DCN_FUSED_MLP_MIN_BATCH

    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    monkeypatch.setattr(kernels.cross_ws_op, "gluon_hopper_available", lambda device: hopper)
    batch = DCN_FUSED_MLP_MIN_BATCH // 2 if below else DCN_FUSED_MLP_MIN_BATCH
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json", {"data.batch_size": batch, "model.dropout": dropout})
    resolved, chosen = resolve_fast_path(cfg, CUDA, multi_hot=True, total_steps=1000)
    assert resolved.kernels.mlp == want
    assert ("beside the Gluon cross layers" in chosen["kernels.mlp"]["why"]) == (want == "fused")
