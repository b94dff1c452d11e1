"""README as a contract (session 59): what the README says of a run's config.json given back as --config."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from dlrm.cli import check_not_own_record
from dlrm.config_checks import free_run_name
from dlrm.errors import ConfigError


def _sweep_trial(tmp_path, seeds=(0,)):
    """A sweep's directory as dlrm.sweep lays it out: sweep.json, a setting directory, its seed-<k> trials."""
    sweep = tmp_path / "sw"
    setting = sweep / "00-optim.dense.lr=0.001"
    for k in seeds:
        (setting / f"seed-{k}").mkdir(parents=True)
        (setting / f"seed-{k}" / "config.json").write_text(json.dumps({"log": {"run_name": f"seed-{k}"}}))
    (sweep / "sweep.json").write_text("{}")
    return setting


def test_the_free_name_for_a_sweep_trials_config_is_no_trial_of_the_sweep(tmp_path):
    # a stopped 3-seed sweep whose seed-2 has not run yet: the advice named "seed-2", so a user who followed it put a
    # run of seed 0's config where the sweep's seed-2 trial goes, and `sweep --resume` then refused that trial
    setting = _sweep_trial(tmp_path, seeds=(0, 1))
    free = free_run_name(setting / "seed-0")
    assert not re.fullmatch(r"seed-\d+", free), free
    assert not (setting / free).exists() and free.startswith("seed-0")
    # elsewhere the -2, -3, ... sequence is as before
    (tmp_path / "tb" / "r").mkdir(parents=True)
    assert free_run_name(tmp_path / "tb" / "r") == "r-2"
    (tmp_path / "tb" / "r-2").mkdir()
    assert free_run_name(tmp_path / "tb" / "r-2") == "r-3"


def test_a_sweep_trials_config_given_back_is_refused_naming_a_name_no_trial_takes(tmp_path):
    setting = _sweep_trial(tmp_path, seeds=(0,))
    cfg = SimpleNamespace(log=SimpleNamespace(run_name="seed-0", tb_dir=str(setting)))
    with pytest.raises(ConfigError) as refused:
        check_not_own_record(str(setting / "seed-0" / "config.json"), cfg, {}, eval_only=False)
    text = str(refused.value)
    name = re.search(r"--run-name (\S+) \(free\)", text).group(1)
    assert not re.fullmatch(r"seed-\d+", name), text


@pytest.mark.parametrize("eval_only", [False, True])
def test_the_own_config_refusal_reads_as_english(tmp_path, eval_only):
    # it read "is run 'r1''s own config.json" (a repr followed by 's)
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "config.json").write_text("{}")
    cfg = SimpleNamespace(log=SimpleNamespace(run_name="r1", tb_dir=str(tmp_path)))
    with pytest.raises(ConfigError) as refused:
        check_not_own_record(str(tmp_path / "r1" / "config.json"), cfg, {}, eval_only=eval_only)
    text = str(refused.value)
    assert "''s" not in text and "run 'r1'" in text and "--run-name r1-2 (free)" in text, text
