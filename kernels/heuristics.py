"""Launch heuristics of the kernels in one place: SM count, block sizes, named tile configs.

The numbers were measured on an H100 SXM (132 SMs); the SM count itself is asked from the device,
so grids sized "to fill the GPU" follow the GPU they run on. Under ``TRITON_INTERPRET=1`` on the
CPU there is no device to ask: `DEFAULT_SM_COUNT` stands in (the interpreter ignores occupancy;
the heuristics that depend on it are then not used, or only shape the test cases' grids).

Overrides: benchmarks and tests may set `SPARSE_UPDATE_OVERRIDE` / `INTERACTION_OVERRIDE` /
`CROSS_TILE_OVERRIDE` / `WGRAD_LAUNCH_OVERRIDE` to force a launch config (read at every launch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton

from kernels._backend import interpret_mode

__all__ = [
    "DEFAULT_SM_COUNT",
    "GEMM_TILES",
    "INTERPRETER_GEMM_TILE",
    "MAX_ROWS_PER_PROGRAM",
    "GemmTile",
    "InteractionLaunch",
    "SparseUpdateConfig",
    "TailLaunch",
    "WgradLaunch",
    "dot_block",
    "fp32_dot_precision",
    "cross_bwd_pass_launch",
    "gemm_tiles",
    "is_h200",
    "interaction_launch",
    "lookup_launch",
    "mask_bias_launch",
    "pooled_lookup_launch",
    "pick_cross_tile",
    "pick_gemm_tile",
    "rows_per_program",
    "sm_count",
    "sparse_update_config",
    "split_k_slices",
    "tail_launch",
    "pick_wgrad_launch",
]

# ----------------------------------------------------------------------------------------------------
# Device
# ----------------------------------------------------------------------------------------------------

# H100 SXM and H200, the GPUs the tile choices below were measured on.
DEFAULT_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    # Cached: get_device_properties is a driver query, and launchers ask on every call.
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str | None) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); `DEFAULT_SM_COUNT` off CUDA."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


# False: every GPU takes the H100's launches (`is_h200` answers False), for benchmarks/scaling.py
# --per-gpu-launches off, an A/B of the H200's own launches in the whole step.
PER_GPU_LAUNCHES = True


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def is_h200(device: torch.device | str | None) -> bool:
    """Whether ``device`` is an H200 (or a GH200): a Hopper GPU with HBM3e, ~1.4x the H100's memory bandwidth over
    the same 132 SMs, so its memory-bound kernels want more bytes in flight a program than the H100's launches give
    (`cross_bwd_pass_launch`, `mask_bias_launch`, `kernels.cross_ws.default_config`). False off CUDA and in the
    interpreter. The other launches here were measured on an H100 and are kept on an H200 where it was measured too
    (the pooled lookup's, results/pooled_lookup_launches_h200.md) or not measured."""
    device = torch.device(device) if device is not None else None
    if (not PER_GPU_LAUNCHES or device is None or device.type != "cuda" or interpret_mode()
            or not torch.cuda.is_available()):
        return False
    return "H200" in _cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())


# The cross network backward's elementwise passes (`kernels.cross_bwd_passes`): (BLOCK_M, BLOCK_N, rows a program,
# warps). H100: 64 x 128, 512 rows, 8 warps, the three MLPerf passes 2.525 ms (results/cross_bwd_passes.md). H200
# (results/cross_bwd_passes_h200.md): 128 x 64 tiles 0.345 + 0.473 + 0.998 = 1.816 ms against the H100's launch's
# 0.360 + 0.468 + 1.096 = 1.924 (-5.6%; the first layer's pass, 9 streams, from 3.7 to 4.1 TB/s).
CROSS_BWD_LAUNCH = (64, 128, 512, 8)
CROSS_BWD_LAUNCH_H200 = (128, 64, 512, 8)


