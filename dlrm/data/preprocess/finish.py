"""The end of a run: vocabularies, metadata.json, and the summary in the log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.data.preprocess.constants import BAD_LINE_REASONS
from dlrm.data.preprocess.empty_splits import advice
from dlrm.data.preprocess.stats import DistinctCounter
from dlrm.data.schema import NUM_SPARSE, SPLITS, Metadata, SplitInfo, write_metadata
from dlrm.data.vocabulary import vocab_path
from dlrm.errors import os_errors_named
from dlrm.stop_signal import raise_pending


def _finish(out, scans, fingerprints, opts, plan, done, counter, file_bad, hashing, min_frequency,
            max_rows, shared_rows=()) -> Metadata:
    """Step 4: the vocabularies (vocabulary hashing), then metadata.json, from the finished chunks."""
    from loguru import logger

    keys = sorted(done)
    splits = {}
    for name in SPLITS:
        recs = [done[k]["shards"][name] for k in keys if name in done[k]["shards"]]
        splits[name] = SplitInfo(
            rows=sum(r["rows"] for r in recs),
            positives=sum(r["positives"] for r in recs),
            files=[r["file"] for r in recs],
        )
    bad = {r: 0 for r in BAD_LINE_REASONS}
    for k in keys:
        for r, n in done[k]["bad"].items():
            bad[r] += n
    for r, n in file_bad.items():
        bad[r] += n
    distinct = counter.distinct()
    extra: dict[str, Any] = {"source": "dlrm.preprocess"}
    if hashing == "vocabulary":
        sizes = _write_vocabularies(out, counter, min_frequency)
        cards = [v + 1 for v in sizes]
        extra["vocabulary_sizes"] = sizes
        _warn_empty_vocabularies(sizes, min_frequency, splits["train"].rows)
    else:
        cards = [min(d + 1, max_rows) if max_rows else d + 1 for d in distinct]
    extra.update(
        {
            "distinct_counts": distinct,
            "inputs": [
                {
                    "path": fp["path"],
                    "format": sc.format,
                    "header": sc.header,
                    "compressed": sc.compressed,
                    "bytes": fp["size"],
                    "lines": sc.lines,
                }
                for fp, sc in zip(fingerprints, scans)
            ],
            "total_lines": plan.total_lines,
            "split_rule": plan.describe(),
            "options": opts,
            "bad_lines": bad,
            # the first line skipped (input order): the counts alone said neither which file nor where
            "first_bad_line": next((done[k]["first_bad"] for k in keys if isinstance(done[k].get("first_bad"), str)),
                                   None),
            "dense_clipped": sum(done[k]["clipped"] for k in keys),
        }
    )
    if shared_rows:  # inputs sharing most of their rows, kept under --allow-shared-rows: whoever trains on it is told
        extra["shared_rows"] = list(shared_rows)
    sizes = opts.get("multi_hot_sizes") or [1] * NUM_SPARSE
    layout = opts.get("sparse_layout", "lists")  # recorded only when multi-hot; one-hot: the same files
    meta = Metadata(cardinalities=cards, multi_hot_sizes=list(sizes), hashing=hashing, splits=splits, extra=extra,
                    sparse_layout=layout)
    raise_pending()  # a SIGTERM whose stop a library dropped: before metadata.json marks the dataset complete
    write_metadata(out, meta)
    logger.info("wrote {}", out / "metadata.json")
    return meta


def _warn_empty_vocabularies(sizes: list[int], min_frequency: int, train_rows: int) -> None:
    """One warning naming the features whose vocabulary is empty: a --min-frequency above every count of theirs
    (1000 on a 100-line sample) made every table the out-of-vocabulary row alone, said nowhere but in the summary's
    "26 rows in all", and the model then trained on the dense features only."""
    from loguru import logger

    empty = [f"SPARSE_{f}" for f, n in enumerate(sizes) if n == 0]
    if not empty:
        return
    every = len(empty) == NUM_SPARSE
    which = ("no feature keeps a value" if every
             else f"{len(empty)} of {NUM_SPARSE} features ({', '.join(empty)}) keep none")
    logger.warning(f"--min-frequency {min_frequency}: {which} (no value occurs {min_frequency} times in the "
                   f"{train_rows:,} train rows): their tables are the out-of-vocabulary row alone, so the model learns "
                   "nothing from them" + ("; use a lower --min-frequency, or auto" if every else ""))


def _write_vocabularies(out: Path, counter: DistinctCounter, min_frequency: int) -> list[int]:
    """Write every feature's vocabulary (atomically: temp file, fsync, rename); returns their sizes."""
    sizes = []
    for f in range(NUM_SPARSE):
        vocab = counter.vocabulary(f, min_frequency)
        path = vocab_path(out, f)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with os_errors_named(path), open(tmp, "wb") as fh:  # (a write's error names no file)
                np.save(fh, vocab)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk, Ctrl-C: no half-written temp file left in the dataset
            tmp.unlink(missing_ok=True)
            raise
        sizes.append(int(vocab.size))
    return sizes


