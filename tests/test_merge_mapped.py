"""The merge reads the shards memory-mapped (`dlrm.mapped_load`) until OUT is written: a shard written in place
meanwhile (``cp`` over it) gave OUT another file's bytes at the first one's offsets without a word; now refused in one
line naming the shard, OUT not left behind. A shard replaced by a rename is not (the mapping holds the file it mapped).
Out of memory (a shard beyond ``ulimit -v``) is one line and exit 4, where it was a traceback."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed import merge as merge_mod
from tests.test_audit_checkpoint_files import save_sharded, tiny_state


@pytest.fixture
def manifest(tmp_path):
    return save_sharded(tmp_path / "run", tiny_state(step=3))


def _during_write(monkeypatch, act) -> None:
    """Run `act` as the merge starts writing OUT (its shards mapped, rank 0's dense tensors not yet read)."""
    real = merge_mod.write_atomic

    def write(out, state, **kwargs):
        act()
        return real(out, state, **kwargs)

    monkeypatch.setattr(merge_mod, "write_atomic", write)


def test_a_shard_written_in_place_during_the_merge_is_refused_and_out_is_not_left(manifest, tmp_path, monkeypatch):
    shard = manifest.parent / dist_ckpt.shard_name(3, 0, 2)
    other = save_sharded(tmp_path / "other", tiny_state(step=3))
    donor = (other.parent / dist_ckpt.shard_name(3, 0, 2)).read_bytes()

    def cp_over():  # what cp does: the same inode truncated and written again
        with open(shard, "r+b") as f:
            f.truncate(0)
            f.write(donor + b"\0" * 4096)  # (another size, as another run's file has in general)

    _during_write(monkeypatch, cp_over)
    out = tmp_path / "m.pt"
    with pytest.raises(ConfigError) as e:
        merge_mod.merge_to_file(manifest, out)
    assert str(e.value).startswith(f"{shard}: written while it was read (in place") and "\n" not in str(e.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".m.pt")]


def test_a_shard_replaced_by_a_rename_during_the_merge_merges_the_file_it_mapped(manifest, tmp_path, monkeypatch):
    shard = manifest.parent / dist_ckpt.shard_name(3, 0, 2)
    before = merge_mod.merge(manifest)

    def replace():  # an atomic write's rename: the mapped file stays whole
        tmp = shard.with_name("x.tmp")
        tmp.write_bytes(b"not a checkpoint")
        os.replace(tmp, shard)

    _during_write(monkeypatch, replace)
    out = tmp_path / "m.pt"
    merge_mod.merge_to_file(manifest, out)
    merged = ckpt.load_checkpoint(out)
    for key, value in before["model"].items():
        assert torch.equal(merged["model"][key], value), key


def test_out_of_memory_in_the_merge_is_one_line_and_exit_4(manifest, tmp_path, monkeypatch):
    def short(*_):
        raise MemoryError(f"{manifest}: 1.0 MiB more than the address space left (ulimit -v)")

    monkeypatch.setattr(merge_mod, "merge_to_file", short)
    result = CliRunner().invoke(merge_mod.main, [str(manifest), str(tmp_path / "m.pt")])
    assert result.exit_code == 4, result.output
    assert "Traceback" not in result.output and f"{manifest}: 1.0 MiB more than" in result.output, result.output
