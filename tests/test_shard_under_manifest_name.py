"""A shard copied over its manifest (or given its name): the path given as the manifest is really a shard. The merge
refused it with "merge its manifest, X", --resume with "resume from its manifest (X)" and --eval-only/--export with
"python -m dlrm.distributed.merge X OUT.pt", X being that same file: advice that sent the user back to the shard. Now
the line says the file is a shard under its manifest's name, and which file to give instead."""

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
