"""Out of memory on a --resume: the advice says what a resume can do. The checkpoint fixes the tables' rows and the
dense layers' shapes (a resume's data.max_rows_per_table or model keys either are refused against the checkpoint's or
fail to load into it: `dlrm.train.resume_policy`, `dlrm.checkpoint.fixed_model_keys`), and a one-process checkpoint
resumes in one process only (`dlrm.distributed.checkpoint.check_resumable_by`): "cap them with
data.max_rows_per_table", "shard them over several GPUs under torchrun" and "shrink model.cross_rank" were advised to
a resume, each one a dead end. A resume is told to run where there is more free memory (and, on a GPU holding its
splits, to stream them; at a step, to take a smaller batch with --allow-config-change). A fresh run keeps its advice.
No test allocates the tables: the allocation's failure is raised in its place."""

from __future__ import annotations

import json

import pytest
import torch

import dlrm.train.builder as builder
from dlrm.cli import out_of_memory_message
from dlrm.config import Config, ModelConfig, validate
from dlrm.distributed.env import DistEnv
from dlrm.train.host_memory import HostMemory
from dlrm.train.setup import Tables
from tests.conftest import make_dataset
from tests.test_cli_errors import error_line, invoke

CPU_ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 104542509056 bytes. Error code 12 (Cannot allocate memory)")
CONFIG = {"data": {"batch_size": 8}, "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
          "train": {"device": "cpu", "max_steps": 2, "log_every": 1, "baseline": False}}


@pytest.fixture(autouse=True)
def _restore_logging():
    from dlrm.logging_setup import configure_logging

    yield
    configure_logging()


@pytest.fixture
def config(tmp_path):
    # tables (1,000 rows a feature: 26,000 x 4) larger than the dense layers (3,005 parameters): they are what ran out
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16}, cardinality=1000)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**CONFIG, "data": {**CONFIG["data"], "path": str(tmp_path / "ds")}}))
    return path


def _out_of_memory_building(monkeypatch, where: str = "build_model"):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError(CPU_ALLOCATOR)

    monkeypatch.setattr(builder, where, out_of_memory)
    monkeypatch.setattr(builder, "_host_memory", HostMemory)  # (nothing known: the pre-build check refuses nothing)
    monkeypatch.setattr(builder, "_available_host_memory", lambda: None)


@pytest.mark.parametrize("where", ["build_model", "build_optimizers"])
def test_a_resume_out_of_host_memory_building_the_model_is_not_told_to_cap_the_tables(tmp_path, config, monkeypatch,
                                                                                     where):
    assert invoke(tmp_path, config, "--run-name", "r").exit_code == 0
    checkpoint = tmp_path / "tb" / "r" / "checkpoints" / "step-00000002.pt"
    assert checkpoint.is_file()
    _out_of_memory_building(monkeypatch, where)
    line = error_line(invoke(tmp_path, config, "--run-name", "r", "--resume", "latest", "--max-steps", "4"), 4)
    assert f"out of host memory building the model ({CPU_ALLOCATOR}): its embedding tables hold " in line, line
    assert "max_rows_per_table" not in line.split(CPU_ALLOCATOR)[1].replace(
        "data.max_rows_per_table cannot cap them", ""), line
    assert line.endswith(": a resume keeps the checkpoint's tables and layers (data.max_rows_per_table cannot cap "
                         "them; their sizes change only in a new run): resume it on a host with more free "
                         "memory"), line
    # the run is as it was: the resume wrote no checkpoint
    assert sorted(p.name for p in checkpoint.parent.glob("step-*.pt")) == ["step-00000002.pt"]


def test_a_fresh_run_out_of_host_memory_building_the_model_is_still_told_to_cap_the_tables(tmp_path, config,
                                                                                           monkeypatch):
    _out_of_memory_building(monkeypatch)
    line = error_line(invoke(tmp_path, config, "--run-name", "r"), 4)
    assert line.endswith(": cap them with data.max_rows_per_table"), line


