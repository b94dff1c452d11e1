"""Audit tests of `dlrm.config_checks`: boundaries and key names the other config tests leave open (each found by a
mutation that the rest of the suite let through)."""

from __future__ import annotations

import pytest

from dlrm.config import ConfigError, config_from_dict
from dlrm.config_checks import MAX_SIZE
from dlrm.data.schema import MAX_MULTI_HOT_SIZE, NUM_SPARSE

REFUSED = [
    ({"train": {"early_stopping": {"patience": 2}}}, r"^x\.json: train\.early_stopping: needs train\.eval_every"),
    ({"train": {"eval_every": 10, "early_stopping": {"min_delta": -0.5}}},
     r"^x\.json: train\.early_stopping\.min_delta: -0\.5 must be >= 0$"),
    ({"log": {"run_name": "."}}, r"^x\.json: log\.run_name: '\.' must be a plain directory name$"),
    ({"log": {"run_name": ".."}}, r"^x\.json: log\.run_name: '\.\.' must be a plain directory name$"),
    ({"profile": {"active": 0}}, r"^x\.json: profile\.active: 0 must be > 0$"),
    ({"model": {"multi_hot_sizes": [1] * 25 + [MAX_MULTI_HOT_SIZE + 1]}},
     rf"^x\.json: model\.multi_hot_sizes\[25\]: {MAX_MULTI_HOT_SIZE + 1} must be <= {MAX_MULTI_HOT_SIZE}$"),
    ({"data": {"eval_batch_size": 0}}, r"^x\.json: data\.eval_batch_size: 0 must be > 0$"),
    ({"checkpoint": {"keep": 0}}, r"^x\.json: checkpoint\.keep: 0 must be > 0$"),
    ({"name": "a/b"}, r"^x\.json: name: 'a/b' must be a non-empty name without '/'$"),
    ({"name": ""}, r"^x\.json: name: '' must be a non-empty name without '/'$"),
    ({"model": {"cardinalities": [3] * 27}}, r"^x\.json: model\.cardinalities: has 27 entries, expected 26$"),
    ({"optim": {"schedule": {"decay_steps": -1}}}, r"^x\.json: optim\.schedule\.decay_steps: -1 must be >= 0$"),
    ({"optim": {"sparse": {"weight_decay": -0.1}}}, r"^x\.json: optim\.sparse\.weight_decay: -0\.1 must be >= 0$"),
    ({"data": {"shuffle_buffer_rows": 0}}, r"^x\.json: data\.shuffle_buffer_rows: 0 must be > 0$"),
    ({"train": {"min_steps": 0}}, r"^x\.json: train\.min_steps: 0 must be > 0$"),
    ({"model": {"interaction": "dot"}, "kernels": {"interaction": "gluon"}},
     r"^x\.json: kernels\.interaction: \"gluon\" is the DCN cross layer's, not 'dot''s$"),
]


@pytest.mark.parametrize("raw, pattern", REFUSED)
def test_bad_values_are_refused_naming_their_key(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(raw, "x.json")


def test_the_bounds_themselves_are_accepted():
    """Inclusive limits: the largest size, an end factor of 0, a share of 1, the largest multi-hot size."""
    cfg = config_from_dict({
        "data": {"batch_size": MAX_SIZE, "gpu_memory_share": 1.0},
        "optim": {"schedule": {"end_factor": 0.0}},
        "model": {"multi_hot_sizes": [1] * (NUM_SPARSE - 1) + [MAX_MULTI_HOT_SIZE]},
        "train": {"eval_every": 5, "early_stopping": {"min_delta": 0.0}},
    })
    assert cfg.data.batch_size == MAX_SIZE and cfg.data.gpu_memory_share == 1.0
    assert cfg.optim.schedule.end_factor == 0.0 and cfg.model.multi_hot_sizes[-1] == MAX_MULTI_HOT_SIZE
