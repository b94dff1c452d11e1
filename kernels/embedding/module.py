"""``TritonSparseEmbedding``: the eager ``SparseArch`` (one ``[R, D]`` weight, hashing on the device)
on the Triton lookup, with an optional fused sparse optimizer update in the backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from kernels import table_layout
from kernels.embedding.fused_switch import FusedUpdateSwitch
from kernels.embedding.hashing import hash_rows
from kernels.embedding.lookup import embedding_lookup, fused_embedding
from kernels.embedding.update import OPTIMIZERS, check_hyperparameters, init_sparse_optimizer_state

__all__ = ["SparseOptimizerConfig", "TritonSparseEmbedding"]


@dataclass
class SparseOptimizerConfig:
    """Optimizer of the fused-update path of :class:`TritonSparseEmbedding`.

    Attributes:
        kind: 'sgd' | 'adagrad' | 'rowwise_adagrad'.
        lr: one-element float32 tensor on the embedding's device; change it in place (``lr.fill_(x)``)
            to schedule the learning rate without recompiling.
        eps: Adagrad epsilon (torch.optim.Adagrad's default 1e-10).
        state: optimizer state (see :func:`init_sparse_optimizer_state`); None lets
            ``TritonSparseEmbedding.use_fused_update`` allocate zeros. Not part of the module's state_dict:
            checkpoint it with the optimizer.
        deterministic: bitwise reproducible updates (see :func:`embedding_sparse_update_`).
        weight_decay: lazy L2 on the rows a batch looks up (see :func:`embedding_sparse_update_`).
    """

    kind: str
    lr: Tensor
    eps: float = 1e-10
    state: Optional[Tensor] = None
    deterministic: bool = True
    weight_decay: float = 0.0


def _checked_vocabularies(vocabs: Sequence[Tensor], cards: list[int]) -> list[Tensor]:
    """``vocabs`` as 1-D int64 tensors; raises ValueError unless each is sorted, unique and
    ``len(vocabs[f]) + 1 == cards[f]``."""
    if len(vocabs) != len(cards):
        raise ValueError(f"vocab has {len(vocabs)} features, cardinalities {len(cards)}")
    out = []
    for f, (v, c) in enumerate(zip(vocabs, cards)):
        v = torch.as_tensor(v)
        if v.dim() != 1 or v.numel() + 1 != c:
            raise ValueError(f"feature {f}: cardinality {c} must be len(vocab) + 1 = {v.numel() + 1}")
        if v.numel() > 1 and not bool((v[1:] > v[:-1]).all()):
            raise ValueError(f"feature {f}: vocabulary must be sorted ascending and unique")
        out.append(v.to(torch.int64).reshape(-1))
    return out


class TritonSparseEmbedding(FusedUpdateSwitch, nn.Module):
    """All sparse features' embedding tables as one ``[R, D]`` weight, looked up by a Triton kernel.

    Args:
        cardinalities: rows per feature (``F`` ints). In vocabulary mode each must equal
            ``len(vocab[f]) + 1``.
        dim: embedding dim ``D``.
        vocabs: None (modulus hashing) or ``F`` 1-D int64 tensors of sorted, unique raw values (the
            eager ``SparseArch``'s argument name; ``vocab=`` is accepted as an alias).
        device, dtype: of the weight (fp32 or bf16; initialised in place on ``device``).
        autocast_output: under bf16 autocast (on the weight's device), fp32 tables emit their rows in
            bf16, rounded to nearest even -- exactly what the model's cast to the compute dtype would
            make of the fp32 output, with half the bytes written, read by the next kernel, and read back
            as the gradient (issue #20). Off (the default), the output has the weight's dtype; a caller
            that sums the outputs further (the sharded arch's pooling) keeps it off.
        stochastic_rounding: bf16 tables: the fused update rounds new weights stochastically (default;
            unbiased, so updates smaller than half a bf16 step are not lost) or to nearest (False). The
            seed is the non-persistent buffer ``sr_seed`` [1] int64 (starts at 0, advanced on the device
            by every update), as in ``TritonPooledEmbedding``; the sparse optimizer's state_dict carries it.

    ``forward(raw [B, F] int64) -> [B, F, D]``. By default the ordinary differentiable lookup (dense
    gradient for ``weight``). After ``use_fused_update(config)`` the forward, while training with grad
    enabled, uses :func:`fused_embedding`: the backward applies ``config``'s optimizer to the looked-up
    rows in place and leaves ``weight.grad`` None. In that mode ``weight.requires_grad`` is False (so a
    dense optimizer skips it, and torch.compile accepts the in-place update in the backward, see
    :func:`fused_embedding`) and a private zero-size tensor that requires grad makes autograd run the
    backward. ``use_fused_update(None)`` switches back (and sets ``requires_grad`` again). The
    state_dict holds only ``weight``, initialised as the eager ``SparseArch`` (`kernels.table_layout`).

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> emb = TritonSparseEmbedding([5, 3], dim=4).to(device)
        >>> emb
        TritonSparseEmbedding(features=2, rows=8, dim=4, hashing=modulus)
        >>> raw = torch.tensor([[0, 2], [-1, 7]], device=device)   # -1: missing
        >>> emb.rows(raw).tolist()   # feature f: offset + (raw + 1) mod rows; missing -> the feature's row 0
        [[1, 5], [0, 7]]
        >>> torch.equal(emb(raw)[1, 1], emb.weight[7])
        True

    Shapes: int64 [B, F] raw values -> [B, F, D] (the weight's dtype, or bf16 with `autocast_output`).
    """

    # The plain lookup's backward is an ordinary dense [R, D] gradient from a custom op (no sparse COO
    # gradient), so a training step may compile the lookup together with the rest of the model
    # (dlrm.train.step reads this flag; the eager SparseArch has sparse gradients).
    # the attributes of dlrm.model.interfaces.SparseArchInterface: static shapes and no host syncs,
    # so it compiles and captures; its backward applies the sparse optimizer (after use_fused_update)
    compilable = True
    collective = False
    fused_optimizer = True

    def __init__(
        self,
        cardinalities: Sequence[int],
        dim: int,
        vocabs: Optional[Sequence[Tensor]] = None,
        *,
        vocab: Optional[Sequence[Tensor]] = None,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        autocast_output: bool = False,
        stochastic_rounding: bool = True,
    ) -> None:
        super().__init__()
        if vocab is not None:
            if vocabs is not None:
                raise ValueError("give the vocabularies once: vocabs= (vocab= is an alias)")
            vocabs = vocab
        cards = table_layout.check_cardinalities(cardinalities)
        self.cardinality_list = cards
        self.dim = int(dim)
        card_t, offsets = table_layout.layout_tensors(cards, device)
        self.register_buffer("cardinalities", card_t, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self._register_vocabularies(vocabs, cards, device)
        self.weight = nn.Parameter(torch.empty(table_layout.total_rows(cards), self.dim, device=device, dtype=dtype))
        self.autocast_output = bool(autocast_output)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.register_buffer("sr_seed", torch.zeros(1, dtype=torch.int64, device=device), persistent=False)
        self.fused_update: Optional[SparseOptimizerConfig] = None
        # Plain attribute (not a parameter or buffer: state_dict stays {"weight"}); see use_fused_update.
        self._grad_trigger: Optional[Tensor] = None
        self.reset_parameters()

    def _register_vocabularies(self, vocabs, cards: list[int], device) -> None:
        """Buffers ``vocab`` [sum V_f] and ``vocab_offsets`` [F + 1] (None in modulus mode)."""
        if vocabs is None:
            self.vocab = None
            self.vocab_offsets = None
            return
        vocabs = _checked_vocabularies(vocabs, cards)
        sizes = torch.tensor([0] + [v.numel() for v in vocabs], dtype=torch.int64)
        self.register_buffer("vocab", torch.cat(vocabs).to(device), persistent=False)
        self.register_buffer("vocab_offsets", sizes.cumsum(0).to(device), persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference DLRM's per-table init, as the eager SparseArch (same RNG draws, same values)."""
        table_layout.init_tables_(self.weight, self.cardinality_list)

    @property
    def num_features(self) -> int:
        return len(self.cardinality_list)

    @property
    def hashing(self) -> str:
        """'modulus' or 'vocabulary' (as the eager SparseArch)."""
        return "modulus" if self.vocab is None else "vocabulary"

    def rows(self, raw: Tensor) -> Tensor:
        """int64 [B, F] raw values -> int64 [B, F] rows of `weight` (the Triton hashing kernel)."""
        return hash_rows(raw, self.cardinalities, self.offsets, self.vocab, self.vocab_offsets)

    def use_fused_update(self, config: Optional[SparseOptimizerConfig]) -> Optional[SparseOptimizerConfig]:
        """Switch the training forward to the fused sparse-update path (None switches back).

        Allocates ``config.state`` (zeros) when it is None and the optimizer needs one; returns config.
        """
        if config is not None:
            if config.kind not in OPTIMIZERS:
                raise ValueError(f"kind must be one of {sorted(OPTIMIZERS)}, got {config.kind!r}")
            check_hyperparameters(config.kind, config.eps, config.weight_decay)  # now, not at the first backward
            if config.state is None:
                config.state = init_sparse_optimizer_state(config.kind, self.weight)
        self._switch_fused_update(config)
        return config

    def output_dtype(self) -> Optional[torch.dtype]:
        """bf16 under bf16 autocast with ``autocast_output`` and fp32 tables, else None (weight's dtype).
        torch.compile folds the autocast query into the graph (and guards on the autocast state)."""
        device = self.weight.device.type
        if (self.autocast_output and self.weight.dtype == torch.float32 and torch.is_autocast_enabled(device)
                and torch.get_autocast_dtype(device) == torch.bfloat16):
            return torch.bfloat16
        return None

    def forward(self, raw: Tensor) -> Tensor:
        cfg = self.fused_update
        out_dtype = self.output_dtype()
        if cfg is not None and self.training and torch.is_grad_enabled():
            return fused_embedding(
                raw,
                self.weight,
                self.cardinalities,
                self.offsets,
                self.vocab,
                self.vocab_offsets,
                cfg.state,
                cfg.lr,
                cfg.kind,
                cfg.eps,
                cfg.deterministic,
                self._grad_trigger,
                cfg.weight_decay,
                out_dtype,
                self.sr_seed if self.stochastic_rounding and self.weight.dtype == torch.bfloat16 else None,
            )
        return embedding_lookup(raw, self.weight, self.cardinalities, self.offsets, self.vocab, self.vocab_offsets,
                                out_dtype)

    def extra_repr(self) -> str:
        return f"features={self.num_features}, rows={self.weight.shape[0]}, dim={self.dim}, hashing={self.hashing}"
