"""Micro-benchmarks of the Triton kernels in kernels/ against eager PyTorch and torch.compile.

On the GPU machine (one run; or split by family with --append so that each command stays short):

    python benchmarks/kernels.py --out benchmarks/results
    python benchmarks/kernels.py --kernels embedding --out benchmarks/results
    python benchmarks/kernels.py --kernels interaction,loss --append --out benchmarks/results
    python benchmarks/kernels.py --kernels linear --append --out benchmarks/results

CPU smoke test (Triton interpreter, tiny shapes; timings are meaningless and the report says so):

    TRITON_INTERPRET=1 python benchmarks/kernels.py --device cpu --quick --out /tmp/kb

What is measured, per kernel variant (``--list`` prints them), batch size, dtype and implementation:

* kernels: hash_rows, the embedding lookup / fused-SGD backward (D=16 on the Kaggle tables, D=128 on
  tables capped at 4M rows), the dot interaction ([B, 27, 16], [B, 27, 128]), the fused linear+relu
  (512x256, 256x64, 1024x1024), the BCE loss and the DCN cross layer's fused GEMM (Kaggle's 432 x rank
  128 and MLPerf's 3456 x rank 512, against cuBLAS + the eager elementwise cross);
* modes ``fwd``, ``bwd`` (the backward alone, from a retained graph) and ``fwd+bwd``;
* implementations ``triton`` (kernels/), ``eager`` (the eager PyTorch op of dlrm/model: for the
  linear layer that is cuBLAS ``F.linear`` + a separate ``relu``) and ``compile`` (``torch.compile``
  of the same eager function, default mode, static shapes); for the fp32 embedding also
  ``triton_atomic`` (the non-deterministic atomic SGD update);
* time: median of ``triton.testing.do_bench`` (L2 flushed before every run); GB/s for the memory-bound
  ops from the bytes each op must minimally move (see ``*_bytes`` below), compared with the copy
  bandwidth measured in the same run (``dst.copy_(src)`` of 1 GiB, bytes read + written / time);
  TFLOP/s for the GEMMs (2MNK forward, 4MNK backward). fp32 GEMMs may use TF32 on both sides
  (``torch.set_float32_matmul_precision("high")``, i.e. ``torch.backends.cuda.matmul.allow_tf32``
  True; ``--no-tf32`` turns it off).

Outputs under ``--out``: kernels.csv (one row per kernel, mode, batch, dtype, impl), one PNG per kernel
variant, kernels.md (environment, copy bandwidth, tables, target verdicts); the tables and verdicts are
printed to stdout too. Every case runs in its own try/except: a failing kernel is recorded, not fatal.

The calls into kernels/ are gathered in the ADAPTER section below (the kernels' APIs may move).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib
import inspect
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

# The interpreter must be on before triton is first imported (an explicit TRITON_INTERPRET=0 wins).
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from loguru import logger  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# appended, as the other scripts do: the output policy they share (`_common.claim_outputs`)
sys.path.append(str(Path(__file__).resolve().parent))

from _common import add_overwrite, claim_outputs  # noqa: E402
from dlrm.logging_setup import ProgressBar  # noqa: E402
from dlrm.model.archs import dot_interaction_from_combined  # noqa: E402
from dlrm.model.hashing import modulus_rows  # noqa: E402

MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("triton", "triton_atomic", "eager", "compile")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

from dlrm.data.schema import KAGGLE_CARDINALITIES  # noqa: E402 - Criteo Kaggle table sizes, F = 26
NUM_VECTORS = len(KAGGLE_CARDINALITIES) + 1  # F + 1 interacting vectors (dense + 26 embeddings)
EMBEDDING_LR = 1e-3


# ====================================================================================================
# ADAPTER: every call into kernels/ (and the eager references) lives here.
# ====================================================================================================


def _kmod(name: str):
    """Import kernels.<name> lazily: a module broken mid-edit fails its own cases only."""
    return importlib.import_module(f"kernels.{name}")


def tr_hash_rows(raw, cards, offs):
    return _kmod("embedding").hash_rows(raw, cards, offs)


def tr_embedding_lookup(raw, weight, cards, offs):
    return _kmod("embedding").embedding_lookup(raw, weight, cards, offs)


def tr_embedding_sgd_update_(rows, grad, weight, lr, deterministic=True):
    _kmod("embedding").embedding_sparse_update_(rows, grad, weight, None, lr, "sgd", deterministic=deterministic)


def tr_fused_embedding(raw, weight, cards, offs, lr, trigger, deterministic=True):
    """Lookup whose backward applies SGD to the looked-up rows (weight must not require grad)."""
    return _kmod("embedding").fused_embedding(
        raw, weight, cards, offs, None, None, None, lr, "sgd", deterministic=deterministic, grad_trigger=trigger
    )


def tr_dot_interaction(x):
    return _kmod("interaction").dot_interaction(x)


def tr_linear_relu(x, w, b, allow_tf32):
    return _kmod("linear").linear_act(x, w, b, "relu", allow_tf32=allow_tf32)


def tr_bce(logits, labels):
    return _kmod("loss").bce_with_logits(logits, labels, "mean")


def tr_cross_layer(x0, x, u, w, b, allow_tf32):
    return _kmod("cross").cross_layer(x0, x, u, w, b, allow_tf32)


def eager_hash_rows(raw, cards, offs):
    return modulus_rows(raw, cards, offs)


def eager_embedding_fwd(raw, weight, cards, offs):
    """SparseArch.forward without the sparse-gradient flag: modulus hashing, then the gather."""
    return F.embedding(modulus_rows(raw, cards, offs), weight)


def eager_embedding_sgd_update_(rows, grad, weight, lr: float):
    """What SGD does with the lookup's sparse COO gradient (w[rows] -= lr * g), without building it."""
    weight.index_add_(0, rows.reshape(-1), grad.reshape(-1, weight.shape[1]), alpha=-lr)


