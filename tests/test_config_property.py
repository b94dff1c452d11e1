"""Property: any malformed config (a dict, or a file's bytes) gives a one-line ConfigError naming a key,
never another exception; a config that loads holds only numbers that fit where they go."""

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm.config import Config, ConfigError, config_from_dict, parse_config_bytes
from tests.conftest import REPO

SAMPLE = json.loads((REPO / "configs" / "sample.json").read_text())

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.integers()
    | st.integers(4301, 5000).map(lambda n: -(10**n) if n % 2 else 10**n)  # beyond Python's int->str limit
    | st.floats(allow_nan=True) | st.text(max_size=8),
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


# --- whole files: random bytes, random JSON documents, sample configs with hostile values ------



def assert_in_range(node, key=""):
    """Every number a loaded Config holds fits where it goes: ints in int64, floats finite in float32."""
    if isinstance(node, dict):
        for k, v in node.items():
            assert_in_range(v, f"{key}.{k}" if key else k)
    elif isinstance(node, list):
        for v in node:
            assert_in_range(v, key)
    elif isinstance(node, float):
        assert math.isfinite(node) and abs(node) <= 3.4028234663852886e38, (key, node)
    elif isinstance(node, int) and not isinstance(node, bool):
        assert -(2**63) <= node < 2**63, (key, node)


def load_bytes(data: bytes) -> None:
    """Parse and build a config from a file's bytes; only Config or a one-line ConfigError may come out."""
    try:
        cfg = config_from_dict(parse_config_bytes(data, "c.json"), "c.json")
    except ConfigError as e:
        message = str(e)
        assert message.startswith("c.json: ") and "\n" not in message, message
        return
    assert isinstance(cfg, Config)
    assert_in_range(cfg.to_dict())
    assert cfg.train.seed >= 0


# JSON text tokens a careless or hostile user writes: numbers beyond int64, float32 and Python's
# str->int limit, non-finite literals, strings with NUL or lone surrogates, deep nesting.
hostile_tokens = st.one_of(
    st.sampled_from(["null", "true", "false", "NaN", "Infinity", "-Infinity", "1e39", "-1e39", "1e400", "1e-50",
                     "-0.0", "0", "-1", "9223372036854775807", "9223372036854775808", "-9223372036854775809",
                     "2147483648", '""', '"\\u0000"', '"\\ud800"', '"cat"', '"dot"', "[]", "{}", "[16]", "[64, 8]"]),
    st.integers(1, 6000).map(lambda n: "9" * n),
    st.sampled_from([10, 1000, 100_000]).map(lambda n: "[" * n + "]" * n),
    st.sampled_from([10, 1000, 100_000]).map(lambda n: '{"a": ' * n + "1" + "}" * n),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=8).map(json.dumps),
)


@st.composite
def hostile_config_texts(draw):
    """configs/sample.json with 1-3 keys (existing or new, at any depth) set to hostile tokens."""
    raw = json.loads(json.dumps(SAMPLE))
    raw.setdefault("model", {}).setdefault("interaction", "dot")
    paths = [p for p in leaf_paths(raw) if p] + [("train", "seed"), ("model", "embedding_dim"),
                                                 ("optim", "dense", "lr"), ("optim", "sparse", "eps")]
    tokens = {}
    for i in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        node = raw
        for k in path[:-1]:
            node = node.setdefault(k, {}) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                break
        if isinstance(node, dict):
            node[path[-1]] = f"@@{i}@@"
            tokens[f'"@@{i}@@"'] = draw(hostile_tokens)
    text = json.dumps(raw)
    for placeholder, token in tokens.items():
        text = text.replace(placeholder, token)
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_config_texts())
def test_hostile_values_at_random_keys_give_config_or_config_error(data):
    load_bytes(data)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64) | st.binary(max_size=8).map(lambda b: b'{"name": "' + b + b'"}'))
def test_random_bytes_give_config_or_config_error(data):
    load_bytes(data)


json_documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from([*SAMPLE, "train", "optim", "dense", "seed", "lr", "eps", "x"]) | st.text(max_size=6),
                      children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(json_documents)
def test_random_json_documents_give_config_or_config_error(document):
    load_bytes(json.dumps(document).encode())
