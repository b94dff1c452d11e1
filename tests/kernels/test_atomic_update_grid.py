"""The atomic SGD update's launches over many columns (`kernels.embedding.atomic_update`).

Its grid puts a row's columns (features, or multi-hot slots: up to 65,536 a feature) on the grid's second axis,
which CUDA caps at 65,535 programs: more columns failed the launch. The launcher now covers them in runs of at most
`MAX_GRID_Y` columns; on the CPU (no cap in the interpreter) the runs are made short to check the offsets, on the GPU
a row of 65,537 slots is launched for real. Every path against a float64 ``index_add_`` reference: rows given, rows
given with a slot-to-feature map (multi-hot), raw values hashed in the kernel.
"""

from __future__ import annotations

import pytest
import torch

from dlrm.model.hashing import modulus_rows
from kernels.embedding import atomic_update

LR = 0.05


def _case(B: int, C: int, F: int, R: int, D: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, R + 2, (B, C), generator=gen)  # R and R + 1: skipped (no row, multi-hot padding)
    grad = torch.randn(B, F, 24, generator=gen)[:, :, :D]  # non-contiguous: a slice of wider rows
    weight = torch.randn(R, D, generator=gen)
    return rows.to(device), grad.to(device), weight.to(device)


def _reference(rows: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, slot_feature=None) -> torch.Tensor:
    """w - lr * sum of the gradients of every position naming a row < R, in float64."""
    R = weight.shape[0]
    g = grad.double() if slot_feature is None else grad.double()[:, slot_feature.long()]
    keep = rows < R
    return weight.double().index_add(0, rows[keep], g[keep], alpha=-LR)


def _launch(rows, grad, weight, slot_feature=None, hashing=None) -> torch.Tensor:
    w = weight.clone()
    lr = torch.tensor(LR, dtype=torch.float32, device=weight.device)
    atomic_update._sgd_atomic_update(rows, grad, w, lr, slot_feature, hashing)
    return w


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32 adds of a few terms of |lr g| < ~0.25 in any order onto weights ~N(0, 1)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("B,C,run", [(1, 5, 2), (3, 7, 3), (127, 4, 1), (3, 1, 1)])
def test_columns_in_runs_update_every_column_once(B, C, run, device, monkeypatch):
    """Runs of `run` columns (the last shorter): every column's rows are updated once; an offset lost (every run
    starting at column 0) updated the first columns again and left the others."""
    monkeypatch.setattr(atomic_update, "MAX_GRID_Y", run)
    rows, grad, weight = _case(B, C, C, 11, 16, device, seed=B * 10 + C)
    _check(_launch(rows, grad, weight), _reference(rows, grad, weight))


def test_multi_hot_slots_in_runs_read_their_features_gradient(device, monkeypatch):
    """Slots of 3 features (sizes 4, 1, 3) in runs of 3 slots: each slot adds its feature's gradient."""
    monkeypatch.setattr(atomic_update, "MAX_GRID_Y", 3)
    slot_feature = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2], dtype=torch.int32, device=device)
    rows, grad, weight = _case(5, 8, 3, 13, 16, device, seed=3)
    _check(_launch(rows, grad, weight, slot_feature), _reference(rows, grad, weight, slot_feature))


def test_hashed_values_in_runs_hash_by_their_own_feature(device, monkeypatch):
    """Raw values hashed in the kernel (modulus), 5 features in runs of 2: a column hashes by its feature's table."""
    monkeypatch.setattr(atomic_update, "MAX_GRID_Y", 2)
    gen = torch.Generator().manual_seed(5)
    card = torch.tensor([3, 7, 1, 5, 4])
    off = torch.cumsum(card, 0) - card
    raw = torch.randint(-1, 50, (6, 5), generator=gen)
    grad = torch.randn(6, 5, 16, generator=gen)
    weight = torch.randn(int(card.sum()), 16, generator=gen)
    raw, grad, weight, card, off = (t.to(device) for t in (raw, grad, weight, card, off))
    rows = modulus_rows(raw, card, off)
    _check(_launch(raw, grad, weight, hashing=(card, off)), _reference(rows, grad, weight))


@pytest.mark.gpu  # skipped without CUDA by the hook in tests/conftest.py
def test_a_row_of_more_slots_than_a_grid_axis_holds_updates_every_slot():
    """65,537 multi-hot slots of one feature (the most a feature holds is 65,536; one more to pass the cap): the
    launch failed on CUDA ("invalid argument") before the runs."""
    device = torch.device("cuda")
    C = atomic_update.MAX_GRID_Y + 2
    slot_feature = torch.zeros(C, dtype=torch.int32, device=device)
    rows, grad, weight = _case(3, C, 1, 1000, 16, device, seed=7)
    actual = _launch(rows, grad, weight, slot_feature)
    torch.cuda.synchronize()
    # a row is hit ~200 times: fp32 sums of that many terms in any order
    torch.testing.assert_close(actual.double(), _reference(rows, grad, weight, slot_feature), atol=2e-4, rtol=1e-5)
