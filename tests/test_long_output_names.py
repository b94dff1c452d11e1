"""A checkpoint file name near the 255-byte limit (a merge's OUT): `write_atomic`'s temporary name added
".<pid>-<random>.tmp" to the whole name and overflowed it ("File name too long", after the whole merge); a name over
the limit is refused by the merge before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError
from dlrm.distributed.merge import check_out_path
from tests.test_checkpoint_safety import trained  # noqa: F401 - the fixture: a small trained run's checkpoint


@pytest.mark.parametrize("name", ["m" * 252 + ".pt", "é" * 125 + ".ckpt"])
def test_a_checkpoint_name_near_the_limit_is_written_and_loads(trained, tmp_path, name):  # noqa: F811
    assert len(os.fsencode(name)) <= 255
    state = ckpt.load_checkpoint(trained["path"])
    out = tmp_path / name
    ckpt.write_atomic(out, state, replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary left
    assert ckpt.load_checkpoint(out)["position"] == state["position"]


def test_a_temporary_of_a_long_name_is_still_seen_as_a_stale_temporary(tmp_path):
    stem = ckpt.temp_stem("s" * 300 + ".pt")
    assert len(os.fsencode(stem)) <= 200 and stem.endswith(".pt")
    assert ckpt._TEMP.fullmatch(f".{stem}.123-abcd1234.tmp")


def test_merge_refuses_an_out_name_over_the_limit_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"a file name of 256 bytes is too long \(at most 255\)"):
        check_out_path(tmp_path / ("m" * 253 + ".pt"))
    check_out_path(tmp_path / ("m" * 252 + ".pt"))  # 255 bytes: fine
    assert not any(Path(tmp_path).iterdir())


def test_merge_takes_h_for_help_as_every_other_command():
    """`python -m dlrm.distributed.merge -h` was "No such option: -h" (exit 2); train.py and the data tools take it."""
    from click.testing import CliRunner

    from dlrm.distributed import merge

    result = CliRunner().invoke(merge.main, ["-h"])
    assert result.exit_code == 0 and "Merge the sharded CHECKPOINT" in result.output, result.output
