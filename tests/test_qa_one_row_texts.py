"""Counts of one read "1 row", not "1 rows" (`dlrm.logging_setup.counted`, as most of the trainer's lines already do):
the MLPerf import's closing line ("train 1 rows, validation 1 rows" after ``--max-rows-per-day 1``), the generator's
refusal of a split that rounds to no row ("--validation-fraction of 1 rows rounds to ..."), and a run's start line for
a DCN of one cross layer ("dcn: 1 cross layers of rank 1 over 27 inputs"). And the import's first line for a one-hot
input, which read "multi-hot sizes [1, 1, ...]; lz4 files, lists layout": one-hot ids, no layout."""

from __future__ import annotations

import re

from click.testing import CliRunner

from dlrm.config import Config, ModelConfig
from dlrm.data import synthetic
from dlrm.model.dlrm import build_model
from dlrm.train.reporting import model_text
from dlrm.train.setup import Tables
from tests.test_audit_mlperf_import_edges import run, src  # noqa: F401  (src: the fixture of days 0 and 23)
from tests.test_audit_mlperfimport import ARGS, one_hot_dir  # noqa: F401  (one_hot_dir: days whose ids are one a row)
from tests.test_audit_mlperfimport import run as run_import


def test_an_import_of_one_row_a_split_says_row(src, tmp_path):  # noqa: F811
    res = run(src, tmp_path / "ds", "--max-rows-per-day", 1)
    assert res.exit_code == 0, res.output
    # (\b: a rate such as "(71 rows/s)" is not a count of one; on an H200 this read "1 rows" in it)
    assert "train 1 row, validation 1 row" in res.output and not re.search(r"\b1 rows\b(?!/s)", res.output), res.output


def test_the_generator_says_one_row(tmp_path):
    res = CliRunner().invoke(synthetic.main, ["--rows", "1", "--out", str(tmp_path / "ds")])
    assert res.exit_code == 2, res.output
    assert "--validation-fraction of 1 row rounds to no validation row" in res.output, res.output


def test_a_dcn_of_one_cross_layer_says_layer():
    cfg = Config(model=ModelConfig(embedding_dim=1, bottom_mlp=[4, 1], top_mlp=[1], interaction="dcn", cross_layers=1,
                                   cross_rank=1))
    text = model_text(build_model(cfg.model, [3] * 26, log_kernels=False), cfg, Tables([3] * 26, None, "modulus"))
    assert "dcn: 1 cross layer of rank 1 over 27 inputs" in text, text


def test_a_one_hot_import_says_one_hot(one_hot_dir, tmp_path):  # noqa: F811
    res = run_import("--input", one_hot_dir, "--output", tmp_path / "ds", *ARGS)
    assert res.exit_code == 0, res.output
    first = next(line for line in res.output.splitlines() if "importing" in line)
    assert "; one-hot ids (26 features); lz4 files, dense float; 1 worker" in first, first
    assert "multi-hot" not in first and "layout" not in first, first


def test_a_multi_hot_import_still_names_its_sizes_and_layout(src, tmp_path):  # noqa: F811
    res = run(src, tmp_path / "ds")
    assert res.exit_code == 0, res.output
    assert "; multi-hot sizes [3, 1, 2, 1, " in res.output and "lz4 files, slots layout, dense float" in res.output
