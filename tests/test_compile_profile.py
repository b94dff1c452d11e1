"""torch.compile runs, profiler traces with named ranges, and --compare reports (CPU)."""

import csv
import gzip
import json

import pytest
import torch

from dlrm.config import load_config
from dlrm.train.compare import run_comparison
from dlrm.train.profiling import trace_files
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)

RANGES = ["data", "SparseArch", "DenseArch", "InteractionArch", "OverArch", "loss", "backward", "optimizer"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp") / "ds"
    make_dataset(root, {"train": 400, "validation": 70}, row_group_size=100)
    return root


def small_config(dataset, tmp_path, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tmp_path / "tb"), "data.batch_size": 32,
            "train.max_steps": 12, "train.log_every": 4, "train.device": "cpu"}
    return load_config(REPO / "configs" / "sample.json", {**base, **overrides})


def test_profiled_run_writes_trace_with_named_ranges(dataset, tmp_path):
    cfg = small_config(dataset, tmp_path, **{"profile.enabled": True, "profile.wait": 1, "profile.warmup": 1,
                                             "profile.active": 2, "log.run_name": "prof"})
    train(cfg)
    run_dir = tmp_path / "tb" / "prof"
    (trace,) = trace_files(run_dir)
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    for r in RANGES:
        assert r in names, r
    profiler_steps = [n for n in names if n and n.startswith("ProfilerStep#")]
    assert len(profiler_steps) == 2
    # the run's own summary of that trace (dlrm.train.reporting.log_profile), and no <run>/hparams run
    assert "| backward |" in (run_dir / "profile_step.md").read_text()
    assert (run_dir / "profile_timeline.png").stat().st_size > 0
    assert not (run_dir / "hparams").exists()
    pytest.importorskip("torch_tb_profiler")  # the TensorBoard plugin's own loader parses it too
    from torch_tb_profiler.io.cache import Cache
    from torch_tb_profiler.profiler.loader import RunLoader

    run = RunLoader("prof", str(run_dir), Cache(str(tmp_path / "cache"))).load()
    assert run is not None and run.get_profiles()
    assert [v.display_name for v in run.views][:3] == ["Overview", "Operator", "Trace"]


def test_compiled_run_matches_eager_with_no_graph_breaks(dataset, tmp_path):
    # graphs an earlier test compiled from the same code would be reused, not counted
    torch._dynamo.reset()
    eager = train(small_config(dataset, tmp_path, **{"log.run_name": "eager"}))
    compiled = train(small_config(dataset, tmp_path, **{"log.run_name": "compiled", "train.compile.enabled": True,
                                                        "train.compile.fullgraph": True}))
    assert compiled["compile"]["graph_breaks"] == 0
    assert compiled["compile"]["graphs"] == 2  # one training graph, one evaluation graph: nothing recompiled
    assert compiled["warmup_s"] > 0 and compiled["samples_per_sec"] > 0
    for (s1, l1), (s2, l2) in zip(eager["train_losses"], compiled["train_losses"]):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-5)
    assert compiled["auc"] == pytest.approx(eager["auc"], abs=1e-4)
    state = __import__("torch").load(compiled["checkpoint"], weights_only=False)
    assert not any("_orig_mod" in k for k in state["model"])


def test_compare_writes_reports_with_one_row_per_variant(dataset, tmp_path):
    cfg = small_config(dataset, tmp_path, **{"log.run_name": "cmp"})
    rows = run_comparison(cfg, ["eager", "compiled", "auto"], train)
    base = tmp_path / "tb" / "cmp"
    for name in ("compare.md", "compare.csv", "compare.png"):
        assert (base / name).stat().st_size > 0
    with open(base / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["variant"] for r in table] == ["eager", "compiled", "auto"] == [r["variant"] for r in rows]
    assert float(table[0]["max_loss_diff_vs_eager"]) == 0.0
    assert float(table[1]["max_loss_diff_vs_eager"]) < 1e-4
    assert float(table[2]["max_loss_diff_vs_eager"]) == 0.0  # on the CPU "auto" is eager PyTorch: the same steps
    # graph breaks are counted for the compiled run only ("auto" resolved to eager has none to count: n/a)
    assert [r["graph_breaks"] for r in table] == ["", table[1]["graph_breaks"], ""] and int(table[1]["graph_breaks"]) >= 0
    assert all(float(r["samples_per_sec"]) > 0 for r in table)
    assert (base / "eager" / "summary.json").exists() and (base / "compiled" / "summary.json").exists()
    # each variant trained as named: the compiled one through Dynamo, the others eagerly (identical losses alone
    # would not tell a "compiled" row that ran eagerly)
    summaries = {v: json.loads((base / v / "summary.json").read_text()) for v in ("eager", "compiled", "auto")}
    assert summaries["compiled"]["compile"]["graphs"] >= 1 and summaries["compiled"]["resolved"]["compile"] is True
    assert summaries["eager"]["compile"]["graphs"] == summaries["auto"]["compile"]["graphs"] == 0
    md = (base / "compare.md").read_text()
    assert "| eager |" in md and "| compiled |" in md


