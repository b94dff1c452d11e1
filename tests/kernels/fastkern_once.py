"""Results computed once per test process and shared by the parametrizations that need the same one.

Several kernel tests compare each of a few variants (a cache hint, a row-load order, a register cap) against one
reference run of the same update on the same inputs; under the CPU interpreter that run was repeated for every
variant. `once` keys the result by what determines it (the caller names every input in the key) and hands the
same tensors to each variant; the callers only read them.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

_RESULTS: dict[Hashable, Any] = {}


def once(key: Hashable, run: Callable[[], Any]) -> Any:
    """`run()`'s result, computed the first time `key` is asked for in this process."""
    if key not in _RESULTS:
        _RESULTS[key] = run()
    return _RESULTS[key]
