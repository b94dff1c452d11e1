"""Sharded checkpoints (audit): a shard of another run, resumed.

1. `--resume` of a sharded checkpoint one of whose shards is another run's, at the same step (a copied file: its plan,
   shapes and position fit), loaded that shard into its rank without a word: the run went on with a model of two
   runs (and dense weights other than the other ranks'), exit 0. `python -m dlrm.distributed.merge` refused the same
   checkpoint ("shards of different runs"). Each rank now compares its shard's config and table sizes with its
   manifest's: one line naming the shard file and the first key that differs, exit 2 on every rank.
2. ``--resume <run>/checkpoints/best.pt`` of a sharded run whose best evaluation is its latest checkpoint's step was
   refused as "not the latest checkpoint ... resuming it in place would overwrite the later ones" (there are none),
   where one process resumes its best.pt there (a hard link to the step's file: tests/test_audit_reporting_edges.py).
   A sharded best.pt is a manifest of its own whose shards are hard links to the step's: the shard files are compared
   now. best.pt at an earlier step is still refused.
3. ``--eval-only`` or ``--export`` of one shard file (``step-N.rankQ-of-W.pt``, ``best-step-N.rankQ-of-W.pt``, what a
   sharded run's checkpoints/ lists beside its manifests) said "sparse_arch.weight has shape (299, 4) in the
   checkpoint, (598, 4) here", which reads as other data or another config. Now it names the file a shard and the
   manifest to merge, as `--resume` and the merge of a shard do.
4. A shard of another run of the same config, seed and step (the same run name, on a dataset regenerated in place)
   fits its manifest in everything 1 compares: the resume went on, exit 0, each rank training its own dense layers
   from then on (every later checkpoint held two models; the merge refuses them). Each rank but 0 now compares its
   shard's dense layers with rank 0's, as the merge does (`dlrm.distributed.same_run`): one line naming both files
   and the first tensor that differs, exit 2 on every rank, before the first step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, load_config
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.sharding import plan_sharding
from dlrm.train import export as export_mod
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.setup import Tables
from dlrm.train.run_dir import RunDirectory
from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, REPO, make_dataset
from tests.test_audit_checkpoint_files import CARDS, save_sharded, tiny_config, tiny_state
from tests.test_checkpoint_safety import StubEnv


# -- 1. a shard of another run -----------------------------------------------------------------------------------------

def test_a_shard_of_another_run_at_the_same_step_is_not_resumed(tmp_path):
    """Run "mine" and run "other" (train.seed 4) at step 3 under the same plan: rank 1's shard of "mine" replaced by
    "other"'s. Rank 1's load for the resume is refused, naming the file and config.train.seed; rank 0's (its own
    shard) still loads."""
    manifest = save_sharded(tmp_path / "mine", tiny_state())
    other_cfg = tiny_config()
    other_cfg.train.seed = 4
    other = save_sharded(tmp_path / "other", tiny_state(cfg=other_cfg))
    rank1 = manifest.parent / dist_ckpt.shard_name(3, 1, 2)
    shutil.copyfile(other.parent / rank1.name, rank1)
    plan = plan_sharding(CARDS, 2, "row", 1)
    assert dist_ckpt.load_for_rank(manifest, StubEnv(0, 2), plan)["rank"] == 0
    with pytest.raises(ConfigError) as e:  # was: rank 1's state returned, another run's model
        dist_ckpt.load_for_rank(manifest, StubEnv(1, 2), plan)
    message = str(e.value)
    assert message.startswith(f"{rank1}: config.train.seed differs from its manifest {manifest}")
    assert "\n" not in message


def test_a_shard_of_another_run_of_the_same_config_is_not_resumed(tmp_path):
    """Rank 1's shard of "mine" replaced by the same-step shard of "other", whose config is the same and dense layers
    another training's: rank 1's load is refused, naming both shard files and the first dense tensor that differs;
    rank 0's still loads, and so does rank 1's of the run's own shards."""
    state = tiny_state()
    manifest = save_sharded(tmp_path / "mine", state)
    name, weight = next((k, v) for k, v in state["model"].items() if not k.startswith("sparse_arch."))
    other = save_sharded(tmp_path / "other", {**state, "model": {**state["model"], name: weight + 1e-6}})
    plan = plan_sharding(CARDS, 2, "row", 1)
    assert dist_ckpt.load_for_rank(manifest, StubEnv(1, 2), plan)["rank"] == 1  # the run's own shards
    rank0, rank1 = (manifest.parent / dist_ckpt.shard_name(3, q, 2) for q in (0, 1))
    shutil.copyfile(other.parent / rank1.name, rank1)
    assert dist_ckpt.load_for_rank(manifest, StubEnv(0, 2), plan)["rank"] == 0
    with pytest.raises(ConfigError) as e:  # was: rank 1's state returned, another run's dense layers
        dist_ckpt.load_for_rank(manifest, StubEnv(1, 2), plan)
    assert str(e.value) == (f"{rank0}, {rank1}: shards of different runs or steps (model.{name} differs); {manifest} "
                            "names shards of two runs: put this run's own shard back, or resume from another of its "
                            "checkpoints")


