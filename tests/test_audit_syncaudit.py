"""syncaudit: host syncs hidden in the training loop's per-step and per-window paths on CUDA.

torch's sync debug mode ("error") raises on a synchronizing CUDA call: the `gpu` tests run the code under it with work
queued ahead. Without a GPU, a dispatch mode sees the mechanism instead: a copy from a host tensor into a device tensor
(the blocking H2D copy of pageable memory that waits for every queued kernel) or a copy where a fill kernel would do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlrm.data.device_loader import DeviceLoader, device_permutation
from dlrm.data.preprocess import _splitmix64
from dlrm.train.windows import filled_on_device


class _Ops(TorchDispatchMode):
    """Records every aten op dispatched inside it (packet names), and each copy of a host (CPU) tensor into a tensor
    on another device, the synchronous H2D copy on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.host_to_device: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.names.append(name)
        ins = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        # copy_(device dst, host src) returns dst; _to_copy(host, device=...) returns the device tensor
        if ("copy" in name or name == "to") and any(t.device.type == "cpu" for t in ins) \
                and any(t.device.type != "cpu" for t in (*outs, *ins)):
            self.host_to_device.append(str(func))
        return out


def _queue_work(device: str) -> torch.Tensor:
    """A few matmuls queued ahead of the code under test: a sync there would wait for them."""
    x = torch.randn(512, 512, device=device)
    for _ in range(4):
        x = x @ x.T / 512
    return x


