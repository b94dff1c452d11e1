"""Session 60: what the GPU machine's whole suite found (torch 2.11 there, 2.13 here)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dlrm.model.masked_lookup import unchecked_sparse_coo
from tests.conftest import CHILD_ENV, REPO

# The lazy weight decay's sparse gradient, rebuilt in a fresh process (torch warns once a process).
_DECAYED_GRAD = """
import warnings
warnings.simplefilter("always")  # PYTHONWARNINGS=always's filter, without the fresh interpreter a changed one starts
import torch
from dlrm.train.optim import decay_touched_rows_
w = torch.nn.Parameter(torch.ones(4, 2))
torch.nn.functional.embedding(torch.tensor([3, 1, 3]), w, sparse=True).sum().backward()
decay_touched_rows_(w, 0.5)
print(w.grad.to_dense().tolist())
"""


def test_the_lazy_weight_decays_sparse_gradient_warns_of_no_memory_errors():
    """torch 2.11 (the GPU image's) printed "Sparse invariant checks are implicitly disabled. Memory errors (e.g.
    SEGFAULT) will occur ..." for a sparse tensor built with ``check_invariants=False``; 2.13 does not."""
    done = subprocess.run([sys.executable, "-c", _DECAYED_GRAD], cwd=REPO, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "invariant" not in done.stderr, done.stderr
    assert done.stdout.strip() == str([[0.0, 0.0], [1.5, 1.5], [0.0, 0.0], [2.5, 2.5]])  # row 3: two lookups, + 0.5 * 1


@pytest.mark.parametrize("checks", [False, True])
def test_an_unchecked_sparse_tensor_keeps_the_callers_invariant_setting(checks):
    """Its context manager sets torch's process-wide setting explicitly (that silences 2.11's warning) to the value the
    caller had, and restores it: a user who turned the checks on keeps them for their own tensors."""
    with torch.sparse.check_sparse_tensor_invariants(enable=checks):
        grad = unchecked_sparse_coo(torch.tensor([[2, 0]]), torch.tensor([[1.0], [2.0]]), torch.Size([3, 1]))
        assert torch.sparse.check_sparse_tensor_invariants.is_enabled() is checks
    assert grad.to_dense().tolist() == [[2.0], [0.0], [1.0]]
    assert not grad.is_coalesced()
    coalesced = unchecked_sparse_coo(torch.tensor([[0, 2]]), torch.tensor([[2.0], [1.0]]), torch.Size([3, 1]),
                                     is_coalesced=True)
    assert coalesced.is_coalesced()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the host sync it avoids is CUDA's"))])
def test_the_logging_windows_signal_flags_are_filled_behind_the_step_without_a_sync(device):
    """review60: under torchrun each logging window built its signal flags with ``torch.tensor([...], device=cuda)``,
    a copy from pageable memory that waits for the whole queued step, which the window's reads are meant to run
    behind. torch's sync debug mode raises on any synchronizing call."""
    from dlrm.train.windows import filled_on_device

    queued = torch.randn(512, 512, device=device)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            queued = queued @ queued.T / 512  # work queued ahead of the flags
        flags = filled_on_device([15, 1, 0], torch.device(device))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert flags.dtype == torch.int64 and flags.device.type == device
    assert flags.tolist() == [15, 1, 0]