# -- 2. best.pt at the latest step, resumed in place -------------------------------------------------------------------

def _save_best(manifest, state):
    """best.pt of the sharded checkpoint `manifest` (its step just saved: each rank links its shard, as a run does)."""
    plan = plan_sharding(CARDS, 2, "row", 1)
    best = manifest.parent / "best.pt"
    for q in (1, 0):  # rank 0 last: it writes the manifest
        shard = dist_ckpt.load_shard(manifest, ckpt.load_checkpoint(manifest), q)
        dist_ckpt.save_best_sharded(best, shard, state["position"]["step"], StubEnv(q, 2), plan, Checkpointer._link,
                                    manifest)
    return best


def test_a_sharded_best_pt_at_the_latest_step_resumes_in_place(tmp_path):
    run = tmp_path / "tb" / "r"
    cfg = tiny_config()
    cfg.log.tb_dir = str(tmp_path / "tb")
    state = tiny_state(step=3)
    manifest = save_sharded(run, state)
    best = _save_best(manifest, state)
    d = best.parent
    for q in range(2):  # hard links to the step's shards: one checkpoint
        assert (d / f"best-step-00000003.rank{q}-of-2.pt").samefile(d / dist_ckpt.shard_name(3, q, 2))
    opened, copied = RunDirectory.for_resume(cfg, best, manifest)  # was: ConfigError "not the latest checkpoint"
    try:
        assert opened.path == run and not copied
    finally:
        opened.close()
    later = save_sharded(run, tiny_state(step=6))  # a later checkpoint: best.pt (step 3) is not the latest
    with pytest.raises(ConfigError, match="best.pt is not the latest checkpoint of run 'r' \\(step-00000006.pt is\\)"):
        RunDirectory.for_resume(cfg, best, later)


# -- 3. one shard evaluated or exported ------------------------------------------------------------------------------

def test_evaluating_or_exporting_one_shard_names_its_manifest(tmp_path):
    state = tiny_state(step=3)
    manifest = save_sharded(tmp_path / "r", state)
    best = _save_best(manifest, state)
    tables = Tables(list(CARDS), None, "modulus")
    model = tiny_config().to_dict()["model"]
    (tmp_path / "c.json").write_text(json.dumps({"model": model, "train": {"device": "cpu"}}))
    cfg = load_config(tmp_path / "c.json", {})  # as the command line's (its "auto" settings resolvable)
    for shard, named in ((manifest.parent / dist_ckpt.shard_name(3, 1, 2), manifest),
                         (best.parent / "best-step-00000003.rank0-of-2.pt", best)):
        for portable in (False, True):  # --eval-only's model, --export's
            with pytest.raises(ConfigError) as e:  # was: "sparse_arch.weight has shape (4, 4) in the checkpoint, ..."
                export_mod.model_from_checkpoint(cfg, shard, tables, torch.device("cpu"), portable)
            assert str(e.value) == (f"{shard}: one shard of a sharded checkpoint; merge its manifest for one process "
                                    f"first: python -m dlrm.distributed.merge {named} OUT.pt")


# -- the same through train.py on two gloo ranks ----------------------------------------------------------------------

CONFIG = {
    "data": {"batch_size": 20, "eval_batch_size": 10, "shuffle": True, "drop_last": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 3, "eval_every": 3, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 3, "keep": 5},
    "distributed": {"sharding": "table"},
}  # 120 train rows in global batches of 20: 6 steps; checkpoints and evaluations at 3 and 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shardedbest") / "ds"
    make_dataset(root, {"train": 120, "validation": 40}, row_group_size=20, cardinality=23)
    return root


