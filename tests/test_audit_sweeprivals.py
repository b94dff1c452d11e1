"""Sweeps whose settings are rivals only on paper: two settings the device or the dataset makes one model of (a
precision or compile mode the CPU replaces, a table cap no table reaches) were trained and ranked against each other;
and how a sweep reports what it found (one error for one problem, its ranking and its earlier report)."""

from __future__ import annotations

import json
import statistics

import pytest
from loguru import logger

from dlrm.config import ConfigError
from dlrm.sweep import run_sweep
from dlrm.sweep_checks import check_same_configs
from tests.conftest import make_dataset

TINY = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"epochs": 1, "max_steps": 2, "log_every": 1, "device": "cpu", "baseline": False},
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeprivals")
    make_dataset(root / "ds", {"train": 48, "validation": 40}, row_group_size=24)
    raw = json.loads(json.dumps(TINY))
    raw["data"]["path"] = str(root / "ds")
    (root / "tiny.json").write_text(json.dumps(raw))
    return root / "tiny.json"


@pytest.fixture
def cpu_only(monkeypatch):
    """The device "auto" resolves to is the CPU, on a GPU machine too (the suite runs there as well)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def logged():
    seen: list[tuple[str, str]] = []
    handle = logger.add(lambda m: seen.append((m.record["level"].name, m.record["message"])), level="INFO")
    yield seen
    logger.remove(handle)


def _fake_train(cfg, run_dir=None, resume=None):
    """A trial without training: its AUC from its config, so that tests of the report run in no time."""
    auc = {0.01: 0.70, 0.02: 0.72, 0.03: 0.70}.get(cfg.optim.sparse.lr, 0.6) + cfg.train.seed * 0.01
    return {"auc": auc, "logloss": 0.5, "steps": 2, "accuracy": 0.7}


# -- (1) settings the device or the dataset make one model of --------------------------------------------------------


@pytest.mark.parametrize("key, values, why", [
    ("train.precision", ("fp32", "tf32"), r'train.precision "fp32" and "tf32" both train as "fp32" on cpu'),
    ("train.compile.mode", ("default", "max-autotune"),
     r'train.compile.mode acts with train.compile.enabled true or "auto" only, and "auto" is false on cpu'),
    ("kernels.embedding", ("auto", "torch"), r'kernels.embedding "auto" and "torch" both train as "torch" on cpu'),
    ("train.cuda_graph", ("auto", "true"), None),
    ("train.device", ("auto", "cpu"), None),
    ("data.placement", ("auto", "stream"), r'data.placement "auto" and "stream" both train as "stream" on cpu'),
    ("data.gpu_memory_share", (0.1, 0.5), 'data.gpu_memory_share acts with data.placement "auto" only, and "auto" is '
                                          '"stream" on cpu'),
])
def test_settings_the_device_trains_as_one_config_are_refused(tiny_config, cpu_only, key, values, why):
    """`--device cpu --set train.precision=fp32,tf32` trained one fp32 model twice (tf32 is a no-op on the CPU) and
    named a "winner" between them; so did a compile mode under train.compile "auto", which the CPU runs eager."""
    settings = [{key: json.loads(v) if v in ("true", "false") else v} for v in values]
    assert settings[0] != settings[1]
    # (an explicit cuda_graph true needs a graph-able step: the torch embedding compiled; a compile object without
    # "enabled" compiles on any device: "auto", as a file for both devices keeps it, runs eager on the CPU)
    base = {"train.cuda_graph": {"train.compile.enabled": True}, "train.compile.mode": {"train.compile.enabled": "auto"}
            }.get(key, {})
    shown = [f"{key}={json.dumps(s[key])}" for s in settings]
    with pytest.raises(ConfigError, match=rf"^--set: {shown[0]} and {shown[1]} train the same config") as e:
        check_same_configs(str(tiny_config), base, settings)
    if why:
        assert why in str(e.value), str(e.value)
    assert str(e.value).endswith("it would be trained twice and ranked as its own rival; sweep them on a device where "
                                 "they act (cpu trains them as one)"), str(e.value)
    assert "\n" not in str(e.value)


def test_settings_the_device_trains_apart_are_accepted(tiny_config, cpu_only):
    # bf16 autocasts on the CPU too; a compile mode acts where compile is on; the dot vs dcn models differ
    check_same_configs(str(tiny_config), {}, [{"train.precision": "fp32"}, {"train.precision": "bf16"}])
    check_same_configs(str(tiny_config), {"train.compile.enabled": True},
                       [{"train.compile.mode": "default"}, {"train.compile.mode": "max-autotune"}])
    check_same_configs(str(tiny_config), {}, [{"model.interaction": "dot"}, {"model.interaction": "dcn"}])


def test_table_caps_that_cap_no_table_of_the_dataset_are_refused(tiny_config):
    """A data-derived key: the dataset's tables (a few hundred rows here) under a cap of 10^5 or 10^6 are the same
    tables; the two settings trained one model."""
    with pytest.raises(ConfigError, match=r"^--set: data.max_rows_per_table=100000 and data.max_rows_per_table=1000000 "
                                          r"train the same config \(data.max_rows_per_table 100000 and 1000000 cap "
                                          r"the tables of .*ds alike"):
        check_same_configs(str(tiny_config), {}, [{"data.max_rows_per_table": 100000},
                                                  {"data.max_rows_per_table": 1000000}])
    # a cap that folds a table is another model
    check_same_configs(str(tiny_config), {}, [{"data.max_rows_per_table": 3}, {"data.max_rows_per_table": 1000000}])


def test_two_names_of_one_dataset_are_refused(tiny_config, tmp_path):
    """`--set data.path=ds,ds-link`: one dataset under two names (absolute_sets refuses only one name twice) trained
    one model twice, ranked as rivals."""
    real = json.loads(tiny_config.read_text())["data"]["path"]
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match=rf'train the same config \(data.path "{real}" and "{tmp_path}/link" name '
                                          rf'one dataset, {real}\)'):
        check_same_configs(str(tiny_config), {}, [{"data.path": real}, {"data.path": str(tmp_path / "link")}])


def test_a_sweep_of_precisions_the_cpu_trains_alike_writes_nothing(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match=r"train the same config"):
        run_sweep(str(tiny_config), [("train.precision", ["fp32", "tf32"])], 2, tb_dir=str(tmp_path),
                  run_name="sw", train_fn=_fake_train)
    assert not (tmp_path / "sw").exists()


# -- (2) one error for one problem -----------------------------------------------------------------------------------


def test_a_duplicate_grid_is_one_error_without_warnings_about_the_same_settings(tiny_config, tmp_path, logged):
    """It read: three warnings that model.cross_rank has no effect in the dot settings, then the error that two dot
    settings train one config (one problem told twice, the first time as if the sweep would go on)."""
    sets = [("model.interaction", ["dot", "dcn"]), ("model.cross_rank", [4, 8])]
    with pytest.raises(ConfigError, match=r"train the same config"):
        run_sweep(str(tiny_config), sets, 2, tb_dir=str(tmp_path), run_name="dup", train_fn=_fake_train)
    assert [m for level, m in logged if level == "WARNING"] == []


def test_a_grid_that_runs_still_tells_its_inert_keys(tiny_config, tmp_path, logged):
    sets = [("model.interaction", ["dot", "dcn"]), ("model.cross_rank", [4])]
    run_sweep(str(tiny_config), sets, 1, tb_dir=str(tmp_path), run_name="ok", train_fn=_fake_train)
    warned = [m for level, m in logged if level == "WARNING"]
    assert any(m.startswith("model.cross_rank: 4 has no effect in the 1 of the 2 settings") for m in warned), warned


# -- (3) the report's ranking and its ties ---------------------------------------------------------------------------


@pytest.mark.parametrize("first, second", [((0.5, 0.75), (0.5, 0.75)), ((0.5, 0.75), (0.75, 0.5)), ((0.7,), (0.7,))])
def test_a_tie_names_no_winner(first, second):
    """Two settings of one mean AUC: it read "best: x=1 ..., +0.0000 AUC over x=2", the grid's order picking the
    "best", and with equal per-seed AUCs `beyond_noise` was True (a margin of 0 >= 2 x a noise of 0)."""
    from dlrm.sweep import SettingResult, verdict

    a = SettingResult(0, {"x": 1}, [{"auc": v, "logloss": 0.5} for v in first])
    b = SettingResult(1, {"x": 2}, [{"auc": v, "logloss": 0.5} for v in second])
    v = verdict([a, b])
    assert v.beyond_noise is False
    text = v.text()
    seeds = "one seed" if len(first) == 1 else f"mean of {len(first)} seeds"  # (it read "mean of 1 seeds")
    assert text.startswith(f"no winner: x=1 and x=2 tie at AUC {statistics.fmean(first):.4f} ({seeds})"), text
    assert "best" not in text


def test_a_resume_says_it_replaces_the_earlier_report_naming_its_tables(tiny_config, tmp_path, logged):
    """The earlier session's sweep.md, sweep.csv and trials.csv were replaced without a word (the log named its
    hparams/ only)."""
    from dlrm.sweep_resume import resume_sweep

    sets = [("optim.sparse.lr", [0.01, 0.02])]
    directory, _ = run_sweep(str(tiny_config), sets, 1, tb_dir=str(tmp_path), run_name="sw", train_fn=_fake_train)
    first = (directory / "sweep.md").read_text()
    logged.clear()
    resume_sweep(directory, train_fn=_fake_train)
    (line,) = [m for _, m in logged if "earlier session" in m]
    assert all(name in line for name in ("sweep.md", "sweep.csv", "trials.csv", "hparams")), line
    assert (directory / "sweep.md").read_text() == first  # (the same trials: the same report)
