"""A SIGTERM whose `StopAtOnce` exception a library's catch-all dropped, in the commands other than a training run's
start-up (tests/test_swallowed_signal.py): ``--export`` of a ``--checkpoint``, ``python -m dlrm.distributed.merge``,
a sweep's report, and the data tools (``dlrm.data.synthetic``, ``dlrm.preprocess``: their `Terminated`, a
KeyboardInterrupt, passes an ``except Exception`` but not a bare ``except:`` or ``except BaseException``). Each stops
before its output is put in place (nothing written, exit 128 + the signal, one line) where before it finished and
exited 0 as if no signal had come. One dropped once the command's results are all
written stops nothing: exit 0 and the line of a signal that came after them (`dlrm.stop_signal.LateSignals`), where
before the command exited 0 without a word.

As there, the library is a catch-all wrapper around a real call that raises the signal inside: no timing.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrm.logging_setup import configure_logging
from tests import test_checkpoint_safety as safety

# the 3-step run whose checkpoint the merge's shards are made of (module-scoped), bound as test_checkpoint_safety_sharded
# binds it
trained = safety.trained


def _swallowing(call, after: bool = False, caught: type = Exception):
    """`call` as a library that drops every error (`caught`) would run it, the SIGTERM arriving inside (`after`: once
    it returned)."""

    def raised_and_dropped() -> None:
        try:
            signal.raise_signal(signal.SIGTERM)  # the handler runs here (the main thread), raising into the `try`
        except caught:  # noqa: BLE001 - the library's catch-all: the stop's exception dropped
            pass

    def wrapped(*args, **kwargs):
        if not after:
            raised_and_dropped()
        result = call(*args, **kwargs)
        if after:
            raised_and_dropped()
        return result

    return wrapped


def _invoke(command, args: list[str]):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (StopAtOnce installs its handler over the default)
    try:
        result = CliRunner().invoke(command, args)
    finally:
        configure_logging()  # (the command pointed loguru at CliRunner's stderr, closed now)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers put back, nothing left pending
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained 2-step run: its config file and run directory."""
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.test_audit_review52 import tiny_config

    root = tmp_path_factory.mktemp("swallowed")
    config = tiny_config(root)
    summary = train(load_config(config, {"log.tb_dir": str(root / "tb"), "log.run_name": "src", "train.max_steps": 2}))
    return config, Path(summary["run_dir"])


def test_export_of_a_checkpoint_stops_on_a_dropped_sigterm(run, tmp_path, monkeypatch):
    """Before the fix the program was exported to OUT and the command exited 0."""
    from dlrm import cli
    from dlrm.train import trainer as trainer_mod

    config, run_dir = run
    monkeypatch.setattr(trainer_mod, "build_for_data", _swallowing(trainer_mod.build_for_data))
    out = tmp_path / "m.pt2"
    result = _invoke(cli.main, ["--config", str(config), "--checkpoint", str(run_dir), "--export", str(out)])
    assert result.exit_code == 143, result.output
    lines = [line for line in result.output.splitlines() if "SIGTERM" in line]
    assert lines == [lines[0]] and f"WARNING --export: SIGTERM stopped the export of {run_dir / 'checkpoints' / 'best.pt'} " \
        f"to {out}: nothing written there" in lines[0], result.output
    assert list(tmp_path.iterdir()) == []  # no program, no temporary beside it


def test_export_of_a_checkpoint_says_a_sigterm_dropped_after_it_was_written(run, tmp_path, monkeypatch):
    """The program written, a SIGTERM dropped before the command's end: nothing is left to stop, exit 0 with the line
    of a signal after the results (before the fix: exit 0 without a word)."""
    from dlrm import cli
    from dlrm.train import export as export_mod

    config, run_dir = run
    monkeypatch.setattr(export_mod, "export_checkpoint", _swallowing(export_mod.export_checkpoint, after=True))
    out = tmp_path / "m.pt2"
    result = _invoke(cli.main, ["--config", str(config), "--checkpoint", str(run_dir), "--export", str(out)])
    assert result.exit_code == 0, result.output
    assert "WARNING SIGTERM arrived after the command finished (its results written): nothing left to stop, exit 0" \
        in result.output, result.output
    assert out.is_file()


