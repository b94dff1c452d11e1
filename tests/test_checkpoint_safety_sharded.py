"""Sharded checkpoints are data too (issue #17): a two-rank sharded checkpoint of test_checkpoint_safety.py's
3-step run merges back into it, and a merge refuses, in one line naming the files, swapped or missing shards, a
manifest naming a file outside its directory, shards of different runs, a missing input, an existing output, a
dangling symlink and a file in place of the output's directory."""

import re
from pathlib import Path

import pytest
import torch

from dlrm.config import ConfigError
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.merge import merge_to_file
from dlrm.distributed.sharding import plan_sharding
from dlrm import checkpoint as ckpt
from tests import test_checkpoint_safety as safety
from tests.test_checkpoint_safety import StubEnv, assert_one_line_error, local_rows, raw_disk, run_cli

SPARSE = dist_ckpt.SPARSE_WEIGHT
# The 3-step run the tests take a checkpoint from; module-scoped, so this module trains its own (bound as a name,
# not imported as one, since the tests' parameters of that name would read to a linter as shadowing an import).
trained = safety.trained


def write_sharded(run_dir: Path, state: dict) -> tuple[Path, object]:
    """A two-rank sharded checkpoint of the one-process `state`, written by `save_sharded`."""
    plan = plan_sharding(state["cardinalities"], 2, "row", 1)
    sparse = state["optimizers"][1]
    for q in (1, 0):  # rank 0 last: it writes the manifest
        opt = {"param_groups": sparse["param_groups"],
               "state": {0: {"sum": local_rows(plan, q, sparse["state"][0]["sum"])}}}
        shard = {**state, "model": {**state["model"], SPARSE: local_rows(plan, q, state["model"][SPARSE])},
                 "optimizers": [state["optimizers"][0], opt]}
        path = dist_ckpt.save_sharded(run_dir, shard, state["position"]["step"], 5, StubEnv(q, 2), plan)
    return path, plan


def test_sharded_checkpoint_merges_and_bad_shards_are_named(trained, tmp_path):
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k != "format_version"}
    manifest, _ = write_sharded(tmp_path / "run", state)
    assert raw_disk(manifest)["format_version"] == 2 and "model" not in raw_disk(manifest)
    merged = merge_to_file(manifest, tmp_path / "merged.pt")
    assert torch.equal(merged["model"][SPARSE], state["model"][SPARSE])
    assert torch.equal(merged["optimizers"][1]["state"][0]["sum"], state["optimizers"][1]["state"][0]["sum"])
    ckpt.check_compatible(ckpt.load_checkpoint(tmp_path / "merged.pt"), trained["model"],
                          trained["tables"].cardinalities, trained["cfg"].to_dict()["model"], tmp_path / "merged.pt")
    with pytest.raises(ConfigError, match=r"manifest holds no model; merge it"):
        ckpt.check_compatible(ckpt.load_checkpoint(manifest), trained["model"], trained["tables"].cardinalities,
                              trained["cfg"].to_dict()["model"], manifest)
    with pytest.raises(ConfigError, match=r"merged.pt: already exists"):
        merge_to_file(manifest, tmp_path / "merged.pt")

    shards = sorted(manifest.parent.glob("*.rank*"))
    # swapped shard files: each names the rank it is
    a, b = shards[0].read_bytes(), shards[1].read_bytes()
    shards[0].write_bytes(b)
    shards[1].write_bytes(a)
    with pytest.raises(ConfigError, match=r"rank0-of-2.pt: the shard of rank 1, where .* names rank 0's"):
        merge_to_file(manifest, tmp_path / "m2.pt")
    shards[0].write_bytes(a)
    shards[1].write_bytes(b)
    # a manifest naming a file outside its directory
    disk = raw_disk(manifest)
    disk["sharded"]["shards"][1] = "../elsewhere.pt"
    torch.save(disk, manifest)
    with pytest.raises(ConfigError, match=r"checkpoint key 'sharded.shards' must be a list of 2 shard file names"):
        merge_to_file(manifest, tmp_path / "m3.pt")
    shards[1].unlink()
    disk["sharded"]["shards"][1] = shards[1].name
    torch.save(disk, manifest)
    with pytest.raises(ConfigError, match=rf"{shards[1].name}: checkpoint not found"):
        merge_to_file(manifest, tmp_path / "m4.pt")
    assert not any((tmp_path / f"m{i}.pt").exists() for i in (2, 3, 4))