@pytest.mark.parametrize(
    "name, kernels, mode",
    [
        ("eager", ("torch",) * 4, None),
        ("compiled", ("torch",) * 4, "auto"),
        ("compiled-default", ("torch",) * 4, "default"),
        ("compiled-cudagraphs", ("torch",) * 4, "reduce-overhead"),
        ("triton+compiled", ("triton",) * 4, "default"),
        ("triton-embedding+cudagraphs", ("triton", "torch", "torch", "torch"), "reduce-overhead"),
        ("triton-embedding-interaction+cudagraphs", ("triton", "triton", "torch", "torch"), "reduce-overhead"),
    ],
)
def test_variant_config_sets_kernels_and_compile_mode(name, kernels, mode):
    from dlrm.train.compare import variant_config

    cfg = variant_config(load_config(REPO / "configs" / "sample.json"), name)
    k = cfg.kernels
    assert (k.embedding, k.interaction, k.mlp, k.loss) == kernels
    assert cfg.train.compile.enabled == (mode is not None)
    if mode:
        assert cfg.train.compile.mode == mode


def test_the_gluon_fused_mlp_variant_is_a_valid_dcn_configuration():
    from dlrm.config import validate
    from dlrm.train.compare import variant_config

    cfg = variant_config(load_config(REPO / "configs" / "mlperf-dcnv2.json"),
                         "triton-embedding-gluon-cross-fused-mlp+step-graph")
    k = cfg.kernels
    assert (k.embedding, k.interaction, k.mlp, k.loss) == ("triton", "gluon", "fused", "torch")
    assert cfg.train.cuda_graph is True and cfg.train.compile.mode == "default"
    validate(cfg)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("config, overrides", [
    ("sample.json", {}),
    ("kaggle.json", {"data.batch_size": 65536, "train.precision": "bf16"}),
    ("terabyte.json", {}),
    # explicit settings in the user's config give way to the defaults in the "auto" variant
    ("sample.json", {"kernels.embedding": "torch", "train.compile": {"enabled": False, "combo_kernels": True},
                     "train.cuda_graph": False}),
])
def test_the_auto_variant_is_what_the_defaults_resolve_to(config, overrides, device):
    """`--compare eager,auto`: the "auto" variant trains what train.py picks with no explicit kernel, compile or
    step-graph setting, on the run's device (dlrm.train.fast_path)."""
    import torch

    from dlrm.train.compare import unavailable_reason, variant_config
    from dlrm.train.fast_path import resolve_fast_path

    dev = torch.device(device)
    explicit = {k: v for k, v in overrides.items() if k.startswith(("data.", "train.precision"))}
    defaults, _ = resolve_fast_path(load_config(REPO / "configs" / config, explicit), dev)
    auto, chosen = resolve_fast_path(variant_config(load_config(REPO / "configs" / config, overrides), "auto"), dev)
    assert auto.kernels == defaults.kernels and auto.train.compile == defaults.train.compile
    assert auto.train.cuda_graph == defaults.train.cuda_graph and auto.optim == defaults.optim
    assert {"kernels.embedding", "kernels.mlp", "train.compile", "train.cuda_graph"} <= set(chosen)
    assert unavailable_reason("auto", dev) is None  # it needs nothing: on the CPU it is eager PyTorch


