"""--compare with a fake trainer: every row, CSV line and run directory belongs to its own variant; the loss
difference is against the eager variant wherever it is listed; variants that cannot run here are rows saying so."""

from __future__ import annotations

import csv
import re
import sys

import pytest
import torch
import triton

from dlrm.config import load_config
from dlrm.train.compare import parse_variants, run_comparison
from tests.conftest import REPO

FAKE = {  # per variant: samples/s, warm-up s, peak bytes, losses per step, AUC, graph breaks
    "compiled": (2000.0, 9.0, 3 * 2**20, [(2, 0.52), (4, 0.37), (6, 0.30)], 0.71, 3),
    "eager": (1000.0, 1.0, None, [(2, 0.50), (4, 0.40), (6, 0.31)], 0.70, 5),
    "compiled-default": (1500.0, 4.0, 5 * 2**20, [(4, 0.40), (6, 0.35)], 0.72, 0),  # logged from step 4 on
    "auto": (1100.0, 1.5, None, [(2, 0.50), (4, 0.39), (6, 0.31)], 0.70, 0),  # resolved to eager (no graph breaks)
}
WALL = {"compiled": 19.5, "eager": 11.0, "compiled-default": 14.25, "auto": 12.0}  # each variant's session seconds


def fake_train(cfg, run_dir):
    name = run_dir.name
    sps, warm, peak, losses, auc, breaks = FAKE[name]
    assert cfg.train.compile.enabled == ("auto" if name == "auto" else name != "eager")
    run_dir.mkdir(parents=True)  # a second variant in the same directory would fail here
    (run_dir / "mine").write_text(name)
    return {"samples_per_sec": sps, "warmup_s": warm, "peak_memory_bytes": peak, "final_train_loss": losses[-1][1],
            "auc": auc, "compile": {"graph_breaks": breaks}, "train_losses": losses, "wall_s": WALL[name],
            "resolved": {"compile": name not in ("eager", "auto")}}  # "auto" as a CPU run resolves it: eager


def test_each_row_is_its_own_variants_and_the_loss_difference_is_against_eager(tmp_path):
    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})
    names = parse_variants("compiled,eager,compiled-cudagraphs,compiled-default,eager,auto")
    assert names == ["compiled", "eager", "compiled-cudagraphs", "compiled-default", "auto"]
    rows = run_comparison(cfg, names, fake_train)
    base = tmp_path / "tb" / "cmp"
    assert [r["variant"] for r in rows] == names
    by = {r["variant"]: r for r in rows}
    assert by["compiled-cudagraphs"]["status"] == "skipped: CUDA graphs need a CUDA device"
    assert by["compiled-cudagraphs"].get("samples_per_sec") is None
    assert not (base / "compiled-cudagraphs").exists()
    for name, (sps, warm, peak, losses, auc, breaks) in FAKE.items():
        r = by[name]
        assert (base / name / "mine").read_text() == name
        assert (r["status"], r["samples_per_sec"], r["warmup_s"], r["auc"]) == ("ok", sps, warm, auc)
        assert r["final_train_loss"] == losses[-1][1] and r["wall_s"] == WALL[name]
        assert r["peak_memory_mb"] == (None if peak is None else peak / 2**20)
        assert r["graph_breaks"] == (None if name in ("eager", "auto") else breaks)
    assert by["eager"]["max_loss_diff_vs_eager"] == 0.0
    assert by["compiled"]["max_loss_diff_vs_eager"] == pytest.approx(0.03)
    assert by["compiled-default"]["max_loss_diff_vs_eager"] == pytest.approx(0.04)  # step against the same step
    assert "max_loss_diff_vs_eager" not in by["compiled-cudagraphs"]
    with open(base / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["variant"] for t in table] == names
    for t, r in zip(table, rows):
        for key, value in t.items():
            assert value == ("" if r.get(key) is None else str(r[key])), (t["variant"], key)
    md = (base / "compare.md").read_text()
    assert "| compiled | 2,000 | 9.00 | 19.5 | 3 | 0.30000 | 3.00e-02 | 0.7100 | 3 | ok |" in md
    assert "| eager | 1,000 | 1.00 | 11.0 | n/a | 0.31000 | 0.00e+00 | 0.7000 | n/a | ok |" in md
    assert "wall: the variant's whole session" in md
    # what produced the numbers: the device, the libraries' versions and the date
    head = md.splitlines()[2]
    assert head.startswith(f"Device: CPU; python {sys.version.split()[0]}, torch {torch.__version__}, "
                           f"triton {triton.__version__}"), head
    assert re.search(r"; 20\d\d-\d\d-\d\d \d\d:\d\d UTC\.$", head), head


def test_without_an_eager_variant_there_is_no_loss_difference(tmp_path):
    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})
    rows = run_comparison(cfg, ["compiled", "compiled-default"], fake_train)
    assert all(r.get("max_loss_diff_vs_eager") is None for r in rows)


def test_a_step_graph_variant_turns_an_unfused_dense_optimizer_back_to_auto():
    from dlrm.train.compare import variant_config

    cfg = load_config(REPO / "configs" / "sample.json", {"optim.dense.fused": False})
    assert variant_config(cfg, "triton-embedding+step-graph").optim.dense.fused is None
    assert variant_config(cfg, "triton-embedding+compiled").optim.dense.fused is False
    assert cfg.optim.dense.fused is False  # the user's config is left as it was


def test_a_variant_named_twice_trains_once_and_says_so():
    """`--compare eager,auto,eager` trained eager once without a word (the duplicate dropped silently)."""
    from loguru import logger

    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        assert parse_variants("eager,auto") == ["eager", "auto"]
        assert not seen
        assert parse_variants("eager,auto,eager, auto") == ["eager", "auto"]
    finally:
        logger.remove(handle)
    assert seen == ["--compare: 'eager', 'auto' given more than once; each variant trains once (its run directory is "
                    "named after it): compare two runs of one variant with two --compare runs"]

