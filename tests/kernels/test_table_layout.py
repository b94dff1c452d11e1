"""kernels/table_layout.py: the one table layout and init of every sparse arch."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.table_layout import (
    INIT_CHUNK_ROWS,
    check_cardinalities,
    first_init_chunks,
    init_bound,
    init_rows_,
    init_table_,
    init_tables_,
    layout_tensors,
    table_offsets,
    total_rows,
)


def test_offsets_and_rows():
    cards = [3, 1, 1000, 7]
    assert table_offsets(cards) == [0, 3, 4, 1004]
    assert total_rows(cards) == 1011
    c, o = layout_tensors(cards)
    assert c.dtype == o.dtype == torch.int64
    assert c.tolist() == cards and o.tolist() == [0, 3, 4, 1004]
    assert table_offsets([]) == [] and total_rows([]) == 0


def test_check_cardinalities():
    assert check_cardinalities((2, 5)) == [2, 5]
    for bad in ([], [3, 0], [-1]):
        with pytest.raises(ValueError, match="cardinalities"):
            check_cardinalities(bad)


def test_init_bound_is_the_reference_formula():
    # sqrt(1/n), not 1/sqrt(n): they differ in the last bit for n = 3 (and a third of all n)
    assert math.sqrt(1.0 / 3) != 1.0 / math.sqrt(3)
    assert init_bound(3) == math.sqrt(1.0 / 3)
    assert init_bound(1) == 1.0


def test_init_tables_draws_each_table_in_chunks_keyed_by_one_seed():
    """One draw from torch's RNG (the seed); then chunk c of all tables' chunks, in feature order, is U(-b, b) of its
    table's bound from a generator seeded seed + c, drawn whole; each table inside its bound."""
    cards = [3, 1, INIT_CHUNK_ROWS + 50, 7]
    weight = torch.empty(total_rows(cards), 5, requires_grad=True)
    torch.manual_seed(0)
    init_tables_(weight, cards)
    after = torch.rand(3)
    torch.manual_seed(0)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    assert torch.equal(torch.rand(3), after)  # the seed is the init's only draw from torch's RNG
    assert first_init_chunks(cards) == [0, 1, 2, 4]
    key = iter(range(seed, seed + 5))
    want = []
    for n in cards:
        for lo in range(0, n, INIT_CHUNK_ROWS):
            g = torch.Generator().manual_seed(next(key))
            want.append(init_table_(torch.empty(min(INIT_CHUNK_ROWS, n - lo), 5), n, g))
    assert torch.equal(weight.detach(), torch.cat(want))
    for start, n in zip(table_offsets(cards), cards):
        rows = weight.detach()[start : start + n]
        assert rows.abs().max() <= init_bound(n)
    assert not torch.equal(weight[3 + 1 : 3 + 1 + 50], weight[3 + 1 + INIT_CHUNK_ROWS : 3 + 1 + INIT_CHUNK_ROWS + 50])


@pytest.mark.parametrize("start, count", [(0, 0), (0, 1), (7, 3), (INIT_CHUNK_ROWS - 2, 5), (1, 2 * INIT_CHUNK_ROWS),
                                          (2 * INIT_CHUNK_ROWS, 3)])
def test_init_rows_of_any_block_are_the_whole_tables_rows(start, count):
    """Any block of a table, drawn alone (a rank's shard), holds the rows the whole table's init gives it."""
    rows = 2 * INIT_CHUNK_ROWS + 3
    whole = init_rows_(torch.empty(rows, 2), rows, 0, seed=2**64 - 2, first_chunk=5)  # keys wrap around 2**64
    block = init_rows_(torch.empty(count, 2), rows, start, seed=2**64 - 2, first_chunk=5)
    assert torch.equal(block, whole[start : start + count])


def test_init_rows_refuses_rows_outside_the_table():
    for start, count in ((-1, 2), (3, 3), (6, 0)):
        with pytest.raises(ValueError, match="not rows of a table of 5 rows"):
            init_rows_(torch.empty(count, 2), 5, start, seed=0, first_chunk=0)


def test_sparse_arches_share_the_layout():
    """The eager and the Triton arch get the same buffers and, for one seed, the same weight."""
    from dlrm.model.archs import SparseArch
    from kernels.embedding import TritonSparseEmbedding

    cards = [3, 2, 6, 8, 1]
    torch.manual_seed(1)
    eager = SparseArch(cards, 4)
    torch.manual_seed(1)
    fused = TritonSparseEmbedding(cards, 4)
    assert torch.equal(eager.offsets, fused.offsets) and torch.equal(eager.cardinalities, fused.cardinalities)
    assert torch.equal(eager.weight, fused.weight)
