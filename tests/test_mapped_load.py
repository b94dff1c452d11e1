"""Checkpoints read memory-mapped (`dlrm.mapped_load`, `dlrm.checkpoint.load_checkpoint(mmap=True)`): the same values
as the plain read without a copy in the process's own memory; read ahead with a bar where they fit, said in one line
where not; what an optimizer keeps of them made its own; the plain read where a mapping cannot be made."""

from __future__ import annotations

import copy
import io
import os
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm import mapped_load as ml
from tests.test_audit_checkpoint_files import tiny_state

MiB = 1 << 20


def rss_anon() -> int:
    """This process's anonymous resident memory (its own pages, not the page cache's), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def big_checkpoint(tmp_path: Path, rows: int = 1 << 20) -> tuple[Path, dict]:
    """A valid checkpoint whose sparse optimizer's state takes `rows` x 4 bytes (16 MiB by default) beside the
    tiny model; the path and the state written."""
    state = tiny_state()
    state["optimizers"][1]["state"][0]["sum"] = torch.rand(rows)
    path = tmp_path / "step-00000003.pt"
    ckpt.write_atomic(path, state, progress=False)
    return path, state


def test_a_mapped_load_holds_the_same_values_as_the_plain_read(tmp_path):
    path, _ = big_checkpoint(tmp_path, rows=1000)
    plain, mapped = ckpt.load_checkpoint(path), ckpt.load_checkpoint(path, mmap=True, read="all")
    assert plain.keys() == mapped.keys()
    for key in ("model",):
        assert plain[key].keys() == mapped[key].keys()
        for name, value in plain[key].items():
            assert torch.equal(value, mapped[key][name]) and value.dtype == mapped[key][name].dtype, name
    assert torch.equal(plain["optimizers"][1]["state"][0]["sum"], mapped["optimizers"][1]["state"][0]["sum"])
    assert plain["position"] == mapped["position"] and plain["config"] == mapped["config"]
    # the file's pages, not copies: the process's maps name it while the tensors live
    with open("/proc/self/maps") as f:
        assert any(line.rstrip().endswith(str(path)) for line in f)


def test_a_mapped_load_takes_none_of_the_process_memory_the_plain_read_takes(tmp_path):
    path, _ = big_checkpoint(tmp_path, rows=64 * MiB // 4)  # (large: the allocator's reused pages are a few MiB)
    before = rss_anon()
    plain = ckpt.load_checkpoint(path)
    grown_plain = rss_anon() - before  # (measured, so that the mapped figure below is known to be meaningful)
    del plain
    before = rss_anon()
    mapped = ckpt.load_checkpoint(path, mmap=True)
    assert float(mapped["optimizers"][1]["state"][0]["sum"].sum()) > 0  # every page read
    grown_mapped = rss_anon() - before
    assert grown_plain >= 48 * MiB and grown_mapped < 8 * MiB, (grown_plain, grown_mapped)


def test_read_ahead_reads_with_a_bar_where_half_the_available_memory_holds_it(tmp_path, monkeypatch):
    path, _ = big_checkpoint(tmp_path, rows=3 * MiB // 4)
    state = ckpt.load_checkpoint(path, mmap=True)
    total = sum(s.nbytes() for s in ml.cpu_storages(state))
    bars, said = [], []
    real_bar = ml.ProgressBar

    def bar(**kwargs):
        made = real_bar(**{**kwargs, "file": io.StringIO()})
        bars.append(made)
        return made

    monkeypatch.setattr(ml, "ProgressBar", bar)
    monkeypatch.setattr(ml, "CHUNK_BYTES", MiB)  # several chunks per storage
    monkeypatch.setattr(ml.run_logger, "info", said.append)
    assert ml.read_ahead(state, path.name, least=MiB, available=2 * total)
    assert len(bars) == 1 and bars[0].n == bars[0].total == total and not said
    assert not ml.read_ahead(state, path.name, least=MiB, available=2 * total - 2)  # more than half: one line
    assert len(bars) == 1 and len(said) == 1, said
    assert said[0].startswith(f"reading {path.name}: its {total / 1e9:,.1f} GB are read as the model loads them")
    assert not ml.read_ahead(state, path.name, least=total + 1, available=2 * total) and len(said) == 1  # small
    monkeypatch.setattr(ml, "mem_available", lambda: None)  # (not Linux: nothing known, nothing read ahead)
    assert not ml.read_ahead(state, path.name, least=MiB) and len(said) == 2 and "memory, unknown, is" in said[1], said


def test_read_ahead_counts_a_storage_once_for_its_views():
    w = torch.arange(64, dtype=torch.float32)
    storages = ml.cpu_storages({"a": w, "b": w[8:], "c": [w.view(8, 8)], "d": torch.zeros(3, dtype=torch.int8)})
    assert [s.nbytes() for s in storages] == [256, 3]


@pytest.mark.parametrize("name, make", [
    ("Adam", lambda p: torch.optim.Adam(p, lr=0.01)),
    ("Adagrad", lambda p: torch.optim.Adagrad(p, lr=0.01)),
    ("SGD momentum", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
])
def test_own_copies_leaves_no_optimizer_tensor_viewing_the_file(tmp_path, name, make):
    """torch.optim keeps a loaded CPU tensor of its parameter's dtype as it is: a view of the mapped file. After
    `own_copies` none is, and the values and a step after it are those of a plain load."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = make(model.parameters())
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    path = tmp_path / "o.pt"
    torch.save({"opt": opt.state_dict()}, path)
    runs = []
    for mapped in (False, True):
        m = copy.deepcopy(model)
        o = make(m.parameters())
        loaded = ml.load_mapped(str(path), []) if mapped else torch.load(path, weights_only=True)
        o.load_state_dict(loaded["opt"])
        views = {s.data_ptr() for s in ml.cpu_storages(loaded)}
        kept = [t for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        if mapped:
            assert any(t.untyped_storage().data_ptr() in views for t in kept), name  # (the defect, seen)
            assert ml.own_copies([o], loaded) > 0
            kept = [t for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
            assert not any(t.untyped_storage().data_ptr() in views for t in kept), name
        m(torch.randn(4, 5, generator=torch.Generator().manual_seed(1))).sum().backward()
        o.step()
        runs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs)), name


