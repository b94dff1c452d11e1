"""benchmarks/step_clocks.py: nvidia-smi samples parsed, given to their phase and summarized (the run itself needs a
GPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.test_benchmark_scripts import load_script

sc = load_script("step_clocks")


def test_samples_parsed_labelled_and_summarized():
    lines = ["timestamp, clocks.sm [MHz], ...",  # a header, skipped
             "2026/11/29 10:00:00.000, 345, 3201, 120.5, 30, 0x0000000000000001",
             "2026/11/29 10:00:01.000, 1980, 3201, 400.0, 40, 0x0000000000000000",
             "2026/11/29 10:00:02.000, 1755, 3201, 699.0, 50, 0x0000000000000004",
             "2026/11/29 10:00:03.000, 1650, 3201, 701.5, 55, 0x0000000000000024",
             "2026/11/29 10:00:04.000, [N/A], 3201, 700.0, 55, 0x0"]  # not a number: skipped
    samples = sc.parse_samples(lines)
    assert [s["sm_mhz"] for s in samples] == [345.0, 1980.0, 1755.0, 1650.0]
    assert [s["t"] - samples[0]["t"] for s in samples] == [0.0, 1.0, 2.0, 3.0]
    t0 = samples[0]["t"]
    sc.label_phases(samples, [("idle before", 0.0, t0 + 0.5), ("steps", t0 + 0.5, t0 + 3.5)])
    assert [s["phase"] for s in samples] == ["idle before", "steps", "steps", "steps"]
    steps = sc.summarize(samples, "steps")
    assert (steps["samples"], steps["sm_mhz"], steps["sm_min"], steps["sm_max"]) == (3, 1755.0, 1650.0, 1980.0)
    assert (steps["power_w"], steps["power_max"]) == (699.0, 701.5)
    assert steps["power cap (software)"] == pytest.approx(2 / 3) and steps["thermal (software)"] == pytest.approx(1 / 3)
    assert steps["idle"] == 0.0 and sc.summarize(samples, "idle before")["idle"] == 1.0
    assert sc.summarize(samples, "GEMM") is None
    assert sc.label_phases([dict(t=t0 + 9)], [("steps", t0, t0 + 1)])[0]["phase"] == "between"


def test_main_refuses_without_cuda_or_with_a_bad_gemm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        sc.main(["--out", "unused"])
    assert e.value.code == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any device is touched
    for bad in (["--gemm", "1,2"], ["--gemm", "a,b,c"], ["--gemm", "1,0,3"], ["--windows", "0"], ["--sync-every", "0"],
                ["--seconds", "0"], ["--gemm-operands", "normal,ones"], ["--gemm-operands", ","],
                ["--kernels", "copy,matmul"]):
        with pytest.raises(SystemExit) as e:
            sc.main([*bad, "--out", "unused"])
        assert e.value.code == 2


def test_gemm_operands():
    normal, relu, zeros = (sc.gemm_operand(k, (4096, 16), "cpu") for k in sc.GEMM_OPERANDS)
    assert all(t.dtype == torch.bfloat16 and t.shape == (4096, 16) for t in (normal, relu, zeros))
    assert float((normal == 0).float().mean()) < 0.01 and bool((normal < 0).any())
    assert 0.45 < float((relu == 0).float().mean()) < 0.55 and bool((relu >= 0).all())
    assert not bool(zeros.any())


def test_kernel_phases_name_what_they_run():
    assert set(sc.KERNELS) == {"copy", "cross_fwd", "gemm_bf16", "gemm_fp8"}
    fn, nbytes, flop = sc.kernel_phase("copy", "cpu", copy_numel=1000)  # runs anywhere; cross_fwd needs a Hopper GPU
    dst = fn()
    assert nbytes == 2 * 1000 * 2 and flop == 0 and dst.shape == (1000,) and bool(dst.ne(0).any())


def test_gemm_phases_compute_the_same_product_in_bf16_and_fp8():
    """The two GEMM phases multiply the same operands (same seed): the FP8 product is the bf16 one within e4m3's
    rounding (3 mantissa bits), and not bit for bit (it was quantized). Counts: 2MNK FLOP; bf16 operands 2 bytes an
    element, e4m3 ones 1, both outputs bf16. On the GPU when there is one: torch 2.11's CPU ``_scaled_mm`` takes only
    per-tensor scales (newer ones take rowwise scales too); cuBLASLt wants every dimension a multiple of 16."""
    M, N, K = 48, 16, 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    products = {}
    for name in ("gemm_bf16", "gemm_fp8"):
        torch.manual_seed(0)
        fn, nbytes, flop = sc.kernel_phase(name, device, gemm_shape=(M, N, K))
        products[name] = fn().float()
        assert flop == 2 * M * N * K and products[name].shape == (M, N)
        assert nbytes == ((M * K + K * N) * 2 if name == "gemm_bf16" else M * K + K * N) + M * N * 2
    bf16, fp8 = products["gemm_bf16"], products["gemm_fp8"]
    rel = float((fp8 - bf16).norm() / bf16.norm())
    assert 1e-3 < rel < 0.06, rel


def test_sampler_reads_lines_a_buffering_child_wrote_before_it_was_stopped():
    """A child whose output is block-buffered into a pipe (Python's, as nvidia-smi's) and which is stopped while
    still running: every line it printed arrives, because it writes to a pseudo-terminal (line-buffered)."""
    import time

    code = "import time\nfor i in range(40):\n    print(f'{i},x')\n    time.sleep(0.005)\ntime.sleep(60)"
    sampler = sc.Sampler([sys.executable, "-c", code])
    deadline = time.time() + 20
    while sum(c.count("\n") for c in sampler.chunks) < 40 and time.time() < deadline:
        time.sleep(0.05)
    lines = sampler.stop()
    assert lines == [f"{i},x" for i in range(40)]
