"""A sweep's results as a user reads them: its HParams in TensorBoard's default view (``--logdir tb_logs``), where the
settings' rows under ``hparams/`` and the trials' own sessions were told apart by columns only one kind of row had,
and a grid whose settings train one config twice (a dot model under two ``model.cross_rank``), ranked as rivals."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.hparams import metadata

from dlrm.config import Config, ConfigError, LogConfig, load_config
from dlrm.sweep import parse_set, run_sweep
from dlrm.sweep_checks import check_datasets, check_same_configs
from dlrm.train.reporting import session_hparams
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.test_tensorboard_summaries import hparams_session_groups

TINY = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], "cross_layers": 1},
    "train": {"epochs": 1, "max_steps": 2, "log_every": 1, "device": "cpu", "baseline": False},
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweepreport")
    make_dataset(root / "ds", {"train": 48, "validation": 40}, row_group_size=24)
    raw = json.loads(json.dumps(TINY))
    raw["data"]["path"] = str(root / "ds")
    (root / "tiny.json").write_text(json.dumps(raw))
    return root / "tiny.json"


def _experiments(logdir) -> dict[str, tuple[list[str], list[str]]]:
    """Per run that holds one, the (hparam, metric) columns of its HParams experiment: TensorBoard shows one of them,
    the first it finds."""
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out = {}
    for run, tags in mux.PluginRunToTagToContent(metadata.PLUGIN_NAME).items():
        if metadata.EXPERIMENT_TAG in tags:
            exp = metadata.parse_experiment_plugin_data(tags[metadata.EXPERIMENT_TAG])
            out[run] = (sorted(h.name for h in exp.hparam_infos), sorted(m.name.tag for m in exp.metric_infos))
    return out


def test_the_settings_and_the_trials_of_a_sweep_fill_the_same_hparams_columns(tiny_config, tmp_path):
    """Before, the settings' experiment named only the swept keys and sweep/* metrics, the trials' only their own keys
    and hparam/*: whichever TensorBoard picked, the other kind of row was blank."""
    sets = [parse_set("model.interaction=dot,dcn"), parse_set("model.dropout=0,0.3")]
    directory, _ = run_sweep(str(tiny_config), sets, 2, tb_dir=str(tmp_path), run_name="sw")
    train(load_config(tiny_config, {"log.tb_dir": str(tmp_path), "log.run_name": "plain"}))  # a run of its own beside

    experiments = _experiments(tmp_path)
    assert len(experiments) == 1 + 4 * 2 + 4  # the plain run, the trials, the settings
    # and no run of hparams/ itself: an events file of only its header listed it as a run with no data
    assert not list((directory / "hparams").glob("events.out.tfevents.*"))
    plain = experiments.pop("plain")
    (sweep_columns,) = set(map(json.dumps, experiments.values()))  # one experiment for the whole sweep
    hparam_columns, metric_columns = json.loads(sweep_columns)
    assert hparam_columns == sorted([*plain[0], "model.interaction", "model.dropout"])
    assert metric_columns == sorted([*plain[1], "sweep/auc_std", "sweep/logloss_std", "sweep/seeds",
                                     "sweep/failed_trials"])

    trials = list(csv.DictReader(open(directory / "trials.csv")))
    groups = {g["name"]: g for g in hparams_session_groups(tmp_path)}
    assert len(groups) == 1 + 8 + 4
    for name, group in groups.items():  # every row fills every column of a plain run's experiment
        # a setting's seed too: its metrics are the means over its trials' seeds, a blank cell (empty text)
        setting = name.startswith("sw/hparams/")
        assert set(plain[0]) <= set(group["hparams"]), name
        assert (group["hparams"]["seed"] == "") is setting, name
        metrics = {m["name"]["tag"]: m["value"] for m in group["sessions"][0]["metricValues"]}
        assert {"hparam/auc", "hparam/logloss", "hparam/accuracy"} <= set(metrics), name
    for row in trials:
        name = row["run_dir"].removeprefix(f"{tmp_path}/")
        hp = groups[name]["hparams"]
        assert f"model.interaction={json.dumps(hp['model.interaction'])}" in row["setting"]
        assert (hp["interaction"], hp["cross_layers"]) == (hp["model.interaction"],
                                                           1 if hp["model.interaction"] == "dcn" else 0)
        assert hp["seed"] == row["seed"]  # each trial its own: the seeds of a setting were the same values
        metrics = {m["name"]["tag"]: m["value"] for m in groups[name]["sessions"][0]["metricValues"]}
        assert metrics["hparam/auc"] == pytest.approx(float(row["auc"]), abs=1e-6)
    for row in csv.DictReader(open(directory / "sweep.csv")):
        (name,) = [n for n in groups if n.startswith("sw/hparams/")
                   and groups[n]["hparams"]["model.interaction"] == json.loads(row["model.interaction"])
                   and groups[n]["hparams"]["model.dropout"] == json.loads(row["model.dropout"])]
        hp = groups[name]["hparams"]
        assert (hp["interaction"], hp["batch_size"], hp["multi_hot_values"]) == (hp["model.interaction"], 16, 26)
        metrics = {m["name"]["tag"]: m["value"] for m in groups[name]["sessions"][0]["metricValues"]}
        accuracies = [json.loads((directory.parent / t["run_dir"] / "summary.json").read_text())["accuracy"]
                      for t in trials if t["setting"] == row["setting"]]
        assert metrics["hparam/auc"] == pytest.approx(float(row["auc_mean"]), abs=1e-6)
        assert metrics["hparam/logloss"] == pytest.approx(float(row["logloss_mean"]), abs=1e-6)
        assert metrics["hparam/accuracy"] == pytest.approx(statistics.fmean(accuracies), abs=1e-6)
        assert metrics["sweep/auc_std"] == pytest.approx(float(row["auc_std"]), abs=1e-6)
        assert (metrics["sweep/seeds"], metrics["sweep/failed_trials"]) == (2, 0)


def test_a_sweep_trial_names_its_swept_keys_in_its_session_as_json_text_where_no_hparams_type_fits():
    cfg = Config(log=LogConfig(sweep_keys=["model.bottom_mlp", "model.cardinalities", "optim.sparse.lr"]))
    hp = session_hparams(cfg, 32)
    assert (hp["model.bottom_mlp"], hp["model.cardinalities"]) == (json.dumps(cfg.model.bottom_mlp), "null")
    assert hp["optim.sparse.lr"] == cfg.optim.sparse.lr == hp["sparse_lr"]
    assert "model.bottom_mlp" not in session_hparams(Config(), 32)  # a run of its own: its columns as before


def test_log_sweep_keys_names_config_keys_only(tiny_config):
    with pytest.raises(ConfigError, match=r"^command line: log.sweep_keys: 'model.dropuot' is not a config key$"):
        load_config(tiny_config, {"log.sweep_keys": ["model.dropuot"]})


def test_two_settings_of_one_config_are_refused_in_one_line_before_anything_is_written(tiny_config, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "dlrm.sweep", "--config", str(tiny_config), "--set", "model.interaction=dot,dcn",
         "--set", "model.cross_rank=4,8", "--seeds", "2", "--tb-dir", str(tmp_path), "--run-name", "dup"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    # (the file's cross_layers, acting in the dcn settings only, is told beforehand: the one error is the refusal)
    (line,) = [line for line in res.stderr.splitlines() if "ERROR" in line]
    assert line.endswith('--set: model.interaction="dot", model.cross_rank=4 and model.interaction="dot", '
                         'model.cross_rank=8 train the same config (model.cross_rank acts with model.interaction '
                         '"dcn" only): it would be trained twice and ranked as its own rival; sweep those keys where '
                         'they act in a sweep of their own'), line
    assert not (tmp_path / "dup").exists()


def test_settings_that_differ_where_the_key_acts_are_accepted(tiny_config):
    base = {"model.interaction": "dcn"}
    check_same_configs(str(tiny_config), base, [{"model.cross_rank": 4}, {"model.cross_rank": 8}])
    check_same_configs(str(tiny_config), {}, [{"model.interaction": "dot"}, {"model.interaction": "dcn"}])
    # the same grid through a section: the dot settings differ in a value a dot model never reads
    with pytest.raises(ConfigError, match=r"train the same config \(their values make one config\)"):
        check_same_configs(str(tiny_config), {}, [{"model": {"interaction": "dot", "cross_rank": 4}},
                                                   {"model": {"interaction": "dot", "cross_rank": 8}}])


def test_a_setting_whose_dataset_is_missing_is_refused_before_the_first_trial(tiny_config, tmp_path):
    """It was found by its own first trial, after every trial of the settings before it had trained; and --resume,
    which must match the record, could not mend the name."""
    raw = json.loads(tiny_config.read_text())
    del raw["model"]["cross_layers"]  # (a dot model's: train.py, and so the sweep, refuses the file keeping it)
    good, config = raw["data"]["path"], tmp_path / "dot.json"
    config.write_text(json.dumps(raw))
    res = subprocess.run(
        [sys.executable, "-m", "dlrm.sweep", "--config", str(config), "--set", f"data.path={good},{tmp_path}/nope",
         "--seeds", "1", "--tb-dir", str(tmp_path), "--run-name", "nodata"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    (line,) = [line for line in res.stderr.splitlines() if line.strip()]
    assert f'--set data.path="{tmp_path}/nope": data.path: \'{tmp_path}/nope\' does not exist' in line
    assert not (tmp_path / "nodata").exists()
    # the file's own data.path, read where the sweep started, as its trials read it; not blamed on a --set
    check_datasets(str(tiny_config), {}, [{"model.dropout": 0}, {"model.dropout": 0.3}], str(tmp_path))
    relative = tmp_path / "relative.json"
    relative.write_text(json.dumps({**json.loads(tiny_config.read_text()), "data": {"path": "ds"}}))
    check_datasets(str(relative), {}, [{"model.dropout": 0}], str(tiny_config.parent))
    with pytest.raises(ConfigError, match=rf"^data.path: '{tmp_path}/ds' does not exist"):
        check_datasets(str(relative), {}, [{"model.dropout": 0}], str(tmp_path))
