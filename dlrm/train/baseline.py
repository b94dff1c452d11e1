"""The built-in baseline: an L2-regularized logistic regression on the run's own split, loader and hashing.

A DLRM that does not beat a linear model on its data is not learning what the data hold (issue #21:
on a 10,000-line real Criteo sample kaggle.json reached validation AUC 0.704 where a logistic
regression reached 0.757). So every run can fit one next to it, cheaply, and report both:

    logit = bias + sum_j v_j * dense_j + sum_f w[row_f(raw_f)]

where ``dense_j`` is the DLRM's own dense input: ``log1p(max(count_j, 0))``, or a float dataset's value.

``row_f`` is the run's own hashing (modulus or vocabulary, the same table layout as the DLRM's
embedding, `dlrm.model.hashing`), so the model is "one-hot of every embedding row" and a DLRM
whose embeddings were one wide and whose MLPs were absent would compute the same function. The
rows come from the same parquet loader (train split in file order, every row, nothing dropped);
the weights are fitted by full-batch L-BFGS, diagonally preconditioned (`fit`), to the optimum of

    mean BCE(logit, label) + l2 / 2 * (|w|^2 + |v|^2),     l2 = 1 / train_rows by default

which is scikit-learn's ``LogisticRegression()`` objective with its defaults (C = 1 on the summed loss, no feature
scaling; fitted to convergence, where scikit-learn's max_iter 100 of plain lbfgs stops short): the linear model
one would fit first. Embedding rows that no train row uses have weight 0 (L2's optimum), so only the rows train
touches are parameters: the data held is about 300 bytes per train row plus 8 per distinct row (the fit's
peak is more: 4.0 GiB, ~2.2 KB a row, measured on an H100, below).

When (``train.baseline``): true, false, or "auto" = on when the run is one process and its train
split is small enough for the fit to be cheap next to the training (`AUTO_MAX_TRAIN_ROWS`): at most
2,000,000 rows on CUDA, 20,000 on the CPU (rows of 26 sparse values: a multi-hot split may hold as many values,
``rows x sum(multi_hot_sizes)``), where one L-BFGS iteration costs about 1.2 us a train
row (measured on a 2-core CPU: 22 s for 100 iterations over data/sample's 180,000 rows, 0.23 s
over 8,572; on one H100, 19-25 s and 4.0 GiB for 1,900,000 rows). Those were measured for 100 iterations, before
the fit ran to convergence (up to `MAX_ITERATIONS` = 200): data/sample's now converges in 172 iterations, 187
evaluations of the loss where its 100 took 114, so about 1.6 times as long.

Its log line says whether the fit converged, and puts its logloss next to two references: the evaluation
split's logloss of a constant prediction of the train click rate, and the fit's own train logloss. With few train
rows for its weights (C = 1, ~2,300 weights on 1,600 train rows) the optimum overfits: its evaluation logloss can be worse
than the constant's (it read 0.6931 = ln 2 by chance on one such split, AUC 0.643), which the line then says.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from loguru import logger

from dlrm.data.loader import Batch, ParquetLoader, split_files
from dlrm.data.schema import NUM_SPARSE, PAD_SPARSE
from dlrm.errors import is_out_of_memory
from dlrm.logging_setup import ProgressBar, bar_interval
from dlrm.model.hashing import keyed_vocabulary, modulus_rows, vocabulary_rows
from dlrm.train.metric_text import auc_gain_text, auc_text, auc_undefined
from dlrm.train.metrics import evaluate_logits, log_loss
from kernels.table_layout import layout_tensors

AUTO_MAX_TRAIN_ROWS = {"cuda": 2_000_000, "cpu": 20_000}
"""``train.baseline: "auto"`` fits the baseline when the train split has at most this many rows (per device type) of
26 sparse values; a multi-hot split at most as many values (`baseline_wanted`)."""
LOADER_BATCH = 65_536
"""Rows per batch when reading the splits for the baseline (any size gives the same rows)."""
MAX_ITERATIONS = 200
"""L-BFGS iterations at most. Preconditioned (`fit`), fits converged in 101-200 iterations on data/sample (172), real
and synthetic splits of 165-8,572 train rows (tiny, small-real's vocabulary and modulus twins); where measured (six
of them) they were within 2e-6 of the optimum's objective at 100, scikit-learn's default max_iter, which the
unpreconditioned fit had: it stopped 2e-3 above the optimum on data/sample, 1.3e-3 on a small-real modulus split."""
FIT_BAR_DELAY_S = 5.0
"""The fit's progress bar (L-BFGS iterations) shows once the fit has run this long, as the evaluation's does: 100
iterations on 1,900,000 train rows took 19-25 s on one H100 (README), and the fit said nothing until it ended."""
TOLERANCE_CHANGE = 1e-10
"""L-BFGS stops when an iteration changes the objective, or moves every weight, by less than this."""


def baseline_wanted(setting: Union[bool, str], train_rows: int, world_size: int, device_type: str,
                    sparse_width: int = NUM_SPARSE) -> tuple[bool, str]:
    """Whether a run fits the baseline, and why (for the log).

    Args:
        setting: ``train.baseline`` (True, False or "auto").
        train_rows: rows of the train split.
        world_size: processes of the run (the baseline is fitted in one process only).
        device_type: "cuda" or "cpu" (the "auto" limit depends on it).
        sparse_width: sparse values a row holds (`Metadata.sparse_width`: 26 one-hot, ``sum(multi_hot_sizes)``
            multi-hot). The fit holds and gathers one weight a value, so "auto" budgets the values read: the limit's
            rows of 26 values. (By rows alone a multi-hot split of MLPerf's 214 values a row was fitted up to the
            limit's rows, 8.2 times the data the limit was measured for.)

    Example:
        >>> baseline_wanted("auto", 8_572, 1, "cpu")
        (True, 'train.baseline "auto": 8,572 train rows <= 20,000 on cpu')
        >>> baseline_wanted("auto", 8_572, 1, "cpu", sparse_width=214)[0]
        False
    """
    if setting is False:
        return False, "train.baseline is false"
    if world_size > 1:
        return False, f"train.baseline: skipped in a distributed run ({world_size} processes; fit it in one)"
    if setting is True:
        return True, "train.baseline is true"
    limit = AUTO_MAX_TRAIN_ROWS.get(device_type, AUTO_MAX_TRAIN_ROWS["cpu"])
    if sparse_width == NUM_SPARSE:
        if train_rows <= limit:
            return True, f'train.baseline "auto": {train_rows:,} train rows <= {limit:,} on {device_type}'
        return False, f'train.baseline "auto": {train_rows:,} train rows > {limit:,} on {device_type} (true fits it anyway)'
    values, budget = train_rows * sparse_width, limit * NUM_SPARSE
    said = (f'train.baseline "auto": {train_rows:,} train rows x {sparse_width} sparse values = {values:,} values '
            f'{"<=" if values <= budget else ">"} {budget:,} ({limit:,} rows of {NUM_SPARSE}) on {device_type}')
    return (True, said) if values <= budget else (False, said + " (true fits it anyway)")


class RowHasher:
    """Raw sparse values -> rows of the run's embedding layout (the DLRM's own hashing functions).

    Args:
        cardinalities: the run's table sizes (F ints).
        vocabs: the sorted vocabularies of vocabulary hashing, else None (modulus hashing).
        device: where the hashing runs.
        hotness: multi-hot sizes (None: one value a feature). Every slot is hashed with its
            feature's table, and an empty slot (PAD_SPARSE) becomes the id ``-(f + 2)``: one
            "empty slot of feature f" weight, below every real row. The regression then sums the
            weights of all of a row's values: a bag-of-values logistic regression.

    Example:
        >>> RowHasher([10, 20], None, "cpu")(torch.tensor([[3, -1]]))
        tensor([[ 4, 10]])
        >>> RowHasher([10, 20], None, "cpu", hotness=[2, 1])(torch.tensor([[3, -2, 5]]))
        tensor([[ 4, -2, 16]])

    Shapes: int64 [B, F] (or [B, L] multi-hot) -> the same shape.
    """

    def __init__(self, cardinalities: list[int], vocabs: Optional[list[torch.Tensor]], device: torch.device | str,
                 hotness: Optional[list[int]] = None):
        self.cards, self.offsets = layout_tensors(cardinalities, device)
        self.keys = self.vocab_offsets = None
        if vocabs is not None:
            keys, vocab_offsets = keyed_vocabulary(vocabs)
            self.keys, self.vocab_offsets = keys.to(device), vocab_offsets.to(device)
        self.slot_feature = None
        if hotness is not None and any(h != 1 for h in hotness):
            self.slot_feature = torch.repeat_interleave(torch.arange(len(hotness)), torch.tensor(hotness)).to(device)

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        f = self.slot_feature
        if f is None:
            if self.keys is None:
                return modulus_rows(raw, self.cards, self.offsets)
            return vocabulary_rows(raw, self.keys, self.vocab_offsets, self.offsets)
        empty = raw == PAD_SPARSE
        raw = torch.where(empty, torch.full_like(raw, -1), raw)
        if self.keys is None:
            rows = modulus_rows(raw, self.cards[f], self.offsets[f])
        else:
            rows = vocabulary_rows(raw, self.keys, self.vocab_offsets, self.offsets[f], f)
        return torch.where(empty, -(f + 2).expand_as(rows), rows)


def collect(batches: Iterable[Batch], hasher: RowHasher) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split's rows as three tensors: dense float64 [N, 13] (the model's input), rows int64 [N, F], labels float64 [N]."""
    dense, rows, labels = [], [], []
    for batch in batches:
        dense.append(batch.dense.to(torch.float64))
        rows.append(hasher(batch.sparse))
        labels.append(batch.labels.to(torch.float64))
    return torch.cat(dense), torch.cat(rows), torch.cat(labels)


