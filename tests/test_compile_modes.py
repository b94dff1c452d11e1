"""train.compile.mode "auto": torch.compile's reduce-overhead mode where the whole-step graph is off
(dlrm.train.fast_path), and what it must keep: the same training as mode default (issue #19).

The resolution rules are checked everywhere; the CUDA-graph runs need CUDA (tests marked `gpu`).
"""

from __future__ import annotations

import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm.train.compare import variant_config
from dlrm.train.fast_path import resolve_fast_path
from tests.test_graphed_step import SAMPLE, batches, make_run, train

CUDA = torch.device("cuda")  # resolution only looks at the device type


def resolved_mode(overrides: dict, device: torch.device = CUDA, **kw) -> tuple[str, str]:
    resolved, chosen = resolve_fast_path(load_config(SAMPLE, overrides), device, **kw)
    why = chosen.get("train.compile.mode", {}).get("why", "")
    return resolved.train.compile.mode, why


def test_auto_is_reduce_overhead_where_the_step_graph_is_off():
    assert resolved_mode({"train.compile": True, "train.cuda_graph": False}) == (
        "reduce-overhead", "without the whole-step graph, mode default is host-bound at small batches")
    assert resolved_mode({"train.compile": True, "optim.dense.name": "adagrad", "train.cuda_graph": False})[0] == (
        "reduce-overhead")


@pytest.mark.parametrize("overrides, kw, mode, why", [
    ({"train.compile": True}, {}, "default", "the whole step is one CUDA graph already"),
    ({"train.compile": True, "train.cuda_graph": False}, {"distributed": True}, "default", "several processes"),
    ({"train.compile": True, "train.cuda_graph": False}, {"multi_hot": True}, "default", "multi-hot tables"),
    ({"train.compile": {"enabled": True, "mode": "max-autotune"}, "train.cuda_graph": False}, {}, "max-autotune", ""),
    ({"train.compile": {"enabled": True, "mode": "max-autotune-no-cudagraphs"}}, {}, "max-autotune-no-cudagraphs", ""),
    ({"train.compile": {"enabled": True, "mode": "max-autotune-gemm"}}, {}, "max-autotune-gemm", ""),
])
def test_auto_keeps_mode_default_elsewhere_and_explicit_modes_win(overrides, kw, mode, why):
    got, reason = resolved_mode(overrides, **kw)
    assert got == mode and why in reason


def test_on_the_cpu_auto_is_mode_default():
    assert resolved_mode({"train.compile": True}, torch.device("cpu"))[0] == "default"
    resolved, chosen = resolve_fast_path(load_config(SAMPLE), torch.device("cpu"))
    assert resolved.train.compile.mode == "default" and "train.compile.mode" not in chosen  # eager: not logged


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_modes_with_cuda_graphs_of_their_own_refuse_the_step_graph(mode):
    """max-autotune makes torch.compile's own CUDA graphs as reduce-overhead does: with train.cuda_graph true a
    one-line ConfigError names both keys; "auto" leaves the step graph off for them (and says why)."""

    # both keys given as overrides (train.py's options): the error names them as the command line's
    with pytest.raises(ConfigError, match=rf'^command line: train\.cuda_graph: .*train\.compile\.mode "{mode}"'):
        load_config(SAMPLE, {"train.compile": {"enabled": True, "mode": mode}, "train.cuda_graph": True})
    resolved, chosen = resolve_fast_path(load_config(SAMPLE, {"train.compile": {"enabled": True, "mode": mode}}), CUDA)
    assert resolved.train.cuda_graph is False and mode in chosen["train.cuda_graph"]["why"]


def test_the_autotune_variants_capture_the_step_with_max_autotune_without_its_graphs():
    for name in ("triton-embedding+autotune+step-graph", "triton-embedding-interaction+autotune+step-graph"):
        cfg = variant_config(load_config(SAMPLE), name)
        assert cfg.train.compile.enabled and cfg.train.compile.mode == "max-autotune-no-cudagraphs"
        assert cfg.train.cuda_graph is True
        resolved, _ = resolve_fast_path(cfg, CUDA)
        assert resolved.train.cuda_graph is True and resolved.train.compile.mode == "max-autotune-no-cudagraphs"


