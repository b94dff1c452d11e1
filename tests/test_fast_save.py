"""Checkpoints written without zip CRC-32s, CUDA storages copied through pinned memory where the host has room
(`dlrm.fast_save`): a 16 GiB CUDA tensor's torch.save took 32.4 s with torch's defaults, 11.4 s so, on an H200
machine (benchmarks/results/checkpoint_write_h200.md)."""

import zipfile

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm import fast_save as fs
from tests.test_audit_checkpoint_files import tiny_state


def test_checkpoint_has_no_crcs_and_loads_the_same(tmp_path):
    weights = torch.randn(1000, 7, dtype=torch.float64)
    torch.save({"model": {"w": weights}}, tmp_path / "plain.pt")  # torch's default: CRCs
    with zipfile.ZipFile(tmp_path / "plain.pt") as z:
        assert any(i.CRC for i in z.infolist() if "/data/" in i.filename)
    with fs.fast_save({"model": {"w": weights}}) as pinned:
        torch.save({"model": {"w": weights}}, tmp_path / "fast.pt")
    assert pinned is False  # a CPU state: nothing to copy
    with zipfile.ZipFile(tmp_path / "fast.pt") as z:
        data = [i for i in z.infolist() if "/data/" in i.filename]
        assert data and all(i.CRC == 0 for i in data)
    assert torch.equal(torch.load(tmp_path / "fast.pt", weights_only=True)["model"]["w"], weights)
    assert torch.serialization.get_crc32_options() is True  # put back


def test_a_checkpoint_is_written_without_crcs_and_reads_back_whole(tmp_path):
    state = tiny_state(step=3)
    ckpt.write_atomic(tmp_path / "step-00000003.pt", state)
    with zipfile.ZipFile(tmp_path / "step-00000003.pt") as z:
        data = [i for i in z.infolist() if "/data/" in i.filename]
        assert data and all(i.CRC == 0 for i in data)
    back = ckpt.load_checkpoint(tmp_path / "step-00000003.pt")  # the resume's reader: every check it makes
    assert back["model"].keys() == state["model"].keys()
    for key, value in state["model"].items():
        assert torch.equal(back["model"][key], value), key
    assert torch.serialization.get_crc32_options() is True


def test_settings_put_back_when_the_save_fails(tmp_path):
    with pytest.raises(RuntimeError, match="disk"):
        with fs.fast_save({"w": torch.ones(2)}):
            assert torch.serialization.get_crc32_options() is False
            raise RuntimeError("disk full")
    assert torch.serialization.get_crc32_options() is True


def test_views_of_one_storage_count_once_and_cpu_tensors_not_at_all():
    table = torch.empty(100, 8, device="meta")  # (a device tensor without a GPU: what cuda_storage_bytes counts)
    other = torch.empty(3, device="meta", dtype=torch.bfloat16)
    state = {"model": {"a": table[:10], "b": table[10:], "c": other}, "rows": [table], "cpu": torch.ones(1000)}
    assert fs.cuda_storage_bytes(state) == 100 * 8 * 4 + 3 * 2


@pytest.mark.parametrize("nbytes, available, fits", [
    (53 * 10**9, 125 * 10**9, True),
    (53 * 10**9, 106 * 10**9, True),   # exactly half
    (53 * 10**9, 105 * 10**9, False),  # pinned pages cannot be swapped nor reclaimed: at most half
    (53 * 10**9, None, False),         # MemAvailable not known
    (0, 125 * 10**9, False),           # nothing on the device
])
def test_pinned_only_where_the_host_has_twice_the_room(nbytes, available, fits):
    assert fs.pinned_copy_fits(nbytes, available) is fits


@pytest.mark.skipif(fs._save_config() is None, reason="this torch has no use_pinned_memory_for_d2h")
@pytest.mark.parametrize("available, pinned", [(10**12, True), (10**3, False)])
def test_pinned_copy_switched_on_inside_and_released_after(monkeypatch, available, pinned):
    released = []
    monkeypatch.setattr(fs, "_empty_host_cache", lambda: released.append(True))
    config = fs._save_config()
    before = config.use_pinned_memory_for_d2h
    with fs.fast_save({"t": torch.empty(1 << 20, device="meta")}, available=available) as said:
        assert said is pinned and config.use_pinned_memory_for_d2h is pinned
        assert torch.serialization.get_crc32_options() is False
    assert config.use_pinned_memory_for_d2h is before and torch.serialization.get_crc32_options() is True
    assert released == ([True] if pinned else [])


def test_mem_available_read_from_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       131072000 kB\nMemAvailable:   125000000 kB\n")
    assert fs.mem_available(str(tmp_path / "meminfo")) == 125000000 * 1024
    (tmp_path / "none").write_text("MemTotal:       131072000 kB\n")
    assert fs.mem_available(str(tmp_path / "none")) is None
    assert fs.mem_available(str(tmp_path / "missing")) is None
