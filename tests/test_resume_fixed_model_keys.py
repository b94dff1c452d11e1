"""A --resume whose config changes a model key the checkpoint's tensors fix (the MLPs' widths, the embedding dimension,
the interaction, the activation, a DCN's cross network) is refused without advising --allow-config-change for it: that
flag let the key through the resume policy and the checkpoint then failed to load into the other model, a second try
for the same refusal. Keys the flag does allow (a learning rate) are still advised, beside the fixed ones."""

from __future__ import annotations

import pytest

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, config_from_dict
from dlrm.train.resume_policy import check_resume_config


def _refusal(saved: dict, current: dict, allowed=()) -> str:
    with pytest.raises(ConfigError) as e:
        check_resume_config(config_from_dict(saved).to_dict(), config_from_dict(current).to_dict(), allowed, "c.pt")
    return str(e.value)


@pytest.mark.parametrize("saved, current", [
    ({}, {"bottom_mlp": [32, 16]}),
    ({}, {"top_mlp": [32, 1]}),
    ({}, {"activation": "gelu"}),
    ({}, {"interaction": "cat"}),
    ({"bottom_mlp": [32, 16]}, {"bottom_mlp": [32, 8], "embedding_dim": 8}),  # (a dot model's bottom MLP ends at D)
])
def test_a_fixed_model_key_is_not_advised_for_allow_config_change(saved, current):
    text = _refusal({"model": saved}, {"model": current})
    assert "--allow-config-change" not in text, text
    named = text[text.index("values (") + len("values ("):text.index(": fixed by")]
    assert sorted(named.split(", ")) == sorted(f"model.{k}" for k in current), text
    assert text.endswith(": fixed by the checkpoint, whose model loads only into its own architecture; another one is "
                         "a new run, without --resume)"), text


def test_beside_a_fixed_key_the_others_are_still_advised():
    text = _refusal({}, {"model": {"bottom_mlp": [32, 16]}, "optim": {"dense": {"lr": 0.5}}})
    assert ", or pass --allow-config-change optim.dense.lr (model.bottom_mlp: fixed by the checkpoint" in text, text


def test_a_dcn_models_cross_network_is_fixed_and_a_dot_models_unused_cross_keys_are_not():
    dcn = {"model": {"interaction": "dcn", "cross_layers": 3, "cross_rank": 4}}
    for key in ("cross_layers", "cross_rank"):
        changed = {"model": {**dcn["model"], key: 2}}
        text = _refusal(dcn, changed)
        assert "--allow-config-change" not in text and f"(model.{key}: fixed by the checkpoint" in text, text
    # a dot model has no cross network: its cross keys change nothing the checkpoint holds, and the flag lets them be
    text = _refusal({}, {"model": {"cross_rank": 2}})
    assert text.endswith("or pass --allow-config-change model.cross_rank"), text


def test_the_keys_are_those_the_checkpoint_refuses_to_load_into():
    """The policy's fixed keys and the loader's checks are one list (`ckpt.fixed_model_keys`): a key the loader does
    not refuse is still advised for the flag, and one it refuses is not."""
    assert set(ckpt.fixed_model_keys({"interaction": "dot"})) == {
        "embedding_dim", "bottom_mlp", "top_mlp", "interaction", "activation", "top_mlp_input_multiple",
        "bottom_mlp_input_multiple"}
    assert {"cross_layers", "cross_rank"} <= set(ckpt.fixed_model_keys({"interaction": "dcn"}))
