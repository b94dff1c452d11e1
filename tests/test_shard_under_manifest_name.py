"""A shard copied over its manifest (or given its name): the path given as the manifest is really a shard. The merge
refused it with "merge its manifest, X", --resume with "resume from its manifest (X)" and --eval-only/--export with
"python -m dlrm.distributed.merge X OUT.pt", X being that same file: advice that sent the user back to the shard. Now
the line says the file is a shard under its manifest's name, and which file to give instead. A best shard under
another name (best.pt, model.pt) was sent to its step's step-N.pt: now its manifest is said to be unknowable from it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.env import DistEnv
from dlrm.distributed.merge import merge_to_file
from dlrm.train import export as export_mod
from dlrm.train.setup import Tables
from tests.test_audit_checkpoint_files import CARDS, save_sharded, tiny_config, tiny_state


@pytest.fixture
def shard_as_manifest(tmp_path):
    """A two-rank sharded checkpoint at step 3 whose manifest was replaced by a copy of rank 1's shard."""
    manifest = save_sharded(tmp_path / "run", tiny_state(step=3))
    shutil.copyfile(manifest.parent / dist_ckpt.shard_name(3, 1, 2), manifest)
    return manifest


def _said(manifest) -> str:
    return (f"{manifest}: rank 1's shard of a sharded checkpoint under its manifest's name, not the manifest (which "
            f"holds no model: it names every rank's shard); the {manifest.name} its run wrote beside the shards is "
            "the one to give")


def test_merge_says_the_manifest_is_a_shard(shard_as_manifest, tmp_path):
    with pytest.raises(ConfigError) as e:
        merge_to_file(shard_as_manifest, tmp_path / "m.pt")
    assert str(e.value) == _said(shard_as_manifest)  # was: "...; merge its manifest, <this same file>"
    assert not (tmp_path / "m.pt").exists()


def test_resume_says_the_manifest_is_a_shard(shard_as_manifest):
    with pytest.raises(ConfigError) as e:
        dist_ckpt.load_for_rank(shard_as_manifest, DistEnv(), None)
    assert str(e.value) == _said(shard_as_manifest)  # was: "...; resume from its manifest (step-00000003.pt)"


def test_eval_only_and_export_say_the_manifest_is_a_shard(shard_as_manifest, tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"model": tiny_config().to_dict()["model"], "train": {"device": "cpu"}}))
    cfg = load_config(tmp_path / "c.json", {})
    for portable in (False, True):  # --eval-only's model, --export's
        with pytest.raises(ConfigError) as e:  # was: "... python -m dlrm.distributed.merge <this same file> OUT.pt"
            export_mod.model_from_checkpoint(cfg, shard_as_manifest, Tables(list(CARDS), None, "modulus"),
                                             torch.device("cpu"), portable)
        assert str(e.value) == _said(shard_as_manifest)


def test_a_shard_under_its_own_name_still_names_its_manifest(tmp_path):
    manifest = save_sharded(tmp_path / "run", tiny_state(step=3))
    with pytest.raises(ConfigError) as e:
        merge_to_file(manifest.parent / dist_ckpt.shard_name(3, 1, 2), tmp_path / "m.pt")
    assert str(e.value).endswith(f"one shard of a sharded checkpoint; merge its manifest, {manifest}")


def _unknown(path, rank: int = 1) -> str:
    return (f"{path}: rank {rank}'s shard of a sharded checkpoint of 2 ranks at step 3, not a manifest (which holds no "
            "model: it names every rank's shard), under a name that does not say which manifest names it, nor can the "
            "file (a best.pt's shard holds what its step's does): its run's step-00000003.pt, or its best.pt (shards "
            f"best-step-00000003.rank{rank}-of-2.pt) where step 3 was the best evaluation; ")


@pytest.fixture
def best_shard(tmp_path):
    """Rank 1's shard of a two-rank run's best.pt (step 3), and the run's checkpoints/ folder."""
    from tests.test_audit_shardedbest import _save_best

    state = tiny_state(step=3)
    best = _save_best(save_sharded(tmp_path / "run", state), state)
    return best.parent / "best-step-00000003.rank1-of-2.pt", best.parent


@pytest.mark.parametrize("name", ["best.pt", "model.pt"])
def test_a_best_shard_under_another_name_is_not_sent_to_a_step_manifest(best_shard, tmp_path, name):
    """A best shard copied over best.pt (or to any name without `best-`) was refused with "one shard of a sharded
    checkpoint; merge its manifest, <dir>/step-00000003.pt": a step checkpoint that may never have been written (a best
    at an evaluation between checkpoints) or pruned since, and not the manifest that named it. Its name is all that
    told, so the line says what the file is (which rank, how many ranks, which step) and that its manifest cannot
    be known from it."""
    shard, d = best_shard
    copy = d / name if name == "best.pt" else tmp_path / name
    shutil.copyfile(shard, copy)
    with pytest.raises(ConfigError) as e:
        merge_to_file(copy, tmp_path / "m.pt")
    assert str(e.value) == _unknown(copy) + "merge its manifest, MANIFEST"
    with pytest.raises(ConfigError) as e:
        dist_ckpt.load_for_rank(copy, DistEnv(), None)
    assert str(e.value) == _unknown(copy) + "resume from its manifest (MANIFEST)"
    assert not (tmp_path / "m.pt").exists()
    (tmp_path / "c.json").write_text(json.dumps({"model": tiny_config().to_dict()["model"], "train": {"device": "cpu"}}))
    with pytest.raises(ConfigError) as e:  # --eval-only's, --export's
        export_mod.model_from_checkpoint(load_config(tmp_path / "c.json", {}), copy,
                                         Tables(list(CARDS), None, "modulus"), torch.device("cpu"))
    assert str(e.value) == _unknown(copy) + ("merge its manifest for one process first: python -m "
                                             "dlrm.distributed.merge MANIFEST OUT.pt")


def test_a_best_shard_under_its_own_name_still_names_best_pt(best_shard, tmp_path):
    shard, d = best_shard
    with pytest.raises(ConfigError) as e:
        merge_to_file(shard, tmp_path / "m.pt")
    assert str(e.value) == f"{shard}: one shard of a sharded checkpoint; merge its manifest, {d / 'best.pt'}"
