"""Property: any malformed config gives a one-line ConfigError naming a key, never another exception."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm.config import ConfigError, config_from_dict
from tests.conftest import REPO

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=8,
)


def leaf_paths(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from leaf_paths(v, prefix + (k,))
    yield prefix


@st.composite
def mutated_configs(draw):
    raw = json.loads(json.dumps(SAMPLE))
    paths = [p for p in leaf_paths(raw) if p]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        node = raw
        for k in path[:-1]:
            # an earlier mutation may have replaced a parent with a non-dict value
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        if draw(st.booleans()):
            node[path[-1]] = draw(json_values)
        else:
            node[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return raw, paths


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_configs())
def test_malformed_configs_fail_cleanly(case):
    raw, paths = case
    try:
        config_from_dict(raw, "c.json")
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message
        assert message.startswith("c.json: ")
        # the message names a key path that starts at one of the config's top-level keys
        # (keys may themselves contain ':' or '.', so match by prefix rather than by splitting)
        named = message[len("c.json: "):]
        # (an unprintable key is shown quoted, as repr() writes it)
        assert any(named.startswith(top) or named.startswith(repr(top)) for top in [*raw, "<root>"] if top), message
    # any other exception type propagates and fails the test
