"""Audit tests for dlrm/data/vocabulary.py: the contract checks at the ends of the array and of the value range.

A vocabulary that is not strictly increasing, or whose values do not fit int64, silently sends values to the wrong
rows (the hashing's binary search); each case below must load exactly or be refused, naming the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlrm.data.schema import DatasetError
from dlrm.data.vocabulary import read_vocabulary, vocab_path


def _write(root: Path, values: np.ndarray, feature: int = 0) -> None:
    path = vocab_path(root, feature)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, values)


@pytest.mark.parametrize("values,index,pair", [
    ([10, 20, 30, 40, 40], 4, "40 then 40"),  # the last pair: a duplicate
    ([10, 20, 30, 50, 40], 4, "50 then 40"),  # the last pair: out of order
    ([7, 7], 1, "7 then 7"),  # two values only
])
def test_last_pair_is_checked(tmp_path, values, index, pair):
    _write(tmp_path, np.array(values, dtype=np.int64))
    with pytest.raises(DatasetError, match=rf"SPARSE_0.npy: not strictly increasing .* at index {index}: {pair}"):
        read_vocabulary(tmp_path, 0, len(values) + 1)


def test_uint64_values_up_to_int64_max_load_exactly(tmp_path):
    top = 2**63 - 1
    _write(tmp_path, np.array([0, 0xFFFFFFFF, top], dtype=np.uint64))
    got = read_vocabulary(tmp_path, 0, 4)
    assert got.dtype == np.int64 and got.tolist() == [0, 0xFFFFFFFF, top]


@pytest.mark.parametrize("values", [[2**63], [2**64 - 1], [2**63, 2**63 + 1], [1, 2**63], [2**63, 5]])
def test_uint64_values_beyond_int64_are_refused_even_alone(tmp_path, values):
    """Beyond int64 they would wrap to negatives, still increasing for [2**63, 2**63 + 1] and [2**63, 5]: refused,
    never wrapped (the range check comes before the order check, on the raw unsigned values)."""
    _write(tmp_path, np.array(values, dtype=np.uint64))
    with pytest.raises(DatasetError, match=rf"SPARSE_0.npy: value {max(values)} does not fit int64"):
        read_vocabulary(tmp_path, 0, len(values) + 1)


def test_trailing_bytes_are_refused(tmp_path):
    """The file must be exactly as long as its header says: extra bytes mean a corrupt or mislabelled file."""
    _write(tmp_path, np.array([10, 20, 30], dtype=np.int64))
    path = vocab_path(tmp_path, 0)
    path.write_bytes(path.read_bytes() + np.array([40], dtype=np.int64).tobytes())
    with pytest.raises(DatasetError, match=r"SPARSE_0.npy: is \d+ bytes, its header promises \d+ \(truncated"):
        read_vocabulary(tmp_path, 0, 4)


def test_booleans_are_not_integers(tmp_path):
    _write(tmp_path, np.array([False, True]))
    with pytest.raises(DatasetError, match=r"SPARSE_0.npy: must hold a 1-D integer array, holds bool"):
        read_vocabulary(tmp_path, 0, 3)


def test_one_value_and_32_bit_boundaries_load(tmp_path):
    _write(tmp_path, np.array([0xFFFFFFFF], dtype=np.uint32), feature=25)
    assert read_vocabulary(tmp_path, 25, 2).tolist() == [0xFFFFFFFF]
    _write(tmp_path, np.array([-(2**31), -1, 2**31 - 1], dtype=np.int32), feature=1)
    assert read_vocabulary(tmp_path, 1, 4).tolist() == [-(2**31), -1, 2**31 - 1]


# -- hashing: the kernel (kernels.embedding.hashing) and the training code (dlrm.model.hashing) ----------------------

import torch  # noqa: E402

from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows  # noqa: E402

BOUNDARY_RAW = [-1, 0, 1, 2**31 - 1, 2**31, 2**32 - 2, 0xFFFFFFFF, 7, -(2**31), 123456789]


@pytest.fixture
def device() -> torch.device:
    """cuda when available, else cpu (Triton interpreter), as in tests/kernels/conftest.py."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _raw_matrix(B: int, F: int) -> list[list[int]]:
    return [[BOUNDARY_RAW[(b * 3 + f * 7) % len(BOUNDARY_RAW)] for f in range(F)] for b in range(B)]


