"""TensorBoard's HParams had no seed column: two runs that differed only by ``train.seed`` (``--seed``) were sessions of
the same values, their AUCs side by side as if of one setting. Now ``seed`` is the seed the session trained with
(summary.json's ``resolved.seed``); a run resumed from a session written before the column still reads "the same
values" (an earlier session's missing key is no change), and a sweep setting's session, the mean over its seeds, has a
blank cell there. The seed is text: HParams numbers are float64, and seeds 2**53 and 2**53 + 1 showed as one number;
text in every run and setting (TensorBoard types a column by one run's experiment), and a run whose earlier session
wrote its seed as a number still reads "the same values"."""

from __future__ import annotations

import json

import pytest
from loguru import logger

from dlrm.config import load_config
from dlrm.data import synthetic
from dlrm.sweep_report import _setting_hparams
from dlrm.sweep_results import SettingResult
from dlrm.train import reporting
from dlrm.train.trainer import train
from tests.conftest import REPO
from tests.test_tensorboard_summaries import hparams_session_groups


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("seedcol") / "data"
    synthetic.generate(out, 160, seed=3, cardinalities="tiny", validation_fraction=0.2, test_fraction=0.0)
    return out


def _run(dataset, tb, name, **overrides):
    return load_config(REPO / "configs" / "sample.json", {
        "data.path": str(dataset), "data.batch_size": 32, "train.device": "cpu", "train.max_steps": 2,
        "train.log_every": 1, "train.eval_every": None, "train.baseline": False, "optim.schedule.warmup_steps": 0,
        "optim.schedule.decay": "none", "log.tb_dir": str(tb), "log.run_name": name, **overrides})


@pytest.fixture(scope="module")
def seeded_runs(dataset, tmp_path_factory):
    """Two runs alike but for the seed: 0 and 5."""
    tb = tmp_path_factory.mktemp("seedruns")
    return tb, [train(_run(dataset, tb, f"s{seed}", **{"train.seed": seed})) for seed in (0, 5)]


def test_runs_that_differ_only_by_seed_are_sessions_of_other_seeds(seeded_runs):
    tb, summaries = seeded_runs
    groups = {g["name"]: g["hparams"] for g in hparams_session_groups(tb)}
    assert (groups["s0"]["seed"], groups["s5"]["seed"]) == ("0", "5")
    assert groups["s0"] != groups["s5"]  # were equal: every other column is the same
    assert {k: v for k, v in groups["s0"].items() if k != "seed"} == {k: v for k, v in groups["s5"].items()
                                                                       if k != "seed"}
    # the seed as the session resolved it, and summary.json's record of the session says it alike
    for summary, seed in zip(summaries, (0, 5)):
        assert summary["resolved"]["seed"] == seed
        (session,) = summary["sessions"]
        assert session["hparams"]["seed"] == str(seed)


def test_a_sweep_settings_session_has_no_one_seed(seeded_runs):
    """A setting's session holds the means over its trials of several seeds: a blank cell (empty text, the column's
    type in the trials' experiments), not its first trial's seed; its trials' own sessions name theirs."""
    _, summaries = seeded_runs
    hp, _ = _setting_hparams(SettingResult(0, {"optim.dense.lr": summaries[0]["config"]["optim"]["dense"]["lr"]},
                                           summaries))
    assert hp["seed"] == "" and hp["precision"] == "fp32"


def test_a_run_resumed_from_a_session_without_the_column_shows_it_and_says_the_same_values(dataset, tmp_path,
                                                                                             monkeypatch):
    """The first session written as before the column (its event file's hparams and summary.json's record without
    "seed"); the resumed session's are the run's, with the seed, and the log names no change."""
    tb = tmp_path / "tb"
    before = reporting.session_hparams
    settings = {"train.seed": 7, "train.max_steps": 4, "checkpoint.every": 2}
    with monkeypatch.context() as m:
        m.setattr(reporting, "session_hparams",
                  lambda *a, **k: {key: v for key, v in before(*a, **k).items() if key != "seed"})
        train(_run(dataset, tb, "old", **settings))
    assert "seed" not in hparams_session_groups(tb)[0]["hparams"]  # (as a run written before the column)
    lines = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    (tb / "old/checkpoints/step-00000004.pt").unlink()  # as if killed before it: the resume trains steps 3-4 again
    try:  # every setting alike
        resumed = train(_run(dataset, tb, "old", **settings), resume="latest")
    finally:
        logger.remove(sink)
    (group,) = hparams_session_groups(tb)
    assert group["hparams"]["seed"] == "7" and group["hparams"]["steps"] == 4
    (said,) = [line for line in lines if "TensorBoard HParams: the run shows this session's" in line]
    assert "(the same values)" in said  # a key the earlier session lacks is no change
    assert [s["hparams"].get("seed") for s in resumed["sessions"]] == [None, "7"]
    assert json.loads((tb / "old" / "summary.json").read_text())["sessions"][1]["hparams"]["seed"] == "7"


