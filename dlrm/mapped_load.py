"""Checkpoints read memory-mapped: their tensors are views of the file's pages, read as they are used.

torch.load read a checkpoint whole into the process's own memory: MLPerf DLRM-DCNv2's 53 GB file took 53 GB of host
memory at a one-process resume or ``--eval-only``, besides the model, and a resume read it twice (once for its config
and position before the build, once to restore). With ``torch.load(mmap=True)`` the file's pages are the page cache's:
read once where they are used (the model's ``load_state_dict`` copy), shared with other readers, dropped by the kernel
under memory pressure instead of being swapped or killing the process. Measured on this project's 2-core machine
(``benchmarks/results/checkpoint_load_cpu.md``, cold reads): a 2 GiB checkpoint loaded into a model in 0.7-1.0 s
(1.4-1.8 s read ahead first) instead of 2.7-4.2 s, the process's anonymous memory growing by 0.0 GiB instead of 2.0.

Two things the plain read gave that a mapping does not, kept here:

* A progress bar: the read happened inside torch.load (a bar followed its bytes); mapped, it happens inside the
  model's copy, without a word for a minute (MLPerf's file). `read_ahead` reads the tensors a caller will use into
  the page cache, with a bar (one pass at the disk's rate), where they fit in half of the host's MemAvailable; a
  larger file is read as it is used, said in one line. Within `reading` it reads on a thread of its own while the
  caller goes on (builds its model, copies the tensors: the copy then finds the pages read, or reads them itself),
  and `reading` waits for it at its end. Read first, then copied, a 16 GiB file into CUDA took 20-35% longer than
  mapped and copied alone (an H100: 13.8-14.3 s against 10.5-11.5; an H200: 10.4-11.5 against 8.3-9.9;
  results/checkpoint_load_h100.md, gpu_tests_2026-12-05_s83.md): the bar's price, which the thread is to remove
  (not yet measured on a GPU machine; on the 2-core CPU machine, where the copy and the reads share two cores, no
  difference beyond the spread: checkpoint_load_cpu_background.md).
* Ownership: a mapped tensor is ``MAP_PRIVATE`` (writes stay in this process) but its unwritten pages are the file's:
  an optimizer that keeps a loaded tensor as its state (``torch.optim`` keeps a CPU tensor of the parameter's dtype
  as it is) would read another file's bytes if the checkpoint were overwritten in place (``cp``) while the run trains.
  `own_copies` gives such tensors memory of their own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from dlrm.errors import ConfigError
from dlrm.fast_save import mem_available
from dlrm.logging_setup import ProgressBar, bar_interval, run_logger

READ_AHEAD_SHARE = 0.5
"""The largest share of the host's MemAvailable `read_ahead` reads into the page cache (more is read as it is used:
the pages read first would be dropped again before they are used)."""
CHUNK_BYTES = 64 << 20
"""`read_ahead`'s step (and its progress bar's)."""


def load_mapped(path: str, allowed: list) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` onto the CPU, the globals `allowed` (``(obj, name)`` pairs)
    besides torch's: the file's pickle is read now, its tensors' bytes where they are used."""
    try:
        path.encode()
    except UnicodeEncodeError:  # a name not UTF-8 (os.fsdecode's surrogates), which torch's C++ mapping cannot take (it
        # fell back to a read whole, uncounted by the memory checks): the same file through its descriptor (Linux)
        with open(path, "rb") as f:
            return load_mapped(f"/proc/self/fd/{f.fileno()}", allowed)  # (the mapping outlives the descriptor)
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def raise_if_out_of_memory(e: BaseException, path: Any, mapped: bool) -> None:
    """Raise a MemoryError naming the checkpoint at `path` and its size where `e`, torch.load's failure on it (`mapped`
    or read whole), is an allocation's (ENOMEM: ``ulimit -v`` or ``-d`` short of its size); said as it is (exit 4,
    `dlrm.cli.out_of_memory_message`). The file was called "not a readable checkpoint (RuntimeError: [enforce fail at
    alloc_cpu.cpp:127] ...)", exit 2, and a mapping refused so fell back to a read whole, which needs as much."""
    if not (isinstance(e, MemoryError) or os.strerror(errno.ENOMEM) in str(e)):
        return
    size = os.stat(path).st_size / 2**20
    how = f"mapping it ({size:,.1f} MiB of address space)" if mapped else f"reading it whole ({size:,.1f} MiB)"
    exc = MemoryError(f"{path}: out of memory {how}: more than this process may take (ulimit -v, ulimit -d"
                      f"{'' if mapped else ', or the host memory'}); raise the limit")
    exc.dlrm_refused = True  # type: ignore[attr-defined]
    raise exc from None