@pytest.mark.parametrize("B,F", [(1, 1), (3, 4), (127, 4)])
def test_modulus_rows_with_arbitrary_offsets_and_32_bit_cardinalities(device, B, F):
    """Offsets need not start at 0 nor increase (a slice of the tables, any order): row = offsets[f] + (raw + 1) mod
    card[f], with tables of 1, 2**31, 2**32 and 2**32 + 1 rows."""
    from kernels.embedding.hashing import hash_rows

    cards = [2**32, 1, 2**31, 2**32 + 1][:F]
    offsets = [1000, 3, 2**33, 17][:F]
    rows = _raw_matrix(B, F)
    expected = [[offsets[f] + (r[f] + 1) % cards[f] for f in range(F)] for r in rows]
    raw = torch.tensor(rows, dtype=torch.int64)
    card_t, off_t = torch.tensor(cards), torch.tensor(offsets)
    assert modulus_rows(raw, card_t, off_t).tolist() == expected
    got = hash_rows(raw.to(device), card_t.to(device), off_t.to(device))
    assert got.tolist() == expected


@pytest.mark.parametrize("B,F", [(1, 1), (3, 3), (127, 3)])
def test_vocabulary_rows_with_arbitrary_offsets_and_boundary_values(device, B, F):
    """Each vocabulary's first and last value (the binary search's ends), 0xFFFFFFFF as the last value of the whole
    array, 123456789 next to the vocabulary value 123456790 (never its neighbour's row), and 2**31 in feature 1, past
    its last value and equal to the next feature's first: row offsets[f] + 1 + index, else the
    out-of-vocabulary row offsets[f]."""
    from kernels.embedding.hashing import hash_rows

    vocabs = [[-(2**31), 0, 1, 2**31 - 1], [7, 123456789 + 1], [2**31, 2**32 - 2, 0xFFFFFFFF]][:F]
    vocabs = [sorted(v) for v in vocabs]
    offsets = [50, 9, 1][:F]
    rows = _raw_matrix(B, F)
    expected = [[offsets[f] + (vocabs[f].index(r[f]) + 1 if r[f] in vocabs[f] else 0) for f in range(F)] for r in rows]
    raw = torch.tensor(rows, dtype=torch.int64)
    off_t = torch.tensor(offsets)
    keys, voff = keyed_vocabulary([torch.tensor(v, dtype=torch.int64) for v in vocabs])
    assert vocabulary_rows(raw, keys, voff, off_t).tolist() == expected
    cards = torch.tensor([len(v) + 1 for v in vocabs])
    flat = torch.tensor([x for v in vocabs for x in v], dtype=torch.int64)
    got = hash_rows(raw.to(device), cards.to(device), off_t.to(device), flat.to(device), voff.to(device))
    assert got.tolist() == expected
    if B == 127:  # every vocabulary value and the out-of-vocabulary row are hit
        hit = {(f, row[f]) for row in expected for f in range(F)}
        seen = [(f, offsets[f] + i + 1) for f in range(F) for i, v in enumerate(vocabs[f]) if v in BOUNDARY_RAW]
        assert all(x in hit for x in seen)
        assert all((f, offsets[f]) in hit for f in range(F))


@pytest.mark.parametrize("bad", [[5, 2**40], [-(2**33), 7], [2**32]])
def test_a_vocabulary_beyond_32_bit_values_is_refused_naming_its_file_before_the_model(tmp_path, bad):
    """`read_vocabulary` loads any int64 (its own contract), but the hashing's keys hold 32-bit values: a damaged file
    with a larger one was a ValueError traceback ("this is a bug") from `keyed_vocabulary` when the model was built."""
    from dlrm.config import Config
    from dlrm.data.schema import NUM_SPARSE, Metadata
    from dlrm.train.setup import dataset_tables

    cards = [3] * NUM_SPARSE
    cards[4] = len(bad) + 1
    for f in range(NUM_SPARSE):
        _write(tmp_path, np.array(bad if f == 4 else [1, 2], dtype=np.int64), f)
    meta = Metadata(cardinalities=cards, hashing="vocabulary")
    with pytest.raises(DatasetError, match=rf"SPARSE_4.npy: values {min(bad)}..{max(bad)} lie outside \[-2\*\*32"):
        dataset_tables(Config(), meta, tmp_path)
    _write(tmp_path, np.array([-(2**32), 2**32 - 1], dtype=np.int64)[: len(bad)], 4)
    assert dataset_tables(Config(), meta, tmp_path).vocabs[4].tolist()[0] == -(2**32)  # the bounds themselves load
