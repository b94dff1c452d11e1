"""Counts of one read "1 row", not "1 rows" (`dlrm.logging_setup.counted`, as most of the trainer's lines already do):
the MLPerf import's closing line ("train 1 rows, validation 1 rows" after ``--max-rows-per-day 1``), the generator's
refusal of a split that rounds to no row ("--validation-fraction of 1 rows rounds to ..."), and a run's start line for
a DCN of one cross layer ("dcn: 1 cross layers of rank 1 over 27 inputs")."""

from __future__ import annotations

from click.testing import CliRunner

from dlrm.config import Config, ModelConfig
from dlrm.data import synthetic
from dlrm.model.dlrm import build_model
from dlrm.train.reporting import model_text
from dlrm.train.setup import Tables
from tests.test_audit_mlperf_import_edges import run, src  # noqa: F401  (src: the fixture of days 0 and 23)


def test_an_import_of_one_row_a_split_says_row(src, tmp_path):  # noqa: F811
    res = run(src, tmp_path / "ds", "--max-rows-per-day", 1)
    assert res.exit_code == 0, res.output
    assert "train 1 row, validation 1 row" in res.output and "1 rows" not in res.output, res.output


def test_the_generator_says_one_row(tmp_path):
    res = CliRunner().invoke(synthetic.main, ["--rows", "1", "--out", str(tmp_path / "ds")])
    assert res.exit_code == 2, res.output
    assert "--validation-fraction of 1 row rounds to no validation row" in res.output, res.output


def test_a_dcn_of_one_cross_layer_says_layer():
    cfg = Config(model=ModelConfig(embedding_dim=1, bottom_mlp=[4, 1], top_mlp=[1], interaction="dcn", cross_layers=1,
                                   cross_rank=1))
    text = model_text(build_model(cfg.model, [3] * 26, log_kernels=False), cfg, Tables([3] * 26, None, "modulus"))
    assert "dcn: 1 cross layer of rank 1 over 27 inputs" in text, text
