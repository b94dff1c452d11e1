"""A path no file can have, given to any command: a name over 255 bytes (ENAMETOOLONG), a path over PATH_MAX (also
ENAMETOOLONG), one through a symbolic link loop (ELOOP). train.py's --config, --data, --tb-dir, --resume PATH,
--checkpoint and --export, the config's data.path and log.tb_dir, and a sweep's --config, --data, --tb-dir, --resume
and --run-name raised the OSError of whichever check looked first: "this is a bug in dlrm (OSError)", a traceback,
exit 1. The data tools exited 2 but named no flag ("cannot write the dataset: <the whole path>: File name too long"),
merge blamed OUT for a long CHECKPOINT, relayout's --output through a loop was a bug (RuntimeError), and the output
tools made the missing parents of a name they then could not make. Now each is one line naming the flag or key and
the value (shortened: `dlrm.path_checks.shown_path`), exit 2, and nothing is written."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.logging_setup import configure_logging
from dlrm.path_checks import PATH_MAX, path_problem, shown_path
from tests.conftest import REPO

SAMPLE = REPO / "data" / "sample"
CONFIG = REPO / "configs" / "sample.json"


@pytest.fixture(autouse=True)
def _restore_logging():
    """The commands point loguru at CliRunner's stderr, closed afterwards: point it back."""
    yield
    configure_logging()