@pytest.mark.parametrize("name", ["triton-embedding+autotune-gemm+step-graph",
                                  "triton-embedding-interaction+autotune-gemm+step-graph"])
def test_the_autotune_gemm_variants_keep_the_step_graph_and_pytorch_mlps(name):
    cfg = variant_config(load_config(SAMPLE, {"data.batch_size": 65536, "train.precision": "tf32"}), name)
    resolved, _ = resolve_fast_path(cfg, CUDA)
    assert resolved.train.cuda_graph is True and resolved.train.compile.mode == "max-autotune-gemm"
    assert resolved.kernels.mlp == "torch"


def test_kernels_mlp_auto_leaves_the_mlps_to_the_templates_of_max_autotune_gemm():
    """tf32 at 65536 takes the fused MLP in mode default; under GEMM templates (which fuse the epilogues) not."""
    base = {"data.batch_size": 65536, "train.precision": "tf32"}
    assert resolve_fast_path(load_config(SAMPLE, base), CUDA)[0].kernels.mlp == "fused"
    resolved, chosen = resolve_fast_path(
        load_config(SAMPLE, {**base, "train.compile": {"enabled": True, "mode": "max-autotune-gemm"}}), CUDA)
    assert resolved.kernels.mlp == "torch" and "templates" in chosen["kernels.mlp"]["why"]


def test_max_autotune_gemm_compiles_with_inductors_gemm_option_alone(monkeypatch):
    """It is no torch.compile mode: the step is compiled with options {"max_autotune_gemm": True}, no mode."""
    from dlrm.config import CompileConfig
    from dlrm.train import step

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    fn = lambda x: x  # noqa: E731
    for mode in ("max-autotune-gemm", "max-autotune-no-cudagraphs", "auto"):
        assert step._maybe_compile(fn, CompileConfig(enabled=True, mode=mode), CUDA, "the step") is fn
    assert calls == [{"options": {"max_autotune_gemm": True}, "fullgraph": False},
                     {"mode": "max-autotune-no-cudagraphs", "fullgraph": False},
                     {"mode": "default", "fullgraph": False}]


@pytest.mark.parametrize("overrides, kw, on, why", [
    ({"train.precision": "bf16"}, {}, True, "one launch"),
    ({"train.precision": "bf16", "data.batch_size": 65535}, {}, True, "one launch"),
    ({"train.precision": "bf16", "data.batch_size": 65536}, {}, False, "from batch 65536"),
    ({"train.precision": "tf32"}, {}, False, "the same in tf32"),
    ({"train.precision": "fp32"}, {}, False, "bf16 only"),
    ({"train.precision": "bf16"}, {"multi_hot": True}, False, "one-hot dot models and multi-hot DCN models only"),
    ({"train.precision": "bf16"}, {"distributed": True}, False, "one process"),
    ({"train.precision": "bf16", "model.interaction": "dcn"}, {}, False, "one-hot dot models and multi-hot DCN"),
    # MLPerf DLRM-DCNv2's family: multi-hot DCN, on up to batch 65536 (measured there), not past it or on ranks
    ({"train.precision": "bf16", "model.interaction": "dcn", "data.batch_size": 65536}, {"multi_hot": True}, True,
     "MLPerf DLRM-DCNv2"),
    ({"train.precision": "bf16", "model.interaction": "dcn", "data.batch_size": 2048}, {"multi_hot": True}, True,
     "MLPerf DLRM-DCNv2"),
    ({"train.precision": "bf16", "model.interaction": "dcn", "data.batch_size": 65537}, {"multi_hot": True}, False,
     "up to batch 65536"),
    ({"train.precision": "bf16", "model.interaction": "dcn"}, {"multi_hot": True, "distributed": True}, False,
     "one process"),
    ({"train.precision": "tf32", "model.interaction": "dcn"}, {"multi_hot": True}, False, "the same in tf32"),
    # deterministic runs: Inductor's deterministic mode (torch.use_deterministic_algorithms) refuses to time combos
    ({"train.precision": "bf16", "train.deterministic": True}, {}, False, "train.deterministic"),
    ({"train.precision": "bf16", "model.interaction": "dcn", "train.deterministic": True}, {"multi_hot": True}, False,
     "train.deterministic"),
])
def test_combo_kernels_auto_is_on_where_measured_faster(overrides, kw, on, why):
    """train.compile.combo_kernels "auto": Inductor's combo kernels for compiled bf16 one-hot dot models on one CUDA
    process below batch 65536 (measured +1.5% to +11.5%) and multi-hot DCN models up to 65536 (MLPerf DLRM-DCNv2:
    -0.45% a step at 65536), off elsewhere with the reason logged."""
    resolved, chosen = resolve_fast_path(load_config(SAMPLE, {"train.compile": True, **overrides}), CUDA, **kw)
    assert resolved.train.compile.combo_kernels is on
    assert chosen["train.compile.combo_kernels"]["value"] is on and why in chosen["train.compile.combo_kernels"]["why"]


