"""benchmarks/kernels.py's cases: each kernel variant builds, for one (batch, dtype), its implementations and the work
per mode; the targets each variant is checked against, and SPECS, the list of variants. Moved out of kernels.py
unchanged (the 600-line rule)."""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from _kernels_adapter import (eager_bce, eager_cross_layer, eager_embedding_fwd, eager_embedding_sgd_update_,
                              eager_embedding_step, eager_hash_rows, eager_interaction, eager_linear_relu, tr_bce,
                              tr_cross_layer, tr_dot_interaction, tr_embedding_lookup, tr_embedding_sgd_update_,
                              tr_fused_embedding, tr_hash_rows, tr_linear_relu)
from dlrm.data.schema import KAGGLE_CARDINALITIES  # Criteo Kaggle table sizes, F = 26
from dlrm.model.hashing import modulus_rows

MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("triton", "triton_atomic", "eager", "compile")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NUM_VECTORS = len(KAGGLE_CARDINALITIES) + 1  # F + 1 interacting vectors (dense + 26 embeddings)
EMBEDDING_LR = 1e-3


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


# frees what a dropped case or table held (embedding_tables before new tables; kernels.py after every case)
def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
