"""Every expected failure of train.py (and of `python -m dlrm.data.synthetic`) is one ERROR line
naming the key or file, with a documented non-zero exit code and no traceback; an unexpected
exception is a traceback plus one line saying it is a bug (issue #17)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.data import synthetic
from dlrm.errors import NonFiniteLoss, TrainingStopped, dlrm_version
from dlrm.logging_setup import configure_logging
from tests.conftest import CHILD_ENV, REPO

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


@pytest.fixture
def trained(monkeypatch):
    """Replace the trainer's `train` with a recorder (no training); returns the recorded calls."""
    import dlrm.train.trainer as trainer

    calls = []

    def fake_train(cfg, **kwargs):
        calls.append((cfg, kwargs))
        return {"checkpoint": "unused"}

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # (a run of one process, whatever the shell says)
    return calls


def train_raises(monkeypatch, exc: BaseException) -> None:
    """Make the trainer's `train` raise `exc`."""
    import dlrm.train.trainer as trainer

    def failing_train(cfg, **kwargs):
        raise exc

    monkeypatch.setattr(trainer, "train", failing_train)


def write_config(tmp_path: Path, content: bytes | dict, name: str = "c.json") -> Path:
    """A config file holding `content` (raw bytes, or a dict merged over configs/sample.json)."""
    path = tmp_path / name
    if isinstance(content, dict):
        raw = json.loads(json.dumps(SAMPLE))
        for section, values in content.items():
            raw.setdefault(section, {}).update(values)
        content = json.dumps(raw).encode()
    path.write_bytes(content)
    return path


def invoke(tmp_path: Path, config: Path, *args: str):
    """Run train.py's main in-process with a TensorBoard root inside tmp_path."""
    return CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), *args])


def error_line(result, code: int, *needles: str) -> str:
    """Assert exit `code`, exactly one ERROR line holding every needle, no traceback; return the line."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# --- the config file ---------------------------------------------------------------------------

@pytest.mark.parametrize("content, needles", [
    (b'{"train": {"seed": 1}, "name": "caf\xe9"}', ["not UTF-8", "line 1"]),
    (b'{"a": ' * 100_000, ["nested too deeply"]),
    (b'{"train": {"seed": ' + b"7" * 5000 + b"}}", ["train.seed", "5000 digits"]),
    (b'{"data": {"batch_size": 9223372036854775808}}', ["data.batch_size", "int64"]),
    (b'{"optim": {"dense": {"lr": 1e39}}}', ["optim.dense.lr", "float32"]),
    (b'{"optim": {"sparse": {"eps": 1e-50}}}', ["optim.sparse.eps", "underflows"]),
    (b'{"optim": {"dense": {"lr": NaN}}}', ["optim.dense.lr", "nan"]),
    (b'{"optim": {"dense": {"weight_decay": -Infinity}}}', ["optim.dense.weight_decay", "-inf"]),
    (b'{"optim": {"dense": {"momentum": 1e400}}}', ["optim.dense.momentum", "inf"]),
    (b'{"model": {"interaction": "cat", "embedding_dim": 16, "bottom_mlp": [64, 8]}}',
     ["model.bottom_mlp", "model.embedding_dim", "cat"]),
    (b'{"data": {"path": "a\\u0000b"}}', ["data.path", "NUL"]),
])
def test_bad_config_file_is_one_line_naming_file_and_key(tmp_path, trained, content, needles):
    path = write_config(tmp_path, content)
    line = error_line(invoke(tmp_path, path), 2, str(path), *needles)
    assert "UnboundLocalError" not in line
    assert not trained and not (tmp_path / "tb").exists()


def test_negative_seed_on_the_command_line_names_the_key(tmp_path, trained):
    error_line(invoke(tmp_path, REPO / "configs/sample.json", "--seed", "-1"), 2, "train.seed", "-1")
    assert not trained


def test_every_shipped_config_passes_the_new_rules(tmp_path, trained):
    for name in ("sample", "kaggle", "terabyte"):
        result = invoke(tmp_path, REPO / "configs" / f"{name}.json")
        assert result.exit_code == 0, result.output
    assert [cfg.name for cfg, _ in trained] == ["sample", "kaggle", "terabyte"]


@pytest.mark.parametrize("make", ["missing", "file"])
def test_missing_dataset_is_one_line_saying_how_to_make_one(tmp_path, make):
    """A config whose data directory is absent (every shipped config but the sample's, on a fresh checkout)."""
    data = tmp_path / "data"
    if make == "file":
        data.write_text("not a dataset")
    line = error_line(invoke(tmp_path, REPO / "configs" / "sample.json", "--data", str(data)), 2, "data.path", str(data), "dlrm.data.synthetic",
                      "data/README.md")
    assert ("does not exist" if make == "missing" else "is not a directory") in line
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())  # no run directory left behind


