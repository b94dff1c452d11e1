"""Audit of --eval-only / --export against the dataset a checkpoint is evaluated or exported with.

A checkpoint's model maps raw sparse hashes to embedding rows through the dataset's hashing: "modulus"
(``(raw + 1) mod cardinality``) or "vocabulary" (row ``1 + i`` for ``vocab[i]``, else row 0). The vocabulary
is read from the dataset at load time (the model's vocabulary buffers are not in its state_dict), so a
checkpoint evaluated or exported with a dataset of the same table sizes but another hashing (or another
vocabulary) would look up other rows for the same raw values, silently. It must be refused in one line,
as other table sizes, multi-hot sizes or dense formats are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm.config import ConfigError, config_from_dict
from dlrm.data.schema import NUM_SPARSE, read_metadata, write_metadata
from dlrm.data.vocabulary import vocab_path
from dlrm.train.export import evaluate_checkpoint, export_checkpoint, model_from_checkpoint
from dlrm.train.trainer import build_for_data, train
from tests.conftest import make_dataset

CARD = 11


def _config(data: Path, tb: Path, name: str):
    return config_from_dict({
        "data": {"path": str(data), "batch_size": 16},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "train": {"max_steps": 3, "device": "cpu", "deterministic": True, "seed": 3, "baseline": False,
                  "compile": False},
        "checkpoint": {"every": 3, "keep": 1},
        "log": {"tb_dir": str(tb), "run_name": name},
    })


def _as_vocabulary(src: Path, dst: Path, start: int) -> Path:
    """`src`'s rows, hashed by vocabulary: feature f's vocabulary start, start + 1, ... (CARD - 1 values)."""
    shutil.copytree(src, dst)
    meta = read_metadata(dst)
    meta.hashing = "vocabulary"
    write_metadata(dst, meta)
    for f in range(NUM_SPARSE):
        vocab_path(dst, f).parent.mkdir(exist_ok=True)
        np.save(vocab_path(dst, f), np.arange(start, start + CARD - 1, dtype=np.int64))
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hashing")
    make_dataset(root / "mod", {"train": 64, "validation": 32}, cardinality=CARD)
    _as_vocabulary(root / "mod", root / "voc", 0)
    _as_vocabulary(root / "mod", root / "voc2", 100)
    summaries = {name: train(_config(root / name, root / "tb", name)) for name in ("mod", "voc")}
    return root, {name: Path(s["checkpoint"]) for name, s in summaries.items()}, summaries


@pytest.mark.parametrize("trained, other", [("mod", "voc"), ("voc", "mod"), ("voc", "voc2")])
def test_a_checkpoint_with_another_datasets_hashing_is_refused(runs, trained, other):
    root, ckpts, _ = runs
    cfg = _config(root / other, root / "tb", f"eval-{trained}-{other}")
    _, _, _, tables = build_for_data(cfg)
    for portable in (False, True):
        with pytest.raises(ConfigError, match=r"(hashing|vocabulary) differs"):
            model_from_checkpoint(cfg, ckpts[trained], tables, torch.device("cpu"), portable=portable)
    with pytest.raises(ConfigError, match=r"(hashing|vocabulary) differs"):
        evaluate_checkpoint(cfg, ckpts[trained], "validation")
    with pytest.raises(ConfigError, match=r"(hashing|vocabulary) differs"):
        export_checkpoint(cfg, ckpts[trained], root / f"{trained}-{other}.pt2")
    assert not (root / f"{trained}-{other}.pt2").exists()


def test_its_own_hashing_and_vocabulary_evaluate_as_the_run_did(runs):
    """Its own dataset evaluates the checkpoint: --eval-only gives the metrics the run logged at its last step."""
    root, ckpts, summaries = runs
    for name in ("mod", "voc"):
        state = torch.load(ckpts[name], weights_only=False)
        assert state["hashing"] == {"mod": "modulus", "voc": "vocabulary"}[name]
        assert ("vocabulary_digest" in state) == (name == "voc")
        summary = evaluate_checkpoint(_config(root / name, root / "tb", f"own-{name}"), ckpts[name], "validation")
        assert summary["rows"] == 32
        for metric in ("auc", "logloss", "accuracy"):
            assert summary[metric] == pytest.approx(summaries[name][metric], abs=1e-6), (name, metric)


def test_a_checkpoint_without_the_record_still_loads(runs, tmp_path):
    """Checkpoints written before the hashing was recorded are not refused (nothing to compare)."""
    from dlrm import checkpoint as ckpt

    root, ckpts, _ = runs
    state = ckpt.load_checkpoint(ckpts["voc"])
    del state["hashing"], state["vocabulary_digest"]
    ckpt.write_atomic(tmp_path / "old.pt", state, progress=False, replace=False)
    cfg = _config(root / "voc2", root / "tb", "old")
    _, _, _, tables = build_for_data(cfg)
    model = model_from_checkpoint(cfg, tmp_path / "old.pt", tables, torch.device("cpu"))
    assert torch.equal(model.sparse_arch.weight, state["model"]["sparse_arch.weight"])