def eager_embedding_step(raw, weight, cards, offs, grad, lr: float):
    """Forward lookup followed by the SGD update from `grad` (the eager counterpart of fused_embedding)."""
    rows = modulus_rows(raw, cards, offs)
    out = F.embedding(rows, weight)
    weight.index_add_(0, rows.reshape(-1), grad.reshape(-1, weight.shape[1]), alpha=-lr)
    return out


def eager_interaction(x, tril_rows, tril_cols):
    return dot_interaction_from_combined(x, tril_rows, tril_cols)


def eager_linear_relu(x, w, b):
    return F.relu(F.linear(x, w, b))


def eager_bce(logits, labels):
    return F.binary_cross_entropy_with_logits(logits, labels)


def eager_cross_layer(x0, x, u, w, b):
    """The second half of an eager LowRankCrossNet layer: cuBLAS ``u @ w^T``, then the elementwise cross."""
    return x0 * (F.linear(u, w) + b) + x


# ====================================================================================================
# Cases: each kernel variant builds, for one (batch, dtype), its implementations and the work per mode.
# ====================================================================================================


@dataclass
class Ctx:
    """Run-wide settings the case builders need."""

    device: torch.device
    impls: tuple[str, ...]
    tf32: bool
    max_rows: Optional[int]  # cap on every table's rows (None: the real sizes, except the D=128 cap)
    graph_stream: Optional[torch.cuda.Stream] = None  # --timing graph: the stream cases are set up and captured on


# A mode factory returns (fn to time, tensors whose .grad is reset before every run).
ModeFactory = Callable[[], tuple[Callable[[], object], list]]


@dataclass
class Built:
    impls: dict[str, dict[str, ModeFactory]]
    work: dict[str, float]  # mode -> bytes (GB/s kernels) or flops (TFLOP/s kernels)
    note: str = ""


@dataclass
class Spec:
    name: str
    family: str
    metric: str  # "GB/s" or "TFLOP/s"
    shape: str
    build: Callable[[Ctx, int, torch.dtype], Built]
    quick: bool = False
    targets: list = field(default_factory=list)


def compiled(fn):
    """torch.compile of an eager reference (default mode, static shapes; dynamo is reset per case)."""
    return torch.compile(fn, dynamic=False)