def _types(logdir) -> dict[str, str]:
    """Per run, the type its HParams experiment gives the seed column (TensorBoard shows one run's experiment)."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import api_pb2, metadata

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out = {}
    for run, tags in mux.PluginRunToTagToContent(metadata.PLUGIN_NAME).items():
        experiment = metadata.parse_experiment_plugin_data(tags[metadata.EXPERIMENT_TAG])
        (seed,) = [h for h in experiment.hparam_infos if h.name == "seed"]
        out[run] = api_pb2.DataType.Name(seed.type)
    return out


def test_seeds_above_2_53_are_told_apart_and_the_column_has_one_type(seeded_runs, tmp_path):
    """Seeds 2**53 and 2**53 + 1 (train.seed goes to 2**63 - 1) were both 9007199254740992.0; a run's seed column and
    a sweep setting's (blank) are text alike, beside runs of small seeds."""
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.sweep_report import write_hparams

    tb, summaries = seeded_runs
    logdir = tmp_path / "tb"
    for seed in (2**53, 2**53 + 1, 2**63 - 1):
        cfg = load_config(REPO / "configs" / "sample.json", {"train.seed": seed})
        with SummaryWriter(str(logdir / f"s{seed}")) as writer:
            reporting.log_hparams(writer, cfg, 32, {"auc": 0.8, "logloss": 0.45, "accuracy": 0.79})
    lr = summaries[0]["config"]["optim"]["dense"]["lr"]
    write_hparams(logdir / "sweep", [SettingResult(0, {"optim.dense.lr": lr}, summaries)])
    groups = {g["name"]: g["hparams"] for g in hparams_session_groups(logdir)}
    (setting,) = [hp for name, hp in groups.items() if name.startswith("sweep/")]
    assert {name: hp["seed"] for name, hp in groups.items() if not name.startswith("sweep/")} == {
        f"s{seed}": str(seed) for seed in (2**53, 2**53 + 1, 2**63 - 1)} and setting["seed"] == ""
    assert set(_types(logdir).values()) | set(_types(tb).values()) == {"DATA_TYPE_STRING"}, (_types(logdir), _types(tb))


def test_a_run_whose_earlier_session_wrote_the_seed_as_a_number_says_the_same_values(dataset, tmp_path, monkeypatch):
    """The first session written as an earlier version wrote it (the seed a number, rounded above 2**53); the resumed
    session shows the exact seed as text and names no change (it named "seed 9007199254740992.0 -> ...")."""
    tb = tmp_path / "tb"
    before = reporting.session_hparams
    seed = 2**53 + 1
    settings = {"train.seed": seed, "train.max_steps": 4, "checkpoint.every": 2}
    with monkeypatch.context() as m:
        m.setattr(reporting, "session_hparams",
                  lambda *a, **k: {**before(*a, **k), "seed": float(seed)})  # (as a float64 held it: 2**53)
        train(_run(dataset, tb, "old", **settings))
    assert hparams_session_groups(tb)[0]["hparams"]["seed"] == float(2**53)
    lines = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    (tb / "old/checkpoints/step-00000004.pt").unlink()  # as if killed before it: the resume trains steps 3-4 again
    try:
        train(_run(dataset, tb, "old", **settings), resume="latest")
    finally:
        logger.remove(sink)
    (group,) = hparams_session_groups(tb)
    assert group["hparams"]["seed"] == str(seed)
    (said,) = [line for line in lines if "TensorBoard HParams: the run shows this session's" in line]
    assert "(the same values)" in said, said
