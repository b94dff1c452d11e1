"""Config keys accepted where the rest of the config leaves them without effect: `model.cross_layers` of a dot model,
`optim.dense.momentum` with Adam, `eps` with SGD, the decay's keys with `decay: "none"`, `data.gpu_memory_share` with
an explicit placement: a training run set with one trained as without it, without a word. A file's such key is refused
in one line (exit 2) before any work; where a flag or the command line switched the key it depends on (--compile,
--profile, a sweep's --set), on a --resume, for `distributed` keys of one process and compile settings that "auto"
drops on the CPU, it is a one-line warning instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from loguru import logger

import dlrm.cli as cli
from dlrm.config import ConfigError, load_config
from tests.conftest import REPO
from tests.test_cli_errors import _restore_logging, trained  # noqa: F401 (fixtures)

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())


def _config(tmp_path: Path, **sections) -> Path:
    """configs/sample.json with `sections`' objects replacing its sections' keys one level down."""
    raw = json.loads(json.dumps(SAMPLE))
    for section, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(raw.get(section, {}).get(key), dict):
                raw[section][key] = {**raw[section][key], **value}
            else:
                raw.setdefault(section, {})[key] = value
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return path


def _invoke(tmp_path: Path, config: Path, *args: str):
    return CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), *args])


def _lines(result, level: str) -> list[str]:
    return [line for line in result.stderr.splitlines() if level in line]


INERT = [  # (sections over sample.json, the key, what it needs); sample.json: dot, Adam + row-wise Adagrad, linear decay
    ({"model": {"cross_layers": 2}}, "model.cross_layers: 2", 'model.interaction "dcn"'),
    ({"model": {"interaction": "cat", "cross_rank": 64}}, "model.cross_rank: 64", 'model.interaction "dcn"'),
    ({"optim": {"dense": {"momentum": 0.9}}}, "optim.dense.momentum: 0.9", 'optim.dense.name "sgd"'),
    ({"optim": {"dense": {"name": "sgd", "eps": 1e-6}}}, "optim.dense.eps: 1e-06", 'name "adagrad" or "adam"'),
    ({"optim": {"sparse": {"name": "sgd", "eps": 0.001}}}, "optim.sparse.eps: 0.001", 'or "rowwise_adagrad"'),
    ({"optim": {"schedule": {"decay": "none"}}}, "optim.schedule.decay_start_step: 100", "decay \"linear\" or"),
    ({"data": {"placement": "stream", "gpu_memory_share": 0.5}}, "data.gpu_memory_share: 0.5", 'placement "auto"'),
]


@pytest.mark.parametrize("sections, key, needs", INERT)
def test_a_key_the_file_sets_that_cannot_act_is_refused_before_any_work(tmp_path, trained, sections, key, needs):
    path = _config(tmp_path, **sections)
    result = _invoke(tmp_path, path)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = _lines(result, "ERROR")
    assert len(errors) == 1 and f"{path}: {key} has no effect" in errors[0], result.output
    assert needs in errors[0] and "this run has" in errors[0], errors[0]
    assert not trained and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("sections", [
    {"model": {"interaction": "dcn", "cross_layers": 2, "cross_rank": 8}},
    {"optim": {"dense": {"name": "sgd", "momentum": 0.9}, "sparse": {"name": "adagrad", "eps": 1e-6}}},
    {"optim": {"dense": {"eps": 1e-6}, "schedule": {"decay": "cosine", "end_factor": 0.5, "decay_steps": 10}}},
    {"data": {"placement": "auto", "gpu_memory_share": 0.5}},
])
def test_the_same_keys_where_they_act_train(tmp_path, trained, sections):
    result = _invoke(tmp_path, _config(tmp_path, **sections))
    assert result.exit_code == 0, result.output
    assert not _lines(result, "WARNING"), result.output
    cfg = trained[0][0].to_dict()
    for section, values in sections.items():  # the values reach the run
        for key, value in values.items():
            got = cfg[section][key]
            assert ({k: got[k] for k in value} if isinstance(value, dict) else got) == value, (key, got)


def test_every_shipped_config_loads_without_a_refusal_or_a_warning(tmp_path, trained):
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        names = sorted(p.stem for p in (REPO / "configs").glob("*.json"))
        for name in names:
            load_config(REPO / "configs" / f"{name}.json", inert_keys="refuse")
    finally:
        logger.remove(handle)
    assert len(names) == 6 and not seen, seen
    for name in ("sample", "kaggle-dcn", "criteo-small"):  # and through train.py
        assert _invoke(tmp_path, REPO / "configs" / f"{name}.json").exit_code == 0
    assert [cfg.name for cfg, _ in trained] == ["sample", "kaggle-dcn", "criteo-small"]


def test_compile_and_profile_settings_kept_for_their_flags_are_told_not_refused(tmp_path, trained):
    path = _config(tmp_path, train={"compile": {"enabled": False, "mode": "max-autotune"}},
                   profile={"enabled": False, "active": 2})
    result = _invoke(tmp_path, path)
    assert result.exit_code == 0, result.output
    warnings = _lines(result, "WARNING")
    assert len(warnings) == 2, result.output
    assert 'train.compile.mode: "max-autotune" has no effect' in warnings[0] and "with --compile" in warnings[0]
    assert "profile.active: 2 has no effect" in warnings[1] and "with --profile" in warnings[1]
    # with the flags they act, and nothing is said
    result = _invoke(tmp_path, path, "--compile", "--profile")
    assert result.exit_code == 0 and not _lines(result, "WARNING"), result.output
    cfg = trained[-1][0]
    assert (cfg.train.compile.enabled, cfg.train.compile.mode, cfg.profile.enabled, cfg.profile.active) == \
        (True, "max-autotune", True, 2)
    # --no-compile over a file's compiled settings: the command line's choice, told
    result = _invoke(tmp_path, _config(tmp_path, train={"compile": {"mode": "default", "fullgraph": True}}),
                     "--no-compile")
    assert result.exit_code == 0, result.output
    assert [w.split("WARNING")[1].split(":")[0].strip() for w in _lines(result, "WARNING")] == \
        ["train.compile.mode", "train.compile.fullgraph"]
    assert "train.compile.enabled set on the command line" in _lines(result, "WARNING")[0]


def test_stream_settings_with_placement_gpu_are_told_as_kept_for_eval_only(tmp_path, trained):
    """Placement "gpu" trains and evaluates from the split in memory; --eval-only streams it with these settings."""
    result = _invoke(tmp_path, _config(tmp_path, data={"placement": "gpu", "prefetch": 1, "shuffle_buffer_rows": 5000}))
    assert result.exit_code == 0, result.output
    warnings = _lines(result, "WARNING")
    assert len(warnings) == 2, result.output
    assert 'data.prefetch: 1 has no effect: it acts with data.placement "auto" or "stream" only, and this run has ' \
        '"gpu": ignored (kept for --eval-only, which streams)' in warnings[0]
    assert "data.shuffle_buffer_rows: 5000 has no effect" in warnings[1]
    assert trained[0][0].data.prefetch == 1


def test_the_depended_on_key_set_on_the_command_line_warns(tmp_path):
    """A sweep's --set model.interaction=dot,dcn over a file keeping cross_layers for its dcn settings."""
    path = tmp_path / "dcn.json"
    path.write_text(json.dumps({"model": {"interaction": "dcn", "cross_layers": 2}}))
    dot = tmp_path / "dot.json"
    dot.write_text(json.dumps({"model": {"interaction": "dot", "cross_layers": 2}}))
    with pytest.raises(ConfigError, match=r"dot\.json: model\.cross_layers: 2 has no effect: .* \(remove it, or set"):
        load_config(dot, inert_keys="refuse")
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        cfg = load_config(path, {"model.interaction": "dot"}, inert_keys="refuse")
        # a key the command line sets is named as the command line's
        with pytest.raises(ConfigError, match=r"^command line: optim\.dense\.momentum: 0\.5 has no effect"):
            load_config(path, {"optim.dense.momentum": 0.5}, inert_keys="refuse")
    finally:
        logger.remove(handle)
    assert cfg.model.interaction == "dot" and cfg.model.cross_layers == 2
    assert seen == ['model.cross_layers: 2 has no effect: it acts with model.interaction "dcn" only, and this run has '
                    '"dot": ignored (model.interaction set on the command line)']
    # without the check (the Python API, benchmarks): accepted as before
    assert load_config(dot).model.cross_layers == 2


