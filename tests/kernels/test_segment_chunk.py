"""kernels/embedding/segment_chunk.py and segment_carry.py: the chunk kernel's partial sums, written only where
the carry kernel reads them, and the carry kernel's two paths (a segment that ends in the next chunk, one that
spans further), on 16-position chunks, against float64 references.
"""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.embedding import pooled_embedding_sparse_update_, pooled_hash_rows, pooled_layout
from tests.kernels.embedding_inputs import make_grad, make_state, make_weight
from tests.kernels.fastkern_once import once
from tests.kernels.test_pooled_embedding import EPS, LR, make_case, reference_update

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


# Sorted runs of rows over 48 positions (three 16-position chunks): (run length, ...) with length-1 runs as
# distinct rows. Chosen so that segments start mid-chunk and end in the next chunk, end exactly at a chunk
# boundary, fill whole chunks, and span three chunks.
RUNS = {
    "ends-in-next": [1] * 10 + [22] + [1] * 16,
    "ends-at-boundary": [1] * 5 + [27] + [1] * 16,
    "spans-three": [1] * 3 + [40] + [1] * 5,
    "one-row-a-chunk": [16, 16, 16],
    "runs-over-two-boundaries": [1] * 8 + [32] + [1] * 8,
    "every-second-repeats": [2] * 24,
}


@pytest.mark.parametrize("group_sums", [True, False], ids=["group-sums", "chunk-walk"])
@pytest.mark.parametrize("runs", list(RUNS.values()), ids=list(RUNS))
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_carry_paths(runs, optimizer, group_sums, device, monkeypatch, assert_close):
    """Rows [24, 2] (two one-slot features) holding the runs in shuffled positions; 16-position chunks, one
    carry program for all chunk boundaries and, in a second call, one per chunk boundary's worth of them; hot rows
    finished from group sums of 2 chunks and chunk by chunk."""
    from kernels.embedding import update

    monkeypatch.setattr(update, "CARRY_GROUP_SUMS", group_sums)
    assert sum(runs) == 48
    gen = torch.Generator().manual_seed(len(runs))
    values = torch.cat([torch.full((n,), 3 * i + 1) for i, n in enumerate(runs)])
    rows = values[torch.randperm(48, generator=gen)].reshape(24, 2).to(device)
    R = int(values.max()) + 1
    layout = pooled_layout([1, 1], device)
    grad = torch.randn(24, 2, 16, generator=gen).to(device)
    results = []
    for chunks in (32, 1):
        monkeypatch.setattr(update, "CARRY_CHUNKS", chunks)
        monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", heuristics.SparseUpdateConfig(16, 2, 4, 4))
        weight = make_weight(R, 16, device)
        state = make_state(optimizer, weight)
        pooled_embedding_sparse_update_(rows, grad, layout, weight, state, torch.tensor(LR, device=device),
                                        optimizer, EPS, True, 0.0)
        results.append((weight, state))
    w_ref, s_ref = reference_update(optimizer, rows, grad, [0, 1], make_weight(R, 16, device),
                                    make_state(optimizer, make_weight(R, 16, device)), LR)
    for weight, state in results:
        assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
        if s_ref is not None:
            assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_layout", ["contiguous", "permuted"])
def test_32_and_64_bit_index_paths_agree_bit_for_bit(dtype, grad_layout, device, monkeypatch):
    """The chunk kernel does its index arithmetic in int32 where every position and gradient offset fits (POS32,
    checked on the host with `update.max_element_offset`), else in int64: forced onto the 64-bit path, the same update
    (row-wise Adagrad, lazy decay, bf16 with stochastic rounding) gives the same tables and state bit for bit."""
    from kernels.embedding import update

    case, rows = hot_case(device, B=127, seed=5)
    grad = make_grad(rows.shape[0], 2, 16, grad_layout, device)
    assert update.max_element_offset(grad) == sum((n - 1) * s for n, s in zip(grad.shape, grad.stride()))
    w32, s32 = run_update(PLAIN, case, rows, grad, "rowwise_adagrad", dtype, device, monkeypatch)
    monkeypatch.setattr(update, "max_element_offset", lambda t: 2**31)  # as if the gradient were too large for int32
    w64, s64 = run_update(PLAIN, case, rows, grad, "rowwise_adagrad", dtype, device, monkeypatch)
    assert torch.equal(w32, w64) and torch.equal(s32, s64)
    assert not torch.equal(w32, make_weight(case.num_rows, 16, device, dtype))  # the update did move the rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,launch", [(16, PLAIN), (128, heuristics.SparseUpdateConfig(16, 32, 1, 1, 8))],
                         ids=["D16-4warps", "D128-1warp"])
def test_partial_picks_store_and_sum_agree_bit_for_bit(dtype, dim, launch, device, monkeypatch):
    """The chunk kernel's first/last partials written by a store masked to the row's lane (`update.PARTIAL_PICK`
    "store", shipped) or picked by a masked sum over the tile ("sum"): the same tables and state bit for bit
    (row-wise Adagrad, lazy decay, bf16 with stochastic rounding), on hot rows whose segments cross chunks, at
    the one-hot tests' dim and at MLPerf's dim and one-warp launch."""
    from kernels.embedding import update

    case, rows = hot_case(device, B=127, seed=11)
    grad = make_grad(rows.shape[0], 2, dim, "permuted", device)
    results = {}
    for pick in ("store", "sum"):
        monkeypatch.setattr(update, "PARTIAL_PICK", pick)
        results[pick] = run_update(launch, case, rows, grad, "rowwise_adagrad", dtype, device, monkeypatch)
    (w_store, s_store), (w_sum, s_sum) = results["store"], results["sum"]
    assert torch.equal(w_store, w_sum) and torch.equal(s_store, s_sum)
    assert not torch.equal(w_store, make_weight(case.num_rows, dim, device, dtype))  # the update did move the rows


