"""Review of session 58's run records and sweep HParams (session 59): a run's config.json written by a version before a
section existed is told of its inert keys, not refused; --eval-only's numbers in TensorBoard; the samples/s of a session
without a steady window leaves the train loader's shutdown (and an early stop's evaluation) out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loguru import logger

from dlrm.config import ConfigError, load_config
from dlrm.logging_setup import configure_logging
from tests.conftest import REPO

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    configure_logging()


@pytest.fixture
def warnings():
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handle)


def _older_record(tmp_path: Path) -> dict:
    """A run's config.json as a version before the ``distributed`` section (2026-11-23) wrote it: every section of
    its day, momentum 0.9 kept beside Adam (which that version accepted)."""
    sample = json.loads(json.dumps(SAMPLE))
    sample["optim"]["dense"]["momentum"] = 0.9
    (tmp_path / "sample.json").write_text(json.dumps(sample))
    record = load_config(tmp_path / "sample.json").to_dict()
    for section in ("distributed", "profile", "checkpoint"):
        del record[section]
    del record["log"]["sweep_keys"]
    return record


def test_a_runs_config_json_of_a_version_before_a_section_is_told_not_refused(tmp_path, warnings):
    """tb_logs/<run>/config.json of a run trained before the distributed section existed, given again as --config:
    refused, exit 2 ("remove it, or set optim.dense.name"), for a key its own version had trained with."""
    record = _older_record(tmp_path)
    run = tmp_path / "tb" / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(record))
    cfg = load_config(run / "config.json", inert_keys="refuse")
    assert (cfg.optim.dense.name, cfg.optim.dense.momentum) == ("adam", 0.9)
    assert len(warnings) == 1 and warnings[0].startswith("optim.dense.momentum: 0.9 has no effect") \
        and "run's config.json" in warnings[0], warnings
    # the same JSON kept as a file of the user's own (no run beside it) is refused as before
    (tmp_path / "mine.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"mine\.json: optim\.dense\.momentum: 0\.9 has no effect"):
        load_config(tmp_path / "mine.json", inert_keys="refuse")


def _tiny_config(tmp_path: Path) -> Path:
    """A 4-step run on a one-hot dataset of 40 train rows, checkpointed at steps 2 and 4."""
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16})
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "max_steps": 4, "log_every": 2, "eval_every": 2, "device": "cpu", "seed": 5,
                     "baseline": False},
           "checkpoint": {"every": 2, "keep": 10}, "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    return tmp_path / "c.json"


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_eval_only_puts_its_numbers_into_tensorboard(tmp_path):
    """--eval-only makes a run directory under tb_logs; it held config.json and summary.json only, so TensorBoard
    listed no such run and its AUC was nowhere beside the training runs' curves."""
    from dlrm.train.export import evaluate_checkpoint
    from dlrm.train.trainer import train

    config = _tiny_config(tmp_path)
    trained = train(load_config(config, {"log.run_name": "r"}))
    checkpoint = tmp_path / "tb" / "r" / "checkpoints" / "step-00000002.pt"
    summary = evaluate_checkpoint(load_config(config, {"log.run_name": "ev"}), checkpoint, "validation")
    scalars = _scalars(tmp_path / "tb" / "ev")
    assert sorted(scalars) == ["eval/accuracy", "eval/auc", "eval/logloss"]
    for key in ("auc", "logloss", "accuracy"):  # at the checkpoint's step, as the training run's evaluation there
        assert scalars[f"eval/{key}"] == [(2, pytest.approx(summary[key], abs=1e-6))]
        assert _scalars(tmp_path / "tb" / "r")[f"eval/{key}"][0] == (2, pytest.approx(summary[key], abs=1e-6))
    assert trained["steps"] == 4


def test_a_short_sessions_samples_per_sec_leaves_the_loaders_shutdown_out(tmp_path, monkeypatch, clock):
    """A session of no more steps than the warm-up (a run resumed a few steps before its end, or --max-steps 3) has no
    steady window: its samples/s is its loop's average, which ran to the loop's end, after the train loader had
    stopped (its producer decoding ahead). The last window leaves that shutdown out since session 58; the average
    did not. Here the shutdown takes 1000 s of the clock the run reads and the 3 steps far less (a real 2 s sleep was
    not far more than 3 steps on CI's 2 loaded cores)."""
    from dlrm.data.parquet_loader import ParquetLoader
    from dlrm.train.trainer import train

    shutdown_s, original = 1000.0, ParquetLoader.close

    def slow_close(self):
        clock(shutdown_s)
        original(self)

    monkeypatch.setattr(ParquetLoader, "close", slow_close)
    summary = train(load_config(_tiny_config(tmp_path), {"log.run_name": "r", "train.max_steps": 3,
                                                          "train.eval_every": None, "checkpoint.every": None}))
    assert summary["steps"] == 3 and summary["samples"] == 24
    assert summary["samples_per_sec"] > summary["samples"] / shutdown_s, summary["samples_per_sec"]


def test_an_early_stop_after_its_last_window_keeps_the_evaluation_out_of_the_average(clock):
    """The loop's end taken at its last window's read (before that step's evaluation), the seconds paused after it
    are not taken off again: 2 steps in 20 s, then an evaluation of 50 s and a stop (jumps of the clock the meter
    reads: with real sleeps of 0.1-0.5 s, a loaded machine's late wake-ups were a fair share of the bounds)."""
    from dlrm.train.meter import RunStats, StepMeter

    meter = StepMeter(torch.device("cpu"), start_step=0, stats=RunStats(), window=2)
    for _ in range(2):
        clock(10)
        meter.step(torch.tensor(0.5), samples=100, data_wait_s=0.0)
    meter.log_window(step=2, mean_loss=0.5)
    with meter.paused():
        clock(50)
    clock(30)  # the loader's shutdown after the stop
    meter.finish()
    assert 200 / 25 < meter.samples_per_sec < 200 / 19, meter.samples_per_sec


