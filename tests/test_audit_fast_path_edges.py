"""Explicit kernel choices that the model cannot use, and --compare variants that cannot run the config's model
(audit): refused or skipped in one line, never built with another kernel than the log line and the name say."""

from __future__ import annotations

import os

import pytest
import torch

from dlrm.config import ConfigError, KernelsConfig, ModelConfig, load_config
from dlrm.model.archs import InteractionArch
from dlrm.model.dlrm import build_model
from dlrm.train.compare import run_comparison, unavailable_reason
from dlrm.train.fast_path import resolve_fast_path
from tests.conftest import REPO

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# where Triton runs in this test session: the GPU, or the CPU under the interpreter (conftest sets it without CUDA)
TRITON_DEVICE = CUDA if torch.cuda.is_available() else CPU
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
# what a trained variant's summary holds for run_comparison's tables (the tests' fake trainers return it)
FAKE_SUMMARY = {"samples_per_sec": 1.0, "warmup_s": 0.0, "peak_memory_bytes": None, "final_train_loss": 0.5, "auc": 0.5,
                "compile": {"graph_breaks": 0}, "train_losses": [(1, 0.5)], "resolved": {"compile": False}}


def sample(**overrides):
    return load_config(REPO / "configs" / "sample.json", overrides)


def test_a_triton_interaction_for_a_cat_model_is_refused_in_one_line():
    """There is no Triton cat interaction: the config was accepted, the log line said interaction=triton and the model
    was built with the torch InteractionArch."""
    with pytest.raises(ConfigError) as e:
        sample(**{"model.interaction": "cat", "model.bottom_mlp": [64, 16], "kernels.interaction": "triton"})
    msg = str(e.value)
    assert "\n" not in msg and 'kernels.interaction: "triton"' in msg and '"cat"' in msg, msg


@pytest.mark.parametrize("kernel, interaction", [("triton", "cat"), ("gluon", "dot"), ("gluon", "cat")])
def test_build_model_refuses_an_interaction_kernel_it_would_drop(monkeypatch, kernel, interaction):
    """Called without the config's checks (benchmarks build models directly), the kernel was dropped silently: a
    Gluon cross layer asked of a dot model on a Hopper GPU (faked here) built the torch dot interaction."""
    import kernels.cross_ws_op

    monkeypatch.setattr(kernels.cross_ws_op, "gluon_hopper_available", lambda device: True)
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction=interaction)
    with pytest.raises(ConfigError, match=rf'kernels.interaction: "{kernel}" has no kernel for model.interaction '
                                          rf'"{interaction}"'):
        build_model(cfg, [5] * 26, kernels=KernelsConfig(embedding="torch", interaction=kernel, mlp="torch",
                                                         loss="torch"))


def test_auto_still_builds_a_cat_model_with_the_torch_interaction():
    cfg = sample(**{"model.interaction": "cat", "model.bottom_mlp": [64, 16]})
    resolved, chosen = resolve_fast_path(cfg, CUDA)
    assert resolved.kernels.interaction == "torch", chosen["kernels.interaction"]
    model = build_model(cfg.model, [5] * 26, kernels=KernelsConfig(embedding="torch", interaction="torch",
                                                                   mlp="torch", loss="torch"))
    assert type(model.interaction_arch) is InteractionArch and model.interaction_arch.kind == "cat"


def _compare(tmp_path, overrides, variants):
    """run_comparison with a fake trainer that records the configs it was given."""
    cfg = sample(**{"log.tb_dir": str(tmp_path / "tb"), "train.device": TRITON_DEVICE.type, "log.run_name": "cmp",
                    **overrides})
    trained = {}

    def fake_train(vcfg, run_dir):
        trained[run_dir.name] = vcfg
        run_dir.mkdir(parents=True)
        return dict(FAKE_SUMMARY)

    rows = run_comparison(cfg, variants, fake_train)
    return {r["variant"]: r["status"] for r in rows}, trained


def test_compare_skips_triton_interaction_variants_of_a_cat_model(tmp_path):
    """The "triton" variant of a cat model trained the torch interaction under the name "triton" (Triton runs on this
    CPU in its interpreter); now its row says why it was skipped, and eager and auto still run."""
    status, trained = _compare(tmp_path, {"model.interaction": "cat", "model.bottom_mlp": [64, 16]},
                               ["eager", "auto", "triton"])
    assert status["eager"] == status["auto"] == "ok"
    assert status["triton"].startswith('skipped: kernels.interaction: "triton" has no kernel'), status["triton"]
    assert set(trained) == {"eager", "auto"}