def test_combo_kernels_explicit_settings_win_and_eager_runs_log_nothing():
    for value in (True, False):
        cfg = load_config(SAMPLE, {"train.compile": {"enabled": True, "combo_kernels": value}, "train.precision": "tf32"})
        resolved, chosen = resolve_fast_path(cfg, CUDA)
        assert resolved.train.compile.combo_kernels is value and "train.compile.combo_kernels" not in chosen
    resolved, chosen = resolve_fast_path(load_config(SAMPLE, {"train.precision": "bf16"}), torch.device("cpu"))
    assert resolved.train.compile.enabled is False and resolved.train.compile.combo_kernels is False
    assert "train.compile.combo_kernels" not in chosen
    assert variant_config(load_config(SAMPLE, {"train.compile": {"combo_kernels": True}}),
                          "triton-embedding-interaction+step-graph").train.compile.combo_kernels is True


def test_combo_kernels_true_with_a_deterministic_run_is_a_config_error():
    """Inductor keeps a combo kernel only where it times faster, and in deterministic mode (which
    torch.use_deterministic_algorithms turns on) it raises instead of timing: refused when the config is read, naming
    both keys, not as an InductorError at the first compiled step."""
    with pytest.raises(ConfigError, match=r"train\.compile\.combo_kernels: true .*train\.deterministic"):
        load_config(SAMPLE, {"train.compile": {"enabled": True, "combo_kernels": True}, "train.deterministic": True})
    cfg = load_config(SAMPLE, {"train.compile": {"enabled": True, "combo_kernels": False}, "train.deterministic": True})
    assert cfg.train.deterministic and cfg.train.compile.combo_kernels is False


def test_each_run_sets_the_deterministic_mode_its_config_asks_for():
    """torch.use_deterministic_algorithms is process-wide and also turns Inductor's deterministic mode on (in which
    combo kernels fail to compile): a run with train.deterministic false turns off what an earlier deterministic run
    in the same process left on."""
    import torch._inductor.config as inductor_config

    from dlrm.train.setup import seed_everything

    seed_everything(0, True)
    assert torch.are_deterministic_algorithms_enabled() and inductor_config.deterministic
    seed_everything(0, False)
    assert not torch.are_deterministic_algorithms_enabled() and not inductor_config.deterministic


