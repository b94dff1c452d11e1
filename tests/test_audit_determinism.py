"""Reproducibility audit (CPU): seeds that silently stand for other seeds.

1. ``python -m dlrm.preprocess --split random --seed S`` keys its per-line hash with the seed's low 64 bits
   (`dlrm.data.preprocess.splits.random_uniform`): ``--seed 18446744073709551616`` (2**64) split every line as
   ``--seed 0`` did, ``-1`` as ``2**64 - 1``, while the metadata named the seed as typed. Such a seed is refused in one
   line now, before anything is written.
"""

from __future__ import annotations

import pytest

import dlrm.data.preprocess as pp
from tests.test_preprocess import FAST, error_lines, make_fields, run_cli, write_raw


@pytest.mark.parametrize("seed", [2**64, -1])
def test_preprocess_refuses_a_random_split_seed_outside_64_bits(tmp_path, seed):
    src = write_raw(tmp_path / "a.tsv", make_fields(60, seed=3))
    with pytest.raises(pp.PreprocessError, match=r"^--seed: .* must be"):
        pp.preprocess([src], tmp_path / "ds", split="random", seed=seed, **FAST)
    assert not (tmp_path / "ds").exists()  # refused before anything was written
    result = run_cli(["-i", str(src), "-o", str(tmp_path / "cli"), "--split", "random", "--seed", str(seed)])
    lines = error_lines(result)
    assert result.exit_code == 2 and len(lines) == 1 and "--seed" in lines[0] and str(seed) in lines[0], result.output
    assert not (tmp_path / "cli").exists()


def test_preprocess_seeds_at_the_ends_of_the_range_still_split(tmp_path):
    """0 and 2**64 - 1 are taken (the range the hash keys), and split differently."""
    src = write_raw(tmp_path / "a.tsv", make_fields(400, seed=4))
    rows = {}
    for seed in (0, 2**64 - 1):
        meta = pp.preprocess([src], tmp_path / f"s{seed}", split="random", seed=seed, validation_fraction=0.3,
                             test_fraction=0.2, **FAST)
        rows[seed] = {s: i.rows for s, i in meta.splits.items()}
        assert meta.extra["options"]["seed"] == seed
    assert sum(rows[0].values()) == sum(rows[2**64 - 1].values()) == 400
