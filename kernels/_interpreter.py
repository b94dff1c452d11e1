"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) without its repeated per-call patching.

Why: before it runs a kernel, the interpreter points the builtins of ``triton.language`` at its numpy
implementations (``triton.runtime.interpreter._patch_lang``, which walks every member of the language
modules with ``inspect.getmembers``), and restores them when the grid is done. It also does that walk
again at every call of a ``@triton.jit`` helper inside the kernel, once per program: the chunk kernel of
the embedding update calls ~10 helpers per program, so a CPU training run of the multi-hot model spent
~25% of its time re-patching modules that were already patched (Triton 3.6 and 3.9; cProfile of a 27-step
run of the bf16 test config: 9,704 walks, 8.1 of 32 s).

`install` wraps ``_patch_lang``: the kernel-level call patches as before (and its restore ends the
grid); a helper's call patches only the language modules (``triton.language`` or ``triton.language.core``,
whichever its own module's globals hold) that this grid has not patched yet, which is all that call
would have changed (re-patching an already patched module rewrites the same functions). A run computes
exactly what it computed before, in ~22% less time (the same 27-step run: 13.1 s -> 10.2 s, AUC and
loss to every printed digit).

It touches Triton's internals, so it installs only where they look as expected (Triton 3.6 and 3.9 were
read and tested), and ``DLRM_INTERPRETER_PATCH_ONCE=0`` leaves the interpreter as it is.

`install_bf16_dot` is a correctness fix, installed whatever ``DLRM_INTERPRETER_PATCH_ONCE`` says: the interpreter
keeps bf16 tensors as their uint16 bit patterns (numpy has no bf16) and its ``tl.dot`` multiplied those integers
(``InterpreterBuilder.create_dot``: ``np.matmul`` of the raw arrays), so every kernel whose ``tl.dot`` takes bf16
operands (`kernels.linear`, `kernels.cross`, `kernels.wgrad`, `kernels.interaction`, `kernels.mlp_tail`) returned
values ~1e10 off, silently (a CPU run of ``kernels.interaction "triton"`` at ``train.precision "bf16"`` trained on a
loss of 7.7e8). It hands such a dot the operands' exact fp32 values, the products a GPU's bf16 MMA forms, summed in
fp32. It also makes the interpreter's fp32 -> bf16 cast (``x.to(tl.bfloat16)``, a store of fp32 values into bf16) round
to nearest even, as a GPU's ``cvt.rn.bf16.f32`` does: it truncated, so every bf16 result of a CPU run was biased
toward zero and a chain of bf16 layers (`kernels.mlp_tail`) drifted from the eager bf16 MLP by tens of bf16 steps.

`fix_scalar_index` (installed whatever ``DLRM_INTERPRETER_PATCH_ONCE`` says) is a compatibility fix: the interpreter
holds a scalar (``tl.program_id``, a load at one pointer) as a 1-element numpy array, and Triton 3.6's
``tensor.__index__`` converts it with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be
converted to Python scalars"). A loop bound loaded in the kernel (``range(0, hot, UNROLL)`` of the pooled lookup)
then failed every launch under torch 2.11, which pins Triton 3.6; Triton 3.9 squeezes the array first, which is what
the fix does where the installed conversion fails.

`skip_dead_overflow_checks` (with `install`; ``DLRM_INTERPRETER_PATCH_ONCE=0`` leaves it out too) is a speed-up of
nothing checked: before every add, sub and mul of int32 (or narrower) tensors the interpreter computes the result again
in int64 and compares it with the type's bounds (``binary_op_sanitize_overflow_impl``), to hand the comparison to
``device_assert``, which the interpreter runs only with the ``debug`` option, always off there (``InterpreterOptions``
is built with its defaults). The comparison was computed and thrown away: ~40% of the interpreter's time in a CPU
training run of the Triton kernels (cProfile of tests/kernels/test_convergence.py's fifty-step test). The
interpreter's ``sanitize_overflow`` option is turned off where ``debug`` is off and both Triton functions read those
options as 3.6 and 3.9 do; a kernel computes and checks exactly what it did.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading

from kernels._backend import interpret_mode

__all__ = ["fix_scalar_index", "install", "install_bf16_dot", "installed", "skip_dead_overflow_checks"]

_state = threading.local()  # .patched: ids of the language modules patched in this thread's running grid
_langs_by_fn: dict = {}  # function -> its language modules' ids (functions live as long as their jit wrappers)
_original = None
_original_patch_tensor = None  # Triton's _patch_lang_tensor, where `fix_scalar_index` wrapped it


def _language_modules(fn) -> frozenset[int]:
    """ids of the language modules ``fn``'s module can see (what ``_patch_lang`` patches for it)."""
    got = _langs_by_fn.get(fn)
    if got is None:
        import triton.language as tl

        got = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        _langs_by_fn[fn] = got
    return got


class _GridScope:
    """The kernel-level call's patch scope; its ``restore`` (at the grid's end) also ends the grid."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def restore(self) -> None:
        _state.patched = None
        self._inner.restore()


def _patch_lang_once(fn):
    patched = getattr(_state, "patched", None)
    langs = _language_modules(fn)
    if patched is None:  # a kernel's grid starts
        scope = _original(fn)
        _state.patched = set(langs)
        return _GridScope(scope)
    if langs <= patched:  # a helper whose modules this grid already patched: nothing would change
        return None
    patched |= langs
    return _original(fn)  # as before: the helper's patches outlive the grid (Triton never restores them)


def installed() -> bool:
    """Whether `install` has replaced the interpreter's ``_patch_lang``."""
    return _original is not None


def install() -> bool:
    """Replace ``triton.runtime.interpreter._patch_lang`` (see the module docstring); True when installed.

    A no-op outside interpreter mode, with ``DLRM_INTERPRETER_PATCH_ONCE=0``, or when this Triton's
    interpreter does not look like the ones this was written for."""
    global _original
    if _original is not None:
        return True
    if not interpret_mode() or os.environ.get("DLRM_INTERPRETER_PATCH_ONCE", "1") == "0":
        return False
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if not callable(original) or not hasattr(interpreter, "GridExecutor") or not hasattr(
            interpreter, "InterpretedFunction"):
        return False
    if list(inspect.signature(original).parameters) != ["fn"]:
        return False
    _original = original
    interpreter._patch_lang = _patch_lang_once
    return True


_original_dot = None
_original_fp_trunc = None


def _create_dot_exact_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``InterpreterBuilder.create_dot`` with bf16 operands first widened to their fp32 values (exact)."""
    import triton.language as tl

    a = self.cast_impl(a, tl.float32) if a.dtype == tl.bfloat16 else a
    b = self.cast_impl(b, tl.float32) if b.dtype == tl.bfloat16 else b
    return _original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def _fp_trunc_nearest_bf16(self, src, dst_type):
    """``InterpreterBuilder.create_fp_trunc`` with fp32 -> bf16 rounded to nearest, ties to even (NaN stays NaN)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return _original_fp_trunc(self, src, dst_type)
    data = np.asarray(src.data, dtype=np.float32)
    bits = data.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(data)
    rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x40  # a quiet NaN (the carry could have made it inf)
    return interpreter.TensorHandle(rounded.reshape(data.shape), tl.bfloat16)


def install_bf16_dot() -> bool:
    """Make the interpreter's ``tl.dot`` of bf16 operands compute with their values and its fp32 -> bf16 casts round
    to nearest even (see the module docstring); True when installed. A no-op outside interpreter mode or where the
    interpreter does not look as expected."""
    global _original_dot, _original_fp_trunc
    if _original_dot is not None:
        return True
    if not interpret_mode():
        return False
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    dot = getattr(builder, "create_dot", None)
    trunc = getattr(builder, "create_fp_trunc", None)
    if not callable(dot) or not callable(trunc) or not callable(getattr(builder, "cast_impl", None)) or not hasattr(
            interpreter, "TensorHandle") or list(inspect.signature(dot).parameters) != [
            "self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"] or list(
            inspect.signature(trunc).parameters) != ["self", "src", "dst_type"]:
        return False
    _original_dot, _original_fp_trunc = dot, trunc
    builder.create_dot = _create_dot_exact_bf16
    builder.create_fp_trunc = _fp_trunc_nearest_bf16
    return True


class _OneElement:
    """Stands in for an interpreter tensor holding a scalar, to probe how ``__index__`` converts one."""

    class handle:
        data = None  # a [1] numpy array, set by `fix_scalar_index` (numpy is imported only when the fix installs)


def _index_converts_scalars(index) -> bool:
    try:
        return index(_OneElement) == 3
    except TypeError:
        return False


def _scalar_index(self) -> int:
    # squeeze a scalar's [1] array to the 0-d one NumPy >= 2.4 still converts (Triton 3.9's own conversion)
    return int(self.handle.data.squeeze())


def _patch_lang_tensor_fixed(tensor, scope) -> None:
    _original_patch_tensor(tensor, scope)
    if not _index_converts_scalars(tensor.__index__):
        # recorded in the same scope after Triton's own patch: the grid's restore undoes both, in reverse order
        scope.set_attr(tensor, "__index__", _scalar_index)


def fix_scalar_index() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang_tensor`` so that a kernel's scalar converts to an int (a loop
    bound, see the module docstring); True when wrapped. A no-op outside interpreter mode or where this Triton's
    interpreter does not look like 3.6's and 3.9's. Where the installed conversion works (Triton 3.9, NumPy < 2.4)
    the wrapper leaves it as it is."""
    global _original_patch_tensor
    if _original_patch_tensor is not None:
        return True
    if not interpret_mode():
        return False
    try:
        import numpy as np
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if not callable(original) or list(inspect.signature(original).parameters) != ["tensor", "scope"]:
        return False
    _OneElement.handle.data = np.array([3], dtype=np.int32)
    _original_patch_tensor = original
    interpreter._patch_lang_tensor = _patch_lang_tensor_fixed
    return True


def _semantic_source(name: str) -> str:
    """The source of ``triton.language.semantic``'s `name` (a method of its ``TritonSemantic`` class in 3.6 and 3.9, a
    module function before), or "" where it is not found."""
    try:
        import triton.language.semantic as semantic
    except ImportError:
        return ""
    fn = getattr(getattr(semantic, "TritonSemantic", None), name, None) or getattr(semantic, name, None)
    try:
        return inspect.getsource(fn) if callable(fn) else ""
    except (OSError, TypeError):
        return ""


def skip_dead_overflow_checks() -> bool:
    """Turn the interpreter's ``sanitize_overflow`` option off where its check could never fire (see the module
    docstring); True when off. A no-op outside interpreter mode, with ``DLRM_INTERPRETER_PATCH_ONCE=0``, with the
    interpreter's ``debug`` option on, or where Triton's functions do not read the options as 3.6's and 3.9's do."""
    if not interpret_mode() or os.environ.get("DLRM_INTERPRETER_PATCH_ONCE", "1") == "0":
        return False
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow") or getattr(
            options, "debug", True):
        return False
    if not options.sanitize_overflow:
        return True
    # the check's only effect is its device_assert, which returns at once without debug
    if "options.sanitize_overflow" not in _semantic_source("binary_op_sanitize_overflow_impl") or (
            "if not self.builder.options.debug" not in _semantic_source("device_assert")
            and "if not builder.options.debug" not in _semantic_source("device_assert")):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
