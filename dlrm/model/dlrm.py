"""DLRM assembled from the config: the one place that picks torch or triton per component."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from loguru import logger
from torch import nn
from torch.profiler import record_function

from dlrm.config import ConfigError, KernelsConfig, ModelConfig
from dlrm.data.schema import NUM_DENSE
from dlrm.model.archs import DenseArch, InteractionArch, OverArch, SparseArch

def named_range(name: str):
    """`record_function(name)` (the DenseArch, SparseArch, ... ranges of --profile's trace and step breakdown) while a
    profiler records or torch.compile traces, else a null context. Entered with no profiler, a record_function still
    runs torch's RecordFunction machinery: 5-9 us of host time each on the CPU, nine a step (~70 us a step, 2% of the
    sample's CPU step), in every run, profiled or not. Compiling: traced as before (``is_compiling`` first, so Dynamo
    puts no guard on the profiler's flag and a profiler starting recompiles nothing)."""
    if torch.compiler.is_compiling() or getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return record_function(name)
    return contextlib.nullcontext()


# Whether a DCN model with a lookup that takes a prefix slot builds the cross network's input in the lookup
# (`DLRM.concat_in_lookup`); module-level so that a benchmark can compare both.
CONCAT_IN_LOOKUP = True


class DLRM(nn.Module):
    """Deep Learning Recommendation Model (Naumov et al., 2019).

    dense [B, 13] -> DenseArch -> [B, D];  raw sparse [B, F] -> SparseArch -> [B, F, D];
    both -> InteractionArch -> OverArch -> logits [B]. The sigmoid is applied only for
    predictions (`predict`); training uses BCE with logits.

    Args:
        dense_arch, sparse_arch, interaction_arch, over_arch: the four parts.

    Example:
        >>> cfg = ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
        >>> model = build_model(cfg, [10] * 26)
        >>> model(torch.randn(4, 13), torch.randint(0, 100, (4, 26))).shape
        torch.Size([4])

    Shapes: dense [B, 13], raw sparse int64 [B, F] (multi-hot: [B, L], L = sum of the features' hotness) -> logits [B].
    """

    def __init__(self, dense_arch: nn.Module, sparse_arch: nn.Module, interaction_arch: nn.Module, over_arch: nn.Module):
        super().__init__()
        self.dense_arch = dense_arch
        self.sparse_arch = sparse_arch
        self.interaction_arch = interaction_arch
        self.over_arch = over_arch
        # The DCN interaction takes cat([dense vector, embeddings]) as one [B, (F+1) D] tensor; a sparse arch that
        # can write its pooled rows after a prefix slot (the Triton pooled embedding) builds it in the lookup, one
        # pass over [B, F, D] less than a separate concatenation (0.30 ms a step at MLPerf DLRM-DCNv2's shapes).
        self.concat_in_lookup = (CONCAT_IN_LOOKUP and bool(getattr(sparse_arch, "takes_prefix", False))
                                 and getattr(interaction_arch, "kind", None) == "dcn")

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if self.concat_in_lookup:
            with named_range("DenseArch"):
                d = self.dense_arch(dense)
            with named_range("SparseArch"):
                combined = self.sparse_arch(sparse, prefix=d)  # [B, 1 + F, D]
            with named_range("InteractionArch"):
                x = self.interaction_arch.from_combined(combined)
            with named_range("OverArch"):
                return self.over_arch(x)
        with named_range("SparseArch"):
            embeddings = self.sparse_arch(sparse)
        return self.forward_from_embeddings(dense, embeddings)

    def forward_from_embeddings(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Everything after the lookup: [B, 13], [B, F, D] -> logits [B].

        Split out so torch.compile can take this dense part while an embedding with sparse
        gradients (which Inductor does not handle) stays eager. A distributed run calls the
        DistributedDataParallel wrapper of these parts instead (`dlrm.distributed.data_parallel`,
        passed to the train step by `dlrm.train.builder`).
        """
        return dense_forward(self, dense, embeddings)

    @torch.no_grad()
    def predict(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Click probabilities [B]."""
        return torch.sigmoid(self.forward(dense, sparse).float())


def dense_forward(parts: nn.Module, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """DenseArch, InteractionArch and OverArch of `parts` (a DLRM, or the DDP-wrapped dense parts)."""
    with named_range("DenseArch"):
        d = parts.dense_arch(dense)
    with named_range("InteractionArch"):
        x = parts.interaction_arch(d, embeddings)
    with named_range("OverArch"):
        return parts.over_arch(x)


def build_model(
    cfg: ModelConfig,
    cardinalities: list[int],
    vocabs: Optional[list[torch.Tensor]] = None,
    kernels: Optional[KernelsConfig] = None,
    device: torch.device | str = "cpu",
    sparse_arch: Optional[Callable[[], nn.Module]] = None,
    compiled: bool = False,
    multi_hot_sizes: Optional[list[int]] = None,
    log_kernels: bool = True,
) -> DLRM:
    """Build a DLRM on `device`, with eager or Triton parts as `kernels` asks (logged unless `log_kernels` is False:
    a model that is not the run's, such as an export's PyTorch copy, whose line would read as the run's kernels).

    Args:
        cfg: the model section of the config (``embedding_dim`` is D; MLP widths, interaction, ...).
        cardinalities: table size per feature (F ints).
        vocabs: for vocabulary hashing, each feature's sorted vocabulary (as `SparseArch`); None: modulus.
        kernels: torch or Triton per component (default: all torch).
        device: where the parameters are created (directly: no pass through host memory).
        sparse_arch: a function that builds the SparseArch instead (a distributed run's sharded one,
            see `dlrm.train.builder`); it is called where this function would build its own, so the
            parameters draw from the RNG in the same order as in a one-process run.
        compiled: the training step will run under torch.compile (``train.compile.enabled``). The torch
            embedding is then `FusedUpdateSparseArch` (the optimizer in its backward, static shapes: compiled
            with the step) instead of `SparseArch`, whose sparse COO gradient keeps it out of the graph. Eager
            runs keep `SparseArch` (the reference): on the CPU (B=2048, F=26, D=16, row-wise Adagrad, one
            thread) its embedding step took 8.5 ms, the fused update's 16 ms eager and 7.3 ms compiled
            (SGD: 4.9 ms COO eager, 1.5 ms fused compiled).
        multi_hot_sizes: values per sample of each feature (``hotness``); any other than 1 gives the
            sum-pooled multi-hot SparseArch, whose input is [B, L] with ``L = sum(multi_hot_sizes)``.
        log_kernels: log the ``kernels: ...`` line.

    Example:
        >>> cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
        >>> model = build_model(cfg, [10, 20, 30], multi_hot_sizes=[2, 1, 1], log_kernels=False)
        >>> type(model.sparse_arch).__name__, model(torch.randn(5, 13), torch.randint(0, 99, (5, 4))).shape
        ('PooledSparseArch', torch.Size([5]))

    Shapes: the returned `DLRM`'s: dense [B, 13], raw sparse int64 [B, F] (multi-hot: [B, L]) -> logits [B].
    """
    kernels = kernels or KernelsConfig()
    choices = {k: getattr(kernels, k) for k in ("embedding", "interaction", "mlp", "loss")}
    # an interaction kernel the model's interaction has none of would be dropped below (the torch arch built while
    # the log line names the kernel): refused, as dlrm.config refuses it for a run's config
    if (choices["interaction"], cfg.interaction) in (("triton", "cat"), ("gluon", "dot"), ("gluon", "cat")):
        raise ConfigError(f'kernels.interaction: "{choices["interaction"]}" has no kernel for model.interaction '
                          f'"{cfg.interaction}"; use "torch"')
    triton_keys = [f'kernels.{k} "{v}"' for k, v in choices.items() if v in ("triton", "fused", "wgrad", "gluon")]
    if triton_keys:
        from kernels import check_triton_device

        # named as set: a config's kernels.mlp "fused" was reported as "--kernels triton", which was never passed
        check_triton_device(device, " and ".join(triton_keys) + " (Triton kernels)")
    if choices["interaction"] == "gluon":
        from kernels import TritonUnavailableError
        from kernels.cross_ws_op import gluon_hopper_available

        if not gluon_hopper_available(device):
            raise TritonUnavailableError(f'kernels.interaction "gluon" needs a Hopper GPU (sm_90) and a Triton with '
                                         f"Gluon's Hopper dialect; {device} is not one")
    if log_kernels:
        logger.info("kernels: " + ", ".join(f"{k}={v}" for k, v in choices.items()))

    # Parameters are created on `device` directly: the MLPerf-sized tables (tens of GB) must not
    # pass through host memory first. `.to` still moves buffers built from host tensors.
    with torch.device(device):
        model = _build_archs(cfg, cardinalities, vocabs, kernels, sparse_arch, compiled, multi_hot_sizes)
    return model.to(device)


def _build_archs(cfg: ModelConfig, cardinalities: list[int], vocabs, kernels: KernelsConfig,
                 sparse_arch: Optional[Callable[[], nn.Module]] = None, compiled: bool = False,
                 multi_hot_sizes: Optional[list[int]] = None) -> DLRM:
    linear_cls = mlp_cls = None
    if kernels.mlp == "triton":
        from kernels.linear import TritonLinear

        linear_cls = TritonLinear
    elif kernels.mlp == "fused":
        from kernels.mlp import FusedMLP

        mlp_cls = FusedMLP
    elif kernels.mlp == "wgrad":
        from kernels.wgrad import LinearReLUWgrad

        linear_cls = LinearReLUWgrad
    # The DCN model's reference (MLPerf DLRM-DCNv2: TorchRec's DLRM_DCN) initialises its MLPs as nn.Linear does; the
    # dot model's (the 2019 DLRM) with N(0, sqrt(2/(fan_in+fan_out))) weights and N(0, sqrt(1/fan_out)) biases
    mlp_init = "torchrec" if cfg.interaction == "dcn" else "dlrm"
    dense_arch = DenseArch(NUM_DENSE, cfg.bottom_mlp, cfg.activation, linear_cls=linear_cls, dropout=cfg.dropout,
                           mlp_cls=mlp_cls, input_multiple=cfg.bottom_mlp_input_multiple, init=mlp_init)
    multi_hot = multi_hot_sizes is not None and any(s != 1 for s in multi_hot_sizes)
    if sparse_arch is not None:
        sparse_arch = sparse_arch()
    elif multi_hot:
        sparse_arch = _pooled_sparse_arch(cfg, cardinalities, vocabs, kernels, multi_hot_sizes)
    elif kernels.embedding == "triton":
        from kernels.embedding import TritonSparseEmbedding

        # autocast_output: under bf16 autocast the rows leave the lookup in bf16, as the interaction takes them
        sparse_arch = TritonSparseEmbedding(cardinalities, cfg.embedding_dim, vocabs=vocabs,
                                            dtype=_TABLE_DTYPES[cfg.embedding_dtype], autocast_output=True)
    elif compiled:
        # torch.compile cannot take a sparse COO gradient; this twin of SparseArch updates the rows in
        # its backward with static shapes, so the whole step compiles (issue #19)
        from dlrm.model.fused_sparse import FusedUpdateSparseArch

        logger.info("embedding: torch with the sparse optimizer fused into its backward (compiled with the step)")
        sparse_arch = FusedUpdateSparseArch(cardinalities, cfg.embedding_dim, vocabs=vocabs)
    else:
        sparse_arch = SparseArch(cardinalities, cfg.embedding_dim, vocabs=vocabs)
    crossnet_cls = None
    if kernels.interaction == "triton" and cfg.interaction == "dcn":
        from kernels.cross import TritonLowRankCrossNet

        crossnet_cls = TritonLowRankCrossNet
    elif kernels.interaction == "gluon":
        from dlrm.model.archs import GluonLowRankCrossNet

        crossnet_cls = GluonLowRankCrossNet
    interaction = InteractionArch(len(cardinalities), cfg.embedding_dim, cfg.interaction,
                                  cross_layers=cfg.cross_layers, cross_rank=cfg.cross_rank, crossnet_cls=crossnet_cls)
    unpadded = interaction.output_dim
    pad = -unpadded % cfg.top_mlp_input_multiple
    if kernels.interaction == "triton" and cfg.interaction == "dot":
        from kernels.interaction import TritonDotInteraction

        # the kernel writes the zero columns itself: no copy of its output
        interaction = TritonDotInteractionArch(interaction, TritonDotInteraction(), pad)
    elif pad:
        interaction = PaddedInteraction(interaction, pad)
    over_arch = OverArch(interaction.output_dim, cfg.top_mlp, cfg.activation, linear_cls=linear_cls, dropout=cfg.dropout,
                         mlp_cls=mlp_cls, init=mlp_init, fan_in=unpadded)
    return DLRM(dense_arch, sparse_arch, interaction, over_arch)


_TABLE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _pooled_sparse_arch(cfg: ModelConfig, cardinalities: list[int], vocabs, kernels: KernelsConfig,
                        hotness: list[int]) -> nn.Module:
    """The multi-hot SparseArch: each feature's values sum-pooled (Triton kernel, or the eager
    EmbeddingBag reference, which stays outside torch.compile with its sparse gradient)."""
    if kernels.embedding == "triton":
        from kernels.embedding import TritonPooledEmbedding

        return TritonPooledEmbedding(cardinalities, hotness, cfg.embedding_dim, vocabs=vocabs,
                                     dtype=_TABLE_DTYPES[cfg.embedding_dtype])
    from dlrm.model.pooled_sparse import PooledSparseArch

    logger.info(f"embedding: torch EmbeddingBag, {sum(hotness)} values a sample sum-pooled into {len(hotness)} "
                "features (sparse gradients: outside torch.compile)")
    return PooledSparseArch(cardinalities, hotness, cfg.embedding_dim, vocabs=vocabs)


def build_loss(kernels: Optional[KernelsConfig] = None):
    """Mean BCE-with-logits: logits [B], labels [B] -> scalar (torch or the fused Triton kernel).

    Args:
        kernels: ``kernels.loss == "triton"`` picks `kernels.loss.bce_with_logits`; None or "torch":
            ``F.binary_cross_entropy_with_logits``.

    Example:
        >>> logits, labels = torch.tensor([-2.0, 0.0, 3.0]), torch.tensor([0.0, 1.0, 1.0])
        >>> round(float(build_loss()(logits, labels)), 4)   # mean of log(1 + e^-2), log 2, log(1 + e^-3)
        0.2896
        >>> triton_loss = build_loss(KernelsConfig(loss="triton"))(logits, labels)
        >>> torch.allclose(triton_loss, build_loss()(logits, labels))
        True

    Shapes: logits [B], labels [B] -> 0-dim loss.
    """
    if kernels is not None and kernels.loss == "triton":
        from kernels.loss import bce_with_logits

        return lambda logits, labels: bce_with_logits(logits, labels, "mean")
    return nn.functional.binary_cross_entropy_with_logits


class PaddedInteraction(nn.Module):
    """An interaction arch whose output gets `pad` zero columns (``model.top_mlp_input_multiple``).

    Args:
        inner: the interaction arch (an `InteractionArch`; its ``output_dim`` is read).
        pad: zero columns appended to its output.

    Example:
        >>> arch = PaddedInteraction(InteractionArch(2, 4), pad=3)   # dot: 4 + 3 pairs = 7 columns, then 3 zeros
        >>> out = arch(torch.randn(5, 4), torch.randn(5, 2, 4))
        >>> arch.output_dim, out.shape, bool((out[:, 7:] == 0).all())
        (10, torch.Size([5, 10]), True)

    Shapes: as the wrapped arch, with ``output_dim`` larger by `pad`. No state of its own.
    """

    def __init__(self, inner: nn.Module, pad: int) -> None:
        super().__init__()
        self.inner = inner
        self.pad = pad
        self.output_dim = inner.output_dim + pad

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(self.inner(dense, sparse), (0, self.pad))


class TritonDotInteractionArch(nn.Module):
    """InteractionArch whose dot product runs in the fused Triton kernel; same (empty) state.

    Args:
        eager: the ``"dot"`` `InteractionArch` it stands in for (its ``output_dim`` is read).
        op: the kernel's module, `kernels.interaction.TritonDotInteraction`.
        pad: zero columns after the pairs, written by the kernel (as `PaddedInteraction` adds them to
            the eager arch's output); ``output_dim`` counts them.

    Example:
        >>> from kernels.interaction import TritonDotInteraction
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> eager = InteractionArch(2, 4).to(device)
        >>> arch = TritonDotInteractionArch(eager, TritonDotInteraction(), pad=1)
        >>> dense = torch.arange(20.0, device=device).reshape(5, 4) % 3   # small integers: exact in any precision
        >>> sparse = torch.arange(40.0, device=device).reshape(5, 2, 4) % 5 - 2
        >>> out = arch(dense, sparse)
        >>> out.shape, torch.equal(out[:, :7], eager(dense, sparse)), bool((out[:, 7] == 0).all())
        (torch.Size([5, 8]), True, True)

    Shapes: [B, D], [B, F, D] -> [B, D + (F+1)F/2 + pad].
    """

    def __init__(self, eager: InteractionArch, op: nn.Module, pad: int = 0) -> None:
        super().__init__()
        self.output_dim = eager.output_dim + pad
        self.op = op
        self.pad = pad

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        # The two parts go to the kernel as they are: no [B, F + 1, D] concatenation (a pass over the
        # embeddings each way), and the embeddings' gradient comes back contiguous.
        return self.op(dense, sparse.to(dense.dtype), self.pad)
