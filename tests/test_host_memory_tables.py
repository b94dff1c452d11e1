"""Embedding tables beyond the host's available memory are refused before a CPU build (found by a QA pass on
2026-12-04): an allocation of tables larger than MemAvailable but within the kernel's overcommit succeeds on a CPU,
and the OOM killer ended the run while their initial values were written, without a word. The dense layers were
checked before the build, the tables not. No test allocates the tables: the available memory is faked, and the
build is replaced by a function that fails the test if it is reached."""

from __future__ import annotations

import json
import re

import pytest
import torch

import dlrm.train.builder as builder
from dlrm.cli import out_of_memory_message
from dlrm.config import Config, validate
from dlrm.train.host_memory import HostMemory
from dlrm.train.setup import Tables
from tests.conftest import REPO
from tests.test_cli_errors import error_line, invoke

GiB = 2**30


@pytest.fixture(autouse=True)
def _restore_logging():
    from dlrm.logging_setup import configure_logging

    yield
    configure_logging()


def _never_built(*args, **kwargs):
    raise AssertionError("the model was built: its tables would have been allocated")


def test_mlperf_tables_beyond_the_available_host_memory_are_refused_before_the_build(tmp_path, monkeypatch,
                                                                                     mlperf_preset_dataset):
    """MLPerf's 204,184,588 rows x 128 in fp32 on a CPU with 16 GiB available: exit 4, one line with their size and
    the memory available, nothing built and nothing written."""
    monkeypatch.setattr(builder, "build_model", _never_built)
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=16 * GiB))
    cfg = json.loads((REPO / "configs" / "mlperf-dcnv2.json").read_text())
    cfg["model"]["embedding_dtype"], cfg["train"]["precision"], cfg["train"]["device"] = "fp32", "fp32", "cpu"
    path = tmp_path / "mlperf-fp32.json"
    path.write_text(json.dumps(cfg))
    line = error_line(invoke(tmp_path, path, "--data", str(mlperf_preset_dataset)), 4)
    # 97.4 GiB of weights, 0.8 GiB of row-wise Adagrad sums, the dense layers (61 MB) x 3: gradients, Adagrad sums
    assert line.endswith("ERROR   the model needs 98.3 GiB of host memory with its optimizers' state, more than the "
                         "16.0 GiB the host has available (MemAvailable): its embedding tables hold 204,184,588 rows x "
                         "128 x fp32 = 97.4 GiB, the sparse optimizer's state 0.8 GiB more, its dense layers 183.6 MiB: "
                         "cap the tables with data.max_rows_per_table (there is no free swap for train.allow_swap to "
                         "count)"), line
    assert not (tmp_path / "tb").exists()


def _cfg(sparse: str = "adagrad", dense: str = "adam"):
    cfg = validate(Config())
    cfg.model.embedding_dim, cfg.model.embedding_dtype = 16, "fp32"
    cfg.optim.sparse.name, cfg.optim.dense.name = sparse, dense
    return cfg


def _need(cfg, tables: Tables) -> int:
    """Weights (fp32) and per-element Adagrad state (as large), vocabulary keys, dense layers x Adam's 4 copies."""
    rows = sum(tables.cardinalities)
    keys = 8 * sum(c - 1 for c in tables.cardinalities) if tables.hashing == "vocabulary" else 0
    dense = 4 * 4 * sum(builder.dense_layer_parameters(cfg.model, len(tables.cardinalities)).values())
    return rows * 16 * 4 * 2 + keys + dense


@pytest.mark.parametrize("hashing", ["modulus", "vocabulary"])
def test_the_estimate_counts_the_optimizers_state_the_keys_and_the_dense_layers(hashing):
    cfg, tables = _cfg(), Tables([10**6] * 26, None, hashing)
    need = _need(cfg, tables)
    builder.refuse_host_memory_shortfall(cfg, tables, HostMemory(available=need))  # exactly fits
    builder.refuse_host_memory_shortfall(cfg, tables, HostMemory())  # unknown: nothing refused
    with pytest.raises(MemoryError) as raised:
        builder.refuse_host_memory_shortfall(cfg, tables, HostMemory(available=need - 1))
    assert f"the model needs {need / GiB:,.1f} GiB of host memory" in str(raised.value)
    assert ("their vocabularies' keys 0.2 GiB more" in str(raised.value)) == (hashing == "vocabulary")
    # said as it is, not as an allocation that failed while the model was built
    assert out_of_memory_message(raised.value, cfg) == str(raised.value)


def test_a_process_limit_is_named_and_larger_dense_layers_with_their_key():
    cfg = _cfg(sparse="sgd")
    cfg.model.top_mlp = [2**20, 1]  # 1.4 GiB of fp32 parameters (x 4 with Adam), larger than 26 x 10 rows
    with pytest.raises(MemoryError, match=r"^the model needs 5\.8 GiB of host memory with its optimizers' state, more "
                                          r"than the 1\.0 GiB this process may take \(ulimit -v, ulimit -d\): "
                                          r"its dense layers hold [\d,]+ fp32 parameters = 1\.4 GiB, "
                                          r"the top MLP [\d,]+ of them \(its embedding tables hold 260 rows x 16 x "
                                          r"fp32 = 0\.0 GiB\): shrink model\.top_mlp \(now \[1048576, 1\]\)$"):
        builder.refuse_host_memory_shortfall(cfg, Tables([10] * 26, None, "modulus"),
                                             HostMemory(available=64 * GiB, process=GiB))


def test_build_run_refuses_on_the_cpu_before_the_model_is_built(monkeypatch):
    monkeypatch.setattr(builder, "build_model", _never_built)
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=2**20))
    with pytest.raises(MemoryError, match=r"needs 31\.0 GiB .* more than the 1\.0 MiB the host has available "):
        builder.build_run(_cfg(), Tables([10**7] * 26, None, "modulus"), torch.device("cpu"), total_steps=10)


def test_tables_within_the_available_memory_are_built(monkeypatch):
    cfg, tables = _cfg(), Tables([100] * 26, None, "modulus")
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=_need(cfg, tables)))
    run = builder.build_run(cfg, tables, torch.device("cpu"), total_steps=10)
    assert run.model.sparse_arch is not None


@pytest.mark.parametrize("memory, source", [
    (HostMemory(available=2 * GiB, cgroup=GiB), "the cgroup's memory limit leaves (memory.max, or v1's "),
    (HostMemory(available=GiB, cgroup=2 * GiB), "the host has available (MemAvailable)"),
    (HostMemory(available=GiB, process=GiB // 2), "this process may take (ulimit -v, ulimit -d)")])
def test_the_memory_is_named_by_the_limit_that_binds(memory, source):
    """The tightest limit is the one named (it was guessed by reading the process's limits a second time)."""
    with pytest.raises(MemoryError, match=r"more than the [\d.]+ \w+ " + re.escape(source)):
        builder.refuse_host_memory_shortfall(_cfg(), Tables([10**7] * 26, None, "modulus"), memory)
