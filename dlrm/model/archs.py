"""The four arches of DLRM, in eager PyTorch (names and notation as in TorchRec's dlrm.py).

Notation used throughout:
    B: batch size
    F: number of sparse features (26 for Criteo)
    D: embedding dimension (also the DenseArch's output width)
    R: total embedding rows, sum of the per-feature table sizes

Triton replacements in `kernels/` keep the same parameter names and state_dict keys, so a
checkpoint loads into either.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F_
from torch import nn

from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows
from kernels import cross_ws_net
from kernels.cross_ws_op import cross_layer_ws, gluon_hopper_available
from kernels.table_layout import init_tables_, layout_tensors, total_rows

ACTIVATIONS = {
    "relu": F_.relu,
    "sigmoid": torch.sigmoid,
    "gelu": F_.gelu,
    "squared_relu": lambda x: torch.square(F_.relu(x)),
    "none": lambda x: x,
}


def init_linear_(layer: nn.Linear) -> None:
    """The reference DLRM's initialisation: N(0, sqrt(2/(fan_in+fan_out))) weights, N(0, sqrt(1/fan_out)) bias."""
    fan_out, fan_in = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        if layer.bias is not None:
            layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))


def init_linear_torchrec_(layer: nn.Module, fan_in: Optional[int] = None) -> None:
    """TorchRec's initialisation (its MLP layers are plain nn.Linear; MLPerf DLRM-DCNv2's reference, whose closed
    division requires the same distributions): weight kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)). Any layer with nn.Linear's ``weight`` [out, in] and ``bias``.
    `fan_in`: the inputs that are not zero padding (default: the weight's width)."""
    if fan_in is None or fan_in == layer.weight.shape[1]:
        nn.Linear.reset_parameters(layer)  # type: ignore[arg-type]
        return
    # the same draws as reset_parameters (the stream after it unchanged), with the unpadded layer's bound
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        layer.weight.uniform_(-bound, bound)
        if layer.bias is not None:
            layer.bias.uniform_(-bound, bound)


# `DenseArch` / `OverArch` ``init``: the 2019 DLRM's (the dot model) or TorchRec's DLRM_DCN's (the DCN model)
MLP_INITS = {"dlrm": init_linear_, "torchrec": init_linear_torchrec_}


def reinit_mlp_(mlp: nn.Module, init: str, fan_in: Optional[int] = None) -> None:
    """Draw every layer of `mlp` (``layers``: an `MLP`, or a kernel MLP with the same layers) again with `init`.

    After the construction, which every MLP class does with `init_linear_` in the same order: the same seed then
    gives the same weights whichever class runs the layers (a checkpoint moves between them). `fan_in`: the first
    layer's inputs without the zero columns appended to its input (``model.bottom_mlp_input_multiple``,
    ``model.top_mlp_input_multiple``): its law is the unpadded layer's, as the references' (13 dense inputs, 367
    interaction features), the pad columns drawn with it (they multiply zeros)."""
    first = mlp.layers[0]
    fan_out, width = first.weight.shape
    padded = fan_in is not None and fan_in != width
    if init == "dlrm":
        if padded:  # N(0, sqrt(2/(fan_in+fan_out))) from the construction's draw: no new draw, the stream unchanged
            with torch.no_grad():
                first.weight.mul_(math.sqrt((width + fan_out) / (fan_in + fan_out)))
        return
    for i, layer in enumerate(mlp.layers):
        if i == 0 and padded:
            MLP_INITS[init](layer, fan_in)
        else:
            MLP_INITS[init](layer)


