"""One training step and one evaluation forward, optionally under torch.compile.

Where the embedding produces sparse gradients (the eager `SparseArch`), the lookup stays eager
and only the dense part (DenseArch, InteractionArch, OverArch, loss) is compiled: Inductor does
not handle sparse gradients. A Triton embedding whose backward applies the optimizer itself is
an ordinary custom op, so the whole forward is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from dlrm.config import CompileConfig
from dlrm.data.batch import GatheredBatch
from dlrm.data.loader import Batch
from dlrm.logging_setup import run_logger
from dlrm.model.dlrm import DLRM, named_range
from dlrm.train.optim import FusedSparseOptimizer

# train.compile.mode that is not one of torch.compile's modes: Inductor's option max_autotune_gemm alone
GEMM_AUTOTUNE_MODE = "max-autotune-gemm"


def set_matmul_precision(precision: str) -> None:
    """TF32 tensor cores for fp32 CUDA matmuls exactly when ``precision == "tf32"``.

    A process-wide switch (cuBLAS and the Triton linear kernel both follow it), set explicitly
    either way so that one run cannot inherit another's setting. On torch >= 2.9 through
    ``torch.set_float32_matmul_precision``, which sets the new per-backend ``fp32_precision`` too:
    set with the new API alone, the legacy reader ``torch.get_float32_matmul_precision()`` raises
    ("mix of the legacy and new APIs"), and Inductor's max-autotune calls it (found on the H100 with
    torch 2.11, compile mode max-autotune-no-cudagraphs in tf32). CPU matmuls (oneDNN) stay exact fp32.
    """
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    else:  # torch < 2.9
        matmul.allow_tf32 = precision == "tf32"


def precision_on(precision: str, device: torch.device) -> str:
    """The precision a run on `device` computes in (summary.json's "resolved" records it): "tf32" is CUDA's (its TF32
    tensor cores); elsewhere the matmuls stay IEEE fp32 (`set_matmul_precision`), so the run is an fp32 run.

        >>> precision_on("tf32", torch.device("cpu")), precision_on("bf16", torch.device("cpu"))
        ('fp32', 'bf16')
    """
    return "fp32" if precision == "tf32" and device.type != "cuda" else precision


def warn_precision_on(precision: str, device: torch.device, what: str) -> None:
    """Say that train.precision "tf32" has no effect on `device` (not CUDA), as the other CUDA-only settings are said
    there (compile mode reduce-overhead, train.cuda_graph, combo kernels): a warning, and `what` runs on. A CPU run
    in "tf32" trained in fp32 without a word, and its log line said "precision tf32"."""
    if precision_on(precision, device) != precision:
        run_logger.warning(f'train.precision "{precision}" has no effect on {device.type} (TF32 tensor cores are '
                           f"CUDA's): {what} is IEEE fp32")


def autocast_context(device: torch.device, precision: str, cache: bool = True):
    """bf16 autocast, or nothing. ``cache=False`` for a region captured into a CUDA graph: autocast's
    cache of cast weights would outlive the capture (PyTorch's CUDA-graph notes ask for it)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def compile_counters() -> dict[str, int]:
    """Graphs compiled and graph breaks so far in this process (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


@functools.lru_cache(maxsize=1)
def custom_op_source_digest() -> str:
    """A digest of the sources that define this project's custom ops (`kernels/`, `dlrm/model/`)."""
    digest = hashlib.sha256()
    for package in ("kernels", "dlrm.model"):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*.py")):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def tag_compile_caches() -> str:
    """Add the custom ops' source digest to torch.compile's cache keys (``torch.compiler.config.cache_key_tag``,
    keeping a tag the user set); returns the tag.

    Inductor's on-disk caches key a graph by its FX code, which names a custom op but not what its fake
    implementation returns (pytorch/pytorch#160472): after a change to an op's outputs, a graph compiled by the
    old code was reloaded and failed on its output's shape (found on the H100, torch 2.11, 2026-11-24, when the
    one-hot lookup stopped writing rows). Runs of the same sources still share the caches."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return ""
    ours = f"dlrm-ops-{custom_op_source_digest()}"
    tag = str(config.cache_key_tag or "")
    if ours not in tag:
        config.cache_key_tag = f"{tag}+{ours}" if tag else ours
    return config.cache_key_tag


# the torch.compile modes that make CUDA graphs, and what a run on another device compiles with instead (max-autotune's
# CUDA graphs cannot run there either: said, as for reduce-overhead, and compiled with the rest of what the mode does)
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def compile_mode_on(cfg: CompileConfig, device: torch.device) -> str:
    """The mode a compiled run on `device` uses (`_maybe_compile`; summary.json's "resolved" records it): "auto" is
    resolved by dlrm.train.fast_path (build_run), and a caller that skips it gets mode default; off CUDA, the CUDA
    graph modes become their modes without graphs.

        >>> compile_mode_on(CompileConfig(enabled=True, mode="reduce-overhead"), torch.device("cpu"))
        'default'
    """
    mode = "default" if cfg.mode == "auto" else cfg.mode
    return CUDA_GRAPH_MODES.get(mode, mode) if device.type != "cuda" else mode


class _ProfilerRangeNotice(logging.Filter):
    """Drops Dynamo's "Profiler record function ... will be ignored" (`quiet_compile_notices`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Profiler record function", "Profiler function"))


# the loggers Dynamo tells a record_function it traces through (torch._dynamo.variables: the context manager, the call)
_DYNAMO_PROFILER_LOGGERS = ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch")


def quiet_compile_notices() -> None:
    """Two notices every compiled run printed on its first step, which tell a user of this program nothing to do:
    Dynamo's warning that the model's record_function ranges (DenseArch, SparseArch, ...) are left out of the compiled
    graph (the profile's trace summary says a compiled region shows its kernels, not those ranges), and, on CUDA in
    fp32, Inductor's advice to call ``torch.set_float32_matmul_precision('high')``, which this program overrides with
    `train.precision` (its "tf32" is the setting that runs fp32 matmuls on the tensor cores, as the README says)."""
    for name in _DYNAMO_PROFILER_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _ProfilerRangeNotice) for f in log.filters):
            log.addFilter(_ProfilerRangeNotice())
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication available "
                            "but not enabled", category=UserWarning)


