"""Numeric-precision paths (train.precision fp32 / tf32 / bf16, model.embedding_dtype fp32 / bf16): bugs found by
the precision audit, each test failing without its fix. Tiny models and hand-built checkpoints keep them fast; the
bf16 tables run the Triton embedding under TRITON_INTERPRET on the CPU (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import Config, ConfigError, config_from_dict
from dlrm.model.dlrm import build_model
from dlrm.train import export as export_mod
from dlrm.train.setup import Tables

CARDS = [3, 5, 2]
# bf16 tables need the Triton embedding: its interpreter on the CPU, the GPU where there is one (a CUDA machine's test
# session has no interpreter)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPARSE = "sparse_arch.weight"


def tiny_config(**model) -> Config:
    # kernels.embedding "triton": bf16 tables need it (`TRITON_DEVICE`)
    return config_from_dict({"model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], **model},
                             "kernels": {"embedding": "triton"}, "train": {"device": TRITON_DEVICE}})


def tiny_checkpoint(path: Path, cfg: Config) -> dict:
    """A one-process checkpoint of the tiny model built as `cfg` says, its table holding values bf16 cannot hold."""
    model = build_model(cfg.model, CARDS, None, cfg.kernels, TRITON_DEVICE)
    state = {"model": model.state_dict(), "optimizers": [], "schedulers": [],
             "position": {"step": 3, "epoch": 0, "batch": 3}, "rng": ckpt.rng_state(),
             "cardinalities": list(CARDS), "config": cfg.to_dict()}
    with torch.no_grad():
        state["model"][SPARSE] = (1 + torch.arange(state["model"][SPARSE].numel()).reshape(state["model"][SPARSE].shape)
                                  * 2.0 ** -12).to(state["model"][SPARSE].dtype)
    ckpt.write_atomic(path, state)
    return state


# -- 1. --eval-only of an fp32-table checkpoint under a bf16-table config ----------------------------------------------

def test_eval_only_refuses_to_round_a_checkpoints_fp32_tables_to_bf16(tmp_path):
    """Expected: a one-line ConfigError naming model.embedding_dtype (as --resume refuses the difference). Got: the
    fp32 tables rounded to bf16 as they loaded, and the AUC/logloss of that other model reported as the checkpoint's."""
    state = tiny_checkpoint(tmp_path / "c.pt", tiny_config(embedding_dtype="fp32"))
    assert state["model"][SPARSE].dtype == torch.float32
    assert not torch.equal(state["model"][SPARSE].bfloat16().float(), state["model"][SPARSE])  # rounding would lose
    tables = Tables(list(CARDS), None, "modulus")
    with pytest.raises(ConfigError, match=r"model\.embedding_dtype.*fp32.*bf16"):
        export_mod.model_from_checkpoint(tiny_config(embedding_dtype="bf16"), tmp_path / "c.pt", tables,
                                         torch.device(TRITON_DEVICE))


def test_eval_only_of_bf16_tables_in_fp32_and_in_bf16_keeps_them_exactly(tmp_path):
    """The lossless directions still load (the documented way to evaluate bf16 tables on a CPU is fp32 tables)."""
    state = tiny_checkpoint(tmp_path / "c.pt", tiny_config(embedding_dtype="bf16"))
    tables = Tables(list(CARDS), None, "modulus")
    for dtype, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = export_mod.model_from_checkpoint(tiny_config(embedding_dtype=dtype), tmp_path / "c.pt", tables,
                                                 torch.device(TRITON_DEVICE))
        assert model.sparse_arch.weight.dtype == want
        assert torch.equal(model.sparse_arch.weight.float().cpu(), state["model"][SPARSE].float().cpu())


# -- 2. --eval-only evaluates as training did (train.compile "auto" resolved) -------------------------------------------

def test_eval_only_on_the_cpu_evaluates_eagerly_as_training_did(tmp_path, monkeypatch):
    """Expected: `--eval-only` builds its evaluation from the config as training resolved it: on the CPU train.compile
    "auto" is eager, so the checkpoint scores exactly what training's own evaluation reported. Got: "auto" handed to
    EvalForward as it is, a truthy string, so the forward was compiled (seconds to a minute of warm-up on the CPU, and
    Inductor rounds bf16 otherwise than eager: a DCN model's bf16 logloss 0.673164 against training's 0.672978)."""
    from dlrm.train.trainer import train
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 32, "validation": 24, "test": 8}, files_per_split=1)
    cfg = config_from_dict({"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
                            "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                            "kernels": {"embedding": "torch"}, "log": {"tb_dir": str(tmp_path / "tb")},
                            "train": {"device": "cpu", "precision": "bf16", "max_steps": 2, "baseline": False}})
    assert cfg.train.compile.enabled == "auto"
    trained = train(cfg, tmp_path / "tb" / "run")

    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile called: the CPU run evaluated eagerly")

    monkeypatch.setattr(torch, "compile", no_compile)
    summary = export_mod.evaluate_checkpoint(cfg, Path(trained["checkpoint"]), "validation")
    assert (summary["auc"], summary["logloss"], summary["accuracy"]) == (
        trained["auc"], trained["logloss"], trained["accuracy"])
