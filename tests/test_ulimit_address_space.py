"""Under ``ulimit -v`` (RLIMIT_AS) a run failed in ways the memory checks did not see, measured with configs/sample.json
on a 2-core machine: 1.0 GB an import ("libtriton.so: failed to map segment from shared object": "a bug", exit 1),
1.5 GB "can't start new thread" (exit 1) or a segfault, 2.0-2.5 GB torch's "can't allocate memory" (exit 4, advising a
smaller batch), 2.75 GB pyarrow's "Failed to launch worker thread" (exit 2, the parquet file called unreadable), 3.0 GB
libgomp's "Thread creation failed" (exit 1, from C). The check before the build weighed the model alone against the
limit, not the ~1 GiB of threads' stacks, malloc arenas and buffers a run maps after it
(`dlrm.train.host_memory.later_address_space`): now counted, the run refused there in one line naming the limit (exit
4); a failure to map memory before it, under a limit, is one line naming the limit too
(`dlrm.errors.as_limit_failure`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dlrm import errors
from dlrm.errors import ConfigError, DatasetError, as_limit_failure
from tests.conftest import REPO

LIMITED = "ulimit -v 1.0 GiB (RLIMIT_AS)"

MEASURED = [  # (what failed, as it was raised under ulimit -v)
    ImportError("/site-packages/triton/_C/libtriton.so: failed to map segment from shared object"),
    RuntimeError("can't start new thread"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 37440000 bytes. Error code 12 (Cannot allocate memory)"),
    DatasetError("data/sample/train/part-00000.parquet: row group 0: cannot be read (Unknown error: Failed to launch "
                 "worker thread: Resource temporarily unavailable)"),
    MemoryError(),
]


@pytest.mark.parametrize("exc", MEASURED, ids=lambda e: type(e).__name__)
def test_a_failure_to_map_memory_under_a_limit_names_the_limit(monkeypatch, exc):
    monkeypatch.setattr(errors, "address_limits", lambda: LIMITED)
    got = as_limit_failure(exc)
    assert isinstance(got, MemoryError) and getattr(got, "dlrm_refused", False)  # exit 4, said as it is
    text = str(got)
    assert text.startswith(f"out of address space under this process's limit, {LIMITED} ({type(exc).__name__}")
    assert "raise it (ulimit -v unlimited" in text and "\n" not in text, text


def test_without_a_limit_or_for_other_errors_nothing_changes(monkeypatch):
    monkeypatch.setattr(errors, "address_limits", lambda: "")
    for exc in MEASURED:
        assert as_limit_failure(exc) is exc
    monkeypatch.setattr(errors, "address_limits", lambda: LIMITED)
    other = ConfigError("c.json: data.batch_size: must be positive")
    refused = MemoryError("the model needs 9 GiB, more than ... (ulimit -v, ulimit -d)")
    refused.dlrm_refused = True
    assert as_limit_failure(other) is other and as_limit_failure(refused) is refused


def test_the_limits_are_read_as_set():
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_AS); "
            "resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, hard)); "
            "from dlrm.errors import address_limits; print(address_limits())")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("ulimit -v 6.0 GiB (RLIMIT_AS)"), r.stdout
