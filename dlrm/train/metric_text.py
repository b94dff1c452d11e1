"""An AUC as a person reads it: a one-class split's AUC is undefined (NaN in the metrics, null in summary.json), and
its log lines and reports say "n/a (one class)" where they said "nan" (and "+nan" for a margin). No torch here: the
sweep's command line uses it."""

from __future__ import annotations

import math
from typing import Any, Optional

UNDEFINED_AUC = "n/a (one class)"
"""A one-class split's AUC, as the log lines and reports write it."""


def auc_undefined(auc: Optional[float]) -> bool:
    """Whether an AUC is undefined: NaN (a one-class split, or NaN scores), or null as summary.json writes NaN."""
    return auc is None or (isinstance(auc, float) and math.isnan(auc))


def auc_text(metrics: dict[str, Any], key: str = "auc") -> str:
    """``metrics[key]`` (an AUC) for a log line or report: 4 decimals, or why there is none.

    A NaN (null) AUC with a finite logloss is a one-class split's (finite scores always give a finite logloss; a
    NaN score makes both NaN).

        >>> auc_text({"auc": 0.81234, "logloss": 0.4}), auc_text({"auc": float("nan"), "logloss": 0.4})
        ('0.8123', 'n/a (one class)')
        >>> auc_text({"auc": None, "logloss": None})
        'n/a (NaN scores)'
    """
    auc = metrics.get(key)
    if not auc_undefined(auc):
        return f"{auc:.4f}"
    logloss = metrics.get("logloss")
    return UNDEFINED_AUC if isinstance(logloss, (int, float)) and math.isfinite(logloss) else "n/a (NaN scores)"


def auc_gain_text(auc: Optional[float], other: Optional[float]) -> str:
    """``auc - other`` signed (4 decimals), or "n/a" when either is undefined (not "+nan")."""
    return "n/a" if auc_undefined(auc) or auc_undefined(other) else f"{auc - other:+.4f}"


def csv_cell(value: Any) -> Any:
    """`value` for a CSV cell the app writes (sweep.csv, trials.csv, compare.csv): a missing value (None) and an
    undefined one (NaN, infinite: a one-class split's AUC) are an empty cell, as summary.json writes them null. A
    trial gathered by ``sweep --resume`` read null back from summary.json and wrote an empty cell, one trained in the
    session its NaN as "nan": one column, two spellings of one value, and the tables of a resumed sweep differed
    from those of the same sweep uninterrupted.

        >>> [csv_cell(v) for v in (0.5, float("nan"), None, "ok", 3)]
        [0.5, None, None, 'ok', 3]
    """
    return None if isinstance(value, float) and not math.isfinite(value) else value
