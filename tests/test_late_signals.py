"""A SIGTERM or Ctrl-C that reaches train.py after its run finished: from summary.json's write to the process's end.

Before, one after summary.json was written raised where it arrived (`StopAtOnce`, KeyboardInterrupt): the finished run
ended 143 ("SIGTERM: stopped at once, outside the training steps (no checkpoint written now)") or 130 ("interrupted
(Ctrl-C)"), and one during summary.json's write left no summary; in the interpreter's shutdown, after main returned,
a SIGTERM killed it (143, no line) and a Ctrl-C printed a KeyboardInterrupt traceback. Now the command exits 0 with a line saying the signal
came after the run finished (`dlrm.stop_signal.LateSignals`). Each signal is sent by the process to itself at a chosen
point (a patched function), so nothing here depends on timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import CHILD_ENV
from tests.test_audit_review52 import tiny_config

# argv: the signal, where it arrives, then train.py's arguments
SCRIPT = """
import errno, os, signal, sys
from dlrm.train import trainer
signum, at = getattr(signal, sys.argv[1]), sys.argv[2]
kill = lambda: os.kill(os.getpid(), signum)
real_write, real_fit = trainer.write_summary, trainer.Trainer.fit
def write_summary(*args, **kwargs):
    kill()  # as summary.json's write begins
    if at == "write_fails":
        raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
    return real_write(*args, **kwargs)
def fit(self):
    summary = real_fit(self)
    kill()  # after the run's last line
    if at == "after_done_twice":
        kill()
    return summary
if at in ("write", "write_fails"):
    trainer.write_summary = write_summary
elif at in ("after_done", "after_done_twice"):
    trainer.Trainer.fit = fit
elif at == "hparams":  # during the summary's making, before summary.json's write: the run is not finished
    real_hparams = trainer.log_hparams
    def log_hparams(*args, **kwargs):
        kill()
        return real_hparams(*args, **kwargs)
    trainer.log_hparams = log_hparams
elif at == "export":  # as the export after training starts (it builds the model, then torch.export)
    from dlrm.train import export
    real_export = export.export_checkpoint
    def export_checkpoint(*args, **kwargs):
        kill()
        return real_export(*args, **kwargs)
    export.export_checkpoint = export_checkpoint
elif at == "threads":  # as the interpreter joins the threads, after train.py's main returned
    import threading
    real_shutdown = threading._shutdown
    def shutdown():
        kill()
        return real_shutdown()
    threading._shutdown = shutdown
elif at in ("exit_function", "after_exit_functions"):
    import atexit
    if at == "after_exit_functions":  # registered before train.py's: run after it, as the modules' teardown would
        atexit.register(kill)
    else:  # registered during the run, as torch's and multiprocessing's are: run before train.py's
        def fit(self):
            atexit.register(kill)
            return real_fit(self)
        trainer.Trainer.fit = fit
