"""The benchmark scripts' own logic (not their timings): runs built as train.py builds them, trace
summaries, CSV merging and the files each script writes."""

from __future__ import annotations

import collections
import csv
import importlib.util
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


def test_kernels_append_replaces_only_the_cases_measured_again(tmp_path):
    """--append keeps every earlier (kernel, batch, dtype) case not measured in this run."""
    base = [sys.executable, str(REPO / "benchmarks" / "kernels.py"), "--out", str(tmp_path)]
    if torch.cuda.is_available():  # compiled kernels, short timings (the GPU image's Triton 3.6 interpreter
        env = dict(os.environ)      # fails on the loss kernel with its numpy: not a configuration that runs kernels)
        base += ["--device", "cuda", "--dtypes", "fp32", "--impls", "triton,eager", "--warmup-ms", "1", "--rep-ms", "2"]
    else:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        base += ["--device", "cpu", "--cpu-reps", "1"]
    subprocess.run(base + ["--kernels", "loss", "--batch-sizes", "8,16"], check=True, env=env, capture_output=True)
    subprocess.run(base + ["--kernels", "loss,interaction_d16", "--batch-sizes", "16", "--append"], check=True, env=env,
                   capture_output=True)  # fmt: skip
    with open(tmp_path / "kernels.csv") as f:
        rows = list(csv.DictReader(f))
    cases = collections.Counter((r["kernel"], r["batch"]) for r in rows)
    assert cases[("copy", "")] == 1
    assert cases[("loss", "8")] == cases[("loss", "16")] == cases[("interaction_d16", "16")] > 0
    assert set(cases) == {("copy", ""), ("loss", "8"), ("loss", "16"), ("interaction_d16", "16")}
    errors = [(r["kernel"], r["batch"], r["error"]) for r in rows if r["error"]]
    assert not errors, errors


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


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


def test_mlp_benchmark_smoke_times_every_implementation(tmp_path):
    """benchmarks/mlp.py --smoke: every MLP case x (eager, compiled, fused) measured at tiny shapes, the
    speed-ups relative to eager, and the CSV / Markdown / PNG written (CUDA: graph-replay timing); the
    opt-in fp8 and on-chip tail impls, the tail with a forced launch too."""
    mb = load_script("mlp")
    assert mb.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "mlp.csv")
    assert [(r["mlp"], r["impl"]) for r in rows] == [(m, i) for m in mb.CASES for i in mb.DEFAULT_IMPLS]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and r["batch"] == "8" for r in rows), rows
    assert all(float(r["speedup_vs_eager"]) == 1.0 for r in rows if r["impl"] == "eager")
    assert {"device", "torch", "triton", "date"} <= set(rows[0])
    md = (tmp_path / "mlp.md").read_text()
    assert md.count("| fused | ") == len(mb.CASES) and (tmp_path / "mlp.png").stat().st_size > 0
    # the FP8 try is opt-in and runs under bf16 autocast only: a tf32 row says so, and the run succeeds
    assert mb.main(["--smoke", "--mlps", "kaggle_top", "--impls", "eager,fp8", "--out", str(tmp_path / "fp8")]) == 0
    fp8 = [r for r in read_csv(tmp_path / "fp8" / "mlp.csv") if r["impl"] == "fp8"]
    assert [r["status"] for r in fp8] == ["skipped: fp8 runs under bf16 autocast"]
    # the on-chip tail (kernels/mlp_tail.py) is opt-in too; each forced launch adds a tail[...] row
    assert mb.main(["--smoke", "--mlps", "kaggle_bottom,mlperf_top", "--impls", "eager,fused,tail",
                    "--tail-launches", "16x4/16x4x2rh", "--out", str(tmp_path / "tail")]) == 0
    tail = read_csv(tmp_path / "tail" / "mlp.csv")
    assert [(r["mlp"], r["impl"]) for r in tail] == [(m, i) for m in ("kaggle_bottom", "mlperf_top")
                                                     for i in ("eager", "fused", "tail", "tail[16x4/16x4x2rh]")]
    # --smoke runs tf32 rows: on CUDA the tail refuses fp32 inputs, and its rows say so
    skipped = "skipped: the on-chip tail runs 16-bit on CUDA"
    assert all((r["status"] == "ok" and float(r["ms"]) > 0) or (torch.cuda.is_available() and r["impl"].startswith("tail")
               and r["status"] == skipped) for r in tail), tail
    assert "the on-chip layers: kaggle_bottom 1-16-8-2-1, mlperf_top 32-32-16-8-1" in (tmp_path / "tail" / "mlp.md").read_text()
    with pytest.raises(SystemExit):
        mb.main(["--smoke", "--impls", "tail", "--tail-launches", "16x4", "--out", str(tmp_path / "bad")])


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
    assert md2.main(["--smoke", "--variants", "eager,triton-embedding+step-graph", "--out", str(tmp_path)]) == 0
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
    assert md2.main(["--smoke", "--no-baseline", "--variants", "eager,triton-embedding+step-graph,eager",
                     "--out", str(tmp_path)]) == 0
    assert [r["impl"] for r in read_csv(tmp_path / "mlperf_dcnv2.csv")] == [
        "eager", "triton-embedding+step-graph", "eager"]
    assert md2.main(["--smoke", "--no-baseline", "--variants", "eager", "--append", "--out", str(tmp_path)]) == 0
    assert [r["impl"] for r in read_csv(tmp_path / "mlperf_dcnv2.csv")] == ["triton-embedding+step-graph", "eager"]