def autograd_modes(fn: Callable, inputs: tuple) -> dict[str, ModeFactory]:
    """fwd / bwd / fwd+bwd of a differentiable `fn(*inputs)` through autograd."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def grad_like(out):
        return torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)

    def fwd():
        return (lambda: fn(*inputs)), []

    def bwd():
        out = fn(*inputs)
        grad = grad_like(out)
        return (lambda: out.backward(grad, retain_graph=True)), leaves

    def fwd_bwd():
        grad = grad_like(fn(*inputs))
        return (lambda: fn(*inputs).backward(grad)), leaves

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def standard_impls(ctx: Ctx, triton_fn, eager_fn, inputs: tuple, eager_inputs: Optional[tuple] = None):
    """triton / eager / compile implementations of one differentiable op."""
    eager_inputs = inputs if eager_inputs is None else eager_inputs
    impls = {}
    if "triton" in ctx.impls:
        impls["triton"] = autograd_modes(triton_fn, inputs)
    if "eager" in ctx.impls:
        impls["eager"] = autograd_modes(eager_fn, eager_inputs)
    if "compile" in ctx.impls:
        impls["compile"] = autograd_modes(compiled(eager_fn), eager_inputs)
    return impls


def fwd_bwd_work(fwd: float, bwd: float) -> dict[str, float]:
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


# ---- embedding ---------------------------------------------------------------------------------

_TABLES: dict = {}  # one cached (weight, cardinalities, offsets) across the batch sizes of a variant


def embedding_tables(ctx: Ctx, name: str, dim: int, cap: Optional[int], dtype: torch.dtype):
    key = (name, dtype)
    if key not in _TABLES:
        _TABLES.clear()
        free_memory(ctx.device)
        caps = [c for c in (cap, ctx.max_rows) if c is not None]
        cards = [min([c, *caps]) for c in KAGGLE_CARDINALITIES]
        card_t = torch.tensor(cards, dtype=torch.int64, device=ctx.device)
        offs_t = torch.cumsum(card_t, 0) - card_t
        weight = torch.empty(sum(cards), dim, dtype=dtype, device=ctx.device).uniform_(-0.05, 0.05)
        _TABLES[key] = (weight, card_t, offs_t)
    return _TABLES[key]


def embedding_bytes(n: int, unique: int, dim: int, elem: int) -> dict[str, float]:
    """Minimal traffic. fwd: raw ids (8 B each) + each distinct row read once + output written.
    bwd (fused SGD): rows ids + gradient read + each distinct row read and written once."""
    fwd = n * 8 + unique * dim * elem + n * dim * elem
    bwd = n * 8 + n * dim * elem + 2 * unique * dim * elem
    return fwd_bwd_work(fwd, bwd)


def build_embedding(dim: int, cap: Optional[int], name: str):
    def build(ctx: Ctx, batch: int, dtype: torch.dtype) -> Built:
        dev = ctx.device
        weight, cards, offs = embedding_tables(ctx, name, dim, cap, dtype)
        nf = cards.numel()
        raw = torch.randint(-1, 2**32, (batch, nf), dtype=torch.int64, device=dev)  # uniform: cold rows
        grad = torch.randn(batch, nf, dim, dtype=dtype, device=dev) * 1e-3
        lr = torch.full((1,), EMBEDDING_LR, dtype=torch.float32, device=dev)
        rows = modulus_rows(raw, cards, offs)
        unique = int(torch.unique(rows).numel())
        trigger = torch.zeros(0, device=dev, requires_grad=True)
        impls: dict[str, dict[str, ModeFactory]] = {}

        def triton_modes(deterministic: bool, with_fwd: bool):
            modes = {
                "bwd": lambda: ((lambda: tr_embedding_sgd_update_(rows, grad, weight, lr, deterministic)), []),
                "fwd+bwd": lambda: (
                    (lambda: tr_fused_embedding(raw, weight, cards, offs, lr, trigger, deterministic).backward(grad)),
                    [trigger],
                ),
            }
            if with_fwd:
                modes["fwd"] = lambda: ((lambda: tr_embedding_lookup(raw, weight, cards, offs)), [])
            return modes

        def eager_modes(fwd_fn, upd_fn, step_fn):
            return {
                "fwd": lambda: ((lambda: fwd_fn(raw, weight, cards, offs)), []),
                "bwd": lambda: ((lambda: upd_fn(rows, grad, weight, EMBEDDING_LR)), []),
                "fwd+bwd": lambda: ((lambda: step_fn(raw, weight, cards, offs, grad, EMBEDDING_LR)), []),
            }

        if "triton" in ctx.impls:
            impls["triton"] = triton_modes(deterministic=True, with_fwd=True)
        if "triton_atomic" in ctx.impls and dtype == torch.float32:
            impls["triton_atomic"] = triton_modes(deterministic=False, with_fwd=False)
        if "eager" in ctx.impls:
            impls["eager"] = eager_modes(eager_embedding_fwd, eager_embedding_sgd_update_, eager_embedding_step)
        if "compile" in ctx.impls:
            impls["compile"] = eager_modes(
                compiled(eager_embedding_fwd), compiled(eager_embedding_sgd_update_), compiled(eager_embedding_step)
            )
        n = batch * nf
        note = f"R={weight.shape[0]} rows, {unique}/{n} distinct rows looked up"
        return Built(impls, embedding_bytes(n, unique, dim, weight.element_size()), note)

    return build


def build_hash_rows(ctx: Ctx, batch: int, dtype: torch.dtype) -> Built:
    """Modulus hashing alone (int64 in, int64 out: measured once, under fp32)."""
    if dtype != torch.float32:
        return Built({}, {})
    cards = torch.tensor(KAGGLE_CARDINALITIES, dtype=torch.int64, device=ctx.device)
    offs = torch.cumsum(cards, 0) - cards
    raw = torch.randint(-1, 2**32, (batch, cards.numel()), dtype=torch.int64, device=ctx.device)
    fns = {"triton": tr_hash_rows, "eager": eager_hash_rows}
    if "compile" in ctx.impls:
        fns["compile"] = compiled(eager_hash_rows)
    impls = {name: {"fwd": (lambda f=f: ((lambda: f(raw, cards, offs)), []))} for name, f in fns.items() if name in ctx.impls}
    return Built(impls, {"fwd": raw.numel() * 16}, "int64 ids in and out (dtype n/a)")  # read raw, write rows


# ---- interaction -------------------------------------------------------------------------------


def build_interaction(dim: int):
    def build(ctx: Ctx, batch: int, dtype: torch.dtype) -> Built:
        x = torch.randn(batch, NUM_VECTORS, dim, dtype=dtype, device=ctx.device, requires_grad=True)
        tril_rows, tril_cols = torch.tril_indices(NUM_VECTORS, NUM_VECTORS, offset=-1, device=ctx.device)
        impls = standard_impls(ctx, tr_dot_interaction, eager_interaction, (x,), (x, tril_rows, tril_cols))
        s = x.element_size()
        n_in = batch * NUM_VECTORS * dim
        n_out = batch * (dim + NUM_VECTORS * (NUM_VECTORS - 1) // 2)
        # fwd: read x, write out. bwd: read grad_out and x, write grad_x.
        return Built(impls, fwd_bwd_work((n_in + n_out) * s, (n_out + 2 * n_in) * s))

    return build


# ---- linear ------------------------------------------------------------------------------------


def build_linear(k: int, n: int):
    def build(ctx: Ctx, batch: int, dtype: torch.dtype) -> Built:
        dev = ctx.device
        x = torch.randn(batch, k, dtype=dtype, device=dev, requires_grad=True)
        w = (torch.randn(n, k, dtype=dtype, device=dev) / math.sqrt(k)).requires_grad_()
        b = torch.randn(n, dtype=dtype, device=dev).requires_grad_()
        impls = standard_impls(
            ctx, lambda x_, w_, b_: tr_linear_relu(x_, w_, b_, ctx.tf32), eager_linear_relu, (x, w, b)
        )
        mnk = 2.0 * batch * n * k
        note = "fp32 with TF32 on both sides" if (dtype == torch.float32 and ctx.tf32) else ""
        return Built(impls, fwd_bwd_work(mnk, 2 * mnk), note)  # bwd: grad_x and grad_w GEMMs

    return build


# ---- DCN cross layer ---------------------------------------------------------------------------


def build_cross(n: int, rank: int):
    """``x0 * (u @ w^T + b) + x`` for x0, x [B, n], u [B, rank], w [n, rank] (kernels/cross.py)."""

    def build(ctx: Ctx, batch: int, dtype: torch.dtype) -> Built:
        dev = ctx.device
        x0, x = (torch.randn(batch, n, dtype=dtype, device=dev, requires_grad=True) for _ in range(2))
        u = torch.randn(batch, rank, dtype=dtype, device=dev, requires_grad=True)
        w = (torch.randn(n, rank, dtype=dtype, device=dev) / math.sqrt(rank)).requires_grad_()
        b = torch.randn(n, dtype=dtype, device=dev).requires_grad_()
        impls = standard_impls(ctx, lambda *a: tr_cross_layer(*a, ctx.tf32), eager_cross_layer, (x0, x, u, w, b))
        mnk = 2.0 * batch * n * rank
        note = "fp32 with TF32 on both sides" if (dtype == torch.float32 and ctx.tf32) else ""
        return Built(impls, fwd_bwd_work(mnk, 2 * mnk), note)  # bwd: grad_u and grad_w GEMMs

    return build


# ---- loss --------------------------------------------------------------------------------------


def build_loss(ctx: Ctx, batch: int, dtype: torch.dtype) -> Built:
    logits = torch.randn(batch, dtype=dtype, device=ctx.device, requires_grad=True)
    labels = (torch.rand(batch, device=ctx.device) < 0.25).float()
    impls = standard_impls(ctx, tr_bce, eager_bce, (logits, labels))
    s, ls = logits.element_size(), labels.element_size()
    # fwd: read logits and labels. bwd: read logits and labels, write grad_logits.
    return Built(impls, fwd_bwd_work(batch * (s + ls), batch * (2 * s + ls)), "labels fp32, reduction mean")


# ---- targets -----------------------------------------------------------------------------------


@dataclass
class Target:
    """A goal checked on one impl's rows: ``value(triton) / reference >= threshold``."""

    text: str
    mode: str
    reference: str  # "copy" (fraction of copy bandwidth) or an impl name (speedup over it)
    threshold: float
    impl: str = "triton"


