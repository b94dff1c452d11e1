"""What TensorBoard shows of a run, against what the run did (QA session 78).

HParams' ``precision`` column: the config's "tf32" on a CPU run, which computes in IEEE fp32 there (the start line, its
warning and summary.json's ``resolved.precision`` say fp32), read "tf32": such a run was told apart from fp32 runs that
trained exactly alike, in the run's own session, in summary.json's ``sessions`` and in a sweep setting's session.

HParams had no column for the run's length: a 60-step run's AUC stood beside a 1406-step run's as that of the same
settings (the README's first command beside a --compare of it at --max-steps 60).

HParams had no column for the kernels or torch.compile a run trained with: the runs of a ``--compare``, one a variant
(eager, compiled, triton, triton+compiled), were sessions of the same values, told apart by their names alone."""

from __future__ import annotations

import json

import pytest

from dlrm.config import Config, load_config, validate
from dlrm.data import synthetic
from dlrm.sweep_report import _setting_hparams
from dlrm.sweep_results import SettingResult
from dlrm.train.compare import KERNEL_SETS, VARIANTS, variant_config
from dlrm.train.reporting import session_hparams
from dlrm.train.trainer import train
from tests.conftest import REPO
from tests.test_tensorboard_summaries import hparams_session_groups


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("tb78") / "data"
    synthetic.generate(out, 160, seed=3, cardinalities="tiny", validation_fraction=0.2, test_fraction=0.0)
    return out


@pytest.fixture(scope="module")
def tf32_run(dataset, tmp_path_factory):
    tb = tmp_path_factory.mktemp("tb78runs")
    return tb, train(_run(dataset, tb, "tf32"))


def _run(dataset, tb, name, **overrides):
    return load_config(REPO / "configs" / "sample.json", {
        "data.path": str(dataset), "data.batch_size": 32, "train.device": "cpu", "train.precision": "tf32",
        "train.max_steps": 2, "train.log_every": 1, "train.eval_every": None, "train.baseline": False,
        "optim.schedule.warmup_steps": 0, "optim.schedule.decay": "none", "log.tb_dir": str(tb),
        "log.run_name": name, **overrides})


def test_runs_of_other_lengths_are_sessions_of_other_steps_a_resumed_one_its_new_length(dataset, tf32_run):
    tb, _ = tf32_run
    train(_run(dataset, tb, "longer", **{"train.max_steps": 3}))
    groups = {g["name"]: g["hparams"] for g in hparams_session_groups(tb)}
    assert (groups["tf32"]["steps"], groups["longer"]["steps"]) == (2, 3)
    train(_run(dataset, tb, "longer", **{"train.max_steps": 4}), resume="latest")
    groups = {g["name"]: g["hparams"] for g in hparams_session_groups(tb)}
    assert groups["longer"]["steps"] == 4


def test_a_tf32_run_on_the_cpu_is_an_fp32_session_in_hparams(tf32_run):
    tb, summary = tf32_run
    assert summary["config"]["train"]["precision"] == "tf32" and summary["resolved"]["precision"] == "fp32"
    group = next(g for g in hparams_session_groups(tb) if g["name"] == "tf32")
    assert group["hparams"]["precision"] == "fp32"
    # the kernels and compile it trained with ("auto" resolved on the CPU: PyTorch's, eager)
    assert (group["hparams"]["kernels"], group["hparams"]["compile"]) == ("torch", "off")
    # summary.json's record of the session says it alike
    (session,) = json.loads((tb / "tf32" / "summary.json").read_text())["sessions"]
    assert (session["hparams"]["precision"], session["hparams"]["kernels"], session["hparams"]["compile"]) == \
        ("fp32", "torch", "off")


def test_a_sweep_settings_session_names_the_precision_its_trials_computed_in(tf32_run):
    _, summary = tf32_run
    hp, _ = _setting_hparams(SettingResult(0, {"optim.dense.lr": summary["config"]["optim"]["dense"]["lr"]},
                                           [summary]))
    assert (hp["precision"], hp["kernels"], hp["compile"]) == ("fp32", "torch", "off")


@pytest.mark.parametrize("variants", [("eager", "compiled-default", "triton", "triton+compiled"),
                                      ("compiled+step-graph", "triton-embedding+step-graph",
                                       "triton-embedding-interaction+step-graph", "triton-wgrad+step-graph",
                                       "triton-embedding-interaction+compiled", "triton-embedding+autotune+step-graph")])
def test_the_variants_of_a_comparison_are_sessions_of_other_kernels_or_compile(variants):
    """Each variant's session, with what it trained (summary.json's ``resolved`` on a CUDA device), names its kernels
    and compile settings: no two variants of other kernels or compile are the same HParams values."""
    parts = ("embedding", "interaction", "mlp", "loss")
    shown = {}
    for name in variants:
        kernels, mode, step_graph = VARIANTS[name]
        cfg = variant_config(validate(Config()), name)
        resolved = {"precision": "fp32", "kernels": dict(zip(parts, KERNEL_SETS[kernels])),
                    "compile": mode is not None, "compile_mode": mode, "cuda_graph": step_graph}
        hp = session_hparams(cfg, 32, None, resolved)
        shown[name] = (hp["kernels"], hp["compile"])
    assert len(set(shown.values())) == len(variants), shown
    if "eager" in shown:
        assert shown["eager"] == ("torch", "off") and shown["triton+compiled"] == ("triton", "default")
    else:
        assert shown["triton-embedding+step-graph"] == (
            "embedding=triton, interaction=torch, mlp=torch, loss=torch", "default+step-graph")
