"""A benchmark's run is the one train.py builds, whatever an earlier run in the same process left: torch's
deterministic mode (process-wide, and with it Inductor's, which refuses to time the combo kernels) left on by a
deterministic run before it failed `mlperf_dcnv2.py`'s compiled row on the GPU machine ("In the deterministic mode of
Inductor, we will avoid those benchmarkings")."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO
from tests.test_benchmark_scripts import load_script


@pytest.mark.parametrize("deterministic", [False, True])
def test_measure_sets_the_deterministic_mode_its_config_says(monkeypatch, deterministic):
    tt = load_script("train_throughput")
    seen: list[bool] = []

    def build_run(cfg, *args, **kwargs):  # what the run would be built under, then stop
        seen.append(torch.are_deterministic_algorithms_enabled())
        raise RuntimeError("built")

    monkeypatch.setattr(tt, "build_run", build_run)
    monkeypatch.setattr(tt, "tables_from_config", lambda cfg: None)
    cfg = tt.load_config(REPO / "configs" / "sample.json")
    cfg.train.deterministic = deterministic
    torch.use_deterministic_algorithms(not deterministic)  # what an earlier run of this process left
    with pytest.raises(RuntimeError, match="built"):
        tt.measure(cfg, "eager", "fp32", 8, torch.device("cpu"), 1, 1, 1)
    assert seen == [deterministic]
