"""State one sweep trial leaves to the next in the sweep's process (`python -m dlrm.sweep` trains its trials one after
another in one process): each trial must be the run train.py makes alone with its config and seed.

* torch.compile's caches: Dynamo keeps every trial's compiled graphs on the step's code objects, and once a sweep has
  compiled more model structures than its recompile limit (8 by default) every later trial ran EAGER, said only by
  torch's warning, its summary's "compile" recording no graph and its weights no longer the compiled run's.
* the earlier trials' models (tables, optimizer state, loader arenas: reference cycles) were still in memory when the
  next trial built its own: two or three trials' memory at once (on a GPU, out of memory for a trial that fits alone).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch._dynamo

from dlrm.config import load_config
from dlrm.model.dlrm import DLRM
from dlrm.sweep import parse_set, run_sweep, slug
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.test_sweep import BASE


@pytest.fixture
def config(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    raw["train"]["max_steps"] = 2
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path / "tiny.json"


def _weights(summary: dict) -> dict:
    return torch.load(summary["checkpoint"], map_location="cpu", weights_only=False)["model"]


def test_a_compiled_sweep_past_dynamos_recompile_limit_still_compiles_each_trial(tmp_path, config):
    # the limit (8 by default: a sweep of 9 model structures) lowered to 1, so two trials show it. Torch's own
    # config.patch, not monkeypatch: pytest 9.2's undo deletes an attribute missing from the target's __dict__, and
    # dynamo's config keeps its values elsewhere (every later compile in the worker failed: "recompile_limit does not
    # exist")
    with torch._dynamo.config.patch(recompile_limit=1):
        _compiled_sweep_with_the_limit_lowered(tmp_path, config)


def _compiled_sweep_with_the_limit_lowered(tmp_path, config):
    torch._dynamo.reset()
    sets = [parse_set("model.top_mlp=[8,1],[6,1]")]
    base = {"train.compile.enabled": True}
    directory, _ = run_sweep(str(config), sets, 1, base, tb_dir=str(tmp_path), run_name="sw")
    second = json.loads((directory / slug(1, {"model.top_mlp": [6, 1]}) / "seed-0" / "summary.json").read_text())
    assert second["resolved"]["compile"] is True
    assert second["compile"]["graphs"] > 0, "the second trial ran eager: Dynamo's recompile limit, hit by the first's"
    # bit for bit the run train.py makes alone (a fresh process: no compiled graph of another trial)
    torch._dynamo.reset()
    cfg = load_config(str(config), {**base, "model.top_mlp": [6, 1], "train.seed": 0})
    alone = train(cfg, run_dir=tmp_path / "alone")
    assert second["train_losses"] == alone["train_losses"] and second["auc"] == alone["auc"]
    ours, theirs = _weights(second), _weights(alone)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_trial_starts_without_the_earlier_trials_models_in_memory(tmp_path, config):
    gc.collect()
    before = sum(issubclass(type(o), DLRM) for o in gc.get_objects())
    alive = []

    def counting_train(cfg, run_dir):
        alive.append(sum(issubclass(type(o), DLRM) for o in gc.get_objects()) - before)  # gc.get_objects collects nothing
        return train(cfg, run_dir=run_dir)

    run_sweep(str(config), [parse_set("optim.sparse.lr=0.01,0.02,0.03")], 2, tb_dir=str(tmp_path), run_name="sw",
              train_fn=counting_train)
    assert alive == [0] * 6, f"earlier trials' models alive at each trial's start: {alive}"
