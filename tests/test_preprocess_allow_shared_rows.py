"""``--allow-shared-rows``: inputs that share most of their rows (`same_content.same_rows`) are refused in one line, and
a user whose inputs overlap on purpose (a concatenation of day files given beside them, rows known to be real
repeats of the log) had no way through. The flag turns the refusal into a warning naming both files and the share,
recorded in the dataset's metadata; a resumed run (whose count pass comes from its manifest, without the samples)
keeps the earlier run's finding: refused without the flag, warned again with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import run as pp_run
from dlrm.data.schema import read_metadata
from tests.test_preprocess import FAST, assert_same_dataset, dataset_files
from tests.test_preprocess_cli_errors import assert_one_line_error, raw_lines, run_cli
from tests.test_preprocess_edge_fixes import warnings_logged


@pytest.fixture
def days(tmp_path: Path) -> list[Path]:
    """day_0 and day_1 (400 distinct lines each) and their concatenation, given beside them on purpose."""
    d0, d1 = raw_lines(400), raw_lines(400, seed=1)
    paths = [tmp_path / "day_0", tmp_path / "day_1", tmp_path / "days_0_1"]
    for path, text in zip(paths, (d0, d1, d0 + d1)):
        path.write_text(text)
    return paths


def test_refused_without_the_flag_which_the_line_names(tmp_path, days):
    out = tmp_path / "ds"
    assert_one_line_error(run_cli("-i", *days, "-o", out), f"{days[0]}: 100% of its lines are also lines of {days[2]}",
                          "read twice", "--allow-shared-rows")
    assert not out.exists()


def test_accepted_with_the_flag_warned_and_every_row_kept(tmp_path, days, monkeypatch):
    out = tmp_path / "ds"
    with warnings_logged() as warned:
        result = run_cli("-i", *days, "-o", out, "--allow-shared-rows")
    assert result.exit_code == 0, result.stderr
    shared = [w for w in warned if "--allow-shared-rows" in w]
    assert len(shared) == 2, warned  # each day in the concatenation
    for day in days[:2]:
        assert any(w.startswith(f"{day}: 100% of its lines are also lines of {days[2]} (400 of 400 sampled lines")
                   for w in shared), shared
    meta = read_metadata(out)
    assert sum(s.rows for s in meta.splits.values()) == 1600  # the shared rows read twice, as asked
    assert sorted((r["file"], r["other"], r["shared"], r["sampled"]) for r in meta.extra["shared_rows"]) == [
        (str(days[0]), str(days[2]), 400, 400), (str(days[1]), str(days[2]), 400, 400)]
    # the same shards as a run that never compared the inputs (the flag changes nothing else)
    monkeypatch.setattr(pp_run, "same_rows", lambda scans, allow=False: [])
    pp.preprocess(days, tmp_path / "unchecked", **FAST)
    written, unchecked = dataset_files(out), dataset_files(tmp_path / "unchecked")
    assert written.keys() == unchecked.keys()
    assert all(written[k] == unchecked[k] for k in written if k != "metadata.json")


def test_distinct_inputs_are_not_warned_of_with_the_flag(tmp_path, days):
    with warnings_logged() as warned:
        meta = pp.preprocess(days[:2], tmp_path / "ds", allow_shared_rows=True, **FAST)
    assert not [w for w in warned if "--allow-shared-rows" in w] and "shared_rows" not in meta.extra


def test_a_resumed_run_keeps_the_finding_of_the_run_it_resumes(tmp_path, days):
    """The resumed run's scans are the manifest's (no samples): without the flag it went on silently, a way around
    the refusal; now refused (nothing touched), and with the flag warned again, ending as an uninterrupted run."""
    kw = dict(chunk_rows=100, allow_shared_rows=True, **FAST)
    pp.preprocess(days, tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess(days, out, _max_new_chunks=2, **kw)
    manifest = out / pp.PROGRESS_DIR / "manifest.json"
    assert len(json.loads(manifest.read_text())["shared_rows"]) == 2
    before = dataset_files(out)
    line = assert_one_line_error(run_cli("-i", *days, "-o", out, "--chunk-rows", "100"), str(manifest),
                                 f"{days[0]}: 100% of its lines are also lines of {days[2]}", "--allow-shared-rows")
    assert "--overwrite" in line
    assert dataset_files(out) == before
    with warnings_logged() as warned:
        pp.preprocess(days, out, **kw)
    assert len([w for w in warned if "--allow-shared-rows" in w]) == 2, warned
    assert_same_dataset(out, tmp_path / "ref")


def test_a_run_that_kept_no_shared_rows_resumes_without_the_flag(tmp_path, days):
    """The flag given to distinct inputs recorded nothing to keep: its resume needs no flag (not an output option)."""
    kw = dict(chunk_rows=100, **FAST)
    pp.preprocess(days[:2], tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    with pytest.raises(pp._Interrupted):
        pp.preprocess(days[:2], out, _max_new_chunks=2, allow_shared_rows=True, **kw)
    pp.preprocess(days[:2], out, **kw)
    assert_same_dataset(out, tmp_path / "ref")
