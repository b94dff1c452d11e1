"""JSON text to typed values for `dlrm.config`: the decoding and conversion half of loading a config.

`parse_config_bytes` turns a file's bytes into a JSON object, and `_build` / `_convert` turn that
object into the config dataclasses, checking every value against its field's type. Every
malformation of the untrusted input is a one-line `ConfigError` naming the key path: bytes that
are not UTF-8, JSON nested too deeply, integers beyond int64 (or Python's int->str limit), floats
not finite in float32, NaN/Infinity literals, strings holding NUL. Nothing here opens a file:
`dlrm.config` stays the only module that reads one, and re-exports these names.

    >>> from dlrm.config_parse import parse_config_bytes
    >>> parse_config_bytes(b'{"data": {"batch_size": 64}}', "x.json")
    {'data': {'batch_size': 64}}
    >>> parse_config_bytes(b"[1]", "x.json")
    Traceback (most recent call last):
    ...
    dlrm.errors.ConfigError: x.json: the top level must be a JSON object
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import struct
import types
import typing
from typing import Any, Literal, Union

from dlrm.errors import ConfigError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
_MAX_INT_TEXT = 40
"""JSON integers with more characters than this are not converted (Python refuses above 4300
digits, and anything this long is out of int64 range anyway)."""


class _HugeInt:
    """Stands in for a JSON integer too long to convert, so the error can name its key."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


def _parse_int(text: str) -> Any:
    """json's parse_int: an int, or a `_HugeInt` for text too long to convert safely."""
    return int(text) if len(text) <= _MAX_INT_TEXT else _HugeInt(text)


def _show(value: Any, limit: int = 80) -> str:
    """repr() of a user-given value for an error message: one line, at most ~`limit` characters,
    and never an exception of its own (huge ints and deep nesting make repr() raise)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_MAX_INT_TEXT:
        return f"<integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # too deep, or holds an int beyond Python's int->str limit
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "an object"
    if tp is bool:
        return "true/false"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against type `tp`; return it (dataclasses built recursively)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {_show(value)}")
        return _build(tp, value, key)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:  # Optional[X]: X's own message is the precise one
            return _convert(value, non_null[0], key)
        for arg in non_null:  # an object goes to the dataclass member, whose message names the inner key
            if isinstance(value, dict) and dataclasses.is_dataclass(arg):
                return _convert(value, arg, key)
        for arg in non_null:
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {_show(value)} is not {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp) or isinstance(value, bool):
            raise ConfigError(f"{key}: {_show(value)} is not one of {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {_show(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        return _convert_int(value, key)
    if tp is float:
        return _convert_float(value, key)
    if tp is str:
        return _convert_str(value, key)
    raise TypeError(f"unsupported config type {tp!r} at {key}")  # a bug in this module, not user input


def _convert_int(value: Any, key: str) -> int:
    """An integer within int64 (every integer ends up in a tensor, a numpy array or a C API)."""
    if isinstance(value, _HugeInt):
        raise ConfigError(f"{key}: {value!r} is out of range (integers must fit in int64)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {_show(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"{key}: {_show(value)} is out of range (integers must fit in int64)")
    return value


def _convert_float(value: Any, key: str) -> float:
    """A number that is finite in float32, the precision every float setting is used in."""
    if isinstance(value, _HugeInt):
        raise ConfigError(f"{key}: {value!r} overflows float32 (|x| must be <= 3.4e38)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise ConfigError(f"{key}: {_show(value)} overflows float32 (|x| must be <= 3.4e38)") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}: {number!r} must be a finite number")
    if abs(number) > FLOAT32_MAX:
        raise ConfigError(f"{key}: {number!r} overflows float32 (|x| must be <= 3.4e38)")
    return number


def _convert_str(value: Any, key: str) -> str:
    """A string that can become a file name or a log line (no NUL, no lone surrogate)."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{key}: {_show(value)} is not valid Unicode text") from None
    if "\0" in value:
        raise ConfigError(f"{key}: {_show(value)} must not contain a NUL character")
    return value


def _as_float32(value: float) -> float:
    """`value` rounded to float32 (the caller has checked it is within float32 range)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        # A key with a newline or other unprintable character is shown quoted, so the error stays one line.
        shown = key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else _show(key)
        path = f"{prefix}.{shown}" if prefix else shown
        if key not in names:
            raise ConfigError(f"{path}: unknown key (expected one of {', '.join(sorted(names))})")
        kwargs[key] = _convert(value, hints[key], path)
    return cls(**kwargs)


class _DuplicateKey(Exception):
    """A JSON object naming one key twice (json.loads would keep the last one and drop the first silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def parse_config_bytes(data: bytes, source: str) -> dict[str, Any]:
    """Decode UTF-8 JSON holding an object; every malformation is a one-line `ConfigError`.

    Integers too long to convert become `_HugeInt` placeholders (rejected by `config_from_dict`
    with their key); NaN and Infinity literals become floats that it rejects the same way.
    """
    # A leading BOM (some Windows editors write one) is harmless. It is cut off here rather than by the "utf-8-sig"
    # codec, whose error offsets count from after the BOM: the byte and column named would be 3 bytes off.
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line} column {column})") from None
    try:
        raw = json.loads(text, parse_int=_parse_int, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except _DuplicateKey as e:
        key = e.args[0]
        shown = repr(key) if key.isprintable() and len(key) <= 80 else _show(key)
        raise ConfigError(f"{source}: key {shown} appears twice in one object (JSON would keep only the last)") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid config: JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    return raw
