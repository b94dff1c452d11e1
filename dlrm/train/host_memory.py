"""The host memory a CPU run may take, read before its model is built (`dlrm.train.builder` weighs the model against
it: `refuse_host_memory_shortfall`).

Three sources, each read where it is set: the host's MemAvailable and free swap (/proc/meminfo); the memory cgroup's
limit, at every level from this process's cgroup up to its mount's root (a Slurm job's or a systemd slice's limit sits
on an ancestor: the process's own cgroup has none), found through /proc/self/mountinfo (a container whose cgroup
mount starts below the hierarchy's root, as Docker's under cgroup v1, has its cgroup at the mount point, not under it),
cgroup v2 (memory.max, memory.high, memory.swap.max) and v1 (memory.limit_in_bytes, memory.memsw.limit_in_bytes);
and this
process's own rlimits (`ulimit -v`, `ulimit -d`). A cgroup's usage counts the page cache of the files its processes
read (a dataset read before the build: gigabytes), which the kernel reclaims before it kills anything: its inactive
file pages are counted free, as MemAvailable counts the host's and as the kubelet's working set leaves them out.
v2's memory.high counts as a limit where it is below memory.max: above it the kernel throttles the cgroup's allocations
and reclaims its pages (without swap, anonymous pages cannot go: the run crawls and is never killed), so a model larger
than memory.high is refused as one larger than memory.max is.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class HostMemory:
    """What a CPU build may take (bytes; None: no such limit, or not known).

    Args:
        available: the host's MemAvailable.
        swap_free: the host's SwapFree (0: no swap).
        cgroup: what the memory limits of this process's cgroup and its ancestors leave, the least of them.
        cgroup_swap: the swap those cgroups may still use beyond `cgroup`; None: no swap limit of theirs.
        process: what this process's own rlimits leave (RLIMIT_AS less its address space, RLIMIT_DATA less its data).
        cgroup_limit: the limit file that leaves `cgroup`, its value and the usage (`cgroup_limits`); "": not known.
        reserved: of `process`, what a run maps after the check under ``ulimit -v`` (`later_address_space`); 0: none.
    """

    available: Optional[int] = None
    swap_free: int = 0
    cgroup: Optional[int] = None
    cgroup_swap: Optional[int] = None
    process: Optional[int] = None
    cgroup_limit: str = ""
    reserved: int = 0

    def shared(self, with_swap: bool = False) -> tuple[Optional[int], str]:
        """The memory every process on this host (of this cgroup) draws from, and where that number comes from as a
        refusal says it; with_swap: free swap counted too (within the cgroup's swap limit), as train.allow_swap
        counts it."""
        swap = self.swap()
        rooms = []
        if self.available is not None:
            rooms.append((self.available + (swap if with_swap else 0),
                          "the host has available with its free swap (MemAvailable + SwapFree, counted under "
                          "train.allow_swap)" if with_swap
                          else "the host has available (MemAvailable)"))
        if self.cgroup is not None:
            if self.cgroup_limit:  # the file that binds, which a user can read and raise (memory.high or memory.max)
                text = (f"the cgroup's memory and swap limits leave ({self.cgroup_limit}; with its free swap, counted "
                        "under train.allow_swap)" if with_swap
                        else f"the cgroup's memory limit leaves ({self.cgroup_limit})")
            else:
                text = ("the cgroup's memory and swap limits leave (memory.max and memory.swap.max, or v1's "
                        "limit_in_bytes and memsw.limit_in_bytes, counted under train.allow_swap)" if with_swap else
                        "the cgroup's memory limit leaves (memory.max, or v1's memory.limit_in_bytes)")
            rooms.append((self.cgroup + (swap if with_swap else 0), text))
        if not rooms:
            return None, ""
        return min(rooms, key=lambda r: r[0])

    def swap(self) -> int:
        """The swap this process's cgroup may still use (0: none)."""
        return max(0, self.swap_free if self.cgroup_swap is None else min(self.swap_free, self.cgroup_swap))


def read_host_memory() -> HostMemory:
    """The host's memory, its cgroups' limits and this process's rlimits, read now (`HostMemory`)."""
    meminfo = _meminfo()
    cgroup, cgroup_swap, limit = cgroup_limits()
    limited = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    return HostMemory(meminfo.get("MemAvailable"), meminfo.get("SwapFree", 0), cgroup, cgroup_swap, rlimit_room(),
                      limit, later_address_space() if limited else 0)


def host_key() -> str:
    """What the processes sharing this host's memory have alike: the running kernel's boot id (containers on one host
    share it; two hosts' host names may not differ), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def mem_available() -> Optional[int]:
    """The host's MemAvailable (bytes); None where /proc/meminfo does not say it."""
    return _meminfo().get("MemAvailable")


def _meminfo() -> dict[str, int]:
    """/proc/meminfo's kB fields (KiB) in bytes; empty where it cannot be read."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (0 where it is not there)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rlimit_room() -> Optional[int]:
    """What this process's rlimits leave (bytes), None where none is set: RLIMIT_AS (`ulimit -v`) less the address
    space it maps, RLIMIT_DATA (`ulimit -d`, which counts private anonymous mappings, the tables' too, since Linux
    4.7) less its data segment. Swap does not lift either."""
    rooms = []
    for limit, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            rooms.append(soft - status_kib(field) * 1024)
    return max(0, min(rooms)) if rooms else None


# What a CPU run maps after its memory check (`dlrm.train.builder.refuse_host_memory_shortfall`), which counted only
# the model against `ulimit -v`: under a limit between the two the run died later, of libgomp's "Thread creation
# failed" (exit 1, from C: nothing to catch), a segfault, or an error blaming the data. Measured with
# benchmarks/address_space_margin.py on configs/sample.json on a 2-core machine (2026-12-05): 2,135 MiB mapped at the
# check, then 973-1,053 MiB more over 10-11 threads (one the measuring thread's) with 2 torch threads, 1,276 MiB over
# 15 with OMP_NUM_THREADS=6: each thread its stack and a glibc malloc arena (64 MiB of address space), the rest
# buffers (~320 MiB). The threads: torch's (OpenMP), pyarrow's CPU pool (one a core) and 6 more (loader, readers,
# TensorBoard's writer, the progress bar's monitor); not measured on more cores.
ARENA_BYTES = 64 << 20
LATER_BUFFER_BYTES = 320 << 20


def later_address_space(torch_threads: Optional[int] = None, cores: Optional[int] = None) -> int:
    """The address space a CPU run maps after its memory check beside the model (bytes): its threads' stacks
    (RLIMIT_STACK, 8 MiB where unlimited) and malloc arenas (at most glibc's 8 a core), and buffers.

    Example:
        >>> later_address_space(torch_threads=2, cores=2) >> 20  # 10 threads: 8 + 64 MiB each, 320 MiB of buffers
        1040
    """
    cores = cores or os.cpu_count() or 1
    if torch_threads is None:
        torch = sys.modules.get("torch")
        torch_threads = torch.get_num_threads() if torch is not None else cores
    threads = 6 + torch_threads + cores
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = stack if stack != resource.RLIM_INFINITY and stack > 0 else 8 << 20
    return threads * stack + min(threads, 8 * cores) * ARENA_BYTES + LATER_BUFFER_BYTES


# a limit at or above this is "no limit" (cgroup v1 writes PAGE_COUNTER_MAX pages, 2**63 rounded down to a page)
_NO_LIMIT = 2**62


def cgroup_rooms(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") \
        -> tuple[Optional[int], Optional[int]]:
    """(memory, swap) of `cgroup_limits`."""
    return cgroup_limits(proc_cgroup, mountinfo)[:2]


def cgroup_limits(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") \
        -> tuple[Optional[int], Optional[int], str]:
    """(memory, swap, limit) that the memory limits of this process's cgroup and of every ancestor up to the mount's
    root leave, the least at any level (None: no limit found): v2's memory.max, or memory.high where lower, less
    memory.current, v1's memory.limit_in_bytes less memory.usage_in_bytes, each with its inactive file pages counted
    free; swap: v2's memory.swap.max less memory.swap.current, v1's memory.memsw.limit_in_bytes (memory and swap) less
    its usage, less the memory left; limit: the file that leaves the memory, its value and the usage, as a refusal
    says them. A file that cannot be read is no limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
        mounts = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None, None, ""
    memory = swap = None
    limit = ""
    for line in lines:  # "0::/path" (cgroup v2), "4:memory:/path" (v1)
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for directory in _cgroup_dirs(mounts, v2, path):
            m, s, text = (_v2_rooms if v2 else _v1_rooms)(directory)
            if m is not None and (memory is None or m < memory):
                memory, limit = m, text
            swap = s if swap is None or (s is not None and s < swap) else swap
    return (None if memory is None else max(0, memory)), (None if swap is None else max(0, swap)), limit


def _cgroup_dirs(mounts: list[str], v2: bool, path: str) -> list[Path]:
    """The directories of cgroup `path` and its ancestors, up to the root of the mount of its hierarchy (v2's cgroup2,
    or v1's memory controller) that holds it: mountinfo's 4th field is the hierarchy's path at the mount point."""
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if (v2 and fstype != "cgroup2") or (not v2 and (fstype != "cgroup" or "memory" not in options)):
            continue
        root, point = fields[3], Path(fields[4])
        rel = os.path.relpath(path or "/", root)
        if rel == ".." or rel.startswith("../"):  # not below this mount's root (another container's mount)
            continue
        dirs, at = [], point / rel if rel != "." else point
        while True:
            dirs.append(at)
            if at == point:
                return dirs
            at = at.parent
    return []


def _read_int(path: Path) -> Optional[int]:
    """The number in `path` (None: "max", no file, or no number)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(directory: Path, key: str) -> int:
    """memory.stat's `key` (the inactive file pages, reclaimable) in `directory` (0: none, or not read)."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _limit_text(file: Path, limit: int, used: int) -> str:
    """What a refusal says of the limit that binds: the file, its value and the usage it is less."""
    return f"{file} {_size(limit)}, {_size(max(0, used))} of it in use"


def _v2_rooms(d: Path) -> tuple[Optional[int], Optional[int], str]:
    memory = swap = None
    text = ""
    hard, high, used = _read_int(d / "memory.max"), _read_int(d / "memory.high"), _read_int(d / "memory.current")
    hard = hard if hard is not None and hard < _NO_LIMIT else None
    high = high if high is not None and high < _NO_LIMIT else None
    if used is not None and (hard is not None or high is not None):
        used -= _inactive_file(d, "inactive_file")
        if high is not None and (hard is None or high < hard):  # throttled above it, before memory.max kills
            memory = high - used
            text = (_limit_text(d / "memory.high", high, used)
                    + (f", below memory.max {_size(hard)}" if hard is not None else ", memory.max none")
                    + ": above memory.high the kernel throttles the run and reclaims its memory, and it crawls")
        else:
            memory, text = hard - used, _limit_text(d / "memory.max", hard, used)
    limit, used = _read_int(d / "memory.swap.max"), _read_int(d / "memory.swap.current")
    if limit is not None and limit < _NO_LIMIT and used is not None:
        swap = limit - used
    return memory, swap, text


def _v1_rooms(d: Path) -> tuple[Optional[int], Optional[int], str]:
    memory = both = None
    text = both_text = ""
    cache = _inactive_file(d, "total_inactive_file")  # (v1's hierarchical count, as usage_in_bytes is)
    limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
    if limit is not None and limit < _NO_LIMIT and used is not None:
        memory, text = limit - (used - cache), _limit_text(d / "memory.limit_in_bytes", limit, used - cache)
    limit, used = _read_int(d / "memory.memsw.limit_in_bytes"), _read_int(d / "memory.memsw.usage_in_bytes")
    if limit is not None and limit < _NO_LIMIT and used is not None:
        both, both_text = limit - (used - cache), _limit_text(d / "memory.memsw.limit_in_bytes", limit, used - cache)
    if both is None:
        return memory, None, text
    if memory is None or both < memory:  # (memory counts against memsw too: no more than it leaves, none to swap)
        return both, 0, both_text
    return memory, both - memory, text