def _maybe_compile(fn: Callable, cfg: CompileConfig, device: torch.device, what: str) -> Callable:
    if not cfg.enabled:
        return fn
    tag_compile_caches()
    quiet_compile_notices()
    if device.type == "cpu" and (os.cpu_count() or 1) <= 4:
        # Inductor's pool of compile workers keeps competing for the cores after compilation;
        # on a 2-core machine that made compiled CPU steps ~50x slower than eager. Compile in-process.
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    mode = compile_mode_on(cfg, device)
    if mode != cfg.mode and cfg.mode in CUDA_GRAPH_MODES:
        run_logger.warning(f"compile mode {cfg.mode} (CUDA graphs) needs CUDA; {what} uses mode {mode} on {device}")
    if cfg.mode == "reduce-overhead" and device.type != "cuda":
        return torch.compile(fn, mode="default", fullgraph=cfg.fullgraph)
    # not a torch.compile mode: Inductor's GEMM template autotuning alone (mode max-autotune also tunes
    # every pointwise and reduction kernel, by coordinate descent too)
    options = {"max_autotune_gemm": True} if mode == GEMM_AUTOTUNE_MODE else None
    if cfg.combo_kernels is True and device.type != "cuda":
        run_logger.warning(f"train.compile.combo_kernels is for CUDA (Triton kernels); {what} compiles without it on {device}")
    elif cfg.combo_kernels is True:  # only the combos that time faster are kept (benchmark_combo_kernel), as measured
        from torch._inductor import list_mode_options  # what mode=... applies: torch.compile takes a mode or options

        options = {**(options or list_mode_options(mode)), "combo_kernels": True, "benchmark_combo_kernel": True}
    if options is not None:
        return torch.compile(fn, options=options, fullgraph=cfg.fullgraph)
    return torch.compile(fn, mode=mode, fullgraph=cfg.fullgraph)


def nonfinite_weight(model: torch.nn.Module, env) -> Optional[str]:
    """The name of a parameter of `model` holding a NaN or Inf (on any rank of `env`: "on another rank"), or
    None; one host sync. An update that overflowed leaves its step's loss finite (computed before it): the loss
    checks alone let a checkpoint or best.pt of such a model be written. ``aminmax`` reduces without a copy of a
    table (``isfinite`` would allocate one as large) and carries a NaN or Inf into its min or max."""
    params = [(name, p.detach()) for name, p in model.named_parameters() if p.numel()]
    bounds = torch.stack([torch.stack(torch.aminmax(p)).float() for _, p in params])
    finite = torch.isfinite(bounds).all(dim=1)
    flag = (~finite).any().to(torch.int64).reshape(1)
    if not int(env.all_reduce_max(flag).item()):
        return None
    local = [name for (name, _), ok in zip(params, finite.tolist()) if not ok]
    return local[0] if local else "on another rank"