EMB_TARGETS = [
    Target("embedding forward >= 80% of copy bandwidth", "fwd", "copy", 0.8),
    Target("embedding backward (fused SGD update) >= 50% of copy bandwidth", "bwd", "copy", 0.5),
]
INTERACTION_TARGETS = [
    Target("interaction fwd+bwd >= 2x eager", "fwd+bwd", "eager", 2.0),
    Target("interaction fwd+bwd no slower than torch.compile", "fwd+bwd", "compile", 1.0),
]
LINEAR_TARGETS = [
    Target("fused linear+relu fwd no slower than cuBLAS + relu", "fwd", "eager", 1.0),
    Target("fused linear+relu fwd+bwd no slower than cuBLAS + relu", "fwd+bwd", "eager", 1.0),
]
LOSS_TARGETS = [Target("loss fwd+bwd >= 3x eager", "fwd+bwd", "eager", 3.0)]
# what kernels.interaction "auto" would need before choosing the Triton cross layer (dlrm.train.fast_path)
CROSS_TARGETS = [
    Target("cross layer fwd+bwd no slower than cuBLAS + eager epilogue", "fwd+bwd", "eager", 1.0),
    Target("cross layer fwd+bwd no slower than torch.compile", "fwd+bwd", "compile", 1.0),
]

SPECS = [
    Spec("hash_rows", "embedding", "GB/s", "modulus hashing of [B, 26] int64 ids", build_hash_rows),
    Spec("embedding_d16", "embedding", "GB/s", "Kaggle tables (F=26), D=16", build_embedding(16, None, "embedding_d16"), True, EMB_TARGETS),
    Spec("embedding_d128", "embedding", "GB/s", "Kaggle tables capped at 4M rows, D=128", build_embedding(128, 4_000_000, "embedding_d128"), False, EMB_TARGETS),
    Spec("interaction_d16", "interaction", "GB/s", "[B, 27, 16]", build_interaction(16), True, INTERACTION_TARGETS),
    Spec("interaction_d128", "interaction", "GB/s", "[B, 27, 128]", build_interaction(128), False, INTERACTION_TARGETS),
    Spec("linear_512x256", "linear", "TFLOP/s", "[B, 512] -> [B, 256], relu", build_linear(512, 256), True, LINEAR_TARGETS),
    Spec("linear_256x64", "linear", "TFLOP/s", "[B, 256] -> [B, 64], relu", build_linear(256, 64), False, LINEAR_TARGETS),
    Spec("linear_1024x1024", "linear", "TFLOP/s", "[B, 1024] -> [B, 1024], relu", build_linear(1024, 1024), False, LINEAR_TARGETS),
    Spec("loss", "loss", "GB/s", "BCE with logits, [B]", build_loss, True, LOSS_TARGETS),
    Spec("cross_432x128", "cross", "TFLOP/s", "DCN layer, [B, 128] -> [B, 432] (Kaggle)", build_cross(432, 128), True, CROSS_TARGETS),
    Spec("cross_3456x512", "cross", "TFLOP/s", "DCN layer, [B, 512] -> [B, 3456] (MLPerf)", build_cross(3456, 512), False, CROSS_TARGETS),
]  # fmt: skip


# ====================================================================================================
# Timing
# ====================================================================================================


def _do_bench_kwargs() -> dict:
    """Median from do_bench: return_mode where it exists (triton >= 3.0), else quantiles=[0.5]."""
    params = inspect.signature(triton.testing.do_bench).parameters
    return {"return_mode": "median"} if "return_mode" in params else {"quantiles": [0.5]}


