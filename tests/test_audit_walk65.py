"""A new user's walk through README.md on the CPU (session 65): what it found wrong."""

import errno
import io
import json
import os
import subprocess
import sys

from dlrm.logging_setup import ConsoleStream
from tests.conftest import CHILD_ENV, REPO, make_dataset


class _ReadOnlyStream(io.StringIO):
    """A text stream over a descriptor open for reading only: every write raises EBADF, as sys.stderr's does."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "Bad file descriptor")

    def flush(self) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")


def _fd2_read_only(path: str):
    """preexec_fn: fd 2 held read-only on `path`, what `python ... 2>&-` leaves when `python` is pyenv's shim (a
    bash script, which the kernel opened on the lowest free descriptor, 2, and exec'd Python with it still open)."""
    def setup() -> None:
        fd = os.open(path, os.O_RDONLY)
        if fd != 2:
            os.dup2(fd, 2)
            os.close(fd)
    return setup


def test_console_write_error_ends_console_output_not_the_process():
    """A write to stderr that raises an OSError other than BrokenPipeError (EBADF: fd 2 read-only) propagated out of
    the training bar's first draw: exit 1, "a bug", the run directory removed."""
    console = ConsoleStream(_ReadOnlyStream())
    assert console.write("train:   0%|") == len("train:   0%|")
    console.flush()
    console.write_record("12:00:00 INFO    a record\n")
    assert console.reader_gone


def test_train_with_stderr_closed_through_a_launcher_script(tmp_path):
    """`python train.py ... 2>&-` with pyenv's `python` (README, "Console output": stderr closed from the start ends
    the console output, not the run): Python starts with fd 2 open read-only on the shim script, sys.stderr is not
    None, and its first write raised EBADF: exit 1, nothing trained, the new run directory removed."""
    make_dataset(tmp_path / "ds", {"train": 100, "validation": 40})
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 20},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 0, "baseline": False},
           "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    script = tmp_path / "launcher.sh"
    script.write_text("#!/bin/sh\n")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "cfg.json"),
                          "--run-name", "closed"], cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.PIPE, text=True,
                         timeout=120, preexec_fn=_fd2_read_only(str(script)))
    assert out.returncode == 0, f"exit {out.returncode}; stdout {out.stdout[-2000:]!r}"
    assert json.loads((tmp_path / "tb" / "closed" / "summary.json").read_text())["steps"] == 5


def test_preprocess_with_stderr_closed_through_a_launcher_script(tmp_path):
    """The same for `python -m dlrm.preprocess ... 2>&-`: its first progress bar raised EBADF, exit 1 and no dataset;
    a second run on that output is refused (exit 2), its error line lost, not turned into exit 1."""
    raw = tmp_path / "log.tsv"
    line = "\t".join(["1"] + [str(i) for i in range(13)] + [f"{i:08x}" for i in range(26)])
    raw.write_text((line + "\n") * 30)
    script = tmp_path / "launcher.sh"
    script.write_text("#!/bin/sh\n")
    cmd = [sys.executable, "-m", "dlrm.preprocess", "--input", str(raw), "--output", str(tmp_path / "out"),
           "--workers", "1"]
    for expected in (0, 2):
        out = subprocess.run(cmd, cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.PIPE, text=True, timeout=120,
                             preexec_fn=_fd2_read_only(str(script)))
        assert out.returncode == expected, f"exit {out.returncode}; stdout {out.stdout[-2000:]!r}"
        assert (tmp_path / "out" / "metadata.json").is_file()


def test_best_pt_of_a_run_without_eval_every_and_the_readme_says_so(tmp_path):
    """README's file table said `checkpoints/best.pt` is written "when the run evaluates during training
    (`train.eval_every`)", and its export paragraph "With `train.eval_every`, the best evaluation's model is kept":
    a run without it (configs/mlperf-dcnv2.json's `"eval_every": null`) writes one too, its last evaluation's, which
    `--checkpoint RUN` and `--export` take."""
    make_dataset(tmp_path / "ds", {"train": 60, "validation": 40})
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 20},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "eval_every": None, "device": "cpu", "seed": 0, "baseline": False},
           "log": {"tb_dir": str(tmp_path / "tb")}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "cfg.json"),
                          "--run-name", "r"], cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    run = tmp_path / "tb" / "r"
    assert (run / "checkpoints" / "best.pt").is_file()
    assert json.loads((run / "summary.json").read_text())["best"]["step"] == 3
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `checkpoints/best.pt` |"))
    assert "without `train.eval_every` has one too" in row, row
    assert "With `train.eval_every`, the best evaluation's model is kept" not in readme