def test_ctrl_c_while_the_config_loads_is_an_interruption(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)
    error_line(invoke(tmp_path, REPO / "configs/sample.json"), 130, "interrupted")


# --- --export and option combinations, checked before any training ------------------------------

@pytest.mark.parametrize("target, needles", [
    ("model.onnx", ["model.onnx", ".pt2"]),
    ("exists.pt2", ["exists.pt2", "already exists"]),
    ("no-such-dir/m.pt2", ["no-such-dir", "does not exist"]),
    ("a-file/m.pt2", ["a-file", "is not a directory"]),
])
def test_bad_export_path_fails_before_training(tmp_path, trained, target, needles):
    (tmp_path / "exists.pt2").write_text("the user's program")
    (tmp_path / "a-file").write_text("")
    result = invoke(tmp_path, REPO / "configs/sample.json", "--export", str(tmp_path / target))
    error_line(result, 2, "--export", *needles)
    assert not trained and not (tmp_path / "tb").exists()
    assert (tmp_path / "exists.pt2").read_text() == "the user's program"


@pytest.mark.parametrize("args, needles", [
    (["--compare", "eager", "--export", "m.pt2"], ["--compare", "--export"]),
    (["--eval-only"], ["--eval-only", "--checkpoint"]),
    (["--checkpoint", "c.pt"], ["--checkpoint", "--eval-only or --export"]),
    (["--allow-config-change", "data.batch_size"], ["--allow-config-change", "--resume"]),
    (["--resume", "--allow-config-change", "data.batch_sise"], ["'data.batch_sise' is not a config key",
                                                                "data.batch_size"]),
    (["--resume", "--allow-config-change", "data.batch_size,,optim.dense.lr"], ["--allow-config-change", "empty key"]),
])
def test_contradictory_or_unknown_options_are_one_line(tmp_path, trained, args, needles):
    error_line(invoke(tmp_path, REPO / "configs/sample.json", *args), 2, *needles)
    assert not trained


def test_allow_config_change_reaches_the_trainer_as_a_list(tmp_path, trained):
    result = invoke(tmp_path, REPO / "configs/sample.json", "--run-name", "r", "--resume",
                    "--allow-config-change", "data.batch_size, optim.dense.lr,optim.sparse")
    assert result.exit_code == 0, result.output
    result = invoke(tmp_path, REPO / "configs/sample.json")
    assert result.exit_code == 0, result.output
    (_, resumed), (_, fresh) = trained
    # (results_written: the hook by which the trainer tells train.py its results are out, tests/test_late_signals.py)
    assert callable(resumed.pop("results_written")) and callable(fresh.pop("results_written"))
    assert resumed == {"resume": "latest", "allow_config_change": ["data.batch_size", "optim.dense.lr", "optim.sparse"]}
    assert fresh == {"resume": None, "allow_config_change": []}


