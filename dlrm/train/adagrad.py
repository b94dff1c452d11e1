"""Dense Adagrad that a CUDA graph can capture: `torch.optim.Adagrad`'s update, its state_dict, no host sync.

`torch.optim.Adagrad` (torch 2.11-2.13) reads its step counter back to the host (``.item()``) to
compute ``lr / (1 + (step - 1) * lr_decay)`` and has no ``capturable`` option, so a whole training step
with it cannot be captured (`dlrm.train.graphed_step`); MLPerf DLRM-DCNv2 trains its dense part with
Adagrad. `CapturableAdagrad` is the same rule without ``lr_decay`` (the configs have none):

    g <- g + weight_decay * p;  sum <- sum + g * g;  p <- p + (-lr * g) / (sqrt(sum) + eps)

computed with the very foreach ops, in the same order, as torch's foreach implementation (what torch
uses on CUDA), so the results are bitwise the same there; ``lr`` may be a float or a 0-dim device tensor
(what the captured step reads), and the step counter stays a tensor on the parameter's device. Its
state_dict has torch's keys (``step``, ``sum``) and group entries, so checkpoints load into either class.

On CUDA (`ONE_PASS`), the same rule runs as Triton kernels (`kernels.adagrad.adagrad_step_`, one launch for up to
32 parameters): one read of the parameter, gradient and sum, one write of the parameter and sum, instead of the
foreach ops' ~15 passes, with the same operations in the same order.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import Tensor


# Whether CUDA parameters take the one-pass Triton update (module-level so that a benchmark can compare both).
# MLPerf DLRM-DCNv2 (16M dense fp32 parameters), H100, alternating in one process (2026-11-25,
# results/adagrad_one_pass.md): the step 21.88-21.91 ms against 22.07-22.08 with the foreach ops (+0.8-0.9%).
ONE_PASS = True


class CapturableAdagrad(torch.optim.Optimizer):
    """Adagrad (no lr decay) whose step runs on the device only: capturable in a CUDA graph.

    Args:
        params: the parameters (dense gradients only).
        lr: learning rate, a float or a 0-dim tensor on the parameters' device.
        eps: added to the root of the accumulated squares.
        weight_decay: L2 coefficient added to the gradient.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> opt = CapturableAdagrad([w], lr=0.5)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> w.detach()
        tensor([ 0.5000, -1.5000])
        >>> sorted(opt.state[w])
        ['step', 'sum']
    """

    def __init__(self, params: Iterable, lr: Union[float, Tensor] = 0.01, eps: float = 1e-10,
                 weight_decay: float = 0.0) -> None:
        if not isinstance(lr, Tensor) and lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not eps >= 0.0:  # as torch.optim.Adagrad: a negative (or NaN) eps gave -inf / NaN weights, silently
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        # torch.optim.Adagrad's group entries, so that a state_dict of either class loads into the other
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=0.0, initial_accumulator_value=0.0,
                        foreach=True, maximize=False, differentiable=False, fused=None)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                self.state[p]["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self.register_load_state_dict_post_hook(_steps_to_param_device)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CapturableAdagrad.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("CapturableAdagrad: sparse gradients are not supported (dense parameters only)")
            state = [self.state[p] for p in params]
            torch._foreach_add_([s["step"] for s in state], 1)  # counted as torch does, on the device
            sums = [s["sum"] for s in state]
            if _one_pass(params, grads, sums):
                from kernels.adagrad import adagrad_step_

                lr, dev = group["lr"], params[0].device
                if not isinstance(lr, Tensor):  # a fill kernel, no host sync (and capturable)
                    lr = torch.full((), lr, dtype=torch.float32, device=dev)
                elif lr.dtype != torch.float32 or lr.device != dev:
                    lr = lr.to(device=dev, dtype=torch.float32)
                adagrad_step_(params, grads, sums, lr, group["eps"], group["weight_decay"])
                continue
            if group["weight_decay"] != 0:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            torch._foreach_addcmul_(sums, grads, grads, value=1)
            std = torch._foreach_sqrt(sums)
            torch._foreach_add_(std, group["eps"])
            numerator = torch._foreach_mul(grads, group["lr"])  # lr: a float, or a device tensor (no sync)
            torch._foreach_neg_(numerator)
            torch._foreach_addcdiv_(params, numerator, std)
        return None


def _one_pass(params: list[Tensor], grads: list[Tensor], sums: list[Tensor]) -> bool:
    """`ONE_PASS`, and every tensor fp32, contiguous and on one CUDA device (the kernel's contract)."""
    if not ONE_PASS or not params[0].is_cuda:
        return False
    dev = params[0].device
    return all(t.device == dev and t.dtype == torch.float32 and t.is_contiguous() for t in (*params, *grads, *sums))


def _steps_to_param_device(optimizer: CapturableAdagrad) -> None:
    """After load_state_dict: step counters on their parameter's device (torch's Adagrad keeps them on
    the CPU, and Optimizer.load_state_dict leaves a "step" where it was)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and isinstance(state.get("step"), Tensor):
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
            elif state is not None and "step" in state:
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=p.device)
