"""Audit of vocabulary hashing end to end: the eager modules and the Triton ones must agree on which
vocabularies they take, and a vocabulary dataset's copy (`dlrm.data.relayout`) must not be made from
vocabulary files no run can read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dlrm.data.relayout import main as relayout_main
from dlrm.data.schema import NUM_SPARSE, read_metadata, write_metadata
from dlrm.data.vocabulary import vocab_path
from dlrm.model.archs import SparseArch
from dlrm.model.hashing import keyed_vocabulary
from dlrm.model.pooled_sparse import PooledSparseArch
from dlrm.train.baseline import RowHasher
from kernels.embedding.module import TritonSparseEmbedding
from tests.conftest import make_dataset

# -- eager modules refuse an unsorted or repeated vocabulary, as the Triton modules do ---------------------------

UNSORTED = [torch.tensor([9, 5, 1]), torch.tensor([3, 4])]  # feature 0 descending
REPEATED = [torch.tensor([1, 5, 9]), torch.tensor([3, 3])]  # feature 1 holds 3 twice


@pytest.mark.parametrize("vocabs, feature", [(UNSORTED, 0), (REPEATED, 1)])
def test_eager_modules_refuse_a_vocabulary_the_triton_module_refuses(vocabs, feature):
    """An unsorted vocabulary made the eager modules' searchsorted miss: 1, 5 and 9, all in feature 0's
    vocabulary [9, 5, 1], went to its out-of-vocabulary row 0, silently (the DLRM and the baseline trained
    every value on one row), where the Triton module refuses the same vocabulary."""
    cards = [len(v) + 1 for v in vocabs]
    with pytest.raises(ValueError, match=f"feature {feature}: vocabulary must be"):
        TritonSparseEmbedding(cards, 2, vocabs)
    builders = {
        "keyed_vocabulary": lambda: keyed_vocabulary(vocabs),
        "SparseArch": lambda: SparseArch(cards, 2, vocabs),
        "PooledSparseArch": lambda: PooledSparseArch(cards, [1, 1], 2, vocabs),
        "RowHasher": lambda: RowHasher(cards, vocabs, "cpu"),
    }
    for name, build in builders.items():
        with pytest.raises(ValueError, match=f"feature {feature}: vocabulary must be .*sorted ascending and unique"):
            build()
            pytest.fail(f"{name} took the vocabulary")


def test_a_sorted_vocabulary_still_maps_every_value_to_its_own_row_in_eager_and_triton():
    vocabs = [torch.tensor([1, 5, 9]), torch.tensor([-3, 4]), torch.empty(0, dtype=torch.int64)]
    cards = [len(v) + 1 for v in vocabs]
    raw = torch.tensor([[1, -3, 0], [5, 4, -1], [9, 7, 2**63 - 1], [2, -1, -(2**63)]])
    expected = [[1, 5, 7], [2, 6, 7], [3, 4, 7], [0, 4, 7]]  # offsets 0, 4, 7; row 0 of a table: out of vocabulary
    assert SparseArch(cards, 2, vocabs).rows(raw).tolist() == expected
    assert RowHasher(cards, vocabs, "cpu")(raw).tolist() == expected
    # the Triton module on CUDA where there is one (on the CPU the interpreter runs it: tests/conftest.py)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert TritonSparseEmbedding(cards, 2, vocabs).to(device).rows(raw.to(device)).tolist() == expected


# -- relayout checks the vocabularies it copies -------------------------------------------------------------------

CARD = 6


def _vocabulary_dataset(root: Path) -> Path:
    make_dataset(root, {"train": 20, "validation": 10}, cardinality=CARD)
    meta = read_metadata(root)
    meta.hashing = "vocabulary"
    write_metadata(root, meta)
    for f in range(NUM_SPARSE):
        vocab_path(root, f).parent.mkdir(exist_ok=True)
        np.save(vocab_path(root, f), np.arange(10, 10 + CARD - 1, dtype=np.int64))
    return root


def _relayout(data: Path, output: Path):
    return CliRunner().invoke(relayout_main, ["--data", str(data), "--output", str(output), "--workers", "1"])


@pytest.mark.parametrize("damage, needle", [
    ("missing", "vocabulary file missing"),
    ("unsorted", "not strictly increasing"),
    ("short", f"holds {CARD - 2} values but metadata.json cardinalities[7] is {CARD}"),
])
def test_relayout_refuses_a_vocabulary_dataset_whose_vocabulary_file_is_damaged(tmp_path, damage, needle):
    """vocab/ was copied as it was: a vocabulary dataset missing SPARSE_7.npy (or holding an unsorted or short
    one) gave a copy, exit 0, that every run refuses. Now: one line naming the file, exit 2, no --output."""
    data = _vocabulary_dataset(tmp_path / "ds")
    path = vocab_path(data, 7)
    if damage == "missing":
        path.unlink()
    elif damage == "unsorted":
        np.save(path, np.arange(10, 10 + CARD - 1, dtype=np.int64)[::-1].copy())
    else:
        np.save(path, np.arange(CARD - 2, dtype=np.int64))
    res = _relayout(data, tmp_path / "out")
    assert res.exit_code == 2, res.output
    assert needle in res.output and str(path) in res.output, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()


def test_relayout_copies_a_sound_vocabulary_dataset(tmp_path):
    data = _vocabulary_dataset(tmp_path / "ds")
    res = _relayout(data, tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert read_metadata(tmp_path / "out").hashing == "vocabulary"
    for f in range(NUM_SPARSE):
        assert np.load(vocab_path(tmp_path / "out", f)).tolist() == list(range(10, 10 + CARD - 1))


# -- a strided batch hashes as a contiguous one, without torch's searchsorted warning in the user's log -----------


def test_a_transposed_batch_hashes_as_its_contiguous_copy_without_a_warning():
    import warnings

    from dlrm.model.hashing import vocabulary_rows

    keys, vocab_offsets = keyed_vocabulary([torch.tensor([1, 5, 9]), torch.tensor([3, 4])])
    offsets = torch.tensor([0, 4])
    raw = torch.tensor([[9, 1, 2, -1, 5], [4, 3, 7, 4, -1]]).t()  # [B=5, F=2] as a transposed view
    assert not raw.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = vocabulary_rows(raw, keys, vocab_offsets, offsets)
    assert rows.tolist() == vocabulary_rows(raw.contiguous(), keys, vocab_offsets, offsets).tolist()
    assert rows.tolist() == [[3, 6], [1, 5], [0, 4], [0, 6], [2, 4]]