def bench_graph_ms(fn, grad_to_none: list, rep_ms: int) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: the device time alone, with the host's
    launch cost (Python, custom-op dispatch, Triton's launcher) taken out, as in a training step run
    under CUDA graphs. No L2 flush between calls. Same method as triton.testing.do_bench_cudagraph
    (one graph of n calls, replayed 10 times), but captured on the *current* stream: the `bwd` mode
    replays a backward whose forward ran before the capture, and autograd launches backward kernels
    on the forward's stream, so that stream has to be the capturing one (run_case makes it so)."""
    stream = torch.cuda.current_stream()

    def captured(n: int) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(n):
                for t in grad_to_none:
                    t.grad = None
                fn()
        return g

    def replay_ms(g: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        g.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)

    one = captured(1)
    replay_ms(one)  # first replay uploads the graph
    n = max(1, min(1000, int(rep_ms / max(replay_ms(one), 1e-3))))
    del one
    graph = captured(n)
    replay_ms(graph)
    return statistics.median(replay_ms(graph) / n for _ in range(10))


def reset_cuda_rng_after_failed_capture(device: torch.device) -> None:
    """A capture that fails inside cudaStreamEndCapture leaves the default CUDA generator believing it
    is still capturing ("Offset increment outside graph capture encountered unexpectedly" on every
    later torch.randn). A cloned state is a fresh one with the same seed and offset: swap it in."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError) as exc:  # older torch: nothing to reset, or no API for it
        logger.debug(f"could not reset the CUDA generator: {one_line(exc)}")


def bench_ms(fn, grad_to_none: list, device: torch.device, warmup_ms: int, rep_ms: int, cpu_reps: int,
             timing: str = "launch") -> float:
    """Median milliseconds of fn() (compiled / autotuned by one untimed call first)."""
    fn()
    for t in grad_to_none:
        t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if timing == "graph":
            return bench_graph_ms(fn, grad_to_none, rep_ms)
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none or None, **_do_bench_kwargs())
        return float(ms[0] if isinstance(ms, (list, tuple)) else ms)
    times = []
    for _ in range(cpu_reps):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, args) -> tuple[float, float, int]:
    """(GB/s, ms, bytes) of dst.copy_(src) on a 1 GiB fp32 tensor (16 MiB on the CPU)."""
    nbytes = 2**30 if device.type == "cuda" else 2**24
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), [], device, args.warmup_ms, args.rep_ms, args.cpu_reps)
    src = dst = None  # frees the buffers; rebinding, not del: the timed lambda closes over these names
    free_memory(device)
    return 2 * nbytes / ms / 1e6, ms, 2 * nbytes


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ====================================================================================================
# Running the cases
# ====================================================================================================

CSV_FIELDS = ["kernel", "family", "shape", "mode", "batch", "dtype", "impl", "ms", "metric", "value",
              "bytes", "flops", "note", "error"]  # fmt: skip


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def base_row(spec: Spec, batch: int, dtype_name: str) -> dict:
    return {"kernel": spec.name, "family": spec.family, "shape": spec.shape, "batch": batch, "dtype": dtype_name,
            "metric": spec.metric, "ms": None, "value": None, "bytes": None, "flops": None, "note": "", "error": ""}  # fmt: skip


def time_mode(factory: ModeFactory, ctx: Ctx, args) -> tuple[float, str]:
    """(median ms, "" or why graph timing fell back to launch timing) of one mode."""
    if args.timing != "graph":
        fn, grad_to_none = factory()
        return bench_ms(fn, grad_to_none, ctx.device, args.warmup_ms, args.rep_ms, args.cpu_reps), ""
    try:
        # set up (a `bwd` mode runs its forward here) and capture on one side stream: see bench_graph_ms
        with torch.cuda.stream(ctx.graph_stream):
            fn, grad_to_none = factory()
            return bench_ms(fn, grad_to_none, ctx.device, args.warmup_ms, args.rep_ms, args.cpu_reps, "graph"), ""
    except RuntimeError as exc:
        # an op that syncs with the host (e.g. torch.unique) cannot be captured: time it the ordinary way
        # and say so in the row
        fn = grad_to_none = None  # drop the retained graph of the failed attempt
        torch.cuda.synchronize(ctx.device)
        reset_cuda_rng_after_failed_capture(ctx.device)
        fn, grad_to_none = factory()
        return bench_ms(fn, grad_to_none, ctx.device, args.warmup_ms, args.rep_ms, args.cpu_reps), one_line(exc)


def run_case(spec: Spec, batch: int, dtype_name: str, ctx: Ctx, args) -> list[dict]:
    """All impls and modes of one (kernel, batch, dtype): one row each (errors recorded, never raised)."""
    rows = []
    if "compile" in ctx.impls:
        torch._dynamo.reset()
    try:
        built = spec.build(ctx, batch, DTYPES[dtype_name])
    except Exception as exc:  # noqa: BLE001
        logger.warning(f"{spec.name} B={batch} {dtype_name}: setup failed: {one_line(exc)}")
        logger.debug(traceback.format_exc())
        return [{**base_row(spec, batch, dtype_name), "mode": "*", "impl": "(setup)", "error": one_line(exc)}]
    for impl, modes in built.impls.items():
        for mode in MODES:
            if mode not in modes:
                continue
            row = {**base_row(spec, batch, dtype_name), "mode": mode, "impl": impl, "note": built.note}
            work = built.work[mode]
            row["bytes" if spec.metric == "GB/s" else "flops"] = work
            try:
                ms, fallback = time_mode(modes[mode], ctx, args)
                if fallback:
                    logger.warning(f"{spec.name} {mode} B={batch} {dtype_name} {impl}: not capturable, launch-timed: {fallback}")
                    row["note"] = "; ".join(x for x in (row["note"], "launch-timed: not capturable in a CUDA graph") if x)
                row["ms"] = ms
                row["value"] = work / ms / (1e6 if spec.metric == "GB/s" else 1e9)
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
            except Exception as exc:  # noqa: BLE001
                row["error"] = one_line(exc)
                logger.warning(f"{spec.name} {mode} B={batch} {dtype_name} {impl}: {row['error']}")
                logger.debug(traceback.format_exc())
            rows.append(row)
    del built
    free_memory(ctx.device)
    return rows


def select_specs(names: Optional[str], quick: bool) -> list[Spec]:
    if not names:
        return [s for s in SPECS if s.quick or not quick]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if not any(n in (s.name, s.family) for s in SPECS)]
    if unknown:
        raise SystemExit(f"unknown --kernels {unknown}; choose from {[s.name for s in SPECS]} or families "
                         f"{sorted({s.family for s in SPECS})}")  # fmt: skip
    return [s for s in SPECS if s.name in wanted or s.family in wanted]


# ====================================================================================================
# Reporting: targets, tables, CSV, Markdown, plots
# ====================================================================================================


def fmt(v, digits=3) -> str:
    if v is None or v == "":
        return ""
    v = float(v)
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def lookup(rows: list[dict], **key) -> Optional[dict]:
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()) and r.get("ms") not in (None, ""):
            return r
    return None


def evaluate_targets(rows: list[dict], copy_gbps: float) -> list[dict]:
    """One verdict per (target, kernel, dtype), decided at the largest batch measured; all batches listed."""
    verdicts = []
    for spec in SPECS:
        for tgt in spec.targets:
            for dtype in sorted({r["dtype"] for r in rows if r["kernel"] == spec.name}):
                batches = sorted({r["batch"] for r in rows if r["kernel"] == spec.name and r["dtype"] == dtype and r["batch"] != ""})
                ratios = {}
                for b in batches:
                    mine = lookup(rows, kernel=spec.name, dtype=dtype, batch=b, mode=tgt.mode, impl=tgt.impl)
                    if mine is None:
                        continue
                    if tgt.reference == "copy":
                        ratios[b] = float(mine["value"]) / copy_gbps if copy_gbps else None
                    else:
                        ref = lookup(rows, kernel=spec.name, dtype=dtype, batch=b, mode=tgt.mode, impl=tgt.reference)
                        ratios[b] = float(ref["ms"]) / float(mine["ms"]) if ref else None
                measured = {b: r for b, r in ratios.items() if r is not None}
                if not measured:
                    verdict, ratio, at = "n/a", None, None
                else:
                    at = max(measured)
                    ratio = measured[at]
                    verdict = "PASS" if ratio >= tgt.threshold else "MISS"
                unit = "of copy BW" if tgt.reference == "copy" else f"x {tgt.reference}"
                verdicts.append({
                    "target": tgt.text, "kernel": spec.name, "dtype": dtype, "batch": at, "ratio": ratio,
                    "threshold": tgt.threshold, "unit": unit, "verdict": verdict,
                    "all": ", ".join(f"{b}: {fmt(r)}" for b, r in measured.items()),
                })  # fmt: skip
    return verdicts


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def verdict_table(verdicts: list[dict]) -> str:
    body = [[v["target"], v["kernel"], v["dtype"], v["batch"] or "", f"{fmt(v['ratio'])} {v['unit']}" if v["ratio"] is not None else "",
             f">= {v['threshold']:g}", f"**{v['verdict']}**", v["all"]] for v in verdicts]  # fmt: skip
    return md_table(["target", "kernel", "dtype", "B", "ratio", "needed", "verdict", "ratio per batch"], body)


def kernel_table(rows: list[dict], spec_name: str, metric: str, copy_gbps: float) -> str:
    """Pivot: one line per (mode, dtype, batch); per impl 'ms / metric' (+ % of copy BW for GB/s)."""
    mine = [r for r in rows if r["kernel"] == spec_name and r["mode"] != "*"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in mine)]
    refs = [i for i in ("eager", "compile") if i in impls and "triton" in impls]
    keys = sorted({(r["mode"], r["dtype"], r["batch"]) for r in mine}, key=lambda k: (MODES.index(k[0]), k[1], k[2]))
    body = []
    for mode, dtype, batch in keys:
        cells = []
        for impl in impls:
            r = next((r for r in mine if (r["mode"], r["dtype"], r["batch"], r["impl"]) == (mode, dtype, batch, impl)), None)
            if r is None:
                cells.append("")
            elif r.get("error"):
                cells.append("error")
            else:
                cell = f"{fmt(r['ms'])} ms / {fmt(r['value'])}"
                if metric == "GB/s" and copy_gbps:
                    cell += f" ({100 * float(r['value']) / copy_gbps:.0f}%)"
                cells.append(cell)
        speedups = []
        for ref in refs:
            a = lookup(mine, mode=mode, dtype=dtype, batch=batch, impl="triton")
            b = lookup(mine, mode=mode, dtype=dtype, batch=batch, impl=ref)
            speedups.append(f"{fmt(float(b['ms']) / float(a['ms']))}x" if a and b else "")
        body.append([mode, dtype, batch, *cells, *speedups])
    unit = f"ms / {metric}" + (" (% of copy BW)" if metric == "GB/s" else "")
    header = ["mode", "dtype", "B", *[f"{i} [{unit}]" for i in impls], *[f"triton speedup vs {r}" for r in refs]]
    return md_table(header, body)


def _allow_tf32_state() -> str:
    try:
        return str(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # legacy/new TF32 APIs mixed somewhere: report the new one
        return f"fp32_precision={getattr(torch.backends.cuda.matmul, 'fp32_precision', '?')}"


def environment(device: torch.device, args) -> dict:
    env = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "CUDA": torch.version.cuda or "none",
        "python": platform.python_version(),
        "TF32 for fp32 GEMMs": f"{args.tf32} (torch.backends.cuda.matmul.allow_tf32 = {_allow_tf32_state()}, both sides)",
        "timing": (f"perf_counter median of {args.cpu_reps} calls (CPU interpreter: meaningless)" if device.type != "cuda"
                   else f"triton.testing.do_bench_cudagraph median, rep {args.rep_ms} ms: calls replayed from a CUDA graph, "
                   "device time without the host's launch cost, no L2 flush" if args.timing == "graph"
                   else f"triton.testing.do_bench median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms: each call "
                   "launched from Python, so host launch cost counts where it exceeds the kernel time"),
        "command": "python " + " ".join(sys.argv),
    }  # fmt: skip
    return env


WHY_MISSED = ("Why targets are missed, and how the launch-timed (`kernels.md`) and CUDA-graph-timed "
              "(`kernels_graph.md`) verdicts differ: benchmarks/PERF.md, section \"Kernels: launch-timed and device-timed\".")


def write_markdown(path: Path, rows: list[dict], verdicts: list[dict], env: dict, copy: tuple, cpu: bool, tag: str = "") -> str:
    copy_gbps, copy_ms, copy_bytes = copy
    title = "Triton kernel benchmarks" + (", CUDA-graph timing (device time)" if tag == "_graph" else "")
    parts = [f"# {title}", ""]
    if cpu:
        parts += ["> **CPU smoke run under TRITON_INTERPRET=1 with tiny shapes: the timings, bandwidths and verdicts "
                  "below are meaningless.**", ""]  # fmt: skip
    parts += [f"- **{k}**: {v}" for k, v in env.items()]
    parts += [f"- **copy bandwidth**: {fmt(copy_gbps)} GB/s (`dst.copy_(src)`, {copy_bytes / 2 / 2**20:.0f} MiB, "
              f"{fmt(copy_ms)} ms; bytes read + written / time)", ""]  # fmt: skip
    parts += ["Modes: `fwd`, `bwd` (backward alone, from a retained graph), `fwd+bwd`. Impls: `triton` (kernels/), "
              "`eager` (eager PyTorch; the linear layer is cuBLAS `F.linear` + a separate `relu`; the embedding "
              "backward is `index_add_` of `-lr * grad`, what SGD does with the sparse COO gradient), `compile` "
              "(`torch.compile` of the eager function, default mode), `triton_atomic` (fp32 embedding SGD "
              "with atomics, non-deterministic). GB/s count the bytes each op must minimally move (embedding: "
              "each distinct row once); TFLOP/s count 2MNK per GEMM (backward: 2 GEMMs).", ""]  # fmt: skip
    parts += ["## Targets", "", verdict_table(verdicts), "", WHY_MISSED, ""]
    for spec in SPECS:
        if not any(r["kernel"] == spec.name for r in rows):
            continue
        notes = sorted({r["note"] for r in rows if r["kernel"] == spec.name and r.get("note")})
        parts += [f"## {spec.name}: {spec.shape} ({spec.metric})", ""]
        parts += [f"![{spec.name}]({spec.name}{tag}.png)", ""]
        parts += [kernel_table(rows, spec.name, spec.metric, copy_gbps), ""]
        if notes:
            parts += ["Notes: " + "; ".join(notes[:6]), ""]
    errors = [r for r in rows if r.get("error")]
    if errors:
        parts += ["## Errors", ""]
        parts += [md_table(["kernel", "mode", "B", "dtype", "impl", "error"],
                           [[r["kernel"], r["mode"], r["batch"], r["dtype"], r["impl"], r["error"].replace("|", "\\|")] for r in errors]), ""]  # fmt: skip
    text = "\n".join(parts)
    path.write_text(text)
    return text


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})


def read_csv(path: Path) -> list[dict]:
    """Rows of an earlier run (for --append), with numbers parsed back."""
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            for k in ("ms", "value", "bytes", "flops"):
                r[k] = float(r[k]) if r.get(k) else None
            r["batch"] = int(r["batch"]) if r.get("batch") not in (None, "") else ""
            rows.append(r)
    return rows


def plot_kernel(path: Path, rows: list[dict], spec: Spec, copy_gbps: float) -> bool:
    """xFormers style: x = batch size, y = GB/s or TFLOP/s, one line per impl (and dtype), one subplot per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["kernel"] == spec.name and r.get("value") not in (None, "")]
    if not mine:
        return False
    fig, axes = plt.subplots(1, len(MODES), figsize=(5 * len(MODES), 4), squeeze=False)
    colors = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    styles = {"fp32": "-", "bf16": "--"}
    for ax, mode in zip(axes[0], MODES):
        for impl in IMPLS:
            for dtype in DTYPES:
                pts = sorted((r["batch"], float(r["value"])) for r in mine if (r["mode"], r["impl"], r["dtype"]) == (mode, impl, dtype))
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, styles[dtype], marker="o", color=colors[impl], label=f"{impl} {dtype}")
        if spec.metric == "GB/s" and copy_gbps:
            ax.axhline(copy_gbps, color="grey", linestyle=":", label="copy bandwidth")
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in mine})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_title(f"{spec.name} {mode}")
        ax.set_xlabel("batch size")
        ax.set_ylabel(spec.metric)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{spec.name}: {spec.shape}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ====================================================================================================
