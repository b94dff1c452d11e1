"""A new run or sweep directory whose name begins with '.' is refused in one line naming it: accepted before,
``tb_logs/.r`` was missing from ``ls tb_logs`` and from shell globs (``tb_logs/*``) while TensorBoard and --resume
still found it. A run that already has such a name is still resumed in place (nothing the user has is stranded).
In-process with a recording `train` (no training): each case costs milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.config import ConfigError
from dlrm.logging_setup import configure_logging
from dlrm.sweep import sweep_directory
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


@pytest.fixture
def trained(monkeypatch):
    """The trainer's `train` replaced by a recorder: the calls that got past every check."""
    import dlrm.train.trainer as trainer

    calls = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kwargs: calls.append((cfg, kwargs)) or {"checkpoint": "x"})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return calls


def invoke(tb: Path, config: Path, *args: str):
    return CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tb), *args])


def one_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.output
    return errors[0]


def test_a_new_run_named_with_a_leading_dot_is_refused(tmp_path, trained):
    tb = tmp_path / "tb"
    line = one_error(invoke(tb, REPO / "configs/sample.json", "--run-name", ".hidden"))
    assert "command line: log.run_name: '.hidden' begins with '.'" in line and "ls" in line
    assert not trained and not tb.exists()


def test_the_other_new_directories_named_with_a_leading_dot_are_refused(tmp_path, trained):
    """--resume by a name not there yet (it starts the run), a branch, --compare, --eval-only, and a default name from
    a config file named ".x.json"."""
    tb = tmp_path / "tb"
    checkpoint = tmp_path / "src" / "checkpoints" / "step-00000005.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    cases = [["--run-name", ".new", "--resume"], ["--resume", str(checkpoint), "--run-name", ".branch"],
             ["--run-name", ".c", "--compare", "eager"],
             ["--run-name", ".e", "--eval-only", "--checkpoint", str(checkpoint)]]
    for args in cases:
        assert "begins with '.'" in one_error(invoke(tb, REPO / "configs/sample.json", *args)), args
    dotted = tmp_path / ".x.json"
    dotted.write_text((REPO / "configs/sample.json").read_text())
    line = one_error(invoke(tb, dotted))
    assert f"{dotted}: name" in line and "'.x' begins with '.'" in line and "--run-name" in line
    assert not trained and not tb.exists()


def test_an_existing_run_with_such_a_name_is_still_resumed_in_place(tmp_path, trained):
    """Made before names were checked: --resume of it by name goes on (refused, it was stranded)."""
    tb = tmp_path / "tb"
    (tb / ".old").mkdir(parents=True)
    (tb / ".old" / "config.json").write_text(json.dumps({"name": "sample"}))
    result = invoke(tb, REPO / "configs/sample.json", "--run-name", ".old", "--resume")
    assert result.exit_code == 0, result.output
    assert [(cfg.log.run_name, kwargs["resume"]) for cfg, kwargs in trained] == [(".old", "latest")]


def test_a_sweep_named_with_a_leading_dot_is_refused(tmp_path):
    tb = tmp_path / "tb"
    with pytest.raises(ConfigError, match=r"^--run-name: '\.s' begins with '\.'"):
        sweep_directory(str(tb), ".s", str(REPO / "configs/sample.json"))
    with pytest.raises(ConfigError, match=r"the default sweep name: '\.x-sweep-[0-9-]+' begins with '\.'.*--run-name"):
        sweep_directory(str(tb), None, str(tmp_path / ".x.json"))
    assert not tb.exists()
    directory, created = sweep_directory(str(tb), "s.1", str(REPO / "configs/sample.json"))  # a dot inside is fine
    assert created and directory == tb / "s.1"
