"""`python -m dlrm.data.mlperf_import` without --num-embeddings records MLPerf's table sizes (204,184,588 rows) whatever
the input holds, and said nothing of it (found by a QA pass on 2026-12-04): a hand-made input of a few ids then trained
tables of 204M rows. Its log now says the sizes it records and where they come from, in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tests.test_mlperf_import as t
from dlrm.data.schema import MLPERF_CARDINALITIES, NUM_SPARSE


@pytest.fixture
def small_ids_dir(tmp_path, monkeypatch):
    """Days whose ids are all below 3 (MLPerf's smallest table), so that its default sizes import them."""
    monkeypatch.setattr(t, "CARDS", [3] * NUM_SPARSE)
    rng = np.random.default_rng(0)
    src = tmp_path / "in"
    src.mkdir()
    for i, n in t.ROWS.items():
        t.write_day(src, i, n, rng)
    return src


def _sizes_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "table sizes recorded" in line]


def test_the_default_table_sizes_are_said_with_their_source(small_ids_dir, tmp_path):
    out = tmp_path / "ds"
    res = t.run("--input", small_ids_dir, "--output", out, "--train-days", "0,1", "--workers", 1)
    assert res.exit_code == 0, res.output
    assert json.loads((out / "metadata.json").read_text())["cardinalities"] == list(MLPERF_CARDINALITIES)
    [line] = _sizes_lines(res.output)
    assert line.endswith("INFO    table sizes recorded (MLPerf DLRM-DCNv2's, 40M-capped: --num-embeddings was not "
                         "given; 204,184,588 rows in all): 40,000,000 39,060 17,295 7,424 20,265 3 7,122 1,543 63 "
                         "40,000,000 3,067,956 405,282 10 2,209 11,938 155 4 976 14 40,000,000 40,000,000 40,000,000 "
                         "590,152 12,973 108 36"), line


def test_given_table_sizes_are_said_as_given(small_ids_dir, tmp_path):
    cards = [3] * (NUM_SPARSE - 1) + [1_234_567]
    res = t.run("--input", small_ids_dir, "--output", tmp_path / "ds", "--train-days", "0,1", "--workers", 1,
                "--num-embeddings", ",".join(map(str, cards)))
    assert res.exit_code == 0, res.output
    [line] = _sizes_lines(res.output)
    assert line.endswith("table sizes recorded (--num-embeddings; 1,234,642 rows in all): " + "3 " * (NUM_SPARSE - 1)
                         + "1,234,567"), line
