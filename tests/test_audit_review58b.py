"""Review of session 58's sweep and config-check commits (8e4baeb, 14e4a78): a run's config.json written before
``log.sweep_keys`` existed (every run's before this session's, a sweep trial's too) was refused as --config where the
new one is told; a sweep told a file's key once per value of the key it depends on, as "this run has ...: ignored";
a sweep trial's config.json trained again by train.py carried the sweep's HParams columns into a run of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from loguru import logger

import dlrm.cli as cli
from dlrm.config import ConfigError, load_config
from dlrm.config_checks import check_dependent_keys
from dlrm.logging_setup import configure_logging
from tests.conftest import REPO

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


@pytest.fixture
def warnings():
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handle)


def _write(path: Path, raw: dict) -> Path:
    path.write_text(json.dumps(raw))
    return path


def _trial_config(tmp_path: Path) -> dict:
    """The config.json of the "dot" trial of ``--set model.interaction=dot,dcn`` over a file keeping cross_layers 2."""
    sample = json.loads(json.dumps(SAMPLE))
    sample["model"]["cross_layers"] = 2
    path = _write(tmp_path / "sample.json", sample)
    return load_config(path, {"model.interaction": "dot", "log.sweep_keys": ["model.interaction"]}).to_dict()


def test_a_config_json_of_an_earlier_version_is_told_as_todays_is(tmp_path, warnings):
    """Written before keys added since (log.sweep_keys this session, distributed.timeout_s), it was refused, exit 2."""
    older = _trial_config(tmp_path)
    del older["log"]["sweep_keys"], older["distributed"]["timeout_s"]
    cfg = load_config(_write(tmp_path / "config.json", older), inert_keys="refuse")
    assert (cfg.model.interaction, cfg.model.cross_layers, cfg.log.sweep_keys) == ("dot", 2, None)
    assert warnings == ['model.cross_layers: 2 has no effect: it acts with model.interaction "dcn" only, and this run '
                        'has "dot": ignored (the file gives every key, as a run\'s config.json does)']
    # a file without a section a run's config.json holds is still one of the user's own: refused
    del older["profile"]
    with pytest.raises(ConfigError, match=r"partial\.json: model\.cross_layers: 2 has no effect: .* \(remove it, or"):
        load_config(_write(tmp_path / "partial.json", older), inert_keys="refuse")


def test_a_sweep_tells_a_files_key_once_naming_the_settings_it_cannot_act_in(tmp_path, warnings):
    """It was said once per value of the key it depends on (two lines for dot and cat), each "this run has "dot":
    ignored", as if the whole sweep ignored it: the dcn settings train with it."""
    raw = json.loads(json.dumps(SAMPLE))
    raw["model"]["cross_layers"] = 2
    raw["optim"]["dense"]["momentum"] = 0.9
    config = str(_write(tmp_path / "c.json", raw))
    settings = [{"model.interaction": i, "optim.dense.name": n} for i in ("dot", "cat", "dcn") for n in ("adam", "sgd")]
    check_dependent_keys(config, {}, settings)
    assert warnings == [
        'model.cross_layers: 2 has no effect in the 4 of the 6 settings with model.interaction "dot" or "cat": it acts '
        'with model.interaction "dcn" only: ignored there (model.interaction set on the command line)',
        'optim.dense.momentum: 0.9 has no effect in the 3 of the 6 settings with optim.dense.name "adam": it acts with '
        'optim.dense.name "sgd" only: ignored there (optim.dense.name set on the command line)']


def test_a_trials_config_json_trained_again_is_a_run_of_its_own(tmp_path, monkeypatch):
    """Its log.sweep_keys kept, the run's HParams experiment named the swept keys and the four sweep/* metrics, blank
    columns for every other run of a --logdir whose columns TensorBoard took from it. A --resume (the trial's own
    run) keeps them."""
    import dlrm.train.trainer as trainer

    calls: list = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kwargs: calls.append((cfg, kwargs)) or {"checkpoint": "x"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trial = _write(tmp_path / "config.json", _trial_config(tmp_path))
    args = ["--config", str(trial), "--tb-dir", str(tmp_path / "tb")]

    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert "log.sweep_keys (a sweep's, on its trials) dropped: this run is one of its own" in result.stderr
    from dlrm.train.reporting import experiment_metrics

    (cfg, _), = calls
    assert cfg.log.sweep_keys is None and cfg.model.interaction == "dot"
    assert experiment_metrics(cfg) == ("hparam/auc", "hparam/logloss", "hparam/accuracy")

    result = CliRunner().invoke(cli.main, [*args, "--resume", "latest", "--run-name", "seed-0"])
    assert result.exit_code == 0, result.output
    assert calls[1][0].log.sweep_keys == ["model.interaction"] and calls[1][1]["resume"] == "latest"


def _sorted_session_groups(logdir: Path, column: str) -> list[dict]:
    """The session groups TensorBoard's HParams dashboard asks for once the user sorts by `column`."""
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import hparams_plugin
    from werkzeug.test import Client
    from werkzeug.wrappers import Response

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    context = base_plugin.TBContext(logdir=str(logdir), multiplexer=mux,
                                    data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)))
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 100,
               "colParams": [{"hparam": column, "order": "ORDER_ASC", "includeInResult": True}],
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]}
    app = hparams_plugin.HParamsPlugin(context).get_plugin_apps()["/session_groups"]
    response = Client(app, Response).post("/session_groups", data=json.dumps(request), content_type="application/json")
    assert response.status_code == 200, response.get_data(as_text=True)[-300:]
    return json.loads(response.get_data(as_text=True))["sessionGroups"]


def test_a_swept_keys_hparams_column_sorts_with_a_null_among_its_values(tmp_path):
    """``--set train.max_steps=null,2``: the null settings' sessions held "null" beside the others' 2, and the
    dashboard's every request, once sorted by that column, failed ("'<' not supported between 'float' and 'str'")."""
    from dlrm.sweep import parse_set, run_sweep
    from dlrm.train.reporting import session_hparams
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 32, "validation": 32}, row_group_size=16)
    config = _write(tmp_path / "tiny.json", {
        "data": {"path": str(tmp_path / "ds"), "batch_size": 16},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "train": {"epochs": 1, "log_every": 1, "device": "cpu", "baseline": False}})
    run_sweep(str(config), [parse_set("train.max_steps=null,1")], 1, tb_dir=str(tmp_path / "tb"), run_name="sw")

    groups = _sorted_session_groups(tmp_path / "tb", "train.max_steps")
    assert [(g["name"], g["hparams"].get("train.max_steps")) for g in groups] == [
        ("sw/01-train.max_steps=1/seed-0", 1), ("sw/hparams/01-train.max_steps=1", 1),  # (a null: a blank cell, last)
        ("sw/00-train.max_steps=null/seed-0", None), ("sw/hparams/00-train.max_steps=null", None)]
    # a key of several kinds (a bool or "auto"; a bool or null) is JSON text in every setting
    for key, values in (("train.compile.enabled", ("auto", False)), ("optim.dense.fused", (None, True))):
        cfgs = [load_config(config, {key: v, "log.sweep_keys": [key]}) for v in values]
        assert [session_hparams(c, 16)[key] for c in cfgs] == [json.dumps(v) for v in values]
