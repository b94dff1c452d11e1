"""Running out of memory while the model is built is the embedding tables' doing: train.py says their size and what
makes them fit (cap, bf16, shard), not the batch-size advice of an out-of-memory error met while training (the build
does not depend on the batch). No test allocates the tables: the allocation's failure is raised in its place."""

from __future__ import annotations

import json

import pytest
import torch

import dlrm.train.builder as builder
from dlrm.config import Config, validate
from dlrm.distributed.env import DistEnv
from dlrm.train.host_memory import HostMemory
from dlrm.train.setup import Tables
from tests.conftest import REPO
from tests.test_cli_errors import error_line, invoke

CPU_ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 104542509056 bytes. Error code 12 (Cannot allocate memory)")


@pytest.fixture(autouse=True)
def _restore_logging():
    from dlrm.logging_setup import configure_logging

    yield
    configure_logging()


def _run_out_of_memory_in(where: str, tmp_path, monkeypatch, dataset, **data):
    """train.py on `dataset` with fp32 tables on the CPU, `where` (the builder's build_model or build_optimizers)
    raising the CPU allocator's error; its ERROR line. Exit 4, nothing written."""
    def out_of_memory(*args, **kwargs):
        raise RuntimeError(CPU_ALLOCATOR)

    monkeypatch.setattr(builder, where, out_of_memory)
    cfg = json.loads((REPO / "configs" / "mlperf-dcnv2.json").read_text())
    cfg["model"]["embedding_dtype"], cfg["train"]["precision"], cfg["train"]["device"] = "fp32", "fp32", "cpu"
    cfg["data"].update(data)
    path = tmp_path / "mlperf-fp32.json"
    path.write_text(json.dumps(cfg))
    result = invoke(tmp_path, path, "--data", str(dataset))
    line = error_line(result, 4)
    assert not (tmp_path / "tb").exists()
    return line


def test_mlperf_tables_out_of_host_memory_are_named_with_their_size(tmp_path, monkeypatch, mlperf_preset_dataset):
    """MLPerf's 204,184,588 rows x 128 in fp32 on a CPU: 97.4 GiB of weights, 0.8 GiB of row-wise Adagrad sums (one
    fp32 a row)."""
    # the host's available memory unknown: the build is tried (where it is known and too small, the build is refused
    # before it: tests/test_host_memory_tables.py)
    monkeypatch.setattr(builder, "_available_host_memory", lambda: None)
    monkeypatch.setattr(builder, "_host_memory", HostMemory)  # (nothing known: the pre-build check refuses nothing)
    line = _run_out_of_memory_in("build_model", tmp_path, monkeypatch, mlperf_preset_dataset)
    assert line.endswith(f"ERROR   out of host memory building the model ({CPU_ALLOCATOR}): its embedding tables hold "
                         "204,184,588 rows x 128 x fp32 = 97.4 GiB, the sparse optimizer's state 0.8 GiB more: cap "
                         "them with data.max_rows_per_table"), line


def test_out_of_memory_in_the_sparse_optimizers_state_names_the_tables_too(tmp_path, monkeypatch, mlperf_preset_dataset):
    """The optimizers' build (the sparse state) is covered as the model's is. The model is built for real here, so
    its tables are capped at 1,000 rows (whole, MLPerf's 104 GB of fp32 would be allocated on a host that has it):
    17 tables of 1,000 rows and 9 smaller ones, 18,369 rows. Capped so, the tables (9 MB) are smaller than the MLPerf
    model's dense layers (61 MB), but the two fit in the host's available memory (64 GiB, faked): the dense layers are
    not what ran out, and are not named (tests/test_audit_review65.py; "shrink model.cross_rank (now 512)" it said)."""
    monkeypatch.setattr(builder, "_available_host_memory", lambda: 64 * 2**30)
    line = _run_out_of_memory_in("build_optimizers", tmp_path, monkeypatch, mlperf_preset_dataset,
                                 max_rows_per_table=1000)
    assert line.endswith(f"({CPU_ALLOCATOR}): its embedding tables hold 18,369 rows x 128 x fp32 = 0.0 GiB, the sparse "
                         "optimizer's state 0.0 GiB more: cap them with data.max_rows_per_table"), line


def _tables_text(exc: BaseException, dtype: str, sparse: str, device: str, env: DistEnv = DistEnv(),
                 cardinalities: tuple = (1000, 3), hashing: str = "modulus") -> str | None:
    cfg = validate(Config())
    cfg.model.embedding_dtype, cfg.optim.sparse.name, cfg.model.embedding_dim = dtype, sparse, 16
    tables = Tables(cardinalities=list(cardinalities), vocabs=None, hashing=hashing)
    with pytest.raises(type(exc)) as raised:
        with builder.tables_named_if_out_of_memory(cfg, tables, torch.device(device), env):
            raise exc
    assert raised.value is exc  # the same error leaves, with the tables' size on it
    return getattr(exc, "dlrm_tables", None)


