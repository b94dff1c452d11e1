"""``--min-frequency auto``: the vocabulary's frequency threshold, picked from the train split's size.

With vocabulary hashing a value gets its own embedding row only when train holds it at least
``min_frequency`` times; rarer values share the table's out-of-vocabulary row. On small click logs
most values are rare (three quarters of the distinct values of a 10,000-line Criteo sample occur
once), and a row trained on one or two lines memorizes them: the DLRM overfits within an epoch.

The rule (`auto_min_frequency`): ``clip(round(AUTO_SCALE * train_rows ** AUTO_POWER), AUTO_MIN, AUTO_MAX)``,
see the constants for the measurements behind it. The train split's size is known after the count
pass, before any chunk is parsed (`train_rows_of_plan`): exact for the sequential and days splits,
the expected count for the random one (its lines are drawn per line).
"""

from __future__ import annotations

from dlrm.data.preprocess.splits import SplitPlan

AUTO = "auto"
AUTO_MIN, AUTO_MAX = 2, 50
AUTO_SCALE, AUTO_POWER = 0.15, 0.5
"""Measured on the small-real synthetic regime (`dlrm.data.synthetic`, raw TSV preprocessed with
``--split sequential --hashing vocabulary``), the DLRM of configs/criteo-small.json (3 epochs, 2-3
seeds): validation AUC by threshold 5 / 10 / 20 / 40 was 0.753 / 0.761 / 0.760 / 0.754 at 8,572 train
rows and 0.789 / 0.796 / 0.802 / 0.804 at 85,714: the best threshold grows about like the square
root of the train rows (0.15 * sqrt gives 14 and 44). Below 2 nothing is thresholded; above 50 (more
than about 110,000 train rows) the rule was not measured, so it stops growing there."""


def auto_min_frequency(train_rows: int) -> int:
    """The threshold "auto" picks for a train split of `train_rows` rows.

    Example:
        >>> [auto_min_frequency(n) for n in (86, 8_572, 85_714, 39_291_958)]
        [2, 14, 44, 50]
    """
    return int(min(max(round(AUTO_SCALE * max(train_rows, 0) ** AUTO_POWER), AUTO_MIN), AUTO_MAX))


def describe_rule() -> str:
    """The rule in words (logged with the value it gave, kept in the metadata)."""
    return f"clip(round({AUTO_SCALE:g} * sqrt(train rows)), {AUTO_MIN}, {AUTO_MAX})"


def train_rows_of_plan(plan: SplitPlan, file_lines: list[int]) -> int:
    """Rows the train split will get from `plan` over files of `file_lines` lines (bad lines included:
    the count pass does not parse; the expected count for a random split)."""
    if plan.mode == "sequential":
        return plan.train_end
    if plan.mode == "days":
        return sum(file_lines[: plan.last_file])
    return round(plan.total_lines * (1.0 - plan.validation_fraction - plan.test_fraction))
