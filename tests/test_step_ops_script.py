"""benchmarks/step_ops.py: kernels given to the op that launched them, GEMMs' FLOPs, a GEMM timed alone on the
recorded layout (CUDA), the whole script on a tiny config (CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_benchmark_scripts import REPO, load_script

so = load_script("step_ops")


def ev(name, cat, ts, dur, tid=1, pid=1, **args):
    return dict(name=name, cat=cat, ph="X", ts=ts, dur=dur, pid=pid, tid=tid, args=args)


def mm_args(dims, strides, types=("c10::BFloat16", "c10::BFloat16")):
    return {"Input Dims": dims, "Input Strides": strides, "Input type": list(types)}


def test_kernels_go_to_the_innermost_op_open_on_the_launching_thread():
    trace = {"traceEvents": [
        # main thread: a matmul whose mm launches a GEMM; a sibling op that ended before the second launch
        ev("aten::matmul", "cpu_op", 0, 100),
        ev("aten::mm", "cpu_op", 10, 30, **mm_args([[4, 8], [8, 2]], [[8, 1], [1, 8]])),
        ev("cudaLaunchKernel", "cuda_runtime", 20, 5, correlation=1),
        ev("aten::fill_", "cpu_op", 45, 5),
        ev("cuLaunchKernelEx", "cuda_driver", 60, 5, correlation=2),  # inside matmul only, after fill_ ended
        # the autograd engine's thread: an addmm_ open there while the main thread is elsewhere
        ev("aten::addmm_", "cpu_op", 15, 40, tid=2, **mm_args([[4, 2], [4, 8], [8, 2]], [[2, 1], [8, 1], [2, 1]])),
        ev("cudaLaunchKernel", "cuda_runtime", 30, 5, tid=2, correlation=3),
        ev("cudaMemsetAsync", "cuda_runtime", 200, 5, correlation=4),  # no op open
        ev("gemm_a", "kernel", 40, 10, tid=7, correlation=1),
        ev("triton_poi", "kernel", 70, 3, tid=7, correlation=2),
        ev("gemm_b", "kernel", 80, 20, tid=7, correlation=3),
        ev("Memset", "gpu_memset", 210, 1, tid=7, correlation=4),
        ev("orphan", "kernel", 300, 2, tid=7, correlation=99),  # its launch is not in the trace
        ev("aten::mm", "cpu_op", 500, 10, **mm_args([[1, 1], [1, 1]], [[1, 1], [1, 1]])),  # launches nothing
    ]}
    got = [(k["kernel"], k["op"], k["us"], k["dims"]) for k in so.kernels_by_op(trace)]
    assert got == [("gemm_a", "aten::mm", 10.0, [[4, 8], [8, 2]]), ("triton_poi", "aten::matmul", 3.0, None),
                   ("gemm_b", "aten::addmm_", 20.0, [[4, 2], [4, 8], [8, 2]]), ("Memset", "(no op)", 1.0, None),
                   ("orphan", "(no op)", 2.0, None)]
    assert so.kernels_by_op(trace)[2]["strides"] == [[2, 1], [8, 1], [2, 1]]


def test_gemm_flops_by_op_and_none_for_other_ops():
    assert so.gemm_gflop("aten::mm", [[65536, 512], [512, 3456], [65536, 3456]]) == 2 * 65536 * 512 * 3456 / 1e9
    assert so.gemm_gflop("aten::addmm", [[3456], [65536, 1024], [1024, 3456], [], []]) == 2 * 65536 * 1024 * 3456 / 1e9
    assert so.gemm_gflop("aten::addmm_", [[3, 5], [3, 7], [7, 5]]) == 2 * 3 * 5 * 7 / 1e9
    assert so.gemm_gflop("aten::_addmm_activation", [[5], [3, 7], [7, 5], [], [], []]) == 2 * 3 * 5 * 7 / 1e9
    assert so.gemm_gflop("aten::add", [[3, 5], [3, 5]]) is None
    assert so.gemm_gflop("aten::mm", None) is None
    assert so.gemm_gflop("aten::mm", [[3, 5, 2], [5, 2]]) is None  # not a matrix product of 2-D operands


def test_aggregate_adds_up_each_op_shape_and_kernel_per_step():
    k = dict(op="aten::mm", kernel="nvjet_x", dims=[[64, 32], [32, 16]], strides=[[32, 1], [16, 1]],
             dtypes=["c10::BFloat16"] * 2)
    other = dict(k, dims=[[64, 32], [32, 8]])
    copy = dict(op="aten::copy_", kernel="elementwise", dims=None, strides=None, dtypes=None)
    kernels = [dict(k, us=10.0), dict(k, us=30.0), dict(other, us=4.0), dict(copy, us=50.0)]
    rows = so.aggregate(kernels, steps=2)
    assert [(r["op"], json.loads(r["dims"]) if r["dims"] != "null" else None) for r in rows] == [
        ("aten::copy_", None), ("aten::mm", [[64, 32], [32, 16]]), ("aten::mm", [[64, 32], [32, 8]])]
    copy_row, big, small = rows
    assert (big["calls_per_step"], big["ms_per_step"], big["ms_per_call"]) == (1.0, 0.02, 0.02)
    assert big["gflop"] == 2 * 64 * 32 * 16 / 1e9 and big["tflops"] == pytest.approx(big["gflop"] / 0.02)
    assert (small["calls_per_step"], small["ms_per_call"]) == (0.5, 0.004)
    assert "gflop" not in copy_row and copy_row["ms_per_step"] == 0.025


def test_gemm_rows_merge_the_kernels_of_one_call():
    """cuBLASLt's split-K GEMM and its reduction kernel are one call of the op: one row, their times added."""
    base = dict(op="aten::mm", dims="[[8, 4], [4, 2]]", strides="[[4, 1], [2, 1]]", dtypes="[]", gflop=1e-6)
    rows = [dict(base, kernel="nvjet_splitK", calls_per_step=3, ms_per_step=0.3),
            dict(base, kernel="splitKreduce", calls_per_step=3, ms_per_step=0.06),
            dict(base, strides="[[1, 8], [2, 1]]", kernel="nvjet_other", calls_per_step=1, ms_per_step=0.5),
            dict(op="aten::copy_", dims="null", strides="null", dtypes="null", kernel="copy", calls_per_step=1,
                 ms_per_step=9.0)]
    merged = so.gemm_rows(rows)
    assert [(m["kernel"], m["calls_per_step"]) for m in merged] == [("nvjet_other", 1), ("nvjet_splitK + splitKreduce", 3)]
    assert merged[1]["ms_per_call"] == pytest.approx(0.12) and merged[1]["tflops"] == pytest.approx(1e-6 / 0.12)
    assert rows[0]["kernel"] == "nvjet_splitK"  # the input rows are left as they were