def test_pooled_embedding_smoke_times_every_mode_and_dtype(tmp_path):
    """benchmarks/pooled_embedding.py --smoke: the pooled Triton lookup, fused row-wise Adagrad update and
    both together, bf16 and fp32, and the embedding_bag references, at tiny tables (batch 2); the bytes
    that must move counted from the shapes and the batch's distinct rows (CUDA: graph-replay timing)."""
    pe = load_script("pooled_embedding")
    assert pe.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "pooled_embedding.csv")
    per_dtype = [("triton", "fwd"), ("torch-bag", "fwd"), ("torch-bag-rows", "fwd"), ("triton", "bwd"),
                 ("triton", "fwd+bwd")]
    assert [(r["impl"], r["mode"], r["dtype"]) for r in rows] == [(i, m, d) for d in ("bf16", "fp32")
                                                                  for i, m in per_dtype]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and r["batch"] == "2" for r in rows), rows
    for r in rows:
        e, unique = 2 if r["dtype"] == "bf16" else 4, int(r["unique_rows"])
        assert 0 < unique <= int(r["lookups"]) == 2 * 214
        fwd, bwd = 2 * (214 + 26) * 128 * e, 2 * 26 * 128 * e + unique * (2 * 128 * e + 2 * 4)
        assert int(r["bytes"]) == {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[r["mode"]]
        assert r["meets_target"] in (("True", "False") if r["impl"] == "triton" and r["mode"] != "fwd+bwd" else ("",))
    md = (tmp_path / "pooled_embedding.md").read_text()
    assert md.count("| triton | bwd |") == 2 and "copy bandwidth" in md
    assert (tmp_path / "pooled_embedding.png").stat().st_size > 0


def test_pooled_embedding_lookup_launches_add_forward_rows_and_restore_the_picked_launch(tmp_path):
    """--lookup-launches: one more triton fwd row per forced launch (SAMPLESxWARPS[xUNROLL[xMAXNREG]]), the override
    reset after."""
    pe = load_script("pooled_embedding")
    import kernels.embedding.pooled as pooled

    assert pe.main(["--smoke", "--out", str(tmp_path), "--dtypes", "bf16", "--modes", "fwd", "--impls", "triton",
                    "--lookup-launches", "16x2,8x4x4,8x4x2x128"]) == 0
    rows = read_csv(tmp_path / "pooled_embedding.csv")
    assert [r["impl"] for r in rows] == ["triton", "triton 16x2x1", "triton 8x4x4", "triton 8x4x2x128"]
    assert all(r["status"] == "ok" and int(r["bytes"]) == int(rows[0]["bytes"]) for r in rows)
    assert pooled.POOLED_LOOKUP_OVERRIDE is None
    with pytest.raises(SystemExit):
        pe.main(["--smoke", "--out", str(tmp_path), "--lookup-launches", "12x4"])  # rows not a power of two
    with pytest.raises(SystemExit):
        pe.main(["--smoke", "--out", str(tmp_path), "--lookup-launches", "16x4x2x8"])  # a register cap below 24


def test_onehot_embedding_sweep_smoke_times_each_launch_and_update(tmp_path):
    """benchmarks/onehot_embedding_sweep.py --smoke: each lookup launch, the deterministic update and (fp32) the
    atomic one with the lookup ahead of it and the update that hashes the raw values, for D=16 and 128, with
    kernels.py's byte counts; the forced launch is reset afterwards."""
    sw = load_script("onehot_embedding_sweep")
    import kernels.embedding.lookup as lookup

    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "s", "--launches", "picked,16x2"]) == 0
    rows = read_csv(tmp_path / "s.csv")
    want = [(d, t, op, la) for d in ("16", "128") for t in ("bfloat16", "float32")
            for op, la in [("fwd", "picked"), ("fwd", "16x2"), ("bwd", "picked")]
            + ([("fwd_atomic", "picked"), ("bwd_atomic", "picked"), ("bwd_atomic_hashed", "picked")]
               if t == "float32" else [])]
    assert [(r["dim"], r["dtype"], r["op"], r["launch"]) for r in rows] == want
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and r["batch"] == "8" for r in rows), rows
    assert lookup.LOOKUP_LAUNCH_OVERRIDE is None and (tmp_path / "s.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--launches", "100x3"])


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
    from dlrm.data.schema import read_metadata

    sp = load_script("step_profile")
    sample = REPO / "data" / "sample"
    cfg = load_config(REPO / "configs" / "sample.json")
    tables, batches = sp.dataset_batches(cfg, sample, 3, 64, torch.device("cpu"))
    assert tables.cardinalities == read_metadata(sample).cardinalities and len(batches) == 3
    assert all(b.dense.shape == (64, 13) and b.sparse.shape == (64, 26) and b.labels.shape == (64,) for b in batches)
    assert not torch.equal(batches[0].sparse, batches[1].sparse)
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