def launch(tmp_path, dataset, args, world=2, config=None):
    """``train.py`` on `world` gloo ranks (as torchrun starts them); [(exit code, output)] by rank."""
    cfg = json.loads(json.dumps(config or CONFIG))
    cfg["data"]["path"] = str(dataset)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "train.py", "--config", str(tmp_path / "c.json"), "--tb-dir", str(tmp_path / "tb"), *args]
    with reserved_port() as port:  # (held until every rank is done: tests/_ports.py)
        env = {**CHILD_ENV, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TRITON_INTERPRET": "1"}
        procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
        try:
            return [(p.wait(timeout=150), p.stdout.read()) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def said_once_by_rank_0(results) -> str:
    """The one ERROR line of a refusal every rank reached alike: exit 2 on every rank, no traceback, the line said by
    rank 0 alone (`dlrm.distributed.said_once`, `dlrm.cli.report_failure`: rank 1 printed it again as "[rank 1] ..."
    before 2026-12-04)."""
    for rank, (code, out) in enumerate(results):
        assert code == 2 and "Traceback" not in out, f"rank {rank} exited {code}:\n{out[-3000:]}"
    errors = [[line for line in out.splitlines() if "ERROR" in line] for _, out in results]
    assert len(errors[0]) == 1 and not any(errors[1:]), errors
    return errors[0][0]


def test_resuming_with_another_runs_shard_stops_every_rank_in_one_line(tmp_path, dataset):
    """Two 2-rank runs of the same config but train.seed (3 and 5), stopped at step 3; "mine"'s rank-1 shard replaced
    by "other"'s: the resume exited 0 on both ranks, training on from two runs' shards."""
    for name, seed in (("mine", "3"), ("other", "5")):
        results = launch(tmp_path, dataset, ["--run-name", name, "--seed", seed, "--max-steps", "3"])
        assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    d, other = ckpt.checkpoint_dir(tmp_path / "tb" / "mine"), ckpt.checkpoint_dir(tmp_path / "tb" / "other")
    rank1 = d / dist_ckpt.shard_name(3, 1, 2)
    shutil.copyfile(other / rank1.name, rank1)
    results = launch(tmp_path, dataset, ["--run-name", "mine", "--seed", "3", "--resume"])
    error = said_once_by_rank_0(results)
    assert rank1.name in error and "config.train.seed differs" in error, error
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "tb" / "mine")] == ["step-00000003.pt"]


def test_resuming_with_a_shard_of_a_run_of_the_same_config_stops_every_rank_in_one_line(tmp_path):
    """Run "mine" stopped at step 3 and set aside; the dataset regenerated in place (other rows) and "mine" run again
    to step 3, with the same command line; the first run put back with the second's rank-1 shard. Its config, seed,
    plan and position are the first run's: the resume trained on, exit 0 on both ranks (each rank's dense layers its
    own run's from then on). Now every rank stops before its first step, naming both shard files."""
    dataset = tmp_path / "ds"
    args = ["--run-name", "mine", "--max-steps", "3"]
    make_dataset(dataset, {"train": 120, "validation": 40}, row_group_size=20, cardinality=23, seed=1)
    assert [code for code, _ in launch(tmp_path, dataset, args)] == [0, 0]
    run, first = tmp_path / "tb" / "mine", tmp_path / "first"
    run.rename(first)
    make_dataset(dataset, {"train": 120, "validation": 40}, row_group_size=20, cardinality=23, seed=2)
    assert [code for code, _ in launch(tmp_path, dataset, args)] == [0, 0]
    second = ckpt.checkpoint_dir(run) / dist_ckpt.shard_name(3, 1, 2)
    rank1 = ckpt.checkpoint_dir(first) / second.name
    rank1.unlink()  # (a hard link to best.pt's shard: that one is left as it is)
    shutil.copyfile(second, rank1)
    shutil.rmtree(run)
    first.rename(run)
    make_dataset(dataset, {"train": 120, "validation": 40}, row_group_size=20, cardinality=23, seed=1)
    rank0, rank1 = (ckpt.checkpoint_dir(run) / dist_ckpt.shard_name(3, q, 2) for q in (0, 1))
    results = launch(tmp_path, dataset, ["--run-name", "mine", "--resume"])
    error = said_once_by_rank_0(results)
    assert f"{rank0}, {rank1}: shards of different runs or steps (model." in error, error
    assert not any("resumed from" in out for _, out in results), results[0][1][-3000:]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000003.pt"]


def test_a_damaged_rank0_shard_is_reported_by_rank_0_not_as_a_bug_of_rank_1(tmp_path, dataset):
    """Rank 0's shard truncated (a copy cut short): rank 0 refuses it in one line, exit 2, and every other rank says
    that rank 0 could not resume. Rank 1's comparison with rank 0's shard (`same_run.check_resumed_shard`) read that
    file memory-mapped and raised torch's own error first ("OSError: [Errno 22] Invalid argument", no file named): a
    bug's traceback, exit 1, beside rank 0's exit 2."""
    args = ["--run-name", "mine", "--max-steps", "3"]
    assert [code for code, _ in launch(tmp_path, dataset, args)] == [0, 0]
    rank0 = ckpt.checkpoint_dir(tmp_path / "tb" / "mine") / dist_ckpt.shard_name(3, 0, 2)
    data = rank0.read_bytes()
    rank0.unlink()  # (a hard link to best.pt's shard: that one is left whole)
    rank0.write_bytes(data[: len(data) // 2])
    results = launch(tmp_path, dataset, ["--run-name", "mine", "--resume"])
    error = said_once_by_rank_0(results)  # (rank 1's relay of rank 0's failure is that same line: said once)
    assert f"{rank0}: not a readable checkpoint" in error, error
