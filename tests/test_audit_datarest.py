"""Audit of data preparation and TensorBoard records: a resumed run as TensorBoard's own loader reads it, TorchRec's
one-hot .npy import (and an import stopped before its first file), the preprocessor's lines about empty vocabularies
and its worker count."""

from __future__ import annotations

from pathlib import Path

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.test_audit_overwrite52 import tiny_config


def _steps_as_tensorboard_serves(run: Path, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard's Python loader serves them (the web app's scalars with --load_fast=false,
    or without the data server): plugin_event_accumulator, not the older event_accumulator."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors(tag)]


def test_a_resume_from_an_earlier_checkpoint_shows_each_step_once_in_tensorboards_loader(tmp_path):
    """A run trained to 10, resumed in place from its step-6 checkpoint: TensorBoard's Python loader showed train/loss
    at 2, 4, 6, 8, 10, 8, 10: it purges at a SessionLog.START only after a first one, and the first session wrote
    none. A second and third resume (the second from further back) keep each step once."""
    config = tiny_config(tmp_path)
    train(load_config(config, {"log.run_name": "r"}))
    run = tmp_path / "tb" / "r"
    for step in (8, 10):
        (run / "checkpoints" / f"step-{step:08d}.pt").unlink()
    train(load_config(config, {"log.run_name": "r"}), resume="latest")
    for tag in ("train/loss", "eval/auc"):
        assert _steps_as_tensorboard_serves(run, tag) == [2, 4, 6, 8, 10], tag
    for step in (6, 8, 10):
        (run / "checkpoints" / f"step-{step:08d}.pt").unlink()
    summary = train(load_config(config, {"log.run_name": "r"}), resume="latest")
    assert summary["resumed_at_step"] == 4
    for tag in ("train/loss", "eval/auc"):
        assert _steps_as_tensorboard_serves(run, tag) == [2, 4, 6, 8, 10], tag


def _torchrec_day(root: Path, i: int, n: int, rng, cards: list[int]):
    """One day as TorchRec's `BinaryCriteoUtils` leaves it (one-hot, before MLPerf's multi-hot step): labels int32
    [n, 1], dense float32 log(x + 3) [n, 13], sparse int64 [n, 26] (contiguous ids here, below `cards`)."""
    import numpy as np

    labels = rng.integers(0, 2, (n, 1)).astype(np.int32)
    dense = np.log(rng.integers(0, 500, (n, 13)) + 3.0).astype(np.float32)
    sparse = np.stack([rng.integers(0, c, n) for c in cards], axis=1).astype(np.int64)
    np.save(root / f"day_{i}_labels.npy", labels)
    np.save(root / f"day_{i}_dense.npy", dense)
    np.save(root / f"day_{i}_sparse.npy", sparse)
    return labels[:, 0], dense, sparse


def _import(src: Path, out: Path, cards: list[int]):
    from click.testing import CliRunner

    from dlrm.data import mlperf_import as mi

    return CliRunner().invoke(mi.main, ["--input", str(src), "--output", str(out), "--train-days", "0-1",
                                        "--eval-day", "2", "--num-embeddings", ",".join(map(str, cards)),
                                        "--workers", "1"])


