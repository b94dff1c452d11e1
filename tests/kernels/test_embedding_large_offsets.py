"""The embedding kernels at table sizes whose element offsets pass 2^31 (issue #22: MLPerf DLRM-DCNv2's one
[204M, 128] table has 26e9 elements).

A row id is loaded as int32 (the hashed rows are stored so) and multiplied by D or a stride; in 32-bit arithmetic
``row * 128`` turns negative at row 2^24 (an address before the table) and wraps to the table's first rows at 2^25
(another row read and written, silently). Every such product is cast to int64 first; these tests fail when one cast
is lost. The table is a sparse file mapped into memory (``torch.from_file``: 17 GB of address space for 2^25 + 105
rows of 128 fp32, only the rows touched take memory or disk), so the CPU interpreter runs the real kernels at such
offsets in seconds; on a GPU the table is in device memory (17 GB, skipped below 24 GB). Checked against float64:
the lookup, the pooled sums, the fused update of every row hit (row-wise Adagrad through the sorted-segment kernels,
SGD through the atomic ones), and that the rows a wrapped offset would have hit stay untouched.
"""

from __future__ import annotations

import fcntl
import gc
import tempfile
from pathlib import Path

import pytest
import torch

from kernels.embedding.lookup import embedding_lookup, fused_embedding
from kernels.embedding.pooled import PAD_SPARSE, fused_pooled_embedding, pooled_hash_rows, pooled_layout
from kernels.table_layout import layout_tensors

D = 128
CARDS = [2**25 + 100, 5]  # the first table's last rows sit past row 2^25: row * 128 > 2^32
R = sum(CARDS)
LR = 0.05


