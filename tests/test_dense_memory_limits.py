"""An oversized cross network against the memory this process may take (found by a QA pass on 2026-12-04).

Under `ulimit -v` (or a cgroup's memory.max: a scheduler's job), a cross network of model.cross_rank 1,000,000 ran the
build out of memory and was reported as the tables' doing (MemAvailable left room for it), and one of 600,000 passed
the build and ran its first step out of memory with advice on the batch size and the tables alone. The pre-build check
counted the parameters only, not their gradients and optimizer state, against the machine's whole RAM.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dlrm.train.builder as builder
from dlrm.cli import out_of_memory_message
from dlrm.config import Config, ConfigError, DenseOptimConfig, ModelConfig, validate
from tests.conftest import REPO

DCN = ModelConfig(embedding_dim=8, bottom_mlp=[32, 8], top_mlp=[32, 1], interaction="dcn", cross_layers=2,
                  cross_rank=1000)


@pytest.mark.parametrize("optim, copies", [(DenseOptimConfig(name="adam"), 4), (DenseOptimConfig(name="adagrad"), 3),
                                           (DenseOptimConfig(name="sgd"), 2),
                                           (DenseOptimConfig(name="sgd", momentum=0.9), 3)])
def test_training_copies_count_gradients_and_optimizer_state(optim, copies):
    assert builder.dense_training_copies(optim) == copies


def test_the_pre_build_check_counts_gradients_state_and_this_processs_limit(monkeypatch):
    params = sum(builder.dense_layer_parameters(DCN, 26).values())
    monkeypatch.setattr(builder, "_process_room", lambda: 4 * params * 4 - 1)  # one byte short of Adam's four copies
    builder.refuse_dense_layers_beyond_memory(DCN, 26, torch.device("cpu"))  # the parameters alone fit
    with pytest.raises(ConfigError, match=r"^model\.cross_rank: 1000 \(with model\.cross_layers 2\) makes the cross "
                                          r"network [\d,]+ fp32 parameters, the dense layers [\d.]+ GiB with their "
                                          r"gradients and optimizer state: more than this process's \(ulimit -v, "
                                          r"ulimit -d, or its cgroup's memory\.max or memory\.high\) "):
        builder.refuse_dense_layers_beyond_memory(DCN, 26, torch.device("cpu"), copies=4)
    monkeypatch.setattr(builder, "_process_room", lambda: 4 * params * 4)
    builder.refuse_dense_layers_beyond_memory(DCN, 26, torch.device("cpu"), copies=4)


def test_the_room_a_build_is_weighed_against_is_the_process_limit_where_lower(monkeypatch):
    monkeypatch.setattr(builder, "_process_room", lambda: 2**20)
    assert builder._available_host_memory() == 2**20
    monkeypatch.setattr(builder, "_process_room", lambda: None)
    assert builder._available_host_memory() > 2**20  # MemAvailable (this machine has more than a MiB)


def test_the_process_room_reads_the_address_space_limit():
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_AS); "
            "resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, hard)); "
            "import dlrm.train.builder as b; print(b._process_room())")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    room = int(r.stdout.strip())
    assert 0 < room < 8 * 2**30  # the limit less the address space the interpreter and torch already map


def test_a_steps_out_of_memory_names_an_oversized_cross_network():
    cfg = validate(Config())
    cfg.model = ModelConfig(embedding_dim=8, bottom_mlp=[32, 8], top_mlp=[32, 1], interaction="dcn", cross_layers=2,
                            cross_rank=600_000)
    text = out_of_memory_message(MemoryError("tried to allocate 518400000 bytes"), cfg)
    assert text.endswith("or shrink the cross network: model.cross_rank (now 600000) or model.cross_layers (now 2); "
                         "the dense layers take 7.7 GiB with their gradients and adam's state"), text
    cfg.model.cross_rank = 16  # small dense layers: the batch and the tables alone, as before
    assert "shrink" not in out_of_memory_message(MemoryError("x"), cfg)


def test_the_advice_to_use_fp32_tables_says_what_they_take(tmp_path):
    """configs/mlperf-dcnv2.json on a CPU: "use fp32 tables" alone, which then ran out of memory building 97 GiB."""
    from dlrm.config import load_config
    from dlrm.train.fast_path import resolve_fast_path

    cfg = load_config(str(REPO / "configs" / "mlperf-dcnv2.json"), {"train.device": "cpu"})
    with pytest.raises(ConfigError, match=r'needs kernels.embedding "triton".*: use fp32 tables \(fp32 tables of '
                                          r"204,184,588 rows x 128 take 97\.4 GiB: cap them with "
                                          r"data\.max_rows_per_table, or train on a GPU\)$"):
        resolve_fast_path(cfg, torch.device("cpu"), False, True, 10)
    cfg = load_config(str(REPO / "configs" / "mlperf-dcnv2.json"),
                      {"train.device": "cpu", "data.max_rows_per_table": 1000})
    with pytest.raises(ConfigError, match=r"use fp32 tables$"):  # small enough: no note
        resolve_fast_path(cfg, torch.device("cpu"), False, True, 10)
