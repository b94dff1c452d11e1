"""kernels/heuristics.py: the SM count comes from the device, rules and tile choices by name."""

from __future__ import annotations

import pytest
import torch

from kernels import heuristics
from kernels.heuristics import (
    DEFAULT_SM_COUNT,
    GEMM_TILES,
    INTERPRETER_GEMM_TILE,
    dot_block,
    gemm_tiles,
    interaction_launch,
    lookup_launch,
    pick_gemm_tile,
    pooled_lookup_launch,
    rows_per_program,
    sm_count,
    sparse_update_config,
)


def test_lookup_launch_takes_128_rows_up_to_d128_and_the_gather_default_beyond():
    """The one-hot lookup's launch measured on the H100 (results/onehot_embedding_launch.md): 128 rows x 4 warps
    for rows up to 128 wide; wider rows keep the gather kernels' ~4K elements a program (not measured)."""
    assert [lookup_launch(d) for d in (16, 32, 128)] == [(128, 4)] * 3
    assert lookup_launch(256) == (rows_per_program(256), 4) == (16, 4)


def test_pooled_lookup_launch_unrolls_two_slots_of_128_samples_at_d128_only():
    """Measured at MLPerf's D=128 only (results/pooled_lookup_unroll.md); other widths keep one slot a step."""
    assert pooled_lookup_launch(128) == (128, 4, 2)
    assert [pooled_lookup_launch(d) for d in (16, 64, 256)] == [(rows_per_program(d), 4, 1) for d in (16, 64, 256)]


def test_sm_count_default_off_cuda():
    assert sm_count("cpu") == sm_count(torch.device("cpu")) == sm_count(None) == DEFAULT_SM_COUNT == 132


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sm_count_from_the_device():
    want = torch.cuda.get_device_properties(0).multi_processor_count
    assert sm_count("cuda:0") == want
    with torch.cuda.device(0):
        assert sm_count("cuda") == want


def test_sm_count_asks_the_driver_once_per_device(monkeypatch):
    calls = []

    class Props:
        multi_processor_count = 78

    def fake_properties(index):
        calls.append(index)
        return Props()

    heuristics._cuda_sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake_properties)
    try:
        assert [sm_count("cuda:1") for _ in range(3)] == [78, 78, 78]
        assert sm_count(torch.device("cuda", 2)) == 78
        assert calls == [1, 2]
    finally:
        heuristics._cuda_sm_count.cache_clear()


@pytest.mark.parametrize("block_d,rows", [(1, 256), (16, 256), (32, 128), (128, 32), (4096, 1), (8192, 1)])
def test_rows_per_program(block_d, rows):
    assert rows_per_program(block_d) == rows


@pytest.mark.parametrize("n,block", [(1, 16), (16, 16), (17, 32), (27, 32), (128, 128), (129, 256)])
def test_dot_block(n, block):
    assert dot_block(n) == block


@pytest.mark.parametrize(
    "M,N,dtype,sms,name",
    [
        (65536, 1, torch.float32, 132, "narrow_16"),
        (65536, 32, torch.bfloat16, 132, "narrow_32"),
        (64, 512, torch.float32, 132, "small_batch"),
        (2048, 512, torch.float32, 132, "medium"),  # 64 square tiles < 132 SMs
        (2048, 512, torch.float32, 64, "square_fp32"),  # ... but they fill a 64-SM GPU
        (65536, 512, torch.float32, 132, "square_fp32"),
        (65536, 512, torch.bfloat16, 132, "square_16bit"),
    ],
)
def test_pick_gemm_tile_by_name(M, N, dtype, sms, name):
    assert pick_gemm_tile(M, N, dtype, sms) is GEMM_TILES[name]


def test_gemm_tiles_and_their_triton_configs():
    assert gemm_tiles(True) == [INTERPRETER_GEMM_TILE]
    assert gemm_tiles(False) == list(GEMM_TILES.values())
    tile = GEMM_TILES["small_batch"]
    cfg = tile.config()
    assert cfg.kwargs == {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}
    assert (cfg.num_warps, cfg.num_stages) == (2, 5)
    assert tile.launch_kwargs() == {**cfg.kwargs, "num_warps": 2, "num_stages": 5}


def test_sparse_update_config(monkeypatch):
    SUC = heuristics.SparseUpdateConfig
    assert sparse_update_config(16, torch.bfloat16) == SUC(64, 32, 4, 4)  # one-hot, narrow rows
    assert sparse_update_config(16, torch.float32) == SUC(16, 128, 1, 4)
    assert sparse_update_config(128, torch.bfloat16) == SUC(32, 64, 4, 1)  # one-hot, wide rows
    assert sparse_update_config(64, torch.float32) == SUC(32, 64, 4, 1)
    # multi-hot wide rows: hot rows finished from group sums (their Zipf-like data's walks were long); one-hot not
    # 16-bit gradients: the chunk kernel capped at 128 registers (more programs an SM;
    # results/pooled_update_chunk_latency_h200.md)
    assert sparse_update_config(128, torch.bfloat16, multi_hot=True) == SUC(16, 32, 1, 1, 8, True, 128)
    assert not any(sparse_update_config(d, t).chunk_maxnreg for d in (16, 128) for t in (torch.float32, torch.bfloat16))
    assert sparse_update_config(128, torch.float32, multi_hot=True).carry_chunks == 32  # the default
    assert sparse_update_config(128, torch.float32, multi_hot=True) == SUC(16, 16, 2, 4, group_sums=True)
    assert not any(sparse_update_config(d, t).group_sums for d in (16, 128) for t in (torch.float32, torch.bfloat16))
    assert sparse_update_config(16, torch.float32, multi_hot=True) == SUC(16, 128, 1, 4)
    monkeypatch.setattr(heuristics, "SPARSE_UPDATE_OVERRIDE", (16, 16, 4, 4))
    assert sparse_update_config(16, torch.float32) == heuristics.SparseUpdateConfig(16, 16, 4, 4)


