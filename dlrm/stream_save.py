"""torch.save's file, its tensors' bytes streamed in: a CUDA storage goes to the disk in chunks through two small
pinned buffers, never whole in host memory.

torch.save copies each CUDA storage whole to the host before writing it (`dlrm.fast_save`): MLPerf DLRM-DCNv2's
tables are one 52 GB storage, so a one-process checkpoint held 53 GB of host memory and wrote nothing for the copy's
~40 s (pageable, 1.16 GB/s) or the pinned buffer's ~26 s allocation, then wrote at the disk's rate (95 s and 71 s in
all on an H200 machine, 2026-12-04). Here the archive is written first with the space for the bytes left empty
(`torch.serialization.skip_data`), then each storage's bytes are written at its record's offset, the device-to-host
copy of one chunk running while the previous chunk is written: the save takes the disk's time and ~2 chunks of
host memory. The file is torch.save's own, byte for byte (CRC-32s 0, as `dlrm.fast_save` writes them).

The records are found by name in the zip's directory, the storages by the order torch.save numbers them (the order
of their first appearance in the pickle, which a pickling of the same object reproduces), checked by rebuilding the
file's pickle over those storages: every tensor must view the state's own memory. Where anything does not match
(another torch's layout), the file is written again by plain torch.save.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from typing import Any, Callable, Optional

import torch

CHUNK_BYTES = 64 << 20
"""A chunk of a storage's bytes (two pinned buffers of this size for a CUDA storage)."""


def storage_order(obj: Any) -> dict[str, torch.UntypedStorage]:
    """`obj`'s storages by the key torch.save gives each (``"0"``, ``"1"``, ... in order of first appearance while
    pickling, one key for views of one storage), from a pickling of `obj` that writes no tensor's bytes.

    Example:
        >>> t = torch.arange(6.0)
        >>> state = {"a": t[:2], "b": torch.ones(2, dtype=torch.int8), "c": t}  # a and c: one storage
        >>> {k: s.nbytes() for k, s in storage_order(state).items()}
        {'0': 24, '1': 2}
    """
    ids: dict[int, str] = {}
    order: dict[str, torch.UntypedStorage] = {}

    class _Order(pickle.Pickler):
        def persistent_id(self, o: Any) -> Optional[tuple]:
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                key = ids.setdefault(storage._cdata, str(len(ids)))
                order.setdefault(key, storage)
                return ("storage", key)
            return None

    _Order(io.BytesIO(), protocol=2).dump(obj)
    return order


def record_offsets(path: str) -> dict[str, tuple[int, int]]:
    """``name -> (offset, size)`` of each record of the torch.save file at `path` (``<archive>/data.pkl``,
    ``<archive>/data/<key>``, ...: the name after the archive's folder): where its bytes start, after its local
    header, whose name and extra field lengths are read from the file (zipfile would check the CRC-32s, which are 0)."""
    found: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset)
            header = f.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise ValueError(f"{info.filename}: no local header at {info.header_offset}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            found[info.filename.split("/", 1)[-1]] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return found


def data_offsets(path: str) -> dict[str, tuple[int, int]]:
    """``key -> (offset, size)`` of each tensor record (``data/<key>``) of the torch.save file at `path`."""
    return {name[5:]: where for name, where in record_offsets(path).items() if name.startswith("data/")}


def _rebuilt(path: str, order: dict[str, torch.UntypedStorage]) -> Any:
    """The object of the file at `path`'s pickle with each storage key bound to `order`'s storage (no bytes read:
    the tensors are views of `state`'s own storages where `order` is right)."""
    offset, size = record_offsets(path)["data.pkl"]
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(size)

    class _Bind(pickle.Unpickler):  # (the file this process has just written, not a file from elsewhere)
        def persistent_load(self, saved_id: tuple) -> Any:
            _, storage_type, key, _location, _numel = saved_id
            with warnings.catch_warnings():  # (the legacy storage classes torch.save names say they are deprecated)
                warnings.simplefilter("ignore", UserWarning)
                dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            return torch.storage.TypedStorage(wrap_storage=order[key], dtype=dtype, _internal=True)

    return _Bind(io.BytesIO(raw)).load()


def _same_views(a: Any, b: Any) -> bool:
    """Whether `b` has `a`'s structure and each of its tensors views the same memory as `a`'s, the same way."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
                and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_views(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_views(x, y) for x, y in zip(a, b))
    return True


def _write_at(f, data: memoryview, offset: int) -> None:
    """`data` at `offset` of the file object `f`, through its own ``write`` (a BufferedWriter passes a chunk this
    large straight to the file's: a full disk or a quota fails there as in torch.save's own writes)."""
    f.seek(offset)
    f.write(data)


def write_storage(f, offset: int, storage: torch.UntypedStorage, advance: Callable[[int], None],
                  chunk: int = CHUNK_BYTES) -> None:
    """Write `storage`'s bytes at `offset` of the file object `f`; a CUDA storage's chunk by chunk through two pinned
    buffers, the next chunk's copy running while this one is written."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    n = flat.numel()
    if flat.device.type == "cpu":
        for start in range(0, n, chunk):
            _write_at(f, memoryview(flat[start:start + chunk].numpy()), offset + start)
            advance(min(chunk, n - start))
        return
    if n == 0:
        return
    size = min(chunk, n)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]
    side = torch.cuda.Stream(device=flat.device)
    side.wait_stream(torch.cuda.current_stream(flat.device))  # the step that made the bytes has finished writing them

    def copy(i: int) -> None:
        start = i * chunk
        with torch.cuda.stream(side):
            buffers[i % 2][:min(chunk, n - start)].copy_(flat[start:start + chunk], non_blocking=True)
            done[i % 2].record(side)

    count = -(-n // chunk)
    copy(0)
    for i in range(count):
        if i + 1 < count:
            copy(i + 1)  # into the buffer chunk i - 1 left, written (synchronously) in the last pass
        done[i % 2].synchronize()
        start = i * chunk
        length = min(chunk, n - start)
        _write_at(f, memoryview(buffers[i % 2][:length].numpy()), offset + start)
        advance(length)


def stream_save(state: Any, writer, f, path: str, advance: Callable[[int], None], chunk: int = CHUNK_BYTES) -> bool:
    """torch.save `state` through `writer` (a file object with ``write`` and ``seek``: the progress bar's) into the
    open, empty file `f` at `path`, its tensors' bytes streamed in (`write_storage`); `advance(n)` after each n
    bytes. False where this torch has no ``skip_data`` or the file's records do not match `state`'s storages: the
    caller writes it with plain torch.save (`f` emptied again)."""
    skip = getattr(torch.serialization, "skip_data", None)
    if skip is None:
        return False
    order = storage_order(state)
    with skip():
        torch.save(state, writer)
    f.flush()
    offsets = data_offsets(path)
    # each key's bytes where torch.save numbered them: the sizes, and the pickle rebuilt over these storages views
    # the state's memory tensor for tensor (two storages of one size swapped would pass the sizes alone)
    if (offsets.keys() != order.keys() or any(offsets[k][1] != s.nbytes() for k, s in order.items())
            or not _same_views(state, _rebuilt(path, order))):
        f.seek(0)
        f.truncate()
        return False
    for key, storage in order.items():
        write_storage(f, offsets[key][0], storage, advance, chunk)
    return True
