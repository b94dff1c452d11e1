"""A new user's journey through README (audit, each test failed before its fix): configs/terabyte.json on a
vocabulary-hashed dataset, `--resume RUN_DIR`, and the generator's rounding of a split fraction to no row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.config import Config, ConfigError, load_config
from dlrm.data import synthetic
from dlrm.data.schema import NUM_SPARSE, Metadata
from dlrm.logging_setup import configure_logging
from dlrm.train.setup import dataset_tables
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


def one_error(result, code: int) -> str:
    """The run's one ERROR line, after checking the exit code and that no traceback was printed."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.output
    return errors[0]


def vocabulary_dataset(root: Path, rows: int) -> Metadata:
    """The metadata of a vocabulary-hashed dataset whose 26 tables have `rows` rows, its vocabularies written."""
    (root / "vocab").mkdir(parents=True)
    for f in range(NUM_SPARSE):
        np.save(root / "vocab" / f"SPARSE_{f}.npy", np.arange(10, 10 + rows - 1, dtype=np.int64))
    return Metadata(cardinalities=[rows] * NUM_SPARSE, hashing="vocabulary")


def test_terabyte_config_trains_a_vocabulary_dataset_whose_tables_are_within_its_cap(tmp_path):
    """README: `--data DIR` with any config. configs/terabyte.json caps tables at 10M rows; on any vocabulary-hashed
    dataset (README's `--hashing vocabulary` path) it was refused, "cannot cap tables of a vocabulary-hashed
    dataset", though no table came near the cap. A table above the cap is still refused, naming it."""
    cfg = load_config(REPO / "configs" / "terabyte.json")
    assert cfg.data.max_rows_per_table == 10_000_000
    meta = vocabulary_dataset(tmp_path / "voc", 50)
    tables = dataset_tables(cfg, meta, tmp_path / "voc")
    assert tables.hashing == "vocabulary" and tables.cardinalities == [50] * NUM_SPARSE
    assert len(tables.vocabs) == NUM_SPARSE and tables.vocabs[3].tolist() == list(range(10, 59))

    small = Config()
    small.data.max_rows_per_table = 49
    with pytest.raises(ConfigError, match=r"^data.max_rows_per_table: cannot cap tables of a vocabulary-hashed "
                                          r"dataset \(.*voc: SPARSE_0 has 50 rows > 49"):
        dataset_tables(small, meta, tmp_path / "voc")


def test_resume_of_a_run_directory_is_refused_naming_how_to_resume_it(tmp_path):
    """`--resume tb_logs/r1` (the run directory, as `--checkpoint` takes one) said "--resume: tb_logs/r1: checkpoint
    not found" of a directory that exists, after reading the dataset: now one line, before any work, saying how."""
    run = tmp_path / "tb" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    result = CliRunner().invoke(cli.main, ["--config", str(REPO / "configs" / "sample.json"), "--tb-dir",
                                           str(tmp_path / "tb"), "--resume", str(run)])
    line = one_error(result, 2)
    assert f"--resume: {run} is a directory, not a checkpoint file" in line, line
    assert f"--tb-dir {tmp_path / 'tb'} --run-name r1 --resume" in line, line
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["r1"]  # nothing written
    assert not any(run.joinpath("checkpoints").iterdir())