@pytest.mark.parametrize("config, precision, batch, fastest", [
    # the fastest named variant measured at each size on the H100 (results/autopick.md, wgrad_threshold.md)
    ("kaggle.json", "tf32", 128, "triton-embedding-interaction+step-graph"),
    ("kaggle.json", "bf16", 2048, "triton-embedding-interaction+step-graph"),
    ("kaggle.json", "tf32", 2048, "triton-embedding-interaction+step-graph"),
    ("kaggle.json", "bf16", 8192, "triton-wgrad+step-graph"),
    ("kaggle.json", "bf16", 65536, "triton-wgrad+step-graph"),
    ("kaggle.json", "tf32", 65536, "triton-fused-mlp+step-graph"),
    ("terabyte.json", "bf16", 2048, "triton-embedding-interaction+step-graph"),
    ("terabyte.json", "tf32", 2048, "triton-embedding-interaction+step-graph"),
    ("terabyte.json", "bf16", 32768, "triton-wgrad+step-graph"),
    ("terabyte.json", "bf16", 65536, "triton-wgrad+step-graph"),
    ("terabyte.json", "tf32", 65536, "triton-fused-mlp+step-graph"),
])
def test_the_auto_variant_on_cuda_is_the_fastest_measured_one(config, precision, batch, fastest):
    """On CUDA, "auto" resolves to exactly the named variant that measured fastest there (same kernels, compile mode,
    combo kernels and step graph), so the defaults are the fastest variant of each throughput table."""
    import torch

    from dlrm.train.compare import variant_config
    from dlrm.train.fast_path import resolve_fast_path

    cfg = load_config(REPO / "configs" / config, {"train.precision": precision, "data.batch_size": batch})
    cuda = torch.device("cuda")
    auto, _ = resolve_fast_path(variant_config(cfg, "auto"), cuda, total_steps=1000)
    named, _ = resolve_fast_path(variant_config(cfg, fastest), cuda, total_steps=1000)
    assert (auto.kernels, auto.train.compile, auto.train.cuda_graph) == (
        named.kernels, named.train.compile, named.train.cuda_graph)


def test_unknown_variant_is_named_in_the_error():
    from dlrm.config import ConfigError
    from dlrm.train.compare import parse_variants

    with pytest.raises(ConfigError, match="'fastest'"):
        parse_variants("eager,fastest")


def test_compare_frees_each_variant_before_the_next(tmp_path):
    """What a finished variant left in reference cycles (on a GPU: a captured step and its CUDA graph
    pool, or a model and its tables) is collected before the next variant builds its own."""
    import gc
    import weakref

    from dlrm.train.compare import run_comparison

    class Holder:  # stands for a model that a finished run still reaches through a reference cycle
        pass

    left_behind: list[weakref.ref] = []
    alive_at_start: list[bool] = []

    def fake_train(cfg, run_dir):
        alive_at_start.append(any(r() is not None for r in left_behind))
        h = Holder()
        h.cycle = h
        left_behind.append(weakref.ref(h))
        del h
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"samples_per_sec": 1.0, "warmup_s": 0.0, "peak_memory_bytes": None, "final_train_loss": 0.5,
                "auc": 0.5, "compile": {"graph_breaks": 0}, "train_losses": [(1, 0.5)],
                "resolved": {"compile": bool(cfg.train.compile.enabled)}}

    gc.disable()  # only the comparison's own collection may free the cycle
    try:
        cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu"})
        run_comparison(cfg, ["eager", "compiled"], fake_train)
    finally:
        gc.enable()
    assert alive_at_start == [False, False]
    assert all(r() is None for r in left_behind)


def test_a_run_shorter_than_the_profiler_cycle_is_told_at_the_start(tmp_path):
    from loguru import logger

    from dlrm.config import ProfileConfig
    from dlrm.train.profiling import make_profiler

    seen: list[str] = []
    handle = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        cfg = ProfileConfig(enabled=True, wait=5, warmup=3, active=5)
        make_profiler(cfg, tmp_path, torch.device("cpu"), steps=12)
        assert len(seen) == 1 and "trains 12 step(s), fewer than the profiler's first cycle" in seen[0]
        assert "= 13" in seen[0] and "its trace will hold only 4 of the 5 active step(s)" in seen[0]
        make_profiler(cfg, tmp_path, torch.device("cpu"), steps=13)  # one whole cycle: a trace, nothing to say
        make_profiler(ProfileConfig(enabled=False), tmp_path, torch.device("cpu"), steps=1)
        assert len(seen) == 1
    finally:
        logger.remove(handle)


def test_profiler_notices_are_said_once_in_the_runs_words_not_as_torch_warnings(tmp_path):
    """profile.warmup 0 is told through the run's log, not torch's bare UserWarning; a second cycle (repeat 2) writes
    its own trace, so torch's warning that it clears the first cycle's events is not printed."""
    import warnings

    from loguru import logger

    from dlrm.config import ProfileConfig
    from dlrm.train.profiling import make_profiler, trace_files

    seen: list[str] = []
    handle = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = ProfileConfig(enabled=True, wait=0, warmup=0, active=1, repeat=2)
            with make_profiler(cfg, tmp_path, torch.device("cpu"), steps=3) as prof:
                for _ in range(3):
                    torch.ones(4).sum()
                    prof.step()
    finally:
        logger.remove(handle)
    assert [str(w.message) for w in caught if "rofiler" in str(w.message)] == []
    assert len(seen) == 1 and "profile.warmup 0: the first recorded step also holds the profiler's own" in seen[0]
    assert len(trace_files(tmp_path)) == 2