def test_merge_cli_missing_file_and_existing_output(tmp_path):
    result = run_cli(["-m", "dlrm.distributed.merge", str(tmp_path / "nope.pt"), str(tmp_path / "out.pt")])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "nope.pt: checkpoint not found")
    (tmp_path / "out.pt").write_text("mine")
    (tmp_path / "in.pt").write_text("junk")
    result = run_cli(["-m", "dlrm.distributed.merge", str(tmp_path / "in.pt"), str(tmp_path / "out.pt")])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "out.pt: already exists")
    assert (tmp_path / "out.pt").read_text() == "mine"


def test_merge_refuses_shards_of_different_runs(trained, tmp_path):
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k != "format_version"}
    manifest, _ = write_sharded(tmp_path / "run", state)
    other = {**state, "config": {**state["config"], "train": {**state["config"]["train"], "seed": 4}}}
    other_manifest, _ = write_sharded(tmp_path / "other", other)
    # rank 1's shard replaced by the same-step shard of another run: the plan and shapes fit
    rank1 = manifest.parent / dist_ckpt.shard_name(state["position"]["step"], 1, 2)
    rank1.write_bytes((other_manifest.parent / rank1.name).read_bytes())
    with pytest.raises(ConfigError, match=r"rank0-of-2.pt, .*rank1-of-2.pt: shards of different runs.*"
                                          r"config.train.seed differs"):
        merge_to_file(manifest, tmp_path / "m.pt")
    result = run_cli(["-m", "dlrm.distributed.merge", str(manifest), str(tmp_path / "m.pt")])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "rank0-of-2.pt", str(rank1), "config.train.seed")
    assert not (tmp_path / "m.pt").exists()


def test_merge_refuses_shards_of_two_runs_of_one_config(trained, tmp_path):
    """Two runs of one config, seed and step (the second on a dataset regenerated in place, under the same run name):
    their shards told the same config, position and table sizes, and were merged into one model, run 1's embeddings
    beside run 2's (found by a QA pass, 2026-12-04). Their dense layers, alike on every rank of one run, differ."""
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k != "format_version"}
    manifest, _ = write_sharded(tmp_path / "run", state)
    name, weight = next((k, v) for k, v in state["model"].items() if not k.startswith("sparse_arch."))
    other = {**state, "model": {**state["model"], name: weight + 1.0}}  # another training's dense weights
    other_manifest, _ = write_sharded(tmp_path / "other", other)
    rank1 = manifest.parent / dist_ckpt.shard_name(state["position"]["step"], 1, 2)
    rank1.write_bytes((other_manifest.parent / rank1.name).read_bytes())
    with pytest.raises(ConfigError, match=rf"rank0-of-2.pt, .*rank1-of-2.pt: shards of different runs or steps "
                                          rf"\(model\.{re.escape(name)} differs\)"):
        merge_to_file(manifest, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()
    merge_to_file(other_manifest, tmp_path / "m2.pt")  # the other run's own shards still merge


def test_merge_refuses_a_dangling_symlink_or_a_file_as_out_directory(trained, tmp_path):
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k != "format_version"}
    manifest, _ = write_sharded(tmp_path / "run", state)
    link = tmp_path / "link.pt"
    link.symlink_to(tmp_path / "nowhere.pt")
    result = run_cli(["-m", "dlrm.distributed.merge", str(manifest), str(link)])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "link.pt: already exists")
    assert link.is_symlink() and not (tmp_path / "nowhere.pt").exists()  # the user's link is left as it was
    (tmp_path / "c.json").write_text("mine")
    result = run_cli(["-m", "dlrm.distributed.merge", str(manifest), str(tmp_path / "c.json" / "m7.pt")])
    assert result.returncode == 2
    # ("m7.pt: cannot write it: ..." named no argument; now the click path type's line names OUT)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "Invalid value for 'OUT'" in lines[0] and f"m7.pt: {tmp_path / 'c.json'} is not a directory" in lines[0]
    assert (tmp_path / "c.json").read_text() == "mine"
