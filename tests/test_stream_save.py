"""torch.save's file with its tensors' bytes streamed in chunk by chunk (`dlrm.stream_save`): read back, it is what
torch.save wrote, views and dtypes and all; where the records do not match, plain torch.save writes it."""

import os
import zipfile

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm import stream_save as ss
from tests.test_audit_checkpoint_files import tiny_state


def _state(device="cpu"):
    base = torch.arange(37, dtype=torch.float32, device=device)
    wide = torch.randn(5, 9, dtype=torch.float64, device=device)
    return {"model": {"a": base[:10], "b": base[10:], "t": wide.t(), "bf": torch.randn(13, device=device).bfloat16(),
                      "mask": torch.rand(11, device=device) > 0.5, "empty": torch.zeros(0, 4, device=device),
                      "ids": torch.randint(0, 1 << 40, (7,), device=device)},
            "list": [base, {"n": 3}], "step": 4}


def _save(tmp_path, state, chunk, name="s.pt"):
    path = tmp_path / name
    advanced = []
    with open(path, "wb") as f:
        assert ss.stream_save(state, f, f, str(path), advanced.append, chunk=chunk)
        f.flush()
    return path, advanced


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])  # chunks smaller than a storage, uneven, and larger
def test_read_back_it_is_the_state_views_and_dtypes_kept(tmp_path, chunk):
    state = _state()
    path, advanced = _save(tmp_path, state, chunk)
    back = torch.load(path, weights_only=True)
    assert _same(state, back)
    # views of one storage stay one storage
    assert back["model"]["a"].untyped_storage().data_ptr() == back["model"]["b"].untyped_storage().data_ptr()
    assert back["list"][0].untyped_storage().data_ptr() == back["model"]["a"].untyped_storage().data_ptr()
    total = sum(s.nbytes() for s in ss.storage_order(state).values())
    assert sum(advanced) == total and max(advanced) <= chunk


def test_tensor_bytes_are_torch_saves_own(tmp_path):
    # the records' bytes at their offsets, against plain torch.save's file (CRCs off as the checkpoint writes it)
    state = _state()
    streamed, _ = _save(tmp_path, state, 64)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, tmp_path / "plain.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    a, b = ss.data_offsets(str(streamed)), ss.data_offsets(str(tmp_path / "plain.pt"))
    assert a.keys() == b.keys() and len(a) == 6  # base, wide, bf, mask, empty, ids
    with open(streamed, "rb") as fa, open(tmp_path / "plain.pt", "rb") as fb:
        for key, (offset, size) in a.items():
            fa.seek(offset), fb.seek(b[key][0])
            assert size == b[key][1] and fa.read(size) == fb.read(size), key


def test_records_that_do_not_match_fall_back_to_torch_save(tmp_path, monkeypatch):
    state = tiny_state(step=3)
    state["model"]["twin"] = torch.ones_like(next(v for v in state["model"].values() if isinstance(v, torch.Tensor)))
    real = ss.storage_order

    def swapped(obj):  # another torch numbering two storages of one size the other way round
        order = real(obj)
        same = [k for k in order if order[k].nbytes() == order["0"].nbytes()]
        assert len(same) >= 2, "the state needs two storages of one size"
        order[same[0]], order[same[1]] = order[same[1]], order[same[0]]
        return order

    monkeypatch.setattr(ss, "storage_order", swapped)
    path = tmp_path / "x.pt"
    with open(path, "wb") as f:
        assert ss.stream_save(state, f, f, str(path), lambda n: None) is False
        assert os.fstat(f.fileno()).st_size == 0
    ckpt.write_atomic(tmp_path / "step-00000003.pt", state)  # and the checkpoint is written by torch.save
    back = ckpt.load_checkpoint(tmp_path / "step-00000003.pt")
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def test_a_torch_without_skip_data_writes_plainly(tmp_path, monkeypatch):
    monkeypatch.delattr(torch.serialization, "skip_data")
    path = tmp_path / "x.pt"
    with open(path, "wb") as f:
        assert ss.stream_save(_state(), f, f, str(path), lambda n: None) is False
    state = tiny_state(step=3)
    ckpt.write_atomic(tmp_path / "step-00000003.pt", state)
    back = ckpt.load_checkpoint(tmp_path / "step-00000003.pt")
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def test_a_checkpoint_records_no_crcs_and_zipfile_sees_its_members(tmp_path):
    ckpt.write_atomic(tmp_path / "step-00000003.pt", tiny_state(step=3))
    with zipfile.ZipFile(tmp_path / "step-00000003.pt") as z:
        data = [i for i in z.infolist() if "/data/" in i.filename]
        assert data and all(i.CRC == 0 for i in data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, chunked copy of a CUDA storage needs a GPU")
@pytest.mark.parametrize("chunk", [1000, 1 << 20])
def test_cuda_storages_stream_through_pinned_chunks(tmp_path, chunk):
    state = _state("cuda")
    state["model"]["big"] = torch.randn(3000, 7, device="cuda").bfloat16()
    path, advanced = _save(tmp_path, state, chunk)
    back = torch.load(path, weights_only=True, map_location="cuda")
    assert _same(state, back)
    assert sum(advanced) == sum(s.nbytes() for s in ss.storage_order(state).values())


def test_a_full_disk_while_the_bytes_stream_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    # the tensors' bytes no longer pass through torch.save's writes: a full disk in the streamed part (a sparse
    # file's space is taken there) must end as torch.save's own failure did
    import errno

    target = tmp_path / "best.pt"
    ckpt.write_atomic(target, tiny_state(step=3))
    before = target.read_bytes()
    calls = []

    def full(f, data, offset):
        calls.append(offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ss, "_write_at", full)
    with pytest.raises(OSError) as e:
        ckpt.write_atomic(target, tiny_state(step=6))
    assert calls and e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"] and target.read_bytes() == before
