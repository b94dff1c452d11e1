"""The "did you mean" of an unknown config key on the command line (found by a QA pass on 2026-12-04): compared whole,
the section a mistyped key shares with every key of its section drove the match, so `sweep --set model.pooling=...`
suggested model.bottom_mlp (nothing alike but "model."), as did train.py's --allow-config-change. The last parts are
compared now, a key of the same section first: something close, or nothing."""

from __future__ import annotations

import pytest

from dlrm.cli import parse_allowed_changes
from dlrm.config import ConfigError
from dlrm.sweep import parse_set


@pytest.mark.parametrize("key, meant", [
    ("model.pooling", None),  # model.bottom_mlp, by the shared "model." alone
    ("optim.dense.learning_rate", None),  # optim.dense.name
    ("model.mlp", "model.top_mlp"),  # kernels.mlp: the same last part, in another section
    ("model.cross_rnk", "model.cross_rank"),
    ("optm.dense.lr", "optim.dense.lr"),  # a typo in the section: the last part finds it, the whole key the section
    ("batch_size", "data.batch_size"),
    ("model.batch_size", "data.batch_size"),  # nothing like it in its own section
    ("modle", "model"),  # a section, not train.compile.mode
])
def test_the_suggestion_compares_the_last_part_within_the_section_first(key, meant):
    from dlrm.config import closest_config_key

    assert closest_config_key(key) == meant


def test_sweep_set_of_an_unknown_key_suggests_something_close_or_nothing():
    with pytest.raises(ConfigError) as raised:
        parse_set("model.pooling=sum,mean")
    assert str(raised.value) == "--set model.pooling: not a config key"
    with pytest.raises(ConfigError, match=r"^--set model\.embeding_dim: not a config key \(did you mean "
                                          r"model\.embedding_dim\?\)$"):
        parse_set("model.embeding_dim=8,16")


def test_train_allow_config_change_suggests_alike():
    with pytest.raises(ConfigError) as raised:
        parse_allowed_changes("model.pooling")
    assert str(raised.value) == ("--allow-config-change: 'model.pooling' is not a config key (e.g. data.batch_size, "
                                 "optim.dense.lr)")
    with pytest.raises(ConfigError, match=r"\(did you mean model\.top_mlp\?\)$"):
        parse_allowed_changes("data.batch_size,model.mlp")
