"""kernels/table_layout.py: the one table layout and init of every sparse arch."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.table_layout import (
    check_cardinalities,
    init_bound,
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


def test_init_tables_draws_each_table_in_feature_order():
    """Same values as drawing every table on its own (what the sharded arch does), each inside its bound."""
    cards = [3, 1, 50, 7]
    weight = torch.empty(total_rows(cards), 5, requires_grad=True)
    torch.manual_seed(0)
    init_tables_(weight, cards)
    torch.manual_seed(0)
    tables = [init_table_(torch.empty(n, 5), n) for n in cards]
    assert torch.equal(weight.detach(), torch.cat(tables))
    for start, n in zip(table_offsets(cards), cards):
        rows = weight.detach()[start : start + n]
        assert rows.abs().max() <= init_bound(n)


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
