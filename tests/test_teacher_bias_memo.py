"""The teacher's tuned bias is kept per process (`dlrm.data.teacher._TUNED_BIAS`): a dataset made with the kept bias
is the one a fresh tuning makes, byte for byte."""

from pathlib import Path

import pytest

from dlrm.data import synthetic, teacher
from dlrm.data.teacher import Teacher


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("seed, cards, sizes, fill", [
    (0, synthetic.CARDINALITY_PRESETS["tiny"], None, "fixed"),
    (3, synthetic.CARDINALITY_PRESETS["tiny"], None, "fixed"),
    (7, synthetic.CARDINALITY_PRESETS["tiny"], [3, 1, 2] + [1] * 23, "variable"),
])
def test_a_kept_bias_is_the_bias_tuned_afresh(monkeypatch, seed, cards, sizes, fill):
    monkeypatch.setattr(teacher, "_TUNED_BIAS", {})
    first = Teacher(seed, cards, multi_hot_sizes=sizes, multi_hot_fill=fill)
    assert len(teacher._TUNED_BIAS) == 1
    kept = Teacher(seed, list(cards), multi_hot_sizes=sizes, multi_hot_fill=fill)
    afresh = Teacher(seed, cards, bias=0.0, multi_hot_sizes=sizes, multi_hot_fill=fill)._tune_bias()  # as __init__ does
    assert kept.bias == first.bias == afresh  # the bisection again, bit for bit
    assert len(teacher._TUNED_BIAS) == 1  # the second teacher did not tune


def test_other_seeds_cardinalities_and_sizes_are_tuned_apart(monkeypatch):
    monkeypatch.setattr(teacher, "_TUNED_BIAS", {})
    tiny = synthetic.CARDINALITY_PRESETS["tiny"]
    biases = {Teacher(0, tiny).bias, Teacher(1, tiny).bias, Teacher(0, [c + 1 for c in tiny]).bias}
    assert len(teacher._TUNED_BIAS) == 3 and len(biases) == 3


def test_a_subclass_is_tuned_with_its_own_logits(monkeypatch):
    monkeypatch.setattr(teacher, "_TUNED_BIAS", {})

    class Shifted(Teacher):
        def logit(self, dense, ids):
            return super().logit(dense, ids) + 1.0

    tiny = synthetic.CARDINALITY_PRESETS["tiny"]
    assert Shifted(0, tiny).bias == pytest.approx(Teacher(0, tiny).bias - 1.0, abs=1e-9)


@pytest.mark.parametrize("rows, seed", [(300, 0), (1000, 5)])
def test_a_dataset_made_with_a_kept_bias_is_the_same_bytes(tmp_path, monkeypatch, rows, seed):
    monkeypatch.setattr(teacher, "_TUNED_BIAS", {})
    synthetic.generate(tmp_path / "ds", rows, seed=seed, cardinalities="tiny")
    assert len(teacher._TUNED_BIAS) == 1
    (tmp_path / "ds").rename(tmp_path / "fresh")  # the same --out for both (metadata.json records the command)
    synthetic.generate(tmp_path / "ds", rows, seed=seed, cardinalities="tiny")
    assert len(teacher._TUNED_BIAS) == 1  # the second dataset's teacher did not tune
    fresh, kept = _files(tmp_path / "fresh"), _files(tmp_path / "ds")
    assert fresh.keys() == kept.keys() and len(fresh) > 1
    assert [name for name in fresh if fresh[name] != kept[name]] == []