def file_stamps(paths: Iterable[Any]) -> dict[str, tuple[int, int, int, int]]:
    """(device, inode, size, modification time in ns) of each file of `paths` that exists, by path: taken before a
    mapped load, compared by `check_unchanged` once its tensors are copied."""
    stamps = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:  # (the load names a missing file)
            continue
        stamps[str(path)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return stamps


def check_unchanged(stamps: dict[str, tuple[int, int, int, int]]) -> None:
    """A one-line ConfigError naming the first file of `stamps` (`file_stamps`) written in place since: the same file
    (device, inode), another size or modification time (``cp other.pt`` over it). Its mapped pages are the file's, so
    the tensors copied out of it were read from the other file's bytes, at the first one's offsets (an --eval-only
    reported NaN scores, exit 0; a resume died of an "Invalid mt19937 state" traceback). A file replaced by a rename
    (an atomic write) or deleted is not: the mapping holds the file it mapped, whole. One truncated while its pages
    were read (`reading`) is named as such first."""
    raise_if_truncated(stamps)
    for path, stamp in stamps.items():
        now = file_stamps([path]).get(path)
        if now is not None and now[:2] == stamp[:2] and now != stamp:
            raise ConfigError(f"{path}: written while it was read (in place: cp over it?), its tensors taken from two "
                              "files' bytes; read it again once it is complete")


def cpu_storages(obj: Any) -> list[torch.UntypedStorage]:
    """The distinct CPU storages of the tensors in `obj` (nested dicts, lists and tuples), in the order met; views of
    one storage counted once.

    Example:
        >>> w = torch.zeros(4)
        >>> [s.nbytes() for s in cpu_storages({"w": w, "v": w[1:], "n": [torch.ones(2, dtype=torch.int64)], "x": 1})]
        [16, 16]
    """
    seen: dict[int, torch.UntypedStorage] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.device.type == "cpu":
                storage = o.untyped_storage()
                seen.setdefault(storage.data_ptr(), storage)
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return list(seen.values())


def read_ahead(obj: Any, name: str, least: int, available: Optional[int] = None) -> bool:
    """Read the bytes of `obj`'s tensors (memory-mapped: `load_mapped`) into the page cache, with a progress bar
    ("reading `name`"), where they come to at least `least` bytes and at most `READ_AHEAD_SHARE` of `available` (the
    host's MemAvailable; default: read now); where they come to more, one line says they are read as they load.
    Returns whether it reads them: now, or within `reading` on a thread of its own that the innermost `reading`
    waits for at its end (the caller's own reads of the pages meanwhile: `ReadAheads`).

    Example:
        >>> read_ahead({"w": torch.zeros(4)}, "step-1.pt", least=1 << 30)  # 16 bytes: read where used
        False
    """
    storages = cpu_storages(obj)
    total = sum(s.nbytes() for s in storages)
    if total < least:
        return False
    available = mem_available() if available is None else available
    if available is None or total > READ_AHEAD_SHARE * available:
        room = "unknown" if available is None else f"{available / 1e9:,.1f} GB"
        run_logger.info(f"reading {name}: its {total / 1e9:,.1f} GB are read as the model loads them (no progress "
                        f"bar: more than half of the host's available memory, {room}, is not read ahead)")
        return False
    if _read_aheads:
        _read_aheads[-1].start(storages, total, name)
    else:
        _read_storages(storages, total, name, threading.Event())
    return True


def _read_storages(storages: list, total: int, name: str, stop: threading.Event, in_thread: bool = False) -> None:
    """`read_ahead`'s reads, with their bar, until done or `stop` is set (`in_thread`: on a `ReadAheads` thread)."""
    buffer = torch.empty(min(CHUNK_BYTES, total), dtype=torch.uint8)
    with ProgressBar(total=total, desc=f"reading {name}", unit="B", unit_scale=True, dynamic_ncols=True,
                     **bar_interval()) as bar:
        for storage in storages:
            # the storage's bytes as a tensor, copied chunk by chunk into one small buffer: the copy faults the pages
            # in (the kernel's readahead: the disk's sequential rate) and touches no memory of this process's own
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            for start in range(0, flat.numel(), CHUNK_BYTES):
                if stop.is_set():
                    return
                n = min(CHUNK_BYTES, flat.numel() - start)
                if in_thread:  # one memcpy (ctypes releases the GIL): torch's copy_ on a new thread starts an OpenMP
                    # team of its own (libgomp's pool is per calling thread, measured: a thread a core, each with its
                    # stack and malloc arena of address space, which a `ulimit -v` run's allowance does not hold)
                    ctypes.memmove(buffer.data_ptr(), flat.data_ptr() + start, n)
                else:
                    buffer[:n].copy_(flat[start:start + n])
                bar.update(n)


class ReadAheads:
    """The read-aheads started within one `reading`, each on a daemon thread after the one before: the caller's work
    goes on meanwhile (where it copies a page first, the reader finds it in the page cache). `wait` joins them
    (`stop`: at their next chunk, the phase having failed); the pages they fault in stay the truncation handler's
    within `reading`. A reader's own failure ends only its reads: the caller's copy reads the pages itself and meets
    the same file."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()

    def start(self, storages: list, total: int, name: str) -> None:
        before = self.threads[-1] if self.threads else None

        def run() -> None:
            if before is not None:  # one at a time (a merge maps several shards): one bar, the disk read in order
                before.join()
            try:
                _read_storages(storages, total, name, self.stop, in_thread=True)
            except Exception as e:  # noqa: BLE001 - (see the class docstring) said, not raised in a thread
                run_logger.debug(f"reading {name} ahead stopped: {e}")

        thread = threading.Thread(target=run, name=f"read-ahead {name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def wait(self, stop: bool = False) -> None:
        if stop:
            self.stop.set()
        for thread in self.threads:
            thread.join()


_read_aheads: list[ReadAheads] = []  # one for each open `reading`, innermost last


def own_copies(holders: Iterable[Any], loaded: Any) -> int:
    """Give each CPU tensor kept in `holders` (optimizers, LR schedulers, after their ``load_state_dict``) that views a
    storage of `loaded` (a checkpoint read by `load_mapped`) memory of its own (a clone, put where it was); returns
    how many. Their ``state`` (an optimizer's: per parameter, a dict of tensors), ``param_groups`` and attributes are
    searched two containers deep (a scheduler's ``base_lrs`` list, a group's ``lr``).

    Example:
        >>> mapped = {"sum": torch.zeros(3)}
        >>> opt = torch.optim.Adagrad([torch.nn.Parameter(torch.ones(3))])
        >>> opt.state[opt.param_groups[0]["params"][0]] = {"sum": mapped["sum"]}
        >>> own_copies([opt], mapped), next(iter(opt.state.values()))["sum"] is mapped["sum"]
        (1, False)
    """
    mapped = {s.data_ptr() for s in cpu_storages(loaded)}
    count = 0

    def owned(value: Any) -> Any:
        nonlocal count
        if (isinstance(value, torch.Tensor) and value.device.type == "cpu"
                and value.untyped_storage().data_ptr() in mapped):
            count += 1
            return value.clone()
        return value

    def each(container: Any, depth: int) -> None:
        items: Iterable[tuple[Any, Any]]
        if isinstance(container, dict):
            items = list(container.items())
        elif isinstance(container, list):
            items = list(enumerate(container))
        else:
            return
        for key, value in items:
            new = owned(value)
            if new is not value:
                container[key] = new
            elif depth > 0:
                each(value, depth - 1)

    for holder in holders:
        parts: list[Callable[[], Any]] = [lambda h=holder: getattr(h, "state", None),
                                          lambda h=holder: getattr(h, "param_groups", None),
                                          lambda h=holder: vars(h) if hasattr(h, "__dict__") else None]
        for part in parts:
            each(part(), 2)
    return count


# --- a file truncated while it is mapped --------------------------------------------------------------------------
# Reading a mapped page past a file's end (another program truncated it: `truncate -s 1M f.pt`, `cp small.pt f.pt`)
# raises SIGBUS, whose default action killed the process ("Bus error (core dumped)", or nothing, and a merge's
# temporary OUT left behind). Python's own handler cannot help: it only sets a flag and returns, and the faulting load
# repeats forever. Within `reading`, a handler installed with sigaction (through ctypes) maps zero pages over the rest
# of the truncated file's mapping instead, notes the file and returns: the load repeats, reads zeros, and the phase
# ends in `reading`'s one-line ConfigError naming the file, the tensors read from it never used. The handler runs
# Python, which a signal handler should not: it acquires the GIL (the faulting thread holds it, or a torch copy
# released it) and allocates, safe here because the fault is a load from a file's pages inside a copy (no lock of the
# allocator or interpreter held), the only faults it takes. Any other SIGBUS gets the action it had before (the
# default's death, or faulthandler's traceback).

_SA_SIGINFO = 4
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x02, 0x10, 0x20


class _SigInfo(ctypes.Structure):  # (the head of Linux's siginfo_t on 64-bit x86 and Arm: the fault's address)
    _fields_ = [("si_signo", ctypes.c_int), ("si_errno", ctypes.c_int), ("si_code", ctypes.c_int),
                ("_pad", ctypes.c_int), ("si_addr", ctypes.c_void_p)]


class _SigAction(ctypes.Structure):  # (glibc's struct sigaction)
    _fields_ = [("sa_sigaction", ctypes.c_void_p), ("sa_mask", ctypes.c_ulong * 16), ("sa_flags", ctypes.c_int),
                ("sa_restorer", ctypes.c_void_p)]


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)
# inode -> the paths `reading` watches it as (its device is not compared: btrfs's stat and /proc/self/maps name two)
_watched: dict[int, list[str]] = {}
_truncated: set[str] = set()  # the watched paths whose pages past their end were read (zero pages mapped over them)
_filled: list[tuple[int, int]] = []  # the address ranges zero pages were mapped over
_previous = _SigAction()  # the action SIGBUS had before the handler's


def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.POINTER(_SigAction)]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _file_mapping(addr: int) -> Optional[tuple[int, int]]:
    """The end of the mapping of /proc/self/maps that holds `addr`, and its file's inode (0: anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= addr < end:
                return end, int(fields[4])
    return None


def _on_sigbus(signum: int, info: Any, context: Any) -> None:
    try:
        addr = info.contents.si_addr or 0
        found = _file_mapping(addr)
        if found is not None and found[1] == 0 and any(start <= addr < end for start, end in _filled):
            return  # another thread's fault on the pages just filled: its load repeats and reads them
        if found is not None and found[1] in _watched and _LIBC is not None:
            end, inode = found
            page = addr - addr % os.sysconf("SC_PAGE_SIZE")
            # every page from here to the mapping's end lies past the file's end, which only shrank
            got = _LIBC.mmap(page, end - page, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS,
                             -1, 0)
            if got == page:
                _filled.append((page, end))
                _truncated.update(_watched[inode])
                return
    except BaseException:  # noqa: BLE001 - (raised here, the load would repeat without end): the previous action
        pass
    if _LIBC is not None:
        _LIBC.sigaction(signal.SIGBUS, ctypes.byref(_previous), None)  # the load repeats under it


_HANDLER = _HANDLER_TYPE(_on_sigbus)  # (kept alive: the process's handler)


def _install() -> bool:
    """Make `_on_sigbus` SIGBUS's handler, unless it is; returns whether it is."""
    if _LIBC is None:
        return False
    current = _SigAction()
    if _LIBC.sigaction(signal.SIGBUS, None, ctypes.byref(current)) != 0:
        return False
    ours = ctypes.cast(_HANDLER, ctypes.c_void_p).value
    if current.sa_sigaction == ours:
        return True
    action = _SigAction()
    action.sa_sigaction = ours
    action.sa_flags = _SA_SIGINFO
    if _LIBC.sigaction(signal.SIGBUS, ctypes.byref(action), None) != 0:
        return False
    ctypes.memmove(ctypes.byref(_previous), ctypes.byref(current), ctypes.sizeof(current))
    return True


def raise_if_truncated(paths: Iterable[Any]) -> None:
    """A one-line ConfigError naming the first of `paths` whose mapped pages past its end were read within `reading`
    (truncated, or written in place by a shorter file, by another program)."""
    for path in paths:
        if str(path) in _truncated:
            raise ConfigError(f"{path}: changed while it was read (truncated, or replaced in place by a shorter file: "
                              "cp or truncate over it?); its tensors past the new end were not read; read it again "
                              "once it is complete")


@contextmanager
def reading(paths: Iterable[Any]) -> Iterator[dict[str, tuple[int, int, int, int]]]:
    """Read the files of `paths` memory-mapped within: yields their `file_stamps` (for `check_unchanged`), and waits
    at its end for the `read_ahead` threads started within (`ReadAheads`); one truncated meanwhile, its pages past the
    end then read, is a one-line ConfigError (`raise_if_truncated`) at the end, or in place of the error the zeros
    read there caused, where it was SIGBUS's death. A failure of the phase while a file was changed (a write from its
    mapped pages past the end: EFAULT) is `check_unchanged`'s line."""
    stamps = file_stamps(paths)
    keys = []
    if _install():
        for path, (_, ino, _, _) in stamps.items():
            _watched.setdefault(ino, []).append(path)
            keys.append((ino, path))
    read_aheads = ReadAheads()
    _read_aheads.append(read_aheads)
    try:
        try:
            yield stamps
        except Exception:
            read_aheads.wait(stop=True)
            check_unchanged(stamps)  # (the change's line in place of the error it caused)
            raise
        read_aheads.wait()  # (its reads done before the truncation check and the handler's watch end)
        raise_if_truncated(stamps)
    finally:
        try:
            read_aheads.wait(stop=True)  # (a second Ctrl-C may end the join: the watch ends anyway)
        finally:
            _read_aheads.remove(read_aheads)
            for ino, path in keys:
                _watched[ino].remove(path)
                if not _watched[ino]:
                    del _watched[ino]
                _truncated.discard(path)