def test_torchrecs_one_hot_npy_days_import_value_for_value_and_train(tmp_path):
    """TorchRec's one-hot Criteo files (day_N_labels.npy, day_N_dense.npy, day_N_sparse.npy [N, 26]) were refused
    ("day_0_sparse_multi_hot.npz: missing"); they import as 26 one-hot features, every value where the files hold it,
    and a model trains on the result."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dlrm.data.schema import DENSE_COLUMNS, SPARSE_COLUMNS, read_metadata

    rng = np.random.default_rng(0)
    cards = [3 + 2 * f for f in range(26)]
    src = tmp_path / "torchrec"
    src.mkdir()
    days = {i: _torchrec_day(src, i, n, rng, cards) for i, n in {0: 50, 1: 31, 2: 24}.items()}
    res = _import(src, tmp_path / "imported", cards)
    assert res.exit_code == 0, res.output
    meta = read_metadata(tmp_path / "imported")
    assert meta.cardinalities == cards and meta.multi_hot_sizes in (None, [1] * 26)
    want = {"train": [days[0], days[1]], "validation": [tuple(a[:12] for a in days[2])],
            "test": [tuple(a[12:] for a in days[2])]}
    for split, parts in want.items():
        table = pa.concat_tables([pq.read_table(tmp_path / "imported" / f) for f in meta.splits[split].files])
        labels, dense, sparse = (np.concatenate(a) for a in zip(*parts))
        assert table.num_rows == len(labels) == meta.splits[split].rows, split
        np.testing.assert_array_equal(table.column("label").to_numpy(), labels)
        for j, name in enumerate(DENSE_COLUMNS):  # float32 as they are, bit for bit
            assert table.column(name).type == pa.float32()
            np.testing.assert_array_equal(table.column(name).to_numpy(), dense[:, j])
        for f, name in enumerate(SPARSE_COLUMNS):
            assert table.column(name).type == pa.int64()
            np.testing.assert_array_equal(table.column(name).to_numpy(), sparse[:, f])
    (tmp_path / "cfg").mkdir()  # (tiny_config writes a dataset of its own, into cfg/ds)
    config = load_config(tiny_config(tmp_path / "cfg"), {"log.run_name": "npy", "data.path": str(tmp_path / "imported"),
                                                              "train.max_steps": 4})
    summary = train(config)
    tables = summary["resolved"]["tables"]
    assert tables["cardinalities"] == cards and tables["dense_format"] == "float", tables
    assert summary["steps"] == 4 and np.isfinite(summary["final_train_loss"]) and 0 <= summary["auc"] <= 1, summary


def test_torchrecs_one_hot_npy_of_a_wrong_shape_or_dtype_is_one_line_naming_the_file(tmp_path):
    import numpy as np

    rng = np.random.default_rng(1)
    cards = [5] * 26
    src = tmp_path / "torchrec"
    src.mkdir()
    for i, n in {0: 6, 1: 5, 2: 4}.items():
        _torchrec_day(src, i, n, rng, cards)
    bad = {"columns": np.zeros((5, 25), np.int64), "rows": np.zeros((4, 26), np.int64),
           "floats": np.zeros((5, 26), np.float32), "one-dim": np.zeros(5 * 26, np.int64)}
    for what, array in bad.items():
        np.save(src / "day_1_sparse.npy", array)
        res = _import(src, tmp_path / f"out-{what}", cards)
        assert res.exit_code == 2, (what, res.output)
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert len(lines) == 1 and f"{src / 'day_1_sparse.npy'}: shape {array.shape}" in lines[0], (what, lines)
        assert "expected integers [5, 26]" in lines[0], lines
        assert not (tmp_path / f"out-{what}").exists()
    # a negative id names the file, the column and the row (one at or above its table is taken modulo its size, as
    # the reference reads TorchRec's ids: tests/test_audit_mlperfdata67.py)
    _torchrec_day(src, 1, 5, rng, cards)
    ids = np.load(src / "day_1_sparse.npy")
    ids[3, 7] = -5
    np.save(src / "day_1_sparse.npy", ids)
    res = _import(src, tmp_path / "out-id", cards)
    assert res.exit_code == 2, res.output
    assert f"{src / 'day_1_sparse.npy'}: column 7: row 3, value 0: id -5 is negative" in res.output


def test_a_min_frequency_that_empties_vocabularies_is_said_naming_the_features(tmp_path):
    """--hashing vocabulary --min-frequency 1000 on a 100-line sample wrote 26 one-row tables (every value out of the
    vocabulary) and said nothing but "26 rows in all": the model then learned from the dense features alone. A
    feature left without a value is now named in one warning; none is said when every feature keeps values."""
    from loguru import logger

    from dlrm.data import preprocess as pp

    rows = []
    for r in range(40):
        cats = [f"{r * 1000 + f:08x}" if f in (3, 9) else f"{r % 4 + 1:08x}" for f in range(26)]  # 3, 9: all unique
        rows.append("\t".join([str(r % 2), *["1"] * 13, *cats]))
    src = tmp_path / "log.tsv"
    src.write_text("\n".join(rows) + "\n")
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        for mf in (2, 1000, 1):
            warnings.clear()
            meta = pp.preprocess([src], tmp_path / f"mf{mf}", hashing="vocabulary", min_frequency=mf, progress=False,
                                 workers=1)
            empty = [f"SPARSE_{f}" for f, n in enumerate(meta.extra["vocabulary_sizes"]) if n == 0]
            if mf == 1:
                assert not empty and not warnings, warnings
            elif mf == 2:
                assert empty == ["SPARSE_3", "SPARSE_9"], empty
                assert warnings == [f"--min-frequency 2: 2 of 26 features (SPARSE_3, SPARSE_9) keep none (no value "
                                    f"occurs 2 times in the {meta.splits['train'].rows} train rows): their tables are "
                                    "the out-of-vocabulary row alone, so the model learns nothing from them"], warnings
            else:
                assert len(empty) == 26 and len(warnings) == 1, warnings
                assert warnings[0].startswith("--min-frequency 1000: no feature keeps a value (no value occurs 1000 "
                                              "times") and warnings[0].endswith("use a lower --min-frequency, or auto")
    finally:
        logger.remove(sink)


def test_the_chunk_line_counts_one_worker_as_one(tmp_path):
    """`--workers 1` printed "1 chunk(s) of up to 262144 lines to do (1 workers)"."""
    from loguru import logger

    from dlrm.data import preprocess as pp

    src = tmp_path / "log.tsv"
    src.write_text("\t".join(["1", *["2"] * 13, *["0000abcd"] * 26]) + "\n")
    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="INFO")
    try:
        pp.preprocess([src], tmp_path / "ds", split="random", progress=False, workers=1)
    finally:
        logger.remove(sink)
    assert "1 chunk(s) of up to 262,144 lines to do (1 worker)" in said, said


def test_an_import_stopped_before_finishing_a_file_leaves_nothing_and_the_corrected_command_runs(tmp_path):
    """A bad id in the first file (an id outside its table, a wrong or missing --num-embeddings, was the usual first
    mistake; a one-hot file's ids are now taken modulo the table sizes, so a negative one stands for it here) left
    .OUT.import-partial holding a plan and no file ("the 0 of 3 files finished are kept"), and the corrected command
    was refused as "an unfinished import with other options or input" until given --overwrite. Now nothing is kept;
    an import stopped after a file was finished still keeps it (tests/test_mlperf_import.py)."""
    import numpy as np

    from dlrm.data import mlperf_import as mi

    rng = np.random.default_rng(2)
    cards = [9] * 26
    src = tmp_path / "torchrec"
    src.mkdir()
    for i, n in {0: 6, 1: 5, 2: 4}.items():
        _torchrec_day(src, i, n, rng, cards)
    out = tmp_path / "ds"
    # a bad id in the first file (one-hot ids at or above their tables are taken modulo the sizes, as the reference
    # reads them: a negative one stops the import)
    good = np.load(src / "day_0_sparse.npy")
    bad = good.copy()
    bad[0, 0] = -1
    np.save(src / "day_0_sparse.npy", bad)
    res = _import(src, out, cards)
    assert res.exit_code == 2 and "is negative" in res.output, res.output
    assert "no file was finished" in res.output and "files finished are kept" not in res.output, res.output
    assert not out.exists() and not mi.partial_dir(out).exists()
    np.save(src / "day_0_sparse.npy", good)
    res = _import(src, out, cards)
    assert res.exit_code == 0, res.output
    assert (out / "metadata.json").is_file()
