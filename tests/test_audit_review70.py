"""Review of session 69's lazily gathered batches (`GatheredBatch`) from the side of their other readers.

benchmarks/loader_throughput.py times an epoch of each loader by iterating it: a shuffled batch of the "gpu"
placement is now gathered when its tensors are first read, so an epoch that only counted rows timed the slices of
the permutation and none of the gathers (the "gpu" shuffled row's samples/s, and its verdict against the 200M
target, were those of a loader that delivered nothing).
"""

from __future__ import annotations

import torch

from dlrm.data.batch import ResidentSplit
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import split_files
from dlrm.data.schema import read_metadata
from tests.conftest import make_dataset
from tests.test_benchmark_scripts import load_script


def test_loader_throughput_epoch_times_the_gathers_of_a_shuffled_device_resident_split(tmp_path, monkeypatch):
    """`_epoch` over a shuffled DeviceLoader: every batch's gathers run inside the timed epoch (one `take` a batch),
    as when the loader gathered them itself; an unshuffled epoch (views) gathers nothing."""
    lt = load_script("loader_throughput")
    make_dataset(tmp_path, {"train": 45}, row_group_size=7)
    files = split_files(tmp_path, read_metadata(tmp_path), "train")
    takes = []
    take = ResidentSplit.take
    monkeypatch.setattr(ResidentSplit, "take", lambda self, rows: takes.append(len(rows)) or take(self, rows))
    shuffled = DeviceLoader(files, batch_size=8, device="cpu", shuffle=True, seed=1)
    rows, seconds = lt._epoch(shuffled, torch.device("cpu"))
    assert rows == 45 and seconds >= 0.0
    assert takes == [8] * 5 + [5]
    takes.clear()
    assert lt._epoch(DeviceLoader(files, batch_size=8, device="cpu"), torch.device("cpu"))[0] == 45 and takes == []
