"""Multi-process training (torchrun, gloo on the CPU): N ranks equal one process on the same
global batches, for table-wise and row-wise sharding; sharded checkpoints resume on the same
ranks and merge into a one-process checkpoint."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm.data.schema import read_metadata
from dlrm.distributed.merge import merge_to_file
from dlrm import checkpoint as ckpt
from tests.conftest import REPO, make_dataset, process_output
from tests.shared_once import computed_once

BASE = {
    # 278 rows: 12 batches of 23 (12 + 11 per rank), then 2 (1 + 1); 64 validation rows: 3 batches of 21, then one
    # row (on two ranks: that row and a padding row, Batch.pad)
    "data": {"batch_size": 23, "eval_batch_size": 21, "shuffle": True, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
              "schedule": {"warmup_steps": 5, "decay": "linear"}},
    "train": {"epochs": 2, "log_every": 9, "eval_every": 20, "device": "cpu", "seed": 3},
    "checkpoint": {"every": 10, "keep": 5},
}
STEPS = 26  # two epochs of 13 steps


# (the sharding plan's and the batch slices' unit tests: tests/test_distributed_units.py)


# ------------------------------------------------------------------------------------------
# two processes against one


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    make = lambda d: make_dataset(d / "ds", {"train": 278, "validation": 64, "test": 40}, row_group_size=50)  # noqa: E731
    return computed_once(tmp_path_factory, "dist-ds", make) / "ds"


def write_config(path, dataset, sharding="auto", embedding="torch", sparse_weight_decay=0.0):
    raw = json.loads(json.dumps(BASE))
    raw["kernels"] = {"embedding": embedding}
    raw["optim"]["sparse"]["weight_decay"] = sparse_weight_decay
    raw["data"]["path"] = str(dataset)
    raw["distributed"] = {"sharding": sharding, "row_wise_min_rows": 10}  # auto (balance "cost"): all whole on 2 ranks
    path.write_text(json.dumps(raw))
    return path


def run(args, cwd, nproc=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    # These runs are on the CPU (gloo, train.device "cpu") also on a GPU machine, where tests/conftest.py
    # leaves TRITON_INTERPRET unset: a Triton embedding on the CPU needs the interpreter.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([*launcher, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env)


def train_run(tmp_path, dataset, name, nproc, sharding="auto", extra=(), embedding="torch", sparse_weight_decay=0.0):
    cfg = write_config(tmp_path / f"{name}.json", dataset, sharding, embedding, sparse_weight_decay)
    result = run(["--config", str(cfg), "--run-name", name, "--tb-dir", str(tmp_path / "tb"), *extra], tmp_path, nproc)
    assert result.returncode == 0, process_output(result)
    return tmp_path / "tb" / name


def merged_state(manifest, tmp_path, name):
    """The sharded checkpoint `manifest` merged into ``{name}-merged.pt`` (in this process: the merge's command
    line, its exit codes and messages, is tested in tests/test_checkpoint_safety_sharded.py; a process a merge
    cost ~2 s)."""
    out = tmp_path / f"{name}-merged.pt"
    merge_to_file(Path(manifest), out)
    return out, torch.load(out, weights_only=False)


def assert_close_states(a, b):
    assert a["position"] == b["position"]
    assert set(a["model"]) == set(b["model"])
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    for oa, ob in zip(a["optimizers"], b["optimizers"]):
        for pid, st in ob["state"].items():
            for name, v in st.items():
                if torch.is_tensor(v):
                    torch.testing.assert_close(oa["state"][pid][name], v, rtol=1e-5, atol=1e-7, msg=f"{pid}.{name}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, dataset):
    run_dir = computed_once(tmp_path_factory, "dist-one", lambda d: train_run(d, dataset, "one", 1)) / "tb" / "one"
    return torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False), json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("sharding,embedding", [("table", "torch"), ("row", "torch"), ("row", "triton")])
def test_two_ranks_equal_one_process(tmp_path, dataset, one_process, sharding, embedding):
    """The reference is one eager process; "triton": each owner's shard is a Triton embedding whose
    backward applies the fused row-wise Adagrad update (under TRITON_INTERPRET on the CPU)."""
    ref_state, ref_summary = one_process
    run_dir = train_run(tmp_path, dataset, f"two-{sharding}", 2, sharding, embedding=embedding)
    manifest = ckpt.list_checkpoints(run_dir)[-1]
    assert manifest.name == ckpt.checkpoint_name(STEPS)
    shards = sorted(p.name for p in manifest.parent.glob(manifest.stem + ".rank*"))
    assert shards == [f"step-{STEPS:08d}.rank0-of-2.pt", f"step-{STEPS:08d}.rank1-of-2.pt"]
    # the local shards split the rows: table-wise whole tables, row-wise a block of each
    local_rows = [torch.load(manifest.parent / s, weights_only=False)["model"]["sparse_arch.weight"].shape[0] for s in shards]
    assert sum(local_rows) == 26 * 11 and min(local_rows) > 0
    out, merged = merged_state(manifest, tmp_path, sharding)
    assert_close_states(merged, ref_state)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples"] == ref_summary["samples"] == 2 * 278
    # AUC and logloss over all ranks' rows equal the one-process numbers
    for key in ("auc", "logloss", "accuracy"):
        assert summary[key] == pytest.approx(ref_summary[key], abs=1e-5), key
    for (s1, l1), (s2, l2) in zip(summary["train_losses"], ref_summary["train_losses"]):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)
    # best.pt: a manifest of its own shards, which merges into the one process's best.pt
    best = ckpt.checkpoint_dir(run_dir) / "best.pt"
    assert ckpt.load_checkpoint(best)["sharded"]["shards"] == [
        f"best-step-{summary['best']['step']:08d}.rank{q}-of-2.pt" for q in range(2)]
    assert summary["best"]["checkpoint"] == str(best) and summary["best"]["step"] == ref_summary["best"]["step"]
    _, merged_best = merged_state(best, tmp_path, f"{sharding}-best")
    ref_best = torch.load(Path(ref_summary["best"]["checkpoint"]), weights_only=False)
    assert_close_states(merged_best, ref_best)
    # the merged checkpoint serves one process: --eval-only gives the same validation numbers
    result = run(["--config", str(tmp_path / f"two-{sharding}.json"), "--eval-only", "--checkpoint", str(out),
                  "--run-name", "eval", "--tb-dir", str(tmp_path / "tb")], tmp_path)
    assert result.returncode == 0, process_output(result)
    evaluated = json.loads((tmp_path / "tb" / "eval" / "summary.json").read_text())
    assert evaluated["auc"] == pytest.approx(summary["auc"], abs=1e-6)


def test_sharded_resume_same_ranks_and_clear_refusals(tmp_path, dataset):
    run_dir = train_run(tmp_path, dataset, "res", 2, "auto")
    cdir = ckpt.checkpoint_dir(run_dir)
    straight = {p.name: torch.load(p, weights_only=False) for p in cdir.glob(f"step-{STEPS:08d}.rank*")}
    saved = tmp_path / "straight"
    shutil.copytree(cdir, saved)
    # resuming step 20 in place would overwrite the later checkpoints: refused on every rank, one line
    cfg = str(tmp_path / "res.json")
    result = run(["--config", cfg, "--resume", str(cdir / ckpt.checkpoint_name(20))], tmp_path, nproc=2)
    assert result.returncode != 0 and "not the latest checkpoint" in result.stderr  # torchrun exits 1 when a rank fails
    assert "this is a bug" not in result.stderr
    # continued from step 20 in a new run on two ranks: the same shards as the uninterrupted run
    result = run(["--config", cfg, "--resume", str(cdir / ckpt.checkpoint_name(20)), "--run-name", "res-branch",
                  "--tb-dir", str(tmp_path / "tb")], tmp_path, nproc=2)
    assert result.returncode == 0, process_output(result)
    # it went on from step 20 (a run trained from step 0 would end with the same shards)
    assert json.loads((tmp_path / "tb" / "res-branch" / "summary.json").read_text())["resumed_at_step"] == 20
    branch = ckpt.checkpoint_dir(tmp_path / "tb" / "res-branch")
    for name, ref in straight.items():
        got = torch.load(branch / name, weights_only=True)
        assert_close_states(got, ref)
    # one process cannot resume it, and says how
    # (a copy out of its run: --run-name NEW, the run directory's own rule, lets the shard check speak)
    result = run(["--config", cfg, "--resume", str(saved / ckpt.checkpoint_name(20)), "--run-name", "one-process",
                  "--tb-dir", str(tmp_path / "tb")], tmp_path)
    assert result.returncode == 2
    assert not (tmp_path / "tb" / "one-process").exists()  # refused before its first step: nothing left
    assert "written by 2 ranks, resumed by 1" in result.stderr and "dlrm.distributed.merge" in result.stderr
    # a different plan is named ("auto" put every table whole, as "table" would)
    other = write_config(tmp_path / "row.json", dataset, "row")
    result = run(["--config", str(other), "--resume", str(saved / ckpt.checkpoint_name(20)), "--run-name", "other-plan",
                  "--tb-dir", str(tmp_path / "tb")], tmp_path, nproc=2)
    assert result.returncode != 0 and "sharding plan differs" in result.stdout + result.stderr


@pytest.mark.parametrize("loader_name", ["parquet", "device"])
@pytest.mark.parametrize("world", [2, 3])
def test_loader_ranks_concatenate_to_the_one_process_batches(dataset, loader_name, world):
    from dlrm.data.device_loader import DeviceLoader
    from dlrm.data.loader import ParquetLoader

    files = sorted((dataset / "train").glob("*.parquet"))

    def make(rank, world_size):
        if loader_name == "device":
            return DeviceLoader(files, 23, "cpu", shuffle=True, seed=5, drop_last=False, rank=rank, world_size=world_size)
        return ParquetLoader(files, 23, "cpu", shuffle=True, seed=5, shuffle_buffer_rows=100, rank=rank, world_size=world_size)

    ref = list(make(0, 1))
    ranks = [list(make(r, world)) for r in range(world)]
    # 12 batches of 23 rows, then one of 2 rows: kept for 2 ranks, dropped for 3 (a rank would get none)
    assert len(ref) == 13 and all(len(r) == (13 if world == 2 else 12) for r in ranks)
    for i, batch in enumerate(ref[: len(ranks[0])]):
        parts = [r[i] for r in ranks]
        assert all(p.global_len == len(batch) and p.pad == 0 for p in parts)
        for field in ("dense", "sparse", "labels"):
            assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(batch, field))


@pytest.mark.parametrize("loader_name", ["parquet", "device"])
@pytest.mark.parametrize("world", [3, 4])
def test_evaluation_loader_ranks_keep_a_last_batch_smaller_than_world(dataset, loader_name, world):
    """An evaluation's loader (pad_ranks) keeps the 2-row last batch on 3 and 4 ranks: the ranks without a row
    get the batch's last row as padding (Batch.pad), and every batch's real rows joined in rank order are the one
    process's batch."""
    from dlrm.data.device_loader import DeviceLoader
    from dlrm.data.loader import ParquetLoader

    files = sorted((dataset / "train").glob("*.parquet"))

    def make(rank, world_size):
        if loader_name == "device":
            return DeviceLoader(files, 23, "cpu", rank=rank, world_size=world_size, pad_ranks=True)
        return ParquetLoader(files, 23, "cpu", prefetch=1, rank=rank, world_size=world_size, pad_ranks=True)

    ref = list(make(0, 1))
    ranks = [list(make(r, world)) for r in range(world)]
    assert len(ref) == 13 and all(len(r) == 13 == len(make(q, world)) for q, r in enumerate(ranks))
    assert [p.pad for p in ranks[-1]] == [0] * 12 + [1] and [len(p) for p in (r[-1] for r in ranks)] == [1] * world
    for i, batch in enumerate(ref):
        parts = [r[i] for r in ranks]
        assert all(p.global_len == len(batch) for p in parts)
        for field in ("dense", "sparse", "labels"):
            assert torch.equal(torch.cat([p.real(getattr(p, field)) for p in parts]), getattr(batch, field))
        for p in parts:
            if p.pad:  # the padding row repeats the batch's last row
                assert torch.equal(p.sparse, batch.sparse[-1:]) and p.real(p.labels).shape == (0,)


