"""Dense Adagrad in one pass over each parameter: the update `dlrm.train.adagrad.CapturableAdagrad` runs on CUDA.

torch's foreach Adagrad makes six passes over every parameter-sized tensor (``sum += g * g``; ``std = sqrt(sum)``;
``std += eps``; ``num = g * lr``; ``num = -num``; ``p += num / std``): about 15 reads and writes of each element,
0.36 ms a step for MLPerf DLRM-DCNv2's 16M dense fp32 parameters on an H100 (results/step_profile_mlperf_*.md,
"dense optimizer"). This kernel reads ``p``, ``g`` and ``sum`` once and writes ``p`` and ``sum`` once, with the
same operations in the same order (IEEE square root and division), so its results match the foreach update to the
last bit where both round alike (checked on the GPU in tests/test_capturable_adagrad.py):

    g <- g + weight_decay * p;  sum <- sum + g * g;  p <- p + (-(g * lr)) / (sqrt(sum) + eps)

``lr`` is read from a 0-dim fp32 device tensor, so a captured CUDA graph follows the learning-rate schedule.

One launch updates up to ``MAX_TENSORS`` parameters: each program finds its parameter among the launch's block
ranges (a static chain of scalar comparisons) and runs the update on one block of it. One launch a parameter cost
MLPerf DLRM-DCNv2's 25 dense parameters (16M values, 321 MB moved, ~0.07 ms at an H200's copy bandwidth) 0.146 ms
on an H200 (results/scaling_mlperf_profile_1gpu_twentyfourth.md): 17 of them are biases or layers under 1M values,
whose launch, ramp-up and tail cost more than their bytes. In one launch: 0.087 ms
(results/adagrad_grouped_h200.md).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["MAX_TENSORS", "adagrad_step_"]

BLOCK = 1024  # elements a program: fp32, 4 warps, 8 elements a thread
# Parameters one launch takes: the kernel inlines the update once per parameter (a compile per group size).
MAX_TENSORS = 32


@triton.jit
def _adagrad_block(p_ptr, g_ptr, s_ptr, offs, n, lr, eps, weight_decay, DECAY: tl.constexpr):
    """The update of elements ``offs`` (< ``n``) of one parameter, its gradient and its sum."""
    m = offs < n
    p = tl.load(p_ptr + offs, mask=m, other=0.0)
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    s = tl.load(s_ptr + offs, mask=m, other=0.0)
    if DECAY:
        g = g + weight_decay * p
    s = s + g * g
    num = -(g * lr)
    p = p + tl.div_rn(num, tl.sqrt_rn(s) + eps)
    tl.store(s_ptr + offs, s, mask=m)
    tl.store(p_ptr + offs, p, mask=m)


@triton.jit
def _adagrad_kernel(ps, gs, ss, ns, starts, lr_ptr, eps, weight_decay, NT: tl.constexpr, DECAY: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Program ``pid`` updates block ``pid - starts[i]`` of parameter ``i`` (``starts[i] <= pid < starts[i + 1]``)
    of the ``NT`` parameters ``ps`` (gradients ``gs``, sums ``ss``, sizes ``ns``)."""
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    for i in tl.static_range(NT):
        if (pid >= starts[i]) & (pid < starts[i + 1]):
            offs = (pid - starts[i]).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            _adagrad_block(ps[i], gs[i], ss[i], offs, ns[i], lr, eps, weight_decay, DECAY)


def adagrad_step_(params: list[Tensor], grads: list[Tensor], sums: list[Tensor], lr: Tensor, eps: float,
                  weight_decay: float = 0.0) -> None:
    """One Adagrad step in place on each ``(param, grad, sum)``: fp32, contiguous, same shape; ``lr`` a 0-dim
    fp32 tensor on their device (CUDA, or the CPU under ``TRITON_INTERPRET=1``). One kernel launch per
    ``MAX_TENSORS`` parameters.

    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> p, g = torch.tensor([1.0, -2.0], device=device), torch.tensor([2.0, -2.0], device=device)
    >>> s = torch.zeros(2, device=device)
    >>> adagrad_step_([p], [g], [s], torch.tensor(0.5, device=device), eps=0.0)
    >>> p.tolist(), s.tolist()
    ([0.5, -1.5], [4.0, 4.0])
    """
    # zip() would stop at the shortest list: the parameters past it were left without their step, silently
    if not len(params) == len(grads) == len(sums):
        raise ValueError(f"adagrad_step_: one gradient and one sum per parameter, got {len(params)} parameters, "
                         f"{len(grads)} gradients and {len(sums)} sums")
    # the kernel loads lr through a pointer: a Python float failed inside Triton with no word of lr, a tensor of
    # several values stepped with its first, another dtype computed the step in it, another device read bad memory
    if not (isinstance(lr, Tensor) and lr.numel() == 1 and lr.dtype == torch.float32):
        raise ValueError(f"adagrad_step_: lr must be a one-element float32 tensor, got "
                         f"{f'{lr.dtype} {tuple(lr.shape)}' if isinstance(lr, Tensor) else type(lr).__name__}")
    work = []
    for p, g, s in zip(params, grads, sums):
        if not (p.device == g.device == s.device == lr.device):
            raise ValueError(f"adagrad_step_: parameter, gradient, sum and lr must share one device, got {p.device}, "
                             f"{g.device}, {s.device} and {lr.device}")
        if not (p.dtype == g.dtype == s.dtype == torch.float32 and p.is_contiguous() and g.is_contiguous()
                and s.is_contiguous() and p.shape == g.shape == s.shape):
            raise ValueError(f"adagrad_step_: fp32 contiguous tensors of one shape expected, got {p.dtype} "
                             f"{tuple(p.shape)}, {g.dtype} {tuple(g.shape)}, {s.dtype} {tuple(s.shape)}")
        if p.numel():
            work.append((p, g, s))
    for i in range(0, len(work), MAX_TENSORS):
        group = work[i : i + MAX_TENSORS]
        ns = tuple(p.numel() for p, _, _ in group)
        starts = tuple(itertools.accumulate((triton.cdiv(n, BLOCK) for n in ns), initial=0))
        ps, gs, ss = (tuple(t[k] for t in group) for k in range(3))
        _adagrad_kernel[(starts[-1],)](ps, gs, ss, ns, starts, lr, eps, weight_decay, NT=len(group),
                                       DECAY=weight_decay != 0.0, BLOCK=BLOCK, num_warps=4)
