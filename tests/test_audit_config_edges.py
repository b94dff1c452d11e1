"""Audit tests of the config and command line (`dlrm.config`, `dlrm.config_checks`, `dlrm.cli`): option
combinations and option values that used to be silently ignored, run names that passed validation but were
refused only after the dataset was read and the model built, and dotted overrides of a section and of a key
inside it (the key was lost). Each test failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrm import cli
from dlrm.config import ConfigError, load_config
from dlrm.logging_setup import configure_logging
from tests.conftest import REPO

SAMPLE = REPO / "configs" / "sample.json"


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


@pytest.fixture
def actions(monkeypatch):
    """Record train / evaluate_checkpoint / export_checkpoint instead of running them."""
    from dlrm.train import checkpointer, export, trainer

    calls: list[str] = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: calls.append("train") or {"checkpoint": "last.pt"})
    monkeypatch.setattr(checkpointer, "checkpoint_for", lambda path: Path(path))
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda *a: calls.append("eval"))
    monkeypatch.setattr(export, "export_checkpoint", lambda *a: calls.append("export"))
    return calls


def invoke(tmp_path: Path, *args: str, config: Path = SAMPLE):
    return CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), *args])


def one_error(result) -> str:
    """Exit 2 with exactly one ERROR line and no traceback; return that line's message."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.output
    return errors[0].split(" ERROR ", 1)[1].strip()


# --- --resume with --checkpoint --export: the resume was silently dropped -------------------------------------------

def test_resume_with_checkpoint_and_export_is_refused(tmp_path, actions):
    """`--resume --checkpoint C --export M` exported C and never resumed (exit 0): one of the two is ignored."""
    result = invoke(tmp_path, "--run-name", "r", "--resume", "--checkpoint", "c.pt",
                    "--export", str(tmp_path / "m.pt2"))
    assert one_error(result) == ("--resume cannot be combined with --checkpoint (--resume continues training from "
                                 "its own checkpoint; export a --checkpoint in a run of its own)")
    assert actions == []
    assert not (tmp_path / "tb").exists() and not (tmp_path / "m.pt2").exists()


# --- an empty --export or --checkpoint (an unset shell variable) was taken as absent -------------------------------

def test_an_empty_export_path_is_refused_not_ignored(tmp_path, actions):
    """`--export ""` trained a whole run and exported nothing, exit 0."""
    assert one_error(invoke(tmp_path, "--export", "")) == "--export: empty path (name the .pt2 file to write)"
    assert actions == []


def test_an_empty_checkpoint_is_refused_not_ignored(tmp_path, actions):
    """`--checkpoint "" --export M` trained a new run from scratch (and exported it) instead of exporting a checkpoint."""
    result = invoke(tmp_path, "--checkpoint", "", "--export", str(tmp_path / "m.pt2"))
    assert one_error(result) == "--checkpoint: empty path (a .pt file or a run directory)"
    assert actions == []
    assert not (tmp_path / "tb").exists()


# --- run names: validated with the config, not after the dataset is read and the model built ------------------------

@pytest.mark.parametrize("name, message", [
    ("my run", "log.run_name: 'my run' may hold only letters, digits and . _ + - (it names the run's directory)"),
    ("a" * 256, "log.run_name: a name of 256 bytes is too long for a directory name (at most 255)"),
], ids=["space", "256-bytes"])
def test_a_run_name_the_run_directory_refuses_is_a_config_error(name, message):
    """Both passed load_config; the run refused them (or failed to create the directory, leaving an empty
    --tb-dir behind) only after reading the dataset and building the model."""
    with pytest.raises(ConfigError) as err:
        load_config(SAMPLE, {"log.run_name": name})
    assert str(err.value) == f"command line: {message}"


def test_the_longest_and_widest_run_names_are_accepted():
    assert load_config(SAMPLE, {"log.run_name": "a" * 255}).log.run_name == "a" * 255
    assert load_config(SAMPLE, {"log.run_name": "r-1_2.3+x"}).log.run_name == "r-1_2.3+x"


def test_a_config_file_name_that_cannot_name_a_run_is_refused_before_training(tmp_path, actions):
    """A config "my config.json" trains under the default run name "my config-<date>-<time>", which the run
    directory refuses: after the dataset was read and the model built, naming log.run_name, never set."""
    config = tmp_path / "my config.json"
    config.write_bytes(SAMPLE.read_bytes())
    message = one_error(invoke(tmp_path, config=config))
    assert message == (f"{config}: name: 'my config' (the config file's name unless set) begins the default run "
                       "name and may hold only letters, digits and . _ + -; set \"name\" or pass --run-name")
    assert actions == []
    # an explicit run name makes it irrelevant; --eval-only writes a run directory of that name too (refused alike),
    # an export of a --checkpoint none
    assert invoke(tmp_path, "--run-name", "r", config=config).exit_code == 0
    assert invoke(tmp_path, "--eval-only", "--checkpoint", "c.pt", config=config).exit_code == 2
    assert invoke(tmp_path, "--eval-only", "--checkpoint", "c.pt", "--run-name", "e", config=config).exit_code == 0
    assert actions == ["train", "eval"]


