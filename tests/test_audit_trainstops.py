"""Stops and CPU settings of train.py's flows found by a QA pass (helper fix-train-stops; each test failed before its
fix): an interrupted ``--eval-only`` said "the run failed before its first step" and spoke of training; ``--compare``
stopped by a signal while a later variant ran wrote no report of the variants already finished; train.precision "tf32"
on the CPU ran fp32 without a word (its log line said "precision tf32")."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys

import pytest
from loguru import logger

from dlrm.config import Config, load_config, validate
from dlrm.errors import TrainingStopped
from dlrm.stop_signal import StopAtOnce
from dlrm.train import compare
from dlrm.train import export as export_mod
from dlrm.train.run_dir import RunDirectory
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV, REPO, process_output
from tests.test_audit_fast_path_edges import FAKE_SUMMARY
from tests.test_audit_review52 import tiny_config

# --eval-only with the signal sent from inside the evaluation, as `kill -TERM PID` or Ctrl-C would arrive there
EVAL_SIGNAL = """
import os, signal, sys
from dlrm.train import evaluator
real = evaluator.evaluate
def evaluate(forward, loader, env=None):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(forward, loader, env) if env is not None else real(forward, loader)
evaluator.evaluate = evaluate
from dlrm.cli import main
main(sys.argv[2:])
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny config and one finished run's last checkpoint."""
    root = tmp_path_factory.mktemp("trainstops")
    config = tiny_config(root)
    summary = train(load_config(config, {"log.tb_dir": str(root / "tb"), "log.run_name": "r", "train.max_steps": 4}))
    return root, config, summary["checkpoint"]


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_eval_only_says_the_evaluation_was_stopped_and_writes_nothing(tmp_path, trained, name, code):
    """Was: "removed ...: the run failed before its first step", then "SIGTERM: stopped at once, outside the training
    steps (no checkpoint written now)" or "interrupted (Ctrl-C)"."""
    _, config, checkpoint = trained
    tb = tmp_path / "tb"
    done = subprocess.run([sys.executable, "-c", EVAL_SIGNAL, name, "--config", str(config), "--tb-dir", str(tb),
                           "--run-name", "ev", "--eval-only", "--checkpoint", checkpoint],
                          cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == code, process_output(done)
    assert "Traceback" not in done.stderr and "failed" not in done.stderr, process_output(done)
    assert f"removed {tb / 'ev'}: the evaluation was stopped by {name}\n" in done.stderr, process_output(done)
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith(f"--eval-only: {name} stopped the evaluation of {checkpoint}; nothing written"), last
    assert not (tb / "ev").exists()  # no half-written run directory (summary.json, events) left


def test_eval_only_still_writes_its_summary_when_not_stopped(tmp_path, trained):
    """The same evaluation without a signal: its run directory, summary.json and line as before."""
    _, config, checkpoint = trained
    cfg = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "ev"})
    summary = export_mod.evaluate_checkpoint(cfg, checkpoint, "validation")
    assert json.loads((tmp_path / "tb" / "ev" / "summary.json").read_text())["auc"] == summary["auc"]


def _warnings(fn) -> tuple[list[str], object]:
    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="WARNING")
    try:
        result = fn()
    finally:
        logger.remove(sink)
    return said, result


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_tf32_on_the_cpu_is_said_once_and_recorded_as_fp32(tmp_path, precision):
    """train.precision "tf32" has no effect on the CPU (oneDNN's matmuls stay IEEE fp32): said in one warning, as the
    other CUDA-only settings are there (compile mode reduce-overhead, train.cuda_graph), and summary.json's resolved
    precision, the start line and --eval-only's summary say fp32. Was: no word, "precision tf32" everywhere."""
    config = tiny_config(tmp_path, train={"precision": precision})
    cfg = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r", "train.max_steps": 2})
    infos: list[str] = []
    sink = logger.add(lambda m: infos.append(m.record["message"]), level="INFO")
    try:
        said, summary = _warnings(lambda: train(cfg))
    finally:
        logger.remove(sink)
    about = [m for m in said if "tf32" in m]
    if precision == "tf32":
        assert about == ['train.precision "tf32" has no effect on cpu (TF32 tensor cores are CUDA\'s): the run is '
                         "IEEE fp32"], said
    else:
        assert about == [], said
    assert summary["resolved"]["precision"] == "fp32"
    assert any(m.startswith("device cpu, precision fp32, ") for m in infos), infos
    assert summary["config"]["train"]["precision"] == precision  # the config as given stays recorded
    evaluated = load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "ev"})
    said, result = _warnings(lambda: export_mod.evaluate_checkpoint(evaluated, summary["checkpoint"], "validation"))
    assert [m for m in said if "tf32" in m] == (['train.precision "tf32" has no effect on cpu (TF32 tensor cores are '
                                                 "CUDA's): the evaluation is IEEE fp32"] if precision == "tf32" else [])
    assert result["resolved"]["precision"] == "fp32"