# Main
# ====================================================================================================


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", help="comma-separated kernel variants or families (default: all; see --list)")
    p.add_argument("--batch-sizes", help="comma-separated (default 2048,16384,65536; --quick 2048,16384; cpu 8,16)")
    p.add_argument("--dtypes", help="comma-separated of fp32,bf16 (default both; cpu: fp32, the interpreter's only dtype)")
    p.add_argument("--impls", help=f"comma-separated of {','.join(IMPLS)} (default all; cpu: no compile)")
    p.add_argument("--quick", action="store_true", help="few small cases: one variant per family, small batches")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1; smoke test only)")
    p.add_argument("--out", default="benchmarks/results", help="output folder (kernels.csv, kernels.md, <kernel>.png)")
    p.add_argument("--append", action="store_true", help="merge into an existing kernels.csv: replace the (kernel, batch, dtype) cases measured now, keep the rest")
    p.add_argument("--no-tf32", dest="tf32", action="store_false", help="fp32 GEMMs in full fp32 on both sides")
    p.add_argument("--max-rows", type=int, help="cap every embedding table at this many rows (cpu default 2000)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per case on the CPU")
    p.add_argument("--timing", choices=["launch", "graph"], default="launch",
                   help="launch: do_bench, each call launched from Python (host cost included where it dominates); "
                   "graph: do_bench_cudagraph, device time alone; writes kernels_graph.* and <kernel>_graph.png")
    p.add_argument("--list", action="store_true", help="print the kernel variants and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="log tracebacks of failing cases")
    add_overwrite(p)  # (--append merges into kernels.csv and redraws the rest: asked for, never refused)
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def resolve_options(args) -> tuple[torch.device, list[int], list[str], tuple[str, ...]]:
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu with TRITON_INTERPRET=1 for a smoke test)")
    from kernels._backend import interpret_mode  # imported here: TRITON_INTERPRET is set above before triton loads

    if cpu and not interpret_mode():
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (set before triton is imported)")
    if args.batch_sizes:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    else:
        batches = [8, 16] if cpu else ([2048, 16384] if args.quick else [2048, 16384, 65536])
    if cpu and args.quick and not args.batch_sizes:
        batches = [8]
    dtypes = [d.strip() for d in (args.dtypes or ("fp32" if cpu else "fp32,bf16")).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"unknown --dtypes {bad}; choose from {list(DTYPES)}")
    default_impls = ",".join(i for i in IMPLS if not (cpu and i == "compile"))
    impls = tuple(i.strip() for i in (args.impls or default_impls).split(",") if i.strip())
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"unknown --impls {bad}; choose from {list(IMPLS)}")
    if cpu and args.timing == "graph":
        raise SystemExit("--timing graph needs CUDA (CUDA graphs)")
    if cpu and args.max_rows is None:
        args.max_rows = 2000
    return device, batches, dtypes, impls


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    logger.remove()
    logger.add(lambda m: ProgressBar.write(m, end=""), level="DEBUG" if args.verbose else "INFO", colorize=False,
               format="{time:HH:mm:ss} | {level: <7} | {message}")  # fmt: skip
    if args.list:
        for s in SPECS:
            print(f"{s.name:<24} {s.family:<12} {s.metric:<8} {s.shape}{'  (quick)' if s.quick else ''}")
        return 0
    specs = select_specs(args.kernels, args.quick)
    device, batches, dtypes, impls = resolve_options(args)
    tag = "_graph" if args.timing == "graph" else ""
    names = [f"kernels{tag}.csv", f"kernels{tag}.md", *(f"{s.name}{tag}.png" for s in specs)]
    outputs = claim_outputs(ap, args, args.out, names, append=args.append)
    cpu = device.type == "cpu"
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")  # sets matmul.allow_tf32 consistently
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if cpu:
        logger.warning("CPU smoke run (Triton interpreter, tiny shapes): timings are meaningless")
    ctx = Ctx(device=device, impls=impls, tf32=args.tf32, max_rows=args.max_rows,
              graph_stream=torch.cuda.Stream(device) if args.timing == "graph" else None)
    env = environment(device, args)
    logger.info(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['CUDA']}")

    copy = copy_bandwidth(device, args)
    logger.info(f"copy bandwidth: {copy[0]:.0f} GB/s ({copy[2] / 2 / 2**20:.0f} MiB copy, {copy[1]:.3f} ms)")
    rows = [{"kernel": "copy", "family": "copy", "shape": f"{copy[2] // 2} bytes", "mode": "fwd", "batch": "", "dtype": "fp32",
             "impl": "torch", "ms": copy[1], "metric": "GB/s", "value": copy[0], "bytes": copy[2], "note": "dst.copy_(src)"}]  # fmt: skip

    cases = [(s, d, b) for s in specs for d in dtypes for b in batches]
    logger.info(f"{len(cases)} cases: kernels {[s.name for s in specs]}, batches {batches}, dtypes {dtypes}, impls {list(impls)}")
    t0 = time.perf_counter()
    # `timeout` sends SIGTERM: stop after the case in flight and still write what was measured. The caller's handler
    # comes back after the cases: called in-process (the tests), it stayed, and a later SIGTERM in that process raised
    # KeyboardInterrupt (a test worker went down on a training test's own SIGTERM)
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for spec, dtype, batch in ProgressBar(cases, desc="kernels", unit="case", dynamic_ncols=True):
            if _TABLES and not spec.name.startswith("embedding_"):
                _TABLES.clear()  # the cached tables take up to ~10 GB
                free_memory(device)
            try:
                rows += run_case(spec, batch, dtype, ctx, args)
            except Exception as exc:  # noqa: BLE001  (e.g. a CUDA error that poisoned the context)
                logger.error(f"{spec.name} B={batch} {dtype}: {one_line(exc)}")
                rows.append({**base_row(spec, batch, dtype), "mode": "*", "impl": "(case)", "error": one_line(exc)})
    except KeyboardInterrupt:
        logger.warning(f"interrupted: writing the {len(rows) - 1} results measured so far (the other cases are missing)")
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    _TABLES.clear()
    free_memory(device)
    logger.info(f"measured in {time.perf_counter() - t0:.0f} s")

    csv_path = out / f"kernels{tag}.csv"
    if args.append and csv_path.exists():
        # replace exactly the (kernel, batch, dtype) cases measured now: a rerun of a few cases (or one
        # cut short by its time limit) keeps every other row of the file
        done = {(r["kernel"], str(r["batch"]), r["dtype"]) for r in rows if r["kernel"] != "copy"}
        kept = [r for r in read_csv(csv_path) if r["kernel"] != "copy" and (r["kernel"], str(r["batch"]), r["dtype"]) not in done]
        rows = rows[:1] + kept + rows[1:]
    write_csv(csv_path, rows)
    verdicts = evaluate_targets(rows, copy[0])
    plotted = [s.name for s in SPECS if plot_kernel(out / f"{s.name}{tag}.png", rows, s, copy[0])]
    md_path = out / f"kernels{tag}.md"
    text = write_markdown(md_path, rows, verdicts, env, copy, cpu, tag)
    print(text)
    n_err = sum(1 for r in rows if r.get("error"))
    logger.info(f"wrote {csv_path}, {md_path} and {len(plotted)} plots; {n_err} failed cases")
    outputs.paths = [csv_path, md_path, *(out / f"{name}{tag}.png" for name in plotted)]  # --append: its merge's too
    outputs.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