def test_own_copies_reaches_a_schedulers_lists_and_leaves_other_tensors_alone():
    loaded = {"base": torch.tensor([0.5, 0.25])}
    sched = type("Sched", (), {})()
    sched.base_lrs = [loaded["base"][0:1], 0.1]
    own = torch.ones(2)
    sched.other = own
    assert ml.own_copies([sched], loaded) == 1
    assert sched.base_lrs[0].untyped_storage().data_ptr() != loaded["base"].untyped_storage().data_ptr()
    assert torch.equal(sched.base_lrs[0], torch.tensor([0.5])) and sched.other is own and sched.base_lrs[1] == 0.1


def test_a_file_that_cannot_be_mapped_is_read_plainly(tmp_path, monkeypatch):
    path, state = big_checkpoint(tmp_path, rows=1000)

    def no_mmap(*a, **k):
        raise RuntimeError("mmap: Operation not supported")  # (a file system without mmap)

    monkeypatch.setattr(ckpt, "load_mapped", no_mmap)
    loaded = ckpt.load_checkpoint(path, mmap=True, read="all")
    assert torch.equal(loaded["optimizers"][1]["state"][0]["sum"], state["optimizers"][1]["state"][0]["sum"])
    with open("/proc/self/maps") as f:
        assert not any(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.parametrize("damage", ["truncated", "zeroed tail", "not a zip"])
def test_a_damaged_file_mapped_is_one_line_naming_it(tmp_path, damage):
    path, _ = big_checkpoint(tmp_path, rows=1000)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "zeroed tail":
        path.write_bytes(data[:-200] + bytes(200))
    else:
        path.write_bytes(b"hello")
    with pytest.raises(ckpt.ConfigError) as raised:
        ckpt.load_checkpoint(path, mmap=True, read="all")
    text = str(raised.value)
    assert text.startswith(f"{path}: not a readable checkpoint") and "\n" not in text, text


def test_the_shard_names_of_a_one_process_checkpoint_are_read_without_its_tensors(tmp_path, monkeypatch):
    """`_named_shards` of a file that is not a manifest (a one-process checkpoint given where a manifest is looked
    for: 53 GB for MLPerf's) maps it: torch.load is never asked to read it whole."""
    from dlrm.distributed.checkpoint import _named_shards

    path, _ = big_checkpoint(tmp_path, rows=1000)
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("mmap")) or real(*a, **k))
    assert _named_shards(path) == [] and calls and all(calls), calls