def test_pooled_update_sweep_smoke_times_every_plan_row(tmp_path):
    """benchmarks/pooled_update_sweep.py --smoke: every (dtype, rounding, launch) of its plan runs and is
    written (tiny tables, batch 2; the interpreter on the CPU), forced launches restored afterwards."""
    import torch

    sw = load_script("pooled_update_sweep")
    from kernels import heuristics
    from kernels.embedding import update

    shipped = update.SR_RNG
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "s"]) == 0
    rows = read_csv(tmp_path / "s.csv")
    assert [(r["dtype"], r["rounding"]) for r in rows] == [(d, r) for d, r, _ in sw.PLAN]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    assert heuristics.SPARSE_UPDATE_OVERRIDE is None and update.SR_RNG == shipped == "hash1hi"
    assert "(picked)" in rows[0]["launch"] and (tmp_path / "s.png").stat().st_size > 0
    assert {r["row_loads"] for r in rows} == {update.ROW_LOADS}
    # --row-loads times each kept row in each order, --repeats runs the plan again, interleaved
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "o", "--dtypes", "bf16", "--roundings", "nearest",
                    "--row-loads", "after_sums,with_gradients", "--repeats", "2"]) == 0
    rows = read_csv(tmp_path / "o.csv")
    launches = [c for d, r, c in sw.PLAN if d == "bf16" and r == "nearest"]
    assert [r["row_loads"] for r in rows] == ["after_sums", "with_gradients"] * 2 * len(launches)
    assert all(r["status"] == "ok" for r in rows) and update.ROW_LOADS == "prefetch_l2"
    # --evictions times each kept row with each L2 eviction setting, the shipped one restored afterwards
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "e", "--dtypes", "bf16", "--launches", "picked",
                    "--evictions", "none,rows_first_grad_last"]) == 0
    rows = read_csv(tmp_path / "e.csv")
    assert [r["eviction"] for r in rows] == ["none", "rows_first_grad_last"]
    assert all(r["status"] == "ok" for r in rows) and update.EVICTION == "grad_last"
    # --carry-chunks times each kept row with each carry-kernel block of chunks, the shipped one restored afterwards
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "c", "--dtypes", "bf16", "--launches", "picked",
                    "--carry-chunks", "1,8"]) == 0
    rows = read_csv(tmp_path / "c.csv")
    assert [r["carry_chunks"] for r in rows] == ["1", "8"] and all(r["status"] == "ok" for r in rows)
    assert update.CARRY_CHUNKS is None and "| 8 |" in (tmp_path / "c.md").read_text()
    # by default each launch's own carry_chunks, written as the number it is
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "d", "--dtypes", "bf16", "--launches",
                    "picked,16:32:1:1:4"]) == 0
    picked = heuristics.sparse_update_config(128, torch.bfloat16, multi_hot=True).carry_chunks
    assert [r["carry_chunks"] for r in read_csv(tmp_path / "d.csv")] == [str(picked), "4"]
    # --picks times each kept row with each way of writing the chunk partials, the shipped one restored afterwards
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "p", "--dtypes", "bf16", "--launches", "picked",
                    "--picks", "sum,store"]) == 0
    rows = read_csv(tmp_path / "p.csv")
    assert [r["pick"] for r in rows] == ["sum", "store"] and all(r["status"] == "ok" for r in rows)
    assert update.PARTIAL_PICK == "store" and "| sum |" in (tmp_path / "p.md").read_text()
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--picks", "both"])
    # --maxnregs times each kept row with each register cap of the chunk kernel (the interpreter ignores it), the
    # override reset after
    assert sw.main(["--smoke", "--out", str(tmp_path), "--name", "r", "--dtypes", "bf16", "--launches", "picked",
                    "--maxnregs", "launch,none,120"]) == 0
    rows = read_csv(tmp_path / "r.csv")
    own = heuristics.sparse_update_config(128, torch.bfloat16, multi_hot=True).chunk_maxnreg
    assert [r["maxnreg"] for r in rows] == [str(own or "none"), "none", "120"]
    assert all(r["status"] == "ok" for r in rows)
    assert update.CHUNK_MAXNREG is None and "| 120 |" in (tmp_path / "r.md").read_text()
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--maxnregs", "8"])
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--row-loads", "sideways"])
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--evictions", "evict_sometimes"])
    with pytest.raises(SystemExit):
        sw.main(["--smoke", "--out", str(tmp_path), "--carry-chunks", "12"])
    # a launch's sixth and seventh numbers: group sums (0/1) and the chunk kernel's register cap (0: none)
    assert sw.parse_launches("16:32:4:1:8:1:0,16:32:1:1:8:0:96,16:32:1:1") == [
        heuristics.SparseUpdateConfig(16, 32, 4, 1, 8, True, None),
        heuristics.SparseUpdateConfig(16, 32, 1, 1, 8, False, 96), heuristics.SparseUpdateConfig(16, 32, 1, 1)]
    for bad in ("16:32:4:1:8:2", "16:32:4:1:0", "16:32:4", "16:32:4:1:8:1:0:5", "16:x:4:1"):
        with pytest.raises(ValueError, match="is not chunk:carry_block"):
            sw.parse_launches(bad)