class LogisticRegression:
    """``bias + dense @ v + sum_f w[rows_f]`` with one weight per embedding row seen in training.

    Args:
        used_rows: the sorted distinct embedding rows of the train split, int64 [U] (their weights
            are the parameters; any other row weighs 0).
        device: where the weights live.

    Example:
        >>> lr = LogisticRegression(torch.tensor([2, 5, 9]), "cpu")
        >>> lr.logits(torch.zeros(4, 13, dtype=torch.float64), torch.tensor([[2, 7]] * 4)).shape
        torch.Size([4])
    """

    def __init__(self, used_rows: torch.Tensor, device: torch.device | str):
        self.used_rows = used_rows
        self.sparse = torch.zeros(used_rows.numel(), dtype=torch.float64, device=device, requires_grad=True)
        self.dense = torch.zeros(13, dtype=torch.float64, device=device, requires_grad=True)
        self.bias = torch.zeros((), dtype=torch.float64, device=device, requires_grad=True)

    def parameters(self) -> list[torch.Tensor]:
        return [self.sparse, self.dense, self.bias]

    def local_ids(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into the weights [N, F], whether the row has a weight [N, F]) of embedding rows."""
        pos = torch.searchsorted(self.used_rows, rows).clamp(max=max(self.used_rows.numel() - 1, 0))
        return pos, self.used_rows[pos] == rows

    def logits_from_ids(self, dense: torch.Tensor, ids: torch.Tensor, known: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [N] of dense [N, 13] and weight indices [N, F] (`known` masks rows without a weight)."""
        weights = self.sparse[ids]
        if known is not None:
            weights = weights * known
        return self.bias + dense @ self.dense + weights.sum(1)

    @torch.no_grad()
    def logits(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [N] of dense [N, 13] float64 and embedding rows [N, F]."""
        ids, known = self.local_ids(rows)
        return self.logits_from_ids(dense, ids, known)


def fit(dense: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, l2: Optional[float] = None,
        max_iterations: int = MAX_ITERATIONS) -> tuple[LogisticRegression, dict]:
    """Fit the L2 logistic regression by full-batch L-BFGS (strong Wolfe line search), diagonally preconditioned.

    Args:
        dense: float64 [N, 13] the model's dense input; rows: int64 [N, F] embedding rows; labels: float64 [N].
        l2: the penalty's weight on the mean loss; None: 1 / N (scikit-learn's default C = 1).
        max_iterations: L-BFGS iterations at most.

    Returns:
        (the model, {"l2", "iterations", "converged", "last_change", "train_objective", "train_logloss"});
        ``converged``: L-BFGS met its tolerances (not only its iteration limit); ``last_change``: the objective's
        change in its last iteration.
    """
    l2 = 1.0 / labels.numel() if l2 is None else l2
    used, ids, counts = torch.unique(rows, return_inverse=True, return_counts=True)
    model = LogisticRegression(used, dense.device)
    rate = labels.mean().clamp(1e-6, 1 - 1e-6)
    # L-BFGS is not scale-invariant: a row seen once has 1/count the curvature of one seen count times, a log1p count
    # column (values up to ~15) far more than a 0/1 one, so plain L-BFGS (scikit-learn's too) ended its 100
    # iterations 2e-3 above the optimum on data/sample (it took 686), its validation AUC 0.0024 and logloss 0.0025
    # off the optimum's. So it runs on u = w / scale, scale = 1 / sqrt(the Hessian's diagonal at the start:
    # rate (1 - rate) * E[x^2] (+ l2 where penalized)): the same objective and optimum (the penalty stays on w),
    # reached in 172 iterations there (`MAX_ITERATIONS`).
    curvature = rate * (1 - rate)
    sparse_scale = (curvature * counts.to(torch.float64) / labels.numel() + l2).rsqrt()
    dense_scale = (curvature * dense.square().mean(0) + l2).rsqrt()
    bias_scale = curvature.rsqrt()  # unpenalized: its curvature is the rate's alone
    sparse_u = torch.zeros_like(model.sparse, requires_grad=True)
    dense_u = torch.zeros_like(model.dense, requires_grad=True)
    # start from the base rate: the bias is the only unpenalized weight
    bias_u = (torch.log(rate / (1 - rate)) / bias_scale).detach().requires_grad_(True)
    # max_eval: iterations stop the fit, as in scikit-learn (scipy's 15,000 evaluations); PyTorch's default,
    # 1.25 evaluations an iteration, ended a fit of max_iterations 3 after its first iteration. Its strong Wolfe
    # line search takes at most 25 evaluations an iteration.
    opt = torch.optim.LBFGS([sparse_u, dense_u, bias_u], lr=1.0, max_iter=max_iterations,
                            max_eval=25 * max_iterations + 1, history_size=20, tolerance_grad=1e-7,
                            tolerance_change=TOLERANCE_CHANGE, line_search_fn="strong_wolfe")

    def losses(sparse: torch.Tensor, dense_w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean BCE, the penalized objective) of the weights w."""
        logits = bias + dense @ dense_w + sparse[ids].sum(1)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return bce, bce + 0.5 * l2 * (sparse.square().sum() + dense_w.square().sum())

    def closure() -> torch.Tensor:
        bar.update(opt.state[sparse_u].get("n_iter", 0) - bar.n)  # (LBFGS counts an iteration before its evaluations)
        opt.zero_grad()
        loss = losses(sparse_u * sparse_scale, dense_u * dense_scale, bias_u * bias_scale)[1]
        loss.backward()
        return loss

    # intended host syncs: L-BFGS's line search reads the loss; the baseline runs once, after training
    interval = bar_interval()  # {} on a terminal; in a file the bar stays, as the evaluation's does
    with ProgressBar(total=max_iterations, desc="baseline fit", unit="iteration", leave=bool(interval),
                     dynamic_ncols=True, delay=FIT_BAR_DELAY_S, **interval) as bar:
        opt.step(closure)
    state = opt.state[sparse_u]  # LBFGS keeps its state on the first parameter
    iterations = int(state.get("n_iter", 0))
    with torch.no_grad():
        model.sparse.copy_(sparse_u * sparse_scale)
        model.dense.copy_(dense_u * dense_scale)
        model.bias.copy_(bias_u * bias_scale)
        bce, objective = (float(v) for v in losses(model.sparse, model.dense, model.bias))
        # the last iteration's progress: LBFGS checks the iteration limit before its tolerances, so a fit that met
        # them at its last allowed iteration (one did, at 200 of 200) still converged
        last_step = float((state["d"] * state["t"]).abs().max()) if "d" in state else 0.0
    last_change = objective - float(state.get("prev_loss", objective))
    out_of_evaluations = state.get("func_evals", 0) >= 25 * max_iterations + 1
    converged = not out_of_evaluations and (iterations < max_iterations or last_step <= TOLERANCE_CHANGE
                                            or abs(last_change) < TOLERANCE_CHANGE)
    return model, {"l2": l2, "iterations": iterations, "converged": converged, "last_change": last_change,
                   "train_objective": objective, "train_logloss": bce}