def test_export_under_torchrun_is_refused(tmp_path, trained, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    error_line(invoke(tmp_path, REPO / "configs/sample.json", "--export", str(tmp_path / "m.pt2")), 2, "torchrun")


# --- failures during the run --------------------------------------------------------------------

def test_non_finite_loss_exits_3(tmp_path, monkeypatch):
    train_raises(monkeypatch, NonFiniteLoss("loss became NaN or Inf at step 7; stopped; no checkpoint"))
    error_line(invoke(tmp_path, REPO / "configs/sample.json"), 3, "at step 7")


def test_signal_stop_exits_128_plus_the_signal(tmp_path, monkeypatch):
    train_raises(monkeypatch, TrainingStopped(143, "stopped by signal at step 3; checkpoint x"))
    result = invoke(tmp_path, REPO / "configs/sample.json")
    assert result.exit_code == 143 and "stopped by signal at step 3" in result.stderr
    assert "Traceback" not in result.output


def test_ctrl_c_during_training_exits_130(tmp_path, monkeypatch):
    train_raises(monkeypatch, KeyboardInterrupt())
    error_line(invoke(tmp_path, REPO / "configs/sample.json"), 130, "interrupted")


@pytest.mark.parametrize("make_exc, what", [
    (lambda torch: MemoryError(), "host memory"),
    (lambda torch: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has ..."),
     "GPU memory"),
    (lambda torch: RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
     "host memory"),
])
def test_out_of_memory_is_one_line_suggesting_smaller_settings(tmp_path, monkeypatch, make_exc, what):
    import torch

    train_raises(monkeypatch, make_exc(torch))
    error_line(invoke(tmp_path, REPO / "configs/sample.json", "--batch-size", "64"), cli.EXIT_OUT_OF_MEMORY,
               f"out of {what}", "data.batch_size (now 64)", "data.max_rows_per_table")


def test_bad_checkpoint_quoting_a_multi_line_error_stays_one_line(tmp_path, monkeypatch):
    from dlrm.config import ConfigError

    train_raises(monkeypatch, ConfigError("r/ckpt.pt: not a readable checkpoint (UnpicklingError: invalid load key\n"
                                          "Weights only load failed)"))
    error_line(invoke(tmp_path, REPO / "configs/sample.json"), 2, "ckpt.pt", "invalid load key Weights only")


def test_full_disk_is_one_line(tmp_path, monkeypatch):
    train_raises(monkeypatch, OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "tb/r/ckpt.pt")))
    error_line(invoke(tmp_path, REPO / "configs/sample.json"), 2, "ckpt.pt", "No space left on device")


def test_triton_unavailable_is_one_line(tmp_path, monkeypatch):
    from kernels import TritonUnavailableError

    train_raises(monkeypatch, TritonUnavailableError("kernels.embedding: 'triton' needs a GPU"))
    error_line(invoke(tmp_path, REPO / "configs/sample.json"), 2, "kernels.embedding")


def test_unexpected_exception_is_a_traceback_and_a_bug_line(tmp_path, monkeypatch):
    train_raises(monkeypatch, RuntimeError("an internal invariant broke"))
    result = invoke(tmp_path, REPO / "configs/sample.json")
    assert result.exit_code == 1, result.output
    assert "Traceback" in result.stderr and "RuntimeError: an internal invariant broke" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "ERROR" in last and "bug in dlrm" in last and dlrm_version() in last


# --- a real process -----------------------------------------------------------------------------

def test_real_process_non_utf8_config_is_one_line(tmp_path):
    """The original report: a non-UTF-8 config showed `UnboundLocalError: NonFiniteLoss`."""
    path = write_config(tmp_path, b'{"name": "\xff"}')
    res = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(path)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "UnboundLocalError" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "ERROR" in lines[0] and "not UTF-8" in lines[0] and str(path) in lines[0]


# --- python -m dlrm.data.synthetic --------------------------------------------------------------

def invoke_synthetic(*args: str):
    return CliRunner().invoke(synthetic.main, list(args))


