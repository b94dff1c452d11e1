"""Audit of the multi-hot DCN (MLPerf DLRM-DCNv2) flows, session 65: each test failed before its fix.

An oversized cross network (or MLP) that runs the build out of memory was reported as the embedding tables' doing: "its
embedding tables hold 2,847 rows x 8 x fp32 = 0.0 GiB ...: cap them with data.max_rows_per_table", advice that cannot
help. The error now names the dense layers, the part that holds most of them and the key that shrinks it. Dense layers
larger than the machine's memory are refused before the build, naming the key and its value: model.cross_layers
1,000,000,000 passed the config's checks and built layer after layer until the kernel's OOM killer ended the run without
a word. A model.multi_hot_sizes list of the wrong length did not say what it held.
"""

from __future__ import annotations

import json

import pytest
import torch

import dlrm.train.builder as builder
from dlrm.config import Config, ConfigError, ModelConfig, validate
from dlrm.model.dlrm import build_model
from dlrm.train.host_memory import HostMemory
from dlrm.train.setup import Tables
from tests.test_cli_errors import error_line, invoke
from tests.test_tables_out_of_memory import CPU_ALLOCATOR


@pytest.fixture(autouse=True)
def _no_process_limit(monkeypatch):
    """The host's memory is what these messages name: a CI runner's cgroup limit (`builder._process_room`) would name
    the process's instead (tests/test_dense_memory_limits.py covers that)."""
    monkeypatch.setattr(builder, "_process_room", lambda: None)


@pytest.fixture(autouse=True)
def _restore_logging():
    from dlrm.logging_setup import configure_logging

    yield
    configure_logging()


@pytest.mark.parametrize("model", [
    dict(interaction="dcn", cross_layers=3, cross_rank=7),
    dict(interaction="dcn", cross_layers=2, cross_rank=3, top_mlp_input_multiple=8, bottom_mlp_input_multiple=8),
    dict(interaction="dot", top_mlp_input_multiple=16),
    dict(interaction="cat"),
])
def test_dense_layer_parameters_count_what_build_model_builds(model):
    """Multi-hot tables (the dense parts do not depend on them) and one sparse feature as well as 26."""
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[9, 4], top_mlp=[11, 5, 1], **model)
    for tables in ([10] * 26, [5]):
        built = build_model(cfg, tables, multi_hot_sizes=[3] * len(tables), log_kernels=False)
        dense = sum(p.numel() for name, p in built.named_parameters() if not name.startswith("sparse_arch"))
        parts = builder.dense_layer_parameters(cfg, len(tables))
        assert sum(parts.values()) == dense, (model, tables)
        if model["interaction"] == "dcn":
            crossnet = next(m for m in built.modules() if hasattr(m, "W_kernels"))  # inside PaddedInteraction too
            assert parts["the cross network"] == sum(p.numel() for p in crossnet.parameters())


def _out_of_memory_line(tmp_path, monkeypatch, dataset, **model) -> str:
    """train.py's ERROR line for a DCN config on `dataset` whose build_model raises the CPU allocator's error (no test
    allocates the 7 TB); exit 4 and no run directory."""
    def out_of_memory(*args, **kwargs):
        raise RuntimeError(CPU_ALLOCATOR)

    monkeypatch.setattr(builder, "build_model", out_of_memory)
    # the host's available memory unknown (no MemAvailable): the build is tried, its failure faked. (Where it is known
    # and too small, the build is refused before it: tests/test_host_memory_tables.py)
    monkeypatch.setattr(builder, "_available_host_memory", lambda: None)
    monkeypatch.setattr(builder, "_host_memory", HostMemory)  # (the pre-build check's reading: nothing known)
    cfg = {"data": {"batch_size": 16}, "train": {"device": "cpu", "max_steps": 2, "baseline": False},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1], "interaction": "dcn",
                     "cross_layers": 2, "cross_rank": 5, **model}}
    path = tmp_path / "dcn.json"
    path.write_text(json.dumps(cfg))
    line = error_line(invoke(tmp_path, path, "--data", str(dataset)), 4, "out of host memory building the model")
    assert not (tmp_path / "tb").exists()
    return line


def test_an_oversized_cross_network_out_of_memory_names_it_not_the_tables(tmp_path, monkeypatch, tiny_dataset):
    """model.cross_rank 2**18 over 27 x 8 inputs: 2 x (2 x 216 x 2**18 + 216) = 226,492,848 fp32 parameters (0.8 GiB:
    within any host's memory, so the build is tried; its failure is faked)."""
    line = _out_of_memory_line(tmp_path, monkeypatch, tiny_dataset[0], cross_rank=2**18)
    assert line.endswith(
        f"({CPU_ALLOCATOR}): its dense layers hold 226,496,697 fp32 parameters = 0.8 GiB, the cross network "
        "226,492,848 of them (its embedding tables hold 286 rows x 8 x fp32 = 0.0 GiB, the sparse optimizer's "
        "state 0.0 GiB more): shrink model.cross_rank (now 262144) or model.cross_layers (now 2)"), line
    assert "max_rows_per_table" not in line


