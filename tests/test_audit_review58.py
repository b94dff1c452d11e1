"""Review of session 58's commits: the refusal of config keys that cannot act (f2fd88c) refused a sweep trial's own
config.json given back as --config (the trial's command line had left keys of the file without effect, and the
config.json records every key), and under --compare it called the file's compile settings "ignored" although the
compiled variants use them; the settings each --compare variant replaces were replaced without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.config import ConfigError, load_config
from tests.conftest import REPO
from tests.test_cli_errors import _restore_logging, trained  # noqa: F401 (fixtures)

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())


def _write(path: Path, raw: dict) -> Path:
    path.write_text(json.dumps(raw))
    return path


def _invoke(tmp_path: Path, config: Path, *args: str):
    return CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), *args])


def _warnings(result) -> list[str]:
    return [line.split("WARNING", 1)[1].strip() for line in result.stderr.splitlines() if "WARNING" in line]


def test_a_sweep_trials_config_json_given_as_the_config_trains_again(tmp_path, trained):
    """`python -m dlrm.sweep --config configs/sample.json --set optim.schedule.decay=none,linear`: the "none" trial
    wrote a config.json holding sample.json's decay_start_step 100 and end_factor 0.1 beside decay "none" (the sweep's
    --set left them without effect, told); given back to train.py as --config, that trial was refused, exit 2."""
    sample = _write(tmp_path / "sample.json", SAMPLE)
    trial = load_config(sample, {"optim.schedule.decay": "none", "train.max_steps": 2})
    written = _write(tmp_path / "config.json", trial.to_dict())  # what the trial's run directory holds

    result = _invoke(tmp_path, written)
    assert result.exit_code == 0, result.output
    assert len(trained) == 1 and trained[0][0].to_dict()["optim"] == trial.to_dict()["optim"]
    assert _warnings(result) == [
        f'optim.schedule.{key}: {value} has no effect: it acts with optim.schedule.decay "linear" or "cosine" only, '
        f'and this run has "none": ignored (the file gives every key, as a run\'s config.json does)'
        for key, value in (("decay_start_step", 100), ("end_factor", 0.1))]

    # a file that sets the same keys but not every key is still refused in one line
    partial = json.loads(json.dumps(SAMPLE))
    partial["optim"]["schedule"]["decay"] = "none"
    with pytest.raises(ConfigError, match=r"decay_start_step: 100 has no effect: .* \(remove it, or set "):
        load_config(_write(tmp_path / "partial.json", partial), inert_keys="refuse")
    # nor is a whole file a partial one with an object where the config has one: a missing section inside counts
    # (a missing key does not: an earlier version's config.json lacks the keys added since, tests/test_audit_review58b)
    whole = trial.to_dict()
    del whole["train"]["compile"]
    with pytest.raises(ConfigError, match=r"decay_start_step: 100 has no effect"):
        load_config(_write(tmp_path / "almost.json", whole), inert_keys="refuse")


def test_compare_uses_the_files_fullgraph_and_names_the_settings_its_variants_replace(tmp_path, monkeypatch):
    """The compiled variants take train.compile.fullgraph from the file (`variant_config`): it was told "has no effect
    ... ignored (kept for a run with --compile)"; the file's kernels, compile mode and step graph, which each variant
    replaces with its own, were replaced without a word."""
    import dlrm.train.trainer as trainer

    calls: list = []

    def record(cfg, **kwargs):
        calls.append(cfg)
        raise KeyboardInterrupt  # the first variant's config is all this test needs

    monkeypatch.setattr(trainer, "train", record)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raw = json.loads(json.dumps(SAMPLE))
    raw["data"]["path"] = str(REPO / "data" / "sample")
    raw["kernels"] = {"embedding": "torch", "mlp": "torch"}
    raw["train"].update(compile={"enabled": False, "mode": "max-autotune", "fullgraph": True}, cuda_graph=False)
    result = _invoke(tmp_path, _write(tmp_path / "c.json", raw), "--compare", "compiled,eager", "--max-steps", "2")

    assert result.exit_code == 130, result.output  # (the recorder's interrupt)
    (compiled,) = calls
    assert (compiled.train.compile.enabled, compiled.train.compile.fullgraph) == (True, True)
    assert _warnings(result) == [
        '--compare: the config\'s train.compile.enabled false, train.compile.mode "max-autotune" replaced by each '
        'variant\'s own (its name says its kernels and compile settings)']  # (both variants have the torch kernels)


def test_replaced_settings_names_only_what_a_compared_variant_changes():
    from dlrm.train.compare import replaced_settings

    cfg = load_config(REPO / "configs" / "sample.json", {"kernels.embedding": "torch", "train.compile.enabled": False,
                                                         "train.cuda_graph": False, "optim.dense.fused": False})
    # eager has the torch kernels, no compile and no step graph: only its compile mode differs from none set here
    assert replaced_settings(cfg, ["eager"]) == []
    assert replaced_settings(cfg, ["eager", "compiled"]) == ["train.compile.enabled false"]
    # compiled in mode default, the whole step graphed, which needs the fused dense optimizer
    assert replaced_settings(cfg, ["triton-embedding+step-graph"]) == [
        'kernels.embedding "torch"', "train.compile.enabled false", "train.cuda_graph false", "optim.dense.fused false"]
    # a config at the defaults: nothing to name
    assert replaced_settings(load_config(REPO / "configs" / "sample.json"), ["eager", "auto", "triton"]) == []


def _sweep(tmp_path: Path, config: dict, *sets: str) -> list:
    """run_sweep of `config` over `sets`, training nothing: the configs of the trials it starts (the first only)."""
    from dlrm.sweep import parse_set, run_sweep

    tmp_path.mkdir(exist_ok=True)
    trained: list = []

    def first_trial(cfg, run_dir=None):
        trained.append(cfg)
        raise KeyboardInterrupt  # whether the sweep started is all that matters

    try:
        run_sweep(str(_write(tmp_path / "c.json", config)), [parse_set(s) for s in sets], 1,
                  tb_dir=str(tmp_path / "tb"), run_name="sw", train_fn=first_trial)
    except KeyboardInterrupt:
        pass
    return trained


def test_a_sweeps_file_keeping_a_key_no_setting_lets_act_is_refused_as_train_py_refuses_it(tmp_path):
    """`python -m dlrm.sweep --config F`, F keeping optim.dense.momentum beside Adam: train.py refuses F, but the sweep
    trained every trial as without it (each trial is a run of train.py's, README), without a word."""
    from loguru import logger

    adam = {"train": {"device": "cpu"}, "optim": {"dense": {"name": "adam", "momentum": 0.9}}}
    with pytest.raises(ConfigError, match=r"c\.json: optim\.dense\.momentum: 0\.9 has no effect: it acts with "
                                          r"optim\.dense\.name \"sgd\" only, and this run has \"adam\" \(remove it"):
        _sweep(tmp_path / "refused", adam, "optim.dense.lr=0.001,0.002")
    assert not (tmp_path / "refused" / "tb" / "sw").exists()

    # a --set of the key it depends on lets it act in some settings: told once (not once a setting), and trained
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        trials = _sweep(tmp_path / "told", adam, "optim.dense.name=adam,sgd", "optim.dense.lr=0.001,0.002")
    finally:
        logger.remove(handle)
    assert trials and trials[0].optim.dense.momentum == 0.9
    assert [line for line in seen if "momentum" in line] == [
        'optim.dense.momentum: 0.9 has no effect in the 2 of the 4 settings with optim.dense.name "adam": it acts with '
        'optim.dense.name "sgd" only: ignored there (optim.dense.name set on the command line)']
