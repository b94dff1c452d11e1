"""What to change when a finished run's train or validation split has no rows (`advice`), said by the summary.

The advice must be true for the input at hand: the summary said "give more lines, or a --validation-fraction above
0 with --split random" to a run of --validation-fraction 1e-300, already above 0 (a fraction that drew no line of
100, and that ``--test-fraction 0.05 + 1e-300`` rounds away altogether), and to a run whose train split was empty.
So the advice names the smallest --validation-fraction that draws a line of this input (--split random, whose draw
of every line is known: `random_uniform`), the line count from which --split sequential fills validation, the last
day file's lines (--split days), or the bad lines that took the split's every line.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

import numpy as np

from dlrm.data.preprocess.splits import SplitPlan, random_uniform, sequential_sizes

# --split random: up to this many lines the draws of every line are computed for exact advice; above it, the advice
# is the expected count. Measured 0.7 s a 2**22 lines on a busy 2-core CPU: ~3 s for 2**24, and by extrapolation
# ~13 minutes for Criteo 1TB's 4.4 billion lines, after the run.
_EXACT_MAX_LINES = 1 << 24
_BLOCK = 1 << 20


def advice(split: str, options: dict, total_lines: int, last_file_lines: int) -> str:
    """How to get rows into the empty `split` ("train" or "validation") of a run of `options` (metadata's
    ``extra["options"]``) over `total_lines` lines, the last input holding `last_file_lines`."""
    mode = options["split"]
    if mode == "random":
        return _random(split, options, total_lines)
    if mode == "sequential":
        assigned = sequential_sizes(total_lines)[split]
    else:
        plan = SplitPlan.build("days", [total_lines - last_file_lines, last_file_lines])
        assigned = {"train": total_lines - last_file_lines,
                    "validation": last_file_lines - plan.last_file_test_lines}[split]
    if assigned:
        return _all_bad(assigned)
    if mode == "sequential":  # (train always gets a line of a non-empty input: validation's is the only case)
        need = next(n for n in range(total_lines + 1, total_lines + 15) if sequential_sizes(n)["validation"])
        return (f"--split sequential takes validation from the second half of the input's last seventh, empty for "
                f"{total_lines:,} lines: give {need:,} lines or more, or use --split random")
    if split == "train":
        return "--split days trains on every input file but the last, which hold no line here: give the train days"
    return (f"--split days takes validation from the second half of the last file, whose {last_file_lines:,} "
            "line(s) leave it empty: give a last file of 2 lines or more")


def _all_bad(lines: int) -> str:
    return (f"the split's {lines:,} line(s) were all bad lines, skipped (the summary counts them): fix or replace "
            "them")


def _random(split: str, options: dict, total: int) -> str:
    """--split random: a line goes to test if u < test_fraction, else to validation if u < test_fraction +
    validation_fraction, else to train (`SplitPlan.assign`)."""
    tf, vf = options["test_fraction"], options["validation_fraction"]
    if split == "validation" and vf == 0:
        return "give a --validation-fraction above 0"
    if total > _EXACT_MAX_LINES:  # the expected count of lines: what the fractions promise, without drawing them all
        if split == "validation":
            return (f"--validation-fraction {vf:g} expects {vf * total:.3g} of the {total:,} lines in validation: "
                    f"{_round(1 / total, up=True)} or more expects one")
        return (f"--validation-fraction {vf:g} + --test-fraction {tf:g} leave train an expected "
                f"{(1 - tf - vf) * total:.3g} of the {total:,} lines: give lower fractions")
    lowest, highest, assigned = 1.0, 0.0, 0
    end = tf + vf  # as `SplitPlan.assign` adds them: 0.05 + 1e-300 is 0.05, and no line can fall in between
    for start in range(0, total, _BLOCK):
        u = random_uniform(options["seed"], np.arange(start, min(start + _BLOCK, total), dtype=np.int64))
        inside = (u >= tf) & (u < end) if split == "validation" else u >= end
        assigned += int(inside.sum())
        above = u[u >= tf]
        if above.size:
            lowest = min(lowest, float(above.min()))
        highest = max(highest, float(u.max()))
    if assigned:
        return _all_bad(assigned)
    if split == "train":  # every line drew u < tf + vf: a smaller sum leaves train the line of the highest draw
        return (f"--validation-fraction {vf:g} + --test-fraction {tf:g} leave train no line of these {total:,}: "
                f"give more lines, or fractions that sum to at most {_round(highest, up=False)}")
    if lowest == 1.0:  # every line drew test
        return (f"--test-fraction {tf:g} took every one of the {total:,} lines: give more lines, or a lower "
                "--test-fraction")
    # (at least what tf + v needs to exceed tf at all: a draw u == tf is 2**-53 likely, yet possible)
    needed = max(lowest - tf, math.ulp(tf) if tf else 5e-324)
    smallest = _round(needed, up=True, fits=lambda v: lowest < tf + v and tf + v < 1)
    return (f"--validation-fraction {vf:g} draws none of these {total:,} lines: {smallest} or more draws one "
            "(or give more lines)")


def _round(x: float, up: bool, fits=lambda v: True) -> str:
    """`x` (> 0) rounded up (or down) to the fewest significant digits, 2 or more, whose value `fits` (in decimal: a
    float scale overflows for the smallest fractions)."""
    d = Decimal(x)
    for digits in range(2, 18):
        v = d.quantize(Decimal(1).scaleb(d.adjusted() - digits + 1), rounding=ROUND_CEILING if up else ROUND_FLOOR)
        if fits(float(v)):
            return f"{float(v):.{digits}g}"
    return repr(x)