@pytest.mark.parametrize("cap", [128, 96])
def test_register_cap_gives_the_same_update_bit_for_bit(cap, device, monkeypatch):
    """The chunk kernel under a register cap (`SparseUpdateConfig.chunk_maxnreg`, 128 in the multi-hot 16-bit
    launch; spills on sm_90 below that): the same bf16 tables and state bit for bit as the uncapped kernel, at
    MLPerf's dim and one-warp launch (the interpreter ignores the cap: there this checks that the field passes)."""
    from kernels.embedding import update

    assert heuristics.sparse_update_config(128, torch.bfloat16, multi_hot=True).chunk_maxnreg == 128
    assert update.CHUNK_MAXNREG is None  # the launch's own cap, not a forced one
    case, rows = hot_case(device, B=127, seed=17)
    grad = make_grad(rows.shape[0], 2, 128, "permuted", device, dtype=torch.bfloat16)
    launch = heuristics.SparseUpdateConfig(16, 32, 1, 1, 8, True, cap)
    uncapped = launch._replace(chunk_maxnreg=None)
    w_cap, s_cap = run_update(launch, case, rows, grad, "rowwise_adagrad", torch.bfloat16, device, monkeypatch)
    # the uncapped run is the same for every cap: once in this process
    w_ref, s_ref = once(("test_register_cap", str(device)), lambda: run_update(
        uncapped, case, rows, grad, "rowwise_adagrad", torch.bfloat16, device, monkeypatch))
    assert torch.equal(w_cap, w_ref) and torch.equal(s_cap, s_ref)
    assert not torch.equal(w_cap, make_weight(case.num_rows, 128, device, torch.bfloat16))


# Hot rows spanning many groups of chunks (`_group_sum_kernel`): 16-position chunks, groups of CARRY_BLOCK chunks.
# A 316-position run starting mid-chunk (21 chunks: 5 to 10 group steps; its last position the first of chunk 20), a
# 141-position one starting in the chunk the first ends in, short repeats, then a 144-position run starting exactly at
# a chunk and group boundary (512 = 32 chunks, a multiple of 2 and 4) and ending exactly at one. (Until 2026-12-01
# runs of 700 and 333 positions, 1088 before the 144: the same layout at twice the chunk kernel's grid under the CPU
# interpreter, ~2.3 s a case.)
HOT_RUNS = [1] * 5 + [316] + [1] * 3 + [141] + [2] * 10 + [1] * 27 + [144] + [1] * 16


@pytest.mark.parametrize("group_sums", [True, False], ids=["group-sums", "chunk-walk"])
@pytest.mark.parametrize("carry_block", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_hot_rows_spanning_many_groups(group_sums, carry_block, optimizer, device, monkeypatch, assert_close):
    """Segments of tens of chunks finished from the group sums (and, for A/B measurements, by the walk chunk by
    chunk they replaced), against the float64 reference, whatever the carry programs' share of chunk boundaries
    (bit for bit: the summation order depends on the sorted rows alone)."""
    from kernels.embedding import update

    monkeypatch.setattr(update, "CARRY_GROUP_SUMS", group_sums)
    n = sum(HOT_RUNS)
    assert n == 672 and (5 + 316 + 3 + 141 + 20 + 27) == 32 * 16 and (5 + 316 - 1) == 20 * 16
    gen = torch.Generator().manual_seed(carry_block)
    values = torch.cat([torch.full((c,), 2 * i + 1) for i, c in enumerate(HOT_RUNS)])
    rows = values[torch.randperm(n, generator=gen)].reshape(n // 2, 2).to(device)
    R = int(values.max()) + 1
    layout = pooled_layout([1, 1], device)
    grad = torch.randn(n // 2, 2, 16, generator=gen).to(device)
    results = []
    for chunks in (32, 1):
        monkeypatch.setattr(update, "CARRY_CHUNKS", chunks)
        monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", heuristics.SparseUpdateConfig(16, carry_block, 4, 4))
        weight = make_weight(R, 16, device)
        state = make_state(optimizer, weight)
        pooled_embedding_sparse_update_(rows, grad, layout, weight, state, torch.tensor(LR, device=device),
                                        optimizer, EPS, True, 0.0)
        results.append((weight, state))
    w_ref, s_ref = reference_update(optimizer, rows, grad, [0, 1], make_weight(R, 16, device),
                                    make_state(optimizer, make_weight(R, 16, device)), LR)
    for weight, state in results:
        assert_close(weight, w_ref, torch.float32, scale=10.0, msg="weight")
        if s_ref is not None:
            assert_close(state, s_ref, torch.float32, scale=10.0, msg="state")
    assert torch.equal(results[0][0], results[1][0])
    hot = values.unique_consecutive()[torch.tensor([5, 9, HOT_RUNS.index(144)])]
    assert not torch.equal(results[0][0][hot.long()], make_weight(R, 16, device)[hot.long()])  # the hot rows moved