def test_combo_kernels_compile_with_the_modes_options(monkeypatch):
    """torch.compile takes a mode or options: with combo kernels on, the mode's own options (list_mode_options) are
    passed with them; on the CPU they are left out with a warning naming the key."""
    from loguru import logger

    from dlrm.config import CompileConfig
    from dlrm.train import step

    calls, warnings = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    combo = {"combo_kernels": True, "benchmark_combo_kernel": True}
    fn = lambda x: x  # noqa: E731
    for mode in ("auto", "default", "max-autotune-no-cudagraphs", "max-autotune-gemm", "reduce-overhead"):
        step._maybe_compile(fn, CompileConfig(enabled=True, mode=mode, combo_kernels=True), CUDA, "the step")
    assert calls == [{"options": combo, "fullgraph": False},
                     {"options": combo, "fullgraph": False},
                     {"options": {"max_autotune": True, "coordinate_descent_tuning": True, **combo}, "fullgraph": False},
                     {"options": {"max_autotune_gemm": True, **combo}, "fullgraph": False},
                     {"options": {"triton.cudagraphs": True, **combo}, "fullgraph": False}]
    calls.clear()
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING")
    try:
        step._maybe_compile(fn, CompileConfig(enabled=True, mode="default", combo_kernels=True), torch.device("cpu"),
                            "the step")
    finally:
        logger.remove(sink)
    assert calls == [{"mode": "default", "fullgraph": False}]
    assert len(warnings) == 1 and "train.compile.combo_kernels" in warnings[0]


