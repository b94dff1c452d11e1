"""hostloop68: the training loop's per-step host work. A CUDA-graphed step at batch 256 is host-bound (an H200 busy
0.05-0.2 ms of a 0.27-0.4 ms step), so every op the host dispatches per step is time the run loses. Counted here with a
dispatch mode over N batches or steps (no timing): the device-resident loader's gathers (`DeviceLoader.__iter__`), the
widening of compact sparse values (`widen_sparse`, per batch there) and the loss window's per-step copy
(`LossWindow.add`); each also checked value by value against arrays computed here."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlrm.data.batch import transform_dense, widen_sparse
from dlrm.data.device_loader import DeviceLoader, device_permutation
from dlrm.data.loader import split_files
from dlrm.data.schema import read_metadata
from dlrm.train.meter import _FIRST_SLOTS, LossWindow
from tests.conftest import make_dataset


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside it, by name (``aten.index_select.default``): each one host dispatch, and on CUDA
    a kernel launch or a view's bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# -- DeviceLoader: a shuffled batch is three index_selects, not advanced indexing --------------------------------------


def _batches_with_ops(loader: DeviceLoader) -> list[tuple[object, Counter]]:
    out, batches = [], iter(loader)
    while True:
        with _Ops() as ops:
            batch = next(batches, None)
        if batch is None:
            return out
        out.append((batch, Counter(ops.names)))


def test_device_loader_gathers_a_shuffled_batch_with_index_select_and_delivers_the_permuted_rows(tmp_path):
    """``t[rows]`` (aten.index: advanced indexing, the heavier host path) became ``t.index_select(0, rows)``, as the
    streamed loader's buffers cut: per batch exactly 3 gathers and 3 ops widening the sparse block when its tensors
    are read (session 69: a `GatheredBatch`, whose fetch is 1 slice of the permutation, nothing else); and each batch holds the rows the epoch's permutation names, value by value."""
    root = tmp_path / "ds"
    arrays = make_dataset(root, {"train": 100}, row_group_size=9)["train"]
    loader = DeviceLoader(split_files(root, read_metadata(root), "train"), 16, "cpu", shuffle=True, seed=5)
    loader.set_epoch(1)
    order = device_permutation(100, 5, 1, "cpu").numpy()
    got = _batches_with_ops(loader)
    assert [len(b) for b, _ in got] == [16] * 6 + [4]
    for i, (batch, ops) in enumerate(got):
        if i == 0:  # the epoch's permutation is drawn at the first batch: its ops are the permutation's too
            assert ops["aten.index.Tensor"] == 0 and ops["aten.index_select.default"] == 0, ops
            continue
        # the fetch slices the permutation (a `GatheredBatch`); the gathers run when its tensors are first read
        assert ops == Counter({"aten.slice.Tensor": 1}), (i, ops)
        with _Ops() as read:
            batch.dense
        assert Counter(read.names) == Counter({"aten.index_select.default": 3, "aten._to_copy.default": 1,
                                               "aten.lt.Scalar": 1, "aten.add_.Tensor": 1}), (i, read.names)
        rows = order[16 * i: 16 * (i + 1)]
        expected_dense = transform_dense(torch.from_numpy(arrays["dense"][rows]))
        assert torch.equal(batch.dense, expected_dense)
        assert batch.sparse.dtype == torch.int64 and batch.sparse.tolist() == arrays["sparse"][rows].tolist()
        assert batch.labels.tolist() == arrays["label"][rows].astype(np.float32).tolist()
    assert sorted(int(d) for b, _ in got for d in torch.expm1(b.dense[:, 0]).round()) == list(range(100))


def test_device_loader_unshuffled_batches_are_views_with_no_gather(tmp_path):
    """Unshuffled, a batch is a contiguous row range: views, no gather at all (only the sparse block's widening)."""
    root = tmp_path / "ds"
    arrays = make_dataset(root, {"train": 40}, row_group_size=9)["train"]
    loader = DeviceLoader(split_files(root, read_metadata(root), "train"), 16, "cpu")
    got = _batches_with_ops(loader)
    assert [len(b) for b, _ in got] == [16, 16, 8]
    for i, (batch, ops) in enumerate(got):
        assert ops["aten.index_select.default"] == 0 and ops["aten.index.Tensor"] == 0, ops
        rows = slice(16 * i, 16 * (i + 1))
        assert torch.equal(batch.dense, transform_dense(torch.from_numpy(arrays["dense"][rows])))
        assert batch.sparse.tolist() == arrays["sparse"][rows].tolist()
        assert batch.labels.tolist() == arrays["label"][rows].astype(np.float32).tolist()


# -- widen_sparse: three ops, the same values ---------------------------------------------------------------------------


