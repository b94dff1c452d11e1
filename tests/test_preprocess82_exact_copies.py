"""``--allow-shared-rows`` and inputs that are copies of each other.

The flag keeps inputs that share rows on purpose, and it kept a copy whose bytes differ (another order of the lines,
CRLF line ends: a share of 100%) with its warning, but refused a byte-identical copy or the same data plain and
gzip'ed, in a line that did not say why the flag did not apply. A copy under another name is two files: the flag is
the user's word that reading shared rows twice is meant (a day given twice to weigh it double), so every copy is kept
alike, warned of, recorded in the metadata. One file named twice (the same path, a symlink or a hard link to it) is
still refused with the flag: a command-line slip (a glob that also matches a file named beside it), never a second
input; the line says that the flag keeps distinct files only."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from dlrm.data.schema import read_metadata
from tests.test_preprocess_cli_errors import assert_one_line_error, raw_lines, run_cli
from tests.test_preprocess_edge_fixes import warnings_logged


@pytest.fixture
def day(tmp_path: Path) -> Path:
    path = tmp_path / "day_0"
    path.write_text(raw_lines(300))
    return path


def _gzip_of(path: Path, out: Path) -> Path:
    out.write_bytes(gzip.compress(path.read_bytes()))
    return out


def _kept_with_a_warning(tmp_path: Path, first: Path, second: Path) -> None:
    out = tmp_path / "ds"
    with warnings_logged() as warned:
        result = run_cli("-i", first, second, "-o", out, "--allow-shared-rows")
    assert result.exit_code == 0, result.stderr
    shared = [w for w in warned if "--allow-shared-rows" in w]
    assert len(shared) == 1, warned
    assert "100% of its lines are also lines of" in shared[0] and str(first) in shared[0] and str(second) in shared[0]
    meta = read_metadata(out)
    assert sum(s.rows for s in meta.splits.values()) == 600  # every row of both, as asked
    assert [(r["shared"], r["sampled"]) for r in meta.extra["shared_rows"]] == [(300, 300)]
    assert {meta.extra["shared_rows"][0]["file"], meta.extra["shared_rows"][0]["other"]} == {str(first), str(second)}


def test_a_byte_identical_copy_is_kept_with_the_flag_as_a_reordered_copy_is(tmp_path, day):
    copy = tmp_path / "day_0_copy"
    copy.write_bytes(day.read_bytes())
    # without the flag: refused, as before, naming both files
    assert_one_line_error(run_cli("-i", day, copy, "-o", tmp_path / "refused"), f"{copy}: the same bytes as {day}")
    assert not (tmp_path / "refused").exists()
    _kept_with_a_warning(tmp_path, day, copy)


def test_a_reordered_copy_is_kept_with_the_flag_alike(tmp_path, day):
    """What the exact copy is now consistent with: the same lines in another order (`tac`), kept with the warning."""
    reordered = tmp_path / "day_0_reversed"
    reordered.write_text("".join(reversed(day.read_text().splitlines(keepends=True))))
    _kept_with_a_warning(tmp_path, day, reordered)


def test_the_same_data_plain_and_gzipped_is_kept_with_the_flag(tmp_path, day):
    packed = _gzip_of(day, tmp_path / "day_0.gz")
    assert_one_line_error(run_cli("-i", day, packed, "-o", tmp_path / "refused"), "the same data as",
                          "once decompressed")
    _kept_with_a_warning(tmp_path, day, packed)


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_one_file_named_twice_is_refused_even_with_the_flag(tmp_path, day, how):
    other = {"same path": day, "symlink": tmp_path / "link", "hard link": tmp_path / "hard"}[how]
    if how == "symlink":
        other.symlink_to(day)
    elif how == "hard link":
        os.link(day, other)
    out = tmp_path / "ds"
    line = assert_one_line_error(run_cli("-i", day, other, "-o", out, "--allow-shared-rows"),
                                 f"{other}: given twice as input",
                                 "--allow-shared-rows keeps distinct files that share rows, not one file named twice")
    assert not out.exists(), line
    # without the flag the line does not name it
    plain = assert_one_line_error(run_cli("-i", day, other, "-o", out), f"{other}: given twice as input")
    assert "--allow-shared-rows" not in plain