def test_a_sweep_refuses_a_cap_below_a_vocabulary_table_before_its_first_trial(tmp_path):
    """--set data.max_rows_per_table=null,100 on a vocabulary-hashed dataset (a table of 224 rows): the capped
    setting's run refuses the cap, and found by its first trial, it ended the sweep after the settings before it had
    trained, with "--resume finishes it", which could not (the record keeps the cap). Now refused before any trial,
    as a missing dataset is (`dlrm.sweep_checks.check_datasets`); a cap that no table exceeds stays accepted."""
    import dataclasses

    from dlrm.data.schema import read_metadata, write_metadata
    from dlrm.sweep_checks import check_datasets
    from tests.conftest import make_dataset

    data = tmp_path / "voc"
    make_dataset(data, {"train": 20, "validation": 8}, cardinality=224)
    write_metadata(data, dataclasses.replace(read_metadata(data), hashing="vocabulary"))
    (tmp_path / "c.json").write_text(json.dumps({"data": {"path": str(data)}}))
    base = {"data.path": str(data)}
    check_datasets(str(tmp_path / "c.json"), base, [{"data.max_rows_per_table": 1000}], str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--set data\.max_rows_per_table=100: data\.max_rows_per_table: cannot cap "
                                          r"tables of a vocabulary-hashed dataset \(.*voc: SPARSE_0 has 224 rows > 100"):
        check_datasets(str(tmp_path / "c.json"), base, [{"data.max_rows_per_table": None},
                                                        {"data.max_rows_per_table": 100}], str(tmp_path))


def test_a_sweep_refuses_two_settings_whose_caps_bind_no_table(tmp_path):
    """--set data.max_rows_per_table=null,1000 on a dataset whose largest table has 224 rows: the cap changes no table,
    so both settings trained the same model, ranked as rivals ("+0.0000 AUC over" the other). Refused before the first
    trial, as two settings of one config are (`check_same_configs`); caps that bind stay accepted, and a resumed sweep
    (`check_datasets` alone: its grid began so) is not refused midway."""
    from dlrm.sweep_checks import check_datasets
    from tests.conftest import make_dataset

    data = tmp_path / "ds"
    make_dataset(data, {"train": 20, "validation": 8}, cardinality=224)
    (tmp_path / "c.json").write_text(json.dumps({"data": {"path": str(data)}}))
    config, base = str(tmp_path / "c.json"), {"data.path": str(data)}
    from dlrm.sweep_checks import check_same_configs

    check_same_configs(config, base, [{"data.max_rows_per_table": v} for v in (None, 100, 200)])
    check_datasets(config, base, [{"data.max_rows_per_table": v} for v in (None, 100, 200)], str(tmp_path))
    grid = [{"data.max_rows_per_table": v} for v in (None, 100, 1000)]
    # (the sweep checks the grid's configs first: `check_same_configs` resolves the dataset's tables, session 59)
    with pytest.raises(ConfigError, match=r"^--set: data\.max_rows_per_table=null and data\.max_rows_per_table=1000 "
                                          r"train the same config \(data\.max_rows_per_table null and 1000 cap the "
                                          r"tables of .*ds alike \(the largest has 224 rows\)"):
        check_same_configs(config, base, grid)
    check_datasets(config, base, grid, str(tmp_path))  # (a resumed sweep's: its grid began so, not refused midway)


def test_eval_only_of_the_test_split_logs_eval_test_scalars(tmp_path):
    """`train.py --eval-only --checkpoint C --split test` wrote its test numbers as eval/*, the tags of the validation
    evaluations (training runs' curves, another --eval-only's): in TensorBoard a test evaluation read as a validation
    one. Now they are eval/test/*, as a training run names its evaluations of another split than its curve's; a
    validation evaluation keeps eval/*."""
    from click.testing import CliRunner

    import dlrm.cli as cli
    from tests.conftest import make_dataset

    config = _tiny_config(tmp_path)
    raw = json.loads(config.read_text())
    make_dataset(tmp_path / "ds3", {"train": 40, "validation": 16, "test": 24})
    raw["data"]["path"] = str(tmp_path / "ds3")
    config.write_text(json.dumps(raw))
    from dlrm.train.trainer import train

    train(load_config(config, {"log.run_name": "r"}))
    checkpoint = tmp_path / "tb" / "r" / "checkpoints" / "step-00000004.pt"
    for split in ("test", "validation"):
        result = CliRunner().invoke(cli.main, ["--config", str(config), "--eval-only", "--checkpoint", str(checkpoint),
                                               "--split", split, "--run-name", f"ev-{split}"])
        assert result.exit_code == 0, result.output
    test = _scalars(tmp_path / "tb" / "ev-test")
    assert sorted(test) == ["eval/test/accuracy", "eval/test/auc", "eval/test/logloss"], sorted(test)
    summary = json.loads((tmp_path / "tb" / "ev-test" / "summary.json").read_text())
    assert summary["split"] == "test" and summary["rows"] == 24
    for key in ("auc", "logloss", "accuracy"):  # the test split's numbers, at the checkpoint's step
        assert test[f"eval/test/{key}"] == [(4, pytest.approx(summary[key], abs=1e-6))]
    assert sorted(_scalars(tmp_path / "tb" / "ev-validation")) == ["eval/accuracy", "eval/auc", "eval/logloss"]