def _compact(raw: np.ndarray) -> torch.Tensor:
    """The int32 bit patterns the loaders carry raw values in (the low 32 bits)."""
    return torch.from_numpy((raw & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def test_widen_sparse_restores_every_raw_value_in_three_ops():
    """One-hot rule: the raw values [-1, 2^32) without 0xFFFFFFFF come back exactly; multi-hot (padded): [-2, 2^32)
    without 0xFFFFFFFE and 0xFFFFFFFF. Each widening is 3 ops (the cast, the mask, the in-place add); it was 4
    (cast, ==, &, where), the 4th a kernel launch per batch of the "gpu" placement."""
    edges = [0, 1, 2, 1000, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 3]
    rng = np.random.default_rng(0)
    for padded, negatives, top in ((False, [-1], 2**32 - 1), (True, [-2, -1], 2**32 - 2)):
        raw = np.array(negatives + edges + list(rng.integers(0, top, 200)), dtype=np.int64)
        assert raw.max() < top
        compact = _compact(raw)
        with _Ops() as ops:
            wide = widen_sparse(compact, padded=padded)
        assert ops.names == ["aten._to_copy.default", "aten.lt.Scalar", "aten.add_.Tensor"], ops.names
        assert wide.dtype == torch.int64 and wide.tolist() == raw.tolist()
    # the one-hot rule reads 0xFFFFFFFE as itself (version 1's data), the multi-hot rule as the padding -2
    assert widen_sparse(_compact(np.array([2**32 - 2]))).tolist() == [2**32 - 2]
    assert widen_sparse(_compact(np.array([2**32 - 2])), padded=True).tolist() == [-2]


def test_widen_sparse_of_a_transposed_block_and_of_int64():
    """The streamed loader widens a buffer's columns as a transposed view (`_upload`): same values as the contiguous
    block; an int64 block comes back as a copy, unchanged."""
    raw = np.random.default_rng(1).integers(-1, 2**32 - 1, (7, 26))
    columns = _compact(raw).t().contiguous()  # [26, rows], as the host arena holds them
    assert widen_sparse(columns.t()).tolist() == raw.tolist()
    as_int64 = torch.from_numpy(raw)
    copied = widen_sparse(as_int64)
    assert copied.tolist() == raw.tolist() and copied.data_ptr() != as_int64.data_ptr()


# -- LossWindow.add: one copy a step, no view made per step --------------------------------------------------------------


def test_loss_window_add_dispatches_one_copy_a_step_over_several_windows():
    """Each step's loss lands in its slot with a single copy: the slot's view is made once a buffer (`_hold`), not as
    ``buf[n]`` every step (a select op each). Three windows of 20 steps: 60 copies, no select; every window's losses
    read back in order."""
    window = LossWindow(torch.device("cpu"), capacity=20, first_step=0)
    losses = [torch.tensor(0.5 + k / 64) for k in range(60)]
    with _Ops() as ops:
        for w in range(3):
            for k in range(20):
                window.add(losses[20 * w + k])
            assert window.values() == [float(x) for x in losses[20 * w: 20 * w + 20]]
            window.reset(20 * (w + 1))
    counts = Counter(ops.names)
    assert counts["aten.copy_.default"] == 60 and counts["aten.select.int"] == 0, counts


def test_loss_window_beyond_its_first_slots_grows_and_reuses_the_grown_buffer():
    """A window longer than `_FIRST_SLOTS` grows its buffer (the steps past those slots index it as before); the slot
    views then belong to the grown buffer: the next window's losses are read back from it, not from the old one."""
    n = _FIRST_SLOTS + 100
    window = LossWindow(torch.device("cpu"), capacity=3 * _FIRST_SLOTS, first_step=7)
    values = [float(k % 97) / 8 for k in range(n)]
    for v in values:
        window.add(torch.tensor(v))
    assert window.buf.numel() == 2 * _FIRST_SLOTS and window.values() == values
    assert int(window.first_nonfinite_step()) == -1 and float(window.total()) == sum(values)
    window.reset(7 + n)
    for v in (1.5, float("nan"), 2.5):
        window.add(torch.tensor(v))
    got = window.values()
    assert got[0] == 1.5 and np.isnan(got[1]) and got[2] == 2.5 and len(got) == 3
    assert int(window.first_nonfinite_step()) == 7 + n + 2
    window.preload([0.25, 0.75], step=50)  # a resumed window's losses, then this session's
    window.add(torch.tensor(1.0))
    assert window.values() == [0.25, 0.75, 1.0] and window.first_step == 48


# -- LossWindow.first_nonfinite_step: the logging step's NaN/Inf check in 8 kernels ---------------------------------------


def test_first_nonfinite_step_names_the_first_nan_or_inf_in_eight_kernels():
    """Every logging step reduces its window for the first NaN/Inf loss. ``~torch.isfinite(x)`` dispatched 5 kernels
    (isfinite is composite: abs, !=, ==, *; then ~) and the step number was added in two adds: 12 kernels a window,
    now 8 (``x * 0 != 0``, one add). The answer is numpy's, for every extreme float32 value at every position."""
    specials = [float("nan"), float("inf"), float("-inf")]
    finite = [0.0, -0.0, 1.0, -2.5, 3.4e38, -3.4e38, 1e-45, -1e-45, 1.17e-38]
    cases = [finite, []] + [finite[:k] + [bad] + finite[k:] + [float("nan")] for bad in specials for k in (0, 4, 9)]
    for values in cases:
        window = LossWindow(torch.device("cpu"), capacity=32, first_step=100)
        for v in values:
            window.add(torch.tensor(v, dtype=torch.float32))
        with _Ops() as ops:
            got = window.first_nonfinite_step()
        nonfinite = np.flatnonzero(~np.isfinite(np.array(values, dtype=np.float32)))
        assert int(got) == (101 + int(nonfinite[0]) if len(nonfinite) else -1), values
        assert got.dtype == torch.int64 and got.dim() == 0
        if values:
            kernels = [n for n in ops.names if n != "aten.slice.Tensor"]  # (the window's view: no kernel)
            assert len(kernels) == 8 and "aten.abs.default" not in kernels, kernels