def test_the_compiled_variant_takes_the_auto_mode():
    cfg = variant_config(load_config(SAMPLE), "compiled")
    assert cfg.train.compile.mode == "auto" and cfg.train.cuda_graph is False
    assert resolve_fast_path(cfg, CUDA)[0].train.compile.mode == "reduce-overhead"
    assert variant_config(load_config(SAMPLE), "compiled-default").train.compile.mode == "default"


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dense_opt", ["sgd", "adagrad"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_reduce_overhead_trains_like_mode_default(kernels, dense_opt):
    """Same seed, same batches (a partial last batch, an evaluation between steps): mode "auto"
    (reduce-overhead here) gives mode default's losses, evaluation logits and final weights, and
    its CUDA graphs really ran (none skipped). "torch": the PyTorch embedding's row update compiled
    into the backward; "triton": the Triton embedding outside the compiled dense part."""
    from torch._dynamo.utils import counters

    overrides = {"kernels.embedding": kernels, "kernels.interaction": kernels, "train.compile": True,
                 "train.cuda_graph": False, "optim.dense.name": dense_opt, "optim.schedule.warmup_steps": 3}
    data = batches(6, 127, CUDA) + batches(1, 33, CUDA, seed=2)
    held_out = batches(1, 100, CUDA, seed=3)[0]
    results = {}
    for mode in ("default", "auto"):
        torch._dynamo.reset()
        counters.clear()
        cfg = load_config(SAMPLE, {**overrides, "train.compile.mode": mode})
        run = make_run(cfg, CUDA)
        losses = train(run, data[:4])
        first_eval = run.eval_forward(held_out)
        losses += train(run, data[4:])
        results[mode] = (run, losses, first_eval, run.eval_forward(held_out), counters["inductor"]["cudagraph_skips"])
    (plain, a, eval_a1, eval_a2, _), (auto, b, eval_b1, eval_b2, skips) = results["default"], results["auto"]
    assert auto.config.train.compile.mode == "reduce-overhead" and auto.train_step.cudagraphs
    assert skips == 0
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eval_b1, eval_a1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eval_b2, eval_a2, rtol=1e-5, atol=1e-6)
    for (name, x), y in zip(plain.model.state_dict().items(), auto.model.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_max_autotune_gemm_inside_the_step_graph_trains_like_mode_default():
    """train.compile.mode max-autotune-gemm (Inductor's GEMM templates, autotuned) inside the whole-step graph:
    the step is captured, and 6 steps give mode default's losses and weights to fp32-GEMM rounding (the templates
    sum the products in another order than cuBLAS; TF32 off)."""
    overrides = {"train.compile": True, "train.cuda_graph": True, "train.precision": "fp32"}
    data = batches(6, 127, CUDA)
    runs = {}
    for mode in ("default", "max-autotune-gemm"):
        torch._dynamo.reset()
        run = make_run(load_config(SAMPLE, {**overrides, "train.compile.mode": mode}), CUDA)
        runs[mode] = (run, train(run, data))
    (plain, a), (tuned, b) = runs["default"], runs["max-autotune-gemm"]
    assert tuned.config.train.compile.mode == "max-autotune-gemm" and tuned.config.train.cuda_graph is True
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=1e-5)
    for (name, x), y in zip(plain.model.state_dict().items(), tuned.model.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_combo_kernels_inside_the_step_graph_train_like_without():
    """Inductor's combo kernels change which launches run, not the arithmetic: 6 captured steps (fp32, TF32 off)
    give the same losses and weights with and without them, to the reductions' summation order."""
    overrides = {"train.compile": True, "train.cuda_graph": True, "train.precision": "fp32"}
    data = batches(6, 127, CUDA)
    runs = {}
    for combo in (False, True):
        torch._dynamo.reset()
        run = make_run(load_config(SAMPLE, {**overrides, "train.compile.combo_kernels": combo}), CUDA)
        runs[combo] = (run, train(run, data))
    (plain, a), (combined, b) = runs[False], runs[True]
    assert combined.config.train.compile.combo_kernels is True and combined.config.train.cuda_graph is True
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)
    for (name, x), y in zip(plain.model.state_dict().items(), combined.model.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9: the legacy flag only")
def test_matmul_precision_is_readable_by_the_legacy_getter_inductor_calls():
    """set_matmul_precision sets TF32 for CUDA matmuls exactly for "tf32", keeps CPU (oneDNN) matmuls exact, and
    leaves torch.get_float32_matmul_precision() readable: Inductor's max-autotune calls it, and it raised
    after the per-backend API alone had been used (H100, torch 2.11, Kaggle tf32 with max-autotune), also
    when an earlier caller had used that API."""
    from dlrm.train.step import set_matmul_precision

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"  # an earlier caller of the new API alone
        for precision, cuda, legacy in [("tf32", "tf32", "high"), ("fp32", "ieee", "highest"), ("bf16", "ieee", "highest"),
                                        ("tf32", "tf32", "high")]:
            set_matmul_precision(precision)
            assert matmul.fp32_precision == cuda and torch.backends.mkldnn.matmul.fp32_precision == "ieee"
            assert torch.get_float32_matmul_precision() == legacy
            assert matmul.allow_tf32 == (precision == "tf32")
    finally:
        set_matmul_precision("fp32")
        matmul.fp32_precision = before


def test_compile_caches_are_keyed_by_the_custom_ops_sources(monkeypatch, tmp_path):
    """torch.compile's cache key carries a digest of kernels/ and dlrm/model/ (Inductor's caches do not see what
    a custom op's fake implementation returns), after any tag the user set; a changed source changes it."""
    from dlrm.train import step as step_mod

    config = torch.compiler.config
    # torch's own config.patch, not monkeypatch: pytest 9.2's undo deletes an attribute missing from the target's
    # __dict__, and torch's config modules keep their values elsewhere (every later compile in the worker failed:
    # "torch.compiler.config.cache_key_tag does not exist")
    with config.patch(cache_key_tag="users-tag"):
        tag = step_mod.tag_compile_caches()
        digest = step_mod.custom_op_source_digest()
        assert tag == f"users-tag+dlrm-ops-{digest}" == config.cache_key_tag
        assert step_mod.tag_compile_caches() == tag  # idempotent
    # the digest follows the sources: a package with one more file hashes differently
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "op.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: real(name, *a) if name != "kernels" else
                        iu.spec_from_file_location("kernels", pkg / "__init__.py", submodule_search_locations=[str(pkg)]))
    step_mod.custom_op_source_digest.cache_clear()
    first = step_mod.custom_op_source_digest()
    (pkg / "op.py").write_text("X = 2\n")
    step_mod.custom_op_source_digest.cache_clear()
    assert step_mod.custom_op_source_digest() != first
    step_mod.custom_op_source_digest.cache_clear()