def test_stream_overlap_smoke_times_each_pair_alone_in_series_and_side_by_side(tmp_path):
    """benchmarks/stream_overlap.py --smoke: each pair's parts alone, one after the other and on two streams
    (on the CPU: one after the other, a check of the script), written as CSV, Markdown and a plot; unknown
    pairs refused."""
    so = load_script("stream_overlap")
    pairs = "update||wgrads,sort||fwd_gemms,sort||update_presorted"
    assert so.main(["--smoke", "--out", str(tmp_path), "--pairs", pairs]) == 0
    rows = read_csv(tmp_path / "stream_overlap.csv")
    assert [(r["a"], r["b"]) for r in rows] == [("update", "wgrads"), ("sort", "fwd_gemms"), ("sort", "update_presorted")]
    for r in rows:
        par = ("par_ms", "par_a_hi_ms", "par_b_hi_ms")
        assert all(float(r[k]) > 0 for k in ("a_ms", "b_ms", "seq_ms", *par)), r
        assert math.isclose(float(r["gain_ms"]), float(r["seq_ms"]) - min(float(r[k]) for k in par),
                            rel_tol=1e-6, abs_tol=1e-9)
        assert int(r["batch"]) == 2 and r["device"]
    assert "update \\|\\| wgrads" in (tmp_path / "stream_overlap.md").read_text()
    assert (tmp_path / "stream_overlap.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        so.main(["--smoke", "--out", str(tmp_path), "--pairs", "update||lookup", "--overwrite"])
    # the collectives' pairs: without torchrun a local copy of the same bytes, and the Markdown says so
    assert so.main(["--smoke", "--out", str(tmp_path), "--pairs", "a2a||sort,allreduce||update", "--overwrite"]) == 0
    rows = read_csv(tmp_path / "stream_overlap.csv")
    assert [(r["a"], r["b"], r["world"]) for r in rows] == [("a2a", "sort", "1"), ("allreduce", "update", "1")]
    assert all(float(r["a_ms"]) > 0 for r in rows)
    assert "local copies" in (tmp_path / "stream_overlap.md").read_text()


def test_stream_overlap_repeats_each_pair_at_each_sm_carveout(tmp_path):
    """--sm-carveouts: every pair once per carve-out, each row's gain against the uncarved "A then B" of the same
    pair (on the CPU the carve-out changes nothing: a check of the bookkeeping); bad lists refused."""
    so = load_script("stream_overlap")
    assert so.main(["--smoke", "--out", str(tmp_path), "--pairs", "sort||fwd_gemms", "--sm-carveouts", "0,8"]) == 0
    rows = read_csv(tmp_path / "stream_overlap.csv")
    assert [(r["pair"], r["sm_carveout"]) for r in rows] == [("sort||fwd_gemms", "0"), ("sort||fwd_gemms", "8")]
    uncarved_seq = float(rows[0]["seq_ms"])
    for r in rows:
        best = min(float(r[k]) for k in ("par_ms", "par_a_hi_ms", "par_b_hi_ms"))
        assert math.isclose(float(r["gain_vs_uncarved_ms"]), uncarved_seq - best, rel_tol=1e-6, abs_tol=1e-9)
    assert "| sort \\|\\| fwd_gemms | 8 |" in (tmp_path / "stream_overlap.md").read_text()
    assert not hasattr(torch._C, "_get_sm_carveout_experimental") or torch._C._get_sm_carveout_experimental() is None
    for bad in ("-1", "a", ","):
        with pytest.raises(SystemExit):
            so.main(["--smoke", "--out", str(tmp_path), "--pairs", "sort||fwd_gemms", "--sm-carveouts", bad])


def test_stream_overlap_collectives_match_the_exchange_and_ddp_sizes():
    """`Collectives` sends what a two-rank MLPerf step's all_to_all sends (a rank's samples of half the features,
    for every rank) and `dense_params` counts what DDP all-reduces: the bottom MLP's, cross network's and top MLP's
    parameters, as the modules hold them."""
    import torch

    from dlrm.model.archs import LowRankCrossNet

    so = load_script("stream_overlap")
    cfg = {"cross_rank": 4, "cross_layers": 2, "bottom_mlp": [8, 4], "top_mlp": [6, 1]}
    width = 3 * 4
    bottom = torch.nn.Sequential(torch.nn.Linear(13, 8), torch.nn.Linear(8, 4))
    top = torch.nn.Sequential(torch.nn.Linear(width, 6), torch.nn.Linear(6, 1))
    cross = LowRankCrossNet(width, num_layers=2, low_rank=4)
    assert so.dense_params(cfg, width) == sum(p.numel() for m in (bottom, cross, top) for p in m.parameters())
    comm = so.Collectives(batch=5, features=3, dim=4, params=7, device=torch.device("cpu"))
    assert tuple(comm.send.shape) == (1 * 5 * 3, 4) and comm.send.dtype == torch.bfloat16
    comm.a2a()
    comm.allreduce()
    assert torch.equal(comm.recv, comm.send) and torch.equal(comm.grads_copy, comm.grads)


def test_cross_layer_smoke_times_the_network_and_each_forward_tile(tmp_path):
    """benchmarks/cross_layer.py --smoke: the 3-layer network (eager and Triton) and one layer's forward (cuBLAS +
    elementwise, the Triton kernel per tile, with and without the saved pre-activation) all run and are written;
    the forced tile is restored and a malformed tile refused."""
    cl = load_script("cross_layer")
    from kernels import heuristics

    assert cl.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "cross_layer.csv")
    torch_impl = "inductor" if torch.cuda.is_available() else "eager"  # compiled on a GPU
    assert [(r["case"], r["impl"]) for r in rows[:4]] == [("net fwd+bwd", torch_impl), ("net fwd", torch_impl),
                                                          ("net fwd+bwd", "triton"), ("net fwd", "triton")]
    fused = [(r["tile"], r["store_pre"]) for r in rows if r["impl"] == "triton fused"]
    assert fused == [("picked", "True"), ("picked", "False"), ("64x128x64s4w4", "True"), ("64x128x64s4w4", "False")]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    assert heuristics.CROSS_TILE_OVERRIDE is None
    assert cl.parse_tile("64x128x64s4w4") == heuristics.GemmTile(64, 128, 64, 4, 4) and cl.parse_tile("picked") is None
    assert (tmp_path / "cross_layer.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        cl.main(["--smoke", "--out", str(tmp_path), "--tiles", "64x128"])


def test_wgrad_benchmark_smoke_times_torch_and_the_kernel(tmp_path):
    """benchmarks/wgrad.py --smoke: each smoke shape timed with PyTorch and the fused weight-gradient kernel, the
    results checked against float64 (no WRONG rows), and the CSV / Markdown / PNG written."""
    wb = load_script("wgrad")
    assert wb.main(["--smoke", "--out", str(tmp_path), "--name", "w"]) == 0
    rows = read_csv(tmp_path / "w.csv")
    impls = ["torch", "triton"] if not torch.cuda.is_available() else ["torch", "inductor", "triton"]
    assert [(r["layer"], r["impl"]) for r in rows] == [(s[1], i) for s in wb.SMOKE_SHAPES for i in impls]
    assert all(r["status"] == "" and float(r["ms"]) > 0 for r in rows), rows
    assert {"device", "torch", "triton", "date"} <= set(rows[0])
    assert "Sum over a model's layers" in (tmp_path / "w.md").read_text() and (tmp_path / "w.png").stat().st_size > 0


def test_cross_tma_probe_smoke_checks_and_times_every_variant(tmp_path):
    """benchmarks/cross_tma_probe.py --smoke: cuBLAS + elementwise, kernels.cross and the persistent TMA kernel
    (TMA and pointer epilogues, with and without the saved pre-activation) all run, match a float64 reference
    element by element, and are written; variant names parse to their launch keywords."""
    ctp = load_script("cross_tma_probe")
    assert ctp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "cross_tma_probe.csv")
    persistent = [(r["tile"], r["epi"], r["store_pre"]) for r in rows if r["impl"] == "persistent TMA"]
    assert persistent == [("32x32x16s2w4", "tma", "True"), ("32x32x16s2w4", "tma", "False"),
                          ("32x32x16s2w4-ptr", "ptr", "True"), ("32x32x16s2w4-ptr", "ptr", "False")]
    assert len(rows) == 7 and all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    tol = 1e-4 if not torch.cuda.is_available() else 0.1  # fp32 in the interpreter; bf16 outputs on a GPU
    assert all(float(r["max_abs_err"]) < tol for r in rows), rows
    assert ctp.parse_variant("128x256x64s3w8-flat-ws-ptr") == dict(
        bm=128, bn=256, bk=64, stages=3, warps=8, flatten=True, ws=True, epi_tma=False)
    assert "persistent TMA" in (tmp_path / "cross_tma_probe.md").read_text()


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


