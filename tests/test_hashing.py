import pytest
import torch

from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows


def test_modulus_rows_by_hand():
    raw = torch.tensor([[-1, 0, 2**32 - 1], [6, 9, 2**31]], dtype=torch.int64)
    cards = torch.tensor([7, 10, 3])
    offsets = torch.tensor([0, 7, 17])
    expected = torch.tensor([
        [0 + 0, 7 + 1, 17 + (2**32) % 3],
        [0 + 0, 7 + 0, 17 + (2**31 + 1) % 3],
    ])
    assert torch.equal(modulus_rows(raw, cards, offsets), expected)


def test_modulus_rows_stay_in_their_table():
    raw = torch.randint(-1, 2**32, (500, 4))
    cards = torch.tensor([1, 2, 1000, 99991])
    offsets = torch.cumsum(cards, 0) - cards
    rows = modulus_rows(raw, cards, offsets)
    assert ((rows >= offsets) & (rows < offsets + cards)).all()


def test_vocabulary_rows_seen_distinct_unseen_oov():
    vocabs = [torch.tensor([5, 17, 2**32 - 1]), torch.tensor([], dtype=torch.int64), torch.tensor([-5, 0, 3, 17])]
    keys, voff = keyed_vocabulary(vocabs)
    cards = torch.tensor([4, 1, 5])
    offsets = torch.cumsum(cards, 0) - cards  # [0, 4, 5]
    raw = torch.tensor([
        [5, 5, 0],          # feature 1 has an empty vocabulary: everything is OOV
        [17, 17, 17],
        [2**32 - 1, -1, 3],
        [-1, 0, -1],        # missing -> OOV rows
        [6, 3, 4],          # unseen values -> OOV rows
    ])
    expected = torch.tensor([
        [0 + 1, 4, 5 + 2],
        [0 + 2, 4, 5 + 4],
        [0 + 3, 4, 5 + 3],
        [0, 4, 5],
        [0, 4, 5],
    ])
    assert torch.equal(vocabulary_rows(raw, keys, voff, offsets), expected)


def test_vocabulary_rows_exact_for_values_outside_32_bits():
    """Keys are value + feature * 2**33: a raw value 2**33 away from another feature's vocabulary value
    has that value's key. It must still be out of vocabulary (and never land in another table)."""
    vocabs = [torch.tensor([0, 5]), torch.tensor([5]), torch.tensor([5, 9])]
    keys, voff = keyed_vocabulary(vocabs)
    cards = torch.tensor([3, 2, 3])
    offsets = torch.cumsum(cards, 0) - cards  # [0, 3, 5]
    raw = torch.tensor([
        [2**33 + 5, -(2**33) + 5, -(2**33) + 5],  # the keys of feature 1's / feature 0's / feature 1's 5
        [2 * 2**33 + 5, 2**33 + 9, 2**40],
        [2**63 - 1, -(2**63), 2**63 - 1],  # keyed values wrap around
        [5, 5, 9],  # in vocabulary
    ])
    expected = torch.tensor([[0, 3, 5], [0, 3, 5], [0, 3, 5], [0 + 2, 3 + 1, 5 + 2]])
    assert torch.equal(vocabulary_rows(raw, keys, voff, offsets), expected)


def test_keyed_vocabulary_refuses_values_beyond_32_bits():
    keyed_vocabulary([torch.tensor([-(2**32), 2**32 - 1])])  # the limits themselves are fine
    with pytest.raises(ValueError, match="feature 1"):
        keyed_vocabulary([torch.tensor([1]), torch.tensor([0, 2**32])])
    with pytest.raises(ValueError, match="feature 0"):
        keyed_vocabulary([torch.tensor([-(2**32) - 1])])


def test_vocabularies_at_both_ends_of_the_range_stay_apart():
    """Adjacent features whose vocabularies reach both limits, -2**32 and 2**32 - 1: their keys must not interleave
    (one sorted array), and every value finds its own row in its own table."""
    limits = [-(2**32), -1, 0, 2**32 - 1]
    vocabs = [torch.tensor(limits), torch.tensor(limits[:1] + [7] + limits[3:]), torch.tensor(limits)]
    keys, voff = keyed_vocabulary(vocabs)
    assert bool((keys[1:] > keys[:-1]).all())
    cards = torch.tensor([len(v) + 1 for v in vocabs])
    offsets = torch.cumsum(cards, 0) - cards
    for f, vocab in enumerate(vocabs):
        raw = torch.full((len(vocab), len(vocabs)), 12345, dtype=torch.int64)  # 12345: in no vocabulary
        raw[:, f] = vocab
        rows = vocabulary_rows(raw, keys, voff, offsets)
        assert torch.equal(rows[:, f], offsets[f] + 1 + torch.arange(len(vocab)))
        others = [g for g in range(len(vocabs)) if g != f]
        assert torch.equal(rows[:, others], offsets[others].expand(len(vocab), -1))  # out of vocabulary
