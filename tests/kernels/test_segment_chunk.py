"""kernels/embedding/segment_chunk.py: the chunk kernel's partial sums, written only where the carry kernel
reads them.

Cases have hot rows spanning several 16-position chunks (the carry kernel adds the chunks' partial sums)
and PAD slots.
"""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.embedding import pooled_embedding_sparse_update_, pooled_hash_rows
from tests.kernels.test_pooled_embedding import (
    EPS,
    LR,
    make_case,
    make_grad,
    make_state,
    make_weight,
    reference_update,
)

PLAIN = heuristics.SparseUpdateConfig(16, 4, 4, 4)


def hot_case(device, B: int = 120, seed: int = 13):
    """Two features (hotness 3 and 2), PAD slots, and rows hit by many slots (several chunks each)."""
    case = make_case(B, [3, 2], "modulus", seed=seed, pad=0.3).to(device)
    raw = case.raw.clone()
    raw[: B // 2, 0] = -1
    raw[B // 2 :, 3] = 7
    rows = pooled_hash_rows(raw, *case.hash_args(), case.num_rows)
    return case, rows


def run_update(launch, case, rows, grad, optimizer, dtype, device, monkeypatch, weight_decay=0.05):
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", launch)
    weight = make_weight(case.num_rows, grad.shape[2], device, dtype)
    state = make_state(optimizer, weight)
    seed = torch.full((1,), 7, dtype=torch.int64, device=device) if dtype == torch.bfloat16 else None
    pooled_embedding_sparse_update_(rows, grad, case.layout(), weight, state, torch.tensor(LR, device=device),
                                    optimizer, EPS, True, weight_decay, seed)
    return weight, state


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_partial_sums_written_where_the_carry_reads_them(optimizer, device, monkeypatch, assert_close):
    """The partial-sum buffers start as NaN (they are torch.empty, which often hands out zeros): a chunk that
    skipped a partial the carry kernel reads would put NaN into the weights."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    case, rows = hot_case(device, B=97, seed=3)
    grad = make_grad(rows.shape[0], 2, 16, "contiguous", device)
    w_ref, s_ref = reference_update(optimizer, rows, grad, case.slot_feature, make_weight(case.num_rows, 16, device),
                                    make_state(optimizer, make_weight(case.num_rows, 16, device)), LR)
    monkeypatch.setattr(torch, "empty", nan_empty)
    weight, state = run_update(PLAIN, case, rows, grad, optimizer, torch.float32, device, monkeypatch,
                               weight_decay=0.0)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
    if s_ref is not None:
        assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")
