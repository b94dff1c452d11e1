"""A path through a regular file (``afile/x``: ENOTDIR), given to any command where a path goes. Some commands said
what their own check found without naming the flag: train.py's and a sweep's --config "x.json: config file not found",
--checkpoint (--eval-only, an export) and merge's CHECKPOINT "checkpoint not found", preprocess's -i "no such file" and
-o "cannot be created", merge's OUT "cannot write it"; train.py's --data and a sweep's "data.path: ... does not exist"
named the key for the flag given, and --resume called the checkpoint missing. Now each is one line naming the flag
(or the config file and key) and the file on the way, exit 2, nothing created. The cases are test_long_paths.py's:
every command and path flag."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.path_checks import file_on_the_way, path_problem
from tests.test_long_paths import (CONFIG, SAMPLE, SWEEP_CASES, TOOL_CASES, TRAIN_CASES, _restore_logging,  # noqa: F401
                                   trained)


def under_file(root, suffix: str = "") -> tuple[str, str]:
    """``root/afile/x<suffix>`` (afile made), and the file its line must name."""
    (root / "afile").write_text("not a directory\n")
    return str(root / "afile" / f"x{suffix}"), str(root / "afile")


def one_line(result, flag: str, path: str, blocker: str) -> str:
    """Exit 2, no traceback, one line holding the flag, the path and the file on the way, said to be no directory."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "bug in dlrm" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert flag in lines[0] and path in lines[0] and f"{blocker} is " in lines[0] and "not a directory" in lines[0], \
        lines[0]
    return lines[0]


def left(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name not in ("afile", "cfg.json"))


@pytest.mark.parametrize("flag", TRAIN_CASES)
def test_train_names_the_flag_of_a_path_through_a_file(tmp_path, trained, flag):
    args, suffix = TRAIN_CASES[flag]
    path, blocker = under_file(tmp_path, suffix)
    extra = [] if flag in ("--tb-dir", "--checkpoint ") else ["--tb-dir", str(tmp_path / "tb")]
    result = CliRunner().invoke(cli.main, [*args(path, tmp_path), *extra])
    line = one_line(result, flag.strip(), path, blocker)
    if flag == "--config":
        assert "Invalid value for '--config'" in line
    assert not trained and left(tmp_path) == []


@pytest.mark.parametrize("key", ["data.path", "log.tb_dir"])
def test_train_names_the_file_and_key_of_such_a_path_in_the_config(tmp_path, trained, key):
    path, blocker = under_file(tmp_path)
    raw = json.loads(CONFIG.read_text())
    raw["data"]["path"] = str(SAMPLE)
    section, name = key.split(".")
    raw.setdefault(section, {})[name] = path
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(raw))
    extra = ["--tb-dir", str(tmp_path / "tb")] if key == "data.path" else []
    one_line(CliRunner().invoke(cli.main, ["--config", str(config), *extra]), f"{config}: {key}", path, blocker)
    assert not trained and left(tmp_path) == []


@pytest.mark.parametrize("flag", SWEEP_CASES)
def test_sweep_names_the_flag_of_a_path_through_a_file(tmp_path, trained, flag):
    from dlrm import sweep

    args, suffix = SWEEP_CASES[flag]
    path, blocker = under_file(tmp_path, suffix)
    result = CliRunner().invoke(sweep.main, [*args(path, tmp_path), "--seeds", "1"][: None if flag != "--resume" else 2])
    one_line(result, flag, path, blocker)
    assert not trained and left(tmp_path) == []


@pytest.mark.parametrize("tool, flag, make", TOOL_CASES, ids=[f"{t} {f}" for t, f, _ in TOOL_CASES])
def test_data_tools_name_the_flag_of_a_path_through_a_file(tmp_path, tool, flag, make):
    path, blocker = under_file(tmp_path, ".pt" if tool == "merge" else "")
    command, args = make(flag, path, tmp_path)
    named = {"-i": "'--input' / '-i'", "-o": "'--output' / '-o'"}.get(flag, f"'{flag}'")
    one_line(CliRunner().invoke(command, args), f"Invalid value for {named}", path, blocker)
    assert left(tmp_path) == []


def test_the_file_on_the_way_is_the_deepest_part_that_exists(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "d" / "f")
    assert file_on_the_way(tmp_path / "d" / "f" / "x" / "y") == str(tmp_path / "d" / "f")
    assert file_on_the_way(tmp_path / "link" / "x") == str(tmp_path / "link")  # (the name given, not its target)
    assert file_on_the_way(tmp_path / "d" / "missing" / "x") is None and file_on_the_way(tmp_path / "d") is None
    # asked for only: a command whose own check names its flag keeps its line ("is a file, not a directory; pick
    # another --tb-dir")
    assert path_problem(tmp_path / "d" / "f" / "x") is None
    assert path_problem(tmp_path / "d" / "f" / "x", under_file=True) == f"{tmp_path / 'd' / 'f'} is not a directory"