def fit_and_evaluate(train: Iterable[Batch], evaluation: Iterable[Batch], hasher: RowHasher,
                     l2: Optional[float] = None) -> dict:
    """Fit on every row of `train`, evaluate on `evaluation`; returns the metrics and the fit's facts.

    Returns:
        {"auc", "logloss", "accuracy", "model", "l2", "iterations", "converged", "train_objective", "train_logloss",
        "train_rows", "train_rate", "constant_logloss", "weights", "seconds"}; ``constant_logloss``: the evaluation
        split's logloss of predicting the train click rate for every row (the floor a fit should beat).
    """
    started = time.perf_counter()
    dense, rows, labels = collect(train, hasher)
    train_rows = labels.numel()
    train_rate = float(labels.mean())
    model, facts = fit(dense, rows, labels, l2)
    del dense, rows, labels  # the evaluation split's tensors take their place
    ev_dense, ev_rows, ev_labels = collect(evaluation, hasher)
    metrics = evaluate_logits(model.logits(ev_dense, ev_rows), ev_labels)
    rate = min(max(train_rate, 1e-6), 1 - 1e-6)
    constant = float(log_loss(torch.full_like(ev_labels, math.log(rate / (1 - rate))), ev_labels))
    return {**metrics, "model": "logistic regression (L2, the dense input + one weight per embedding row)", **facts,
            "train_rows": train_rows, "train_rate": train_rate, "constant_logloss": constant,
            "weights": model.used_rows.numel() + 14, "seconds": time.perf_counter() - started}