def test_main_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        so.main(["--out", "unused"])
    assert e.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gemm_alone_on_the_recorded_layout_and_out_tensor():
    dims = [[256, 128], [128, 64], [256, 64]]
    col_major = [[1, 256], [64, 1], [1, 256]]  # A and the out tensor column-major
    bf16 = ["c10::BFloat16"] * 3
    ms, status = so.time_gemm_alone("aten::mm", dims, col_major, bf16, torch.device("cuda"), repeats=3, windows=2)
    assert ms is not None and ms > 0 and status == "ok"
    ms, status = so.time_gemm_alone("aten::addmm_", [[256, 64], [256, 128], [128, 64]], None, bf16,
                                    torch.device("cuda"), repeats=3, windows=2)
    assert ms > 0 and status == "ok"
    ms, status = so.time_gemm_alone("aten::mm", dims, None, ["c10::Quantized"] * 3, torch.device("cuda"))
    assert ms is None and status.startswith("not rebuilt: KeyError")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_script_on_a_small_model(tmp_path):
    assert so.main(["--config", str(REPO / "configs" / "kaggle.json"), "--max-rows", "10000", "--batch-size", "2048",
                    "--variant", "compiled", "--steps", "2", "--warmup", "2", "--repeats", "3", "--out", str(tmp_path),
                    "--name", "so"]) == 0
    rows = list(__import__("csv").DictReader(open(tmp_path / "so.csv")))
    gemms = [r for r in rows if r["gflop"]]
    assert gemms and all(r["op"] in so.GEMM_OPS for r in gemms)
    assert all(r["alone_status"] == "ok" and float(r["alone_ms_per_call"]) > 0 for r in gemms), gemms
    assert rows[: len(gemms)] == gemms and any(not r["gflop"] for r in rows)  # GEMM calls first, then other ops
    assert (tmp_path / "so.md").read_text().count("| aten::") >= len(gemms)
    assert (tmp_path / "so.png").stat().st_size > 0