def _report(meta: Metadata, seconds: float) -> None:
    """Log the summary table of a finished run."""
    from loguru import logger

    lines = [f"{'split':<11}{'rows':>14}{'positive rate':>15}{'shards':>8}"]
    total = 0
    for name, info in meta.splits.items():
        rate = f"{100 * info.positives / info.rows:.2f}%" if info.rows else "-"
        lines.append(f"{name:<11}{info.rows:>14,}{rate:>15}{len(info.files):>8}")
        total += info.rows
    cards = meta.cardinalities
    lines.append(
        f"tables ({meta.hashing}): {sum(cards):,} rows in all, largest {max(cards):,}, "
        f"distinct values in train {sum(meta.extra['distinct_counts']):,}"
    )
    bad = {k: v for k, v in meta.extra["bad_lines"].items() if v}
    first = meta.extra.get("first_bad_line")
    lines.append("bad lines skipped: " + (", ".join(f"{k} {v:,}" for k, v in bad.items()) if bad else "none")
                 + (f"; the first: {first}" if first else ""))
    if meta.extra["dense_clipped"]:
        lines.append(f"counts clipped to int32 max: {meta.extra['dense_clipped']:,}")
    lines.append(f"{total:,} rows in {seconds:.1f} s ({total / max(seconds, 1e-9):,.0f} rows/s)")
    for line in lines:
        logger.info(line)
    empty = [name for name in ("train", "validation") if meta.splits[name].rows == 0]
    if empty:  # said only by a table line before: train.py then refused the dataset ("lists no files")
        extra = meta.extra
        hints = [advice(name, extra["options"], extra["total_lines"], extra["inputs"][-1]["lines"]) for name in empty]
        logger.warning(f"the {' and '.join(empty)} split{'s have' if len(empty) > 1 else ' has'} no rows: train.py "
                       "trains on train and evaluates on validation, and refuses this dataset; "
                       + "; ".join(hints if len(empty) == 1 else (f"{n}: {h}" for n, h in zip(empty, hints))))
    for name in ("validation", "test"):
        _warn_one_class(name, meta.splits[name], meta.extra["options"]["split"] == "random")


def _warn_one_class(name: str, info: SplitInfo, random_split: bool) -> None:
    """Warn when split ``name`` holds rows of one class only. Said for validation (train.py's default data.eval_split)
    and for test alike: ``--split test`` (data.eval_split "test") evaluates it the same way, and a one-class test split
    was only to be seen as "0.00%" or "100.00%" in the table."""
    from loguru import logger

    if not info.rows or info.positives not in (0, info.rows):
        return
    label = "1 (positive)" if info.positives else "0 (negative)"
    rows = "its one row is" if info.rows == 1 else f"its {info.rows:,} rows are all"
    how = "" if name == "validation" else f", with --split {name} or data.eval_split '{name}',"
    again = " or another --seed" if random_split else ""
    logger.warning(f"the {name} split holds one class only: {rows} labelled {label}, so its AUC is undefined "
                   f"(train.py evaluating it{how} picks best.pt by logloss and refuses train.early_stopping.metric "
                   f"'auc'); give more lines{again}")