def test_eval_only_says_a_sigterm_dropped_after_its_summary(run, tmp_path, monkeypatch):
    from dlrm import cli
    from dlrm.train import export as export_mod

    config, run_dir = run
    monkeypatch.setattr(export_mod, "evaluate_checkpoint", _swallowing(export_mod.evaluate_checkpoint, after=True))
    result = _invoke(cli.main, ["--config", str(config), "--checkpoint", str(run_dir), "--eval-only",
                                "--tb-dir", str(tmp_path), "--run-name", "ev"])
    assert result.exit_code == 0, result.output
    assert "WARNING SIGTERM arrived after the command finished (its results written): nothing left to stop, exit 0" \
        in result.output, result.output
    assert (tmp_path / "ev" / "summary.json").is_file()


def _manifest(trained, tmp_path) -> Path:
    from dlrm import checkpoint as ckpt
    from tests.test_checkpoint_safety_sharded import write_sharded

    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k != "format_version"}
    return write_sharded(tmp_path / "run", state)[0]


@pytest.mark.parametrize("after", [False, True], ids=["during", "after-written"])
def test_merge_stops_on_a_dropped_sigterm_before_writing_out(trained, tmp_path, monkeypatch, after):
    """Dropped during the merge: before the fix OUT was written and the merge exited 0; now nothing is written, 143.
    Dropped once OUT is written: exit 0, said (before: without a word)."""
    from dlrm.distributed import merge as merge_mod

    manifest = _manifest(trained, tmp_path)
    if after:
        monkeypatch.setattr(merge_mod, "write_atomic", _swallowing(merge_mod.write_atomic, after=True))
    else:
        monkeypatch.setattr(merge_mod, "merge", _swallowing(merge_mod.merge))
    out = tmp_path / "out" / "m.pt"
    result = _invoke(merge_mod.main, [str(manifest), str(out)])
    if after:
        assert result.exit_code == 0, result.output
        assert f"WARNING SIGTERM arrived after the merge finished ({out} written): nothing left to stop, exit 0" \
            in result.output, result.output
        assert out.is_file()
        return
    assert result.exit_code == 143, result.output
    assert result.output.endswith(" WARNING SIGTERM: stopped at once, outside the training steps (no checkpoint "
                                  "written now)\n"), result.output
    assert "merged" not in result.output and "ERROR" not in result.output, result.output
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # no OUT, no temporary beside it


def test_sweep_stops_on_a_sigterm_dropped_before_its_report(run, tmp_path, monkeypatch):
    """Dropped after the last trial (as the HParams are written): before the fix the report was written and the sweep
    exited 0; now it stops before the tables, 143, saying the --resume that writes them."""
    from dlrm import sweep, sweep_report

    config, _ = run
    monkeypatch.setattr(sweep_report, "write_hparams", _swallowing(sweep_report.write_hparams))
    result = _invoke(sweep.main, ["--config", str(config), "--seeds", "1", "--tb-dir", str(tmp_path),
                                  "--run-name", "sw"])
    assert result.exit_code == 143, result.output
    assert [line[len("hh:mm:ss "):] for line in result.output.splitlines()[-2:]] == [  # (the time cut off)
        "WARNING SIGTERM: stopped at once, outside the training steps (no checkpoint written now)",
        f"INFO    sweep: stopped while writing its report; `python -m dlrm.sweep --resume {tmp_path / 'sw'}` writes it "
        "(the finished trials are gathered, not trained again)"], result.output
    assert not (tmp_path / "sw" / "sweep.md").exists()


