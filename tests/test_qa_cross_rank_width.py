"""A DCN's ``model.cross_rank`` at or above the cross network's width N = (F + 1) D is said at the start of a run.

Each layer's ``W_l V_l`` (N x r times r x N) can then be any N x N matrix, as a full-rank layer's, at 2 r / N times
its weights and work: the rank saves nothing. ``model.cross_rank`` defaults to MLPerf's 512 (N = 3456 there), so a
small DCN model (D = 8: N = 216) that left it out built a cross network 4.7x a full-rank one, without a word (the
start line's "rank 512 over 216 inputs" was all it said). `dlrm.train.builder.warn_cross_rank_at_width`.
"""

from __future__ import annotations

import json

import pytest
from loguru import logger

from dlrm.config import ModelConfig
from dlrm.data.schema import NUM_SPARSE
from dlrm.train.builder import warn_cross_rank_at_width
from tests.test_cli_errors import invoke

WARNING_512_D8 = ("model.cross_rank 512 is at least the cross network's width 216 (27 x model.embedding_dim 8): each "
                  "layer's W V can then be any 216 x 216 matrix, as a full-rank layer's, at 4.7x its weights and work; "
                  "a rank below 108 saves work (TorchRec's guidance: near 54)")


@pytest.fixture
def warnings():
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handle)


def _model(**kw) -> ModelConfig:
    return ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], **kw)


def test_the_default_rank_over_a_small_width_is_said(warnings):
    warn_cross_rank_at_width(_model(interaction="dcn"), NUM_SPARSE)  # cross_rank left at its default, 512
    assert warnings == [WARNING_512_D8]


@pytest.mark.parametrize("rank, said", [(215, False), (216, True), (217, True), (54, False)])
def test_the_bound_is_the_width(warnings, rank, said):
    warn_cross_rank_at_width(_model(interaction="dcn", cross_rank=rank), NUM_SPARSE)
    assert len(warnings) == int(said), warnings
    if said:
        assert warnings[0].startswith(f"model.cross_rank {rank} is at least the cross network's width 216 ")


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_models_without_a_cross_network_say_nothing(warnings, interaction):
    warn_cross_rank_at_width(_model(interaction=interaction), NUM_SPARSE)
    assert warnings == []


def test_mlperfs_rank_over_its_width_says_nothing(warnings):
    warn_cross_rank_at_width(ModelConfig(embedding_dim=128, bottom_mlp=[512, 256, 128], top_mlp=[1024, 1],
                                         interaction="dcn", cross_rank=512), NUM_SPARSE)
    assert warnings == []


@pytest.mark.parametrize("rank, said", [(None, True), (16, False)])
def test_train_py_says_it_once_and_trains(tmp_path, tiny_dataset, rank, said):
    model = {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1], "interaction": "dcn", "cross_layers": 1}
    if rank is not None:
        model["cross_rank"] = rank
    path = tmp_path / "dcn.json"
    path.write_text(json.dumps({"model": model, "data": {"batch_size": 32},
                                "train": {"device": "cpu", "baseline": False}}))
    result = invoke(tmp_path, path, "--data", str(tiny_dataset[0]), "--max-steps", "1")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "model.cross_rank" in line]
    if said:
        assert len(lines) == 1 and "WARNING" in lines[0] and lines[0].endswith(WARNING_512_D8), result.output
    else:
        assert lines == [], result.output