def test_scaling_efficiency_uses_the_one_gpu_row_closest_in_time():
    """Device calls can land on different machines: each N-GPU row is divided by the 1-GPU row (same config,
    precision, batch and device) measured closest to it, before or after."""
    from tests.test_benchmark_scripts import load_script  # by path: benchmarks/kernels.py must not shadow `kernels`

    scaling = load_script("scaling")

    def row(gpus, rate, date, config="m.json"):
        return {"gpus": gpus, "config": config, "precision": "bf16", "batch_per_gpu": 64, "device": "H",
                "samples_per_sec": rate, "date": date}

    rows = [row(1, 100.0, "2026-11-28 09:00"), row(2, 150.0, "2026-11-28 09:02"),
            row(2, 180.0, "2026-11-28 10:01"), row(1, 120.0, "2026-11-28 10:02"), row(2, 90.0, "2026-11-28 10:03", "k.json")]
    scaling.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.75, 0.75, 1.0, ""]


@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
def test_scaling_benchmark_runs_and_reports_efficiency(tmp_path, multi_hot):
    """Smoke run of benchmarks/scaling.py on the CPU (gloo): one process, then two ranks; also with multi-hot
    sizes in the config (the synthetic batches then have their slots: they had 26 columns before)."""
    cfg = json.loads((REPO / "configs" / "kaggle.json").read_text())
    cfg["model"]["cardinalities"] = [40] * 26
    if multi_hot:
        cfg["model"]["multi_hot_sizes"] = [3, 1, 2] + [1] * 23
    cfg["train"]["device"] = "cpu"  # two ranks on a machine with one GPU, too
    (tmp_path / "k.json").write_text(json.dumps(cfg))
    for n in (1, 2):
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                                 str(REPO / "benchmarks" / "scaling.py"), "--config", str(tmp_path / "k.json"),
                                 "--batch-per-gpu", "64", "--warmup", "1", "--steps", "2", "--windows", "1",
                                 "--out", str(tmp_path), "--name", "s", *(["--profile"] if multi_hot else [])],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, process_output(result)
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert [r["gpus"] for r in rows] == ["1", "2"] and rows[1]["sharding"] == "auto"
    assert float(rows[0]["efficiency"]) == 1.0 and float(rows[1]["efficiency"]) > 0
    assert (tmp_path / "s.md").is_file() and (tmp_path / "s.png").stat().st_size > 0
    if multi_hot:  # --profile: every rank's profile, written by rank 0
        for n in (1, 2):
            prof = list(csv.DictReader(open(tmp_path / f"s_profile_{n}gpu.csv")))
            assert {r["rank"] for r in prof} == {str(r) for r in range(n)}
            for r in range(n):  # each rank's categories (the idle row included) add up to the step
                mine = [row for row in prof if row["rank"] == str(r)]
                assert any(row["category"].startswith("idle") for row in mine)
                assert sum(float(row["share_of_step"]) for row in mine) >= 0.999
            assert "Longest kernels:" in (tmp_path / f"s_profile_{n}gpu.md").read_text()
        # the 2 ranks' collectives (gloo's all_to_all of the sharded tables, DDP's all_reduce) have their own group
        assert any(row["category"] == "collectives (NCCL)" for row in prof), {row["category"] for row in prof}