def test_a_name_too_long_for_the_default_run_name_is_refused_before_training(tmp_path, actions):
    """"name" of 240 bytes + "-<date>-<time>" is 256 bytes: creating the run directory failed after the model was
    built, leaving --tb-dir behind, created empty."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({**json.loads(SAMPLE.read_text()), "name": "n" * 240}))
    assert one_error(invoke(tmp_path, config=config)) == (
        f"{config}: name: a name of 240 bytes is too long to begin the default run name (at most 239); set a "
        'shorter "name" or pass --run-name')
    assert actions == [] and not (tmp_path / "tb").exists()
    config.write_text(json.dumps({**json.loads(SAMPLE.read_text()), "name": "n" * 239}))
    assert invoke(tmp_path, config=config).exit_code == 0 and actions == ["train"]


# --- dotted overrides of a section and of a key inside it ----------------------------------------------------------

def test_a_key_overridden_inside_an_overridden_section_is_kept():
    """{"optim.dense.lr": 0.5, "optim.dense": {...}} (a sweep's `--set optim.dense.lr=... --set optim.dense=...`)
    trained with the default lr: the section, applied second, replaced the key set first."""
    cfg = load_config(SAMPLE, {"optim.dense.lr": 0.5, "optim.dense": {"name": "sgd"}})
    assert (cfg.optim.dense.name, cfg.optim.dense.lr) == ("sgd", 0.5)


def test_overrides_do_not_change_the_callers_values():
    """The section's dict was written into: a sweep's grid shares it between settings, so its reported setting
    (and the next trial's value) carried a key of another setting."""
    section = {"name": "sgd"}
    overrides = {"optim.dense": section, "optim.dense.lr": 0.5}
    assert load_config(SAMPLE, overrides).optim.dense.lr == 0.5
    assert section == {"name": "sgd"}
    assert load_config(SAMPLE, {"optim.dense": section}).optim.dense.lr == 1e-3
    assert json.dumps(overrides) == '{"optim.dense": {"name": "sgd"}, "optim.dense.lr": 0.5}'


# --- empty directory paths: Path("") is the working directory -------------------------------------------------------

@pytest.mark.parametrize("option, message", [
    ("--tb-dir", 'command line: log.tb_dir: empty path (the TensorBoard root; "." for the working directory)'),
    ("--data", 'command line: data.path: empty path (a dataset directory; "." for the working directory)'),
])
def test_an_empty_directory_option_is_refused(tmp_path, actions, option, message):
    """`--tb-dir ""` (an unset shell variable) wrote the run directory into the working directory; `--data ""` read
    the working directory as the dataset (failing with "metadata.json: missing", naming neither option nor key)."""
    result = CliRunner().invoke(cli.main, ["--config", str(SAMPLE), option, ""])
    assert one_error(result) == message
    assert actions == []
    assert load_config(SAMPLE, {"log.tb_dir": ".", "data.path": "."}).log.tb_dir == "."


def test_the_kernels_shortcut_leaves_a_cat_models_interaction_to_torch(tmp_path):
    """`--kernels triton` (every component at once) on a "cat" model: refused since the Triton cat interaction was
    found missing (an explicit kernels.interaction "triton" there is refused); the shortcut means Triton wherever it
    has a kernel, so the interaction stays torch, and a dot model keeps the Triton interaction."""
    from dlrm.cli import load_with_kernels_shortcut

    shortcut = {f"kernels.{k}": "triton" for k in ("embedding", "interaction", "mlp", "loss")}
    cat = tmp_path / "cat.json"
    cat.write_text(json.dumps({"model": {"interaction": "cat", "bottom_mlp": [64, 16]}}))
    cfg = load_with_kernels_shortcut(str(cat), shortcut)
    assert (cfg.kernels.embedding, cfg.kernels.interaction, cfg.kernels.mlp, cfg.kernels.loss) == (
        "triton", "torch", "triton", "triton")
    dot = load_with_kernels_shortcut(str(REPO / "configs" / "sample.json"), shortcut)
    assert dot.kernels.interaction == "triton"
    with pytest.raises(ConfigError, match='kernels.interaction: "triton"'):  # asked for by name: still refused
        load_with_kernels_shortcut(str(cat), {"kernels.interaction": "triton"})
    with pytest.raises(ConfigError, match="data.batch_size"):  # another error keeps its own message
        load_with_kernels_shortcut(str(cat), {**shortcut, "data.batch_size": 0})


def test_eval_only_refuses_a_config_name_that_cannot_name_its_run_before_loading(tmp_path):
    """--eval-only writes a run directory of the default name too: a config file named "my config.json" failed after
    the checkpoint and the model were loaded, naming log.run_name, a key the user never set."""
    bad = tmp_path / "my config.json"
    bad.write_text(SAMPLE.read_text())
    res = CliRunner().invoke(cli.main, ["--config", str(bad), "--eval-only", "--checkpoint", str(tmp_path / "none.pt"),
                                        "--tb-dir", str(tmp_path / "tb")])
    assert res.exit_code == 2, res.output
    assert "name: 'my config'" in res.output and "none.pt" not in res.output, res.output
    assert not (tmp_path / "tb").exists()
