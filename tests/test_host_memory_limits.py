"""The CPU host-memory check before the build (`dlrm.train.builder.refuse_host_memory_shortfall`, exit 4; its first
tests: tests/test_host_memory_tables.py), three gaps found on 2026-12-04:

(1) Swap was ignored and there was no way past the refusal: a model that fits only with swap is refused (a run whose
    tables are swapped crawls), naming ``train.allow_swap``, which lets it go on (counting the free swap, said so).
(2) A torchrun run on the CPU (gloo) was not checked at all: the ranks of one host, each holding its shard of the
    tables and a replica of the dense layers with DDP's buckets and the optimizer's state, share its memory. Now the
    ranks weigh the host's total and every rank exits 4 with one line, nothing written.
(3) The limits read were wrong: only the process's own cgroup (a Slurm job's or a systemd slice's limit sits on an
    ancestor), its page cache counted as used (a dataset just read is reclaimed before anything is killed), a cgroup
    v1 mount of a container (Docker) looked for below itself, and `ulimit -d` not read.

The memory is faked (`builder._host_memory`, or the files under /proc/self and /sys/fs/cgroup read from a tree under
tmp_path); no test allocates the tables."""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import re
import resource
import socket
import subprocess
import sys

import pytest
import torch

import dlrm.train.builder as builder
from dlrm.config import Config, ConfigError, ModelConfig, load_config, validate
from dlrm.distributed.env import DistEnv
from dlrm.train.host_memory import HostMemory
from dlrm.train.resume_policy import check_resume_config
from dlrm.train.setup import Tables
from tests.conftest import CHILD_ENV, REPO, make_dataset
from tests.test_audit_killfuzz import CONFIG
from tests.test_audit_ranklog import launch_two_ranks
from tests.test_cli_errors import error_line, invoke

GiB, MiB = 2**30, 2**20


@pytest.fixture(autouse=True)
def _restore_logging():
    from dlrm.logging_setup import configure_logging

    yield
    configure_logging()


def _cfg(allow_swap: bool = False):
    cfg = validate(Config())
    cfg.model.embedding_dim, cfg.model.embedding_dtype = 16, "fp32"
    cfg.train.allow_swap = allow_swap
    return cfg


TABLES = Tables([10**6] * 26, None, "modulus")  # 26M rows x 16 fp32 with row-wise Adagrad: 1.6 GiB


def _refusal(cfg, memory: HostMemory, env: DistEnv = DistEnv(), plan=None) -> str:
    with pytest.raises(MemoryError) as raised:
        builder.refuse_host_memory_shortfall(cfg, TABLES, memory, env, plan)
    return str(raised.value)


# ------------------------------------------------------------------------------------------------------------------
# (1) swap, and the override


def test_a_model_that_fits_only_with_swap_is_refused_naming_the_key_and_trains_with_it(tmp_path, monkeypatch):
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, cardinality=5000)  # 2.5 MiB of tables
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=MiB, swap_free=8 * GiB))
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 20}, "model": CONFIG["model"],
           "train": {"device": "cpu", "max_steps": 2, "baseline": False}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    line = error_line(invoke(tmp_path, tmp_path / "c.json", "--run-name", "r"), 4,
                      "more than the 1.0 MiB the host has available (MemAvailable)",
                      "or set train.allow_swap true to go on with ", "of 8.0 GiB free; a run that swaps is slow)")
    assert not (tmp_path / "tb").exists(), line  # nothing written
    cfg["train"]["allow_swap"] = True
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    result = invoke(tmp_path, tmp_path / "c.json", "--run-name", "r")
    assert result.exit_code == 0, result.output
    assert "of it will be in swap (train.allow_swap true), and training will be slow" in result.stderr
    assert (tmp_path / "tb" / "r" / "summary.json").is_file()


