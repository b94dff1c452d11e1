"""`OnChipTailMLP`: the eager ``dlrm.model.archs.MLP`` with its narrow tail (`split_tail`) on the on-chip
kernel of `kernels.mlp_tail` and its wide head through `kernels.mlp.fused_mlp` (issue #20).

An opt-in module: measured on an H100 (benchmarks/results/mlp_tail.md) it is at most 0.01 ms faster than
the fused MLP, so ``kernels.mlp: "auto"`` does not pick it. On CUDA it runs 16-bit inputs (bf16 autocast)
only; see `kernels.mlp_tail`.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from kernels.mlp import build_fused_layers, fused_mlp
from kernels.mlp_tail import MAX_LAYERS, MAX_WIDTH, tail_mlp

__all__ = ["OnChipTailMLP", "split_tail"]


def split_tail(dims: list[int], max_layers: int = MAX_LAYERS) -> int:
    """The first layer of the chain ``dims`` = [in_features, *widths] that the on-chip tail runs:
    the longest suffix (at most `max_layers` layers) whose input and widths are all <= `MAX_WIDTH`;
    ``len(dims) - 1`` when the last layer itself is too wide (no tail).

    >>> split_tail([13, 512, 256, 64, 16]), split_tail([367, 512, 256, 1]), split_tail([13, 16, 16])
    (2, 2, 0)
    """
    n = len(dims) - 1
    start = n
    while start > 0 and n - start < max_layers and dims[start - 1] <= MAX_WIDTH and dims[start] <= MAX_WIDTH:
        start -= 1
    return start


class OnChipTailMLP(nn.Module):
    """Swap-in for ``dlrm.model.archs.MLP`` (ReLU or none): the wide head layers through
    `kernels.mlp.fused_mlp`, the narrow tail (`split_tail`) through the on-chip kernel.

    Args (the eager MLP's):
        in_features: input width.
        widths: output width of each layer.
        activation: "relu" or "none"; any other raises ValueError.
        activate_last: apply the activation after the last layer too (False for the top MLP).
        linear_cls: must be None (accepted so the eager MLP's keyword arguments pass through).
        dropout: must be 0.

    Parameters, init (same RNG draws) and state_dict keys as the eager MLP and
    `kernels.mlp.FusedMLP`: ``layers.<i>.weight`` / ``layers.<i>.bias``; ``activations`` lists each
    layer's activation, ``tail_start`` the first layer of the tail (``len(widths)``: none).

    Example:
        >>> mlp = OnChipTailMLP(13, [512, 256, 64, 16])
        >>> mlp.tail_start, list(mlp.state_dict())[-2:]
        (2, ['layers.3.weight', 'layers.3.bias'])

    Shapes: [B, in_features] -> [B, widths[-1]].
    """

    def __init__(
        self,
        in_features: int,
        widths: list[int],
        activation: str = "relu",
        activate_last: bool = True,
        linear_cls: Optional[type] = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.activations, self.layers = build_fused_layers(type(self).__name__, in_features, widths, activation,
                                                           activate_last, linear_cls, dropout)
        self.tail_start = split_tail([in_features, *widths])
        self.dropout = None

    def forward(self, x: Tensor) -> Tensor:
        h = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        ws = [l.weight for l in self.layers]
        bs = [l.bias for l in self.layers]
        relu = [a == "relu" for a in self.activations]
        s = self.tail_start
        if s > 0:
            h = fused_mlp(h, ws[:s], bs[:s], relu[:s])
        if s < len(ws):
            h = tail_mlp(h, ws[s:], bs[s:], relu[s:])
        return h if x.dim() == 2 else h.view(*x.shape[:-1], h.shape[-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, activations={self.activations}, tail_start={self.tail_start}"
