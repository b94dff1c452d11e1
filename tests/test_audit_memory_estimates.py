"""Memory estimates and the automatic decisions made from them (audit): data.placement "auto"'s log line."""

import re

import pytest
import torch
from loguru import logger

from dlrm.config import load_config
from dlrm.data.schema import Metadata, SplitInfo
from dlrm.train.placement import DEVICE_BYTES_PER_ROW, choose_placement, table_bytes
from tests.conftest import REPO

GiB = 2**30
CARDS = [1000] * 26
CUDA = torch.device("cuda")


def meta(train_rows):
    return Metadata(cardinalities=CARDS, splits={"train": SplitInfo(train_rows, 0, []),
                                                 "validation": SplitInfo(0, 0, [])})


def placement_line(cfg, rows, monkeypatch, free):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    try:
        choice = choose_placement(cfg, meta(rows), CARDS, CUDA)
    finally:
        logger.remove(handle)
    lines = [m for m in seen if m.startswith("data.placement auto:")]
    assert len(lines) == 1, seen
    return choice, lines[0]


@pytest.mark.parametrize("budget_gib, need_gib, expected", [
    (7.444, 7.44, "gpu"),     # needs 7.44 GiB of a 7.444 GiB budget: fits
    (7.454, 7.46, "stream"),  # needs 7.46 GiB of a 7.454 GiB budget: does not fit
])
def test_the_log_line_states_numbers_that_agree_with_the_choice(monkeypatch, budget_gib, need_gib, expected):
    """The line states the bytes the split needs and the budget it was compared with: a user must be able to read
    the choice off them. The budget was shown to one decimal, the need to two: 'needs 7.44 GiB ... budget is 7.4
    GiB' with the choice gpu, and 'needs 7.46 GiB ... budget is 7.5 GiB' with the choice stream."""
    cfg = load_config(REPO / "configs" / "sample.json", {"data.gpu_memory_share": 1.0})
    rows = int(need_gib * GiB) // DEVICE_BYTES_PER_ROW
    choice, line = placement_line(cfg, rows, monkeypatch, table_bytes(cfg, CARDS) + int(budget_gib * GiB))
    assert choice == expected
    need = float(re.search(r"rows, ([0-9.]+) GiB on the device", line).group(1))
    budget = float(re.search(r"free after the tables is ([0-9.]+) GiB", line).group(1))
    assert (need <= budget) == (choice == "gpu"), line


@pytest.mark.parametrize("mode", ["table", "auto"])
def test_sharding_finds_the_tables_a_fitting_spread(mode):
    """Two ranks of 10 rows each, tables of 5, 5, 4, 3 and 3 rows: {5, 5} and {4, 3, 3} fit exactly. Spread by their
    lookups (5, 4, 3, 2, 1 a sample) the tables went 5 + 4 + ... until the last fitted on neither rank, and the plan
    was refused as 'the tables do not fit 2 ranks of 10 bytes' (a run on those GPUs refused at the start)."""
    from dlrm.distributed.sharding import plan_sharding

    cards, limit = [5, 5, 4, 3, 3], 10
    plan = plan_sharding(cards, 2, mode, 10**7, [5, 4, 3, 2, 1], "cost", row_bytes=1, memory_per_rank=limit)
    assert plan.row_wise_tables() == []
    assert sorted(plan.local_rows(q) for q in range(2)) == [10, 10]
    assert all(plan.local_rows(q) <= limit for q in range(2))
