"""Small click logs (#21): the default path for them (raw log -> ``python -m dlrm.preprocess --hashing vocabulary
--min-frequency auto`` -> configs/criteo-small.json) reaches at least the built-in linear baseline.

Quality is measured on the synthetic ``small-real`` regime (a 10,000-line click log's shape: Kaggle
category counts, most values rare), whose raw TSV goes through the real preprocessor, over 3 seeds;
the real samples of ../shared/criteo check the same pipeline end to end (skipped without them).
Eager CPU, a few seconds a seed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.config import load_config
from dlrm.data import synthetic
from dlrm.data.preprocess import preprocess
from dlrm.data import preprocess as pp
from dlrm.data.preprocess.frequency import auto_min_frequency, train_rows_of_plan
from dlrm.data.preprocess.splits import SplitPlan
from dlrm.data.schema import SPARSE_COLUMNS, read_metadata
from dlrm.sweep import parse_set, run_sweep
from dlrm.train.baseline import run_baseline
from dlrm.train.setup import dataset_tables
from dlrm.train.trainer import train
from tests.conftest import REPO, SHARED_CRITEO
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)
from tests.shared_once import computed_once

SEEDS = (0, 1, 2)
CONFIG = REPO / "configs" / "criteo-small.json"


def preprocessed(raw, out, **options):
    """`raw` through the preprocessor (one process, quiet); returns the dataset directory."""
    preprocess([raw], out, workers=1, progress=False, **options)
    return out


@pytest.fixture(scope="module")
def regime(tmp_path_factory):
    """Per seed: the small-real regime's parquet dataset, its raw TSV preprocessed the recommended way
    (vocabulary, --min-frequency auto) and with plain modulus hashing (no threshold: tables of the distinct train values + 1 rows, values collide).
    Made once per test run and shared by the pytest-xdist workers (`tests.shared_once`: 7.5 s on one thread of a
    loaded 2-core machine, paid by each worker that ran any of this module's tests); tests only read it."""

    def make(root: Path) -> None:
        for seed in SEEDS:
            raw = root / f"log-{seed}.txt"
            synthetic.generate(root / f"syn-{seed}", seed=seed, raw_tsv=raw, regime="small-real")
            preprocessed(raw, root / f"voc-{seed}", hashing="vocabulary", min_frequency="auto")
            preprocessed(raw, root / f"mod-{seed}")

    root = computed_once(tmp_path_factory, "small-real-regime", make)
    return {seed: {"synthetic": root / f"syn-{seed}", "vocabulary": root / f"voc-{seed}",
                   "modulus": root / f"mod-{seed}"} for seed in SEEDS}


def config(data_dir, tmp_path, name, **overrides):
    return load_config(CONFIG, {"data.path": str(data_dir), "train.device": "cpu", "log.tb_dir": str(tmp_path),
                                "log.run_name": name, **overrides})


def baseline_of(data_dir) -> dict:
    """The built-in baseline's metrics on a dataset's validation split."""
    cfg = load_config(CONFIG, {"data.path": str(data_dir), "train.baseline": True})
    meta = read_metadata(data_dir)
    return run_baseline(cfg, meta, dataset_tables(cfg, meta, data_dir), torch.device("cpu"))


def train_values(data_dir, feature: int) -> np.ndarray:
    meta = read_metadata(data_dir)
    col = np.concatenate([pq.read_table(data_dir / f, columns=[SPARSE_COLUMNS[feature]]).column(0).to_numpy()
                          for f in meta.splits["train"].files])
    return col[col >= 0]


def test_regime_looks_like_a_small_preprocessed_real_log(regime):
    syn, mod, voc = (read_metadata(regime[0][k]) for k in ("synthetic", "modulus", "vocabulary"))
    assert {s: i.rows for s, i in syn.splits.items()} == {"train": 8_572, "validation": 714, "test": 714}
    assert {s: i.rows for s, i in mod.splits.items()} == {"train": 8_572, "validation": 714, "test": 714}
    assert syn.cardinalities == mod.cardinalities  # the preprocessor sizes the raw log's tables the same way
    counts = np.concatenate([np.unique(train_values(regime[0]["synthetic"], f), return_counts=True)[1]
                             for f in range(26)])
    assert (counts == 1).mean() > 0.6  # most values are unique
    assert 0.2 < syn.splits["train"].positives / 8_572 < 0.3
    # --min-frequency auto: the rule's value for 8,572 train rows, and exactly the values seen that often
    used = voc.extra["options"]["min_frequency_used"]
    assert voc.extra["options"]["min_frequency"] == "auto" and used == auto_min_frequency(8_572) == 14
    for f in (0, 2, 9):
        values, n = np.unique(train_values(regime[0]["synthetic"], f), return_counts=True)
        assert voc.cardinalities[f] == int((n >= used).sum()) + 1


def test_default_config_reaches_at_least_the_linear_baseline(regime, tmp_path):
    dlrm, base, full = [], [], []
    for seed in SEEDS:
        summary = train(config(regime[seed]["vocabulary"], tmp_path, f"s{seed}", **{"train.seed": seed}))
        assert summary["baseline"] is not None  # "auto": 8,572 train rows on the CPU
        dlrm.append(summary["auc"])  # the final model, not the best evaluation (no selection on validation)
        base.append(summary["baseline"]["auc"])
        full.append(baseline_of(regime[seed]["modulus"])["auc"])  # a linear model on every value seen in train
    assert statistics.fmean(dlrm) >= statistics.fmean(base), (dlrm, base)
    assert statistics.fmean(dlrm) >= statistics.fmean(full), (dlrm, full)


def test_the_sweep_finds_a_setting_at_least_as_good(regime, tmp_path):
    data = regime[0]["vocabulary"]
    base = baseline_of(data)["auc"]
    sets = [parse_set("optim.sparse.lr=0.01,0.03")]  # 0.01 is the config's own value
    directory, result = run_sweep(str(CONFIG), sets, 3, {"data.path": str(data), "train.device": "cpu",
                                                          "train.baseline": False}, str(tmp_path), "sweep")
    rows = [result.winner, result.runner_up]
    assert sorted(r.setting["optim.sparse.lr"] for r in rows) == [0.01, 0.03]
    assert rows[0].auc_mean != rows[1].auc_mean  # each setting reached its runs (the same runs would tie)
    assert result.winner.auc_mean >= base  # the sweep's pick beats a linear model on every value seen in train
    assert (directory / "sweep.md").is_file()


needs_real = pytest.mark.skipif(not SHARED_CRITEO.is_dir(), reason="../shared/criteo is absent")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Both real samples (raw TSV and the CSV variant) in one run: 300 lines, 30% validation."""
    out = tmp_path_factory.mktemp("real") / "ds"
    preprocess([SHARED_CRITEO / "part-0.tsv", SHARED_CRITEO / "criteo_sample.txt"], out, workers=1, progress=False,
               split="random", validation_fraction=0.3, test_fraction=0.1, hashing="vocabulary", min_frequency="auto")
    return out


@pytest.fixture(scope="module")
def real_default_run(real, tmp_path_factory):
    """The config as it is (train.seed 0, its default) on the real samples: (summary, run directory). Both real-sample
    tests read it (the second as its seed 0): the same run, trained once a worker instead of twice (~1.5 s)."""
    tb = tmp_path_factory.mktemp("real-run")
    return train(config(real, tb, "real")), tb / "real"


@needs_real
def test_real_samples_default_path_end_to_end(real, real_default_run):
    meta = read_metadata(real)
    assert meta.splits["train"].rows + meta.splits["validation"].rows + meta.splits["test"].rows == 300
    assert meta.extra["options"]["min_frequency_used"] == 2
    summary, run_dir = real_default_run
    assert json.loads((run_dir / "summary.json").read_text())["baseline"]["auc"] == summary["baseline"]["auc"]
    # 165 rows: 1 batch of 128 an epoch, so train.min_steps (200) sets the length, not the 3 epochs
    assert 0.0 < summary["baseline"]["logloss"] and summary["steps"] == 200


@needs_real
def test_real_samples_reach_the_baseline_with_the_defaults(real, real_default_run, tmp_path):
    """A split of a few hundred rows is one batch an epoch: the config's train.min_steps gives it enough steps."""
    assert load_config(CONFIG).train.seed == 0 == SEEDS[0]  # the shared run is this test's seed 0
    aucs, bases = [], []
    for seed in SEEDS:
        summary = real_default_run[0] if seed == 0 else train(config(real, tmp_path, f"r{seed}", **{"train.seed": seed}))
        aucs.append(summary["auc"])
        bases.append(summary["baseline"]["auc"])
    assert statistics.fmean(aucs) >= statistics.fmean(bases), (aucs, bases)


# -- --min-frequency auto and the regime's command line -------------------------------------------


def test_auto_rule_grows_like_the_square_root_within_its_bounds():
    assert [auto_min_frequency(n) for n in (0, 86, 8_572, 85_714, 10**6, 39_291_958)] == [2, 2, 14, 44, 50, 50]
    sizes = [10**k for k in range(2, 8)]
    assert all(a <= b for a, b in zip(map(auto_min_frequency, sizes), map(auto_min_frequency, sizes[1:])))
    lines = [6_000, 4_000]
    assert train_rows_of_plan(SplitPlan.build("sequential", lines), lines) == 8_572
    assert train_rows_of_plan(SplitPlan.build("days", lines), lines) == 6_000
    plan = SplitPlan.build("random", lines, validation_fraction=0.3, test_fraction=0.1)
    assert train_rows_of_plan(plan, lines) == 6_000


def preprocess_cli(*args):
    return subprocess.run([sys.executable, "-m", "dlrm.preprocess", *map(str, args), "--workers", "1", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--min-frequency", "auto"], "error: --min-frequency auto: the frequency threshold applies to --hashing vocabulary only"),
    (["--hashing", "vocabulary", "--min-frequency", "often"], "'often' is not an integer or auto"),
    (["--hashing", "vocabulary", "--min-frequency", "0"], "0 must be >= 1 (or auto)"),
])
def test_bad_min_frequency_is_one_line_and_writes_nothing(regime, tmp_path, args, message):
    raw = regime[0]["synthetic"].parent / "log-0.txt"
    res = preprocess_cli("--input", raw, "--output", tmp_path / "out", *args)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and message in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_auto_resumes_an_interrupted_run_to_the_same_dataset(regime, tmp_path):
    """The manifest keeps "auto" (not its value), so the same command resumes; the result is that of an
    uninterrupted run."""
    raw = regime[0]["synthetic"].parent / "log-0.txt"
    options = dict(workers=1, progress=False, hashing="vocabulary", min_frequency="auto", chunk_rows=2_000)
    with pytest.raises(pp._Interrupted):
        pp.preprocess([raw], tmp_path / "resumed", _max_new_chunks=2, **options)
    resumed = pp.preprocess([raw], tmp_path / "resumed", **options)
    whole = read_metadata(regime[0]["vocabulary"])
    assert resumed.cardinalities == whole.cardinalities and resumed.extra["options"]["min_frequency_used"] == 14
    for f in range(26):
        assert np.array_equal(np.load(tmp_path / "resumed" / "vocab" / f"{SPARSE_COLUMNS[f]}.npy"),
                              np.load(regime[0]["vocabulary"] / "vocab" / f"{SPARSE_COLUMNS[f]}.npy"))


def test_regime_command_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "dlrm.data.synthetic", "--out", str(tmp_path / "none")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--rows: required (or a --regime that sets it" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "none").exists()
    from click.testing import CliRunner

    res = CliRunner().invoke(synthetic.main, ["--regime", "small-real", "--rows", "1400", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    meta = read_metadata(tmp_path / "r")
    assert {s: i.rows for s, i in meta.splits.items()} == {"train": 1_200, "validation": 100, "test": 100}
    assert meta.extra["regime"] == "small-real" and meta.extra["command"].endswith("--regime small-real")
    assert sum(meta.cardinalities) < 26 * 1_200  # distinct train values + 1, not the 33.8M Kaggle categories