def test_generator_refuses_a_split_fraction_that_rounds_to_no_row(tmp_path):
    """`--rows 3` (10% validation, 10% test by default) wrote a dataset of 3 train rows and no validation split, and
    said it was done; train.py then refused it ("has no 'validation' split"). A fraction asked for must give a row;
    a fraction of 0 still means no such split, and the finished line has no dangling comma without an oracle AUC."""
    result = CliRunner().invoke(synthetic.main, ["--rows", "3", "--cardinalities", "tiny", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2, result.output
    assert "--validation-fraction of 3 rows rounds to no validation row" in result.output, result.output
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())

    result = CliRunner().invoke(synthetic.main, ["--rows", "30", "--cardinalities", "tiny", "--test-fraction", "0.01",
                                                 "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "--test-fraction of 30 rows rounds to no test row" in result.output, result.output

    meta = synthetic.generate(tmp_path / "c", 1, cardinalities="tiny", validation_fraction=0, test_fraction=0)
    assert {s: i.rows for s, i in meta.splits.items()} == {"train": 1}
    line = synthetic._done_line(synthetic._settings(tmp_path / "d", 1, 0, "tiny", None, 0.0, 0.0, 10, False,
                                                    "default"), meta, 0.5)
    assert line.endswith("positive rate 0.0000") or line.endswith("positive rate 1.0000"), line
    assert json.loads((tmp_path / "c" / "metadata.json").read_text())["splits"].keys() == {"train"}


def test_eval_only_of_a_runs_checkpoints_folder_means_the_run(tmp_path, monkeypatch):
    """`--checkpoint tb_logs/r1/checkpoints` (the folder holding best.pt and step-*.pt) was refused as "a directory
    without checkpoints/best.pt or step-*.pt": it now means its run, as `--checkpoint tb_logs/r1` does (best.pt)."""
    import dlrm.train.export as export_mod

    evaluated = []
    monkeypatch.setattr(export_mod, "evaluate_checkpoint", lambda cfg, path, split: evaluated.append((path, split)))
    folder = tmp_path / "tb" / "r1" / "checkpoints"
    folder.mkdir(parents=True)
    for name in ("step-00000002.pt", "best.pt"):
        (folder / name).write_bytes(b"not read here")
    for given in (folder, tmp_path / "tb" / "r1"):
        result = CliRunner().invoke(cli.main, ["--config", str(REPO / "configs" / "sample.json"), "--tb-dir",
                                               str(tmp_path / "tb"), "--eval-only", "--checkpoint", str(given)])
        assert result.exit_code == 0, result.output
    assert evaluated == [(folder / "best.pt", "validation")] * 2


@pytest.mark.parametrize("flags", [["--eval-only", "--profile"], ["--eval-only", "--baseline"],
                                   ["--eval-only", "--max-steps", "5"], ["--eval-only", "--epochs", "2"],
                                   ["--eval-only", "--checkpoint-every", "10"],
                                   ["--export", "OUT", "--profile"], ["--export", "OUT", "--max-steps", "5"]])
def test_a_run_that_trains_nothing_refuses_the_options_that_act_on_training(tmp_path, monkeypatch, flags):
    """`--eval-only --profile` wrote no trace and `--eval-only --baseline` fitted no baseline, without a word (as did
    --max-steps, --epochs and --checkpoint-every, and an --export of a --checkpoint): check_modes refuses "option
    combinations whose one part would otherwise be silently ignored". Now one line naming the option, nothing run."""
    import dlrm.train.export as export_mod

    ran = []
    monkeypatch.setattr(export_mod, "evaluate_checkpoint", lambda *a: ran.append(a))
    monkeypatch.setattr(export_mod, "export_checkpoint", lambda *a: ran.append(a))
    ckpt = tmp_path / "step-00000002.pt"
    ckpt.write_bytes(b"not read here")
    flags = [str(tmp_path / "m.pt2") if f == "OUT" else f for f in flags]
    result = CliRunner().invoke(cli.main, ["--config", str(REPO / "configs" / "sample.json"), "--tb-dir",
                                           str(tmp_path / "tb"), "--checkpoint", str(ckpt), *flags])
    line = one_error(result, 2)
    option = next(f for f in flags if f in ("--profile", "--baseline", "--max-steps", "--epochs", "--checkpoint-every"))
    assert f"{option}: acts only on training" in line, line
    assert ran == [] and not (tmp_path / "tb").exists() and not (tmp_path / "m.pt2").exists()

    ok = CliRunner().invoke(cli.main, ["--config", str(REPO / "configs" / "sample.json"), "--tb-dir",
                                       str(tmp_path / "tb"), "--checkpoint", str(ckpt), "--eval-only", "--no-baseline"])
    assert ok.exit_code == 0 and len(ran) == 1, ok.output  # what happens anyway may be said
