"""--compare variants that cannot run the dataset (multi-hot) or the process group (torchrun), and the benchmark
scripts' argument checks and scaling efficiency base (audit): skipped rows with the reason, one-line errors before
the CUDA check, efficiency against a one-GPU run of the same settings."""

from __future__ import annotations

import torch
import pytest

import dlrm.train.compare as compare
from dlrm.config import load_config
from dlrm.data import synthetic
from dlrm.distributed.env import DistEnv
from tests.conftest import REPO
from tests.test_audit_fast_path_edges import FAKE_SUMMARY

CUDA = torch.device("cuda")
SIZES = [1] * 26
SIZES[0], SIZES[4] = 3, 2


@pytest.fixture(scope="module")
def multi_hot_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp") / "mh"
    synthetic.generate(root, 120, seed=2, cardinalities="tiny", multi_hot_sizes=SIZES, multi_hot_fill="fixed",
                       validation_fraction=0.2, test_fraction=0.0)
    return root


class FakeEnv(DistEnv):
    """Rank 0 of two (torchrun), without a process group: compare only asks is_main, distributed, broadcast."""

    def __init__(self):
        super().__init__(rank=0, world_size=2)

    def broadcast_object(self, obj):
        return obj


def _compare(tmp_path, monkeypatch, variants, device=None, env=None, **overrides):
    """run_comparison (the runner train.py --compare calls) with a fake trainer that records what it was given; with
    `device`/`env`, as init_distributed would give them on a CUDA machine / under torchrun."""
    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                          "log.run_name": "cmp", **overrides})
    if device is not None or env is not None:
        import dlrm.distributed.env

        monkeypatch.setattr(dlrm.distributed.env, "init_distributed", lambda dist, dev: (env or DistEnv(), device or dev))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "fake GPU")
    if env is not None:  # the ranks' agreement on a stop after each variant: no process group (nor CUDA) here
        import contextlib

        import dlrm.train.signals

        monkeypatch.setattr(dlrm.train.signals, "agreed_stop", lambda *a, **k: contextlib.nullcontext())
    trained = {}

    def fake_train(vcfg, run_dir):
        trained[run_dir.name] = vcfg
        run_dir.mkdir(parents=True)
        return dict(FAKE_SUMMARY)

    rows = compare.run_comparison(cfg, variants, fake_train)
    return {r["variant"]: r["status"] for r in rows}, trained


# -- (a) --compare on multi-hot data / under torchrun ------------------------------------------------------------------

MULTI_HOT_SKIP = "skipped: the dataset is multi-hot: the torch multi-hot embedding (EmbeddingBag)"


def test_compare_skips_the_torch_step_graph_variant_of_multi_hot_data_on_cuda(tmp_path, monkeypatch, multi_hot_data):
    """On a GPU, compiled+step-graph of a multi-hot dataset (sizes from its metadata.json, the config has none) passed
    unavailable_reason and was built: build_run refused the EmbeddingBag's capture (a "failed" row and a non-zero
    exit for the whole comparison). It cannot run that data anywhere: a skipped row, and the others still run."""
    status, trained = _compare(tmp_path, monkeypatch, ["eager", "compiled", "compiled+step-graph"], device=CUDA,
                               **{"data.path": str(multi_hot_data)})
    assert status["compiled+step-graph"].startswith(MULTI_HOT_SKIP), status
    assert "\n" not in status["compiled+step-graph"]
    assert status["eager"] == status["compiled"] == "ok" and set(trained) == {"eager", "compiled"}


def test_the_multi_hot_reason_comes_first_so_it_is_given_on_the_cpu_too(tmp_path, monkeypatch, multi_hot_data):
    """The reason that holds on every device is the row's reason (it said "CUDA graphs need a CUDA device" here,
    which suggested a GPU would run it)."""
    status, trained = _compare(tmp_path, monkeypatch, ["eager", "compiled+step-graph"],
                               **{"data.path": str(multi_hot_data)})
    assert status["compiled+step-graph"].startswith(MULTI_HOT_SKIP), status
    assert set(trained) == {"eager"}


