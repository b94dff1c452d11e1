"""bf16 rounding of fp32 values inside Triton kernels: round to nearest even, or stochastically
(unbiased), by bit arithmetic; used by the fused sparse updates (`kernels.embedding.update`)."""

import triton
import triton.language as tl


@triton.jit
def _round_bf16(x, seed_ptr, offsets, STOCHASTIC: tl.constexpr):
    """fp32 ``x`` -> fp32 values exactly representable in bf16 (the cast to bf16 after it is exact).

    ``STOCHASTIC`` (unbiased): adds 16 uniform random bits (Philox: the seed at ``seed_ptr``, one counter
    per element, ``offsets`` int64) below the bf16 mantissa and truncates them, so x rounds away from
    zero with probability (dropped bits) / 2**16 and E[result] = x (sign-magnitude bits: negative values
    too). Otherwise round to nearest, ties to even, by the same bit arithmetic: the same result on GPUs
    and in the interpreter (whose fp32 -> bf16 cast truncates). +-inf stay; NaN is kept as is (adding
    bits could turn a NaN payload into inf); values past the largest bf16 round to inf as casts do.
    """
    bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        add = tl.randint(tl.load(seed_ptr), offsets).to(tl.uint32, bitcast=True) & 0xFFFF
    else:
        add = 0x7FFF + ((bits >> 16) & 1)
    rounded = ((bits + add) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)
