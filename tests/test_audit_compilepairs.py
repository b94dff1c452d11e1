"""torch.compile on the CPU paired with the other features (audit): each pair against its uncompiled twin, or
refused in one line where it cannot run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.config import ConfigError, load_config
from dlrm.logging_setup import configure_logging
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset
from tests.fastdist_ranks import failures_on_ranks

SMALL = {"data.batch_size": 16, "model.embedding_dim": 4, "model.bottom_mlp": [8, 4], "model.top_mlp": [8, 1],
         "train.device": "cpu", "train.max_steps": 2, "train.log_every": 1, "train.baseline": False,
         "train.deterministic": True}


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points loguru at CliRunner's stderr, which is closed afterwards: point it back."""
    yield
    configure_logging()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("compilepairs") / "ds"
    make_dataset(root, {"train": 64, "validation": 16}, row_group_size=32)
    return root


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if "ERROR" in line]


# -- --compare with --compile / --compile-mode ------------------------------------------------------------------------

@pytest.mark.parametrize("flags, named", [(["--compile-mode", "max-autotune"], "--compile-mode"),
                                          (["--compile"], "--compile"), (["--no-compile"], "--no-compile"),
                                          (["--kernels", "torch"], "--kernels")])
def test_compare_refuses_the_compile_options_its_variants_replace(tmp_path, monkeypatch, flags, named):
    """`--compare eager,compiled --compile-mode max-autotune` trained the compiled variant in mode default and the
    eager one eagerly, exit 0: each variant sets torch.compile itself (dlrm.train.compare.variant_config), so the
    option was ignored without a word. Refused in one line, as the other ignored options are (dlrm.cli.check_modes)."""
    import dlrm.train.compare as compare

    compared = []
    monkeypatch.setattr(compare, "run_comparison", lambda cfg, variants, fn: compared.append((cfg, variants)))
    result = CliRunner().invoke(cli.main, ["--config", str(REPO / "configs" / "sample.json"), "--tb-dir",
                                           str(tmp_path / "tb"), "--compare", "eager,compiled", *flags])
    assert not compared, "the comparison ran, ignoring " + " ".join(flags)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = _error_lines(result)
    assert named in line and "--compare" in line


# -- fullgraph under torchrun (gloo) ------------------------------------------------------------------------------------

