"""Stops and CPU settings of train.py's flows found by a QA pass (helper fix-train-stops; each test failed before its
fix): train.precision "tf32" on the CPU ran fp32 without a word (its log line said "precision tf32")."""

from __future__ import annotations

import pytest
from loguru import logger

from dlrm.config import load_config
from dlrm.train import export as export_mod
from dlrm.train.trainer import train
from tests.test_audit_review52 import tiny_config


def _warnings(fn) -> tuple[list[str], object]:
    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="WARNING")
    try:
        result = fn()
    finally:
        logger.remove(sink)
    return said, result


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_tf32_on_the_cpu_is_said_once_and_recorded_as_fp32(tmp_path, precision):
    """train.precision "tf32" has no effect on the CPU (oneDNN's matmuls stay IEEE fp32): said in one warning, as the
    other CUDA-only settings are there (compile mode reduce-overhead, train.cuda_graph), and summary.json's resolved
    precision, the start line and --eval-only's summary say fp32. Was: no word, "precision tf32" everywhere."""
    config = tiny_config(tmp_path, train={"precision": precision})
    cfg = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r", "train.max_steps": 2})
    infos: list[str] = []
    sink = logger.add(lambda m: infos.append(m.record["message"]), level="INFO")
    try:
        said, summary = _warnings(lambda: train(cfg))
    finally:
        logger.remove(sink)
    about = [m for m in said if "tf32" in m]
    if precision == "tf32":
        assert about == ['train.precision "tf32" has no effect on cpu (TF32 tensor cores are CUDA\'s): the run is '
                         "IEEE fp32"], said
    else:
        assert about == [], said
    assert summary["resolved"]["precision"] == "fp32"
    assert any(m.startswith("device cpu, precision fp32, ") for m in infos), infos
    assert summary["config"]["train"]["precision"] == precision  # the config as given stays recorded
    evaluated = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "ev"})
    said, result = _warnings(lambda: export_mod.evaluate_checkpoint(evaluated, summary["checkpoint"], "validation"))
    assert [m for m in said if "tf32" in m] == (['train.precision "tf32" has no effect on cpu (TF32 tensor cores are '
                                                 "CUDA's): the evaluation is IEEE fp32"] if precision == "tf32" else [])
    assert result["resolved"]["precision"] == "fp32"