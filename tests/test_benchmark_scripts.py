"""The benchmark scripts' own logic (not their timings): runs built as train.py builds them, trace
summaries, CSV merging and the files each script writes."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ev(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}


def test_trace_timeline_summarizes_the_last_training_step(tmp_path):
    tt = load_script("trace_timeline")
    trace = {"traceEvents": [
        ev("ProfilerStep#1", "user_annotation", 0, 100),
        ev("data", "user_annotation", 0, 5),
        ev("backward", "user_annotation", 10, 30),
        ev("backward", "gpu_user_annotation", 20, 25),
        ev("aten::mm", "cpu_op", 12, 8),
        ev("aten::mm", "cpu_op", 22, 8),
        ev("cudaLaunchKernel", "cuda_runtime", 15, 1),
        ev("gemm", "kernel", 20, 10),
        ev("relu_bwd", "kernel", 40, 5),
        # the tail after training: a step range without a backward, which must not be chosen
        ev("ProfilerStep#2", "user_annotation", 200, 50),
        ev("aten::copy_", "cpu_op", 210, 3),
    ]}  # fmt: skip
    assert tt.last_step(trace["traceEvents"])["name"] == "ProfilerStep#1"
    text = tt.summarize(trace, "t")
    assert "ProfilerStep#1: host 0.100 ms, device kernels busy 0.015 ms (2 kernels)" in text
    assert "| backward | 0.030 | 0.025 |" in text and "| data | 0.005 | 0.000 |" in text
    assert "| `aten::mm` | 2 | 0.016 |" in text and "| `cudaLaunchKernel` | 1 | 0.001 |" in text
    assert "aten::copy_" not in text
    tt.draw(trace, tmp_path / "t.png", "t")
    assert (tmp_path / "t.png").stat().st_size > 0


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def small_mlperf_config(tmp_path: Path, **model) -> str:
    """configs/mlperf-dcnv2.json (its 26 tables, D = 128) with 42 lookups a sample instead of 214: one a feature, four
    or eight in four of them, two of those the tables of 3 and 4 rows. Under the Triton interpreter the smoke runs'
    cost is the kernels' programs, one for every 16-64 lookups of the update and a pass over every slot of the lookup
    (214 made the pooled update sweep alone ~17 s of CPU); batch 2 of these still repeats rows (8 lookups of the table
    of 3 rows; on the CPU 84 lookups of 74 rows) and there, in the plan's 16-lookup chunks, carries a row's sums over a
    chunk boundary. ``model`` sets more of its keys (the dense layers)."""
    cfg = json.loads((REPO / "configs" / "mlperf-dcnv2.json").read_text())
    hot = [1] * 26
    hot[5], hot[16], hot[20], hot[21] = 4, 4, 8, 4  # tables of 3 and 4 rows (5, 16), two of 40M (20, 21)
    cfg["model"].update(multi_hot_sizes=hot, **model)
    path = tmp_path / "mlperf-small.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_loader_throughput_measures_every_stage_on_a_small_input(tmp_path):
    lt = load_script("loader_throughput")
    assert lt.main(["--rows", "3000", "--workers", "1", "--repeats", "1", "--devices", "cpu", "--shuffle", "true",
                    "--reader-threads", "1,2", "--shuffle-buffer-rows", "700", "--batch-size", "256",
                    "--out", str(tmp_path), "--name", "lt"]) == 0
    rows = read_csv(tmp_path / "lt.csv")
    assert [(r["stage"], r["workers"]) for r in rows] == [
        ("parse", "1"), ("preprocess", "1"), ("decode", "1"), ("decode", "2"), ("loader", "1"), ("loader", "2")]
    assert all(r["status"] == "ok" and float(r["rate"]) > 0 for r in rows)
    assert {r["arrow_threads"] for r in rows if r["stage"] in ("decode", "loader")} == {"True"}  # the loader's default
    train_rows = {r["rows"] for r in rows if r["stage"] in ("decode", "loader")}
    assert len(train_rows) == 1 and 0 < int(train_rows.pop()) < 3000  # the train split, every row once
    assert (tmp_path / "lt.md").read_text().count("| decode |") == 2 and (tmp_path / "lt.png").stat().st_size > 0


def test_loader_throughput_measures_an_existing_multi_hot_dataset(tmp_path, mlperf_preset_dataset):
    """--dataset: the loader alone on a dataset already made (no raw file, no preprocessing), multi-hot rows decoded
    as such (every row once; no one-hot target applied to them); a folder without metadata refused. The dataset:
    the session's 2,000 rows of MLPerf's multi-hot preset (tests/conftest.py; the loader reads it, never writes)."""
    data = mlperf_preset_dataset
    lt = load_script("loader_throughput")
    assert lt.main(["--dataset", str(data), "--repeats", "1", "--devices", "cpu", "--shuffle", "true",
                    "--reader-threads", "2", "--shuffle-buffer-rows", "700", "--batch-size", "256",
                    "--arrow-threads", "on,off", "--codecs", "lz4", "--layouts", "lists", "--work", str(tmp_path / "work"),
                    "--out", str(tmp_path), "--name", "lt"]) == 0
    rows = read_csv(tmp_path / "lt.csv")
    # the dataset's own files (zstd, slot columns), then a copy rewritten in LZ4 with list columns, each with
    # pyarrow's column pool on and off
    assert [(r["stage"], r["codec"], r["layout"], r["arrow_threads"]) for r in rows] == [
        (stage, codec, layout, arrow) for codec, layout in (("zstd", "slots"), ("lz4", "lists"))
        for stage in ("decode", "loader") for arrow in ("True", "False")]
    assert all(r["status"] == "ok" and float(r["rate"]) > 0 and r["target"] == "" and r["placement"] == "stream"
               and float(r["cpu_user_s"]) >= 0 and int(r["minor_faults"]) >= 0 for r in rows), rows
    # CPU time is counted in clock ticks: a run of 1,600 rows can take less than one (0.0 s, seen in CI), all eight not
    assert sum(float(r["cpu_user_s"]) for r in rows) > 0, rows
    assert {int(r["rows"]) for r in rows} == {1600}  # the train split (80% of 2,000), every row once
    assert not (tmp_path / "work" / "recoded-lz4-lists").exists()  # the copy is removed once measured
    with pytest.raises(SystemExit):
        lt.main(["--dataset", str(data), "--arrow-threads", "maybe", "--devices", "cpu", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        lt.main(["--dataset", str(tmp_path / "nothing"), "--devices", "cpu", "--out", str(tmp_path)])


def test_loader_training_runs_each_placement(tmp_path):
    lt = load_script("loader_training")
    assert lt.main(["--data", str(REPO / "data" / "sample"), "--config", "configs/sample.json", "--variant", "eager",
                    "--batch-size", "64", "--steps", "12", "--log-every", "2", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "loader_training_b64.csv")
    assert [r["placement"] for r in rows] == ["stream", "gpu"]
    for r in rows:
        assert r["status"] == "ok" and r["steps"] == "12" and float(r["samples_per_sec"]) > 0
        assert 0 <= float(r["data_wait_fraction"]) <= 1 and 0 < float(r["auc"]) < 1
    assert (tmp_path / "loader_training_b64.png").stat().st_size > 0


def spy_build_run(monkeypatch, module) -> list[dict]:
    """Record each `build_run` call of a benchmark module (its config, tables and total_steps)."""
    real, calls = module.build_run, []

    def spy(cfg, tables, device, total_steps, *args, **kwargs):
        calls.append({"cfg": cfg, "tables": tables, "total_steps": total_steps})
        return real(cfg, tables, device, total_steps, *args, **kwargs)

    monkeypatch.setattr(module, "build_run", spy)
    return calls


def test_train_throughput_builds_each_case_with_the_builder(tmp_path, monkeypatch):
    """Measured cases run the run `build_run` makes (capped tables of the config's dataset); a case that
    cannot run here is written as skipped, the last one too; the CSV keeps its columns."""
    tt = load_script("train_throughput")
    calls = spy_build_run(monkeypatch, tt)
    monkeypatch.chdir(REPO)  # the sample config's data.path is relative
    assert tt.main(["--config", "configs/sample.json", "--device", "cpu", "--variants", "eager,triton-embedding+step-graph",
                    "--precisions", "fp32", "--batch-sizes", "32", "--warmup", "2", "--steps", "2", "--windows", "2",
                    "--out", str(tmp_path), "--name", "tt"]) == 0
    with open(tmp_path / "tt.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header == ["variant", "precision", "batch_size", "samples_per_sec", "min_samples_per_sec",
                      "max_samples_per_sec", "step_ms", "warmup_s", "peak_memory_mb", "final_loss", "status",
                      "device", "torch", "triton", "python", "date"]
    eager, graph = read_csv(tmp_path / "tt.csv")
    assert eager["status"] == "ok" and float(eager["samples_per_sec"]) > 0 and math.isfinite(float(eager["final_loss"]))
    assert graph["variant"] == "triton-embedding+step-graph" and graph["status"].startswith("skipped: CUDA graphs")
    assert len(calls) == 1 and calls[0]["total_steps"] == 2 + 2 * 2
    assert calls[0]["cfg"].train.precision == "fp32" and calls[0]["cfg"].data.batch_size == 32
    assert calls[0]["tables"].cardinalities == calls[0]["cfg"].model.cardinalities  # no cap in the sample config
    md = (tmp_path / "tt.md").read_text()
    assert md.startswith("# DLRM training throughput, sample.json\n\ndevice: ") and md.count("\n| eager | fp32 | 32 |") == 1
    assert (tmp_path / "tt.png").stat().st_size > 0


def test_scaling_one_process_then_two_ranks(tmp_path, monkeypatch):
    """One process, then 2 ranks under torchrun (gloo: the builder's sharded tables and DDP) append
    rows to one CSV; efficiency is rate(2) / (2 x rate(1))."""
    sc = load_script("scaling")
    calls = spy_build_run(monkeypatch, sc)
    monkeypatch.chdir(REPO)
    has_cuda = torch.cuda.is_available()
    # on the CPU everywhere: 2 ranks need 2 GPUs, and the rows' logic is what is checked here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["--config", "configs/sample.json", "--precision", "fp32", "--batch-per-gpu", "32", "--warmup", "1",
            "--steps", "2", "--windows", "2", "--out", str(tmp_path), "--name", "sc"]
    from kernels.embedding import update

    with pytest.MonkeyPatch.context() as mp:  # --sr-rng sets the module's generator: put back after this run
        mp.setattr(update, "SR_RNG", update.SR_RNG)
        assert sc.main([*args, "--sr-rng", "hash1", "--profile", "--top-kernels", "3"]) == 0
        assert update.SR_RNG == "hash1"
    assert len(calls) == 1 and calls[0]["total_steps"] == 1 + 2 * 2
    # --profile: the per-category table and the --top-kernels longest ops (CPU time here), with calls a step
    profile = (tmp_path / "sc_profile_1gpu.md").read_text()
    longest = profile.split("Longest kernels:")[1]
    assert "| calls per step |" in longest and longest.count("\n| 0 | ") == 3
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    if has_cuda:  # hidden where there is one; elsewhere the variable is left out, as a changed CUDA_VISIBLE_DEVICES
        # runs torchrun and both ranks in fresh interpreters instead of the prewarmed one (~2.5 s of CPU each)
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "benchmarks" / "scaling.py"), *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    one, two = read_csv(tmp_path / "sc.csv")
    assert (one["gpus"], one["sharding"], float(one["efficiency"])) == ("1", "none", 1.0)
    assert (one["sr_rng"], two["sr_rng"]) == ("hash1", update.SR_RNG)  # the second: the shipped generator
    assert two["gpus"] == "2" and two["sharding"] == "auto" and two["batch_per_gpu"] == "32"
    expected = float(two["samples_per_sec"]) / (2 * float(one["samples_per_sec"]))
    assert float(two["efficiency"]) == pytest.approx(expected)
    assert (tmp_path / "sc.md").read_text().count("| sample.json | fp32 |") == 2
    assert (tmp_path / "sc.png").stat().st_size > 0


def test_mlperf_dcnv2_floor_at_the_sustained_gemm_rate():
    """With a settle time the GEMM is timed again after it (the power-capped clock): the compute and series floors
    at that rate are reported beside the burst ones; without one they are None and their rows absent."""
    md2 = load_script("mlperf_dcnv2")
    work = {"flop": 100e6, "emb_bytes": 200e3, "bottom_macs": 0.0, "cross_macs": 0.0, "top_macs": 0.0,
            "lookups": 214, "features": 26}
    peaks = {"gemm_tflops": 800.0, "gemm_tflops_sustained": 600.0, "copy_gbps": 4000.0, "gemm_n": 8192}
    fl = md2.floors(work, peaks)
    assert fl["compute_floor_sps"] == pytest.approx(8e6) and fl["compute_floor_sustained_sps"] == pytest.approx(6e6)
    assert fl["memory_floor_sps"] == pytest.approx(20e6)
    assert fl["floor_sustained_sps"] == pytest.approx(1 / (1 / 6e6 + 1 / 20e6))
    lines = md2.floor_lines(work, fl, peaks)
    assert any("600 TFLOP/s (sustained)" in line for line in lines) and len(lines) == 7
    assert "at the sustained GEMM rate (compute 6.00M)" in md2.context_paragraph(fl)
    burst_only = md2.floors(work, {**peaks, "gemm_tflops_sustained": None})
    assert burst_only["floor_sustained_sps"] is None and len(md2.floor_lines(work, burst_only, peaks)) == 5
    measured = md2.device_peaks(torch.device("cpu"), smoke=True, settle_s=0.05)
    assert measured["gemm_tflops"] > 0 and measured["gemm_tflops_sustained"] > 0
    assert md2.device_peaks(torch.device("cpu"), smoke=True)["gemm_tflops_sustained"] is None


def test_mlperf_dcnv2_clocks_of_the_timed_windows_only():
    """The nvidia-smi samples taken between a case's two host-clock marks give its row's SM clock, power and
    power-capped share (samples before or after, the warm-up's and the next case's, are left out); the table shows
    them, n/a where none were sampled (the CPU, --no-clocks)."""
    md2 = load_script("mlperf_dcnv2")
    from datetime import datetime

    t0 = datetime(2026, 11, 29, 10, 0, 1).timestamp()
    line = lambda sec, mhz, w, reasons: f"2026/11/29 10:00:{sec:06.3f}, {mhz}, 3201, {w}, 50, {reasons}"  # noqa: E731
    lines = [line(0.5, 1980, 300.0, "0x0"),  # before the windows: the warm-up's boost
             line(1.0, 1700, 690.0, "0x4"), line(1.5, 1650, 698.0, "0x4"), line(2.0, 1800, 650.0, "0x0"),
             line(3.0, 1980, 200.0, "0x1")]  # after them
    clocks = md2.window_clocks(lines, t0, t0 + 1.5)
    assert clocks == {"sm_mhz": 1700.0, "power_w": 690.0, "power_capped": pytest.approx(2 / 3)}
    assert md2.window_clocks(lines, t0 + 10, t0 + 11) == {}
    assert md2.clock_sampler(torch.device("cpu"), True) is None
    row = {"impl": "auto", "batch_size": 65536, "status": "ok", **clocks}
    table = md2.markdown_table([row, {"impl": "baseline", "batch_size": 65536, "status": "ok"}])
    assert "SM MHz in the windows (power, capped)" in table[0]
    assert "| 1700 (690 W, 67%) |" in table[2] and "| n/a | ok |" in table[3]


def test_mlperf_dcnv2_smoke_baseline_ours_and_a_step_graph_variant(tmp_path):
    """benchmarks/mlperf_dcnv2.py --smoke: the plain PyTorch baseline and our eager run measured at tiny
    tables (batch 64), a +step-graph variant with the config's dense Adagrad (CapturableAdagrad on CUDA:
    measured there; on the CPU recorded as skipped, not a crash), the model's floor from its shapes, and
    the CSV / Markdown / PNG written."""
    md2 = load_script("mlperf_dcnv2")
    # --warmup 0: no untimed step (--smoke's 1): each measured case is MLPerf's dense layers under bf16 autocast, a
    # ~2-s step on a CI core; the two timed windows still run, measure and train (a finite final loss)
    assert md2.main(["--smoke", "--warmup", "0", "--variants", "eager,triton-embedding+step-graph",
                     "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "mlperf_dcnv2.csv")
    assert [(r["impl"], r["batch_size"]) for r in rows] == [
        ("baseline", "64"), ("eager", "64"), ("triton-embedding+step-graph", "64")]
    base, eager, graph = rows
    for r in (base, eager):
        assert r["status"] == "ok" and float(r["samples_per_sec"]) > 0 and math.isfinite(float(r["final_loss"])), r
        assert r["table_rows"] == str(sum(min(c, 1000) for c in md2.load_config(md2.CONFIG).model.cardinalities))
    assert float(base["speedup_vs_baseline"]) == 1.0 and float(eager["speedup_vs_baseline"]) > 0
    assert (base["embedding_dtype"], eager["embedding_dtype"]) == ("bf16", "fp32")  # torch embedding: fp32 tables
    if torch.cuda.is_available():
        assert graph["status"] == "ok" and float(graph["samples_per_sec"]) > 0, graph
    else:
        assert graph["status"] == "skipped: CUDA graphs need a CUDA device" and not graph["samples_per_sec"], graph
    assert 95e6 < float(base["flop_per_sample"]) < 97e6 and 165e3 < float(base["emb_bytes_per_sample"]) < 180e3
    assert float(base["floor_sps"]) > 0 and {"device", "torch", "triton", "date"} <= set(base)
    if not torch.cuda.is_available():  # no nvidia-smi samples on the CPU: the clock columns stay empty
        assert all(r["sm_mhz"] == "" and r["power_capped"] == "" for r in rows), rows
    md = (tmp_path / "mlperf_dcnv2.md").read_text()
    assert "| baseline | 64 |" in md and "96.2 MFLOP" in md and (tmp_path / "mlperf_dcnv2.png").stat().st_size > 0


def test_mlperf_dcnv2_keeps_a_row_per_measurement_of_a_repeated_variant(tmp_path):
    """A variant named twice (alternated with another) keeps both rows in run order; --append replaces an earlier
    run's row of a case measured again and keeps the others."""
    md2 = load_script("mlperf_dcnv2")
    # the rows' bookkeeping is what is checked: MLPerf's dense layers (a 1-s step on the CPU) made smaller
    small = ["--config", small_mlperf_config(tmp_path, cross_rank=16, bottom_mlp=[32, 128], top_mlp=[32, 1])]
    out = tmp_path / "out"
    assert md2.main(["--smoke", "--no-baseline", "--variants", "eager,triton-embedding+step-graph,eager",
                     "--out", str(out), *small]) == 0
    rows = read_csv(out / "mlperf_dcnv2.csv")
    assert [r["impl"] for r in rows] == ["eager", "triton-embedding+step-graph", "eager"]
    assert all(float(r["samples_per_sec"]) > 0 for r in rows if r["impl"] == "eager"), rows  # measured, not skipped
    assert md2.main(["--smoke", "--no-baseline", "--variants", "eager", "--append", "--out", str(out), *small]) == 0
    assert [r["impl"] for r in read_csv(out / "mlperf_dcnv2.csv")] == ["triton-embedding+step-graph", "eager"]


def test_step_profile_groups_kernels_by_what_they_do():
    """benchmarks/step_profile.py's grouping of kernel names (the profile itself needs a GPU)."""
    sp = load_script("step_profile")
    assert sp.category("_pooled_fwd_kernel") == "embedding lookup"
    assert sp.category("void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<...>") \
        == "embedding update: sort"
    assert sp.category("_sparse_chunk_kernel") == sp.category("_sparse_carry_kernel") \
        == sp.category("_group_sum_kernel") == "embedding update: segment sums + optimizer"
    assert sp.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMMs (cuBLAS / CUTLASS)"
    assert sp.category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "GEMMs (cuBLAS / CUTLASS)"
    assert sp.category("triton_poi_fused_addmm_relu_0") == "Inductor fused kernels"
    assert sp.category("_cross_fwd_kernel") == "other Triton kernels (ours)"
    assert sp.category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "dense optimizer"
    assert sp.category("Memcpy DtoD (Device -> Device)") == sp.category("memcpy128") == "copies and fills"
    assert sp.category("_adagrad_kernel") == "dense optimizer"  # kernels/adagrad.py, before "ours"
    assert sp.category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == sp.category("ncclKernel_SendRecv") \
        == "collectives (NCCL)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_step_profile_refuses_to_run_without_cuda(capsys):
    sp = load_script("step_profile")
    with pytest.raises(SystemExit) as e:
        sp.main(["--out", "/nonexistent"])
    assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_step_profile_takes_batches_and_tables_of_a_dataset():
    """--data: the first batches of the dataset's train split as train.py's device-resident loader cuts them, with the
    dataset's tables; a split too small for them is refused naming the directory."""
    from dlrm.config import load_config
    from dlrm.data.batch import Batch
    from dlrm.data.schema import read_metadata

    sp = load_script("step_profile")
    sample = REPO / "data" / "sample"
    cfg = load_config(REPO / "configs" / "sample.json")
    tables, batches = sp.dataset_batches(cfg, sample, 3, 64, torch.device("cpu"))
    assert tables.cardinalities == read_metadata(sample).cardinalities and len(batches) == 3
    assert all(b.dense.shape == (64, 13) and b.sparse.shape == (64, 26) and b.labels.shape == (64,) for b in batches)
    assert not torch.equal(batches[0].sparse, batches[1].sparse)
    # plain batches, gathered once: every variant times the same step (a lazily gathered batch would have a graphed
    # variant replay the gathers and an ordinary one reuse them)
    assert {type(b) for b in batches} == {Batch}
    with pytest.raises(SystemExit, match="sample: the train split holds"):
        sp.dataset_batches(cfg, sample, 8, 1 << 20, torch.device("cpu"))


@pytest.mark.gpu
def test_step_profile_on_a_small_model(tmp_path):
    sp = load_script("step_profile")
    assert sp.main(["--config", "configs/kaggle.json", "--variant", "triton-embedding-interaction+step-graph",
                    "--batch-size", "2048", "--max-rows", "10000", "--steps", "3", "--warmup", "3",
                    "--out", str(tmp_path), "--name", "p"]) == 0
    rows = read_csv(tmp_path / "p.csv")
    ms = {r["category"]: float(r["ms_per_step"]) for r in rows}
    assert ms["embedding lookup"] > 0 and ms["GEMMs (cuBLAS / CUTLASS)"] > 0
    assert abs(sum(float(r["share_of_step"]) for r in rows) - 1.0) < 0.05 or ms.get("idle (step minus kernels)") == 0
    assert (tmp_path / "p.png").stat().st_size > 0 and "Top kernels" in (tmp_path / "p.md").read_text()
    # the sample's own batches, the update's hot rows walked chunk by chunk as before group sums (the A/B knob)
    from kernels.embedding import update

    try:
        assert sp.main(["--config", "configs/sample.json", "--variant", "auto", "--batch-size", "256", "--steps", "2",
                        "--warmup", "2", "--data", str(REPO / "data" / "sample"), "--group-sums", "off",
                        "--out", str(tmp_path), "--name", "d"]) == 0
        assert update.CARRY_GROUP_SUMS is False and "sample, group sums off" in (tmp_path / "d.md").read_text()
    finally:
        update.CARRY_GROUP_SUMS = None


def test_autopick_report_tables_each_cell_and_names_a_file_without_auto(tmp_path, capsys):
    """benchmarks/autopick_report.py: one line per cell with the fastest named variant in bold and auto against it,
    every row in the CSV with the call, the chart; a cell file without an ``auto`` row is refused by name."""
    ar = load_script("autopick_report")
    keys = ["variant", "precision", "batch_size", "samples_per_sec", "status", "device", "torch", "triton", "python",
            "date"]
    env = ["GPU X", "2.x", "3.x", "3.12", "2026-11-25 04:00"]

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()

    def cell(name, rates):
        with (src / name).open("w") as f:
            f.write(",".join(keys) + "\n")
            for v, r in rates:
                f.write(",".join([v, "bf16", "65536", str(r), "ok", *env]) + "\n")

    cell("auto_kaggle_bf16_b65536.csv", [("auto", 99.0e6), ("triton-embedding-interaction+step-graph", 90.0e6),
                                         ("triton-wgrad+step-graph", 100.0e6)])
    cell("auto_terabyte_bf16_b2048.csv", [("auto", 6.0e6), ("triton-embedding-interaction+step-graph", 5.0e6)])
    assert ar.main([str(src), "--call", "T1", "--out", str(out)]) == 0
    md = (out / "autopick.md").read_text()
    assert "| Kaggle | bf16 | 65536 | 99.00M | 90.00M | **100.00M** |  | -1.0% |" in md
    assert "| Terabyte | bf16 | 2048 | 6.00M | **5.00M** |  |  | +20.0% |" in md
    rows = read_csv(out / "autopick.csv")
    assert len(rows) == 5 and {r["call"] for r in rows} == {"T1"}
    assert (out / "autopick.png").stat().st_size > 0
    cell("auto_kaggle_tf32_b2048.csv", [("triton-embedding-interaction+step-graph", 5.0e6)])
    assert ar.main([str(src), "--call", "T1", "--out", str(out), "--overwrite"]) == 2  # (the first run's files)
    assert "auto_kaggle_tf32_b2048.csv: no 'auto' row" in capsys.readouterr().err


def test_user_path_runs_train_py_with_the_overrides_beside_the_device_resident_reference(tmp_path):
    """benchmarks/user_path.py on the embedded sample (the reference: eager PyTorch on the CPU, the fast path's
    variant on CUDA): train.py as a user runs it, every --set applied to its config (the logging windows of the
    summary's steady state), the ratio to the device-resident rate, CSV / Markdown / plot; a malformed --set refused
    before anything runs."""
    up = load_script("user_path")
    args = ["--config", "configs/sample.json", "--data", str(REPO / "data" / "sample"), "--batch-sizes", "512",
            "--epochs", "1", "--max-steps", "6", "--placements", "", "--out", str(tmp_path), "--name", "up",
            "--set", "train.log_every=2", "--set", "train.eval_every=null"]
    assert up.main(args) == 0
    rows = read_csv(tmp_path / "up.csv")
    reference = up.REFERENCE_VARIANT if torch.cuda.is_available() else "eager"
    assert [r["run"] for r in rows] == [f"device-resident ({reference})", "train.py (defaults)"]
    ref, user = (float(r["samples_per_sec"]) for r in rows)
    assert ref > 0 and user > 0 and math.isclose(float(rows[1]["ratio"]), user / ref, rel_tol=1e-6)
    assert rows[1]["steps"] == "6" and rows[1]["status"] == "ok" and rows[1]["placement"]
    assert "every run with train.log_every=2, train.eval_every=null" in (tmp_path / "up.md").read_text()
    assert (tmp_path / "up.png").stat().st_size > 0
    assert "steps/epoch" in (tmp_path / "up_logs" / "b512-default-.log").read_text()  # the run's own output kept
    assert up.parse_sets(["a.b=3", "a.c=x", "a.d=null"]) == {"a.b": 3, "a.c": "x", "a.d": None}
    for bad in ("train.log_every", "log_every=3", "a.b.c=1", ".x=1"):
        with pytest.raises(SystemExit):
            up.main([*args[:-4], "--set", bad])


def test_train_log_windows_reads_each_window_and_marks_epoch_starts(tmp_path):
    """benchmarks/train_log_windows.py: a window per new samples_s value of the progress bar (the repeated
    postfix of the steps between is one window), epoch starts from the log's "N steps/epoch", the run's totals
    from its last line; a log without windows is refused."""
    tw = load_script("train_log_windows")
    bar = "".join(f"train:  {100 * s // 40:3d}%|##        | {s}/40 [00:0{s % 10}<00:01, 9.1step/s, loss=0.5, samples_s={v:,}]"
                  for s, v in [(1, 0), (10, 1_000_000), (11, 1_000_000), (20, 3_000_000), (24, 3_000_000),
                               (30, 2_000_000), (40, 3_500_000)] if v)
    log = tmp_path / "run.log"
    log.write_text("01:00:00 INFO    device cuda, 2,080,000 train rows, 15 steps/epoch, 40 steps\n" + bar + "\n"
                   "01:01:00 INFO    validation: AUC 0.5950, logloss 2.5155, accuracy 0.7163 (oracle AUC 0.7702); 40 "
                   "steps, 2,621,440 samples, 2,500,000 samples/s (waiting for data 12% of the time), 1.0s\n")
    assert tw.main(["--logs", str(log), "--labels", "a", "--out", str(tmp_path), "--name", "w"]) == 0
    rows = read_csv(tmp_path / "w.csv")
    assert [(r["first_step"], r["end_step"], r["samples_per_s"], r["epoch_start"]) for r in rows] == [
        ("1", "10", "1000000", "False"), ("11", "20", "3000000", "True"), ("21", "30", "2000000", "False"),
        ("31", "40", "3500000", "True")]  # epochs start at steps 16 and 31 (15 steps an epoch)
    md = (tmp_path / "w.md").read_text()
    assert "| a | run.log | 2,500,000 | 12% | 4 | 3.00M | 2.00M | 3.25M | 3.50M |" in md
    assert (tmp_path / "w.png").stat().st_size > 0
    (tmp_path / "empty.log").write_text("nothing here\n")
    with pytest.raises(SystemExit):
        tw.main(["--logs", str(tmp_path / "empty.log"), "--out", str(tmp_path)])


def test_stream_timeline_numbers_from_a_runs_events():
    """benchmarks/stream_timeline.py's per-run numbers, from hand-made events: the steady part starts at step 20,
    a decode straddling it counts in proportion, the host's step times and the time from each sync to the next
    step are medians and means."""
    st = load_script("stream_timeline")
    steps = [float(i) for i in range(40)]  # step i + 1 at t = i: 1 s a step on the host
    events = {"step": steps, "sync": [s + 0.25 for s in steps[9::10]], "loader": [{"reader_threads": 2}],
              "decode": [[1, 17.0, 21.0, 400], [2, 20.0, 30.0, 1000], [1, 50.0, 60.0, 999]],  # the last after the end
              "wait": [[10.0, 11.0], [25.0, 25.5]], "upload": [[21.0, 21.002]],
              "probe": [[20.5, 0.001], [21.5, 0.003], [5.0, 9.0]]}
    n = st.numbers(events)
    assert n["steady_s"] == pytest.approx(20.0)  # step 20 (t = 19) to step 40 (t = 39)
    assert n["decoded_rows_per_s"] == pytest.approx((200 + 1000) / 20.0)  # half of the first decode is steady
    assert n["reader_busy"] == pytest.approx(12.0 / (20.0 * 2))
    assert n["reader_rows_per_s"] == pytest.approx(1200 / 12.0)
    assert (n["waits"], n["wait_s"]) == (1, pytest.approx(0.5))  # the wait at t = 10 is before the steady part
    assert n["upload_ms"] == pytest.approx(2.0)
    assert n["host_step_ms_p50"] == pytest.approx(1000.0)
    assert n["after_sync_ms"] == pytest.approx(750.0)  # sync at 19.25, 29.25; next steps at 20.0, 30.0
    assert n["oversleep_p99_ms"] == pytest.approx(3.0)
    assert st.parse_setting("r8:reader_threads=8,arrow_threads=0,log_every=100") == (
        "r8", {"reader_threads": 8, "arrow_threads": False, "log_every": 100})
    for bad in ("x:threads=8", "x:prefetch", ":prefetch=2"):
        with pytest.raises(Exception, match="--setting"):
            st.parse_setting(bad)


def test_stream_timeline_runs_train_py_with_the_loader_timed(tmp_path):
    """One streamed run of the sample (the child sets the knobs, skips checkpoints and records its events), the
    report written, and the figure redrawn from the CSV alone."""
    st = load_script("stream_timeline")
    out = tmp_path / "out"
    assert st.main(["--config", str(REPO / "configs" / "sample.json"), "--data", str(REPO / "data" / "sample"),
                    "--epochs", "1",
                    "--setting", "n:reader_threads=1,reader_nice=3,log_every=5,arrow_threads=0,read_late=0",
                    "--out", str(out), "--name", "t", "--keep-logs"]) == 0
    (row,) = read_csv(out / "t.csv")
    assert row["status"] == "ok" and row["readers"] == "1" and float(row["samples_per_sec"]) > 0
    events = __import__("json").loads((out / "t_logs" / "n_1.events.json").read_text())
    assert events["loader"] == [{"reader_threads": 1, "arrow_threads": False, "prefetch": 3}]
    steps = len(events["step"])  # one epoch of the sample at its batch size; logged every 5 steps and at the end
    assert steps > 100 and len(events["sync"]) == steps // 5 + (steps % 5 > 0)
    # read_late=0: each window read at its own logging step, before the next step (the trainer reads it after)
    assert [sum(t < sync for t in events["step"]) for sync in events["sync"]] == [
        min(5 * (i + 1), steps) for i in range(len(events["sync"]))]
    assert not list((out / "t_logs").glob("*.pt")) and "| n | 1 |" in (out / "t.md").read_text()
    (out / "t.png").unlink()
    assert st.main(["--from-csv", str(out / "t.csv")]) == 0 and (out / "t.png").stat().st_size > 0