def test_on_a_gpu_the_free_memory_and_the_three_ways_to_fit_are_said(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    # nothing held before the build (on a GPU machine an earlier test of the same worker may hold some: then the
    # message says so and adds the advice to stream the data, which this test does not expect)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    text = _tables_text(torch.OutOfMemoryError("CUDA out of memory."), "fp32", "adagrad", "cuda")
    # 1,003 rows x 16 fp32: 64,192 B of weights and as much Adagrad state (one fp32 an element)
    assert text == ("its embedding tables hold 1,003 rows x 16 x fp32 = 0.0 GiB, the sparse optimizer's state 0.0 GiB "
                    "more; 3.0 GiB of the GPU's 80.0 GiB were free: cap them with data.max_rows_per_table, store them "
                    "in bf16 (model.embedding_dtype), or shard them over several GPUs under torchrun")
    text = _tables_text(torch.OutOfMemoryError("CUDA out of memory."), "bf16", "sgd", "cuda")
    assert text == ("its embedding tables hold 1,003 rows x 16 x bf16 = 0.0 GiB; 3.0 GiB of the GPU's 80.0 GiB were "
                    "free: cap them with data.max_rows_per_table, or shard them over several GPUs under torchrun")


def test_other_errors_and_ranks_of_sharded_tables_are_left_as_they_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("a rank's share is its plan's"))
    assert _tables_text(ValueError("not memory"), "fp32", "sgd", "cpu") is None
    assert _tables_text(MemoryError(), "fp32", "sgd", "cuda", DistEnv(rank=0, world_size=2)) is None
    assert _tables_text(MemoryError(), "fp32", "sgd", "cpu") == (
        "its embedding tables hold 1,003 rows x 16 x fp32 = 0.0 GiB: cap them with data.max_rows_per_table")


def test_the_free_memory_said_is_the_gpus_before_the_tables_when_the_optimizers_run_out(monkeypatch):
    """The sparse optimizer's state (per-element Adagrad: as large as fp32 tables) is built after the tables: the free
    memory said is what the GPU had before them (60 GiB here), not what the built tables left (11 GiB), which read as
    11 GiB free beside tables that had taken the rest. The model is built on the CPU; the GPU's memory is faked."""
    free = [60 * 2**30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    resolve, build_model = builder.resolve_fast_path, builder.build_model
    monkeypatch.setattr(builder, "resolve_fast_path", lambda cfg, device, *a, **k: resolve(cfg, torch.device("cpu"),
                                                                                               *a, **k))

    def model_on_the_cpu(model_cfg, cards, vocabs, kernels, device, **kwargs):
        free[0] = 11 * 2**30  # what the tables left
        return build_model(model_cfg, cards, vocabs, kernels, torch.device("cpu"), **kwargs)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(builder, "build_model", model_on_the_cpu)
    monkeypatch.setattr(builder, "build_optimizers", out_of_memory)
    cfg = validate(Config())
    cfg.optim.sparse.name, cfg.model.embedding_dim = "adagrad", 16
    with pytest.raises(torch.OutOfMemoryError) as raised:
        builder.build_run(cfg, Tables([1000] * 26, None, "modulus"), torch.device("cuda"), total_steps=10)
    assert "; 60.0 GiB of the GPU's 80.0 GiB were free: " in raised.value.dlrm_tables, raised.value.dlrm_tables


def test_a_split_held_in_gpu_memory_and_the_vocabularies_keys_are_counted(monkeypatch):
    """data.placement "gpu" loads the splits before the build: what the process held then is said, and streaming the
    data is advised with the rest. Vocabulary hashing's int64 keys lie beside the rows on the device (2 GiB here)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * 2**30)
    text = _tables_text(torch.OutOfMemoryError("CUDA out of memory."), "bf16", "sgd", "cuda",
                        cardinalities=(2**27 + 1, 2**27 + 1), hashing="vocabulary")
    assert text == ("its embedding tables hold 268,435,458 rows x 16 x bf16 = 8.0 GiB, their vocabularies' keys 2.0 GiB "
                    "more; 3.0 GiB of the GPU's 80.0 GiB were free, this process held 20.0 GiB already: cap them with "
                    "data.max_rows_per_table, stream the data (data.placement \"stream\": no split in GPU memory), or "
                    "shard them over several GPUs under torchrun")
