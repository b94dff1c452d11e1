"""kernels/exchange_ids.py (the sharded lookup's ids before and after the id all_to_all) against references
written element by element in Python, and the eager ops the sharded arch ran before (`send_ids_eager`,
`local_ids_eager`). Ids are integers: the comparisons are exact.

CPU: Triton interpreter (on a GPU machine the same tests run on CUDA); odd batches (1, 3, 127), padded samples,
one slot, a rank serving nothing, negative and huge raw values, non-contiguous input.
"""

from __future__ import annotations

import pytest
import torch

from kernels.exchange_ids import PAD, local_ids, local_ids_eager, send_ids, send_ids_eager

# (slot tables' sizes, hotness of each slot's feature is irrelevant here: slots only), the slots each rank serves
CARDS = [3, 1, 40, 7, 7, 7, 100, 2]  # L = 8 slots (a feature of hotness 3: slots 3-5)
SLOTS = {
    "two_ranks": [[0, 2, 3, 4, 5], [1, 2, 6, 7]],  # slot 2's table row-wise: sent to both
    "three_ranks_one_idle": [[0, 1, 2, 3, 4, 5, 6, 7], [], [2, 6]],
    "one_slot": [[6]],
}


def _raw(B: int, L: int, multi_hot: bool, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-1, 10**6, (B, L), generator=g)
    raw[0, 0] = -1  # the missing value
    raw[-1, -1] = 2**62  # huge
    if multi_hot:
        raw[torch.rand(B, L, generator=g) < 0.3] = PAD
    return raw.to(device)


def _send_reference(raw: torch.Tensor, cards: list[int], slots: list[list[int]], P: int, multi_hot: bool) -> list[int]:
    out = []
    values = raw.cpu().tolist()
    for q_slots in slots:
        for p in range(P):
            for s in q_slots:
                if p >= len(values) or (multi_hot and values[p][s] == PAD):
                    out.append(-1)
                else:
                    out.append((values[p][s] + 1) % cards[s])  # Python's % is non-negative for a positive modulus
    return out


@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
@pytest.mark.parametrize("layout", sorted(SLOTS))
@pytest.mark.parametrize("B,P", [(1, 1), (3, 3), (3, 5), (127, 128)])
def test_send_ids_hash_and_lay_out_every_rank_block(device, multi_hot, layout, B, P):
    slots = SLOTS[layout]
    L = len(CARDS) if layout != "one_slot" else 7
    raw = _raw(B, L, multi_hot, seed=B + P, device=device)
    card = torch.tensor(CARDS[:L], device=device)
    slot_tensors = [torch.tensor(s, dtype=torch.int64, device=device) for s in slots]
    got = send_ids(raw, card, slot_tensors, P, multi_hot)
    assert got.dtype == torch.int64 and got.tolist() == _send_reference(raw, CARDS, slots, P, multi_hot)
    narrow = send_ids(raw, card, slot_tensors, P, multi_hot, torch.int32)  # what travels: the same ids
    assert narrow.dtype == torch.int32 and torch.equal(narrow.long(), got)
    # the eager ops the sharded arch runs without Triton: the same buffer
    table_rows = torch.remainder(torch.where(raw == PAD, -1, raw) + 1, card) if multi_hot else \
        torch.remainder(raw + 1, card)
    if multi_hot:
        table_rows = torch.where(raw == PAD, torch.full_like(table_rows, -1), table_rows)
    assert torch.equal(send_ids_eager(table_rows, slot_tensors, P), got)


def test_send_ids_read_non_contiguous_input(device):
    raw = _raw(5, len(CARDS), True, seed=1, device=device)
    strided = raw.t().contiguous().t()  # [B, L] with strides (1, B)
    assert not strided.is_contiguous()
    card = torch.tensor(CARDS, device=device)
    slots = [torch.tensor(s, device=device) for s in SLOTS["two_ranks"]]
    assert torch.equal(send_ids(strided, card, slots, 6, True), send_ids(raw, card, slots, 6, True))


def _local_reference(recv: torch.Tensor, base, count, at, pooled: bool):
    raw, valid = [], []
    for i, row in enumerate(recv.cpu().tolist()):
        raw.append([]), valid.append([])
        for j, r in enumerate(row):
            t = r - base[j]
            ok = 0 <= t < count[j]
            valid[-1].append(ok)
            raw[-1].append((t + at[j] - 1 if ok else PAD) if pooled else (t - 1 if ok else i))
    return raw, valid


@pytest.mark.parametrize("pooled", [False, True], ids=["one-table-a-feature", "pooled"])
@pytest.mark.parametrize("rows", [1, 3, 127 * 2])
@pytest.mark.parametrize("n", [1, 5])
def test_local_ids_mask_other_blocks_and_point_at_local_rows(device, pooled, rows, n):
    g = torch.Generator().manual_seed(rows * 10 + n)
    base = [0, 20, 0, 5, 3][:n]  # block starts; the third slot's block is empty
    count = [4, 20, 0, 1, 9][:n]
    at = [0, 4, 24, 24, 25][:n]
    recv = torch.randint(-1, 45, (rows, n), generator=g)
    recv[0, 0] = -1  # an empty slot or a padded sample
    tensors = [torch.tensor(v, dtype=torch.int64, device=device) for v in (base, count, at)]
    raw, valid = local_ids(recv.to(device), *tensors, pooled)
    want_raw, want_valid = _local_reference(recv, base, count, at, pooled)
    assert raw.dtype == torch.int64 and raw.tolist() == want_raw
    assert valid.dtype == torch.bool and valid.tolist() == want_valid
    eager_raw, eager_valid = local_ids_eager(recv.to(device), *tensors, pooled)
    assert torch.equal(eager_raw, raw) and torch.equal(eager_valid, valid)
    narrow = local_ids(recv.to(device, torch.int32), *tensors, pooled)  # int32 ids received
    assert torch.equal(narrow[0], raw) and torch.equal(narrow[1], valid)


def test_local_ids_of_nothing(device):
    z = torch.zeros(0, dtype=torch.int64, device=device)
    raw, valid = local_ids(torch.zeros(4, 0, dtype=torch.int64, device=device), z, z, z, True)
    assert raw.shape == valid.shape == (4, 0)


def test_int64_indices_give_the_same_ids(device, monkeypatch):
    """Past 2**31 elements the kernels index in int64; forced here on small shapes."""
    import kernels.exchange_ids as ex

    raw = _raw(7, len(CARDS), True, seed=3, device=device)
    card = torch.tensor(CARDS, device=device)
    slots = [torch.tensor(s, device=device) for s in SLOTS["two_ranks"]]
    recv = torch.randint(-1, 45, (9, 3), generator=torch.Generator().manual_seed(4)).to(device)
    tables = [torch.tensor(v, dtype=torch.int64, device=device) for v in ([0, 20, 3], [4, 20, 9], [0, 4, 24])]
    narrow = send_ids(raw, card, slots, 8, True), *local_ids(recv, *tables, False)
    monkeypatch.setattr(ex, "INT32_INDEX_LIMIT", 0)
    wide = send_ids(raw, card, slots, 8, True), *local_ids(recv, *tables, False)
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide))


def test_send_ids_refuse_other_dtypes(device):
    with pytest.raises(ValueError, match="dtype must be torch.int32 or torch.int64, got torch.float32"):
        send_ids(torch.zeros(1, 1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int64, device=device),
                 [torch.zeros(1, dtype=torch.int64, device=device)], 1, False, torch.float32)


def test_pad_is_the_schema_pad():
    from dlrm.data.schema import PAD_SPARSE

    assert PAD == PAD_SPARSE