def run_baseline(cfg, meta, tables, device: torch.device, world_size: int = 1, writer=None,
                 step: int = 0, tag: str = "baseline") -> Optional[dict]:
    """The trainer's hook: fit and evaluate the baseline when ``train.baseline`` asks; log it.

    Args:
        cfg: the run's config (``data.path``, ``data.eval_split``, ``train.baseline``).
        meta: the dataset's metadata; tables: the run's `Tables` (sizes, vocabularies).
        device: where to fit. world_size: processes of the run.
        writer: TensorBoard writer for ``baseline/auc`` and ``baseline/logloss`` (at `step`).
        tag: their prefix: ``baseline``, or ``baseline/<split>`` beside a session's ``eval/<split>/*`` (a resume that
            changed data.eval_split): on ``baseline/*`` its baseline's numbers went on the curve of the run's first
            split's, a line from the validation baseline's AUC to the test baseline's.

    Returns:
        The baseline's summary (see `fit_and_evaluate`), or None when it is off.
    """
    # the metadata's row count decides: no file is opened for a run that fits no baseline
    wanted, why = baseline_wanted(cfg.train.baseline, meta.splits["train"].rows, world_size, device.type,
                                  meta.sparse_width)
    if not wanted:
        logger.info(f"baseline: off ({why})")
        return None
    data_dir = Path(cfg.data.path)
    sizes = meta.multi_hot_sizes
    formats = dict(multi_hot_sizes=sizes, dense_format=meta.dense_format)
    train = ParquetLoader(split_files(data_dir, meta, "train"), LOADER_BATCH, device, **formats)
    evaluation = ParquetLoader(split_files(data_dir, meta, cfg.data.eval_split), LOADER_BATCH, device, **formats)
    try:
        result = fit_and_evaluate(train, evaluation, RowHasher(tables.cardinalities, tables.vocabs, device,
                                                               tables.multi_hot_sizes))
    except (MemoryError, RuntimeError) as e:  # out of memory: the DLRM's results are already safe: report, go on
        # torch's CPU allocator raises a plain RuntimeError ("can't allocate memory"), CUDA's torch.OutOfMemoryError
        # (a RuntimeError too); catching only the latter ended a CPU run after training without its summary.json
        if not is_out_of_memory(e):
            raise
        logger.warning(f"baseline: skipped, out of memory ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                       "set train.baseline false (--no-baseline) for data this large")
        return None
    result["why"] = why
    logger.info(f"baseline ({why}): {result['model']}, l2 {result['l2']:.3g}, {fit_text(result)}, "
                f"{result['seconds']:.1f}s: {cfg.data.eval_split} AUC {auc_text(result)}, {logloss_text(result)}")
    if writer is not None:
        if not auc_undefined(result["auc"]):  # a one-class split's NaN: no point (the log line says why)
            writer.add_scalar(f"{tag}/auc", result["auc"], step)
        writer.add_scalar(f"{tag}/logloss", result["logloss"], step)
    return result


def fit_text(result: dict) -> str:
    """How the fit ended, for the log: converged, or stopped at the iteration limit (its numbers then approximate)."""
    if result["converged"]:
        return f"converged in {result['iterations']} L-BFGS iterations"
    return (f"NOT converged: stopped at the limit of {result['iterations']} L-BFGS iterations (train objective "
            f"{result['train_objective']:.6g}, its last iteration changed it by {result['last_change']:.2g}; its AUC "
            "and logloss may be off the optimum's)")


def logloss_text(result: dict) -> str:
    """The evaluation logloss beside what reads it: a constant prediction's logloss, and the train logloss.

    A logloss alone does not say whether the fit learned anything (0.6931 = ln 2 looks like "0.5 for every row",
    and was an overfitted fit's by chance); next to the constant's it does.

    Example:
        >>> logloss_text({"logloss": 0.6931, "constant_logloss": 0.5735, "train_rate": 0.2731, "train_logloss": 0.1735,
        ...               "weights": 2314, "train_rows": 1600})  # doctest: +NORMALIZE_WHITESPACE
        'logloss 0.6931, worse than 0.5735, the logloss of predicting the train click rate 0.2731 for every row: its
        2,314 weights overfit the 1,600 train rows (train logloss 0.1735)'
    """
    constant = f"{result['constant_logloss']:.4f}, the logloss of predicting the train click rate {result['train_rate']:.4f}"
    if result["logloss"] > result["constant_logloss"]:
        return (f"logloss {result['logloss']:.4f}, worse than {constant} for every row: its {result['weights']:,} "
                f"weights overfit the {result['train_rows']:,} train rows (train logloss {result['train_logloss']:.4f})")
    return f"logloss {result['logloss']:.4f} (train {result['train_logloss']:.4f}; {constant} for every row)"


def baseline_clause(summary: dict) -> str:
    """The final log line's words about the baseline: its AUC/logloss and the DLRM's margin."""
    base = summary.get("baseline")
    if not base:
        return ""
    # a one-class split: both AUCs undefined, and so the margin (it read "AUC nan ... (DLRM +nan AUC)")
    gain = auc_gain_text(summary["auc"], base["auc"])
    # flagged here too, as the DLRM's own logloss is (`dlrm.train.logloss_check`): the final line read the baseline's
    # "logloss 0.6422" plainly where its own line, above, said it was worse than the constant's 0.5597
    worse = base.get("constant_logloss") is not None and base["logloss"] > base["constant_logloss"]
    return (f"; baseline (logistic regression) AUC {auc_text(base)}, logloss {base['logloss']:.4f} "
            + (f"(worse than the train click rate's {base['constant_logloss']:.4f}) " if worse else "")
            + (f"(DLRM {gain} AUC)" if gain != "n/a" else "(the DLRM's AUC margin n/a)"))
