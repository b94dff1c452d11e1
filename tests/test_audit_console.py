"""Console output in non-interactive use: train.py with its stderr in a pipe that the reader closes, or in a file."""

import json
import re
import subprocess
import sys

from tests.conftest import CHILD_ENV, REPO, make_dataset


def _config(tmp_path, rows: int, batch_size: int, log_every: int):
    make_dataset(tmp_path / "ds", {"train": rows, "validation": 40})
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": batch_size},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "log_every": log_every, "device": "cpu", "seed": 0, "baseline": False},
           "log": {"tb_dir": str(tmp_path / "tb")}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


def test_stderr_reader_gone_does_not_kill_the_run(tmp_path):
    """`python train.py ... 2>&1 | head -1`: the reader goes away after the first line. The run went on to the
    training bar, whose write raised BrokenPipeError: exit 1 ("a bug in dlrm"), the new run directory removed, no
    checkpoint, no summary. Console output is lost, not the run."""
    cfg = _config(tmp_path, rows=200, batch_size=20, log_every=2)
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(cfg), "--run-name", "piped"],
                            cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = proc.stderr.readline()
    proc.stderr.close()  # as `head -1` exits
    rc = proc.wait(timeout=120)
    assert first.strip(), "no first line on stderr"
    run = tmp_path / "tb" / "piped"
    assert rc == 0, f"exit {rc} after the stderr reader went away; run directory kept: {run.exists()}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10
    assert (run / "checkpoints" / "step-00000010.pt").is_file()


def test_training_bar_does_not_flood_a_log_file(tmp_path):
    """stderr redirected to a file (nohup, SLURM, CI): the training bar was redrawn every 0.1 s and at every logging
    window (set_postfix forces a redraw), each redraw a `\\r` segment in the log: 100 steps at train.log_every 1 wrote
    100+ copies of the bar. In a file it is redrawn at most once a minute (README: "Console output")."""
    cfg = _config(tmp_path, rows=800, batch_size=8, log_every=1)
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(cfg), "--run-name", "r"],
                             cwd=tmp_path, env=CHILD_ENV, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert out.returncode == 0, text[-3000:]
    redraws = [seg for seg in text.replace("\n", "\r").split("\r") if seg.startswith("train:")]
    assert redraws, "no training bar in the log"
    assert len(redraws) <= 5, f"{len(redraws)} redraws of the training bar in a 100-step run's log file"
    assert "100/100" in redraws[-1]  # the bar's final state is still there
    assert "\x1b[" not in text  # and no colour codes in a file


def _config_error(tmp_path, env: dict, stderr) -> int:
    """train.py with a misspelt config key: one ERROR line, exit 2, before torch is imported (fast)."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train": {"epochz": 1}}))
    return subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(bad)], cwd=tmp_path,
                          env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=60).returncode


def test_no_colour_codes_in_a_log_file_on_ci(tmp_path):
    """In a CI job (CI=true, GITHUB_ACTIONS=true) loguru colours the real stderr whatever it is: `train.py 2> log`
    wrote escape codes around the time and level of every line of the file."""
    log = tmp_path / "err.log"
    with open(log, "w") as f:
        rc = _config_error(tmp_path, {**CHILD_ENV, "CI": "true", "GITHUB_ACTIONS": "true"}, f)
    text = log.read_text()
    assert rc == 2 and "ERROR" in text and "epochz" in text, text
    assert "\x1b[" not in text, repr(text)


def _on_a_terminal(tmp_path, env: dict) -> str:
    """`_config_error` with stderr on a pseudo-terminal: what it showed."""
    import os
    import pty

    master, slave = pty.openpty()
    try:
        rc = _config_error(tmp_path, env, slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side is closed and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
    text = b"".join(chunks).decode()
    assert rc == 2 and "ERROR" in text and "epochz" in text, text
    return text


def test_no_colour_on_a_terminal_with_NO_COLOR(tmp_path):
    """NO_COLOR (https://no-color.org) set: no colour codes, also on a terminal (where they are shown otherwise)."""
    env = {k: v for k, v in CHILD_ENV.items() if k != "NO_COLOR"}
    assert "\x1b[" in _on_a_terminal(tmp_path, env)
    text = _on_a_terminal(tmp_path, {**env, "NO_COLOR": "1"})
    assert "\x1b[" not in text, repr(text)


def test_stderr_closed_does_not_stop_the_run(tmp_path):
    """`python train.py ... 2>&-` (stderr closed: sys.stderr is None): loguru refused the None sink with a TypeError
    in configure_logging, exit 1 before the run began."""
    import os

    cfg = _config(tmp_path, rows=100, batch_size=20, log_every=2)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(cfg), "--run-name", "closed"],
                         cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(2))
    assert out.returncode == 0, f"exit {out.returncode}; stdout {out.stdout[-2000:]!r}"
    assert json.loads((tmp_path / "tb" / "closed" / "summary.json").read_text())["steps"] == 5


def test_failed_run_ends_its_log_with_the_error_line(tmp_path):
    """A run that fails in the training loop (a NaN loss, exit 3) with stderr in a file: its bar was left open, so the
    ERROR line was glued to the end of the bar's line, and the bar, closed by the garbage collector at exit, was the
    log's last line (`tail -1 log` showed `train:   5%|...`, not the error)."""
    cfg = _config(tmp_path, rows=400, batch_size=20, log_every=2)
    data = json.loads(cfg.read_text())
    data["optim"] = {"dense": {"name": "sgd", "lr": 1e30}}
    cfg.write_text(json.dumps(data))
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(cfg), "--run-name", "nan"],
                             cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=f, timeout=120)
    text = log.read_text()
    assert out.returncode == 3, text[-3000:]
    lines = [line for line in text.replace("\r", "\n").split("\n") if line.strip()]
    assert re.fullmatch(r"\d\d:\d\d:\d\d ERROR +loss became NaN or Inf at step \d+; stopped; .*", lines[-1]), lines[-3:]
    assert re.search(r"^\d\d:\d\d:\d\d ERROR ", text, re.M), "the ERROR line does not start a line: " + repr(text[-600:])
