"""Rows at or past 2**31 given to the sorted embedding update (`kernels.embedding.update._sort_by_row`): skipped, as
every row >= R is documented to be, on the CPU (interpreter) and on CUDA (moved here from
tests/test_audit_numerics_scale.py, whose CPU tensors met no interpreter on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

# ----------------------------------------------------------------------------------------------------
# The sorted-segment update's int32 sort keys (kernels.embedding.update.sort_by_row)
# ----------------------------------------------------------------------------------------------------
# Rows at or past the table's R rows are documented as "no row", skipped by the update (the multi-hot padding is R).
# Below 2**31 table rows the update sorts int32 keys; a row past 2**31 cast to int32 kept its low 32 bits, so 2**32 + 1
# became row 1 of the table: updated in the deterministic (sorted) path, skipped in the atomic one.

R, D = 4, 2
BEYOND = [2**32 + 1, 2**33 + 2]  # both >= R; their low 32 bits are rows 1 and 2 of the table


def _update(rows, optimizer, deterministic, pooled, device):
    from kernels.embedding import embedding_sparse_update_, init_sparse_optimizer_state
    from kernels.embedding.pooled import pooled_embedding_sparse_update_, pooled_layout

    w = (torch.arange(R * D, dtype=torch.float32).reshape(R, D) / 8).to(device)
    state = init_sparse_optimizer_state(optimizer, w)
    lr = torch.tensor([0.5], device=device)
    if pooled:  # one feature of 3 slots: grad_out [B, 1, D]
        g = torch.full((rows.shape[0], 1, D), 1.0, device=device)
        pooled_embedding_sparse_update_(rows, g, pooled_layout([rows.shape[1]], device), w, state, lr, optimizer,
                                        deterministic=deterministic)
    else:
        g = torch.full((*rows.shape, D), 1.0, device=device)
        embedding_sparse_update_(rows, g, w, state, lr, optimizer, deterministic=deterministic)
    return w


@pytest.mark.parametrize("pooled", [False, True], ids=["one-hot", "pooled"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_rows_past_2_to_the_31_are_skipped_not_wrapped_onto_table_rows(optimizer, pooled, device):
    rows = torch.tensor([[BEYOND[0], 3, BEYOND[1]], [BEYOND[1], 3, R]], device=device)  # row 3 twice, the rest no row
    w = _update(rows, optimizer, True, pooled, device).cpu()
    w0 = torch.arange(R * D, dtype=torch.float32).reshape(R, D) / 8
    assert torch.equal(w[:3], w0[:3]), "a row past 2**31 updated the row its low 32 bits name"
    g = torch.full((D,), 2.0)  # row 3's summed gradient
    step = 0.5 * g if optimizer == "sgd" else 0.5 * g / (torch.sqrt((g * g).mean()) + 1e-10)
    torch.testing.assert_close(w[3], w0[3] - step)
    if optimizer == "sgd":  # the atomic path (not deterministic) skips them too: both paths agree
        assert torch.equal(_update(rows, optimizer, False, pooled, device).cpu(), w)
