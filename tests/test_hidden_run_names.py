"""A new run or sweep directory whose name begins with '.' or '-' is refused in one line naming it: accepted before,
``tb_logs/.r`` was missing from ``ls tb_logs`` and from shell globs (``tb_logs/*``) while TensorBoard and --resume
still found it, and ``tb_logs/-r`` was read as options by the commands given its name (``cd tb_logs && rm -r -r``).
A run that already has such a name is still resumed in place (nothing the user has is stranded).
In-process with a recording `train` (no training): each case costs milliseconds."""

from __future__ import annotations

import json
import re
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


# what each leading character's refusal says about it: '.' hides the directory, '-' makes its name an option
WHY = {".": "ls", "-": "option"}


@pytest.mark.parametrize("lead", [".", "-"])
def test_a_new_run_named_with_a_leading_dot_or_dash_is_refused(tmp_path, trained, lead):
    """(`--run-name -x` reaches the check: click takes the word after --run-name as its value, whatever it begins
    with.)"""
    tb = tmp_path / "tb"
    line = one_error(invoke(tb, REPO / "configs/sample.json", "--run-name", f"{lead}hidden"))
    assert f"command line: log.run_name: '{lead}hidden' begins with '{lead}'" in line and WHY[lead] in line
    assert not trained and not tb.exists()


@pytest.mark.parametrize("lead", [".", "-"])
def test_log_run_name_in_a_config_file_with_a_leading_dot_or_dash_is_refused(tmp_path, trained, lead):
    """The config key, not the flag: the line names the file."""
    tb = tmp_path / "tb"
    config = tmp_path / "named.json"
    config.write_text(json.dumps({**json.loads((REPO / "configs/sample.json").read_text()),
                                  "log": {"run_name": f"{lead}r"}}))
    line = one_error(invoke(tb, config))
    assert f"{config}: log.run_name: '{lead}r' begins with '{lead}'" in line and WHY[lead] in line
    assert not trained and not tb.exists()


@pytest.mark.parametrize("lead", [".", "-"])
def test_the_other_new_directories_named_with_a_leading_dot_or_dash_are_refused(tmp_path, trained, lead):
    """--resume by a name not there yet (it starts the run), a branch, --compare, --eval-only, and a default name from
    a config file named ".x.json" or "-x.json"."""
    tb = tmp_path / "tb"
    checkpoint = tmp_path / "src" / "checkpoints" / "step-00000005.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    cases = [["--run-name", f"{lead}new", "--resume"], ["--resume", str(checkpoint), "--run-name", f"{lead}branch"],
             ["--run-name", f"{lead}c", "--compare", "eager"],
             ["--run-name", f"{lead}e", "--eval-only", "--checkpoint", str(checkpoint)]]
    for args in cases:
        assert f"begins with '{lead}'" in one_error(invoke(tb, REPO / "configs/sample.json", *args)), args
    led = tmp_path / f"{lead}x.json"
    led.write_text((REPO / "configs/sample.json").read_text())
    line = one_error(invoke(tb, led))
    assert f"{led}: name" in line and f"'{lead}x' begins with '{lead}'" in line and "--run-name" in line
    assert not trained and not tb.exists()


@pytest.mark.parametrize("lead", [".", "-"])
def test_an_existing_run_with_such_a_name_is_still_resumed_in_place(tmp_path, trained, lead):
    """Made before names were checked: --resume of it by name goes on (refused, it was stranded)."""
    tb = tmp_path / "tb"
    (tb / f"{lead}old").mkdir(parents=True)
    (tb / f"{lead}old" / "config.json").write_text(json.dumps({"name": "sample"}))
    result = invoke(tb, REPO / "configs/sample.json", "--run-name", f"{lead}old", "--resume")
    assert result.exit_code == 0, result.output
    assert [(cfg.log.run_name, kwargs["resume"]) for cfg, kwargs in trained] == [(f"{lead}old", "latest")]


@pytest.mark.parametrize("lead", [".", "-"])
def test_a_sweep_named_with_a_leading_dot_or_dash_is_refused(tmp_path, lead):
    tb = tmp_path / "tb"
    e = re.escape(lead)
    with pytest.raises(ConfigError, match=rf"^--run-name: '{e}s' begins with '{e}'"):
        sweep_directory(str(tb), f"{lead}s", str(REPO / "configs/sample.json"))
    default = rf"the default sweep name: '{e}x-sweep-[0-9-]+' begins with '{e}'.*--run-name"
    with pytest.raises(ConfigError, match=default):
        sweep_directory(str(tb), None, str(tmp_path / f"{lead}x.json"))
    assert not tb.exists()
    directory, created = sweep_directory(str(tb), f"s{lead}1", str(REPO / "configs/sample.json"))  # inside is fine
    assert created and directory == tb / f"s{lead}1"
