"""The sharded lookup's ids on both sides of the id ``all_to_all``, each side in one pass.

A sharded run (`dlrm.distributed.sharded_embedding.ShardedSparseArch`, W ranks, a local batch of B samples
padded to P) sends rank q, for every sample, the table rows of the n_q slots of the tables q serves; q looks them
up in its shard. Notation: ``raw`` [B, L] the raw values (L slots: one a feature when one-hot, ``hotness[f]`` a
feature when multi-hot, PAD_SPARSE = -2 in an empty multi-hot slot); ``card[s]`` the size of slot s's table.

* **Sending** (`send_ids`): rank q's block of the send buffer is [P, n_q], row-major, its column j slot
  ``slots_q[j]``::

      send[start_q + p * n_q + j] = (raw[p, s] + 1) mod card[s]     (s = slots_q[j]; modulus hashing)
                                  = -1                               (p >= B, or an empty multi-hot slot)

  which no shard holds, so the owner masks it.
* **Receiving** (`local_ids`): rank q's received [W * P, n] ids (n = n_q, column j of its served slot j, whose
  block of rows starts at table row ``base[j]``, holds ``count[j]`` rows and sits at local row ``at[j]`` of the
  shard) become the raw values its local Triton embedding takes, and whether each lookup is its own::

      t = recv - base[j];   valid = 0 <= t < count[j]
      pooled (one table of all local rows; PAD skipped):    raw = t + at[j] - 1  if valid else PAD_SPARSE
      one table a served feature (one-hot):                 raw = t - 1          if valid else i   (its row i of
                                                            [W * P]: a masked lookup spread over its block's rows)

  (the local embeddings hash raw r to row r + 1 mod its table's rows: raw t - 1 is row t).

These are, number for number, the eager ops the sharded arch ran before (`send_ids_eager`, `local_ids_eager`:
the hashing, the PAD and padding ``where``s, the subtraction of the table offsets, one ``index_select`` per rank
and their concatenation; then the subtraction of the block starts, the comparisons and ``where``s), about a
dozen passes over [B, L]-sized int64 tensors: 1.35 ms of copies and fills a step for MLPerf DLRM-DCNv2 on two
H200s (benchmarks/results/scaling_mlperf_profile_2gpu_eager_ids.md, twenty-first run); 0.11 ms for the
sending kernel and under 0.11 for the receiving one since (scaling_mlperf_profile_2gpu.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._backend import check_same_device, device_context

PAD = -2  # dlrm.data.schema.PAD_SPARSE (kernels/ does not import dlrm)
BLOCK = 1024
INT32_INDEX_LIMIT = 2**31  # flat indices from here on are int64 (tests lower it to run that path)


@triton.jit
def _flat_index(WIDE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:  # (one return: compiled Triton refuses returns of two types, even under a constexpr branch)
        pid = pid.to(tl.int64)
    return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _send_ids_kernel(raw_ptr, stride_rb, stride_rl, slots_ptr, card_ptr, out_ptr, B, P, n,
                     PAD_VALUE: tl.constexpr, MULTI_HOT: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """One destination's [P, n] block, flat: element k is sample k // n, its slot slots[k % n]. Indices in int32
    unless ``WIDE`` (P * n >= 2**31): a 64-bit division is a long software sequence on the GPU."""
    k = _flat_index(WIDE, BLOCK)
    p = k // n
    inside = p < P  # not k < P * n: P and n are int32 arguments, their product wraps from 2**31 on
    s = tl.load(slots_ptr + k % n, mask=inside, other=0)
    real = inside & (p < B)
    raw = tl.load(raw_ptr + p.to(tl.int64) * stride_rb + s * stride_rl, mask=real, other=0).to(tl.int64)
    card = tl.load(card_ptr + s, mask=inside, other=1)
    # `%` truncates towards zero in compiled Triton (C semantics): fold negatives back
    row = (raw + 1) % card
    row = tl.where(row < 0, row + card, row)
    if MULTI_HOT:
        real = real & (raw != PAD_VALUE)
    tl.store(out_ptr + k, tl.where(real, row, -1).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _local_ids_kernel(recv_ptr, base_ptr, count_ptr, at_ptr, raw_ptr, valid_ptr, rows, n,
                      PAD_VALUE: tl.constexpr, POOLED: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """The received [rows, n] ids, flat: element k is row k // n, served slot k % n (int32 unless ``WIDE``)."""
    k = _flat_index(WIDE, BLOCK)
    inside = k // n < rows  # not k < rows * n: int32 arguments, their product wraps from 2**31 on
    j = k % n
    t = tl.load(recv_ptr + k, mask=inside, other=0).to(tl.int64) - tl.load(base_ptr + j, mask=inside, other=0)
    valid = (t >= 0) & (t < tl.load(count_ptr + j, mask=inside, other=0))
    if POOLED:
        raw = tl.where(valid, t + tl.load(at_ptr + j, mask=inside, other=0) - 1, PAD_VALUE)
    else:
        raw = tl.where(valid, t - 1, (k // n).to(tl.int64))
    tl.store(raw_ptr + k, raw, mask=inside)
    tl.store(valid_ptr + k, valid.to(tl.int8), mask=inside)


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def _check_integer(name: str, t: torch.Tensor) -> None:
    """One-line ValueError for a floating (or complex, bool) id tensor: the kernels would truncate its values."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers (int64 or int32 ids), got {t.dtype}")


def send_ids(raw: torch.Tensor, slot_card: torch.Tensor, slots: list[torch.Tensor], padded: int,
             multi_hot: bool, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[sum_q P * n_q] send buffer (see the module docstring) of ``dtype`` (int32 halves the bytes sent; the
    caller picks it when every table has fewer than 2**31 rows): ``raw`` [B, L] int64 (any strides), ``slot_card``
    [L] int64 table sizes, ``slots[q]`` [n_q] int64 the slots rank q serves, ``padded`` P >= B."""
    if dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    _check_integer("raw", raw)  # the kernel converts what it loads to int64: 1.5 was sent as row 2 of its table
    B = raw.shape[0]
    # The kernel reads slots[q][j] and slot_card[s] at their data pointers plus j and s: a strided view (a column of
    # a 2-D plan) gave every slot another slot's table, silently. [n]-sized copies, only where needed.
    slot_card = slot_card.contiguous()
    slots = [s.contiguous() for s in slots]
    for name, t in [("slot_card", slot_card), *((f"slots[{q}]", s) for q, s in enumerate(slots))]:
        _check_integer(name, t)
    # the kernel runs on raw's device and reads every table there: a CPU slot table with CUDA ids read bad memory
    check_same_device("send_ids", raw=raw, slot_card=slot_card, **{f"slots[{q}]": s for q, s in enumerate(slots)})
    if padded < B:  # the [P, n_q] blocks hold P samples: the samples from P on were dropped without a word
        raise ValueError(f"padded P={padded} must be >= the batch B={B}")
    sizes = [int(s.numel()) for s in slots]
    out = torch.empty(padded * sum(sizes), dtype=dtype, device=raw.device)
    with device_context(raw):
        start = 0
        for s, n in zip(slots, sizes):
            if n:
                block = out[start : start + padded * n]
                _send_ids_kernel[(triton.cdiv(padded * n, BLOCK),)](
                    raw, raw.stride(0), raw.stride(1), s, slot_card, block, B, padded, n,
                    PAD_VALUE=PAD, MULTI_HOT=multi_hot, WIDE=padded * n + BLOCK >= INT32_INDEX_LIMIT, BLOCK=BLOCK)
            start += padded * n
    return out


def local_ids(recv: torch.Tensor, base: torch.Tensor, count: torch.Tensor, at: torch.Tensor,
              pooled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw [rows, n] int64, valid [rows, n] bool)`` of the received ids ``recv`` [rows, n] (int32 or int64; see
    the module docstring); ``base``, ``count``, ``at`` [n] int64: each served slot's block start, rows and local
    row."""
    rows, n = recv.shape
    _check_integer("recv", recv)
    # read at their data pointers plus the served slot j: strided views gave slot j another slot's block (as above)
    base, count, at = base.contiguous(), count.contiguous(), at.contiguous()
    for name, t in (("base", base), ("count", count), ("at", at)):
        _check_integer(name, t)
    check_same_device("local_ids", recv=recv, base=base, count=count, at=at)  # (read on recv's device, as above)
    raw = torch.empty((rows, n), dtype=torch.int64, device=recv.device)
    valid = torch.empty((rows, n), dtype=torch.int8, device=recv.device)
    if raw.numel():
        recv = recv.contiguous()
        with device_context(recv):
            _local_ids_kernel[(triton.cdiv(rows * n, BLOCK),)](
                recv, base, count, at, raw, valid, rows, n, PAD_VALUE=PAD, POOLED=pooled,
                WIDE=rows * n + BLOCK >= INT32_INDEX_LIMIT, BLOCK=BLOCK)
    return raw, valid.view(torch.bool)


# ----------------------------------------------------------------------------------------------------
# Eager references (what the sharded arch computed before; the torch kernel on the CPU runs them)
# ----------------------------------------------------------------------------------------------------


def send_ids_eager(table_rows: torch.Tensor, slots: list[torch.Tensor], padded: int) -> torch.Tensor:
    """The send buffer from ``table_rows`` [B, L] (each slot's row of its table, -1 for an empty slot)."""
    B = table_rows.shape[0]
    if padded > B:  # padded samples ask for row -1, which no shard holds
        table_rows = torch.nn.functional.pad(table_rows, (0, 0, 0, padded - B), value=-1)
    return torch.cat([table_rows.index_select(1, s).reshape(-1) for s in slots])


def local_ids_eager(recv: torch.Tensor, base: torch.Tensor, count: torch.Tensor, at: torch.Tensor,
                    pooled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`local_ids` in PyTorch ops."""
    t = recv - base
    valid = (t >= 0) & (t < count)
    if pooled:
        return torch.where(valid, t + at - 1, torch.full_like(t, PAD)), valid
    sample = torch.arange(recv.shape[0], device=recv.device).unsqueeze(1)
    return torch.where(valid, t - 1, sample), valid