def test_only_the_torch_embedding_step_graph_is_refused_multi_hot_data():
    """The Triton pooled embedding is captured (tests/test_multihot_graphed.py); one-hot data keep every variant."""
    cfg = load_config(REPO / "configs" / "sample.json")
    for name, (kernels, _, step_graph) in compare.VARIANTS.items():
        torch_step_graph = step_graph is True and compare.KERNEL_SETS[kernels][0] == "torch"
        assert (compare.data_reason(name, multi_hot=True) is not None) == torch_step_graph, name
        assert compare.data_reason(name, multi_hot=False) is None
    assert compare.unavailable_reason("compiled+step-graph", CUDA, cfg, multi_hot=False) is None


def test_compare_under_torchrun_skips_the_torch_step_graph_variant(tmp_path, monkeypatch):
    """Under torchrun on GPUs the captured step of the sharded torch embedding is refused when built
    (dlrm.train.graphed_step), and any failure there ends the whole comparison: the variants after it never ran and
    no report was written. Now a skipped row."""
    status, trained = _compare(tmp_path, monkeypatch, ["compiled+step-graph", "eager"], device=CUDA, env=FakeEnv())
    assert status["compiled+step-graph"].startswith("skipped: several processes with the torch embedding"), status
    assert status["eager"] == "ok" and set(trained) == {"eager"}



def test_compare_of_variants_that_all_are_skipped_is_an_error_not_an_empty_report(tmp_path, monkeypatch):
    """`--compare compiled+step-graph,triton+cudagraphs` on the CPU trained nothing, wrote a report of two skipped rows
    into a new run directory (its name then taken) and exited 0. Now a one-line error naming each reason (exit 2 from
    dlrm.cli), and no directory is left."""
    from dlrm.config import ConfigError

    with pytest.raises(ConfigError) as e:
        _compare(tmp_path, monkeypatch, ["compiled+step-graph", "triton+cudagraphs"])
    msg = str(e.value)
    assert msg.startswith("--compare: no variant can run here (compiled+step-graph: CUDA graphs need a CUDA device; "
                          "triton+cudagraphs: "), msg
    assert "\n" not in msg and not (tmp_path / "tb" / "cmp").exists()

# -- (b) the profiling / scaling scripts check their options and config before the CUDA check -------------------------

from tests.test_benchmark_scripts import load_script  # noqa: E402  (by path: benchmarks/kernels.py shadows `kernels`)

SCRIPTS = ["step_ops", "step_profile", "step_clocks", "scaling"]
ENV = {"device": "fake GPU", "torch": "t", "triton": "x", "date": "2026-11-30 12:00", "cuda": "c", "python": "p"}


def _refused(capsys, monkeypatch, script, argv) -> str:
    """`script`'s main(argv) on a machine with a (faked) CUDA device: expect argparse's exit 2 before anything was
    built or measured, return its error line."""
    mod = load_script(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if hasattr(mod, "environment"):
        monkeypatch.setattr(mod, "environment", lambda device: dict(ENV))
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "error: " in lines[-1] and not any("Traceback" in line for line in lines), lines
    return lines[-1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_missing_config_is_one_argparse_line_before_the_cuda_check(tmp_path, capsys, monkeypatch, script):
    """On a GPU (the CUDA check passed) these scripts loaded the config after setting up the device: a missing file
    was a ConfigError traceback; on the CPU the CUDA check's line hid it (scaling.py, which runs on the CPU too,
    gave the traceback there)."""
    missing = tmp_path / "nope.json"
    err = _refused(capsys, monkeypatch, script, ["--config", str(missing), "--out", str(tmp_path / "out")])
    assert str(missing) in err and "not found" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, argv, says", [
    ("step_profile", ["--config", "configs/kaggle.json", "--precision", "fp16"], "train.precision: 'fp16'"),
    ("step_profile", ["--config", "configs/kaggle.json", "--steps", "0"], "--steps: 0 must be > 0"),
    ("step_ops", ["--config", "configs/kaggle.json", "--batch-size", "0"], "data.batch_size"),
    ("step_ops", ["--config", "configs/sample.json"], "configs/sample.json: model.cardinalities: needed"),
    ("step_clocks", ["--config", "configs/kaggle.json", "--max-rows", "-5"], "data.max_rows_per_table"),
])
def test_bad_values_are_one_argparse_line_before_anything_is_built(tmp_path, capsys, monkeypatch, script, argv, says):
    """A value the config refuses (a precision, a batch of 0, a negative cap), a zero step count or a config without
    table sizes: each surfaced on a GPU only, as a traceback once the run was being built or measured."""
    mod = load_script(script)
    for name in ("profile_step", "profile_ops", "build_run", "synthetic_batches"):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("built or measured before the checks"))
    err = _refused(capsys, monkeypatch, script, [*argv, "--out", str(tmp_path / "out")])
    assert says in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--windows", "--steps", "--batch-per-gpu"])
