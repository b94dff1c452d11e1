"""Splits: which of train / validation / test every line goes to, from its global line number."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlrm.data.preprocess.constants import _M64, _SPLIT_CODE, _U


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer of uint64 values (wrapping arithmetic)."""
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def random_uniform(seed: int, index: np.ndarray) -> np.ndarray:
    """Counter-based uniforms in [0, 1): a pure function of (seed, index) (splitmix64 twice)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & _M64], dtype=np.uint64))[0]
        x = _splitmix64(_splitmix64(index.astype(np.uint64) ^ key))
    return (x >> _U(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SplitPlan:
    """Which split every line goes to, from its global line number (0-based over all inputs).

    sequential (Kaggle, as facebookresearch/dlrm): the lines are cut into 7 parts like
        ``np.array_split(range(T), 7)``; parts 0-5 are train, the first half of part 6
        (rounded up) is test, the rest validation.
    days (Terabyte): every file but the last is train; the last file's first half (rounded up)
        is test, the rest validation.
    random: line g goes to test if u(seed, g) < test_fraction, else to validation if
        u < test_fraction + validation_fraction, else to train.
    """

    mode: str
    total_lines: int
    train_end: int = 0  # sequential: [0, train_end) train
    test_end: int = 0  # sequential: [train_end, test_end) test, the rest validation
    last_file: int = 0  # days
    last_file_test_lines: int = 0  # days
    seed: int = 0
    validation_fraction: float = 0.0
    test_fraction: float = 0.0

    @staticmethod
    def build(mode: str, file_lines: list[int], *, seed: int = 0, validation_fraction: float = 0.0,
              test_fraction: float = 0.0) -> SplitPlan:
        """The plan for ``mode`` over files of ``file_lines`` lines."""
        total = sum(file_lines)
        if mode == "sequential":
            per, extra = divmod(total, 7)
            train_end = 6 * per + min(extra, 6)
            last = total - train_end
            return SplitPlan(mode, total, train_end=train_end, test_end=train_end + (last + 1) // 2)
        if mode == "days":
            n_last = file_lines[-1]
            return SplitPlan(mode, total, last_file=len(file_lines) - 1, last_file_test_lines=(n_last + 1) // 2)
        if mode == "random":
            return SplitPlan(mode, total, seed=seed, validation_fraction=validation_fraction,
                             test_fraction=test_fraction)
        raise ValueError(f"unknown split {mode!r}")

    def assign(self, global_index: np.ndarray, file_index: int, local_index: np.ndarray) -> np.ndarray:
        """Split codes (0 train, 1 validation, 2 test; the order of `SPLITS`) of the given lines."""
        out = np.zeros(global_index.shape[0], dtype=np.int8)
        tr, va, te = (_SPLIT_CODE[s] for s in ("train", "validation", "test"))
        if self.mode == "sequential":
            out[:] = tr
            out[global_index >= self.train_end] = te
            out[global_index >= self.test_end] = va
        elif self.mode == "days":
            out[:] = tr
            if file_index == self.last_file:
                out[:] = va
                out[local_index < self.last_file_test_lines] = te
        else:
            u = random_uniform(self.seed, global_index)
            out[:] = tr
            out[u < self.test_fraction + self.validation_fraction] = va
            out[u < self.test_fraction] = te
        return out

    def describe(self, separators: bool = False) -> str:
        """The rule in one line: kept in ``metadata.extra["split_rule"]`` with plain integers, and logged with
        thousands separators (``separators``), as the log's other numbers are. The record keeps plain ones: a comma
        inside a number would make ``[8,572, 9,286)`` ambiguous to a script reading the interval, and datasets made
        before and after this change record the same text."""
        n = (lambda v: f"{v:,}") if separators else str
        if self.mode == "sequential":
            return (f"sequential over {n(self.total_lines)} lines: [0, {n(self.train_end)}) train, "
                    f"[{n(self.train_end)}, {n(self.test_end)}) test, [{n(self.test_end)}, {n(self.total_lines)}) "
                    "validation")
        if self.mode == "days":
            return (f"days: files 0..{self.last_file - 1} train; file {self.last_file}: first "
                    f"{n(self.last_file_test_lines)} lines test, the rest validation")
        return (f"random (seed {self.seed}): test if u < {self.test_fraction:.12g}, validation if u < "
                f"{self.test_fraction + self.validation_fraction:.12g}, else train; u = splitmix64(seed, line)")


def sequential_sizes(total: int) -> dict[str, int]:
    """Lines per split that ``--split sequential`` gives `total` lines, in the order it cuts them: train, test, then
    validation (also the synthetic small-real regime's split, whose rows are written in this order)."""
    plan = SplitPlan.build("sequential", [total])
    return {"train": plan.train_end, "test": plan.test_end - plan.train_end, "validation": total - plan.test_end}