def test_beyond_memory_and_swap_it_is_refused_either_way_and_the_line_says_swap_was_counted():
    memory = HostMemory(available=GiB, swap_free=GiB // 4)
    allowed = _refusal(_cfg(allow_swap=True), memory)
    assert "more than the 1.2 GiB the host has available with its free swap (MemAvailable + SwapFree, counted " \
           "under train.allow_swap): its embedding tables" in allowed, allowed
    assert allowed.endswith(": cap the tables with data.max_rows_per_table"), allowed
    refused = _refusal(_cfg(), memory)
    assert "more than the 1.0 GiB the host has available (MemAvailable)" in refused, refused
    assert refused.endswith("(with train.allow_swap true the 256.0 MiB of free swap would not hold the other "
                            "662.5 MiB either)"), refused
    assert _refusal(_cfg(), HostMemory(available=GiB)).endswith(
        "(there is no free swap for train.allow_swap to count)")


def test_swap_lifts_no_rlimit_and_a_cgroups_swap_limit_bounds_the_swap():
    """`ulimit -v` counts swapped pages too; a cgroup's memory.swap.max is the swap its processes may use."""
    text = _refusal(_cfg(allow_swap=True), HostMemory(available=64 * GiB, swap_free=64 * GiB, process=GiB))
    assert "more than the 1.0 GiB this process may take (ulimit -v, ulimit -d)" in text, text
    memory = HostMemory(available=64 * GiB, swap_free=64 * GiB, cgroup=GiB, cgroup_swap=GiB // 4)
    assert memory.swap() == GiB // 4
    assert "more than the 1.2 GiB the cgroup's memory and swap limits leave" in _refusal(_cfg(allow_swap=True), memory)
    builder.refuse_host_memory_shortfall(_cfg(allow_swap=True), TABLES, HostMemory(available=GiB, swap_free=GiB))


def test_allow_swap_is_validated_free_on_resume_and_inert_on_cuda(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.allow_swap: expected true or false, got 'yes'"):
        load_config(_write(tmp_path, {"train": {"allow_swap": "yes"}}))
    with pytest.raises(ConfigError, match=r'train\.allow_swap: true has no effect: it acts with train\.device "auto" '
                                          r'or "cpu" only'):
        load_config(_write(tmp_path, {"train": {"allow_swap": True, "device": "cuda"}}), {}, "refuse")
    saved = validate(Config()).to_dict()
    current = json.loads(json.dumps(saved))
    current["train"]["allow_swap"] = True  # the session's own, as train.device is
    check_resume_config(saved, current, [], "step-00000005.pt")


def _write(tmp_path, raw: dict) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return str(path)


# ------------------------------------------------------------------------------------------------------------------
# (2) torchrun on the CPU: the ranks of one host together

# each rank's host memory faked as AVAILABLE bytes (the same on both: one host), then train.py's main
FAKED = """
import sys
import dlrm.train.builder as builder
from dlrm.train.host_memory import HostMemory
builder._host_memory = lambda: HostMemory(available=AVAILABLE)
from dlrm.cli import main
main(sys.argv[1:])
"""


def _one_process_need(model: ModelConfig, rows: int, copies: int) -> tuple[int, int]:
    """(the tables' bytes: fp32 rows of 4 with one row-wise Adagrad sum, the dense layers' x `copies`)."""
    return rows * (4 * 4 + 4), 4 * sum(builder.dense_layer_parameters(model, 26).values()) * copies


def test_two_cpu_ranks_that_fit_the_host_one_by_one_but_not_together_are_refused_alike(tmp_path):
    """The host has exactly what one process of the model needs: each rank's share is less, but the two ranks hold
    the dense layers twice (with DDP's buckets, a copy more than one process): every rank exits 4, one line (rank
    0's), no run directory."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, cardinality=5000)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(tmp_path / "ds")
    model = ModelConfig(**{**ModelConfig().__dict__, **CONFIG["model"]})
    tables, dense = _one_process_need(model, 26 * 5000, 4)  # Adam: parameters, gradients, two moments
    builder.refuse_host_memory_shortfall(validate(Config(model=model)), Tables([5000] * 26, None, "modulus"),
                                         HostMemory(available=tables + dense))  # one process fits
    codes, text = launch_two_ranks(tmp_path, cfg, script=FAKED.replace("AVAILABLE)", f"{tables + dense})"))
    assert codes == [4, 4], text[-3000:]
    errors = [line for line in text.splitlines() if "ERROR" in line]
    need = tables + 2 * dense // 4 * 5  # each rank: its rows (row-wise: half of every table), the dense layers x 5
    assert len(errors) == 1 and not errors[0].startswith("[rank"), text[-3000:]
    assert errors[0].endswith(
        f"ERROR   the 2 ranks on host {socket.gethostname()} need {need / MiB:,.1f} MiB of host memory with their "
        f"optimizers' state, more than the {(tables + dense) / MiB:,.1f} MiB the host has available (MemAvailable): "
        f"each rank holds its shard of the embedding tables (the largest {tables / 2 / MiB:,.1f} MiB with the sparse "
        f"optimizer's state) and the dense layers ({dense // 4 * 5 / MiB:,.1f} MiB with their "
        "gradients, DDP's buckets and the dense optimizer's state): cap the tables with data.max_rows_per_table, or "
        "spread the ranks over more hosts (there is no free swap for train.allow_swap to count)"), errors
    assert not (tmp_path / "tb").exists()


# rank 0 slow to say its line (its report takes 3 s): rank 1, which says nothing, must not exit before it
SLOW_RANK_0 = FAKED.replace("from dlrm.cli import main", """import os, time
import dlrm.cli as cli
if os.environ["RANK"] == "0":
    real = cli.out_of_memory_message
    cli.out_of_memory_message = lambda *a: (time.sleep(3), real(*a))[1]
from dlrm.cli import main""")


def test_under_torchrun_rank_0_says_the_refusal_before_the_other_ranks_exit(tmp_path):
    """torchrun's agent stops the remaining ranks as soon as one exits: rank 1 (which leaves the line to rank 0)
    exited at once, and rank 0 was stopped by SIGTERM before its line was out: no word, exit -15."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, cardinality=5000)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    (tmp_path / "slow.py").write_text(SLOW_RANK_0.replace("AVAILABLE)", f"{2**20})"))
    # (--standalone: torchrun binds its rendezvous store to a port of its own choosing; tests/_ports.py)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(tmp_path / "slow.py"), "--config", str(tmp_path / "c.json"),
                        "--run-name", "r", "--tb-dir", str(tmp_path / "tb")], cwd=REPO, capture_output=True,
                       text=True, env={**CHILD_ENV, "TRITON_INTERPRET": "1"}, timeout=150)
    errors = [line for line in p.stderr.splitlines() if " ERROR " in line and "the 2 ranks on host" in line]
    assert len(errors) == 1 and not errors[0].startswith("[rank"), p.stderr[-3000:]
    # torchrun's summary: rank 0 ended with its own exit 4, not the agent's SIGTERM (rank 1 may take either)
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: 4 ", p.stderr), p.stderr[-3000:]
    assert not (tmp_path / "tb").exists()


