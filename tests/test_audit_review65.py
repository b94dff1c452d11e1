"""Review of session 65's changes: each test failed before its fix.

A --resume of a run stopped before its first checkpoint (restarted from step 0 against its config.json, nothing loaded)
was told a changed model key is "fixed by the checkpoint", with no checkpoint there, and not told the
--allow-config-change that restarts it; a config.json whose `model` is no mapping failed as a bug (AttributeError,
exit 1) instead of being refused. ConsoleStream took every OSError of a write for the console gone: one EAGAIN of a
non-blocking stderr, or ENOSPC of a log's disk, silenced the rest of the run.
"""

from __future__ import annotations

import errno
import io
import json

import pytest

from dlrm.config import ConfigError, config_from_dict
from dlrm.logging_setup import ConsoleStream
from dlrm.train.resume_policy import check_resume_config, restart_config


def _stopped_run(tmp_path, saved: dict):
    """A run directory as a run killed before its first checkpoint leaves it: config.json only."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(saved))
    return run


def test_a_restart_from_step_0_advises_the_flag_for_a_model_key(tmp_path):
    run = _stopped_run(tmp_path, config_from_dict({}).to_dict())
    current = config_from_dict({"model": {"bottom_mlp": [32, 16]}}).to_dict()
    with pytest.raises(ConfigError) as e:
        restart_config(run, current, ())
    text = str(e.value)
    assert text.endswith("resume with the stopped run's config.json values, or pass --allow-config-change "
                         "model.bottom_mlp"), text
    assert "fixed by the checkpoint" not in text, text
    restart_config(run, current, ("model.bottom_mlp",))  # the advice holds: no checkpoint is loaded
    # a checkpoint's config still fixes it
    with pytest.raises(ConfigError, match=r"\(model\.bottom_mlp: fixed by the checkpoint"):
        check_resume_config(config_from_dict({}).to_dict(), current, (), "c.pt")


@pytest.mark.parametrize("model", [["x"], "dcn", 3])
def test_a_config_json_whose_model_is_no_mapping_is_refused_not_a_bug(tmp_path, model):
    saved = config_from_dict({}).to_dict()
    saved["model"] = model
    run = _stopped_run(tmp_path, saved)
    with pytest.raises(ConfigError, match=r"\(model: .* -> \(absent\); "):
        restart_config(run, config_from_dict({}).to_dict(), ())


class _FailingOnce(io.StringIO):
    """A console whose first write (and flush) raises `error`, and whose later ones go through."""

    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().write(text)


@pytest.mark.parametrize("error", [BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"),
                                   OSError(errno.ENOSPC, "No space left on device"),
                                   OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_a_write_error_that_leaves_the_console_loses_that_write_only(error):
    stream = _FailingOnce(error)
    console = ConsoleStream(stream)
    assert console.write("train:  10%|") == len("train:  10%|")  # (not raised: the run goes on)
    console.write_record("12:00:00 INFO    step 5 ...\n")
    assert not console.reader_gone
    assert stream.getvalue().endswith("12:00:00 INFO    step 5 ...\n"), repr(stream.getvalue())


@pytest.mark.parametrize("error", [BrokenPipeError(errno.EPIPE, "Broken pipe"), OSError(errno.EBADF, "Bad file"),
                                   OSError(errno.EIO, "Input/output error")])
def test_a_console_gone_stops_the_writes(error):
    stream = _FailingOnce(error)
    console = ConsoleStream(stream)
    console.write("train:  10%|")
    console.write_record("12:00:00 INFO    step 5 ...\n")
    assert console.reader_gone and stream.getvalue() == ""


def _build_text(monkeypatch, model: dict, cardinalities: list[int], device: str) -> str:
    import torch

    import dlrm.train.builder as builder
    from dlrm.config import Config, validate
    from dlrm.train.setup import Tables

    cfg = validate(Config())
    for key, value in model.items():
        setattr(cfg.model, key, value)
    exc = torch.OutOfMemoryError("CUDA out of memory.") if device == "cuda" else RuntimeError("can't allocate memory")
    with pytest.raises(type(exc)):
        with builder.tables_named_if_out_of_memory(cfg, Tables(cardinalities, None, "modulus"), torch.device(device),
                                                   builder.DistEnv()):
            raise exc
    return exc.dlrm_tables


def test_small_dense_layers_on_a_gpu_others_hold_are_not_blamed(monkeypatch):
    """The GPU nearly full before the build (other processes' 57 GiB, this process's split in GPU memory 20 GiB):
    MLPerf's MLPs and cross network (61 MB) over small tables are not what ran out, yet "shrink model.cross_rank (now
    512)" was the advice, in place of streaming the split. Dense layers and tables that fit in the free memory leave
    the tables' message, which says what was free and held."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * 2**30)
    mlperf = {"interaction": "dcn", "embedding_dim": 128, "bottom_mlp": [512, 256, 128],
              "top_mlp": [1024, 1024, 512, 256, 1], "cross_layers": 3, "cross_rank": 512}
    text = _build_text(monkeypatch, mlperf, [1000] * 26, "cuda")
    assert "dense layers" not in text and "cross_rank" not in text, text
    assert "stream the data" in text and "3.0 GiB of the GPU's 80.0 GiB were free" in text, text
    # beyond the free memory they are named, as before
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    assert "shrink model.cross_rank (now 512)" in _build_text(monkeypatch, mlperf, [1000] * 26, "cuda")


def test_small_dense_layers_on_a_full_host_are_not_blamed(monkeypatch):
    """The same on the CPU against the host's available memory before the build."""
    import dlrm.train.builder as builder

    monkeypatch.setattr(builder, "_available_host_memory", lambda: 64 * 2**30, raising=False)
    text = _build_text(monkeypatch, {"top_mlp": [4096, 1]}, [10] * 26, "cpu")
    assert "dense layers" not in text and text.endswith("cap them with data.max_rows_per_table"), text
    monkeypatch.setattr(builder, "_available_host_memory", lambda: 2**20, raising=False)
    assert _build_text(monkeypatch, {"top_mlp": [4096, 1]}, [10] * 26, "cpu").endswith(
        "shrink model.top_mlp (now [4096, 1])")


def test_every_bar_in_dlrm_is_a_progress_bar():
    """The ^C fix holds for the bars built as ProgressBar only: a `tqdm(...)` added to dlrm/ later would wrap `C` onto
    the next line again, and no test said so (each bar's test patches its module's ProgressBar)."""
    import ast
    from pathlib import Path

    import dlrm

    root = Path(dlrm.__file__).parent
    found = []
    # dlrm/ and the benchmark scripts (their kernel sweep's bar is on a terminal too)
    for path in sorted([*root.rglob("*.py"), *(root.parent / "benchmarks").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name == "tqdm":
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert found == [], found