def test_a_resume_is_told_not_refused(tmp_path, trained):
    """A run that began with such a config (accepted before) is not stranded mid-way."""
    result = _invoke(tmp_path, _config(tmp_path, optim={"dense": {"momentum": 0.9}}), "--run-name", "r", "--resume")
    assert result.exit_code == 0, result.output
    assert trained and trained[0][1]["resume"] == "latest"
    warnings = _lines(result, "WARNING")
    assert len(warnings) == 1 and "optim.dense.momentum: 0.9 has no effect" in warnings[0]
    assert "the resumed run keeps its config" in warnings[0]


def test_distributed_keys_of_one_process_are_told(tmp_path, trained):
    result = _invoke(tmp_path, _config(tmp_path, distributed={"sharding": "row", "timeout_s": 30}))
    assert result.exit_code == 0, result.output
    warnings = _lines(result, "WARNING")
    assert len(warnings) == 1 and 'distributed: sharding "row", timeout_s 30.0 set, but this run is one process' \
        in warnings[0], result.output
    assert not _lines(_invoke(tmp_path, REPO / "configs" / "sample.json"), "WARNING")


def test_compile_settings_that_auto_drops_on_the_cpu_are_told():
    from dlrm.config import CompileConfig, Config, validate
    from dlrm.train.fast_path import resolve_fast_path

    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        cfg = validate(Config())
        cfg.train.compile = CompileConfig(enabled="auto", mode="max-autotune", fullgraph=True)
        resolved, _ = resolve_fast_path(cfg, torch.device("cpu"))
        quiet = validate(Config())
        resolve_fast_path(quiet, torch.device("cpu"))
    finally:
        logger.remove(handle)
    assert resolved.train.compile.enabled is False
    assert seen == ['train.compile: mode "max-autotune", fullgraph true set, but train.compile "auto" runs eager on '
                    'cpu: ignored']


