"""torch.save at the disk's speed: no zip CRC-32s, and CUDA storages copied to the host through pinned memory.

A checkpoint's bytes are streamed in by `dlrm.stream_save` (no whole copy at all); the pinned copy here is for the
files it leaves to plain torch.save (another torch's layout), the CRC-32s for both.

A checkpoint's torch.save spent most of its time on neither the GPU nor the disk. Measured on an H200 machine
(2026-12-04, ``benchmarks/results/checkpoint_write_h200.md``, one 16 GiB CUDA tensor): 32.4 s with torch's defaults,
24.1 s without the CRC-32s, 17.1 s with the pinned copy, 11.4 s with both (the disk alone: 14.1 s at 1.22 GB/s).

* CRC-32: torch.save computes one for each record on one core (~1 GB/s) and torch.load never checks it (a flipped
  byte inside a tensor loads without a word, with or without it), so it bought nothing. Without it the zip's CRC
  fields are 0: ``unzip -t`` and Python's ``zipfile`` reading a member report them bad; torch.load reads the file.
* The device-to-host copy: torch.save copies each CUDA storage with ``storage.cpu()`` into pageable memory (1.16
  GB/s there, MLPerf DLRM-DCNv2's 52 GB of tables in ~40 s before the first byte reached the disk); through a pinned
  buffer (torch's ``use_pinned_memory_for_d2h``) the copy runs at ~54 GB/s after the buffer's allocation (2 GB/s).
  Pinned pages cannot be swapped nor reclaimed, so the copy is pinned only where the CUDA storages' bytes are at most
  half of the host's MemAvailable (pageable otherwise, as before), and the pinned buffers torch's host allocator
  keeps cached afterwards are handed back at once: the run does not hold the checkpoint's size in pinned memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

PINNED_SHARE = 0.5
"""The largest share of the host's MemAvailable a save may pin (see the module docstring)."""


def cuda_storage_bytes(obj: Any) -> int:
    """The bytes of the distinct storages off the CPU (CUDA's) in `obj` (nested dicts, lists and tuples of tensors
    and values; views of one storage counted once): what torch.save copies to the host.

    Example:
        >>> cuda_storage_bytes({"model": {"w": torch.zeros(4)}, "steps": [1, 2]})  # CPU tensors: nothing to copy
        0
    """
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.device.type != "cpu":
                storage = o.untyped_storage()
                seen[storage._cdata] = storage.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return sum(seen.values())


def pinned_copy_fits(nbytes: int, available: Optional[int]) -> bool:
    """Whether a save may copy `nbytes` of CUDA storages through pinned memory, with `available` bytes of the
    host's MemAvailable (None: not known, not pinned).

    Example:
        >>> pinned_copy_fits(53 * 10**9, 125 * 10**9), pinned_copy_fits(53 * 10**9, 100 * 10**9)
        (True, False)
    """
    return 0 < nbytes and available is not None and nbytes <= PINNED_SHARE * available


def mem_available(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The host's MemAvailable in bytes; None where `meminfo` does not say it (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _save_config() -> Any:
    """torch's ``torch.utils.serialization.config.save`` (None in a torch without it)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return None
    save = getattr(config, "save", None)
    return save if hasattr(save, "use_pinned_memory_for_d2h") else None


def _empty_host_cache() -> None:
    """Hand the pinned buffers torch's host allocator holds back to the system (the API's name by torch version)."""
    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"), (torch._C, "_host_emptyCache"),
                        (torch._C, "_accelerator_emptyHostCache")):
        release = getattr(owner, name, None)
        if release is not None:
            release()
            return


@contextlib.contextmanager
def fast_save(state: Any, available: Optional[int] = None) -> Iterator[bool]:
    """Inside: torch.save writes no CRC-32s and, where `pinned_copy_fits` (`available`: the host's MemAvailable;
    default: read now), copies `state`'s CUDA storages through pinned memory; yields whether it does. torch's
    settings are put back afterwards, and pinned buffers handed back.

    Example:
        >>> import io
        >>> with fast_save({"w": torch.ones(3)}) as pinned:
        ...     torch.save({"w": torch.ones(3)}, io.BytesIO())
        >>> pinned, torch.serialization.get_crc32_options()
        (False, True)
    """
    cuda_bytes = cuda_storage_bytes(state)
    if cuda_bytes and available is None:
        available = mem_available()
    config = _save_config()
    pinned = config is not None and pinned_copy_fits(cuda_bytes, available)
    crc = torch.serialization.get_crc32_options()
    was_pinned = config.use_pinned_memory_for_d2h if config is not None else None
    torch.serialization.set_crc32_options(False)
    if config is not None:
        config.use_pinned_memory_for_d2h = pinned
    try:
        yield pinned
    finally:
        torch.serialization.set_crc32_options(crc)
        if config is not None:
            config.use_pinned_memory_for_d2h = was_pinned
        if pinned:
            _empty_host_cache()
