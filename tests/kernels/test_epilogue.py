"""kernels/epilogue.py (`act_backward`, the linear op's activation backward) against float64 autograd.

Every activation, saved output or saved pre-activation, element by element ``grad_pre`` and the
bias gradient (column sums over many row blocks included), odd shapes and non-contiguous / stride-0
inputs. CPU: Triton interpreter, fp32; GPU (marked gpu): fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels.activations import ACTIVATIONS, apply_activation, derivative_from_output
from kernels.epilogue import act_backward


def make(shape, layout: str, device, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """A [M, N] tensor with a given layout (contiguous, transposed, sliced columns, stride-0 rows)."""
    M, N = shape
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        t = torch.randn(M, N, generator=gen)
    elif layout == "transposed":
        t = torch.randn(N, M, generator=gen).t()
    elif layout == "sliced":
        t = torch.randn(M, 2 * N + 1, generator=gen)[:, 1::2]
    elif layout == "expand":
        t = torch.randn(1, N, generator=gen).expand(M, N)
    else:
        raise ValueError(layout)
    return t.to(device=device, dtype=dtype)


def reference(pre: torch.Tensor, grad_out: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(grad_pre, grad_bias)`` of ``act(pre)`` by autograd."""
    p = pre.detach().double().requires_grad_()
    apply_activation(p, activation).backward(grad_out.double())
    return p.grad, p.grad.sum(0)


def saved_tensor(pre: torch.Tensor, activation: str, from_output: bool) -> torch.Tensor:
    """What the forward saves: the activation's output (computed in pre's dtype) or pre itself."""
    return apply_activation(pre, activation) if from_output else pre


CASES = [
    # (M, N, pre layout, grad layout)
    (1, 1, "contiguous", "contiguous"),
    (3, 24, "transposed", "expand"),
    (127, 13, "sliced", "transposed"),
    (33, 200, "contiguous", "sliced"),  # N > 128: two column blocks; M > 32: two row blocks
    (545, 7, "contiguous", "contiguous"),  # 18 row blocks: the column sum loops over several steps
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("M,N,pl,gl", CASES)
def test_act_backward(M, N, pl, gl, activation, device, assert_close):
    pre = make((M, N), pl, device, seed=M + N)
    g = make((M, N), gl, device, seed=M * N + 1)
    from_output = derivative_from_output(activation)
    gpre, gbias = act_backward(g, saved_tensor(pre, activation, from_output), activation, from_output, bias_grad=True)
    ref_pre, ref_bias = reference(pre, g, activation)
    what = f"{activation} M={M} N={N}"
    assert gpre.shape == (M, N) and gpre.dtype == g.dtype and gpre.is_contiguous()
    assert gbias.shape == (N,) and gbias.dtype == g.dtype
    assert_close(gpre, ref_pre, torch.float32, msg=f"grad_pre {what}")
    assert_close(gbias, ref_bias, torch.float32, scale=max(1.0, M**0.5), msg=f"grad_bias {what}")


@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_act_backward_from_pre_activation(activation, device, assert_close):
    """relu and sigmoid can also differentiate from the pre-activation (what a caller without the
    output would save)."""
    pre = make((37, 19), "transposed", device, seed=3)
    g = make((37, 19), "contiguous", device, seed=4)
    gpre, gbias = act_backward(g, pre, activation, False, bias_grad=True)
    ref_pre, ref_bias = reference(pre, g, activation)
    assert_close(gpre, ref_pre, torch.float32)
    assert_close(gbias, ref_bias, torch.float32, scale=37**0.5)


def test_act_backward_outputs_on_request(device, assert_close):
    """write_pre=False returns no grad_pre; bias_grad=False no bias gradient; 'none' passes grad_out."""
    pre = make((9, 21), "contiguous", device, seed=5)
    g = make((9, 21), "expand", device, seed=6)
    gpre, gbias = act_backward(g, pre, "gelu", False, write_pre=False, bias_grad=True)
    assert gpre is None
    assert_close(gbias, reference(pre, g, "gelu")[1], torch.float32, scale=3.0)
    gpre, gbias = act_backward(g, pre, "gelu", False)
    assert gbias is None
    assert_close(gpre, reference(pre, g, "gelu")[0], torch.float32)
    gpre, gbias = act_backward(g, pre, "none", True, bias_grad=True)
    assert torch.equal(gpre, g.contiguous())
    assert_close(gbias, g.double().sum(0), torch.float32, scale=3.0)


@pytest.mark.parametrize("M,N", [(0, 5), (4, 0)])
def test_act_backward_empty(M, N, device):
    g = torch.empty(M, N, device=device)
    gpre, gbias = act_backward(g, g, "relu", True, bias_grad=True)
    assert gpre.shape == (M, N)
    assert gbias.shape == (N,) and not gbias.any()


def test_act_backward_rejects_non_matrices(device):
    with pytest.raises(ValueError, match="2-D"):
        act_backward(torch.zeros(2, 3, 4, device=device), torch.zeros(2, 3, 4, device=device), "relu", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_act_backward(activation, dtype, assert_close):
    device = torch.device("cuda")
    M, N = 4099, 200
    pre = make((M, N), "transposed", device, dtype, seed=1)
    g = make((M, N), "expand", device, dtype, seed=2)
    from_output = derivative_from_output(activation)
    gpre, gbias = act_backward(g, saved_tensor(pre, activation, from_output), activation, from_output, bias_grad=True)
    ref_pre, ref_bias = reference(pre, g, activation)
    # bf16: grad_pre rounded to 8 bits (squared_relu's derivative reaches ~8); the bias sums M rows
    s = 4.0 if activation == "squared_relu" else 1.0
    assert_close(gpre, ref_pre, dtype, scale=s, msg="grad_pre")
    assert_close(gbias, ref_bias, dtype, scale=s * M**0.5, msg="grad_bias")