def test_compare_and_profile_under_torchrun(tmp_path, dataset):
    """Rank 0 writes the comparison reports and the TensorBoard run; every rank writes a trace."""
    cfg = json.loads(write_config(tmp_path / "c.json", dataset, "table").read_text())
    cfg["train"].update({"epochs": 1})
    cfg["profile"] = {"enabled": True, "wait": 1, "warmup": 1, "active": 2}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    result = run(["--config", str(tmp_path / "c.json"), "--compare", "eager", "--run-name", "cmp",
                  "--tb-dir", str(tmp_path / "tb")], tmp_path, nproc=2)
    assert result.returncode == 0, process_output(result)
    base = tmp_path / "tb" / "cmp"
    assert {"compare.md", "compare.csv", "compare.png"} <= {p.name for p in base.iterdir()}
    rows = list(csv.DictReader(open(base / "compare.csv")))
    assert [r["variant"] for r in rows] == ["eager"] and rows[0]["status"] == "ok"
    traces = list((base / "eager").glob("*.pt.trace.json.gz"))
    assert len(traces) == 2  # one per rank (worker names carry the pid)
    assert len(list((base / "eager").glob("events.out.tfevents.*"))) == 1  # rank 0 only


def test_sigterm_under_torchrun_stops_all_ranks_at_one_step(tmp_path, dataset):
    """torchrun passes SIGTERM to every rank; the ranks agree through the next logging window's read (the step
    after its logging step), write one sharded checkpoint there, and rank 0 says where they stopped (an agreed stop is
    said once: every rank said it, one line a rank, until session 59)."""
    import signal
    import time

    raw = json.loads(write_config(tmp_path / "s.json", dataset, "row").read_text())
    raw["train"].update({"epochs": 10_000, "log_every": 5, "eval_every": None})
    # the first checkpoint, which the signal waits for, at step 40: the next (80) far from where the stop comes. At
    # step 10 (tried 2026-12-01) the signal could come before step 20's checkpoint, where the ranks stopped instead
    raw["checkpoint"] = {"every": 40, "keep": 5}
    (tmp_path / "s.json").write_text(json.dumps(raw))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "train.py"), "--config", str(tmp_path / "s.json"), "--run-name", "sig",
                             "--tb-dir", str(tmp_path / "tb")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "tb" / "sig"
    deadline = time.time() + 120
    while not ckpt.list_checkpoints(run_dir) and time.time() < deadline:
        time.sleep(0.2)
    assert ckpt.list_checkpoints(run_dir), "no checkpoint before the deadline"
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    stops = re.findall(r"stopped by signal at step (\d+)", out)
    assert len(stops) == 1 and "[rank 1]" not in out.split("stopped by signal")[0][-200:], out[-3000:]
    step = int(stops[0])
    assert step % 5 == 1  # the step after a logging step, where its window (and the ranks' flags) is read
    manifest = ckpt.list_checkpoints(run_dir)[-1]
    assert manifest.name == ckpt.checkpoint_name(step)
    assert len(list(manifest.parent.glob(manifest.stem + ".rank*-of-2.pt"))) == 2


