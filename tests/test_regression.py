"""The trainer still trains exactly as before the one-builder refactor (issue #18), and a checkpoint
written before it still loads.

The reference in tests/data/regression/ was made by ``make_reference.py`` at commit 172338a: 60
deterministic CPU steps of configs/sample.json. Tolerance 1e-6 relative: CPU math may differ in the
last bits across torch builds, but any change in what is computed moves these numbers far more.

One change is on purpose: the tables' init (`kernels.table_layout`) draws since 2026-12-01 in chunks keyed by one
seed, so that a rank of a sharded run draws its own rows only; before, each table was drawn whole from torch's RNG.
The run here puts that earlier init back, so everything else is still held to 172338a's numbers.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from dlrm.config import load_config
from dlrm import checkpoint as ckpt
from dlrm.train.trainer import train
from kernels.table_layout import init_table_, table_offsets
from tests.conftest import REPO

REFERENCE = REPO / "tests" / "data" / "regression"
REL = 1e-6


def checksums(model_state: dict) -> dict:
    return {k: [float(v.double().sum()), float(v.double().square().sum())] for k, v in model_state.items()}


def assert_same_parameters(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, (s, sq) in want.items():
        g_s, g_sq = got[key]
        assert g_sq == pytest.approx(sq, rel=REL), key
        # a sum can be near 0: compare it on the scale of the tensor's norm
        assert abs(g_s - s) <= REL * (abs(s) + math.sqrt(sq)), (key, g_s, s)


@pytest.fixture(scope="module")
def reference():
    return json.loads((REFERENCE / "sample_run.json").read_text())


@torch.no_grad()
def _init_tables_as_at_172338a(weight, cardinalities, seed=None):
    """The tables' init the reference was made with: each table drawn whole, in feature order, from torch's RNG."""
    for start, rows in zip(table_offsets(cardinalities), cardinalities):
        init_table_(weight[start : start + int(rows)], int(rows))


def test_sample_run_matches_the_reference(tmp_path, reference, monkeypatch):
    monkeypatch.setattr("dlrm.model.archs.init_tables_", _init_tables_as_at_172338a)
    cfg = load_config(REPO / "configs" / "sample.json",
                      {**reference["overrides"], "log.tb_dir": str(tmp_path / "tb"), "data.path": str(REPO / "data" / "sample")})
    summary = train(cfg)
    assert [s for s, _ in summary["train_losses"]] == [s for s, _ in reference["train_losses"]]
    assert [l for _, l in summary["train_losses"]] == pytest.approx([l for _, l in reference["train_losses"]], rel=REL)
    assert summary["auc"] == pytest.approx(reference["auc"], rel=REL)
    state = ckpt.load_checkpoint(Path(summary["checkpoint"]))
    assert_same_parameters(checksums(state["model"]), reference["params"])


def test_checkpoint_written_before_the_refactor_still_loads(reference):
    state = ckpt.load_checkpoint(REFERENCE / "sample-step-60.pt")
    assert state["position"]["step"] == 60
    assert_same_parameters(checksums(state["model"]), reference["params"])
    assert isinstance(state["config"], dict) and state["config"]["data"]["batch_size"] == 256
