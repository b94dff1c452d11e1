"""One output, one lock, however its path is spelled (`dlrm.data.output_dirs.output_lock`): an output reached
through a symlink was locked as ``.LINK.lock`` beside the link, so a second run writing the output by its own name
(``.out.lock``) went ahead at the same time (preprocess, which writes an unfinished dataset in place, could write
both runs' shards into one directory)."""

from __future__ import annotations

import click
import pytest

from dlrm.data.output_dirs import output_lock


@pytest.mark.parametrize("first,second", [("out", "link"), ("link", "out"), ("link", "sub/../out")])
def test_a_symlinked_spelling_of_a_locked_output_is_refused(tmp_path, first, second):
    (tmp_path / "out").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "out")
    (tmp_path / "sub").mkdir()
    with output_lock(tmp_path / first, "--out"):
        assert [p.name for p in tmp_path.glob(".*.lock")] == [".out.lock"]  # beside the output itself
        with pytest.raises(click.ClickException, match=r"in use by pid \d+"):
            with output_lock(tmp_path / second, "--out"):
                pass
    assert not list(tmp_path.glob(".*.lock"))  # released and removed


def test_an_output_inside_a_symlinked_directory_is_locked_once(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with output_lock(tmp_path / "alias" / "out", "--out"):
        assert (tmp_path / "real" / ".out.lock").is_file()
        with pytest.raises(click.ClickException, match="in use by"):
            with output_lock(tmp_path / "real" / "out", "--out"):
                pass