def _fullgraph_on_rank(rank: int, root: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    cfg = load_config(REPO / "configs" / "sample.json", {
        **SMALL, "data.path": str(Path(root) / "ds"), "log.tb_dir": str(Path(root) / "tb"), "log.run_name": "fg",
        "train.compile": {"enabled": True, "fullgraph": True}, "distributed.sharding": "table"})
    try:
        train(cfg)
    except ConfigError as e:
        assert "train.compile.fullgraph" in str(e) and "\n" not in str(e), str(e)
        return
    except Exception as e:  # what the run raised instead (the child's traceback is not the test's)
        raise AssertionError(f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
    raise AssertionError("trained under fullgraph")


def test_fullgraph_under_torchrun_is_a_config_error_not_a_traceback(tmp_path, dataset):
    """DDP's forward (the dense parts' gradient synchronisation) cannot be traced as one graph: with
    train.compile.fullgraph true, two gloo ranks failed at the first step with Dynamo's Unsupported traceback
    ("set_runtime_stats_and_log of class Logger"), reported as a bug (exit 1). A one-line ConfigError naming the key,
    before any step, on every rank."""
    (tmp_path / "ds").symlink_to(dataset)
    failures = failures_on_ranks(_fullgraph_on_rank, [(str(tmp_path),)], 2, tmp_path)
    assert not failures, failures
    assert not (tmp_path / "tb" / "fg").exists()


# -- compile modes with CUDA graphs of their own, on the CPU ----------------------------------------------------------

@pytest.mark.parametrize("mode, used", [("reduce-overhead", "default"),
                                        ("max-autotune", "max-autotune-no-cudagraphs")])
def test_modes_with_cuda_graphs_say_so_on_the_cpu(monkeypatch, mode, used):
    """`--compile-mode max-autotune` on the CPU compiled without its CUDA graphs and without a word, where
    reduce-overhead says its CUDA graphs need CUDA: both now log it once per compiled function and compile without
    them (max-autotune keeps its autotuning)."""
    import torch
    from loguru import logger

    from dlrm.config import CompileConfig
    from dlrm.train import step

    calls, warnings = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING")
    try:
        step._maybe_compile(lambda x: x, CompileConfig(enabled=True, mode=mode), torch.device("cpu"), "the step")
    finally:
        logger.remove(sink)
    assert calls == [{"mode": used, "fullgraph": False}]
    assert len(warnings) == 1 and f"compile mode {mode} (CUDA graphs) needs CUDA" in warnings[0], warnings
    assert f"uses mode {used} on cpu" in warnings[0]


# -- --profile of a compiled step -------------------------------------------------------------------------------------

def _event(name, cat, ts, dur):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_a_compiled_steps_profile_says_why_its_model_ranges_are_other():
    """torch.compile drops the record_function ranges inside its graphs ("Profiler record function ... will be
    ignored"): a compiled step's profile_step.md (a CPU run's, as written by `--compile --profile`) had only data,
    backward, optimizer and 53% "other", where README promises SparseArch, DenseArch, InteractionArch, OverArch and
    loss, without a word on why (a CUDA-graph replay says it). It says so now; an eager step has no such note."""
    from dlrm.train.trace_summary import step_table, summarize_step

    def trace(model_ranges: bool) -> dict:
        events = [_event("ProfilerStep#9", "user_annotation", 0, 1000), _event("data", "user_annotation", 0, 100)]
        if model_ranges:
            events += [_event("DenseArch", "user_annotation", 100, 300), _event("aten::addmm", "cpu_op", 110, 200)]
        else:
            events += [_event("Torch-Compiled Region: 0/0", "cpu_op", 100, 400),
                       _event("CompiledFunction", "cpu_op", 110, 300)]
        return {"traceEvents": events + [_event("backward", "user_annotation", 600, 300)]}

    compiled = step_table(summarize_step(trace(model_ranges=False)))
    assert "| other |" in compiled and "| DenseArch |" not in compiled
    assert "torch.compile" in compiled and "`train.compile` false" in compiled, compiled
    assert "torch.compile" not in step_table(summarize_step(trace(model_ranges=True)))


# -- a bare --export of a --checkpoint with --compile ------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--compile"], ["--compile-mode", "max-autotune"], ["--kernels", "triton"]])
def test_a_bare_export_refuses_the_compile_options_it_does_not_use(tmp_path, monkeypatch, flags):
    """`--checkpoint C --export M --compile-mode max-autotune` exported C, exit 0: the export traces the eager model
    (torch.export), nothing is compiled, and the option was ignored without a word, as --split was before. With
    --eval-only it compiles the evaluation and stays accepted; --no-compile, which says what the export does, too."""
    from dlrm.train import checkpointer, export

    calls: list[str] = []
    monkeypatch.setattr(checkpointer, "checkpoint_for", lambda path: Path(path))
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda *a: calls.append("eval"))
    monkeypatch.setattr(export, "export_checkpoint", lambda *a: calls.append("export"))
    common = ["--config", str(REPO / "configs" / "sample.json"), "--checkpoint", str(tmp_path / "c.pt"),
              "--export", str(tmp_path / "m.pt2")]
    result = CliRunner().invoke(cli.main, [*common, *flags])
    assert calls == [], f"{' '.join(flags)} was ignored by a bare export"
    assert result.exit_code == 2, result.output
    (line,) = _error_lines(result)
    assert f"{flags[0]}: " in line and "--export of a --checkpoint" in line
    result = CliRunner().invoke(cli.main, [*common, "--no-compile", "--kernels", "torch"])
    assert result.exit_code == 0 and calls == ["export"], result.output  # (what the export does: PyTorch kernels)
    result = CliRunner().invoke(cli.main, [*common, *flags, "--eval-only", "--tb-dir", str(tmp_path / "tb")])
    assert result.exit_code == 0 and calls == ["export", "eval", "export"], result.output