def _sweep(tmp_path: Path, *sets: str, config: dict) -> list:
    """run_sweep over `sets` on `config`, training nothing: the trials it would run."""
    from dlrm.sweep import parse_set, run_sweep

    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"device": "cpu"}, **config}))
    trained: list = []

    def fake_train(cfg, run_dir=None):
        trained.append(cfg)
        raise KeyboardInterrupt  # stop at the first trial: only whether the sweep started matters

    try:
        run_sweep(str(path), [parse_set(s) for s in sets], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
                  train_fn=fake_train)
    except KeyboardInterrupt:
        pass
    return trained


def test_a_sweep_of_a_newly_dependent_key_where_it_cannot_act_is_refused(tmp_path):
    for n, (key, config) in enumerate((("optim.schedule.end_factor=0.1,0.5", {}),
                                       ("train.compile.mode=default,max-autotune", {}),
                                       ("data.gpu_memory_share=0.1,0.5", {"data": {"placement": "stream"}}))):
        with pytest.raises(ConfigError, match=rf"^--set {key.split('=')[0]}: acts with "):
            _sweep(tmp_path / str(n), key, config={**config, "train": {"device": "cpu", "compile": False}})
        assert not (tmp_path / str(n) / "tb" / "sw").exists()
    # where it acts
    trials = _sweep(tmp_path / "ok", "optim.schedule.end_factor=0.1,0.5",
                    config={"optim": {"schedule": {"decay": "linear"}}})
    assert trials[0].optim.schedule.end_factor == 0.1


def test_a_runs_config_json_as_the_config_trains(tmp_path, trained):
    """A run's config.json holds every key, those at their defaults too (`eps` beside SGD, `momentum` beside Adam,
    every profile and compile key, the cross network's beside "dot"): given as --config it trains again, unrefused and
    untold (a default value does what leaving the key out does)."""
    cfg = load_config(_config(tmp_path, optim={"sparse": {"name": "sgd"}}, train={"compile": False}))
    written = tmp_path / "config.json"
    written.write_text(json.dumps(cfg.to_dict()))
    result = _invoke(tmp_path, written)
    assert result.exit_code == 0, result.output
    assert len(trained) == 1 and _lines(result, "WARNING") == []