def cross_bwd_pass_launch(device: torch.device | str | None) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, rows a program, warps)`` of `kernels.cross_bwd_passes` on ``device``."""
    return CROSS_BWD_LAUNCH_H200 if is_h200(device) else CROSS_BWD_LAUNCH


# The fused MLP's mask kernel (`kernels.mlp.mask_bias_grad`): (rows a loop step, warps, programs a SM). H100: 32 rows,
# 4 warps, 4 programs a SM. H200 (results/mask_bias_launches_h200.md, MLPerf DLRM-DCNv2's seven ReLU layers at batch
# 65536, bf16): 64 rows a step 0.432 ms against 0.474 (-9%); 8 warps, or 8-16 programs a SM, slower.
MASK_BIAS_LAUNCH = (32, 4, 4)
MASK_BIAS_LAUNCH_H200 = (64, 4, 4)


def mask_bias_launch(device: torch.device | str | None) -> tuple[int, int, int]:
    """``(rows a loop step, warps, programs a SM)`` of the fused MLP's mask kernel on ``device``."""
    return MASK_BIAS_LAUNCH_H200 if is_h200(device) else MASK_BIAS_LAUNCH


# ----------------------------------------------------------------------------------------------------
# Blocks of elementwise and gather kernels
# ----------------------------------------------------------------------------------------------------

MAX_ROWS_PER_PROGRAM = 256
_ELEMENTS_PER_PROGRAM = 4096


