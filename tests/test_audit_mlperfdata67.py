"""MLPerf DLRM-DCNv2's data as its reference and TorchRec leave it, imported by `dlrm.data.mlperf_import`, found by an
audit (each test failed before its fix):

1. TorchRec's one-hot ``day_{i}_sparse.npy`` (the output of MLPerf's ``process_Criteo_1TB_Click_Logs_dataset.sh``, the
   input of its multi-hot step) holds ``contiguous_preproc_criteo``'s ids: 2 .. distinct + 1 a feature (the count
   starts at 2), up to ~293M for the four features MLPerf caps at 40M. The reference reads them modulo its table
   sizes (``InMemoryBinaryCriteoIterDataPipe(hashes=num_embeddings_per_feature)``: ``sparse % hashes``), but the
   import refused every id at or above its table ("id 4 is outside feature 5's table of 3 rows"), with MLPerf's
   40M-capped sizes (the default) and with the exact distinct counts alike: the documented route, ``--num-embeddings``,
   imported them only into uncapped tables (~880M rows), never into MLPerf's model. One-hot ids are now taken modulo
   the table sizes as the reference takes them; a negative id (no TorchRec file holds one) is still refused, and so is
   a multi-hot id at or above its table (the reference's multi-hot step applied the sizes already: another size is
   another dataset).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from dlrm.data import mlperf_import as mi
from dlrm.data.schema import MLPERF_CARDINALITIES, NUM_SPARSE, SPARSE_COLUMNS, read_metadata
from tests.test_mlperf_import import CARDS, ROWS, write_day

ONE_HOT_ROWS = {0: 23, 1: 17, 23: 9}


def _contiguous_ids(rng, n: int) -> np.ndarray:
    """[n, 26] ids as ``contiguous_preproc_criteo --frequency_threshold 0`` numbers them for the whole 1TB: 2 ..
    distinct + 1, distinct being MLPerf's table size where it is not capped (39060, 3, ...) and more (up to ~293M)
    where it is; every feature's largest ids (card, card + 1, and past 40M for the capped ones) in the first rows."""
    ids = np.stack([rng.integers(2, card + 2, n) for card in MLPERF_CARDINALITIES], axis=1)
    for f, card in enumerate(MLPERF_CARDINALITIES):
        ids[:2, f] = [card, card + 1] if card < 40_000_000 else [card + 7, 292_775_615]
    return ids


def _torchrec_one_hot_day(root, i: int, n: int, rng) -> np.ndarray:
    """One day as the reference's processing script leaves it: labels int32 [n, 1], dense float32 log(x + 3); sparse
    int32 for days 0-22 (through the shuffle step's ``astype(np.int32)``), int64 for day 23 (copied from the
    contiguous step as it is)."""
    np.save(root / f"day_{i}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    np.save(root / f"day_{i}_dense.npy", np.log(rng.integers(0, 500, (n, 13)) + 3.0).astype(np.float32))
    ids = _contiguous_ids(rng, n).astype(np.int64 if i == 23 else np.int32)
    np.save(root / f"day_{i}_sparse.npy", ids)
    return ids


def _run(*args):
    return CliRunner().invoke(mi.main, [str(a) for a in args])


def test_mlperfs_one_hot_files_import_modulo_mlperfs_table_sizes_as_the_reference_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "in"
    src.mkdir()
    days = {i: _torchrec_one_hot_day(src, i, n, rng) for i, n in ONE_HOT_ROWS.items()}
    out = tmp_path / "ds"
    res = _run("--input", src, "--output", out, "--train-days", "0-1", "--workers", "1")  # MLPerf's 40M-capped sizes
    assert res.exit_code == 0, res.output
    meta = read_metadata(out)
    assert meta.cardinalities == MLPERF_CARDINALITIES
    half = (ONE_HOT_ROWS[23] + 1) // 2
    spans = {"train": [days[0], days[1]], "validation": [days[23][:half]], "test": [days[23][half:]]}
    cards = np.array(MLPERF_CARDINALITIES)
    for split, parts in spans.items():
        table = pa.concat_tables([pq.read_table(out / f) for f in meta.splits[split].files])
        want = np.concatenate(parts).astype(np.int64) % cards  # the reference's `sparse % hashes`
        got = np.stack([table.column(c).to_numpy() for c in SPARSE_COLUMNS], axis=1)
        np.testing.assert_array_equal(got, want, err_msg=split)
        assert (got >= 0).all() and (got < cards).all()


def test_a_negative_one_hot_id_and_a_multi_hot_id_past_its_table_are_still_refused(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "one-hot"
    src.mkdir()
    for i, n in ONE_HOT_ROWS.items():
        _torchrec_one_hot_day(src, i, n, rng)
    ids = np.load(src / "day_1_sparse.npy")
    ids[4, 9] = -3
    np.save(src / "day_1_sparse.npy", ids)
    res = _run("--input", src, "--output", tmp_path / "out-1", "--train-days", "0-1", "--workers", "1")
    assert res.exit_code == 2, res.output
    assert f"{src / 'day_1_sparse.npy'}: column 9: row 4, value 0: id -3 is negative" in res.output, res.output
    assert not (tmp_path / "out-1").exists()
    # multi-hot: the reference's multi-hot step took the ids modulo its sizes already; one past them is refused
    mh = tmp_path / "multi-hot"
    mh.mkdir()
    for i, n in ROWS.items():
        write_day(mh, i, n, rng)
    z = dict(np.load(mh / "day_0_sparse_multi_hot.npz"))
    z["20"][6, 9] = CARDS[20]
    np.savez(mh / "day_0_sparse_multi_hot.npz", **z)
    res = _run("--input", mh, "--output", tmp_path / "out-2", "--train-days", "0-1", "--workers", "1",
               "--num-embeddings", ",".join(map(str, CARDS)))
    assert res.exit_code == 2, res.output
    assert (f"day_0_sparse_multi_hot.npz: member 20.npy: row 6, value 9: id {CARDS[20]} is outside feature 20's "
            f"table") in res.output, res.output
    assert len(CARDS) == NUM_SPARSE