def test_world_size_without_torchrun_is_a_clear_error(tmp_path, dataset):
    cfg = write_config(tmp_path / "w.json", dataset)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(cfg), "--tb-dir", str(tmp_path / "tb")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env, "WORLD_SIZE": "2"})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "WORLD_SIZE is 2" in errors[0] and "torchrun" in errors[0]
    assert not (tmp_path / "tb").exists()  # nothing written


def test_pruning_removes_old_manifests_with_their_shards(tmp_path):
    d = ckpt.checkpoint_dir(tmp_path)
    d.mkdir()
    for step in (10, 20, 30):
        (d / ckpt.checkpoint_name(step)).write_bytes(b"m")
        for r in range(2):
            (d / f"step-{step:08d}.rank{r}-of-2.pt").write_bytes(b"s")
    (d / ".step-00000040.rank0-of-2.pt.abc.tmp").write_bytes(b"t")  # a shard being written
    ckpt.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [".step-00000040.rank0-of-2.pt.abc.tmp"]
        + [f"step-{s:08d}{x}.pt" for s in (20, 30) for x in ("", ".rank0-of-2", ".rank1-of-2")])


# ------------------------------------------------------------------------------------------
# multi-hot tables sharded over ranks


MULTI_HOT_SIZES = [3, 1, 2] + [1] * 20 + [4, 1, 2]  # L = 34 slots, variable fill: empty (PAD) slots too