def test_an_oversized_mlp_out_of_memory_names_its_key(tmp_path, monkeypatch, tiny_dataset):
    line = _out_of_memory_line(tmp_path, monkeypatch, tiny_dataset[0], top_mlp=[2**20, 1])
    assert "its dense layers hold 228,594,681 fp32 parameters = 0.9 GiB, " in line, line
    assert line.endswith("the top MLP 228,589,569 of them (its embedding tables hold 286 rows x 8 x fp32 = 0.0 "
                         "GiB, the sparse optimizer's state 0.0 GiB more): shrink model.top_mlp (now [1048576, 1])"), line


@pytest.mark.parametrize("model, message", [
    ({"cross_layers": 10**9}, "model.cross_layers: 1000000000 (with model.cross_rank 5) makes the cross network "
                              "2,376,000,000,000 fp32 parameters, the dense layers 35,405.2 GiB with their gradients and "
                              "optimizer state: more than the host's "),
    ({"cross_rank": 2**31 - 1}, "model.cross_rank: 2147483647 (with model.cross_layers 2) makes the cross network "
                                "1,855,425,871,440 fp32 parameters, the dense layers 27,648.0 GiB with their gradients and "
                                "optimizer state: more than the host's "),
    ({"bottom_mlp": [2**31 - 1, 8]}, "model.bottom_mlp: [2147483647, 8] makes the bottom MLP 47,244,640,242 fp32 "
                                     "parameters, the dense layers 704.0 GiB with their gradients and optimizer state: "
                                     "more than the host's "),
])
def test_dense_layers_beyond_the_machines_memory_are_refused_before_the_build(tmp_path, tiny_dataset, model, message):
    """One line naming the key and its value, exit 2, nothing written, in seconds (cross_layers 1e9 built for minutes
    and was ended by the OOM killer; 2**31 - 1 is the config's bound)."""
    cfg = {"data": {"batch_size": 16}, "train": {"device": "cpu", "max_steps": 2, "baseline": False},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1], "interaction": "dcn",
                     "cross_layers": 2, "cross_rank": 5, **model}}
    path = tmp_path / "dcn.json"
    path.write_text(json.dumps(cfg))
    error_line(invoke(tmp_path, path, "--data", str(tiny_dataset[0])), 2, message)
    assert not (tmp_path / "tb").exists()


def test_the_memory_bound_is_the_devices(monkeypatch):
    """Refused just above the memory, built just below it (the host's here: pages x page size, faked)."""
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcn", cross_layers=2, cross_rank=3)
    need = 4 * sum(builder.dense_layer_parameters(cfg, 26).values())
    for pages, refused in ((need - 1, True), (need, False)):
        monkeypatch.setattr(builder.os, "sysconf", lambda name, pages=pages: {"SC_PAGE_SIZE": 1}.get(name, pages))
        if refused:
            with pytest.raises(ConfigError, match=r"^model\.cross_rank: 3 \(with model\.cross_layers 2\) makes"):
                builder.refuse_dense_layers_beyond_memory(cfg, 26, torch.device("cpu"))
        else:
            builder.refuse_dense_layers_beyond_memory(cfg, 26, torch.device("cpu"))


def test_on_a_gpu_the_free_memory_is_said_and_no_table_advice_follows(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    cfg = validate(Config())
    cfg.model.interaction, cfg.model.cross_rank, cfg.model.embedding_dim = "dcn", 2**31 - 1, 16
    cfg.model.bottom_mlp = [64, 16]
    exc = torch.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(torch.OutOfMemoryError):
        with builder.tables_named_if_out_of_memory(cfg, Tables([1000, 3] * 13, None, "modulus"), torch.device("cuda"),
                                                   builder.DistEnv()):
            raise exc
    assert exc.dlrm_tables.endswith("GiB more); 3.0 GiB of the GPU's 80.0 GiB were free: shrink model.cross_rank (now "
                                    "2147483647) or model.cross_layers (now 3)"), exc.dlrm_tables


def test_tables_larger_than_the_dense_layers_keep_the_tables_advice(tmp_path, monkeypatch, mlperf_preset_dataset):
    """MLPerf's 204M rows against its 3 cross layers of rank 512: the tables are what ran out, as before."""
    line = _out_of_memory_line(tmp_path, monkeypatch, mlperf_preset_dataset, cross_rank=512)
    assert line.endswith(": cap them with data.max_rows_per_table") and "dense layers" not in line, line


@pytest.mark.parametrize("sizes, got", [([3] * 25, "got 25 entries"), ([3] * 27, "got 27 entries"), ([], "got 0 entries")])
def test_a_multi_hot_sizes_list_of_the_wrong_length_says_what_it_got(tmp_path, tiny_dataset, sizes, got):
    """model.cardinalities' error said "has 25 entries, expected 26"; model.multi_hot_sizes' named neither. train.py: one
    line, exit 2, no run directory."""
    path = tmp_path / "dcn.json"
    path.write_text(json.dumps({"model": {"interaction": "dcn", "cross_layers": 2, "cross_rank": 4,
                                          "multi_hot_sizes": sizes}, "train": {"device": "cpu"}}))
    line = error_line(invoke(tmp_path, path, "--data", str(tiny_dataset[0])), 2,
                      f"model.multi_hot_sizes: must be a list of 26 positive integers, {got}")
    assert str(path) in line and not (tmp_path / "tb").exists()