def test_scaling_refuses_zero_counts_before_measuring(tmp_path, capsys, flag):
    """scaling.py --windows 0 measured, then died on statistics.median([]); --steps 0 and --batch-per-gpu 0 on a
    division by a zero rate (and a batch of 0 rows was never checked): tracebacks after the launch's work."""
    sc = load_script("scaling")
    with pytest.raises(SystemExit) as e:
        sc.main(["--config", "configs/sample.json", "--precision", "fp32", "--batch-per-gpu", "8", "--warmup", "0",
                 "--steps", "1", "--windows", "1", flag, "0", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert f"{flag}: 0 must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_checks_let_a_good_config_through_to_the_cuda_check(capsys, monkeypatch):
    """Without CUDA a valid command still ends at the CUDA check (the checks added before it refuse nothing valid)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for script in ("step_ops", "step_profile", "step_clocks"):
        with pytest.raises(SystemExit) as e:
            load_script(script).main(["--config", "configs/mlperf-dcnv2.json", "--variant", "auto"])
        assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


# -- (c) scaling efficiency against a one-GPU run of the same settings -------------------------------------------------


def test_scaling_efficiency_base_has_the_same_whole_step_graph():
    """results/scaling_kaggle.csv: a 2-GPU run without the whole-step graph was divided by the 1-GPU run with it,
    "efficiency" 0.20 that measured the graph's absence. The base now has the same graph setting (rows read back from
    the CSV hold "True"/"False", a new row a bool); without such a 1-GPU row the efficiency is n/a."""
    sc = load_script("scaling")

    def row(gpus, rate, date, graph):
        return {"gpus": gpus, "config": "k.json", "precision": "tf32", "sharding": "none" if gpus == 1 else "auto",
                "batch_per_gpu": 64, "device": "H", "cuda_graph": graph, "samples_per_sec": rate, "step_ms": 1.0,
                "date": date}

    rows = [row(1, 100.0, "2026-11-28 09:10", "True"), row(2, 40.0, "2026-11-28 09:11", False),
            row(2, 150.0, "2026-11-28 09:11", True), row(1, 50.0, "2026-11-28 10:00", "False")]
    sc.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.4, 0.75, 1.0]
    alone = rows[:3]  # no 1-GPU run without the graph: n/a, not 0.20
    sc.add_efficiency(alone)
    assert [r["efficiency"] for r in alone] == [1.0, "", 0.75]
    table = sc.markdown_table(alone)
    assert "efficiency (vs 1 GPU, same graph)" in table[0] and table[3].split("|")[12].strip() == "n/a"


def test_the_throughput_benchmarks_skip_the_torch_step_graph_of_multi_hot_batches():
    """benchmarks/train_throughput.py and mlperf_dcnv2.py build multi-hot batches from a multi-hot config: the
    torch-embedding step graph is skipped with the multi-hot reason (it was built and failed on a GPU), and a one-hot
    config keeps its other reason on the CPU."""
    tt = load_script("train_throughput")
    mh = load_config(REPO / "configs" / "mlperf-dcnv2.json", {"model.embedding_dtype": "fp32"})
    row = tt.run_case(mh, "compiled+step-graph", "fp32", 8, torch.device("cpu"), None)
    assert row["status"].startswith("skipped: the dataset is multi-hot"), row
    one_hot = load_config(REPO / "configs" / "sample.json")
    row = tt.run_case(one_hot, "compiled+step-graph", "fp32", 8, torch.device("cpu"), None)
    assert row["status"] == "skipped: CUDA graphs need a CUDA device", row