@pytest.mark.parametrize("cause, said", [(None, "the run failed before its first step"),
                                         (RuntimeError("x"), "the run failed before its first step"),
                                         ("SIGTERM", "the run was stopped by SIGTERM before its first step"),
                                         ("SIGINT", "the run was stopped by SIGINT before its first step")])
def test_a_run_directory_given_up_names_a_stop_as_a_stop(tmp_path, cause, said):
    """A new run's directory removed at a SIGTERM or Ctrl-C before its first step said "the run failed"."""
    exc = {"SIGTERM": TrainingStopped(143, "stopped"), "SIGINT": KeyboardInterrupt()}.get(cause, cause)
    run = RunDirectory.create(validate(Config()), tmp_path / "r")
    infos: list[str] = []
    sink = logger.add(lambda m: infos.append(m.record["message"]), level="INFO")
    try:
        run.abandon(exc)
    finally:
        logger.remove(sink)
    assert infos == [f"removed {tmp_path / 'r'}: {said}"] and not (tmp_path / "r").exists()


# --compare with the signal sent from inside its second evaluation: the second variant's only one (the tiny config
# evaluates once, at the end), so the first variant finished and the second is stopped where it trains
COMPARE_SIGNAL = """
import os, signal, sys
from dlrm.train import evaluator
real = evaluator.evaluate
calls = []
def evaluate(forward, loader, env=None):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(forward, loader, env) if env is not None else real(forward, loader)
evaluator.evaluate = evaluate
from dlrm.cli import main
main(sys.argv[2:])
"""


