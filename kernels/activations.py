"""Activation helpers shared by the fused kernels: ``@triton.jit`` forwards and derivatives, plus a
PyTorch reference.

Supported names (``ACTIVATIONS``): ``"none"``, ``"relu"``, ``"sigmoid"``, ``"gelu"`` (the exact erf
form, i.e. torch's default ``nn.GELU()``), ``"squared_relu"`` (``relu(x) ** 2``).

Inside kernels an activation is a ``tl.constexpr`` integer code (see `activation_code`), so each
activation compiles to its own specialised kernel and the branches below cost nothing at run time.
All math is done in fp32: kernels upcast their loads before calling these helpers.

Backward needs either the pre-activation ``x`` or the output ``y = act(x)``:

* ``none``, ``relu`` and ``sigmoid`` can be differentiated from the output alone
  (``relu'(x) = [y > 0]``, ``sigmoid'(x) = y (1 - y)``, which is also what torch's own backward uses),
  so ops save the output they return anyway and need no extra memory;
* ``gelu`` and ``squared_relu`` need the pre-activation (gelu is not invertible; recovering
  ``relu(x)`` from ``sqrt(y)`` would lose precision).

`derivative_from_output` encodes that rule; `act_derivative` takes whichever tensor was saved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACTIVATIONS: tuple[str, ...] = ("none", "relu", "sigmoid", "gelu", "squared_relu")

# Integer codes used as tl.constexpr inside kernels (literals in the jit code below must match).
_CODES = {"none": 0, "relu": 1, "sigmoid": 2, "gelu": 3, "squared_relu": 4}

# Activations whose derivative can be computed exactly from the activation's output.
_FROM_OUTPUT = frozenset({"none", "relu", "sigmoid"})

def check_activation(name: str) -> str:
    """Return `name` unchanged, or raise ``ValueError`` for an unknown activation."""
    if name not in _CODES:
        raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")
    return name


def activation_code(name: str) -> int:
    """The ``tl.constexpr`` code of activation `name` (0 none, 1 relu, 2 sigmoid, 3 gelu, 4 squared_relu)."""
    return _CODES[check_activation(name)]


def derivative_from_output(name: str) -> bool:
    """True when ``act'(x)`` can be computed exactly from ``y = act(x)`` (none, relu, sigmoid)."""
    return check_activation(name) in _FROM_OUTPUT


def apply_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """PyTorch reference: ``act(x)`` for any dtype/device (used by tests and non-Triton paths)."""
    check_activation(name)
    if name == "none":
        return x
    if name == "relu":
        return F.relu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "gelu":
        return F.gelu(x)  # approximate="none": the exact erf form
    return F.relu(x).square()


@triton.jit
def _sigmoid(x):
    # From e = exp(-|x|) <= 1: never overflows (no inf/nan for any finite x), and e / (1 + e) keeps
    # full relative precision for very negative x.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def act_forward(x, ACTIVATION: tl.constexpr):
    """``act(x)`` for an fp32 tile `x`; `ACTIVATION` is an `activation_code`."""
    if ACTIVATION == 1:  # relu
        y = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:  # sigmoid
        y = _sigmoid(x)
    elif ACTIVATION == 3:  # gelu, exact: x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == 4:  # squared relu
        r = tl.maximum(x, 0.0)
        y = r * r
    else:  # none
        y = x
    return y


@triton.jit
def act_derivative(saved, ACTIVATION: tl.constexpr, FROM_OUTPUT: tl.constexpr):
    """``act'(x)`` for an fp32 tile.

    `saved` is the output ``y = act(x)`` when `FROM_OUTPUT` (only valid for none/relu/sigmoid), else
    the pre-activation ``x``.
    """
    if ACTIVATION == 1:  # relu: [x > 0] == [y > 0]; derivative at 0 is 0, as in torch
        d = tl.where(saved > 0.0, 1.0, 0.0)
    elif ACTIVATION == 2:  # sigmoid
        if FROM_OUTPUT:
            s = saved
        else:
            s = _sigmoid(saved)
        d = s * (1.0 - s)
    elif ACTIVATION == 3:  # gelu: Phi(x) + x * phi(x)
        cdf = 0.5 * (1.0 + tl.erf(saved * 0.7071067811865476))
        pdf = tl.exp(-0.5 * saved * saved) * 0.3989422804014327
        d = cdf + saved * pdf
    elif ACTIVATION == 4:  # squared relu: 2 relu(x)
        d = 2.0 * tl.maximum(saved, 0.0)
    else:  # none
        d = tl.full(saved.shape, 1.0, tl.float32)
    return d


__all__ = [
    "ACTIVATIONS",
    "act_derivative",
    "act_forward",
    "activation_code",
    "apply_activation",
    "check_activation",
    "derivative_from_output",
]
