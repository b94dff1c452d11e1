"""Every public ``nn.Module`` of dlrm/ and kernels/ documents itself in TorchRec's way: its constructor's
arguments (an ``Args`` section), an example (a doctest, which ``--doctest-modules`` runs, or a literal
``Example ...::`` block where it needs torchrun) and its output shape (a ``Shapes:`` line)."""

import importlib
import inspect
import re
import types

import pytest
from torch import nn

from tests.conftest import REPO

_ARGS = re.compile(r"^\s*Args\b[^\n]*:\s*$", re.MULTILINE)
_LITERAL_EXAMPLE = re.compile(r"^\s*Example\b[^\n]*::\s*$", re.MULTILINE)


def _module_names() -> list[str]:
    names = []
    for package in ("dlrm", "kernels"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _constructor_args(cls: type) -> list[str]:
    """The constructor's named parameters (``*args``/``**kwargs`` of an inherited ``nn.Module.__init__`` are none)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def docstring_gaps(cls: type) -> list[str]:
    """What `cls`'s docstring lacks of the three parts (empty: nothing)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    gaps = []
    if _constructor_args(cls) and not _ARGS.search(doc):
        gaps.append("an Args section")
    if ">>>" not in doc and not _LITERAL_EXAMPLE.search(doc):
        gaps.append("an example")
    if "Shapes:" not in doc:
        gaps.append("a Shapes: line")
    return gaps


def public_modules(module: types.ModuleType) -> list[type]:
    return [cls for name, cls in vars(module).items()
            if inspect.isclass(cls) and cls.__module__ == module.__name__ and issubclass(cls, nn.Module)
            and not name.startswith("_")]


def test_every_public_module_has_args_example_and_shapes():
    checked, gaps = [], []
    for name in _module_names():
        for cls in public_modules(importlib.import_module(name)):
            checked.append(cls.__qualname__)
            if missing := docstring_gaps(cls):
                gaps.append(f"{name}.{cls.__qualname__}: {', '.join(missing)}")
    assert not gaps, "\n".join(gaps)
    # the walk found the modules it is meant to check (a broken walk would check nothing and pass)
    assert {"DLRM", "DenseArch", "SparseArch", "InteractionArch", "OverArch", "TritonPooledEmbedding",
            "FusedMLP", "TritonLinear", "ShardedSparseArch"} <= set(checked)


class _Undocumented(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()


class _Documented(nn.Module):
    """A layer.

    Args:
        width: its width.

    Example:
        >>> _Documented(3)
        _Documented()

    Shapes: [B, width] -> [B, width].
    """

    def __init__(self, width: int) -> None:
        super().__init__()


class _NoArgs(nn.Module):
    """No constructor arguments, so no Args section.

    Example (needs torchrun)::

        _NoArgs()(x)

    Shapes: [B] -> [B].
    """


@pytest.mark.parametrize("cls, gaps", [
    (_Undocumented, ["an Args section", "an example", "a Shapes: line"]),
    (_Documented, []),
    (_NoArgs, []),
])
def test_docstring_gaps_finds_what_is_missing(cls, gaps):
    assert docstring_gaps(cls) == gaps


def test_docstring_gaps_wants_each_part():
    full = inspect.getdoc(_Documented)
    for part, gap in [("Args:", "an Args section"), (">>>", "an example"), ("Shapes:", "a Shapes: line")]:
        cls = type("Partial", (nn.Module,), {"__doc__": full.replace(part, "Other"),
                                              "__init__": _Documented.__init__})
        assert docstring_gaps(cls) == [gap]
