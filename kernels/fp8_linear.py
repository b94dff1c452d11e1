"""FP8 linear layers (Hopper tensor cores): issue #20's "one measured try" of FP8 MLP GEMMs.

torchao's float8 training is not on the GPU image, so this is the same recipe written against
``torch._scaled_mm`` (cuBLASLt FP8 GEMMs on sm89+; a reference implementation on the CPU):

* forward ``y = x W^T + b``: ``x`` and ``W`` cast to ``float8_e4m3fn`` with one dynamic scale per
  tensor (``amax -> 448``, "tensorwise" in torchao's terms), the GEMM accumulates in fp32 and writes
  bf16; the bias is added after (Inductor fuses it);
* backward: the output gradient cast to ``float8_e5m2`` (wider range, as gradients need), then
  ``dx = g W`` and ``dW = g^T x`` as FP8 GEMMs against the saved FP8 ``x`` and ``W`` (e5m2 x e4m3, the
  combination the hardware takes); ``db = sum(g)`` in fp32.

FP8 GEMMs need every dimension a multiple of 16: `fp8_mlp` swaps only those layers (DLRM's first
bottom layer, 13 wide, its top MLP's input, 367 or 479, and the 1-wide logit stay ``nn.Linear``).

Not wired into the model: `benchmarks/mlp.py` (impl ``fp8``) measures it against the bf16 MLPs first,
and the issue keeps FP8 only where it is faster and the planted-data AUC stays within 0.002 of bf16.

`fp8_rowwise_linear` / `Fp8RowwiseLinear` scale by row instead (one scale per row of x, per output row of W for
the forward and per input column for the input gradient; the weight gradient in bf16), so that Inductor can fuse
each quantization into the kernel that produces the operand. On MLPerf DLRM-DCNv2's dense part (the cross network
and the top MLP, `benchmarks/fp8_dense_probe.py`, H100, 2026-11-25) it saved 0.43 ms of 15.26 (2.8%) while the
input gradient's error against float64 grew from 9% (bf16) to 37%: not wired in either.

Notation (as `kernels.linear`'s): M rows (the batch B), K input features, N output features.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

__all__ = ["Fp8Linear", "Fp8RowwiseLinear", "fp8_mlp", "fp8_rowwise_linear", "quantize", "quantize_rows"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def quantize(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(q, inv_scale)``: ``t`` scaled so its largest magnitude maps to ``dtype``'s largest finite
    value, cast to ``dtype`` (round to nearest, saturated; row-major), and the fp32 scalar that undoes
    the scaling (``q.float() * inv_scale ~= t``). An all-zero tensor gets scale 1."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float()
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    # row-major whatever t's strides: cuBLASLt's FP8 GEMMs take only row-major x column-major operands
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, scale.reciprocal()


def quantize_rows(t: Tensor, dtype: torch.dtype = E4M3) -> tuple[Tensor, Tensor]:
    """``(q, inv_scale)`` with one scale per row of the 2-D ``t`` ("rowwise"): each row's largest magnitude maps
    to ``dtype``'s largest finite value; ``inv_scale`` [t.shape[0], 1] fp32 undoes it (``q.float() * inv_scale ~= t``).
    No amax over the whole tensor, so under torch.compile the amax, scale and cast fuse into the kernel that
    produces ``t`` when that kernel holds whole rows. All-zero rows get scale 1."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    # row-major whatever t's strides (elementwise results keep them): cuBLASLt's FP8 GEMMs take only
    # row-major x column-major operands
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, scale.reciprocal()


_cpu_rowwise: bool | None = None  # whether this torch's CPU _scaled_mm takes rowwise scales (probed once)


def _cpu_takes_rowwise_scales() -> bool:
    """torch 2.11's CPU ``_scaled_mm`` takes one scale a tensor only (an internal assert, "Now _scaled_mm only supports
    per-tensor scaling for CPU backend", for [M, 1] x [1, N] scales); torch 2.13's takes rowwise ones. Probed on a
    16 x 16 product rather than read from the version: the CUDA builds of 2.11 take rowwise scales."""
    global _cpu_rowwise
    if _cpu_rowwise is None:
        one = torch.ones(16, 16).to(E4M3)
        try:
            torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                             out_dtype=torch.bfloat16)
            _cpu_rowwise = True
        except RuntimeError:
            _cpu_rowwise = False
    return _cpu_rowwise