@pytest.fixture(scope="module")
def multi_hot_dataset(tmp_path_factory):
    from dlrm.data import synthetic

    def make(d):
        synthetic.generate(d / "ds", 378, seed=4, cardinalities="tiny", multi_hot_sizes=MULTI_HOT_SIZES,
                           multi_hot_fill="variable", validation_fraction=64 / 378, test_fraction=36 / 378)

    root = computed_once(tmp_path_factory, "dist-mh", make) / "ds"
    assert read_metadata(root).splits["train"].rows == 278  # BASE's two epochs of 13 steps
    return root


@pytest.mark.parametrize("sharding", ["table", "row"])
def test_two_ranks_equal_one_process_with_multi_hot_tables(tmp_path, tmp_path_factory, multi_hot_dataset, sharding):
    """Sum-pooled multi-hot features under torchrun: ids are exchanged per slot (an empty one is
    skipped), each owner pools its block's slots per feature, the requesting rank sums the row-wise
    blocks; two ranks train exactly like one process."""
    one = computed_once(tmp_path_factory, "dist-one-mh",
                        lambda d: train_run(d, multi_hot_dataset, "one-mh", 1)) / "tb" / "one-mh"
    two = train_run(tmp_path, multi_hot_dataset, f"two-mh-{sharding}", 2, sharding)
    ref_state = torch.load(ckpt.list_checkpoints(one)[-1], weights_only=False)
    assert ref_state["multi_hot_sizes"] == MULTI_HOT_SIZES
    _, merged = merged_state(ckpt.list_checkpoints(two)[-1], tmp_path, f"mh-{sharding}")
    assert merged["multi_hot_sizes"] == MULTI_HOT_SIZES
    assert_close_states(merged, ref_state)
    ref, summary = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    for (s1, l1), (s2, l2) in zip(summary["train_losses"], ref["train_losses"]):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)
    assert summary["auc"] == pytest.approx(ref["auc"], abs=1e-5)


