"""QA of torchrun launches on the CPU (gloo ranks): what a tool that runs in one process does when torchrun starts it
on several."""

import json
import os
import subprocess
import sys

from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output


def test_sweep_under_torchrun_is_refused_once_before_anything_is_written(tmp_path):
    """`torchrun --nproc-per-node 2 -m dlrm.sweep ...`: every rank ran the whole sweep, each into a sweep directory of
    its own (the second one `<name>-2`, holding a copy of the tables), or, with --run-name, rank 1 was told the
    directory rank 0 had just made "already exists; pick another name". Refused instead, by rank 0 in one line, rank 1
    silent, both exit 2, nothing written. (Each rank is started here with the environment torchrun gives it: a real
    launch's SIGTERM of rank 0 once rank 1 exits can come before rank 0's line.)"""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16})
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
                               "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                               "train": {"epochs": 1, "device": "cpu", "baseline": False}}))
    for rank in (0, 1):
        env = {**CHILD_ENV, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # (a port nobody listens on: no rank meets another)
        result = subprocess.run([sys.executable, "-m", "dlrm.sweep", "--config", str(cfg), "--set",
                                 "optim.dense.lr=0.001,0.01", "--seeds", "1", "--tb-dir", str(tmp_path / "tb")],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 2, process_output(result)
        lines = result.stderr.strip().splitlines()
        if rank == 0:
            assert len(lines) == 1 and "ERROR" in lines[0] and "dlrm.sweep runs its trials in one process, not under " \
                "torchrun (WORLD_SIZE 2" in lines[0], process_output(result)
        else:
            assert not lines, process_output(result)
        assert not (tmp_path / "tb").exists() or not os.listdir(tmp_path / "tb")


def test_compare_warnings_every_rank_makes_alike_are_rank_zeros_alone(tmp_path):
    """`torchrun --nproc-per-node 2 train.py --compare eager,eager,triton-embedding+cudagraphs` with a config that sets
    kernels.embedding, on the CPU: the variant named twice, the config's kernels replaced by each variant's, and the
    variant skipped (no CUDA) were each said twice, once as `[rank 1] ...`; rank 0 says them for the run."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16})
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
                               "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                               "kernels": {"embedding": "torch"},
                               "train": {"epochs": 1, "max_steps": 2, "device": "cpu", "baseline": False}}))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "train.py"), "--config", str(cfg), "--tb-dir",
                             str(tmp_path / "tb"), "--run-name", "cmp", "--compare",
                             "eager,eager,triton-embedding+cudagraphs"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=CHILD_ENV)
    assert result.returncode == 0, process_output(result)
    out = result.stdout + result.stderr
    for said in ("'eager' given more than once", "the config's kernels.embedding \"torch\" replaced",
                 "skipping triton-embedding+cudagraphs: CUDA graphs need a CUDA device"):
        assert out.count(said) == 1, (said, out[-4000:])
    assert "[rank 1]" not in out, out[-4000:]


def test_a_plan_that_leaves_a_rank_without_rows_names_table_wise_where_it_serves_every_rank():
    """26 tables of 2 rows (`data.max_rows_per_table` 2) on 3 ranks, `sharding` "auto" with `balance` "lookups" and
    `row_wise_min_rows` 1 (or "row"): every table split in blocks of 1, 1 and 0 rows, rank 2 holds none. The refusal
    named fewer ranks alone; whole tables (9, 9 and 8 a rank) train on these 3, and the advice names them."""
    import pytest
    import torch

    from dlrm.config import Config, ConfigError, validate
    from dlrm.distributed.env import DistEnv
    from dlrm.train import builder
    from dlrm.train.setup import Tables

    cfg = validate(Config())
    cfg.distributed.row_wise_min_rows, cfg.distributed.balance = 1, "lookups"
    tables = Tables([2] * 26, None, "modulus", None)
    for mode in ("auto", "row"):
        cfg.distributed.sharding = mode
        with pytest.raises(ConfigError, match=rf"^distributed.sharding: '{mode}' leaves rank 2 without embedding rows "
                                              r"\(26 tables, 3 ranks\); use fewer ranks .*, or 'table' \(whole tables"):
            builder.make_sharding(cfg, tables, DistEnv(0, 3), torch.device("cpu"))
    cfg.distributed.sharding = "table"  # the advice, taken
    plan = builder.make_sharding(cfg, tables, DistEnv(0, 3), torch.device("cpu"))
    assert all(plan.local_rows(q) > 0 for q in range(3))