def test_synthetic_occupied_output_exits_2_and_keeps_the_data(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "mine.txt").write_text("user data")
    error_line(invoke_synthetic("--rows", "10", "--out", str(out)), 2, "refusing to overwrite", str(out))
    assert (out / "mine.txt").read_text() == "user data"


@pytest.mark.parametrize("option", ["--out", "--raw-tsv"])
def test_synthetic_unwritable_target_exits_2_before_any_work(tmp_path, option):
    (tmp_path / "a-file").write_text("")
    target = str(tmp_path / "a-file" / "x")
    args = ["--out", target] if option == "--out" else ["--out", str(tmp_path / "ds"), "--raw-tsv", target]
    result = invoke_synthetic("--rows", "10", *args)  # (the click path type's line: tests/test_under_file_paths.py)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"Invalid value for '{option}'" in lines[0] and "a-file is not a directory" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_synthetic_bad_fractions_exit_2(tmp_path):
    result = invoke_synthetic("--rows", "10", "--validation-fraction", "0.6", "--test-fraction", "0.5",
                              "--out", str(tmp_path / "ds"))
    error_line(result, 2, "no training rows")


def test_synthetic_unexpected_exception_is_a_bug(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(synthetic, "generate", broken)
    result = invoke_synthetic("--rows", "10", "--out", str(tmp_path / "ds"))
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "bug in dlrm" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("where", ["inside", "same", "above"])
def test_synthetic_raw_tsv_overlapping_out_exits_2_before_any_work(tmp_path, where):
    out = tmp_path / "ds"
    tsv, out = {"inside": (out / "raw.tsv", out), "same": (out, out), "above": (out, out / "data")}[where]
    result = invoke_synthetic("--rows", "10", "--cardinalities", "tiny", "--out", str(out), "--raw-tsv", str(tsv))
    line = error_line(result, 2, "--raw-tsv", str(tsv), "--out", str(out))
    assert ".tmp" not in line  # names the user's paths, not an internal temporary file
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_synthetic_multi_hot_size_above_the_cap_exits_2(tmp_path):
    from dlrm.data.schema import MAX_MULTI_HOT_SIZE

    sizes = ",".join(["1"] * 3 + [str(MAX_MULTI_HOT_SIZE + 1)] + ["1"] * 22)
    result = invoke_synthetic("--rows", "10", "--cardinalities", "tiny", "--multi-hot-sizes", sizes,
                              "--out", str(tmp_path / "ds"))
    error_line(result, 2, "--multi-hot-sizes", "SPARSE_3", str(MAX_MULTI_HOT_SIZE + 1), str(MAX_MULTI_HOT_SIZE))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["train.py", "--config", ""], "Invalid value for '--config': empty path (name the JSON config file)"),
    (["-m", "dlrm.sweep", "--config", "", "--set", "train.seed=1,2"],
     "Invalid value for '--config': empty path (name the JSON config file)"),
    (["-m", "dlrm.distributed.merge", "", "out.pt"],
     "Invalid value for 'CHECKPOINT': empty path (name the manifest of a sharded checkpoint)"),
    (["-m", "dlrm.distributed.merge", "step-00000010.pt", ""],
     "Invalid value for 'OUT': empty path (name the merged checkpoint to write)"),
])
def test_an_empty_path_is_named_as_empty(tmp_path, argv, message):
    """`--config "$CFG"` with CFG unset was named as '.' ('.: config file not found'), as was merge's empty CHECKPOINT;
    now one line says the path is empty, exit 2, nothing written."""
    # CHILD_ENV: this checkout's dlrm (`-m dlrm.sweep` from tmp_path ran an installed copy, or none: "No module named
    # 'dlrm'" where the editable install points elsewhere)
    r = subprocess.run([sys.executable, *[str(REPO / a) if a == "train.py" else a for a in argv]], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=CHILD_ENV)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []
