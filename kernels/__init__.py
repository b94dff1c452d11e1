"""Fused Triton kernels for DLRM, one file per op.

Each op file follows the same order: ``@triton.jit`` kernels, host launchers, the
``torch.library`` custom op (with fake and autograd registrations), then a thin function and
an ``nn.Module`` with the same parameters and state_dict keys as the eager module it replaces.

Shared by the op files: `kernels.table_layout` (the tables' rows and init, also used by the eager
and sharded arches of ``dlrm``) and `kernels.heuristics` (every launch heuristic: SM count, block
sizes, named tile configs).

This package imports nothing from ``dlrm``: inputs are plain tensors.
"""

from kernels import _interpreter
from kernels._backend import TritonUnavailableError, check_triton_device, interpret_mode

# Under TRITON_INTERPRET=1 (CPU runs, the CPU tests): the interpreter's patching once a grid, not once a helper call.
_interpreter.install()
# ... and without the integer overflow checks whose result it throws away (its device_assert needs debug, always off).
_interpreter.skip_dead_overflow_checks()
# ... and its tl.dot of bf16 operands computed from their values, not their uint16 bit patterns (a correctness fix).
_interpreter.install_bf16_dot()
# ... and a scalar loop bound that Triton 3.6's interpreter (torch 2.11's) cannot convert under NumPy >= 2.4.
_interpreter.fix_scalar_index()

__all__ = ["TritonUnavailableError", "check_triton_device", "interpret_mode"]