class TrainStep:
    """forward, loss, backward and the optimizer steps for one batch.

    Args:
        model: the DLRM (uncompiled; its state is what checkpoints save).
        loss_fn: (logits [B], labels [B]) -> scalar.
        optimizers: stepped in order after backward.
        precision: "fp32" or "bf16" (autocast).
        device: the model's device.
        compile_cfg: torch.compile settings.
        dense_forward: ``(dense, embeddings) -> logits`` for everything after the lookup; default
            ``model.forward_from_embeddings`` (a distributed run passes the DDP wrapper of those parts).

    Calling it with a `Batch` returns the loss as a detached 0-dim device tensor (no host sync).

    Example:
        >>> from dlrm.config import ModelConfig, OptimConfig
        >>> from dlrm.model.dlrm import build_loss, build_model
        >>> from dlrm.train.optim import build_optimizers
        >>> model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [10] * 3,
        ...                     log_kernels=False)
        >>> batch = Batch(torch.randn(6, 13), torch.randint(0, 50, (6, 3)), torch.tensor([0.0, 1.0] * 3))
        >>> step = TrainStep(model, build_loss(), build_optimizers(model, OptimConfig()), "fp32", torch.device("cpu"),
        ...                  CompileConfig(enabled=False))
        >>> expected = build_loss()(model(batch.dense, batch.sparse), batch.labels)
        >>> table = model.sparse_arch.weight.detach().clone()
        >>> loss = step(batch)   # forward, backward, both optimizers stepped
        >>> loss.shape, loss.requires_grad, torch.allclose(loss, expected)
        (torch.Size([]), False, True)
        >>> torch.equal(model.sparse_arch.weight, table), model.sparse_arch.weight.grad
        (False, None)

    Shapes: a `Batch` (dense [B, 13], sparse [B, F] or multi-hot [B, L], labels [B]) -> 0-dim loss.
    """

    def __init__(self, model: DLRM, loss_fn, optimizers, precision: str, device: torch.device, compile_cfg: CompileConfig,
                 dense_forward: Optional[Callable] = None):
        self.model, self.loss_fn, self.optimizers = model, loss_fn, optimizers
        self.dense_forward = dense_forward or model.forward_from_embeddings
        # Decided here, not in the compiled `_full_loss`: torch 2.11's Dynamo cannot compare two bound methods, and
        # that comparison there made it give up on the whole frame, so the loss and its backward ran as eager ops
        # beside a separately compiled model forward (seen on the GPU, twenty-fourth run).
        self.lookup_builds_concat = model.concat_in_lookup and self.dense_forward == model.forward_from_embeddings
        self.precision, self.device = precision, device
        self.embedding_in_graph = model.sparse_arch.compilable  # see dlrm.model.interfaces
        # A sharded SparseArch (distributed run) is called with the global batch size, and each
        # rank's loss becomes its share of the global mean (see `_share`).
        self.collective = model.sparse_arch.collective
        self.cudagraphs = compile_cfg.enabled and compile_cfg.mode == "reduce-overhead" and device.type == "cuda"
        self.autocast_cache = True  # GraphedTrainStep turns it off
        fn = self._full_loss if self.embedding_in_graph else self._dense_loss
        self._loss = _maybe_compile(fn, compile_cfg, device, "the training step")

    def _dense_loss(self, dense: torch.Tensor, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.device, self.precision, self.autocast_cache):
            logits = self.dense_forward(dense, embeddings)
        with named_range("loss"):
            return self.loss_fn(logits.float(), labels)

    def _full_loss(self, dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.lookup_builds_concat:
            with autocast_context(self.device, self.precision, self.autocast_cache):
                logits = self.model(dense, sparse)  # the lookup writes the DCN input's concatenation itself
            with named_range("loss"):
                return self.loss_fn(logits.float(), labels)
        # named as `run` names the lookup it makes itself: without the range, --profile's step breakdown had no
        # SparseArch row for a lookup made here (the Triton embedding's), its time counted as "other"
        with autocast_context(self.device, self.precision, self.autocast_cache), named_range("SparseArch"):
            embeddings = self.model.sparse_arch(sparse)
        return self._dense_loss(dense, embeddings, labels)

    def __call__(self, batch: Batch) -> torch.Tensor:
        self.load_lrs()
        return self.run(batch)

    def load_lrs(self) -> None:
        """Copy the scheduled learning rates into the device tensors kernels read them from."""
        for opt in self.optimizers:
            if isinstance(opt, FusedSparseOptimizer):
                opt.load_lr()  # a fused embedding backward reads its scheduled lr from a device tensor

    def run(self, batch: Batch) -> torch.Tensor:
        """The step without `load_lrs` (what GraphedTrainStep captures)."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be reused
        if isinstance(batch, GatheredBatch) and not batch.gathered:
            with named_range("data"):  # the batch's gathers (`GatheredBatch`), the loader's work: --profile's "data" row
                batch.gather()
        if self.embedding_in_graph:
            loss = self._loss(batch.dense, batch.sparse, batch.labels)
        else:
            with named_range("SparseArch"):
                embeddings = (self.model.sparse_arch(batch.sparse, batch.global_len) if self.collective
                              else self.model.sparse_arch(batch.sparse))
            loss = self._loss(batch.dense, embeddings, batch.labels)
        if self.collective:
            loss = self._share(loss, batch)
        with named_range("backward"):
            loss.backward()
        with named_range("optimizer"):
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return loss.detach()

    def _share(self, loss: torch.Tensor, batch: Batch) -> torch.Tensor:
        """This rank's mean loss times ``B_rank * W / B_global``: DDP's average of the ranks'
        gradients is then the gradient of the global batch's mean loss, also when the last batch
        splits unevenly; the sum of the ranks' values over W is the global mean loss."""
        factor = len(batch) * self.model.sparse_arch.world_size / batch.global_len
        return loss if factor == 1.0 else loss * factor


class EvalForward:
    """Logits of a batch without gradients, compiled separately from the training step.

    A compiled evaluation pads the last partial batch to the full eval batch size so its
    shape never changes (no recompile), and drops the padded rows from the result.

    Args:
        model: the DLRM (uncompiled).
        precision: "fp32" or "bf16" (autocast).
        device: the model's device.
        compile_cfg: torch.compile settings (``enabled``: compiled, partial batches padded).
        batch_size: the evaluation batch size, which a compiled evaluation pads partial batches to.
        dense_forward: ``(dense, embeddings) -> logits``, as `TrainStep`'s (the sharded lookup's runs).

    Example:
        >>> from dlrm.config import ModelConfig
        >>> from dlrm.model.dlrm import build_model
        >>> model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[4], top_mlp=[1]), [10] * 3, log_kernels=False)
        >>> batch = Batch(torch.randn(5, 13), torch.randint(0, 50, (5, 3)), torch.zeros(5))
        >>> logits = EvalForward(model, "fp32", torch.device("cpu"), CompileConfig(enabled=False), batch_size=8)(batch)
        >>> logits.shape, logits.requires_grad, torch.equal(logits, model(batch.dense, batch.sparse))
        (torch.Size([5]), False, True)

    Shapes: a `Batch` of B rows -> fp32 logits [B].
    """

    def __init__(self, model: DLRM, precision: str, device: torch.device, compile_cfg: CompileConfig, batch_size: int,
                 dense_forward: Optional[Callable] = None):
        self.model, self.precision, self.device, self.batch_size = model, precision, device, batch_size
        self.dense_forward = dense_forward or model.forward_from_embeddings
        self.collective = model.sparse_arch.collective
        self.pad = compile_cfg.enabled and not self.collective
        self._forward = _maybe_compile(self._logits, compile_cfg, device, "evaluation")
        if self.collective:  # the sharded lookup runs eagerly; the dense part is compiled
            self._dense = _maybe_compile(self._dense_logits, compile_cfg, device, "evaluation")

    def _logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.device, self.precision):
            return self.model(dense, sparse).float()

    def _dense_logits(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.device, self.precision):
            return self.dense_forward(dense, embeddings).float()

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        if self.collective:
            return self._dense(batch.dense, self.model.sparse_arch(batch.sparse, batch.global_len))
        n = len(batch)
        dense, sparse = batch.dense, batch.sparse
        if self.pad and n < self.batch_size:
            extra = self.batch_size - n
            dense = torch.cat([dense, dense[:1].expand(extra, -1)])
            sparse = torch.cat([sparse, sparse[:1].expand(extra, -1)])
        if self.pad and self.device.type == "cuda" and torch.cuda.is_available():
            torch.compiler.cudagraph_mark_step_begin()
        return self._forward(dense, sparse)[:n].clone()
