"""build_run resolves "auto" with what it knows of the run (its length, tables, processes) and builds what it chose."""

import torch

from dlrm.config import Config, validate
from dlrm.train import builder
from dlrm.train.fast_path import resolve_fast_path


def test_build_run_resolves_auto_with_the_runs_length_and_tables_and_builds_the_choice(monkeypatch):
    calls = []

    def spy(cfg, device, distributed=False, multi_hot=False, total_steps=None):
        calls.append((device, distributed, multi_hot, total_steps))
        return resolve_fast_path(cfg, device, distributed, multi_hot, total_steps)

    monkeypatch.setattr(builder, "resolve_fast_path", spy)
    cfg = validate(Config())
    cfg.model.cardinalities, cfg.data.max_rows_per_table = [10] * 25 + [1000], 100
    cfg.model.multi_hot_sizes = [1] * 25 + [3]
    cpu = torch.device("cpu")
    tables = builder.tables_from_config(cfg)
    assert tables.cardinalities == [10] * 25 + [100]  # capped by data.max_rows_per_table
    run = builder.build_run(cfg, tables, cpu, total_steps=17)
    assert calls == [(cpu, False, True, 17)]
    assert cfg.kernels.embedding == "auto" and run.config.kernels.embedding == "torch"  # the caller's config is kept
    assert run.fast_path["kernels.embedding"]["value"] == "torch" and run.config.train.cuda_graph is False
    assert run.eval_forward.batch_size == 4 * cfg.data.batch_size
    assert builder.build_run(cfg, tables, cpu, 17, eval_batch_size=96).eval_forward.batch_size == 96


def test_a_compiled_run_builds_the_torch_embedding_with_its_fused_update():
    """train.compile on: the torch embedding updates its rows in the backward (static shapes), as resolved."""
    cfg = validate(Config())
    cfg.model.cardinalities, cfg.train.compile.enabled = [10] * 26, True
    run = builder.build_run(cfg, builder.tables_from_config(cfg), torch.device("cpu"), total_steps=5)
    assert run.config.kernels.embedding == "torch" and run.config.train.compile.enabled is True
    assert type(run.model.sparse_arch).__name__ == "FusedUpdateSparseArch"