def _tables_text(device: str, resuming: bool, model: ModelConfig | None = None, cardinalities=(1000, 3)) -> str:
    cfg = validate(Config())
    cfg.model.embedding_dtype, cfg.optim.sparse.name, cfg.model.embedding_dim = "fp32", "adagrad", 16
    if model is not None:
        cfg.model = model
    exc = torch.OutOfMemoryError("CUDA out of memory.") if device == "cuda" else MemoryError()
    with pytest.raises(type(exc)):
        with builder.tables_named_if_out_of_memory(cfg, Tables(list(cardinalities), None, "modulus"),
                                                   torch.device(device), DistEnv(), resuming=resuming):
            raise exc
    return exc.dlrm_tables


@pytest.mark.parametrize("held", [0, 2 * 2**30])
def test_on_a_gpu_a_resume_is_told_neither_to_cap_nor_to_shard_nor_bf16(monkeypatch, held):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held)
    fresh, resumed = _tables_text("cuda", False), _tables_text("cuda", True)
    assert "cap them with data.max_rows_per_table" in fresh and "under torchrun" in fresh and "bf16" in fresh
    head = fresh[:fresh.index(": cap them")]  # the tables' size and the GPU's memory, said alike
    stream = ', or stream the data (data.placement "stream": no split in GPU memory)' if held else ""
    assert resumed == (f"{head}: a resume keeps the checkpoint's tables and layers (data.max_rows_per_table cannot "
                       "cap them; their sizes change only in a new run): resume it on a GPU with more free "
                       f"memory{stream}"), resumed


def test_a_resumes_oversized_dense_layers_are_named_without_the_key_it_cannot_change(monkeypatch):
    """A cross network of 1.2 million parameters a layer beside 1,003 rows: the dense layers are what ran out (the
    memory free before the build unknown: it is not said that both fitted)."""
    monkeypatch.setattr(builder, "_available_host_memory", lambda: None)
    dcn = ModelConfig(embedding_dim=8, bottom_mlp=[32, 8], top_mlp=[32, 1], interaction="dcn", cross_layers=2,
                      cross_rank=600_000)
    fresh, resumed = _tables_text("cpu", False, dcn), _tables_text("cpu", True, dcn)
    assert fresh.endswith("shrink model.cross_rank (now 600000) or model.cross_layers (now 2)"), fresh
    head = fresh[:fresh.rindex(": shrink")]
    assert resumed == (f"{head}: a resume keeps the checkpoint's tables and layers (data.max_rows_per_table cannot "
                       "cap them; their sizes change only in a new run): resume it on a host with more free "
                       "memory"), resumed


def test_a_resume_out_of_memory_at_a_step_is_told_how_a_resume_takes_a_smaller_batch():
    cfg = validate(Config())
    cfg.data.batch_size = 64
    fresh = out_of_memory_message(MemoryError("tried to allocate 5 bytes"), cfg)
    assert fresh.endswith("retry with a smaller data.batch_size (now 64) (--batch-size), or cap the embedding "
                          "tables with data.max_rows_per_table"), fresh
    resumed = out_of_memory_message(MemoryError("tried to allocate 5 bytes"), cfg, resuming=True)
    assert resumed == ("out of host memory (tried to allocate 5 bytes): resume with a smaller data.batch_size (now "
                       "64) (--batch-size with --allow-config-change data.batch_size), or on a host with more free "
                       "memory (the checkpoint fixes the tables and layers: data.max_rows_per_table cannot cap them)"
                       ), resumed
    cfg.model = ModelConfig(embedding_dim=8, bottom_mlp=[32, 8], top_mlp=[32, 1], interaction="dcn", cross_layers=2,
                            cross_rank=600_000)
    resumed = out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory"), cfg, resuming=True)
    assert "shrink" not in resumed and "or on a GPU with more free memory" in resumed, resumed