def _scaled_mm_rowwise(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """``torch._scaled_mm(a, b, scale_a=[M, 1], scale_b=[1, N], out_dtype=bf16)``; on a CPU whose ``_scaled_mm`` takes
    no rowwise scales (torch 2.11), the same product: the FP8 operands' fp32 GEMM (exact products, fp32 sums, as the
    tensor cores accumulate), scaled after the accumulation, rounded to bf16 once."""
    if a.device.type == "cpu" and not _cpu_takes_rowwise_scales():
        return (torch.mm(a.float(), b.float()) * scale_a * scale_b).to(torch.bfloat16)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def _col_major(t: Tensor) -> Tensor:
    """The same matrix with column-major strides (what ``torch._scaled_mm`` wants as its second operand)."""
    return t.t().contiguous().t()


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        xq, sx = quantize(x, E4M3)  # [M, K]
        wq, sw = quantize(weight, E4M3)  # [N, K]
        y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)  # [M, N]
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.has_bias, ctx.x_dtype, ctx.w_dtype = bias is not None, x.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = quantize(grad, E5M2)  # [M, N]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = g W: [M, N] @ [N, K]
            dx = torch._scaled_mm(gq, _col_major(wq), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # dW = g^T x: [N, M] @ [M, K]
            dw = torch._scaled_mm(gq.t().contiguous(), _col_major(xq), scale_a=sg, scale_b=sx,
                                  out_dtype=torch.float32).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.float().sum(0)
        return dx, dw, db


class _Fp8RowwiseLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` and ``dx = g W`` as rowwise-scaled e4m3 GEMMs (bf16 out); ``dW = g^T x`` in bf16 (its
    contraction runs over the batch, which rowwise scales do not cover: torchao's "rowwise_with_gw_hp")."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        xq, sx = quantize_rows(x)  # [M, K], [M, 1]
        wq, sw = quantize_rows(weight)  # [N, K], [N, 1]: one scale per output feature
        y = _scaled_mm_rowwise(xq, wq.t(), sx, sw.t())  # [M, N]
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = g W: [M, N] @ [N, K], W scaled per column (per input feature)
            gq, sg = quantize_rows(grad)
            wtq, swt = quantize_rows(weight.t())  # [K, N]: rows are W's columns
            dx = _scaled_mm_rowwise(gq, wtq.t(), sg, swt.t()).to(x.dtype)
        if ctx.needs_input_grad[1]:  # dW = g^T x in 16 bits, accumulated in fp32 by the GEMM
            dw = torch.mm(grad.t().to(torch.bfloat16), x.to(torch.bfloat16)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.float().sum(0).to(weight.dtype)
        return dx, dw, db


def fp8_rowwise_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with its forward and input-gradient GEMMs in FP8 (rowwise scales); ``x`` [M, K] with M, K
    and the output width multiples of 16; returns bf16 [M, N].

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> fp8_rowwise_linear(torch.randn(16, 32, device=device), torch.randn(16, 32, device=device)).shape
    torch.Size([16, 16])
    """
    return _Fp8RowwiseLinearFunction.apply(x, weight, bias)


class Fp8RowwiseLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state_dict keys) computed by `fp8_rowwise_linear`.

    Args:
        in_features: K, a multiple of 16.
        out_features: N, a multiple of 16.
        bias, device, dtype: as ``nn.Linear``.

    Shapes: ``[M, K]``, M a multiple of 16 -> ``[M, N]`` in bf16.

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> Fp8RowwiseLinear(32, 16, device=device)(torch.randn(16, 32, device=device)).shape
        torch.Size([16, 16])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        if in_features % 16 or out_features % 16:
            raise ValueError(f"Fp8RowwiseLinear: in_features ({in_features}) and out_features ({out_features}) "
                             "must be multiples of 16 (FP8 GEMMs)")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] % 16:  # as Fp8Linear: a one-line error here, not cuBLASLt's inside _scaled_mm on a GPU
            raise ValueError(f"Fp8RowwiseLinear: the batch ({x.shape[0]}) must be a multiple of 16 (FP8 GEMMs)")
        return fp8_rowwise_linear(x, self.weight, self.bias)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state_dict keys) whose GEMMs run in FP8 (module docstring).

    Args:
        in_features: K, a multiple of 16.
        out_features: N, a multiple of 16.
        bias, device, dtype: as ``nn.Linear``.

    Shapes: ``[M, K]`` with M a multiple of 16 (fp32 or bf16) -> ``[M, N]`` in bf16.

    Example:
        >>> layer = Fp8Linear(32, 16)
        >>> layer(torch.randn(16, 32)).shape, layer(torch.randn(16, 32)).dtype
        (torch.Size([16, 16]), torch.bfloat16)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        if in_features % 16 or out_features % 16:
            raise ValueError(f"Fp8Linear: in_features ({in_features}) and out_features ({out_features}) must be "
                             "multiples of 16 (FP8 GEMMs)")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] % 16:
            raise ValueError(f"Fp8Linear: the batch ({x.shape[0]}) must be a multiple of 16 (FP8 GEMMs)")
        return _Fp8LinearFunction.apply(x, self.weight, self.bias)


def fp8_mlp(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every ``nn.Linear`` whose both widths are multiples of 16
    replaced by an `Fp8Linear` holding the same parameters, frozen ones frozen (the others stay as they are).

    Args:
        module: any module (not modified).

    Example:
        >>> mlp = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 1))
        >>> fp8 = fp8_mlp(mlp)
        >>> [type(m).__name__ for m in fp8], torch.equal(fp8[2].weight, mlp[2].weight), fp8[2].weight is mlp[2].weight
        (['Linear', 'ReLU', 'Fp8Linear', 'Linear'], True, False)
    """
    out = copy.deepcopy(module)
    for name, child in list(out.named_modules()):
        for attr, layer in list(child.named_children()):
            if type(layer) is nn.Linear and layer.in_features % 16 == 0 and layer.out_features % 16 == 0:
                new = Fp8Linear(layer.in_features, layer.out_features, layer.bias is not None,
                                device=layer.weight.device, dtype=layer.weight.dtype)
                new.load_state_dict(layer.state_dict())
                for p_new, p_old in zip(new.parameters(), layer.parameters()):
                    p_new.requires_grad_(p_old.requires_grad)  # a frozen layer stays frozen
                setattr(child, attr, new)
    return out
