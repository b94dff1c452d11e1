"""Sums of gradient rows picked by a 0/1 matrix, fp32-accurate on bf16 tensor cores.

``select_sum(sel, g)`` is ``sel @ g`` for a boolean ``sel`` [M, K] and gradients ``g`` [K, D] (fp32
accumulation): the per-row sums of the atomic update (`kernels.embedding.atomic_update`) and the segment sums
of the sorted update (`kernels.embedding.segment_chunk`).

* 16-bit ``g``: one product, exact (0/1 and bf16/fp16 values are exact operands; the MMA accumulates in fp32).
* fp32 ``g`` (``SPLIT_FP32``): ``g = hi + mid + lo`` exactly, each part a bf16 value cut off by bit masking
  (``hi``: the top 8 significand bits, ``mid``: the next 8 bits of the remainder, ``lo``: what is left, at most 8
  bits), and three bf16 products accumulated in fp32, smallest parts first. Every product term is exact, so the
  result is an fp32 sum of the same values, rounded as any fp32 sum is. (A part below fp32's normal range, 2^-126,
  may be flushed to zero by the MMA: an absolute error far below the gradients' own rounding.)

  This replaced 3-pass TF32 (``input_precision="tf32x3"``, which also carries ~fp32 accuracy). On an H100, batch
  65536, fp32 gradients (benchmarks/PERF.md, tenth run): the atomic update of Kaggle's tables at D=16 took
  0.125-0.126 ms against 0.161 (50% against 39% of copy bandwidth; the single-pass bf16 product, inexact, was no
  faster), at D=128 0.675 against 1.104 ms (with the column-major launch it made possible); the deterministic
  update at D=128 0.823-0.827 against 0.897 ms.

``DOT_16BIT`` false (the interpreter, whose ``tl.dot`` mishandles 16-bit operands): the same parts, multiplied in
exact fp32 (``input_precision="ieee"``), so CI runs the split itself.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_head(x):
    """``x`` (fp32) with the low 16 bits of its encoding cleared: its top 8 significand bits, rounded towards
    zero, exactly a bf16 value (``x - bf16_head(x)`` is then exact in fp32)."""
    return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _split3(g):
    """``(hi, mid, lo)``: three bf16 values (held in fp32) with ``hi + mid + lo == g`` exactly."""
    hi = bf16_head(g)
    rest = g - hi
    mid = bf16_head(rest)
    return hi, mid, rest - mid


@triton.jit
def select_sum(sel, g, SPLIT_FP32: tl.constexpr, DOT_16BIT: tl.constexpr):
    """``sel @ g`` in fp32 for a boolean ``sel`` [M, K] and ``g`` [K, D] (M, K, D >= 16, powers of two).

    ``SPLIT_FP32``: ``g`` is fp32 (three exact bf16 parts); else 16-bit. ``DOT_16BIT``: 16-bit products on the
    tensor cores (GPUs); else exact fp32 products (the interpreter)."""
    if SPLIT_FP32:
        if DOT_16BIT and g.shape[1] <= 32:
            # Narrow rows: every operand in bf16 before the first product. Converted between the products, the fp32
            # parts stayed live across them: 138 registers a thread against 86 in the atomic update at D=16, 0.131
            # -> 0.126 ms. At D=128 the early conversion was slower (atomic update 0.675 -> 0.691 ms, deterministic
            # 0.826 -> 0.856): there each part is converted just before its product (H100, PERF.md tenth run).
            s = sel.to(tl.bfloat16)
            hi, mid, lo = _split3(g.to(tl.float32))
            hi16, mid16, lo16 = hi.to(tl.bfloat16), mid.to(tl.bfloat16), lo.to(tl.bfloat16)
            acc = tl.dot(s, lo16)
            acc = tl.dot(s, mid16, acc)
            acc = tl.dot(s, hi16, acc)
        elif DOT_16BIT:
            hi, mid, lo = _split3(g.to(tl.float32))
            s = sel.to(tl.bfloat16)
            acc = tl.dot(s, lo.to(tl.bfloat16))
            acc = tl.dot(s, mid.to(tl.bfloat16), acc)
            acc = tl.dot(s, hi.to(tl.bfloat16), acc)
        else:
            hi, mid, lo = _split3(g.to(tl.float32))
            s = sel.to(tl.float32)
            acc = tl.dot(s, lo, input_precision="ieee")
            acc = tl.dot(s, mid, acc, input_precision="ieee")
            acc = tl.dot(s, hi, acc, input_precision="ieee")
    else:
        if DOT_16BIT:
            acc = tl.dot(sel.to(g.dtype), g)
        else:
            acc = tl.dot(sel.to(tl.float32), g.to(tl.float32), input_precision="ieee")
    return acc