def test_wgrad_tma_probe_smoke_runs_both_kernels_and_restores_the_switches(tmp_path):
    """benchmarks/wgrad_tma_probe.py --smoke: each smoke layer through the pointer kernel and the TMA kernel, checked
    against float64 and written; kernels.wgrad's switches are restored after each call."""
    import kernels.wgrad as wg

    wtp = load_script("wgrad_tma_probe")
    assert wtp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "wgrad_tma_probe.csv")
    assert [(r["layer"], r["impl"]) for r in rows] == [("a", "pointer loads"), ("a", "TMA"), ("b", "pointer loads"),
                                                       ("b", "TMA")]
    assert all(r["status"] == "ok" and float(r["max_abs_err"]) < 1e-4 and float(r["ms"]) > 0 for r in rows), rows
    assert (wg.TMA_OPERANDS, wg.TMA_STAGES) == (None, 3)


def test_gemm_layout_probe_smoke_times_eight_layouts_of_every_step_gemm(tmp_path):
    """benchmarks/gemm_layout_probe.py --smoke: each GEMM of the DCNv2 step (cross V and W, the top MLP's layers but
    the 1-wide one; forward, data and weight gradient) in the eight (A, B, C) layouts, each checked against float64,
    exactly one 'as run' row per GEMM, the summary and chart written."""
    glp = load_script("gemm_layout_probe")
    assert glp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "gemm_layout_probe.csv")
    gemms = {(r["gemm"], r["pass"]) for r in rows}
    assert gemms == {(g, p) for g in ("cross V", "cross W", "top.0", "top.1") for p in ("fwd", "dgrad", "wgrad")}
    for key in gemms:
        mine = [r for r in rows if (r["gemm"], r["pass"]) == key]
        assert len({(r["a"], r["b"], r["c"]) for r in mine}) == 8 and sum(r["as_run"] == "True" for r in mine) == 1
    # Against float64 of the same inputs, relative to the output's largest value: fp32 on the CPU. On CUDA, bf16:
    # the output rounded to bf16 (2**-9) and, for outputs this small, cuBLAS's split-K partial sums, which PyTorch
    # lets it reduce in bf16 (allow_bf16_reduced_precision_reduction): up to ~2 x 2**-9 a split, 2**-5 for 8 splits;
    # FP8 rows: e4m3 operands (3 mantissa bits, 2**-4 each at worst). A wrong layout (a transposed operand) is off
    # by the output's own size. The quantization row has no error of its own.
    tolerance = {"fp32": 1e-5, "bf16": 2**-5, "fp8 tensorwise": 2**-3, "fp8 rowwise": 2**-3}
    for r in rows:
        assert r["status"] == "ok" and float(r["ms"]) > 0, r
        assert r["impl"] not in tolerance or float(r["max_rel_err"]) < tolerance[r["impl"]], r
    assert "bf16" in {r["impl"] for r in rows} if torch.cuda.is_available() else {r["impl"] for r in rows} == {"fp32"}
    fwd = next(r for r in rows if r["gemm"] == "cross V" and r["pass"] == "fwd")
    assert (fwd["M"], fwd["N"], fwd["K"]) == ("64", "16", "48")
    assert "best layout" in (tmp_path / "gemm_layout_probe.md").read_text()
    assert (tmp_path / "gemm_layout_probe.png").stat().st_size > 0


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("source", ["row", "col"])
@pytest.mark.parametrize("major", ["row", "col"])
def test_gemm_layout_probe_tensorwise_fp8_operands_are_in_the_layout_scaled_mm_takes(major, source):
    """The probe's tensorwise FP8 operands (A row-major, B column-major for ``torch._scaled_mm``) have the layout
    asked for and the input's values within e4m3's rounding (half an ulp: 2**-4 relative for normals, 2**-10 absolute
    below the smallest normal 2**-6, in units of the scale); the
    probe once built B row-major from a row-major input, and every tensorwise row failed on the GPU. Odd shapes; the
    input row-major or column-major (non-contiguous)."""
    glp = load_script("gemm_layout_probe")
    x = torch.randn(5, 7, dtype=torch.float64) if source == "row" else torch.randn(7, 5, dtype=torch.float64).t()
    q, scale = glp.tensorwise_fp8(x, major)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.dtype == torch.float32
    assert q.stride() == ((7, 1) if major == "row" else (1, 5))
    assert float(q.float().abs().max()) == torch.finfo(torch.float8_e4m3fn).max  # the largest value maps to e4m3's max
    back = q.double() * scale.double()
    torch.testing.assert_close(back, x, rtol=2**-4, atol=2**-10 * float(scale))