def test_interaction_launch(monkeypatch):
    assert interaction_launch(16, torch.float32, backward=True) == (8, 2)
    assert interaction_launch(128, torch.float32, backward=True) == (1, 4)
    assert interaction_launch(128, torch.float32, backward=False) == (8, 2)
    assert interaction_launch(128, torch.bfloat16, backward=False).samples == 2
    monkeypatch.setattr(heuristics, "INTERACTION_OVERRIDE", (3, 1))
    assert interaction_launch(16, torch.float32, backward=False) == heuristics.InteractionLaunch(3, 1)


@pytest.mark.parametrize("name, h200", [("NVIDIA H200", True), ("NVIDIA GH200 144G HBM3e", True),
                                        ("NVIDIA H100 80GB HBM3", False), ("NVIDIA A100-SXM4-80GB", False)])
def test_memory_bound_launches_follow_the_gpu(name, h200, monkeypatch):
    """An H200 (HBM3e) takes its own launches of the memory-bound kernels measured on it; every other GPU the H100's;
    off CUDA (and in the interpreter) no GPU is an H200."""
    from kernels import cross_ws

    assert not heuristics.is_h200("cpu") and not heuristics.is_h200(None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(heuristics, "interpret_mode", lambda: False)
    monkeypatch.setattr(heuristics, "_cuda_device_name", lambda index: name)
    cuda = torch.device("cuda")
    assert heuristics.is_h200(cuda) is h200 and heuristics.is_h200(torch.device("cuda", 1)) is h200
    assert heuristics.cross_bwd_pass_launch(cuda) == ((128, 64, 512, 8) if h200 else (64, 128, 512, 8))
    assert heuristics.mask_bias_launch(cuda) == ((64, 4, 4) if h200 else (32, 4, 4))
    cfg = cross_ws.default_config(cuda)
    assert (cfg.sub, cfg.epi_stages) == ((64, 1) if h200 else (32, 2))
    assert heuristics.cross_bwd_pass_launch("cpu") == heuristics.CROSS_BWD_LAUNCH
    monkeypatch.setattr(heuristics, "PER_GPU_LAUNCHES", False)  # benchmarks/scaling.py --per-gpu-launches off
    assert not heuristics.is_h200(cuda) and heuristics.mask_bias_launch(cuda) == heuristics.MASK_BIAS_LAUNCH


def test_tail_launch_at_dlrm_tails(monkeypatch):
    """`kernels.mlp_tail`'s launch on a GPU (the docstring's sm_90 picks): forward 128-row tiles in 16-bit, 64 in fp32;
    backward 32 rows, 8 warps, one program an SM; RELOAD for fp32 (both orientations of a 64 x 256 tile would not fit
    in shared memory) and for 16-bit first layers wider than 64 x 256; the weights hoisted where their two copies take
    at most 128 KB (Kaggle's bottom tail in fp32 exactly: hoisted; MLPerf's bottom in fp32: not). The interpreter:
    64-row tiles, both variants in the backward."""
    from kernels.heuristics import TailLaunch, tail_launch

    monkeypatch.setattr(heuristics, "interpret_mode", lambda: True)
    assert tail_launch([256, 64, 16], torch.float32, False) == TailLaunch(64, 4, 1)
    assert tail_launch([256, 64, 16], torch.float32, True) == TailLaunch(64, 4, 1, 1, reload=True, hoist=True)
    monkeypatch.setattr(heuristics, "interpret_mode", lambda: False)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert tail_launch([256, 64, 16], bf16, False) == TailLaunch(128, 8, 1)
    assert tail_launch([256, 64, 16], fp32, False) == TailLaunch(64, 8, 1)
    assert tail_launch([256, 64, 16], bf16, True) == TailLaunch(32, 8, 1, 1, reload=False, hoist=True)
    assert tail_launch([256, 64, 16], fp32, True) == TailLaunch(32, 8, 1, 1, reload=True, hoist=True)
    assert tail_launch([256, 128], bf16, True) == TailLaunch(32, 8, 1, 1, reload=True, hoist=True)
    assert tail_launch([256, 128], fp32, True) == TailLaunch(32, 8, 1, 1, reload=True, hoist=False)
    assert tail_launch([256, 1], bf16, True) == TailLaunch(32, 8, 1, 1, reload=False, hoist=True)
    assert tail_launch([256, 1], fp32, True) == TailLaunch(32, 8, 1, 1, reload=True, hoist=True)