def test_sweep_says_a_sigterm_dropped_after_its_report(run, tmp_path, monkeypatch):
    """The report written, a SIGTERM dropped before the sweep's end: exit 0 and a line (before: without a word)."""
    from dlrm import sweep, sweep_report

    config, _ = run
    monkeypatch.setattr(sweep_report, "write_report", _swallowing(sweep_report.write_report, after=True))
    result = _invoke(sweep.main, ["--config", str(config), "--seeds", "1", "--tb-dir", str(tmp_path),
                                  "--run-name", "sw"])
    assert result.exit_code == 0, result.output
    assert result.output.endswith(" WARNING SIGTERM arrived after the sweep finished (its report written): nothing "
                                  "left to stop, exit 0\n"), result.output
    assert (tmp_path / "sw" / "sweep.md").is_file()


def test_synthetic_generator_stops_on_a_sigterm_a_bare_except_dropped(tmp_path, monkeypatch):
    """Dropped as the metadata was written (a bare ``except:`` there): before the fix the dataset was published at
    --out and the tool exited 0; now nothing is left, 143, its SIGTERM line."""
    from dlrm.data import synthetic

    monkeypatch.setattr(synthetic, "write_metadata", _swallowing(synthetic.write_metadata, caught=BaseException))
    result = _invoke(synthetic.main, ["--rows", "300", "--cardinalities", "tiny", "--out", str(tmp_path / "ds")])
    assert result.exit_code == 143, result.output
    errors = [line for line in result.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "interrupted (SIGTERM)" in errors[0], result.output
    assert list(tmp_path.iterdir()) == []  # no dataset, no temporary beside it


def test_preprocess_stops_on_a_sigterm_a_bare_except_dropped_before_its_metadata(tmp_path, monkeypatch):
    """Dropped as its last step began: before the fix metadata.json was written (the dataset complete) and the tool
    exited 0; now it stops before it, 143, and the same command resumes."""
    from dlrm.data.preprocess import cli as preprocess_cli
    from dlrm.data.preprocess import run as preprocess_run
    from tests.test_audit_tool_signals import write_raw

    raw, out = tmp_path / "raw.tsv", tmp_path / "out"
    write_raw(raw)
    args = [str(raw), "-o", str(out), "--workers", "1", "--chunk-rows", "20", "--no-progress"]
    monkeypatch.setattr(preprocess_run, "_finish", _swallowing(preprocess_run._finish, caught=BaseException))
    result = _invoke(preprocess_cli.build_cli(), args)
    assert result.exit_code == 143, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:") or "ERROR" in line]
    assert errors == ["error: interrupted (SIGTERM); the same command resumes from the finished chunks"], result.output
    assert not (out / "metadata.json").exists()
    monkeypatch.undo()
    assert _invoke(preprocess_cli.build_cli(), args).exit_code == 0 and (out / "metadata.json").is_file()


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_the_export_of_a_checkpoint_says_the_export_was_stopped(run, tmp_path, monkeypatch, name, code):
    """A SIGTERM (or Ctrl-C) as `--checkpoint C --export OUT` builds its model: the line names the export of C to OUT
    and that nothing was written, as --eval-only's does for its evaluation. Was: "SIGTERM: stopped at once, outside
    the training steps (no checkpoint written now)" or "interrupted (Ctrl-C)", lines for a training run."""
    from dlrm import cli
    from dlrm.train import trainer as trainer_mod
    from dlrm.train.checkpointer import checkpoint_for

    config, run_dir = run
    real = trainer_mod.build_for_data

    def signalled(*args, **kwargs):
        signal.raise_signal(getattr(signal, name))  # arrives here, as `kill -TERM PID` or Ctrl-C would
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "build_for_data", signalled)
    out = tmp_path / "m.pt2"
    result = _invoke(cli.main, ["--config", str(config), "--checkpoint", str(run_dir), "--export", str(out)])
    assert result.exit_code == code, result.output
    assert result.output.strip().splitlines()[-1].endswith(
        f"WARNING --export: {name} stopped the export of {checkpoint_for(run_dir)} to {out}: nothing written there"), \
        result.output
    assert "stopped at once" not in result.output and "interrupted" not in result.output, result.output
    assert list(tmp_path.iterdir()) == []
