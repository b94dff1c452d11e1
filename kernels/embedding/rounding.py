"""bf16 rounding of fp32 values inside Triton kernels: round to nearest even, or stochastically
(unbiased), by bit arithmetic; used by the fused sparse updates (`kernels.embedding.update`).

The random bits of stochastic rounding come from one of two counter-based generators, keyed by the
seed, the row and the column of each element (so results do not depend on how the work is split into
programs):

* ``"hash"``: a 32-bit integer finaliser (``_mix32``: two xorshift-multiply rounds, constants
  from Chris Wellons' hash-prospector, bias ~0.02). A key per row (the row's two 32-bit halves mixed with
  the seed, computed once per row) is mixed once more with each column: ~10 integer ops an element;
* ``"hash1"``: the same per-row key, then a single xorshift-multiply round per element (``_mix32_once``):
  ~4 integer ops an element. Each element's 16 bits stay exactly uniform (a bijection of the uniform
  row key), which is all unbiasedness needs; only the mixing between columns of one row is weaker (the
  tests bound their correlation as for the others). The default of the fused updates until 2026-11-28
  (twenty-seventh session): at MLPerf shapes the bf16 update took 6.14 ms against 6.39 ms with ``"hash"``
  (H100, ``results/pooled_update_sweep_hash1.md``);
* ``"hash1hi"``: the same per-row key xor the column key, one odd multiply, and the product's HIGH 16
  bits (~3 integer ops an element: xor, multiply, shift). Still exactly uniform per element (an odd
  multiply is a bijection of a uniform 32-bit value); the high half of a product is its best-mixed part,
  so no xorshift is needed for 16 bits. 6.04 ms against ``"hash1"``'s 6.14 at the launch (16, 16, 2, 1),
  5.98 against 5.99-6.01 at the launch then shipped, (32, 16, 4, 1) (H100, ``results/pooled_update_sweep_hash1hi*.md``);
  3.915-3.926 against 4.020-4.024 at today's one-warp launch (H200, ``results/pooled_update_sweep_rounding.md``):
  the default of the fused updates (``kernels.embedding.update.SR_RNG``);
* ``"philox"``: ``tl.randint`` (Philox 4x32-10, as ``torch.rand``) on ``row * D + column``: ~10x the
  integer work. In the bandwidth-bound update of ~10M bf16 rows of 128 a step (MLPerf DLRM-DCNv2, batch
  65536) that work was measured to double the update's time on an H100 (18.1 ms against 9.6 ms with the
  first version of the hash, which mixed every element twice).

Stochastic rounding needs 16 uniform bits per element and no cryptographic quality: the tests check
that the results are unbiased and change with the seed.
"""

import triton
import triton.language as tl

RNG_CODES = {"hash": 0, "philox": 1, "hash1": 2, "hash1hi": 3}


@triton.jit
def _mix32(x):
    """A bijective 32-bit integer finaliser (xorshift-multiply, hash-prospector's [16 21f0aaad 15 735a2d97 15])."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _mix32_once(x):
    """One xorshift-multiply round (bijective): cheaper than `_mix32`, for inputs that are already uniform."""
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _random_bits(seed_ptr, rows, cols, D, RNG: tl.constexpr):
    """Random bits (uint32) per element of the ``[M, N]`` block at rows ``rows`` ``[M, 1]`` (int64) and
    columns ``cols`` ``[1, N]`` (< D), keyed by the int64 at ``seed_ptr``: 32 of them, except ``"hash1hi"``
    (code 3), whose 16 are the low half of the result (callers take ``& 0xFFFF``)."""
    seed = tl.load(seed_ptr)
    if RNG == 1:
        return tl.randint(seed, rows * D + cols).to(tl.uint32, bitcast=True)
    key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) + 0x3C6EF372))
    lo = (rows & 0xFFFFFFFF).to(tl.uint32)
    hi = ((rows >> 32) & 0xFFFFFFFF).to(tl.uint32)
    row_key = _mix32(lo ^ _mix32(hi ^ key))  # [M, 1]: once per row
    col_key = cols.to(tl.uint32) * 0x9E3779B1  # [1, N]: distinct odd-multiple spread of the columns
    if RNG == 2:
        return _mix32_once(row_key ^ col_key)
    if RNG == 3:
        return ((row_key ^ col_key) * 0x735A2D97) >> 16
    return _mix32(row_key ^ col_key)


@triton.jit
def _round_bf16(x, seed_ptr, rows, cols, D, STOCHASTIC: tl.constexpr, RNG: tl.constexpr = 0):
    """fp32 ``x`` ``[M, N]`` -> fp32 values exactly representable in bf16 (the cast to bf16 after it is exact).

    ``STOCHASTIC`` (unbiased): adds 16 uniform random bits (`_random_bits`: the seed at ``seed_ptr``, the
    element's row in ``rows`` ``[M, 1]`` int64 and column in ``cols`` ``[1, N]`` of ``D``; ``RNG`` a
    `RNG_CODES` value) below the bf16 mantissa and truncates them, so x rounds away from zero with
    probability (dropped bits) / 2**16 and E[result] = x (sign-magnitude bits: negative values too).
    Otherwise round to nearest, ties to even, by the same bit arithmetic: the same result on GPUs and in
    the interpreter (whose fp32 -> bf16 cast truncates). +-inf stay; NaN is kept as is (adding bits could
    turn a NaN payload into inf); values past the largest bf16 round to inf as casts do.
    """
    bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        add = _random_bits(seed_ptr, rows, cols, D, RNG) & 0xFFFF
    else:
        add = 0x7FFF + ((bits >> 16) & 1)
    rounded = ((bits + add) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)