@pytest.fixture(autouse=True)
def one_large_table_at_a_time():
    """On a GPU: these tests one at a time across the suite's worker processes, each giving its ~50 GB back when it
    ends. A worker's caching allocator kept it (54 and 46 GiB held by two workers in a session-60 run), and the other
    workers' tests, these among them, ran out of device memory: 25 failures, every one an OOM."""
    if not torch.cuda.is_available():
        yield
        return
    with open(Path(tempfile.gettempdir()) / "dlrm-large-offset-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()


def zeros(path, n: int, device: torch.device) -> torch.Tensor:
    """n fp32 zeros: on the CPU backed by a sparse file (no memory or disk until written), else in device memory."""
    if device.type == "cuda":
        if torch.cuda.get_device_properties(device).total_memory < 24 * 2**30:
            pytest.skip("a 17 GB table needs a GPU of 24 GB or more")
        return torch.zeros(n, dtype=torch.float32, device=device)
    return torch.from_file(str(path), shared=True, size=n, dtype=torch.float32)


def last_rows(cards: list[int], hot: list[int], batch: int) -> torch.Tensor:
    """Raw values [batch, sum(hot)] hashing to each table's last two rows (``row = offset + (raw + 1) % card``),
    repeated within a bag and across samples, plus one padded slot."""
    raw = torch.empty(batch, sum(hot), dtype=torch.int64)
    col = 0
    for f, (card, h) in enumerate(zip(cards, hot)):
        for s in range(h):
            raw[:, col] = card - 2 - ((s + torch.arange(batch)) % 2)
            col += 1
    if sum(hot) > len(hot):
        raw[-1, 1] = PAD_SPARSE  # an empty slot (pooled layouts only)
    return raw


def expected_update(w0, state0, grad_sums, optimizer):
    """float64 rows after one step of `optimizer` on the summed gradients of each row."""
    if optimizer == "sgd":
        return w0 - LR * grad_sums, None
    s = state0 + (grad_sums * grad_sums).mean(1)
    return w0 - grad_sums * (LR / (s.sqrt() + 1e-8))[:, None], s


def wrapped_aliases(rows: torch.Tensor) -> torch.Tensor:
    """The rows a 32-bit ``row * D`` would address instead (those not hit themselves; rows past 2^25 wrap into the
    table's first rows)."""
    rows = rows.cpu()
    alias = torch.unique(((rows * D) % 2**32) // D)
    return alias[~torch.isin(alias, rows)]


@pytest.mark.parametrize("optimizer, deterministic", [("rowwise_adagrad", True), ("sgd", False)],
                         ids=["rowwise-adagrad-sorted", "sgd-atomic"])
def test_pooled_lookup_and_update_past_2_to_the_32(tmp_path, device, optimizer, deterministic):
    hot = [3, 2]
    card_t, off_t = (t.to(device) for t in layout_tensors(CARDS))
    layout = pooled_layout(hot, device)
    raw = last_rows(CARDS, hot, batch=3).to(device)
    rows = pooled_hash_rows(raw, card_t, off_t, layout, R)
    feature = layout.slot_feature
    want_rows = torch.where(raw == PAD_SPARSE, R, off_t[feature] + (raw + 1) % card_t[feature])
    assert torch.equal(rows.long(), want_rows) and int(want_rows[want_rows < R].max()) * D > 2**32

    weight = zeros(tmp_path / "w.bin", R * D, device).view(R, D)
    state = zeros(tmp_path / "s.bin", R, device) if optimizer == "rowwise_adagrad" else None
    hit = torch.unique(want_rows[want_rows < R])
    gen = torch.Generator().manual_seed(0)
    weight[hit] = torch.randn(len(hit), D, generator=gen).to(device)
    if state is not None:
        state[hit] = torch.rand(len(hit), generator=gen).to(device)
    w0 = weight[hit].double().cpu()
    s0 = state[hit].double().cpu() if state is not None else None
    index = {int(r): i for i, r in enumerate(hit)}
    want_rows, feature = want_rows.cpu(), feature.cpu()

    trigger = torch.zeros(0, requires_grad=True, device=device)
    out = fused_pooled_embedding(raw, weight, card_t, off_t, layout, None, None, state, torch.tensor(LR, device=device),
                                 optimizer, 1e-8, deterministic, grad_trigger=trigger)
    pooled = torch.zeros(3, len(hot), D, dtype=torch.float64)
    for b in range(3):
        for s in range(layout.num_slots):
            if int(want_rows[b, s]) < R:
                pooled[b, int(feature[s])] += w0[index[int(want_rows[b, s])]]
    torch.testing.assert_close(out.detach().double().cpu(), pooled, rtol=1e-6, atol=1e-5)

    grad = torch.randn(3, len(hot), D, generator=gen)
    out.backward(grad.to(device))
    sums = torch.zeros(len(hit), D, dtype=torch.float64)
    for b in range(3):
        for s in range(layout.num_slots):
            if int(want_rows[b, s]) < R:
                sums[index[int(want_rows[b, s])]] += grad[b, int(feature[s])].double()
    check_update(weight, state, hit, expected_update(w0, s0, sums, optimizer))


@pytest.mark.parametrize("optimizer, deterministic", [("rowwise_adagrad", True), ("sgd", False)],
                         ids=["rowwise-adagrad-sorted", "sgd-atomic"])
def test_one_hot_lookup_and_update_past_2_to_the_32(tmp_path, device, optimizer, deterministic):
    card_t, off_t = (t.to(device) for t in layout_tensors(CARDS))
    raw = last_rows(CARDS, [1, 1], batch=4).to(device)
    want_rows = off_t + (raw + 1) % card_t
    assert int(want_rows.max()) * D > 2**32
    weight = zeros(tmp_path / "w.bin", R * D, device).view(R, D)
    state = zeros(tmp_path / "s.bin", R, device) if optimizer == "rowwise_adagrad" else None
    hit = torch.unique(want_rows)
    gen = torch.Generator().manual_seed(1)
    weight[hit] = torch.randn(len(hit), D, generator=gen).to(device)
    w0 = weight[hit].double().cpu()
    s0 = state[hit].double().cpu() if state is not None else None
    index = torch.searchsorted(hit, want_rows).cpu()

    lookup = embedding_lookup(raw, weight, card_t, off_t)
    torch.testing.assert_close(lookup.double().cpu(), w0[index], rtol=0, atol=0)
    trigger = torch.zeros(0, requires_grad=True, device=device)
    out = fused_embedding(raw, weight, card_t, off_t, None, None, state, torch.tensor(LR, device=device), optimizer,
                          1e-8, deterministic, grad_trigger=trigger)
    torch.testing.assert_close(out.detach().double().cpu(), w0[index], rtol=0, atol=0)
    grad = torch.randn(4, 2, D, generator=gen)
    out.backward(grad.to(device))
    sums = torch.zeros(len(hit), D, dtype=torch.float64).index_add_(0, index.reshape(-1), grad.reshape(-1, D).double())
    check_update(weight, state, hit, expected_update(w0, s0, sums, optimizer))


def check_update(weight, state, hit, want) -> None:
    """The rows hit against float64 (fp32 rounding of one step), and the rows a wrapped offset would hit untouched."""
    w_want, s_want = want
    torch.testing.assert_close(weight[hit].double().cpu(), w_want, rtol=1e-5, atol=1e-5)
    if state is not None:
        torch.testing.assert_close(state[hit].double().cpu(), s_want, rtol=1e-5, atol=1e-6)
    alias = wrapped_aliases(hit).to(weight.device)
    assert len(alias) and not weight[alias].any() and (state is None or not state[alias].any())