def test_compare_skips_the_torch_embedding_variants_of_bf16_tables(tmp_path):
    """model.embedding_dtype "bf16" (MLPerf DLRM-DCNv2's config) needs the Triton embedding: the eager variant, which
    sets kernels.embedding "torch" after the config was validated, was trained and failed at build_run (a "failed"
    row and a non-zero exit for the whole comparison, its reason about "auto"); it cannot run this model: skipped."""
    status, trained = _compare(tmp_path, {"model.embedding_dtype": "bf16", "kernels.embedding": "triton"},
                               ["eager", "triton-embedding+compiled"])
    assert status["eager"].startswith('skipped: model.embedding_dtype: "bf16" needs kernels.embedding "triton"'), status
    assert status["triton-embedding+compiled"] == "ok" and set(trained) == {"triton-embedding+compiled"}


@pytest.mark.parametrize("overrides, says", [
    ({"model.dropout": 0.1}, 'skipped: kernels.mlp: "fused" has no dropout'),
    ({"model.activation": "sigmoid"}, 'skipped: kernels.mlp: "fused" needs model.activation "relu"'),
])
def test_compare_skips_mlp_kernel_variants_the_model_cannot_take(tmp_path, overrides, says):
    """The fused-MLP variants of a model with dropout or another activation were trained and failed when the model was
    built (FusedMLP's ValueError: a "failed" row and a non-zero exit); the config checks name why they cannot run."""
    status, trained = _compare(tmp_path, overrides, ["eager", "triton-fused-mlp+compiled"])
    assert status["triton-fused-mlp+compiled"].startswith(says), status
    assert status["eager"] == "ok" and set(trained) == {"eager"}
    assert unavailable_reason("triton-fused-mlp+compiled", TRITON_DEVICE, sample()) is None


def test_placement_auto_is_the_same_on_every_rank(monkeypatch):
    """Under torchrun each rank resolved data.placement "auto" from its own GPU's free memory: a rank with room held
    its split in GPU memory while one without streamed it, and the two loaders shuffle differently, so the ranks'
    slices came from different global batches. Every rank now decides by the least free memory of any rank."""
    from dlrm.data.schema import Metadata, SplitInfo
    from dlrm.train.placement import DEVICE_BYTES_PER_ROW, choose_placement, table_bytes

    GiB, cards = 2**30, [1000] * 26
    cfg = sample(**{"data.gpu_memory_share": 1.0})
    meta = Metadata(cardinalities=cards, splits={"train": SplitInfo(GiB // DEVICE_BYTES_PER_ROW, 0, [])})
    roomy, tight = table_bytes(cfg, cards, 2) + 2 * GiB, table_bytes(cfg, cards, 2) + GiB // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (roomy, 80 * GiB))  # this rank
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)

    def all_gather_object(out, obj):  # this rank (0) and rank 1, whose GPU has less free memory
        out[:] = [obj, tight]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    assert choose_placement(cfg, meta, cards, CUDA, world_size=2) == "stream"
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, obj]))
    assert choose_placement(cfg, meta, cards, CUDA, world_size=2) == "gpu"


def test_compare_skips_the_auto_variant_of_bf16_tables_where_auto_takes_the_torch_embedding(tmp_path):
    """On the CPU "auto" resolves the embedding to torch, which bf16 tables cannot use: the auto variant was trained
    and refused when built (a "failed" row, and with no other variant finished the whole comparison raised)."""
    cfg = sample(**{"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu", "log.run_name": "cmp",
                    "model.embedding_dtype": "bf16", "kernels.embedding": "triton"})
    trained = []

    def train(vcfg, run_dir):  # resolves "auto" as the trainer's build_run does, before any work
        resolve_fast_path(vcfg, CPU)
        trained.append(run_dir.name)
        run_dir.mkdir(parents=True)
        return dict(FAKE_SUMMARY)

    auto_reason = ('model.embedding_dtype "bf16" needs kernels.embedding "triton", which "auto" cannot pick here '
                   "(no CUDA device (cpu))")
    if not TRITON_ON_CPU:  # a CUDA machine's test session runs Triton on the GPU only: that variant is skipped on the
        # CPU too, and a comparison of skipped variants only is a one-line error naming each one's reason
        from dlrm.config import ConfigError

        with pytest.raises(ConfigError) as e:
            run_comparison(cfg, ["auto", "triton-embedding+compiled"], train)
        assert f"auto: {auto_reason}; triton-embedding+compiled: triton kernels cannot run on the CPU" in str(e.value)
        assert trained == []
        return
    rows = {r["variant"]: r["status"] for r in run_comparison(cfg, ["auto", "triton-embedding+compiled"], train)}
    assert rows["auto"] == f"skipped: {auto_reason}", rows
    # the variant whose Triton embedding runs here (the interpreter) is trained
    assert rows["triton-embedding+compiled"] == "ok" and trained == ["triton-embedding+compiled"]
