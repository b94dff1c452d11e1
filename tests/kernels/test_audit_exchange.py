"""Audit tests for kernels/exchange_ids.py and kernels/exchange_combine.py: cases the main tests leave open.

Expected values are plain Python integers (Python's ``%`` is non-negative for a positive modulus). CPU: Triton
interpreter; on a GPU machine the same tests run on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import kernels.exchange_ids as ex
from kernels.exchange_combine import combine_received, exchange_layout
from kernels.exchange_ids import BLOCK, PAD, local_ids, send_ids
from tests.kernels.test_exchange_ids import _local_reference

# raw values int64 allows beyond the data's [-1, 2**32): negatives below -1, the 32-bit boundaries, int64's minimum
NEGATIVE_AND_BOUNDARY = [-1, -3, -4, -(2**31), -(2**32) - 1, -(2**40) - 7, -(2**63), 0xFFFFFFFF, 2**31, 2**31 - 1, 0]


@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
@pytest.mark.parametrize("B,P", [(1, 1), (3, 4), (127, 127)])
def test_send_ids_hash_negative_and_boundary_values_like_python_modulus(device, multi_hot, B, P):
    """Every int64 raw value is hashed as ``(raw + 1) mod card``, non-negative (as `dlrm.model.hashing.modulus_rows`
    does); only PAD (-2) in a multi-hot slot is an empty slot (-1). In one-hot mode -2 is an ordinary value."""
    cards = [7, 3, 1, 2**31 + 11, 5]
    L = len(cards)
    values = NEGATIVE_AND_BOUNDARY + [-2]
    rows = [[values[(b * L + s) % len(values)] for s in range(L)] for b in range(B)]
    slots = [[0, 1, 3], [4, 2, 3]]
    expected = []
    for q_slots in slots:
        for p in range(P):
            for s in q_slots:
                if p >= B or (multi_hot and rows[p][s] == PAD):
                    expected.append(-1)
                else:
                    expected.append((rows[p][s] + 1) % cards[s])
    raw = torch.tensor(rows, dtype=torch.int64, device=device)
    card = torch.tensor(cards, dtype=torch.int64, device=device)
    slot_t = [torch.tensor(s, dtype=torch.int64, device=device) for s in slots]
    got = send_ids(raw, card, slot_t, P, multi_hot)
    assert got.tolist() == expected
    assert min(expected) >= -1


def test_local_ids_read_non_contiguous_recv(device):
    """``recv`` [rows, n] with any strides (here a transposed [n, rows] buffer) gives the ids of its logical layout."""
    g = torch.Generator().manual_seed(7)
    base, count, at = [0, 20, 5], [4, 20, 1], [0, 4, 24]
    recv_t = torch.randint(-1, 45, (3, 127), generator=g)  # [n, rows]
    recv = recv_t.to(device).t()  # [rows, n], strides (1, rows)
    assert not recv.is_contiguous()
    tensors = [torch.tensor(v, dtype=torch.int64, device=device) for v in (base, count, at)]
    for pooled in (False, True):
        raw, valid = local_ids(recv, *tensors, pooled)
        want_raw, want_valid = _local_reference(recv_t.t(), base, count, at, pooled)
        assert raw.tolist() == want_raw and valid.tolist() == want_valid


class _WideSpy:
    """Wraps a Triton kernel: records the WIDE flag of every launch, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.wide = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.wide.append(kwargs["WIDE"])
            return launch(*args, **kwargs)

        return run


def test_int64_path_is_chosen_from_the_size(device, monkeypatch):
    """The launchers pick WIDE (int64 flat indices) from the element count: off below the limit, on past it (the
    main tests lower the limit to run the int64 path and compare; this checks the path really is taken)."""
    raw = torch.tensor([[3, 4, 5]], dtype=torch.int64, device=device)
    card = torch.tensor([7, 7, 7], device=device)
    slots = [torch.tensor([0, 2], device=device)]
    recv = torch.tensor([[1, 2]], device=device)
    z = torch.zeros(2, dtype=torch.int64, device=device)
    send_spy, local_spy = _WideSpy(ex._send_ids_kernel), _WideSpy(ex._local_ids_kernel)
    monkeypatch.setattr(ex, "_send_ids_kernel", send_spy)
    monkeypatch.setattr(ex, "_local_ids_kernel", local_spy)
    narrow = send_ids(raw, card, slots, 2, False), local_ids(recv, z, z + 9, z, True)
    monkeypatch.setattr(ex, "INT32_INDEX_LIMIT", 0)
    wide = send_ids(raw, card, slots, 2, False), local_ids(recv, z, z + 9, z, True)
    assert send_spy.wide == [False, True] and local_spy.wide == [False, True]
    assert narrow[0].tolist() == wide[0].tolist() == [4, 6, -1, -1]
    assert narrow[1][0].tolist() == wide[1][0].tolist() == [[0, 1]]


def test_wide_kernels_cover_blocks_of_2_pow_31_elements(device):
    """The int64 path exists for P * n >= 2**31 elements; its bounds check must not wrap in 32 bits. One program of
    each kernel runs (its first BLOCK elements) on a block of P * n = 2**31 elements without allocating it."""
    P, n = 2**20, 2**11  # P * n = 2**31: each fits int32, their product does not
    cards = [7, 3, 2**31 + 11]
    L = len(cards)
    raw = torch.tensor([[-1, 2**31, 0xFFFFFFFF]], dtype=torch.int64, device=device)
    card = torch.tensor(cards, dtype=torch.int64, device=device)
    slot_of = [k % L for k in range(n)]
    slots = torch.tensor(slot_of, dtype=torch.int64, device=device)
    out = torch.full((BLOCK,), -7, dtype=torch.int64, device=device)
    with ex.device_context(raw):
        ex._send_ids_kernel[(1,)](raw, raw.stride(0), raw.stride(1), slots, card, out, 1, P, n,
                                  PAD_VALUE=PAD, MULTI_HOT=False, WIDE=True, BLOCK=BLOCK)
    vals = raw[0].tolist()
    assert out.tolist() == [(vals[slot_of[k]] + 1) % cards[slot_of[k]] for k in range(BLOCK)]  # p = 0 for k < n

    rows = 2**20
    base = torch.zeros(n, dtype=torch.int64, device=device)
    count = torch.full((n,), 5, dtype=torch.int64, device=device)
    at = torch.full((n,), 3, dtype=torch.int64, device=device)
    recv = torch.tensor([k % 7 for k in range(BLOCK)], dtype=torch.int64, device=device)
    got_raw = torch.full((BLOCK,), -7, dtype=torch.int64, device=device)
    got_valid = torch.full((BLOCK,), 7, dtype=torch.int8, device=device)
    with ex.device_context(recv):
        ex._local_ids_kernel[(1,)](recv, base, count, at, got_raw, got_valid, rows, n,
                                   PAD_VALUE=PAD, POOLED=True, WIDE=True, BLOCK=BLOCK)
    assert got_valid.tolist() == [int(k % 7 < 5) for k in range(BLOCK)]
    assert got_raw.tolist() == [k % 7 + 3 - 1 if k % 7 < 5 else PAD for k in range(BLOCK)]


def test_combine_refuses_too_many_rows_too():
    """A received tensor with more rows than the layout's P * C is a layout mismatch, refused like too few."""
    layout = exchange_layout([[0, 2], [1, 3, 4]], 5)
    with pytest.raises(ValueError, match=r"received 11 rows, the layout needs P \* 5 = 10"):
        combine_received(torch.zeros(11, 4), layout, 2, 2, 1.0)
