"""Audit tests (mutation testing) of kernels/_backend.py, kernels/_interpreter.py, kernels/table_layout.py,
kernels/heuristics.py and kernels/embedding/__init__.py: boundaries and branches the other tests leave open.

Host logic only (fake device names / capabilities, meta tensors), except one case that runs a tiny kernel in a
fresh process under ``TRITON_INTERPRET=1`` (the same on a GPU machine, like tests/kernels/test_interpreter_patch.py).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kernels import _backend, heuristics
from kernels._backend import INT32_OFFSET_LIMIT, device_context, max_element_offset, needs_int64_offsets
from kernels.heuristics import GEMM_TILES, SPARSE_UPDATE_CONFIGS, WgradLaunch
from kernels.table_layout import init_bound, init_table_, layout_tensors
from tests.conftest import CHILD_ENV

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# ----------------------------------------------------------------------------------------------------
# kernels/_backend.py
# ----------------------------------------------------------------------------------------------------


def test_int64_offsets_from_exactly_2_to_the_31():
    """An element offset of exactly 2^31 already wraps in int32: the flag turns on at 2^31, not past it."""
    assert INT32_OFFSET_LIMIT == 2**31
    below = torch.empty(2**31, device="meta")  # last element at 2^31 - 1
    at = torch.empty(2**31 + 1, device="meta")  # last element at 2^31
    assert max_element_offset(below) == 2**31 - 1 and max_element_offset(at) == 2**31
    assert needs_int64_offsets(below) is False
    assert needs_int64_offsets(at) is True


def test_int64_offsets_look_at_every_operand():
    """Any operand past the limit sets the flag, wherever it is in the argument list (None skipped)."""
    small, big = torch.empty(4, 4, device="meta"), torch.empty(2**16 + 1, 2**15, device="meta")
    assert not needs_int64_offsets(small, None, small)
    assert needs_int64_offsets(small, big)
    assert needs_int64_offsets(None, small, None, big)
    assert not needs_int64_offsets()


def test_max_element_offset_of_views_and_empty_tensors():
    t = torch.empty(3, 5)
    assert max_element_offset(t) == 14
    assert max_element_offset(t[:, ::2]) == 2 * 5 + 2 * 2  # rows of stride 5, columns of stride 2
    assert max_element_offset(torch.empty(1, 7).expand(4, 7)) == 6  # stride 0 adds nothing
    assert max_element_offset(torch.empty(0, 5)) == 0  # empty: no element is reached (not -1)
    assert max_element_offset(torch.empty(5, 0)) == 0
    assert max_element_offset(None) == 0


def test_device_context_switches_to_the_tensor_gpu():
    """Launches go to the current CUDA device: a CUDA tensor's context selects its GPU (built without touching a GPU),
    a CPU tensor's does nothing."""
    ctx = device_context(SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1
    assert isinstance(device_context(torch.empty(2)), contextlib.nullcontext)


def test_interpret_mode_is_off_unset_empty_or_zero(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.interpret_mode() is True
    for value in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert _backend.interpret_mode() is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _backend.interpret_mode() is False


# ----------------------------------------------------------------------------------------------------
# kernels/_interpreter.py
# ----------------------------------------------------------------------------------------------------

_TWICE = r'''
import json
import torch, triton, triton.language as tl
import kernels
from kernels import _interpreter
import triton.runtime.interpreter as interpreter

first = _interpreter.installed()
again = _interpreter.install()  # a second install must not wrap its own wrapper


@triton.jit
def _double(x):
    return x + x


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, _double(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)


x = torch.arange(10, dtype=torch.float32)
out = torch.zeros(10)
_kernel[(3,)](x, out, 10, BLOCK=4)
print(json.dumps({"first": first, "again": again, "self_wrapped": _interpreter._original is _interpreter._patch_lang_once,
                  "hook": interpreter._patch_lang is _interpreter._patch_lang_once, "out": out.tolist()}))
'''


def test_install_twice_keeps_the_interpreter_original(tmp_path):
    script = tmp_path / "twice.py"
    script.write_text(_TWICE)
    env = {k: v for k, v in CHILD_ENV.items() if k != "DLRM_INTERPRETER_PATCH_ONCE"}  # the caller's PYTHONPATH too
    env.update(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["first"] is True and got["again"] is True and got["hook"] is True
    assert got["self_wrapped"] is False
    assert got["out"] == [2.0 * i for i in range(10)]


# ----------------------------------------------------------------------------------------------------
# kernels/table_layout.py
# ----------------------------------------------------------------------------------------------------


def test_init_table_is_symmetric_around_zero():
    """U(-b, b): both halves of the interval are drawn (checked on 20k values: min and max near -b and b)."""
    torch.manual_seed(0)
    rows = 400
    table = init_table_(torch.empty(rows, 50), rows)
    b = init_bound(rows)
    assert table.min().item() >= -b and table.max().item() <= b
    assert table.min().item() < -0.99 * b and table.max().item() > 0.99 * b
    assert abs(table.mean().item()) < 0.02 * b
    assert (table < 0).float().mean().item() == pytest.approx(0.5, abs=0.02)


def test_layout_tensors_on_the_requested_device():
    cards, offs = layout_tensors([3, 5, 2], device="meta")
    assert cards.device.type == offs.device.type == "meta" and cards.dtype == offs.dtype == torch.int64
    assert cards.shape == offs.shape == (3,)
    with torch.device("meta"):  # device=None follows the default device (build_model builds under one)
        c2, o2 = layout_tensors([3, 5, 2])
    assert c2.device.type == o2.device.type == "meta"
    c3, o3 = layout_tensors([3, 5, 2], device="cpu")
    assert c3.tolist() == [3, 5, 2] and o3.tolist() == [0, 3, 8]


# ----------------------------------------------------------------------------------------------------
# kernels/embedding/__init__.py
# ----------------------------------------------------------------------------------------------------


def test_embedding_package_exports_its_modules_objects():
    import kernels.embedding as emb
    from kernels.embedding import hashing, lookup, module, pooled, pooled_module, update

    expected = {
        "OPTIMIZERS": update.OPTIMIZERS,
        "PAD_SPARSE": pooled.PAD_SPARSE,
        "PooledLayout": pooled.PooledLayout,
        "SparseOptimizerConfig": module.SparseOptimizerConfig,
        "TritonPooledEmbedding": pooled_module.TritonPooledEmbedding,
        "TritonSparseEmbedding": module.TritonSparseEmbedding,
        "embedding_lookup": lookup.embedding_lookup,
        "embedding_sparse_update_": update.embedding_sparse_update_,
        "fused_embedding": lookup.fused_embedding,
        "fused_pooled_embedding": pooled.fused_pooled_embedding,
        "hash_rows": hashing.hash_rows,
        "init_sparse_optimizer_state": update.init_sparse_optimizer_state,
        "pooled_embedding_lookup": pooled.pooled_embedding_lookup,
        "pooled_embedding_sparse_update_": pooled.pooled_embedding_sparse_update_,
        "pooled_hash_rows": pooled.pooled_hash_rows,
        "pooled_layout": pooled.pooled_layout,
    }
    assert sorted(emb.__all__) == sorted(expected)
    for name, obj in expected.items():
        assert getattr(emb, name) is obj, name


# ----------------------------------------------------------------------------------------------------
# kernels/heuristics.py: device queries (faked)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA "available" with a current device of 3 and a 78-SM GPU; records the driver queries."""
    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=78)

    heuristics._cuda_sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    yield calls
    heuristics._cuda_sm_count.cache_clear()


def test_sm_count_of_plain_cuda_asks_the_current_device(fake_cuda):
    assert sm_count_of("cuda") == 78
    assert fake_cuda == [3]


def test_sm_count_of_cpu_never_asks_the_driver(fake_cuda):
    assert sm_count_of("cpu") == heuristics.DEFAULT_SM_COUNT
    assert sm_count_of(torch.device("meta")) == heuristics.DEFAULT_SM_COUNT
    assert fake_cuda == []


def sm_count_of(device):
    return heuristics.sm_count(device)


def test_no_h200_launches_in_the_interpreter(monkeypatch):
    """Even on an H200 with CUDA available, the interpreter takes the H100 launches (is_h200 is False)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(heuristics, "_cuda_device_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(heuristics, "interpret_mode", lambda: False)
    assert heuristics.is_h200(cuda) is True
    monkeypatch.setattr(heuristics, "interpret_mode", lambda: True)
    assert heuristics.is_h200(cuda) is False
    assert heuristics.mask_bias_launch(cuda) == heuristics.MASK_BIAS_LAUNCH
    assert heuristics.cross_bwd_pass_launch(cuda) == heuristics.CROSS_BWD_LAUNCH


def test_fp32_dot_precision(monkeypatch):
    monkeypatch.setattr(heuristics, "interpret_mode", lambda: True)
    assert heuristics.fp32_dot_precision() == "ieee"
    monkeypatch.setattr(heuristics, "interpret_mode", lambda: False)
    assert heuristics.fp32_dot_precision() == "tf32x3"


# ----------------------------------------------------------------------------------------------------
# kernels/heuristics.py: launch tables at their boundaries
# ----------------------------------------------------------------------------------------------------


def test_atomic_update_launch_boundary():
    assert heuristics.atomic_update_launch(128, fp32_grad=True) == (64, 4)
    assert heuristics.atomic_update_launch(256, fp32_grad=True) == (64, 4)
    assert heuristics.atomic_update_launch(64, fp32_grad=True) == (128, 4)
    assert heuristics.atomic_update_launch(128, fp32_grad=False) == (128, 4)


def test_cross_tile_wide_16bit_from_n_1024(monkeypatch):
    assert heuristics.pick_cross_tile(65536, 1024, BF16, 132) is GEMM_TILES["cross_wide_16bit"]
    assert heuristics.pick_cross_tile(65536, 1023, BF16, 132) is GEMM_TILES["square_16bit"]
    assert heuristics.pick_cross_tile(65536, 1024, FP16, 132) is GEMM_TILES["cross_wide_16bit"]
    monkeypatch.setattr(heuristics, "CROSS_TILE_OVERRIDE", GEMM_TILES["medium"])
    assert heuristics.pick_cross_tile(65536, 3456, BF16, 132) is GEMM_TILES["medium"]


def test_split_k_no_split_when_tiles_fill_the_sms_exactly():
    tile = GEMM_TILES["medium"]  # 64 x 64
    assert heuristics.split_k_slices(128, 128, 65536, tile, sms=4) == 1  # 4 tiles on 4 SMs
    assert heuristics.split_k_slices(128, 128, 65536, tile, sms=5) == 3  # cdiv(10, 4)


def test_wgrad_launch_boundaries(monkeypatch):
    B = 65536
    # exactly 400k outputs: the large-output launch
    assert heuristics.pick_wgrad_launch(B, 625, 640, BF16, 132, interpret=False)[:4] == (128, 256, 64, 8)
    # <= 128 rows and >= 128 columns: 64 x 128 tiles, one program an SM (4 tiles -> 33 splits)
    assert heuristics.pick_wgrad_launch(B, 128, 256, BF16, 132, interpret=False) == WgradLaunch(64, 128, 64, 4, 3, 33)
    # the narrow layer takes 64-row tiles only when masked
    assert heuristics.pick_wgrad_launch(B, 512, 13, BF16, 132, interpret=False).block_m == 128
    assert heuristics.pick_wgrad_launch(B, 512, 13, BF16, 132, interpret=False, masked=True).block_m == 64
    # 64 x 64 tiles still take 128 batch rows a step in 16-bit; fp32 32
    assert heuristics.pick_wgrad_launch(B, 64, 64, BF16, 132, interpret=False).block_b == 128
    assert heuristics.pick_wgrad_launch(B, 64, 64, FP32, 132, interpret=False).block_b == 32
    # the interpreter: 64 x 64 tiles at most, no split
    assert heuristics.pick_wgrad_launch(B, 512, 13, FP32, 132, interpret=True) == WgradLaunch(64, 16, 32, 4, 1, 1)
    forced = WgradLaunch(32, 32, 32, 2, 2, 3)
    monkeypatch.setattr(heuristics, "WGRAD_LAUNCH_OVERRIDE", forced)
    assert heuristics.pick_wgrad_launch(B, 512, 13, BF16, 132, interpret=False) is forced


def test_sparse_update_config_multi_hot_boundaries():
    assert heuristics.sparse_update_config(64, BF16, multi_hot=True) is SPARSE_UPDATE_CONFIGS["multi_hot_wide_rows_16bit"]
    assert heuristics.sparse_update_config(64, FP32, multi_hot=True) is SPARSE_UPDATE_CONFIGS["multi_hot_wide_rows"]
    assert heuristics.sparse_update_config(128, FP16, multi_hot=True) is SPARSE_UPDATE_CONFIGS["multi_hot_wide_rows_16bit"]
    assert heuristics.sparse_update_config(32, BF16, multi_hot=True) is SPARSE_UPDATE_CONFIGS["default"]


def test_interaction_launch_at_d32():
    assert heuristics.interaction_launch(32, FP32, backward=True) == (8, 2)
    assert heuristics.interaction_launch(32, BF16, backward=False) == (8, 2)
    assert heuristics.interaction_launch(64, FP32, backward=True) == (1, 4)
    assert heuristics.interaction_launch(64, BF16, backward=False) == (2, 4)


def test_gemm_tile_narrow_boundaries():
    assert heuristics.pick_gemm_tile(65536, 16, FP32, 132) is GEMM_TILES["narrow_16"]
    assert heuristics.pick_gemm_tile(65536, 17, FP32, 132) is GEMM_TILES["narrow_32"]
    assert heuristics.pick_gemm_tile(65536, 32, BF16, 132) is GEMM_TILES["narrow_32"]
    assert heuristics.pick_gemm_tile(65536, 33, BF16, 132) is GEMM_TILES["square_16bit"]


def test_wgrad_tiles_of_64_stay_64():
    """Output dims up to 64 take tiles of their padded size; past 64, 128."""
    got = heuristics.pick_wgrad_launch(65536, 64, 64, FP32, 132, interpret=False)
    assert (got.block_m, got.block_n) == (64, 64)
    got = heuristics.pick_wgrad_launch(65536, 65, 40, FP32, 132, interpret=False)
    assert (got.block_m, got.block_n) == (128, 64)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "Yes", "y", "0", "false", "2", "", " 1", "no"])
def test_interpret_mode_reads_the_variable_as_triton_does(monkeypatch, value):
    """`TRITON_INTERPRET=true` turns Triton's interpreter on; the project read only "1", so it took the GPU's
    launches (tf32x3 dots the interpreter cannot run) while Triton interpreted. Checked against Triton's own knob
    and against its words."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    expected = value.lower() in ("1", "true", "yes", "on", "y")
    assert _backend.interpret_mode() is expected
    from triton import knobs  # Triton 3.6 (the GPU image) and later

    assert _backend.interpret_mode() is bool(knobs.runtime.interpret)