# A large decay, so that one wrongly decayed row moves the checkpoint well past assert_close_states' bounds.
DECAY = 0.2
# The decay runs train one epoch (13 steps), not BASE's two: every step masks ids on both ranks and pads rank 1's
# slice (12 + 11 rows), and the epoch's last global batch (2 rows) is its step 13, so one epoch has every lookup the
# decay must skip; a wrongly decayed row shows in the step-13 checkpoint as it did in the step-26 one. Under the
# Triton interpreter a step costs ~0.6 s (26 features: ~100 programs of the lookup and exchange kernels a rank and
# step), and the second epoch cost ~8 s of the [triton] test's 27 s and of the multi-hot one's 21 s (CI, 2026-12-01).
DECAY_EXTRA = ("--epochs", "1")
DECAY_STEPS = 13
# With decay, Triton shards are TritonPooledEmbedding modules, run on the CPU under the interpreter here, also on the GPU
# machine (its image's Triton 3.6 interpreter runs them since `kernels._interpreter` fixed its scalar loop bounds under
# NumPy 2.4; until 2026-12-01 they were skipped there).


@pytest.fixture(scope="module")
def one_process_decay(tmp_path_factory, dataset):
    run_dir = computed_once(tmp_path_factory, "dist-one-decay",
                            lambda d: train_run(d, dataset, "one-decay", 1, extra=DECAY_EXTRA,
                                                sparse_weight_decay=DECAY)) / "tb" / "one-decay"
    return torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False), json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("embedding", ["torch", "triton"])
def test_sparse_weight_decay_two_ranks_equal_one_process(tmp_path, dataset, one_process_decay, embedding):
    """Lazy sparse weight decay under torchrun. Row-wise sharding masks every id that another rank's
    block serves, and the last global batch (2 rows) pads rank 1; such lookups point at a shard's first
    row with a zero gradient. They must skip the update (the torch kernel leaves them out of its sparse
    gradient, a Triton shard gets them as skipped PAD slots): one process never decays a row for them."""
    ref_state, ref_summary = one_process_decay
    run_dir = train_run(tmp_path, dataset, f"decay-{embedding}", 2, "row", extra=DECAY_EXTRA, embedding=embedding,
                        sparse_weight_decay=DECAY)
    _, merged = merged_state(ckpt.list_checkpoints(run_dir)[-1], tmp_path, f"decay-{embedding}")
    assert merged["position"]["step"] == DECAY_STEPS
    assert_close_states(merged, ref_state)
    summary = json.loads((run_dir / "summary.json").read_text())
    for (s1, l1), (s2, l2) in zip(summary["train_losses"], ref_summary["train_losses"]):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)


def test_sparse_weight_decay_two_ranks_equal_one_process_with_multi_hot_tables(tmp_path, multi_hot_dataset):
    """The same with multi-hot tables: empty slots are masked too. The reference is one eager process
    (PooledSparseArch, whose gradient also leaves PAD slots out); the two ranks hold Triton shards."""
    one = train_run(tmp_path, multi_hot_dataset, "one-mh-decay", 1, extra=DECAY_EXTRA, sparse_weight_decay=DECAY)
    two = train_run(tmp_path, multi_hot_dataset, "two-mh-decay", 2, "row", extra=DECAY_EXTRA, embedding="triton",
                    sparse_weight_decay=DECAY)
    ref_state = torch.load(ckpt.list_checkpoints(one)[-1], weights_only=False)
    _, merged = merged_state(ckpt.list_checkpoints(two)[-1], tmp_path, "mh-decay")
    assert merged["position"]["step"] == DECAY_STEPS
    assert_close_states(merged, ref_state)