class MLP(nn.Module):
    """Stack of linear layers with an activation between them.

    Args:
        in_features: input width.
        widths: output width of each layer.
        activation: name from `ACTIVATIONS`, applied after every layer except (if
            `activate_last` is False) the last.
        activate_last: apply the activation after the last layer too.
        linear_cls: the layer class (`nn.Linear`, or a fused Triton layer with the same
            parameters and an ``activation`` attribute that applies the activation itself).
        dropout: probability of `nn.Dropout` between layers (after each layer's activation but the
            last's); 0: none (no module, the same state_dict either way).

    Example:
        >>> mlp = MLP(13, [64, 16], "relu")
        >>> mlp(torch.randn(3, 13)).shape
        torch.Size([3, 16])

    Shapes: [B, in_features] -> [B, widths[-1]]. state_dict keys: ``layers.<i>.weight/bias``.
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
        if linear_cls is None and activation not in ACTIVATIONS:  # else a KeyError at the first forward
            raise ValueError(f"MLP activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        dims = [in_features, *widths]
        acts = [activation] * len(widths)
        if not activate_last:
            acts[-1] = "none"
        self.activations = acts
        if linear_cls is None:
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
            self._fused = False
        else:
            self.layers = nn.ModuleList(linear_cls(a, b, activation=act) for a, b, act in zip(dims[:-1], dims[1:], acts))
            self._fused = True
        for layer in self.layers:
            init_linear_(layer)
        # eager nn.Dropout also after a fused Triton layer (kernels/ has no dropout epilogue)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, (layer, act) in enumerate(zip(self.layers, self.activations)):
            x = layer(x) if self._fused else ACTIVATIONS[act](layer(x))
            if self.dropout is not None and i < last:
                x = self.dropout(x)
        return x


class DenseArch(nn.Module):
    """Bottom MLP: the 13 transformed dense features to a D-wide vector.

    Args:
        in_features: number of dense features (13).
        widths: layer widths, the last equal to D for the dot interaction.
        activation: activation name (applied after every layer, as in the reference DLRM).
        linear_cls, dropout: passed to the layer chain (as `MLP`'s: a Triton layer class, dropout
            between layers).
        mlp_cls: the layer chain's class (`MLP`, or `kernels.mlp.FusedMLP`: same parameters).
        input_multiple: zero columns are appended to the input up to a multiple of this
            (``model.bottom_mlp_input_multiple``; the first layer's weight is that wide).
        init: the layers' initialisation, a key of `MLP_INITS` ("dlrm": `init_linear_`; "torchrec":
            `init_linear_torchrec_`, the DCN model's, as MLPerf DLRM-DCNv2's reference).

    Example:
        >>> DenseArch(13, [64, 16])(torch.randn(4, 13)).shape
        torch.Size([4, 16])
        >>> DenseArch(13, [64, 16], input_multiple=8).model.layers[0].weight.shape
        torch.Size([64, 16])

    Shapes: [B, 13] -> [B, D].
    """

    def __init__(self, in_features: int, widths: list[int], activation: str = "relu", linear_cls=None,
                 dropout: float = 0.0, mlp_cls=None, input_multiple: int = 1, init: str = "dlrm") -> None:
        super().__init__()
        self.pad = -in_features % input_multiple
        self.model = (mlp_cls or MLP)(in_features + self.pad, widths, activation, activate_last=True,
                                      linear_cls=linear_cls, dropout=dropout)
        reinit_mlp_(self.model, init, fan_in=in_features)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        if self.pad:  # under torch.compile the zeros are written by the kernel that casts the input
            dense = F_.pad(dense, (0, self.pad))
        return self.model(dense)


class SparseArch(nn.Module):
    """All F embedding tables as ONE weight of R rows, with the hashing done on the device.

    Table f occupies rows ``offsets[f] .. offsets[f] + cardinalities[f] - 1``. Raw 32-bit hash
    values go in; rows come from `dlrm.model.hashing` (modulus, or vocabulary when `vocabs`
    is given). The lookup emits a sparse gradient, so the optimizer touches only used rows
    and no dense [R, D] gradient exists.

    Args:
        cardinalities: table size per feature (F ints).
        dim: D.
        vocabs: for vocabulary hashing, the sorted int64 vocabulary of each feature
            (then ``cardinalities[f] == len(vocabs[f]) + 1``).

    Example:
        >>> arch = SparseArch([10, 20, 5], 8)
        >>> arch(torch.tensor([[3, -1, 2**32 - 1]])).shape
        torch.Size([1, 3, 8])

    Shapes: int64 [B, F] -> [B, F, D]. state_dict keys: ``weight`` only (the hashing buffers
    are derived from the dataset and rebuilt at construction).
    """

    # dlrm.model.interfaces.SparseArchInterface: the sparse COO gradient has data-dependent shapes,
    # so the lookup stays outside torch.compile and CUDA graphs; an eager optimizer steps it (its
    # twin dlrm.model.fused_sparse.FusedUpdateSparseArch updates in its backward and compiles)
    compilable = False
    collective = False
    fused_optimizer = False

    def __init__(self, cardinalities: list[int], dim: int, vocabs: Optional[list[torch.Tensor]] = None) -> None:
        super().__init__()
        if vocabs is not None and [len(v) + 1 for v in vocabs] != list(cardinalities):
            raise ValueError("vocabulary hashing needs cardinalities[f] == len(vocabs[f]) + 1")
        cards, offsets = layout_tensors(cardinalities)
        self.num_features = len(cardinalities)
        self.dim = dim
        self.register_buffer("cardinalities", cards, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.hashing = "modulus" if vocabs is None else "vocabulary"
        if vocabs is not None:
            keys, vocab_offsets = keyed_vocabulary(vocabs)
            self.register_buffer("vocab_keys", keys, persistent=False)
            self.register_buffer("vocab_offsets", vocab_offsets, persistent=False)
        self.weight = nn.Parameter(torch.empty(total_rows(cardinalities), dim))
        self.reset_parameters(cardinalities)

    def reset_parameters(self, cardinalities: list[int]) -> None:
        # Reference DLRM: U(-1/sqrt(n), 1/sqrt(n)) per table of n rows (shared with the Triton and
        # sharded arches, so the same seed gives the same tables in all of them).
        init_tables_(self.weight, cardinalities)

    def rows(self, raw: torch.Tensor) -> torch.Tensor:
        """int64 [B, F] raw values -> int64 [B, F] rows of `weight`."""
        if self.hashing == "modulus":
            return modulus_rows(raw, self.cardinalities, self.offsets)
        return vocabulary_rows(raw, self.vocab_keys, self.vocab_offsets, self.offsets)

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        return F_.embedding(self.rows(raw), self.weight, sparse=True)


class LowRankCrossNet(nn.Module):
    """Low-rank cross network of DCNv2 (Wang et al., 2021), as TorchRec's ``LowRankCrossNet``.

    Layer l maps ``x_l`` [B, N] to ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``: ``V_l`` [r, N]
    projects to the rank, ``W_l`` [N, r] back, ``*`` is elementwise; ``x_0`` is the input.

    Args:
        in_features: N.
        num_layers: cross layers (>= 1).
        low_rank: r (>= 1).

    Parameters (TorchRec's names, shapes and init; ParameterLists, so the state_dict keys are
    ``W_kernels.<l>``, ``V_kernels.<l>``, ``bias.<l>``): ``W_kernels[l]`` [N, r] and
    ``V_kernels[l]`` [r, N] xavier-normal (all W first, then all V: TorchRec's RNG order),
    ``bias[l]`` [N] zeros.

    Under autocast the layers keep the GEMMs' dtype (bf16) end to end: the bias is cast to it before
    the add, where TorchRec's module lets the fp32 bias promote the residual stream to fp32.

    Example:
        >>> net = LowRankCrossNet(in_features=12, num_layers=2, low_rank=3)
        >>> net(torch.randn(5, 12)).shape
        torch.Size([5, 12])
        >>> [tuple(p.shape) for p in net.parameters()]
        [(12, 3), (12, 3), (3, 12), (3, 12), (12,), (12,)]

    Shapes: [B, N] -> [B, N].
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        if num_layers < 1 or low_rank < 1:
            raise ValueError(f"num_layers ({num_layers}) and low_rank ({low_rank}) must be >= 1")
        self.in_features = in_features
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.W_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)
        )
        self.V_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input
        x_l = x_0
        for layer in range(self._num_layers):
            x_l_v = F_.linear(x_l, self.V_kernels[layer])  # [B, r]
            x_l_w = F_.linear(x_l_v, self.W_kernels[layer])  # [B, N]
            # The bias in the GEMM's dtype: under bf16 autocast the GEMMs give bf16 while the bias is an
            # fp32 parameter, and adding them as they are (as TorchRec does) promotes x_l, and every [B, N]
            # tensor after it, forward and backward, to fp32: twice the bytes in the passes that made a
            # quarter of the MLPerf step (PERF.md). Without autocast nothing changes.
            x_l = x_0 * (x_l_w + self.bias[layer].to(x_l_w.dtype)) + x_l
        return x_l

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_layers={self._num_layers}, low_rank={self._low_rank}"


