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

import resource
import subprocess
import sys
import textwrap

import pytest

from dlrm import errors
from dlrm.errors import ConfigError, DatasetError, as_limit_failure
from dlrm.train import builder
from dlrm.train.host_memory import HostMemory, later_address_space
from tests.conftest import CHILD_ENV, REPO, make_dataset
from tests.prewarm import launch

MiB = 2**20
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


def test_what_a_run_maps_after_the_check_counts_its_threads():
    # 10 threads of their stacks (RLIMIT_STACK: 8 MiB here) and 64 MiB arenas, and the buffers: the measured 973-1,053
    # MiB (one thread of which was the measuring one's)
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = stack if stack != resource.RLIM_INFINITY and stack > 0 else 8 * MiB
    assert later_address_space(torch_threads=2, cores=2) == 10 * (stack + 64 * MiB) + 320 * MiB
    # more cores: more threads; glibc's arenas at most 8 a core
    assert later_address_space(torch_threads=1, cores=1) == 8 * stack + 8 * 64 * MiB + 320 * MiB


def test_a_model_that_fits_but_leaves_no_room_for_the_threads_is_refused_naming_the_limit(monkeypatch):
    from dlrm.train.setup import Tables
    from tests.test_host_memory_gaps import _cfg

    monkeypatch.setattr(builder, "address_limits", lambda: LIMITED)
    cfg = _cfg()
    tables = Tables([10] * 26, None, "modulus")
    fits = HostMemory(available=8 << 30, process=600 * MiB)  # (no reserve: as before, the model alone)
    builder.refuse_host_memory_shortfall(cfg, tables, fits)
    short = HostMemory(available=8 << 30, process=600 * MiB, reserved=1040 * MiB)
    with pytest.raises(MemoryError) as e:
        builder.refuse_host_memory_shortfall(cfg, tables, short)
    text = str(e.value)
    assert text.startswith(f"this process may map 600.0 MiB more under {LIMITED}, less than the ") and \
        "and the 1.0 GiB a run's threads (stacks, malloc arenas) and buffers map beside it: raise the limit " \
        "(ulimit -v unlimited, or " in text, text


def test_a_run_under_a_limit_it_cannot_run_in_says_so_in_one_line(tmp_path):
    """End to end: the limit set to what the process maps now and 256 MiB more (the run's threads take ~1 GiB):
    before, it died of whatever failed first (exit 1 "a bug", libgomp's exit 1, a segfault, exit 2 blaming the data)."""
    make_dataset(tmp_path / "ds", {"train": 400, "validation": 100}, cardinality=50)
    script = textwrap.dedent(f"""
        import resource, sys
        from dlrm import cli
        import torch, pyarrow.parquet  # (loaded first: the limit is left to the run, not to the imports)
        vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        sys.argv = ["train.py", "--data", {str(tmp_path / "ds")!r}, "--tb-dir", {str(tmp_path / "tb")!r},
                    "--config", {str(REPO / "configs" / "sample.json")!r}, "--max-steps", "3", "--device", "cpu"]
        cli.main()
    """)
    env = {**CHILD_ENV, "NO_COLOR": "1"}
    r = subprocess.run([launch.real_python(), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 4, (r.returncode, r.stderr[-3000:])
    errors_ = [line for line in r.stderr.splitlines() if "ERROR" in line]
    assert len(errors_) == 1 and "RLIMIT_AS" in errors_[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())  # no run directory left