@pytest.fixture
def trained(monkeypatch):
    """train.py's trainer replaced by a recorder: a path that got through would "train" (exit 0)."""
    import dlrm.train.trainer as trainer

    calls = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kwargs: calls.append(cfg) or {"checkpoint": "unused"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return calls


# each kind: (how to make the bad path under `root`, words of its line)
KINDS = {
    # under a parent that does not exist either: a tool that made the parents first left them behind
    "long name": (lambda root: root / "new" / ("x" * 300), "a name of 30"),
    "long path": (lambda root: root / "new" / "/".join(["a" * 100] * 50), f"too long (at most {PATH_MAX - 1})"),
    "link loop": (lambda root: root / "loop" / "x", "a symbolic link in it loops"),
}


def bad_path(root: Path, kind: str, suffix: str = "") -> tuple[str, str]:
    """The bad path of `kind` (the loop made under `root`), and a needle of its line."""
    (root / "loop").symlink_to("loop")
    make, needle = KINDS[kind]
    return str(make(root)) + suffix, needle


def one_error_line(result, flag: str, path: str, needle: str) -> str:
    """Exit 2, no traceback, one line of error holding the flag, the path as shown and the needle."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "bug in dlrm" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert flag in lines[0] and shown_path(path) in lines[0] and needle in lines[0], lines[0]
    assert len(lines[0]) < 400  # a 5,000-byte path is shortened, not printed whole
    return lines[0]


def left(root: Path) -> list[str]:
    """What `root` holds besides the test's own files."""
    return sorted(p.name for p in root.iterdir() if p.name not in ("loop", "cfg.json", "tb"))


# --- train.py ---------------------------------------------------------------------------------------------------

TRAIN_CASES = {  # flag named in the line: (arguments given the bad path, suffix of the path)
    "--config": (lambda p, tmp: ["--config", p], ".json"),
    "--data": (lambda p, tmp: ["--config", str(CONFIG), "--data", p], ""),
    "--tb-dir": (lambda p, tmp: ["--config", str(CONFIG), "--data", str(SAMPLE), "--tb-dir", p], ""),
    "--resume": (lambda p, tmp: ["--config", str(CONFIG), "--data", str(SAMPLE), "--run-name", "br", "--resume", p],
                 ".pt"),
    "--checkpoint": (lambda p, tmp: ["--config", str(CONFIG), "--data", str(SAMPLE), "--eval-only", "--checkpoint", p],
                     ""),
    "--checkpoint ": (lambda p, tmp: ["--config", str(CONFIG), "--data", str(SAMPLE), "--checkpoint", p, "--export",
                                      str(tmp / "o.pt2")], ""),  # (an export of a checkpoint)
    "--export": (lambda p, tmp: ["--config", str(CONFIG), "--data", str(SAMPLE), "--export", p], ".pt2"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", TRAIN_CASES)
def test_train_refuses_a_path_no_file_can_have(tmp_path, trained, flag, kind):
    args, suffix = TRAIN_CASES[flag]
    path, needle = bad_path(tmp_path, kind, suffix)
    extra = [] if flag in ("--tb-dir", "--checkpoint ") else ["--tb-dir", str(tmp_path / "tb")]  # (a bare export
    # of a checkpoint refuses --tb-dir: it makes no run directory)
    result = CliRunner().invoke(cli.main, [*args(path, tmp_path), *extra])
    line = one_error_line(result, flag.strip(), path, needle)
    if flag == "--config":
        assert "Invalid value for '--config'" in line
    assert not trained and left(tmp_path) == [] and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", ["data.path", "log.tb_dir"])
def test_train_refuses_such_a_path_in_the_config_naming_the_file_and_key(tmp_path, trained, key, kind):
    path, needle = bad_path(tmp_path, kind)
    raw = json.loads(CONFIG.read_text())
    raw["data"]["path"] = str(SAMPLE)
    section, name = key.split(".")
    raw.setdefault(section, {})[name] = path
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(raw))
    extra = ["--tb-dir", str(tmp_path / "tb")] if key == "data.path" else []
    one_error_line(CliRunner().invoke(cli.main, ["--config", str(config), *extra]), f"{config}: {key}", path, needle)
    assert not trained and left(tmp_path) == []


def test_train_run_name_over_the_limit_stays_one_line(tmp_path, trained):
    result = CliRunner().invoke(cli.main, ["--config", str(CONFIG), "--data", str(SAMPLE), "--tb-dir",
                                           str(tmp_path / "tb"), "--run-name", "r" * 300])
    one_error_line(result, "log.run_name", "", "a name of 300 bytes is too long for a directory name")
    assert not trained and not (tmp_path / "tb").exists()


# --- python -m dlrm.sweep ---------------------------------------------------------------------------------------

SWEEP_CASES = {
    "--config": (lambda p, tmp: ["--config", p], ".json"),
    "--data": (lambda p, tmp: ["--config", str(CONFIG), "--data", p, "--tb-dir", str(tmp / "tb")], ""),
    "--tb-dir": (lambda p, tmp: ["--config", str(CONFIG), "--data", str(SAMPLE), "--tb-dir", p], ""),
    "--resume": (lambda p, tmp: ["--resume", p], ""),
    "data.path": (lambda p, tmp: ["--config", str(CONFIG), "--set", f"data.path={str(SAMPLE)},{p}", "--tb-dir",
                                  str(tmp / "tb")], ""),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", SWEEP_CASES)
def test_sweep_refuses_a_path_no_file_can_have(tmp_path, trained, flag, kind):
    from dlrm import sweep

    args, suffix = SWEEP_CASES[flag]
    path, needle = bad_path(tmp_path, kind, suffix)
    result = CliRunner().invoke(sweep.main, [*args(path, tmp_path), "--seeds", "1"][: None if flag != "--resume" else 2])
    one_error_line(result, flag, path, needle)
    assert not trained and left(tmp_path) == [] and not (tmp_path / "tb").exists()


def test_sweep_run_name_over_the_limit_is_one_line(tmp_path, trained):
    from dlrm import sweep

    result = CliRunner().invoke(sweep.main, ["--config", str(CONFIG), "--data", str(SAMPLE), "--seeds", "1",
                                             "--tb-dir", str(tmp_path / "tb"), "--run-name", "r" * 300])
    one_error_line(result, "--run-name", "", "a name of 300 bytes is too long for a directory name (at most 255)")
    assert not trained and not (tmp_path / "tb").exists()


# --- the data tools and the merge -------------------------------------------------------------------------------

def _synthetic(flag, p, tmp):
    from dlrm.data import synthetic

    out = ["--out", p] if flag == "--out" else ["--out", str(tmp / "ds"), "--raw-tsv", p]
    return synthetic.main, ["--rows", "10", "--cardinalities", "tiny", *out]


def _preprocess(flag, p, tmp):
    from dlrm.data.preprocess import cli as pp

    io = ["-i", p, "-o", str(tmp / "ds")] if flag == "-i" else ["-i", str(REPO / "configs" / "sample.json"), "-o", p]
    return pp.build_cli(), [*io, "--no-progress", "--workers", "1"]


def _mlperf(flag, p, tmp):
    from dlrm.data import mlperf_import

    return mlperf_import.main, (["--input", p, "--output", str(tmp / "ds")] if flag == "--input"
                                else ["--input", str(SAMPLE), "--output", p])


def _relayout(flag, p, tmp):
    from dlrm.data import relayout

    return relayout.main, (["--data", p, "--output", str(tmp / "ds")] if flag == "--data"
                           else ["--data", str(SAMPLE), "--output", p])


def _merge(flag, p, tmp):
    from dlrm.distributed import merge

    return merge.main, [p, str(tmp / "m.pt")] if flag == "CHECKPOINT" else [str(SAMPLE / "metadata.json"), p]


TOOL_CASES = [("synthetic", "--out", _synthetic), ("synthetic", "--raw-tsv", _synthetic),
              ("preprocess", "-i", _preprocess), ("preprocess", "-o", _preprocess),
              ("mlperf_import", "--input", _mlperf), ("mlperf_import", "--output", _mlperf),
              ("relayout", "--data", _relayout), ("relayout", "--output", _relayout),
              ("merge", "CHECKPOINT", _merge), ("merge", "OUT", _merge)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tool, flag, make", TOOL_CASES, ids=[f"{t} {f}" for t, f, _ in TOOL_CASES])
def test_data_tools_refuse_a_path_no_file_can_have_naming_the_flag(tmp_path, tool, flag, make, kind):
    path, needle = bad_path(tmp_path, kind, ".pt" if tool == "merge" else "")
    command, args = make(flag, path, tmp_path)
    named = {"-i": "'--input' / '-i'", "-o": "'--output' / '-o'"}.get(flag, f"'{flag}'")
    line = one_error_line(CliRunner().invoke(command, args), f"Invalid value for {named}", path, needle)
    assert "m.pt" not in line  # (merge named OUT for a long CHECKPOINT: "m.pt: cannot write (File name too long)")
    assert left(tmp_path) == []  # neither the missing parent nor a temporary


# --- the helper -------------------------------------------------------------------------------------------------

def test_shown_path_keeps_both_ends_and_says_the_length():
    path = "/data/" + "d" * 5000 + "/day_23.npz"
    shown = shown_path(path)
    assert shown.startswith("/data/ddd") and "...d" in shown and shown.endswith("/day_23.npz (5017 bytes)")
    assert len(shown) < 140 and shown_path("/short/path") == "/short/path"


def test_names_at_the_limits_pass(tmp_path):
    """255 bytes a name, 4095 a path: what the file system takes is not refused (nor a missing path, nor one under a
    file: the commands' own checks say what they found there)."""
    assert path_problem(tmp_path / ("n" * 255)) is None
    assert path_problem(tmp_path / ("é" * 127)) is None and path_problem(tmp_path / ("é" * 128)) is not None
    room = PATH_MAX - 1 - len(os.fsencode(str(tmp_path))) - 1
    deep = tmp_path / "/".join(["d" * 200] * (room // 201) + ["e" * (room % 201 - 1 if room % 201 > 1 else 1)])
    assert len(os.fsencode(str(deep))) <= PATH_MAX - 1 and path_problem(deep) is None
    assert path_problem(str(deep) + "f" * 300) is not None
    (tmp_path / "afile").write_text("")
    assert path_problem(tmp_path / "afile" / "x") is None and path_problem(tmp_path / "missing" / "x") is None


def test_a_directory_without_search_permission_is_named(tmp_path, monkeypatch):
    """EACCES: a path through a directory without search permission. This machine runs the tests as root, whom no
    mode refuses, so the lstat's answer is made here (as a user's would be)."""
    secret = str(tmp_path / "private" / "ds")
    real = os.lstat

    def lstat(path, *args, **kwargs):
        if os.fsdecode(path) == secret:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    assert path_problem(secret) == "Permission denied"
    result = CliRunner().invoke(cli.main, ["--config", str(CONFIG), "--data", secret, "--tb-dir", str(tmp_path / "tb")])
    one_error_line(result, "--data", secret, "Permission denied")