class GluonLowRankCrossNet(LowRankCrossNet):
    """`LowRankCrossNet` (same arguments, parameters, init and state_dict keys) whose layers run
    ``x0 * (W_l u + b_l) + x_l`` as `kernels.cross_ws_op.cross_layer_ws` (on a Hopper GPU one warp-specialized
    Gluon kernel, elsewhere the same PyTorch arithmetic); ``u = V_l x_l`` stays ``F.linear``. On a Hopper GPU with a
    16-bit input the layers run as one autograd function (`kernels.cross_ws_net`) unless
    `kernels.cross_ws_net.BACKWARD` is "layers": its backward is one op of cuBLAS GEMMs and Triton passes that sum
    the bias gradients while they write ``g_pre`` ("passes"), or Gluon GEMMs with the next layer's elementwise work
    in their epilogues ("fused_gemm", slower in the MLPerf step: PERF.md sixteenth run).

    Args:
        in_features, num_layers, low_rank: as `LowRankCrossNet`.

    Example:
        >>> net = GluonLowRankCrossNet(in_features=12, num_layers=2, low_rank=3)
        >>> net(torch.randn(5, 12)).shape
        torch.Size([5, 12])

    Shapes: [B, N] -> [B, N].
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if cross_ws_net.BACKWARD != "layers" and input.is_cuda and gluon_hopper_available(input.device) and \
                input.dtype in (torch.bfloat16, torch.float16):
            # the whole network as one autograd function with its own backward (kernels.cross_ws_net.BACKWARD); the
            # weights in the input's dtype, as autocast casts them for F.linear
            dt = input.dtype
            return cross_ws_net.cross_net_ws(input, [v.to(dt) for v in self.V_kernels],
                                             [w.to(dt) for w in self.W_kernels], list(self.bias),
                                             backward=cross_ws_net.BACKWARD)
        x_0 = input
        x_l = x_0
        for layer in range(self._num_layers):
            u = F_.linear(x_l, self.V_kernels[layer])  # [B, r]; bf16 under autocast
            w = self.W_kernels[layer].to(u.dtype)  # autocast casts F.linear's weight the same way
            # an fp32 input under bf16 autocast keeps the residual stream in fp32, as in the eager module (the
            # op's PyTorch path); the Gluon kernel runs when it is in the GEMMs' 16-bit dtype
            x_l = cross_layer_ws(x_0, x_l, u, w, self.bias[layer])
        return x_l


class InteractionArch(nn.Module):
    """Feature interaction of the dense vector with the F embeddings.

    ``dot``: concatenates the dense vector with the strictly lower triangle of the pairwise
    dot products of the F + 1 vectors, in ``torch.tril_indices(F+1, F+1, -1)`` order
    ((1,0), (2,0), (2,1), (3,0), ...). ``cat``: concatenates everything. ``dcn``: concatenates
    everything into [B, (F+1) D] (dense vector first, as TorchRec's ``InteractionDCNArch``) and
    applies a `LowRankCrossNet` of `cross_layers` layers and rank `cross_rank` (submodule
    ``crossnet``: state_dict keys ``crossnet.W_kernels.<l>``, ``crossnet.V_kernels.<l>``,
    ``crossnet.bias.<l>``).

    Args:
        num_features: F.
        dim: D.
        kind: "dot", "cat" or "dcn".
        cross_layers, cross_rank: the cross network's layers and rank (dcn only).
        crossnet_cls: the cross network's class (`LowRankCrossNet`, or the Triton one with the
            same constructor and parameters, `kernels.cross.TritonLowRankCrossNet`).

    Example:
        >>> InteractionArch(26, 16)(torch.randn(2, 16), torch.randn(2, 26, 16)).shape
        torch.Size([2, 367])
        >>> InteractionArch(26, 16, "dcn", cross_layers=3, cross_rank=64)(torch.randn(2, 16), torch.randn(2, 26, 16)).shape
        torch.Size([2, 432])

    Shapes: [B, D], [B, F, D] -> [B, D + (F+1)F/2] (dot) or [B, (F+1)D] (cat, dcn).
    """

    def __init__(self, num_features: int, dim: int, kind: str = "dot", cross_layers: int = 3, cross_rank: int = 512,
                 crossnet_cls: Optional[type] = None) -> None:
        super().__init__()
        if kind not in ("dot", "cat", "dcn"):  # else an unknown kind ran the dot while output_dim gave cat's width
            raise ValueError(f"InteractionArch kind must be 'dot', 'cat' or 'dcn', got {kind!r}")
        self.kind = kind
        self.num_features = num_features
        self.dim = dim
        # two tensors of their own, not views of one [2, N] storage: torch.export.save warned "No complete tensor found
        # in the group! ... may cause issues when your weights are not on CPU" at every --export
        rows, cols = (t.clone() for t in torch.tril_indices(num_features + 1, num_features + 1, offset=-1))
        # constants every rank builds alike: DDP need not broadcast them (`dlrm.distributed.data_parallel`)
        self.constant_buffers = ("tril_rows", "tril_cols")
        self.register_buffer("tril_rows", rows, persistent=False)
        self.register_buffer("tril_cols", cols, persistent=False)
        if kind == "dcn":
            self.crossnet = (crossnet_cls or LowRankCrossNet)((num_features + 1) * dim, cross_layers, cross_rank)

    @property
    def output_dim(self) -> int:
        f = self.num_features
        return self.dim + (f + 1) * f // 2 if self.kind == "dot" else (f + 1) * self.dim

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.from_combined(torch.cat([dense.unsqueeze(1), sparse.to(dense.dtype)], dim=1))

    def from_combined(self, combined: torch.Tensor) -> torch.Tensor:
        """The same from ``cat([dense.unsqueeze(1), sparse], 1)`` [B, F+1, D] (a lookup may build it)."""
        if self.kind == "cat":
            return combined.flatten(1)
        if self.kind == "dcn":
            return self.crossnet(combined.flatten(1))
        return dot_interaction_from_combined(combined, self.tril_rows, self.tril_cols)


def dot_interaction_from_combined(combined: torch.Tensor, tril_rows: torch.Tensor, tril_cols: torch.Tensor) -> torch.Tensor:
    """[B, F+1, D] -> [B, D + (F+1)F/2]: row 0 followed by the lower-triangle dots."""
    dots = torch.bmm(combined, combined.transpose(1, 2))  # [B, F+1, F+1]
    return torch.cat([combined[:, 0], dots[:, tril_rows, tril_cols]], dim=1)


class OverArch(nn.Module):
    """Top MLP: interaction features to one logit per sample (no activation on the last layer).

    Args:
        in_features: the interaction's output width.
        widths: layer widths, the last equal to 1.
        activation: activation between layers.
        linear_cls, dropout: passed to the layer chain (as `MLP`'s: a Triton layer class, dropout
            between layers).
        mlp_cls: the layer chain's class (`MLP`, or `kernels.mlp.FusedMLP`: same parameters).
        init: the layers' initialisation, as `DenseArch`'s.
        fan_in: the inputs that are not zero padding (``model.top_mlp_input_multiple`` pads the
            interaction's output): the first layer is initialised as that many inputs' layer (default:
            all of ``in_features``).

    Example:
        >>> OverArch(367, [64, 1])(torch.randn(5, 367)).shape
        torch.Size([5])

    Shapes: [B, in_features] -> [B] (logits).
    """

    def __init__(self, in_features: int, widths: list[int], activation: str = "relu", linear_cls=None,
                 dropout: float = 0.0, mlp_cls=None, init: str = "dlrm", fan_in: Optional[int] = None) -> None:
        super().__init__()
        self.model = (mlp_cls or MLP)(in_features, widths, activation, activate_last=False, linear_cls=linear_cls,
                                      dropout=dropout)
        reinit_mlp_(self.model, init, fan_in=fan_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).squeeze(-1)