class _Gathered(DistEnv):
    """Rank `rank` of a run whose all_gather_object returns the ranks' entries given (hosts faked): (host key, host
    name, tables' bytes, HostMemory, bytes of the checkpoint its resume maps)."""

    def __init__(self, rank: int, world_size: int, entries: list):
        super().__init__(rank, world_size, rank)
        object.__setattr__(self, "_entries", entries)

    def all_gather_object(self, obj):
        assert obj[2:] == self._entries[self.rank][2:], (obj, self._entries[self.rank])  # its own share and memory
        return list(self._entries)


def test_the_ranks_are_weighed_by_host_and_every_rank_reaches_the_same_verdict():
    """Two hosts of two ranks: the host whose two ranks do not fit is named, on every rank alike; a rank's own
    rlimit is weighed against its own share alone."""
    from dlrm.distributed.sharding import plan_sharding

    cfg = _cfg()
    plan = plan_sharding(TABLES.cardinalities, 4, "row", 10)
    share = plan.local_rows(0) * (16 * 4 + 4)  # a quarter of the rows, D 16, with their row-wise Adagrad sums
    roomy, tight = HostMemory(available=8 * GiB), HostMemory(available=share + share // 2)
    entries = [("a", "alpha", share, roomy, 0), ("a", "alpha", share, roomy, 0), ("b", "beta", share, tight, 0),
               ("b", "beta", share, tight, 0)]
    texts = set()
    for rank in range(4):
        own = entries[rank][3]
        with pytest.raises(MemoryError) as raised:
            builder.refuse_host_memory_shortfall(cfg, TABLES, own, _Gathered(rank, 4, entries), plan)
        assert getattr(raised.value, "found_alike", False) and raised.value.dlrm_refused
        texts.add(str(raised.value))
    assert len(texts) == 1 and next(iter(texts)).startswith("the 2 ranks on host beta need "), texts
    entries[3] = ("b", "beta", share, HostMemory(available=8 * GiB, process=share // 2), 0)
    text = _refusal(cfg, entries[0][3], _Gathered(0, 4, entries), plan)
    assert text.startswith("rank 3 on host beta needs "), text
    assert f"more than the {share // 2 / MiB:,.1f} MiB it may take (ulimit -v, ulimit -d)" in text, text
    entries[2] = entries[3] = ("b", "beta", share, roomy, 0)
    builder.refuse_host_memory_shortfall(cfg, TABLES, roomy, _Gathered(1, 4, entries), plan)  # every host fits


# ------------------------------------------------------------------------------------------------------------------
# (3) the limits read: cgroup v2 and v1 at every level, the page cache, ulimit -d

_MOVED = ("/proc/self/cgroup", "/proc/self/mountinfo", "/sys/fs/cgroup")


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """/proc/self/cgroup, /proc/self/mountinfo and everything under /sys/fs/cgroup read from under `tmp_path`, and no
    rlimit set: `builder._process_room()` is then what the fake cgroup files leave."""
    real_open, real_read = builtins.open, pathlib.Path.read_text

    def moved(file):
        path = os.fspath(file) if isinstance(file, (str, os.PathLike)) else None
        if path is not None and any(path == p or path.startswith(p + "/") for p in _MOVED):
            return tmp_path / path.lstrip("/")
        return file

    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: real_open(moved(file), *a, **k))
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: real_read(moved(self), *a, **k))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return tmp_path


def _files(root: pathlib.Path, directory: str, **files) -> None:
    d = root / directory.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(f"{text}\n")


V2_MOUNT = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"


def test_a_cgroup_v2_limit_on_an_ancestor_binds(fake_proc):
    """A Slurm job: the limit is the job's (memory.max of job_7), the process sits in a task cgroup below it."""
    leaf = "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
    _files(fake_proc, "/proc/self", cgroup=f"0::{leaf}", mountinfo=V2_MOUNT)
    _files(fake_proc, f"/sys/fs/cgroup{leaf}", memory__max="max", memory__current=2 * MiB, memory__stat="anon 0")
    _files(fake_proc, "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_7", memory__max=4 * GiB,
           memory__current=GiB, memory__stat="anon 1073741824\ninactive_file 0")
    assert builder._process_room() == 3 * GiB


def test_a_cgroups_reclaimable_page_cache_is_counted_free(fake_proc):
    """3 GiB used of 4, 2 GiB of it the inactive page cache of a dataset just read: 3 GiB left, not 1."""
    _files(fake_proc, "/proc/self", cgroup="0::/job", mountinfo=V2_MOUNT)
    _files(fake_proc, "/sys/fs/cgroup/job", memory__max=4 * GiB, memory__current=3 * GiB,
           memory__stat=f"anon {GiB}\nfile {2 * GiB}\nactive_file 0\ninactive_file {2 * GiB}")
    assert builder._process_room() == 3 * GiB


def test_a_containers_cgroup_v1_mount_is_read_where_it_is_mounted(fake_proc):
    """Docker under cgroup v1: /proc/self/cgroup names the host's path (/docker/ID), the container mounts that
    cgroup itself at /sys/fs/cgroup/memory (mountinfo's root field: /docker/ID)."""
    _files(fake_proc, "/proc/self", cgroup="12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n0::/",
           mountinfo="40 31 0:37 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n")
    _files(fake_proc, "/sys/fs/cgroup/memory", memory__limit_in_bytes=2 * GiB, memory__usage_in_bytes=512 * MiB,
           memory__stat="cache 0\ntotal_inactive_file 0")
    assert builder._process_room() == 1536 * MiB


def test_a_cgroup_v2_swap_limit_is_read(fake_proc):
    from dlrm.train.host_memory import cgroup_rooms

    _files(fake_proc, "/proc/self", cgroup="0::/job", mountinfo=V2_MOUNT)
    _files(fake_proc, "/sys/fs/cgroup/job", memory__max=4 * GiB, memory__current=GiB, memory__stat="inactive_file 0",
           memory__swap__max=GiB, memory__swap__current=256 * MiB)
    assert cgroup_rooms() == (3 * GiB, 768 * MiB)


def test_the_process_room_reads_the_data_segment_limit():
    """`ulimit -d` counts private anonymous mappings (the tables') since Linux 4.7."""
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_DATA); "
            "resource.setrlimit(resource.RLIMIT_DATA, (16 * 2**30, hard)); "
            "import dlrm.train.builder as b; print(b._process_room())")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "None" and 0 < int(r.stdout.strip()) < 16 * 2**30, r.stdout


def test_the_cuda_path_reads_no_host_memory(monkeypatch):
    """The check is the CPU's: a build on CUDA never reads it (its tables are the GPU's; the allocation fails at
    once there, `tables_named_if_out_of_memory`)."""
    def read():
        raise AssertionError("host memory read for a CUDA build")

    monkeypatch.setattr(builder, "_host_memory", read)
    monkeypatch.setattr(builder, "make_sharding", lambda *a: (_ for _ in ()).throw(RuntimeError("past the check")))
    monkeypatch.setattr(builder, "refuse_dense_layers_beyond_memory", lambda *a: None)
    monkeypatch.setattr(builder, "resolve_fast_path", lambda cfg, *a: (cfg, {}))
    with pytest.raises(RuntimeError, match="past the check"):
        builder.build_run(_cfg(), TABLES, torch.device("cuda"), total_steps=10)