def rows_per_program(block_d: int) -> int:
    """Rows (lookup positions) per program of a row-gather kernel whose rows are ``block_d`` wide.

    About 4K elements per program: enough bytes in flight per SM to reach copy bandwidth, few enough
    registers per thread that nothing spills; at most 256 rows so that narrow rows (D = 16) still
    leave many programs to spread over the SMs.
    """
    return max(1, min(MAX_ROWS_PER_PROGRAM, _ELEMENTS_PER_PROGRAM // block_d))


# The atomic SGD update (kernels/embedding/atomic_update.py): a block whose rows fit in this many consecutive rows
# sums its gradients per row before adding (a [ATOMIC_SUM_SPAN, BLOCK_B] 0/1 product).
ATOMIC_SUM_SPAN = 64


def atomic_update_launch(block_d: int, fp32_grad: bool = False) -> tuple[int, int]:
    """``(samples per program, warps)`` of the column-major atomic SGD update, for rows ``block_d`` wide and fp32
    (else 16-bit) gradients.

    Measured on an H100, batch 65536, uniform ids (PERF.md, ninth and tenth runs): 128 samples and 4 warps was the
    fastest or within 5% of it except for fp32 gradients at D=128: Kaggle's tables at D=16 0.106 ms with bf16
    gradients (64 x 4: 0.150, 256 x 8: 0.117) and 0.131 ms with fp32 ones (64 x 4: 0.155, 128 x 8: 0.169; 0.126 since
    the parts are converted early at D <= 32, `kernels.embedding.select_sum`); at D=64,
    fp32, 0.329 (64 x 4: 0.336); Terabyte's (10M-row cap) at D=128 with bf16 gradients 0.551 ms (128 x 8: 0.575,
    64 x 8: 0.584), with fp32 ones 64 x 4 0.726 ms (128 x 4: 0.761, 32 x 4: 0.799; Kaggle's tables capped at 4M rows
    alike), their [BLOCK_B, 128] fp32 tiles and three bf16 parts costing registers.
    """
    if fp32_grad and block_d >= 128:
        return 64, 4
    return 128, 4


# The one-hot lookup's rows per program up to this row width: more rows in flight than `rows_per_program`'s
# 4K elements. H100, Kaggle tables, uniform ids, CUDA-graph replay (results/onehot_embedding_launch.md,
# onehot_embedding_sweep_graphcopy.md): D=128 at 65536 0.262 -> 0.235 ms in bf16 (75% -> 84% of copy
# bandwidth), 0.535 -> 0.471 ms in fp32 (73% -> 82%), 16384 alike; D=16 the same at 65536, 2-9% faster at
# 16384. More rows spill registers at D=128: 256 x 4 warps ran 6x slower in fp32, 512 x 4 5x in bf16.
LOOKUP_ROWS = 128
LOOKUP_ROWS_MAX_BLOCK_D = 128


# The pooled (multi-hot) lookup at D = 128 (MLPerf DLRM-DCNv2's tables): 128 samples a program, 4 warps, the
# gathers of 2 slots issued per loop step. H100, CUDA-graph replay (results/pooled_lookup_unroll.md): bf16 at
# 65536 2.160 -> 1.672 ms (62% -> 80% of copy bandwidth), at 16384 0.534 -> 0.411 ms; fp32 4.035 -> 3.414 ms. 4
# slots a step, 8 warps, or 64 samples were slower. Other widths keep `rows_per_program`, one slot a step.
POOLED_LOOKUP_D128 = (128, 4, 2)


def pooled_lookup_launch(block_d: int) -> tuple[int, int, int]:
    """(samples per program, warps, slots a loop step) of the pooled lookup whose rows are ``block_d`` wide."""
    return POOLED_LOOKUP_D128 if block_d == 128 else (rows_per_program(block_d), 4, 1)


def lookup_launch(block_d: int) -> tuple[int, int]:
    """(rows per program, warps) of the one-hot lookup whose rows are ``block_d`` wide."""
    if block_d <= LOOKUP_ROWS_MAX_BLOCK_D:
        return LOOKUP_ROWS, 4
    return rows_per_program(block_d), 4  # wider rows: not measured, the gather kernels' default


def dot_block(n: int) -> int:
    """Block size of a ``tl.dot`` operand dimension of length ``n``: a power of two, at least 16
    (``tl.dot`` refuses smaller dimensions)."""
    return max(16, triton.next_power_of_2(n))


def fp32_dot_precision() -> str:
    """``input_precision`` of fp32 ``tl.dot``s that must stay fp32-accurate: 3-pass TF32 on tensor
    cores on GPUs, exact fp32 (``"ieee"``) in the interpreter (which has no tf32x3)."""
    return "ieee" if interpret_mode() else "tf32x3"


# ----------------------------------------------------------------------------------------------------
# GEMM tiles (kernels.linear)
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    """One tile config of the linear kernel (``GROUP_M`` row tiles share a column tile of w in L2)."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8

    @property
    def kwargs(self) -> dict[str, int]:
        """The kernel's constexpr arguments."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m}

    def launch_kwargs(self) -> dict[str, int]:
        """Keyword arguments of a direct (not autotuned) launch."""
        return {**self.kwargs, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def config(self) -> triton.Config:
        """As a ``triton.Config`` (for ``triton.autotune``)."""
        return triton.Config(self.kwargs, num_warps=self.num_warps, num_stages=self.num_stages)


# Big square tiles for the wide top-MLP layers, narrow-N tiles for the last layers (N = 1..64),
# small tiles for small batches. BLOCK_K = 64 suits 16-bit operands, 32 keeps fp32 tiles in shared memory.
GEMM_TILES: dict[str, GemmTile] = {
    "square_fp32": GemmTile(128, 128, 32, 4, 8),  # large M and N, fp32
    "square_16bit": GemmTile(128, 128, 64, 3, 8),  # large M and N, bf16 / fp16
    "tall": GemmTile(128, 64, 32, 4, 4),  # autotuning candidate
    "wide": GemmTile(64, 128, 32, 4, 4),  # autotuning candidate
    "medium": GemmTile(64, 64, 64, 3, 4),  # grids of square tiles that would leave SMs idle
    "narrow_32": GemmTile(128, 32, 64, 4, 4),  # N <= 32
    "narrow_16": GemmTile(128, 16, 64, 4, 4),  # N <= 16 (the last layer, N = 1)
    "small_batch": GemmTile(32, 64, 32, 5, 2),  # M <= 64
    "cross_wide_16bit": GemmTile(64, 128, 64, 4, 4),  # the cross layer's 16-bit GEMM at N >= 1024 (pick_cross_tile)
}

# The interpreter's cost is per program and per K step, nearly independent of the tile size: wide
# tiles keep DLRM's top-MLP GEMMs (K or N = 355) at a few programs and steps. Tests with K = 37, 40
# (multi-step K loops with tails) and N > 64, M > 32 (several tiles per dimension, grouped program
# order) exercise every masked path.
INTERPRETER_GEMM_TILE = GemmTile(32, 64, 32, 3, 4, group_m=2)


def gemm_tiles(interpret: bool) -> list[GemmTile]:
    """The tiles autotuning chooses from (the interpreter has one)."""
    return [INTERPRETER_GEMM_TILE] if interpret else list(GEMM_TILES.values())


def pick_gemm_tile(M: int, N: int, dtype: torch.dtype, sms: int) -> GemmTile:
    """The tile for an [M, N] output without autotuning, from the shapes DLRM's GEMMs have.

    Narrow outputs (the last layers, N <= 32) take tall narrow tiles; tiny batches small tiles;
    grids of 128x128 tiles that leave some of the ``sms`` SMs idle take 64x64 tiles; everything else
    the large square tile (BLOCK_K = 64 for 16-bit operands, 32 keeps fp32 stages in shared memory).
    """
    if N <= 16:
        return GEMM_TILES["narrow_16"]
    if N <= 32:
        return GEMM_TILES["narrow_32"]
    if M <= 64:
        return GEMM_TILES["small_batch"]
    if triton.cdiv(M, 128) * triton.cdiv(N, 128) < sms:
        return GEMM_TILES["medium"]
    return GEMM_TILES["square_16bit"] if dtype in (torch.bfloat16, torch.float16) else GEMM_TILES["square_fp32"]


def pick_cross_tile(M: int, N: int, dtype: torch.dtype, sms: int) -> GemmTile:
    """The tile of the DCN cross layer's GEMM (`kernels.cross`: ``x0 * (U @ W^T + b) + x``), [M, N] =
    [B, (F+1) D], reducing over the rank.

    `pick_gemm_tile`'s choice, except:

    * 16-bit operands at MLPerf's width (N >= 1024, where the square tile would be picked): a 64x128 tile, 4
      stages, 4 warps. Measured on an H100 at [65536, 3456], rank 512, bf16, saving ``pre``
      (benchmarks/cross_layer.py, results/cross_layer.md): 0.98 ms against 1.29 ms for the square
      128x128 tile, 8 warps. The rank-512 loop is 8 steps, so the kernel is bound by its epilogue's four
      [M, N] streams; smaller tiles (more resident programs) likely keep more of them in flight. Kaggle's
      width (432) is not measured and keeps the square tile.
    * fp32: the 128x128 tile becomes the 128x64 "tall" one, whose half-size accumulator leaves
      registers for the epilogue's x0 and x tiles (not measured).

    `CROSS_TILE_OVERRIDE` forces a tile.
    """
    if CROSS_TILE_OVERRIDE is not None:
        return CROSS_TILE_OVERRIDE
    tile = pick_gemm_tile(M, N, dtype, sms)
    if tile == GEMM_TILES["square_16bit"] and N >= 1024:
        return GEMM_TILES["cross_wide_16bit"]
    return GEMM_TILES["tall"] if tile == GEMM_TILES["square_fp32"] else tile


CROSS_TILE_OVERRIDE: Optional[GemmTile] = None


def split_k_slices(M: int, N: int, K: int, tile: GemmTile, sms: int) -> int:
    """How many slices to cut a GEMM's reduction into (1: none).

    The weight gradient of a layer, ``grad_W [N_out, K_in] = grad_pre^T @ x``, reduces over the
    whole batch (K = 65536) into a small output: one program per output tile leaves most SMs idle
    while a few programs walk 65536 rows each. Splitting K until there are about two programs per
    SM fills the GPU; every slice keeps at least 8 K-steps so the partial sums stay few.
    """
    tiles = triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n)
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), K // (8 * tile.block_k)))


# ----------------------------------------------------------------------------------------------------
# Weight gradient with the bias sum and ReLU mask fused (kernels.wgrad)
# ----------------------------------------------------------------------------------------------------


class WgradLaunch(NamedTuple):
    """Launch of `kernels.wgrad`: an output tile of ``block_m`` x ``block_n`` (dW is [N_out, N_in]),
    ``block_b`` batch rows a loop step, and ``splits`` slices of the batch."""

    block_m: int
    block_n: int
    block_b: int
    num_warps: int
    num_stages: int
    splits: int


# Benchmarks may force a launch (benchmarks/wgrad.py sweeps them); read at every launch.
WGRAD_LAUNCH_OVERRIDE: Optional[WgradLaunch] = None


def _wgrad_block(n: int) -> int:
    return 128 if n > 64 else max(16, triton.next_power_of_2(n))


def pick_wgrad_launch(B: int, M: int, N: int, dtype: torch.dtype, sms: int, interpret: bool,
                      masked: bool = False) -> WgradLaunch:
    """The launch for dW [M, N] reduced over B rows (`masked`: the ReLU mask is applied in the kernel).

    From a sweep on an H100 at batch 65536, bf16 (results/wgrad_diag_launches.log: ms of the GEMM alone):
    * large outputs (M N >= 400k: the Terabyte top layers 1024x1024, 1024x480, 512x1024): 128 x 256 tiles,
      8 warps, about 4 programs per SM (0.28 / 0.15 / 0.15 ms; 128 x 128 with 2 per SM: 0.31 / 0.19 / 0.18);
    * outputs of <= 128 rows and >= 128 columns (128x256, 64x256): 64 x 128 tiles, one program per SM
      (0.022 / 0.017 ms; two per SM 0.024 / 0.020);
    * the masked first layer (512x13): 64 x 16 tiles (128 x 16: 0.23-0.27 ms against 0.072);
    * otherwise tiles of up to 128 x 128 with 4 warps (8 warps ran 1.3-1.8x slower), two programs per SM
      (256x512: 0.048 ms, 512x368: 0.057).
    64 batch rows a loop step, 128 for tiles of <= 64 x 64 (16x64: 0.008 ms); fp32 takes 32 (shared memory).
    Every slice keeps at least 8 steps. The interpreter takes one program per 64 x 64 tile and no split (its
    cost is per program and per step)."""
    if WGRAD_LAUNCH_OVERRIDE is not None:
        return WGRAD_LAUNCH_OVERRIDE
    if interpret:
        return WgradLaunch(min(64, _wgrad_block(M)), min(64, _wgrad_block(N)), 32, 4, 1, 1)
    bm, bn, warps, per_sm = _wgrad_block(M), _wgrad_block(N), 4, 2
    if M * N >= 400_000:
        bm, bn, warps, per_sm = 128, 256, 8, 4
    elif M <= 128 and N >= 128:
        bm, per_sm = 64, 1
    elif masked and bn <= 32:
        bm = min(bm, 64)
    if dtype in (torch.bfloat16, torch.float16):
        bb = 128 if bm * bn <= 64 * 64 else 64
    else:
        bb = 32
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    splits = max(1, min(triton.cdiv(per_sm * sms, tiles), B // (8 * bb)))
    return WgradLaunch(bm, bn, bb, warps, 3, splits)


# ----------------------------------------------------------------------------------------------------
# Sparse embedding update (kernels.embedding.update)
# ----------------------------------------------------------------------------------------------------


class SparseUpdateConfig(NamedTuple):
    """Launch of the sorted segment-sum update: ``chunk`` sorted positions per program of the chunk
    kernel, ``carry_block`` chunks added per step of the carry loop, each kernel's num_warps,
    ``carry_chunks`` chunk boundaries per program of the carry kernel (a power of two), ``group_sums``:
    hot rows' segments finished from sums of ``carry_block`` chunks (`kernels.embedding.segment_carry`), and
    ``chunk_maxnreg``: a register cap for the chunk kernel (Triton's ``maxnreg``; None: the compiler's choice).

    ``tl.dot`` needs every dim >= 16; larger chunks cost ``chunk**2 * D`` multiply-adds per chunk but
    shorten hot rows' carry loops."""

    chunk: int
    carry_block: int
    chunk_warps: int
    carry_warps: int
    carry_chunks: int = 32
    group_sums: bool = False
    chunk_maxnreg: Optional[int] = None


# Measured on H100s, batch 65536, after the 2026-11-24 changes to the chunk kernel (partial sums picked only where
# the carry kernel reads them, F and D compile-time constants) and the carry kernel (blocks of 32 chunk boundaries);
# results/pooled_update_tuning.md. Both kernels are bound by chains of dependent loads and their instruction count,
# so small programs (more of them resident) win until the segment product and the carry work grow.
# * Multi-hot, MLPerf DLRM-DCNv2 shapes (D=128, 214 slots a sample, 14M positions, ~10M distinct rows, row-wise
#   Adagrad, uniform ids): bf16 tables (16-bit gradients, stochastic rounding) 4.50-4.60 ms with one-warp
#   16-position chunks (5.56 ms with (32, 16, 4, 1) before the changes); fp32 tables 7.04-7.08 ms with two warps
#   (one warp: 7.6-7.8). carry_block 8-128 and 1 or 4 carry warps measured within 1% of each other there.
# * One-hot, Kaggle's 26 tables (D=16 full size, D=128 capped at 4M rows), deterministic SGD, uniform ids and
#   skewed ids (one all-missing feature, half of each feature's lookups on 100 hot ids), ms uniform / skewed:
#   D=128 bf16 0.594 / 0.596 with (32, 64, 4, 1) against 0.773 / 0.722 with "default"; D=128 fp32 0.928 / 0.900
#   against 0.970 / 1.121 with (32, 16, 4, 4); D=16 fp32 0.292 (carry_block 64) / 0.283 (128) against
#   0.360 / 0.356 with "default"; D=16 bf16 "default" 0.269 / 0.278, the one-warp launch 0.267 / 0.269 (kept).
#   On skewed ids a long carry_block matters: the all-missing feature's row spans 1,000-4,000 chunks, summed
#   carry_block partials a step by one program.
# * Multi-hot bf16 again (H200, 2026-11-28, results/pooled_update_sweep_carry*.md, two interleaved repeats): the carry
#   kernel with one warp, carry_block 32 and 8 chunk boundaries a program, 4.007-4.022 ms against 4.123-4.138 with
#   (16, 64, 1, 4) at 32 boundaries (-2.7%); 4 boundaries 4.03, 2 boundaries 4.14; 4 warps at 8 boundaries 4.17-4.19.
#   The update's hot-row work (22,651 segments spanning chunks at these shapes, up to 13 in one program's 32
#   boundaries, each summed in turn) spreads over more, smaller programs.
# * group_sums (2026-11-29, not yet measured on a GPU; PERF.md thirty-first run): on for the multi-hot launches, whose
#   Zipf-like data (the synthetic generator's) made a serial walk of 884 carry steps for one hot row at batch 65536
#   (29 with group sums; registers compiled for sm_90 with Triton 3.6: 211 against 214 for the 16-bit launch, 80
#   against 86 for fp32). Off for one-hot launches, whose hot rows span at most thousands of chunks (1,000-4,000 for
#   an all-missing feature) and where the second loop costs registers: 96 against 62 for fp32 D=16, more spills
#   for D=128 with one carry warp.
# * chunk_maxnreg (H200, 2026-11-29, results/pooled_update_chunk_latency_h200.md): the multi-hot 16-bit launch's chunk
#   kernel at 128 registers a thread (146 uncapped with Triton 3.6): 16 one-warp programs an SM instead of 13 hide more
#   of its load latency, the update with its sort 3.584-3.593 ms against 3.852-3.866 (-7%; 124 3.64, 120 3.70, 112
#   3.85, 132-144 3.94), the MLPerf step -1.5% (mlperf_dcnv2_maxnreg_h200.md). fp32 tables: within 0.3% at 128, lower
#   caps slower, so none. Not measured on an H100 (the same SM and register file).
SPARSE_UPDATE_CONFIGS: dict[str, SparseUpdateConfig] = {
    "default": SparseUpdateConfig(chunk=64, carry_block=32, chunk_warps=4, carry_warps=4),
    "wide_rows": SparseUpdateConfig(chunk=32, carry_block=64, chunk_warps=4, carry_warps=1),
    "fp32_narrow_rows": SparseUpdateConfig(chunk=16, carry_block=128, chunk_warps=1, carry_warps=4),
    "multi_hot_wide_rows": SparseUpdateConfig(chunk=16, carry_block=16, chunk_warps=2, carry_warps=4, group_sums=True),
    "multi_hot_wide_rows_16bit": SparseUpdateConfig(chunk=16, carry_block=32, chunk_warps=1, carry_warps=1,
                                                    carry_chunks=8, group_sums=True, chunk_maxnreg=128),
}
SPARSE_UPDATE_OVERRIDE: Optional[SparseUpdateConfig] = None


def sparse_update_config(block_d: int, grad_dtype: torch.dtype, multi_hot: bool = False) -> SparseUpdateConfig:
    """The update's launch for rows of ``block_d`` (padded D), gradients of ``grad_dtype``, and one-hot or
    multi-hot (pooled) lookups."""
    if SPARSE_UPDATE_OVERRIDE is not None:
        return SparseUpdateConfig(*SPARSE_UPDATE_OVERRIDE)
    if multi_hot and block_d >= 64:
        if grad_dtype in (torch.bfloat16, torch.float16):
            return SPARSE_UPDATE_CONFIGS["multi_hot_wide_rows_16bit"]
        return SPARSE_UPDATE_CONFIGS["multi_hot_wide_rows"]
    if block_d >= 64:
        return SPARSE_UPDATE_CONFIGS["wide_rows"]
    if grad_dtype == torch.float32:
        return SPARSE_UPDATE_CONFIGS["fp32_narrow_rows"]
    return SPARSE_UPDATE_CONFIGS["default"]


# ----------------------------------------------------------------------------------------------------
# Dot interaction (kernels.interaction)
# ----------------------------------------------------------------------------------------------------


class InteractionLaunch(NamedTuple):
    """Samples per program and num_warps of the dot-interaction kernels."""

    samples: int
    num_warps: int


INTERACTION_OVERRIDE: Optional[InteractionLaunch] = None


def interaction_launch(block_d: int, dtype: torch.dtype, backward: bool) -> InteractionLaunch:
    """Launch of the interaction forward or backward for vectors padded to ``block_d``.

    Measured on an H100, B=65536, F1=27 (us, forward/backward; bytes moved at 3 TB/s in brackets):
    D=16 fp32 96/148 [70/108], bf16 55/80 [35/54]; D=128 fp32 733/827 [344/646], bf16 178/330 [172/323]
    (torch.compile of the reference forward: ~300 us at D=16, ~1200 us at D=128). Since the kernels take
    the dense vector and the embeddings as two tensors (2026-11-24, eleventh run): the same in bf16 (D=128
    179/332, D=16 60/85), the fp32 forward at D=16 123-140 us (109 at 16 samples, 2 warps, not kept: its
    backward was not timed).
    """
    if INTERACTION_OVERRIDE is not None:
        return InteractionLaunch(*INTERACTION_OVERRIDE)
    if block_d <= 32:
        return InteractionLaunch(samples=8, num_warps=2)
    if backward:
        return InteractionLaunch(samples=1, num_warps=4)
    if dtype == torch.float32:
        return InteractionLaunch(samples=8, num_warps=2)
    return InteractionLaunch(samples=2, num_warps=4)


# ----------------------------------------------------------------------------------------------------
# On-chip MLP tail (kernels.mlp_tail)
# ----------------------------------------------------------------------------------------------------


class TailLaunch(NamedTuple):
    """A launch of the tail kernels: BLOCK_M rows per tile, num_warps, num_stages; for the backward
    its persistent programs per SM (its grid is ``min(row blocks, programs_per_sm x SMs)``), whether
    it loads h_0 and W_0 a second time for their transposed uses (`_tail_bwd_kernel`'s RELOAD) and
    whether it loads the weights once per program instead of once per row block (HOIST_W)."""

    block_m: int
    num_warps: int
    num_stages: int = 1
    programs_per_sm: int = 1
    reload: bool = False
    hoist: bool = False


def tail_launch(dims: list[int], dtype: torch.dtype, backward: bool) -> TailLaunch:
    """The launch for the chain ``dims`` = [K_0, N_0, ..., N_{L-1}] in `dtype`.

    Not measured (written without a GPU; benchmarks/mlp.py ``--tail-launches`` sweeps it on one).
    Chosen from the kernels compiled for sm_90 here (Triton 3.6 and 3.9, ``ptxas -v``: shared memory,
    registers, spills) at DLRM's tails, whose first layer is the widest (K_0 = 256; N_0 = 64 Kaggle
    bottom, 128 MLPerf bottom, 1 the top MLPs'). An H100 SM has 228 KB of shared memory and 64 K
    registers.

    * Forward: one program per BLOCK_M rows (batch 65536: 512 to 1024 programs, several per SM).
      8 warps; 128 rows in 16-bit (the x tile is 64 KB) and 64 in fp32 (also 64 KB): no spills,
      98 to 131 KB of shared memory at the 256-64 layer.
    * Backward: its fp32 dW accumulators stay in registers for the whole program (Kaggle's bottom
      tail 64 x 256 + 16 x 64, 64 registers a thread at 8 warps; MLPerf's 128 x 256, 128), next to a
      row block's recompute and data gradient, so it runs at the 255-register cap with a few hundred
      bytes of spills: 32-row blocks (fewer spills than 64), 8 warps, one program per SM (the
      register file is full), ``num_stages=1`` (pipelining the row loop's loads only added
      shared-memory buffers). fp32 needs RELOAD (the 64 x 256 tiles of h_0 and W_0 in both
      orientations: 196 to 330 KB of shared memory without, 98 to 164 KB with); so does a 16-bit
      first layer wider than 64 x 256. The weights are loaded once per program (HOIST_W) where their
      two shared-memory copies take at most 128 KB (all but MLPerf's 128 x 256 in fp32, which would
      need 312 KB): a 32-row block of 16-bit x is 16 KB against 32 to 64 KB of W_0 re-read from L2
      otherwise, and hoisting also removed most spills (Kaggle bf16: 0 bytes, 102 KB shared).
      The partials are then 132 x S x 4 bytes (9 MB for Kaggle's bottom tail, 17 MB for MLPerf's),
      against 32 MB of bf16 x read at batch 65536.

    What these picks compiled to (shared KB / spilled bytes, Triton 3.9 and 3.6): backward, Kaggle
    bottom bf16 102 / 0, tf32 188 / 60-176; MLPerf bottom bf16 156-164 / 244-296, tf32 164 / 1.2 K;
    the tops' 256-1 <= 51 / 0. Forward: no spills, at most 196 KB (MLPerf bottom, fp32). Exact fp32
    ("ieee", the tests' GPU reference mode) compiles to FMA loops that spill more; it is correct,
    not fast.

    The interpreter (tests): 64-row tiles, one backward program (its cost is per program and per op).
    """
    if interpret_mode():
        return TailLaunch(64, 4, 1, 1, reload=backward, hoist=backward)
    kp = [dot_block(d) for d in dims]
    widest_w = max(a * b for a, b in zip(kp[:-1], kp[1:]))  # elements of the largest padded weight
    e = torch.finfo(dtype).bits // 8
    if not backward:
        return TailLaunch(128 if e == 2 else 64, 8, 1)
    return TailLaunch(32, 8, 1, 1, reload=e == 4 or widest_w > 64 * 256, hoist=2 * widest_w * e <= 128 * 1024)
