"""data.placement "auto" at its boundaries: the exact fit, the optimizer state per row, the rank's share (audit)."""

import pytest
import torch
from loguru import logger

from dlrm.config import load_config
from dlrm.data.schema import Metadata, SplitInfo
from dlrm.train.placement import DEVICE_BYTES_PER_ROW, choose_placement, table_bytes, table_row_bytes
from tests.conftest import REPO

GiB = 2**30
CARDS = [1000] * 26
CUDA = torch.device("cuda")


def meta(train_rows, validation_rows=0):
    return Metadata(cardinalities=CARDS, splits={"train": SplitInfo(train_rows, 0, []),
                                                 "validation": SplitInfo(validation_rows, 0, [])})


def sample(**overrides):
    return load_config(REPO / "configs" / "sample.json", overrides)


@pytest.fixture
def free_memory(monkeypatch):
    def set_free(free):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    return set_free


@pytest.mark.parametrize("sparse, state", [("sgd", 0), ("adagrad", 4 * 16), ("rowwise_adagrad", 4)])
def test_a_table_row_counts_its_optimizer_state(sparse, state):
    cfg = sample(**{"model.embedding_dim": 16, "optim.sparse.name": sparse})
    assert table_row_bytes(cfg) == 16 * 4 + state


def test_data_filling_the_share_exactly_goes_to_the_gpu(free_memory):
    cfg = sample()  # share 25%
    rows = 1000
    free_memory(table_bytes(cfg, CARDS) + 4 * rows * DEVICE_BYTES_PER_ROW)
    assert choose_placement(cfg, meta(rows - 1, 1), CARDS, CUDA) == "gpu"
    assert choose_placement(cfg, meta(rows, 1), CARDS, CUDA) == "stream"


def test_a_rank_counts_only_its_share_of_the_tables(free_memory):
    cfg = sample(**{"data.gpu_memory_share": 1.0})
    cards = [2 * 10**6 + 1] * 25 + [2 * 10**6]  # an odd total: half a row's bytes must not be dropped
    one_rank = table_bytes(cfg, cards)
    assert table_bytes(cfg, cards, world_size=2) == int(sum(cards) / 2 * table_row_bytes(cfg))
    free_memory(one_rank)  # one process: nothing left; two ranks: half the tables' bytes free
    rows = (one_rank // 2 - GiB) // DEVICE_BYTES_PER_ROW
    assert choose_placement(cfg, meta(rows), cards, CUDA, world_size=1) == "stream"
    assert choose_placement(cfg, meta(rows), cards, CUDA, world_size=2) == "gpu"


def test_tables_larger_than_the_free_memory_leave_no_budget(free_memory):
    cfg = sample()
    free_memory(table_bytes(cfg, CARDS) - GiB)
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    try:
        assert choose_placement(cfg, meta(0), CARDS, CUDA) == "gpu"  # nothing to hold fits in nothing
        assert choose_placement(cfg, meta(1), CARDS, CUDA) == "stream"
    finally:
        logger.remove(handle)
    assert any("of the 0.0 GiB free after the tables is 0.0 GiB" in m for m in seen), seen
