"""A tool killed while `replace_dir` swapped its finished output in (`--overwrite` of an existing dataset) left the old
dataset under ``.<name>.old-<random>/``: between the two renames the user's dataset was gone from its place, hidden;
during the old one's removal (seconds to minutes for a large dataset) a partial copy stayed hidden for good. The next
run of that output (holding its lock) puts the first back and removes the second (`recover_replaced`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm.data.output_dirs import recover_replaced
from dlrm.data.relayout import relayout
from tests.test_relayout import lists_split  # noqa: F401 (a fixture)


def _dataset(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(text)
    return path


def test_killed_between_the_renames_the_old_output_comes_back(tmp_path):
    hidden = tmp_path / ".ds.old-k1ll3d_a"
    _dataset(hidden / "ds", "old")
    recover_replaced(tmp_path / "ds")
    assert (tmp_path / "ds" / "metadata.json").read_text() == "old"
    assert not hidden.exists()


def test_killed_while_removing_the_replaced_one_it_goes(tmp_path):
    _dataset(tmp_path / "ds", "new")
    hidden = tmp_path / ".ds.old-k1ll3d_b"
    _dataset(hidden / "ds", "old, half removed")
    other = _dataset(tmp_path / ".ds.old-notmine", "the user's")  # not the 8 characters tempfile adds: kept
    recover_replaced(tmp_path / "ds")
    assert (tmp_path / "ds" / "metadata.json").read_text() == "new"
    assert not hidden.exists() and other.exists()


def test_relayout_recovers_before_it_checks_its_output(lists_split, tmp_path):  # noqa: F811
    """The old output back where it was: refused without --overwrite (it is there again), replaced with it."""
    out = tmp_path / "slots"
    relayout(lists_split, out, "slots")
    hidden = tmp_path / ".slots.old-k1ll3d_c"
    hidden.mkdir()
    out.rename(hidden / "slots")  # killed between replace_dir's renames: --output missing, its dataset hidden
    with pytest.raises(Exception, match="refusing to overwrite non-empty"):
        relayout(lists_split, out, "slots")
    assert (out / "metadata.json").is_file() and not hidden.exists()
    relayout(lists_split, out, "slots", overwrite=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".slots.")] == []
