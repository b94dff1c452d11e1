"""Dense Adagrad in one pass over each parameter: the update `dlrm.train.adagrad.CapturableAdagrad` runs on CUDA.

torch's foreach Adagrad makes six passes over every parameter-sized tensor (``sum += g * g``; ``std = sqrt(sum)``;
``std += eps``; ``num = g * lr``; ``num = -num``; ``p += num / std``): about 15 reads and writes of each element,
0.36 ms a step for MLPerf DLRM-DCNv2's 16M dense fp32 parameters on an H100 (results/step_profile_mlperf_*.md,
"dense optimizer"). This kernel reads ``p``, ``g`` and ``sum`` once and writes ``p`` and ``sum`` once, with the
same operations in the same order (IEEE square root and division), so its results match the foreach update to the
last bit where both round alike (checked on the GPU in tests/test_capturable_adagrad.py):

    g <- g + weight_decay * p;  sum <- sum + g * g;  p <- p + (-(g * lr)) / (sqrt(sum) + eps)

``lr`` is read from a 0-dim fp32 device tensor, so a captured CUDA graph follows the learning-rate schedule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["adagrad_step_"]

BLOCK = 1024  # elements a program: fp32, 4 warps, 8 elements a thread


@triton.jit
def _adagrad_kernel(p_ptr, g_ptr, s_ptr, lr_ptr, n, eps, weight_decay, DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    p = tl.load(p_ptr + offs, mask=m, other=0.0)
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    s = tl.load(s_ptr + offs, mask=m, other=0.0)
    if DECAY:
        g = g + weight_decay * p
    s = s + g * g
    lr = tl.load(lr_ptr)
    num = -(g * lr)
    p = p + tl.div_rn(num, tl.sqrt_rn(s) + eps)
    tl.store(s_ptr + offs, s, mask=m)
    tl.store(p_ptr + offs, p, mask=m)


def adagrad_step_(params: list[Tensor], grads: list[Tensor], sums: list[Tensor], lr: Tensor, eps: float,
                  weight_decay: float = 0.0) -> None:
    """One Adagrad step in place on each ``(param, grad, sum)``: fp32, contiguous, same shape; ``lr`` a 0-dim
    fp32 tensor on their device (CUDA, or the CPU under ``TRITON_INTERPRET=1``). One kernel launch a parameter.

    >>> p, g, s = torch.tensor([1.0, -2.0]), torch.tensor([2.0, -2.0]), torch.zeros(2)
    >>> adagrad_step_([p], [g], [s], torch.tensor(0.5), eps=0.0)
    >>> p, s
    (tensor([ 0.5000, -1.5000]), tensor([4., 4.]))
    """
    for p, g, s in zip(params, grads, sums):
        if not (p.dtype == g.dtype == s.dtype == torch.float32 and p.is_contiguous() and g.is_contiguous()
                and s.is_contiguous() and p.shape == g.shape == s.shape):
            raise ValueError(f"adagrad_step_: fp32 contiguous tensors of one shape expected, got {p.dtype} "
                             f"{tuple(p.shape)}, {g.dtype} {tuple(g.shape)}, {s.dtype} {tuple(s.shape)}")
        n = p.numel()
        if n == 0:
            continue
        _adagrad_kernel[(triton.cdiv(n, BLOCK),)](p, g, s, lr, n, eps, weight_decay, DECAY=weight_decay != 0.0,
                                                  BLOCK=BLOCK, num_warps=4)