def _rows(path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["variant"]: r for r in csv.DictReader(f)}


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_a_later_compare_variant_writes_the_finished_ones_as_a_partial_report(tmp_path, trained, name,
                                                                                             code):
    """Was: exit 143/130 and no compare.md, compare.csv nor compare.png: the finished variant's numbers lost."""
    _, config, _ = trained
    tb = tmp_path / "tb"
    done = subprocess.run([sys.executable, "-c", COMPARE_SIGNAL, name, "--config", str(config), "--tb-dir", str(tb),
                           "--run-name", "cmp", "--max-steps", "4", "--compare", "eager,auto,compiled"],
                          cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == code, process_output(done)
    assert "Traceback" not in done.stderr, process_output(done)
    base = tb / "cmp"
    rows = _rows(base / "compare.csv")
    assert list(rows) == ["eager", "auto", "compiled"], rows
    assert rows["eager"]["status"] == "ok" and float(rows["eager"]["auc"]) > 0 and rows["eager"]["samples_per_sec"]
    # the real session's seconds, start-up and evaluations included: more than its warm-up steps alone
    wall, warm = float(rows["eager"]["wall_s"]), rows["eager"]["warmup_s"]
    assert wall > 0 and (warm == "" or wall > float(warm)), rows["eager"]
    assert rows["auto"]["status"] == f"stopped by {name}" and rows["auto"]["auc"] == ""
    assert rows["compiled"]["status"] == "not run: the comparison was stopped"
    note = f"Partial comparison: stopped by {name} while variant auto trained; not run: compiled."
    md = (base / "compare.md").read_text()
    assert md.startswith(f"# Variant comparison: cmp\n\n**{note}**\n\n"), md
    assert (base / "compare.png").stat().st_size > 0
    assert f"compare: {note} The finished variants (eager) are in {base / 'compare.md'}" in done.stderr
    # the stopped variant's own stop line is the command's last, as a single run's is
    assert "after its last evaluation" in done.stderr.strip().splitlines()[-1], process_output(done)
    assert not list(base.glob(".*.tmp*")) and not list(base.glob("*.tmp"))  # nothing half-written beside them
    assert not (base / "compiled").exists()


def _fake_summary(auc: float) -> dict:
    return {**FAKE_SUMMARY, "auc": auc, "train_losses": [(1, 0.5), (2, 0.25)]}


def _compare_config(tmp_path):
    return load_config(tiny_config(tmp_path), {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "cmp"})


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), TrainingStopped(143, "x")])
def test_a_stop_before_a_later_variants_first_step_is_a_partial_report_too(tmp_path, stop):
    """A Ctrl-C (KeyboardInterrupt) or SIGTERM outside the training steps (`StopAtOnce`) while the second variant is
    built: the first variant's row, the second's "stopped by", and the stop raised for its exit code."""
    def fake_train(vcfg, run_dir):
        if run_dir.name == "auto":
            raise stop
        run_dir.mkdir(parents=True)
        return _fake_summary(0.75)

    with pytest.raises(type(stop)):
        compare.run_comparison(_compare_config(tmp_path), ["eager", "auto"], fake_train)
    rows = _rows(tmp_path / "tb" / "cmp" / "compare.csv")
    signal_name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM"
    assert [(v, r["status"]) for v, r in rows.items()] == [("eager", "ok"), ("auto", f"stopped by {signal_name}")]
    assert rows["eager"]["auc"] == "0.75"


def test_a_stop_in_the_first_variant_writes_no_report_and_removes_the_comparison(tmp_path):
    """Nothing finished, nothing to compare: as before, no report and the comparison's directory removed, its line
    naming the stop (it said "the run failed before its first step")."""
    def fake_train(vcfg, run_dir):
        raise KeyboardInterrupt

    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="INFO")
    try:
        with pytest.raises(KeyboardInterrupt):
            compare.run_comparison(_compare_config(tmp_path), ["eager", "auto"], fake_train)
    finally:
        logger.remove(sink)
    assert not (tmp_path / "tb" / "cmp").exists()
    assert f"removed {tmp_path / 'tb' / 'cmp'}: the run was stopped by SIGINT before its first step" in said


def test_a_signal_while_a_finished_variants_memory_is_released_keeps_its_row(tmp_path, monkeypatch):
    """A SIGTERM deferred by `release_memory` acts as it returns: the variant that had just finished was done, but its
    row was made after that release, so the comparison stopped without it. Now its row comes first: it is in the
    partial report, and no variant is said stopped (the next one had not started)."""
    real = compare.gc.collect

    def collect(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # deferred until release_memory returns
        return real(*args)

    def fake_train(vcfg, run_dir):
        run_dir.mkdir(parents=True)
        monkeypatch.setattr(compare.gc, "collect", collect)
        return _fake_summary(0.7)

    with StopAtOnce(), pytest.raises(TrainingStopped) as stopped:
        compare.run_comparison(_compare_config(tmp_path), ["eager", "auto"], fake_train)
    # its line says where it stopped (it said "SIGTERM: stopped at once, outside the training steps ...")
    assert str(stopped.value) == ("SIGTERM: the comparison stopped after variant eager, before the next began (no "
                                  "checkpoint written now)") and stopped.value.exit_code == 143
    rows = _rows(tmp_path / "tb" / "cmp" / "compare.csv")
    assert [(v, r["status"]) for v, r in rows.items()] == [("eager", "ok"),
                                                            ("auto", "not run: the comparison was stopped")]
    md = (tmp_path / "tb" / "cmp" / "compare.md").read_text()
    assert "**Partial comparison: stopped by SIGTERM; not run: auto.**" in md