@pytest.mark.parametrize("resume_bytes", [0, 1000])
def test_a_resumes_refusal_before_the_build_names_no_dense_key_either(resume_bytes):
    """The pre-build refusal (the host's memory too small: `refuse_host_memory_shortfall`) of a model whose dense
    layers are the larger part advised "shrink model.cross_rank" to a resume too, which its checkpoint refuses."""
    cfg = validate(Config())
    cfg.model = ModelConfig(embedding_dim=8, bottom_mlp=[32, 8], top_mlp=[32, 1], interaction="dcn", cross_layers=2,
                            cross_rank=60_000)
    tables = Tables([1000, 3], None, "modulus")
    with pytest.raises(MemoryError) as raised:
        builder.refuse_host_memory_shortfall(cfg, tables, HostMemory(available=2**20), resume_bytes=resume_bytes)
    text = str(raised.value)
    assert "the model needs " in text and "its dense layers hold " in text, text
    if resume_bytes:
        assert "shrink" not in text and "resume it on a host with more free memory" in text, text
    else:
        assert "shrink model.cross_rank (now 60000) or model.cross_layers (now 2)" in text, text


def test_a_resume_out_of_memory_at_a_step_says_so_end_to_end(tmp_path, config, monkeypatch):
    """train.py passes whether it resumes to the line (`dlrm.cli.report_failure`): the same step's failure in a fresh
    run keeps the cap advice, and on a --resume names the flag a smaller batch needs there."""
    from dlrm.train import step

    assert invoke(tmp_path, config, "--run-name", "r").exit_code == 0

    def out_of_memory(self, batch):
        raise MemoryError("tried to allocate 7 bytes")

    monkeypatch.setattr(step.TrainStep, "__call__", out_of_memory)
    line = error_line(invoke(tmp_path, config, "--run-name", "r", "--resume", "latest", "--max-steps", "4"), 4)
    assert line.endswith("out of host memory (tried to allocate 7 bytes): resume with a smaller data.batch_size (now "
                         "8) (--batch-size with --allow-config-change data.batch_size), or on a host with more free "
                         "memory (the checkpoint fixes the tables and layers: data.max_rows_per_table cannot cap "
                         "them)"), line
    line = error_line(invoke(tmp_path, config, "--run-name", "fresh"), 4)
    assert line.endswith("out of host memory (tried to allocate 7 bytes): retry with a smaller data.batch_size (now "
                         "8) (--batch-size), or cap the embedding tables with data.max_rows_per_table"), line


def test_a_resume_that_restarted_from_step_0_is_not_told_of_a_checkpoint(tmp_path, config, monkeypatch):
    """A --resume of a run stopped before its first checkpoint (its directory holds config.json only) restarts it from
    step 0 (`restart_config`); out of memory at a step it was told "the checkpoint fixes the tables and layers" of a
    run that has none, and not the flag its next --resume needs to cap them (its config.json compared, every change
    refused without --allow-config-change). A --resume by a name with no directory starts a new run, whose directory
    a failure before its first checkpoint removes: its next --resume starts a new run too, a fresh run's advice."""
    from dlrm.config import load_config
    from dlrm.train import step

    def out_of_memory(self, batch):
        raise MemoryError("tried to allocate 7 bytes")

    monkeypatch.setattr(step.TrainStep, "__call__", out_of_memory)
    run = tmp_path / "tb" / "r"
    run.mkdir(parents=True)  # as a run killed before its first checkpoint leaves it
    saved = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r"}).to_dict()
    (run / "config.json").write_text(json.dumps(saved))
    result = invoke(tmp_path, config, "--run-name", "r", "--resume", "latest", "--max-steps", "4")
    assert "holds no checkpoint yet (the run stopped before its first one): starting it from step 0" in result.output
    line = error_line(result, 4)
    assert line.endswith("out of host memory (tried to allocate 7 bytes): retry the --resume with a smaller "
                         "data.batch_size (now 8) (--batch-size with --allow-config-change data.batch_size), or cap "
                         "the embedding tables with data.max_rows_per_table with --allow-config-change "
                         "data.max_rows_per_table (the run has no checkpoint: its config.json is compared)"), line
    assert (run / "config.json").is_file() and not list(run.glob("checkpoints/*.pt"))
    line = error_line(invoke(tmp_path, config, "--run-name", "new", "--resume", "latest", "--max-steps", "4"), 4)
    assert not (tmp_path / "tb" / "new").exists()
    assert line.endswith("out of host memory (tried to allocate 7 bytes): retry with a smaller data.batch_size (now "
                         "8) (--batch-size), or cap the embedding tables with data.max_rows_per_table"), line