from dlrm.cli import main
from dlrm.stop_signal import LateSignals
LateSignals.until_exit = True  # as train.py
main(sys.argv[3:])
"""


def train_py(tmp_path, config, name: str, at: str, *more: str) -> subprocess.CompletedProcess:
    args = ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--run-name", "r", "--max-steps", "4", *more]
    return subprocess.run([sys.executable, "-c", SCRIPT, name, at, *args], cwd=tmp_path, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture
def config(tmp_path):
    return tiny_config(tmp_path)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_after_the_runs_last_line_exits_0_saying_so(tmp_path, config, name):
    done = train_py(tmp_path, config, name, "after_done")
    assert done.returncode == 0, done.stderr[-2000:]  # was 143 / 130
    summary = tmp_path / "tb" / "r" / "summary.json"
    assert f"WARNING {name} arrived after the run finished ({summary} written): nothing left to stop, exit 0" \
        in done.stderr, done.stderr[-2000:]
    assert "stopped" not in done.stderr and "interrupted" not in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert json.loads(summary.read_text())["steps"] == 4


def test_a_second_signal_after_the_run_finished_stops_at_once(tmp_path, config):
    """As during training: a shutdown that hangs can still be stopped (by its default action: killed)."""
    done = train_py(tmp_path, config, "SIGTERM", "after_done_twice")
    assert done.returncode in (-15, 143), done.stderr[-2000:]
    assert "WARNING SIGTERM again after the run finished (" in done.stderr and "): stopping now" in done.stderr
    assert (tmp_path / "tb" / "r" / "summary.json").is_file()


def test_a_signal_as_summary_json_is_written_lets_it_finish(tmp_path, config):
    """The write (a few milliseconds, atomic) finishes: the run is whole, and its --resume trains nothing."""
    done = train_py(tmp_path, config, "SIGTERM", "write")
    assert done.returncode == 0, done.stderr[-2000:]  # was 143, no summary.json
    assert "WARNING SIGTERM arrived after the run finished" in done.stderr, done.stderr[-2000:]
    summary = json.loads((tmp_path / "tb" / "r" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["auc"] is not None
    resumed = train(load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r",
                                         "train.max_steps": 4}), resume="latest")
    assert resumed["finished"] and resumed["steps"] == 4


def test_a_signal_before_a_failed_summary_write_leaves_the_failure_said(tmp_path, config):
    """summary.json's write fails after the signal (a full disk): the failure's line and exit code, not "finished"."""
    done = train_py(tmp_path, config, "SIGTERM", "write_fails")
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"file system error: {tmp_path / 'tb' / 'r' / 'summary.json'}: No space left on device" in done.stderr
    assert "arrived after" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("at", ["threads", "exit_function"])
def test_a_signal_in_the_interpreters_shutdown_exits_0_saying_so(tmp_path, config, name, at):
    done = train_py(tmp_path, config, name, at)
    assert done.returncode == 0, done.stderr[-2000:]  # SIGTERM: was 143 (killed, no line)
    assert f"WARNING {name} arrived after the run finished (" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_after_the_last_exit_function_is_ignored(tmp_path, config, name):
    """Past train.py's exit function, in the modules' teardown, no Python code says anything: the signal is ignored
    (it took its default action there: a SIGTERM killed the finished run, 143)."""
    done = train_py(tmp_path, config, name, "after_exit_functions")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "arrived after" not in done.stderr, done.stderr[-2000:]


def test_main_called_in_process_puts_the_handlers_it_found_back(tmp_path, config):
    """Only train.py (`LateSignals.until_exit`) keeps them to the process's end: a caller of `main` (click's CliRunner) goes on with
    its own Ctrl-C and SIGTERM."""
    import signal

    from click.testing import CliRunner

    from dlrm import cli
    from dlrm.logging_setup import configure_logging

    found = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        result = CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--run-name",
                                               "r", "--max-steps", "2"])
    finally:
        configure_logging()  # (main pointed loguru at CliRunner's stderr, closed now)
    assert result.exit_code == 0, result.output
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == found


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_the_export_after_training_says_the_run_is_kept(tmp_path, config, name, code):
    """The run finished (summary.json written), its --export did not: it said "SIGTERM: stopped at once, outside the
    training steps (no checkpoint written now)" (or "interrupted (Ctrl-C)"), as if the run were lost."""
    out = tmp_path / "m.pt2"
    done = train_py(tmp_path, config, name, "export", "--export", str(out))
    assert done.returncode == code, done.stderr[-2000:]
    run = tmp_path / "tb" / "r"
    assert f"WARNING {name} stopped the export to {out}: nothing written there; the run is trained and kept (its " \
           f"summary.json written): export it with --checkpoint {run} --export {out}" in done.stderr, done.stderr[-2000:]
    assert "stopped at once" not in done.stderr and "interrupted (Ctrl-C)" not in done.stderr
    assert (run / "summary.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if "pt2" in p.name] == []  # no export, no temporary beside it


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_the_summarys_making_names_the_checkpoint_that_holds_the_run(tmp_path, config, name, code):
    """Before summary.json the run is not finished: it stops at once, as before, but said "SIGTERM: stopped at once,
    outside the training steps (no checkpoint written now)" or "interrupted (Ctrl-C)", not that the last step's
    checkpoint holds the whole run (as a signal during the last evaluation says); its --resume makes the summary."""
    done = train_py(tmp_path, config, name, "hparams")
    assert done.returncode == code, done.stderr[-2000:]
    run = tmp_path / "tb" / "r"
    assert f"WARNING stopped by signal ({name}) at step 4, after its last evaluation; checkpoint " \
           f"{run / 'checkpoints' / 'step-00000004.pt'}" in done.stderr, done.stderr[-2000:]
    assert not (run / "summary.json").exists()
    if name == "SIGTERM":
        resumed = train(load_config(config, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "r",
                                             "train.max_steps": 4}), resume="latest")
        assert resumed["resumed_at_step"] == 4 and resumed["steps"] == 4 and (run / "summary.json").is_file()