ADDRESS_SPACE_SCRIPT = """
import resource, sys
from pathlib import Path
from dlrm import checkpoint as ckpt
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
# room for the pickle and the checks, not for the file's 64 MiB: mapped or read whole
resource.setrlimit(resource.RLIMIT_AS, (size + 24 * 2**20, resource.RLIM_INFINITY))
try:
    ckpt.load_checkpoint(Path(sys.argv[1]), mmap=sys.argv[2] == "mapped", read="all")
except Exception as e:
    print(type(e).__name__, getattr(e, "dlrm_refused", False), e)
"""


@pytest.mark.parametrize("how", ["mapped", "read whole"])
def test_a_checkpoint_beyond_the_address_space_left_is_a_memory_error_not_a_damaged_file(tmp_path, how):
    """Under ``ulimit -v`` the mapping failed (ENOMEM), the fallback read the file whole, which failed too, and the
    file was called "not a readable checkpoint (RuntimeError: [enforce fail at alloc_cpu.cpp:127] ...)", exit 2: a
    MemoryError naming the file, its size and the limit (said as it is, exit 4), and no read whole after the mapping
    failed for want of memory."""
    import subprocess
    import sys

    from tests.conftest import CHILD_ENV

    path, _ = big_checkpoint(tmp_path, rows=64 * MiB // 4)
    out = subprocess.run([sys.executable, "-c", ADDRESS_SPACE_SCRIPT, str(path), how], capture_output=True, text=True,
                         env=CHILD_ENV, timeout=120)
    line = out.stdout.strip()
    assert out.returncode == 0 and "\n" not in line, (out.stdout, out.stderr[-2000:])
    assert line.startswith(f"MemoryError True {path}: "), line
    assert f"{path.stat().st_size / MiB:,.1f} MiB" in line and "ulimit -v" in line, line


def test_a_checkpoint_whose_path_is_not_utf8_is_mapped_too(tmp_path):
    """A directory named in Latin-1 (``os.fsdecode``'s surrogates): torch's C++ mapping takes UTF-8 names only, and the
    load fell back to a read whole, in the process's memory, which the host-memory checks had not counted."""
    path, state = big_checkpoint(tmp_path, rows=1000)
    odd = tmp_path / os.fsdecode(b"caf\xe9")
    odd.mkdir()
    path = path.rename(odd / path.name)
    loaded = ckpt.load_checkpoint(path, mmap=True, read="all")
    assert torch.equal(loaded["optimizers"][1]["state"][0]["sum"], state["optimizers"][1]["state"][0]["sum"])
    with open("/proc/self/maps", "rb") as f:  # (bytes: the name is not UTF-8)
        assert any(line.rstrip().endswith(os.fsencode(path)) for line in f)


def test_the_other_mapped_reads_take_a_path_that_is_not_utf8(tmp_path):
    """The step of a checkpoint (`checkpoint_step`: --eval-only's line, its summary's step), a shard's run record (a
    sharded --resume's and the merge's comparison) and a manifest's shard names read the file memory-mapped too: under
    a directory named in Latin-1 the first was None, the second a UnicodeEncodeError traceback, the third None."""
    from dlrm.distributed.same_run import run_record
    from dlrm.train.checkpointer import checkpoint_step
    from dlrm.train.run_dir import _shard_names

    odd = tmp_path / os.fsdecode(b"caf\xe9")
    odd.mkdir()
    path, state = big_checkpoint(odd, rows=1000)
    assert checkpoint_step(path) == state["position"]["step"]
    record = run_record(path)
    assert record["position"] == state["position"] and record["dense"].keys() and all(
        torch.equal(v, state["model"][k]) for k, v in record["dense"].items())
    manifest = odd / "manifest.pt"
    torch.save({"sharded": {"shards": ["step-00000003.rank0.pt"]}}, manifest)
    assert _shard_names(manifest) == ["step-00000003.rank0.pt"]
