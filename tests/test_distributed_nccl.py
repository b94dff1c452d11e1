"""Two ranks on two GPUs (NCCL) train like one GPU: the cross network (DCN) over multi-hot features
with bf16 Triton table shards, under ``torchrun`` (issue #22's "sharding under torchrun", on GPUs).

tests/test_distributed_bf16.py makes the same comparison on the CPU (gloo ranks, Triton's
interpreter, the dot interaction) and explains the bounds: both sides round their bf16 tables
stochastically with independent bits, so the runs drift apart as two one-process runs with
different rounding seeds do. Here the Triton kernels are compiled for the GPU, the collectives are
NCCL's, and the model is the MLPerf one shrunk (D 16, two cross layers of rank 4). The dense math
runs in fp32 as on the CPU. The bounds were measured with this very model and data on the CPU
(gloo ranks against one process, both shardings, 2026-11-28), where the noise is the same bf16
stochastic rounding; each is about 2.5x the largest value seen there, in brackets below (the tables': 1.5x the
largest seen on two H200s, which spread more with the plan, see there). The cross
network's small bias vectors drift most (Adam normalises their noisy gradients), so the dense
parameters are compared by norm, not element by element.

Skipped unless two CUDA devices are visible (a multi-GPU device machine: `benchmarks/gpu_suite.sh
OUT nccl`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm import checkpoint as ckpt
from tests.conftest import REPO
from tests.test_distributed import BASE, MULTI_HOT_SIZES, merged_state
from tests.test_distributed_bf16 import FINAL_SR_SEED, SEED, STEPS, check_shards_are_bf16

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

DEVICE = "cuda"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Planted multi-hot data with "tiny" tables, variable fill (PAD slots too): 600 training rows,
    27 steps of 23 rows (the last of 2), as in tests/test_distributed_bf16.py."""
    from dlrm.data import synthetic

    root = tmp_path_factory.mktemp("nccl-data") / "multi-hot"
    synthetic.generate(root, 700, seed=4, cardinalities="tiny", validation_fraction=64 / 700, test_fraction=36 / 700,
                       multi_hot_sizes=MULTI_HOT_SIZES, multi_hot_fill="variable")
    return root


def dcn_config(path: Path, dataset: Path, sharding: str, cuda_graph="auto") -> Path:
    raw = json.loads(json.dumps(BASE))
    raw["model"].update({"embedding_dim": 16, "bottom_mlp": [32, 16], "top_mlp": [32, 1], "interaction": "dcn",
                         "cross_layers": 2, "cross_rank": 4, "embedding_dtype": "bf16"})
    raw["kernels"] = {"embedding": "triton"}
    raw["data"]["path"] = str(dataset)
    raw["train"]["seed"] = SEED  # FINAL_SR_SEED's (test_distributed_bf16 moved from BASE's seed 3 on 2026-12-01)
    raw["train"].update({"epochs": 1, "device": DEVICE, "precision": "fp32", "compile": False, "cuda_graph": cuda_graph})
    raw["checkpoint"]["every"] = 10  # checkpoints at 10, 20 and 27
    raw["distributed"] = {"sharding": sharding, "row_wise_min_rows": 10}
    path.write_text(json.dumps(raw))
    return path


def train_run(tmp: Path, dataset: Path, name: str, nproc: int, sharding: str = "row",
              cuda_graph="auto") -> tuple[Path, str]:
    """train.py in one process or under torchrun with `nproc` ranks: (run directory, its log)."""
    cfg = dcn_config(tmp / f"{name}.json", dataset, sharding, cuda_graph)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off, as the device machine's README asks
    result = subprocess.run([*launcher, str(REPO / "train.py"), "--config", str(cfg), "--run-name", name,
                             "--tb-dir", str(tmp / "tb")], cwd=tmp, capture_output=True, text=True, timeout=600, env=env)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return tmp / "tb" / name, log


