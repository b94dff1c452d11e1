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
from dlrm.config_checks import MAX_NAME_BYTES, RUN_NAME, free_run_name, leading_name_problem
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


# -- the free name a refusal advises beside such an old run is one a new run may take ---------------------------------


def accepted(name: str) -> bool:
    return (leading_name_problem(name, "n") is None and RUN_NAME.fullmatch(name) is not None
            and len(name.encode()) <= MAX_NAME_BYTES)


@pytest.mark.parametrize("name", ["-x", ".x", "-x-2", ".x-20261201-101010", "--", ".-.", "-" + "a" * 254])
def test_the_free_name_beside_a_run_named_with_a_leading_dot_or_dash_is_accepted(tmp_path, name):
    """free_run_name kept the leading character: beside ``-x`` it advised ``-x-2``, which a new run may not take."""
    (tmp_path / name).mkdir()
    free = free_run_name(tmp_path / name)
    assert accepted(free) and not (tmp_path / free).exists(), free
    (tmp_path / free).mkdir()  # taken in turn: the next advice is another accepted, free name
    again = free_run_name(tmp_path / name)
    assert again != free and accepted(again) and not (tmp_path / again).exists(), again


def advised(message: str) -> str:
    return re.search(r"--run-name (\S+) (?:is free|\(free\))", message).group(1)


@pytest.mark.parametrize("lead", [".", "-"])
def test_the_taken_run_directorys_advice_beside_such_a_run_is_followed(tmp_path, trained, lead):
    """`RunDirectory.create`'s refusal of an existing non-empty directory (reached by the Python API's `train`, which
    does not check names as the command line does) names a --run-name the command line then accepts."""
    from dlrm.config import load_config
    from dlrm.train.run_dir import RunDirectory

    tb = tmp_path / "tb"
    (tb / f"{lead}old").mkdir(parents=True)
    (tb / f"{lead}old" / "x").write_text("x")
    cfg = load_config(str(REPO / "configs/sample.json"))
    cfg.log.tb_dir, cfg.log.run_name = str(tb), f"{lead}old"
    for evaluation in (False, True):
        with pytest.raises(ConfigError) as refused:
            RunDirectory.create(cfg, evaluation=evaluation)
        assert advised(str(refused.value)) == "old-2", str(refused.value)
    result = invoke(tb, REPO / "configs/sample.json", "--run-name", "old-2")
    assert result.exit_code == 0, result.output
    assert [cfg.log.run_name for cfg, _ in trained] == ["old-2"]


@pytest.mark.parametrize("eval_only", [False, True])
@pytest.mark.parametrize("lead", [".", "-"])
def test_the_own_record_advice_beside_such_a_run_is_followed(tmp_path, trained, monkeypatch, lead, eval_only):
    """`check_not_own_record`'s advice for an old run's own config.json (log.run_name '-old'); on the command line the
    name's own refusal comes first, which names none: the advice is followed there with the config.json unchanged."""
    from types import SimpleNamespace

    from dlrm.cli import check_not_own_record
    from dlrm.train import export

    evaluated = []
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda cfg, *a: evaluated.append(cfg.log.run_name))
    tb = tmp_path / "tb"
    run = tb / f"{lead}old"
    checkpoint = run / "checkpoints" / "step-00000005.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    raw = json.loads((REPO / "configs/sample.json").read_text())
    raw["data"]["path"] = str(REPO / raw["data"]["path"])
    raw["log"] = {"tb_dir": str(tb), "run_name": f"{lead}old"}
    (run / "config.json").write_text(json.dumps(raw))
    (tb / "old-2").mkdir()  # taken by something else: the advice names the next free name
    cfg = SimpleNamespace(log=SimpleNamespace(run_name=f"{lead}old", tb_dir=str(tb)))
    with pytest.raises(ConfigError) as refused:
        check_not_own_record(str(run / "config.json"), cfg, {}, eval_only)
    name = advised(str(refused.value))
    assert name == "old-3", str(refused.value)
    args = ["--eval-only", "--checkpoint", str(checkpoint)] if eval_only else []
    result = CliRunner().invoke(cli.main, ["--config", str(run / "config.json"), "--run-name", name, *args])
    assert result.exit_code == 0, result.output
    assert (evaluated if eval_only else [cfg.log.run_name for cfg, _ in trained]) == [name]


@pytest.mark.parametrize("lead", [".", "-"])
def test_the_sweep_advice_beside_such_a_sweep_is_followed(tmp_path, trained, lead):
    """An old sweep ``-s``'s trial config.json given back (and a branch from its trial's checkpoint) was refused with
    ``add --tb-dir <tb> --run-name -s-00-seed-0 (free)``, which the same command then refused as beginning with '-'."""
    tb = tmp_path / "tb"
    sweep = tb / f"{lead}s"
    setting = sweep / "00-optim.dense.lr=0.001"
    trial = setting / "seed-0"
    checkpoint = trial / "checkpoints" / "step-00000005.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    (sweep / "sweep.json").write_text(json.dumps({"sets": [], "seeds": [0]}))
    raw = json.loads((REPO / "configs/sample.json").read_text())
    raw["data"]["path"] = str(REPO / raw["data"]["path"])
    raw["log"] = {"tb_dir": str(setting), "run_name": "seed-0"}
    config = trial / "config.json"
    config.write_text(json.dumps(raw))
    for branch in ([], ["--resume", str(checkpoint), "--run-name", "b"]):
        line = one_error(CliRunner().invoke(cli.main, ["--config", str(config), *branch]))
        where, name = re.search(r"add --tb-dir (\S+) --run-name (\S+) \(free\)", line).groups()
        assert where == str(tb) and name == ("s-00-b" if branch else "s-00-seed-0"), line
        result = CliRunner().invoke(cli.main, ["--config", str(config), *branch[:2], "--tb-dir", where,
                                               "--run-name", name])
        assert result.exit_code == 0, result.output
    assert [(cfg.log.tb_dir, cfg.log.run_name) for cfg, _ in trained] == [(str(tb), "s-00-seed-0"), (str(tb), "s-00-b")]
