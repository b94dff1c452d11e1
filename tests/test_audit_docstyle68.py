"""TorchRec-style docstrings, beyond tests/test_module_docstrings.py's three parts: every constructor argument of a
public ``nn.Module`` of dlrm/ and kernels/ has its own Args entry, the functions and optimizers a user builds or calls
carry a runnable example, and the kernels' notation names the batch rows M (as `kernels.linear` does)."""

import importlib
import inspect
import re

import pytest
from torch import nn

from tests.conftest import REPO
from tests.test_module_docstrings import _constructor_args, _module_names, public_modules

_ARGS_HEADER = re.compile(r"^Args\b[^\n]*:\s*$")


def args_entries(doc: str) -> set[str]:
    """The names that head an entry of `doc`'s Args section (``a, b: ...`` gives a and b), plus the aliases its
    entries accept as ``name=``."""
    lines = inspect.cleandoc(doc or "").splitlines()
    names: set[str] = set()
    for i, line in enumerate(lines):
        if not _ARGS_HEADER.match(line):
            continue
        indent = None
        for entry in lines[i + 1:]:
            depth = len(entry) - len(entry.lstrip())
            if not entry.strip() or depth == 0:
                break
            names |= set(re.findall(r"``(\w+)=``", entry))
            if indent is None:
                indent = depth
            if depth == indent and ":" in entry:
                names |= {n.strip().strip("`") for n in entry.split(":", 1)[0].split(",")}
    return names


def undocumented_args(cls: type) -> list[str]:
    """`cls`'s constructor arguments that no entry of its docstring's Args section names."""
    documented = args_entries(cls.__doc__ or "")
    return [a for a in _constructor_args(cls) if a not in documented]


def test_every_constructor_argument_of_a_public_module_has_an_args_entry():
    checked, gaps = [], []
    for name in _module_names():
        for cls in public_modules(importlib.import_module(name)):
            checked.append(cls.__qualname__)
            if missing := undocumented_args(cls):
                gaps.append(f"{name}.{cls.__qualname__}: {', '.join(missing)}")
    assert not gaps, "\n".join(gaps)
    assert {"DenseArch", "OverArch", "Fp8Linear", "LinearReLUWgrad", "TritonSparseEmbedding"} <= set(checked)


class _Layer(nn.Module):
    """A layer.

    Args:
        width, depth: its shape.
        scale: a factor (``gain=`` is an alias),
            on two lines.
        dropout: nothing here names ``fake`` or
            activation: an indented line is not an entry.
    """

    def __init__(self, width, depth, scale=1.0, gain=None, dropout=0.0, activation="relu", device=None):
        super().__init__()


def test_args_entries_reads_entry_heads_and_aliases_only():
    assert args_entries(_Layer.__doc__) == {"width", "depth", "scale", "gain", "dropout"}
    assert undocumented_args(_Layer) == ["activation", "device"]


# What a user builds or calls (the builders, optimizers, the step, the kernels' thin functions, the hashing): each
# has an Args entry per argument and a doctest that `pytest` runs (an example written as prose, as sum_partial_rows'
# was, is never checked). SparseArchInterface is a Protocol: no constructor, its attributes listed instead.
ENTRY_POINTS = [
    "dlrm.model.dlrm:build_model", "dlrm.model.dlrm:build_loss", "dlrm.model.hashing:modulus_rows",
    "dlrm.model.hashing:keyed_vocabulary", "dlrm.model.hashing:vocabulary_rows",
    "dlrm.model.interfaces:SparseArchInterface", "dlrm.train.optim:RowWiseAdagrad",
    "dlrm.train.optim:FusedSparseOptimizer", "dlrm.train.optim:build_optimizers", "dlrm.train.optim:build_schedulers",
    "dlrm.train.step:TrainStep", "dlrm.train.step:EvalForward", "kernels.linear:linear_act", "kernels.mlp:fused_mlp",
    "kernels.mlp_tail:tail_mlp", "kernels.cross:low_rank_cross_net", "kernels.embedding.hashing:hash_rows",
    "kernels.embedding.lookup:embedding_lookup", "kernels.col_sum:sum_partial_rows", "kernels.fp8_linear:fp8_mlp",
]


@pytest.mark.parametrize("ref", ENTRY_POINTS)
def test_entry_points_have_args_and_a_doctest(ref):
    module, name = ref.split(":")
    obj = getattr(importlib.import_module(module), name)
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{ref}: no doctest"
    params = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
    missing = [p for p in params if p not in args_entries(doc)]
    assert not missing, f"{ref}: no Args entry for {missing}"


_NOTATION_ROWS = re.compile(r"(?:``)?(\w+)(?:``)?\s+rows\s+\(the batch")


def test_kernel_notation_names_the_batch_rows_m():
    """kernels.linear, mlp, cross and mlp_tail write x [M, K] @ W^T [K, N] -> [M, N]; a file that calls the rows N
    (fp8_linear did, with M its output width) reads the opposite way to its neighbours."""
    found = {}
    for path in sorted((REPO / "kernels").rglob("*.py")):
        for symbol in _NOTATION_ROWS.findall(path.read_text()):
            found[path.name] = symbol
    assert {"cross.py", "fp8_linear.py", "mlp_tail.py"} <= set(found)
    assert {f: s for f, s in found.items() if s != "M"} == {}