def on_cpu(obj):
    """A checkpoint's tensors moved to the CPU (checkpoints of CUDA runs hold CUDA tensors)."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return type(obj)((k, on_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory, dataset):
    """One process on one GPU: (its last checkpoint, summary, run directory)."""
    tmp = tmp_path_factory.mktemp("nccl-one")
    run_dir, _ = train_run(tmp, dataset, "one", 1)
    return (torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False, map_location="cpu"), summary_of(run_dir),
            run_dir)


@pytest.mark.parametrize("sharding", ["table", "row"])
def test_two_gpus_with_bf16_shards_train_the_dcn_model_like_one_gpu(tmp_path, dataset, one_gpu, sharding):
    ref, ref_summary, ref_dir = one_gpu
    run_dir, log = train_run(tmp_path, dataset, f"two-{sharding}", 2, sharding)
    assert "backend nccl" in log and "device cuda:0" in log
    # train.cuda_graph "auto": the step, collectives included, is captured after DDP's 11 warm-up steps
    # (" with the batch's gathers from the device-resident split" between the two where the data sits on the GPU)
    assert re.search(r"captured the training step( with [^\n]*)? at batch size 23\n", log), log[-4000:]
    check_shards_are_bf16(run_dir)
    merged = on_cpu(merged_state(ckpt.list_checkpoints(run_dir)[-1], tmp_path, sharding)[1])
    assert merged["position"] == ref["position"] and merged["position"]["step"] == STEPS
    assert set(merged["model"]) == set(ref["model"])
    sparse, ref_sparse = merged["optimizers"][1]["state"][0], ref["optimizers"][1]["state"][0]
    assert sparse["sr_seed"].tolist() == ref_sparse["sr_seed"].tolist() == [FINAL_SR_SEED]
    summary = summary_of(run_dir)
    assert summary["world_size"] == 2 and summary["samples"] == ref_summary["samples"]
    assert len(summary["train_losses"]) == len(ref_summary["train_losses"]) > 0
    assert [s for s, _ in summary["train_losses"]] == [s for s, _ in ref_summary["train_losses"]]
    w, w_ref = merged["model"]["sparse_arch.weight"].float(), ref["model"]["sparse_arch.weight"].float()
    w10 = torch.load(ckpt.checkpoint_dir(ref_dir) / ckpt.checkpoint_name(10), weights_only=True, map_location="cpu")["model"]
    moved = (w_ref - w10["sparse_arch.weight"].float()).norm()
    # Every distance first, so that a failure shows them all: the tables' against how far training moved them,
    # the rest against their norm, the losses relative, the AUC absolute.
    drift = {"tables": float((w - w_ref).norm() / moved), "moved": float(moved / w_ref.norm()),
             "sparse sums": float((sparse["sum"] - ref_sparse["sum"]).norm() / ref_sparse["sum"].norm()),
             "loss": max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(summary["train_losses"],
                                                                      ref_summary["train_losses"])),
             "auc": abs(summary["auc"] - ref_summary["auc"])}
    dense = {k: float((merged["model"][k].float() - v.float()).norm() / (v.float().norm() + 1e-12))
             for k, v in ref["model"].items() if k != "sparse_arch.weight" and v.is_floating_point()}
    report = json.dumps({k: round(v, 4) for k, v in [*drift.items(), *sorted(dense.items(), key=lambda kv: -kv[1])]})
    assert drift["moved"] > 0.05, report  # training moved the tables [23.6% of their norm]
    assert drift["sparse sums"] < 0.08, report  # [3.0%; two H200s, table-wise placed by cost: 4.85%]
    # [CPU: 6.3-17.3% of that movement; two H200s, 2026-11-28: row-wise 7.1%, table-wise placed by lookups 22.3%,
    # table-wise placed by cost (the default) 40.9%, a plan that gave 6.3% on the CPU: the rounding noise, carried
    # along by Adam on 600 rows, differs that much between plans and machines. 1.5x the largest; the CPU tests
    # hold both shardings to one process exactly in fp32]
    assert drift["tables"] < 0.6, report
    # [CPU: cross-net biases 8.6-9.0%, its kernels and the top MLP's first layer 2-4.3%, the rest < 1.1%. Two H200s,
    # table-wise placed by cost (2026-11-28, this code and the commit before the sort overlap alike): a cross-net bias
    # 28.4%, as that plan's tables drift furthest (above). 1.5x the largest]
    assert max(dense.values()) <= 0.43, report
    assert drift["loss"] < 1e-2, report  # [0.19%; two H200s, table-wise placed by cost: 0.58%]
    assert drift["auc"] < 0.02, report  # [0.003]


def test_two_gpus_captured_step_trains_as_the_ordinary_step(tmp_path, dataset):
    """The whole-step CUDA graph of two ranks (the all_to_alls and DDP's all_reduce captured with the rest)
    replays the ordinary step's work: the same losses, tables, optimizer state and dense parameters, number
    for number (the same kernels in the same order; the stochastic rounding's seed advances on the device)."""
    runs = {}
    for graph in (True, False):
        run_dir, log = train_run(tmp_path, dataset, f"graph-{graph}", 2, "row", cuda_graph=graph)
        assert ("captured the training step" in log) == graph
        runs[graph] = (on_cpu(merged_state(ckpt.list_checkpoints(run_dir)[-1], tmp_path, f"graph-{graph}")[1]),
                       summary_of(run_dir))
    (a, sa), (b, sb) = runs[True], runs[False]
    assert sa["train_losses"] == sb["train_losses"] and sa["auc"] == sb["auc"]
    for k, v in b["model"].items():
        assert torch.equal(a["model"][k], v), k
    assert torch.equal(a["optimizers"][1]["state"][0]["sum"], b["optimizers"][1]["state"][0]["sum"])


def test_two_gpus_resumed_from_a_checkpoint_end_as_the_uninterrupted_run(tmp_path, dataset):
    """A two-rank NCCL run branched from its step-10 checkpoint (`--resume ... --run-name`) ends with the
    uninterrupted run's shards, and both merge (`dlrm.distributed.merge`, which compares every shard's dense
    layers with rank 0's bit for bit: DDP must have kept them identical on both GPUs, through the resume too)."""
    run_dir, _ = train_run(tmp_path, dataset, "straight", 2, "row")
    cdir = ckpt.checkpoint_dir(run_dir)
    cfg = tmp_path / "straight.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NCCL_NVLS_ENABLE"] = "0"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "train.py"), "--config", str(cfg), "--resume", str(cdir / ckpt.checkpoint_name(10)),
                             "--run-name", "branch", "--tb-dir", str(tmp_path / "tb")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    branch_dir = tmp_path / "tb" / "branch"
    assert summary_of(branch_dir)["resumed_at_step"] == 10
    assert summary_of(branch_dir)["train_losses"] == summary_of(run_dir)["train_losses"]
    a = on_cpu(merged_state(ckpt.list_checkpoints(run_dir)[-1], tmp_path, "straight")[1])
    b = on_cpu(merged_state(ckpt.list_checkpoints(branch_dir)[-1], tmp_path, "branch")[1])
    assert a["position"] == b["position"] and a["position"]["step"] == STEPS
    for k, v in a["model"].items():  # the same kernels in the same order from the same state: number for number
        assert torch.equal(b["model"][k], v), k
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        for pid, st in oa["state"].items():
            for name, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(ob["state"][pid][name], v), f"{pid}.{name}"