def test_fp8_dense_probe_smoke_runs_each_variant_and_measures_its_error(tmp_path):
    """benchmarks/fp8_dense_probe.py --smoke: bf16 and the three FP8 variants run forward + backward, their errors
    against float64 are finite, bf16's the smallest; unknown variants are refused."""
    fdp = load_script("fp8_dense_probe")
    assert fdp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "fp8_dense_probe.csv")
    assert [r["variant"] for r in rows] == list(fdp.VARIANTS)
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows), rows
    err = {r["variant"]: float(r["err_dx0"]) for r in rows}
    assert 0 < err["bf16"] < min(err["fp8 cross"], err["fp8 top"], err["fp8 cross + top"]) < 1
    assert "rowwise FP8" in (tmp_path / "fp8_dense_probe.md").read_text()
    with pytest.raises(SystemExit):
        fdp.main(["--smoke", "--out", str(tmp_path), "--variants", "fp4"])


def test_fp8_dense_probe_kernel_report_sums_each_kind_per_variant():
    """--profile's table: a kernel counted once, under the first kind its name matches (an FP8 GEMM is not counted
    as a bf16 one), each variant's column summing to its kernels' total."""
    fdp = load_script("fp8_dense_probe")
    assert fdp.kernel_kind("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n") == "FP8 GEMMs"
    assert fdp.kernel_kind("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "FP8 GEMMs"
    assert fdp.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "bf16 GEMMs"
    assert fdp.kernel_kind("triton_per_fused_abs_amax_0") == "Inductor fused kernels"
    assert fdp.kernel_kind("Memset (Device)") == "other"
    lines = fdp.kernel_report({"bf16": [("nvjet_a", 1.25, 2), ("triton_poi_1", 0.5, 1)],
                               "fp8": [("gemm_e4m3_b", 0.75, 2), ("triton_red_2", 0.25, 3), ("memcpy", 0.125, 1)]})
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in lines[2:7]}
    assert rows["FP8 GEMMs"] == ["0.000", "0.750"] and rows["bf16 GEMMs"] == ["1.250", "0.000"]
    assert rows["Inductor fused kernels"] == ["0.500", "0.250"] and rows["other"] == ["0.000", "0.125"]
    assert rows["all kernels"] == ["1.750", "1.125"]
    assert "| triton_red_2 | Inductor fused kernels | 3 | 0.250 |" in lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cross_ws_probe_refuses_to_run_without_cuda(tmp_path, capsys):
    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_probe")
    assert probe.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cublaslt_drelu_probe_refuses_to_run_without_cuda(tmp_path, capsys):
    probe = load_script("cublaslt_drelu_probe")
    assert probe.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cublaslt_drelu_probe_unpacks_a_column_major_bitmask():
    """Bit i of column j in byte [i // 8, j] (LSB first), rows padded to 16 bytes: the layout the probe reads."""
    probe = load_script("cublaslt_drelu_probe")
    gen = torch.Generator().manual_seed(0)
    n, batch = 19, 5  # 19 rows -> 3 bytes, padded to 16
    mask = torch.rand(batch, n, generator=gen) > 0.5
    aux = torch.zeros(16, batch, dtype=torch.uint8)
    for j in range(batch):
        for i in range(n):
            aux[i // 8, j] |= int(mask[j, i]) << (i % 8)
    assert torch.equal(probe.unpack_bits(aux, n, batch), mask)


def test_cross_ws_probe_parses_both_schedules():
    pytest.importorskip("kernels.cross_ws", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_probe")
    coop = probe.parse_config("coop:128x128x64s4u32q2m8r160e4")
    assert (coop.schedule, coop.bm, coop.stages, coop.sub, coop.epi_stages, coop.mma_regs) == ("coop", 128, 4, 32, 2, 160)
    ping = probe.parse_config("64x128x64s3r200")
    assert (ping.schedule, ping.bm, ping.stages, ping.consumer_regs) == ("pingpong", 64, 3, 200)
    for text in probe.DEFAULT_CONFIGS.split(","):
        probe.parse_config(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cross_bwd_passes_refuses_to_run_without_cuda(tmp_path, capsys):
    bench = load_script("cross_bwd_passes")
    with pytest.raises(SystemExit) as info:
        bench.main(["--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_cross_bwd_passes_parses_every_default_launch():
    bench = load_script("cross_bwd_passes")
    assert bench.parse_launch("64x128r512w8") == (64, 128, 512, 8)
    assert all(len(bench.parse_launch(t)) == 4 for t in bench.LAUNCHES.split(","))


def test_cross_ws_head_probe_parses_launches_and_refuses_without_hopper(tmp_path):
    """benchmarks/cross_ws_head_probe.py: the launch syntax, and a clear error (exit 2) where no Hopper GPU is."""
    pytest.importorskip("kernels.cross_ws_head", reason="this Triton has no Gluon Hopper dialect")
    probe = load_script("cross_ws_head_probe")
    cfg = probe.parse_config("128x128x64s3e4")
    assert (cfg.bm, cfg.bn, cfg.bk, cfg.stages, cfg.epi_stages, cfg.schedule) == (128, 128, 64, 3, 4, "coop")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("a Hopper GPU is here: the probe would run")
    with pytest.raises(SystemExit) as e:
        probe.main(["--out", str(tmp_path)])
    assert e.value.code == 2


def test_mask_bias_launches_smoke_times_each_launch_and_checks_it_against_the_shipped_one(tmp_path):
    """benchmarks/mask_bias_launches.py --smoke: every launch timed over the seven ReLU layers, its masked gradients
    equal to the shipped launch's, CSV and Markdown written, the module's launch constants put back; a malformed
    launch refused."""
    from kernels import mlp

    mb = load_script("mask_bias_launches")
    assert mb.main(["--smoke", "--out", str(tmp_path), "--launches", "32x4p4,16x2p8"]) == 0
    assert mlp.MASK_LAUNCH_OVERRIDE is None
    rows = read_csv(tmp_path / "mask_bias_launches.csv")
    assert [r["launch"].split()[0] for r in rows] == ["32x4p4", "16x2p8"]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and float(r["max_bias_diff"]) < 1e-4 for r in rows), rows
    assert "| 16x2p8 |" in (tmp_path / "mask_bias_launches.md").read_text()
    with pytest.raises(SystemExit):
        mb.main(["--smoke", "--out", str(tmp_path), "--launches", "32x4"])


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


def test_gluon_mutants_still_apply_to_the_kernels():
    """Each mutant of benchmarks/gluon_mutants.py names text that is in its kernel at that occurrence, and changes
    it: a kernel edit that moves the text fails here, not on the GPU after a device call."""
    gm = load_script("gluon_mutants")
    assert len({m[0].split()[0] for m in gm.MUTANTS}) == len(gm.MUTANTS)
    for name, path, old, new, occurrence, tests in gm.MUTANTS:
        source = (REPO / path).read_text()
        mutated = gm.mutate(source, old, new, occurrence)
        assert mutated != source and len(mutated) == len(source) - len(old) + len(new), name
        assert (REPO / tests[0]).exists(), name
    with pytest.raises(ValueError, match="occurrence 3 of 'pred=k > 0' not found"):
        gm.mutate((REPO / gm.FWD).read_text(), "pred=k > 0", "", 3)
    assert [gm.verdict(rc) for rc in (0, 1, 2, "timeout")] == ["survived", "killed", "killed", "killed (hang)"]