class _NoSync:
    """torch's sync debug mode "error" on CUDA while inside (nothing elsewhere)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")


# -- the logging window's signal flags (windows.filled_on_device) -------------------------------------------------------


def test_the_signal_flags_are_written_by_fill_kernels_not_copied_from_host_numbers():
    """review60's fix wrote each flag with ``out[i] = value``: for a CUDA tensor torch's setitem turns the number into
    a host tensor and copies it into the element (a blocking H2D copy, the sync it was meant to remove; only a slice's
    assignment fills). Each flag must be a fill kernel taking the number as its argument: no copy at all."""
    with _Ops() as ops:
        flags = filled_on_device([15, 1, 0], torch.device("cpu"))
    assert flags.dtype == torch.int64 and flags.tolist() == [15, 1, 0]
    assert "fill_" in ops.names
    assert not [n for n in ops.names if "copy" in n], ops.names
    assert filled_on_device([], torch.device("cpu")).tolist() == []


# -- the epoch's shuffle of the device-resident split (device_loader.device_permutation) ---------------------------------


def _reference_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The uint64 splitmix64 order of `device_permutation`'s docstring, in numpy: rows sorted (stably) by the hash of
    row XOR key, the hashes compared as int64 (as torch sorts them), key = splitmix64(splitmix64(seed) XOR epoch)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(_splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64)) ^ np.uint64(epoch))
        hashed = _splitmix64(np.arange(n, dtype=np.uint64) ^ key[0])
    return np.argsort(hashed.view(np.int64), kind="stable")


@pytest.mark.parametrize("seed,epoch", [(0, 0), (3, 2), (2**64 - 1, 7), (-5, 1), (123456789, 40)])
def test_the_epoch_permutation_is_the_uint64_splitmix_order(seed, epoch):
    """The key now reaches the device as a kernel argument: the permutation must stay the same, bit for bit (a
    resumed run cuts the same batches as the run it continues)."""
    got = device_permutation(1001, seed, epoch, "cpu")
    np.testing.assert_array_equal(got.numpy(), _reference_permutation(1001, seed, epoch))


def test_the_epoch_permutation_copies_no_host_tensor_to_the_device():
    """The key was computed on the host and moved with ``.to(device)``: from pageable memory, a copy that waited for
    the previous epoch's queued steps at every epoch's first batch. On the meta device (any device but the host) the
    same call is seen: no host tensor may be copied to the device."""
    with _Ops() as ops:
        perm = device_permutation(1001, 3, 2, "meta")
    assert perm.device.type == "meta" and perm.shape == (1001,)
    assert ops.host_to_device == []


@pytest.mark.gpu
def test_gpu_the_epoch_permutation_is_made_behind_the_queued_step_without_a_sync():
    queued = _queue_work("cuda")
    with _NoSync("cuda"):
        perm = device_permutation(100_003, 11, 3, "cuda")
    assert torch.isfinite(queued).all()
    assert torch.equal(perm.cpu(), device_permutation(100_003, 11, 3, "cpu"))


# -- the training loop's per-step and per-window path on CUDA ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_loop_steps_and_logging_windows_make_no_host_sync(cuda_graph):
    """What `Trainer._fit` runs every step and at each logging step, after the warm-up (and the capture): a new
    epoch's batches from the device-resident split (its shuffle), the fetch's idle-time events, the step (Triton
    embedding with its fused update; captured or not), the LR schedules, the meter's loss slot, and the window's
    device reductions and copies to the host (`DeviceRead`), under torch's sync debug mode "error". The values read
    afterwards are the losses' own."""
    from dlrm.config import load_config
    from dlrm.data.loader import split_files
    from dlrm.data.schema import read_metadata
    from dlrm.train.meter import DeviceRead, RunStats, StepMeter
    from dlrm.train.optim import lr_multiplier, trained_lrs
    from tests.test_graphed_step import SAMPLE, make_run

    device = torch.device("cuda")
    cfg = load_config(SAMPLE, {"kernels.embedding": "triton", "train.compile": False, "train.cuda_graph": cuda_graph,
                               "optim.schedule.warmup_steps": 3, "optim.schedule.decay_start_step": 6,
                               "optim.schedule.decay": "linear"})
    run = make_run(cfg, device)
    assert (type(run.train_step).__name__ == "GraphedTrainStep") is cuda_graph
    sample = SAMPLE.parents[1] / "data" / "sample"
    loader = DeviceLoader(split_files(sample, read_metadata(sample), "train"), 128, device, shuffle=True, seed=5)

    def step(batch) -> torch.Tensor:
        loss = run.train_step(batch)
        for sched in run.schedulers:
            sched.step()
        return loss

    first = iter(loader)
    for _ in range(5):  # warm-up (Triton's compilation; a captured step's side-stream steps and its capture)
        step(next(first))
    torch.cuda.synchronize()

    window, steps = 4, 8
    meter = StepMeter(device, start_step=8, stats=RunStats(), window=window, warmup_steps=0)
    losses, reads = [], []
    loader.set_epoch(1)
    _queue_work("cuda")
    with _NoSync("cuda"):
        batches = iter(loader)  # the new epoch's shuffle, at its first batch
        for i in range(1, steps + 1):
            batch, _ = meter.wait_timer.fetch(lambda: next(batches))
            loss = step(batch)
            meter.step(loss, len(batch), 0.0)
            losses.append(loss.clone())  # (a captured step's loss buffer is the next step's)
            if i % window == 0:
                values = [meter.losses.total(), meter.losses.first_nonfinite_step()]
                values += trained_lrs(run.optimizers[:2], run.schedulers)  # as `WindowLogging._queue_window`
                reads.append((meter.cut_window(8 + i), DeviceRead(*values)))
    got = [read.get() for _, read in reads]
    for k, (total, bad, lr_dense, lr_sparse) in enumerate(got):
        own = torch.stack(losses[k * window:(k + 1) * window]).double().sum().item()
        assert total == pytest.approx(own, rel=1e-6) and bad == -1
        scale = lr_multiplier(5 + (k + 1) * window - 1, cfg.optim.schedule, 40)  # its last step's own rate
        assert lr_dense == pytest.approx(cfg.optim.dense.lr * scale, rel=1e-6)
        assert lr_sparse == pytest.approx(cfg.optim.sparse.lr * scale, rel=1e-6)
    assert [cut.steps for cut, _ in reads] == [window, window]
    assert len({round(float(x), 7) for x in losses}) == steps  # every step trained on its own batch
