"""Audit of the real-data path: raw Criteo logs through ``python -m dlrm.preprocess``, then training, evaluation and
``--export``; each test failed before its fix. CI runs them on small synthetic logs written in tmp_path."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.config import Config
from dlrm.data import synthetic
from dlrm.data.preprocess import preprocess
from dlrm.data.schema import DENSE_COLUMNS, SPARSE_COLUMNS, SPLITS, read_metadata
from dlrm.model.dlrm import build_model
from dlrm.train import export as export_mod
from tests.conftest import REPO


def split_table(root, split):
    """label, dense (13, n) and sparse (26, n) of one split of a dataset, in file order."""
    table = pa.concat_tables([pq.read_table(root / f) for f in read_metadata(root).splits[split].files])
    dense = np.stack([table.column(c).to_numpy() for c in DENSE_COLUMNS])
    sparse = np.stack([table.column(c).to_numpy() for c in SPARSE_COLUMNS])
    return table.column("label").to_numpy(), dense, sparse


# -- the small-real regime and its raw TSV twin -----------------------------------------------------


@pytest.mark.parametrize("rows", [22, 36])
def test_small_real_splits_hold_the_rows_its_preprocessed_twin_puts_there(tmp_path, rows):
    """The small-real regime is documented as split as ``dlrm.preprocess --split sequential`` splits its raw TSV twin.
    The sizes were the same, but the generator wrote its rows train, validation, test, where --split sequential cuts
    the last seventh test first, then validation: the twin's validation rows were the synthetic dataset's test rows
    (and the oracle AUC the generator printed for "validation" was that of other rows: 0.7832 at 10,000 rows, where
    the twin's validation rows' is 0.8193). At 36 rows (test 3, validation 2) the splits did not even line up."""
    syn = synthetic.generate(tmp_path / "syn", rows, seed=0, regime="small-real", raw_tsv=tmp_path / "log.txt")
    preprocess([tmp_path / "log.txt"], tmp_path / "twin", workers=1, progress=False)
    twin = read_metadata(tmp_path / "twin")
    assert {s: (i.rows, i.positives) for s, i in syn.splits.items()} == \
        {s: (i.rows, i.positives) for s, i in twin.splits.items()}
    for split in SPLITS:
        label, dense, sparse = split_table(tmp_path / "syn", split)
        twin_label, twin_dense, twin_sparse = split_table(tmp_path / "twin", split)
        assert label.size == syn.splits[split].rows > 0
        np.testing.assert_array_equal(label, twin_label)
        np.testing.assert_array_equal(np.maximum(dense, 0), twin_dense)  # the preprocessor stores negatives as 0
        np.testing.assert_array_equal(sparse, twin_sparse)


def test_sequential_sizes_are_in_the_order_the_lines_are_cut():
    from dlrm.data.preprocess.splits import SplitPlan, sequential_sizes

    sizes = sequential_sizes(36)
    assert list(sizes) == ["train", "test", "validation"] and sizes == {"train": 31, "test": 3, "validation": 2}
    plan = SplitPlan.build("sequential", [36])
    codes = plan.assign(np.arange(36), 0, np.arange(36))
    assert codes.tolist() == [0] * 31 + [2] * 3 + [1] * 2  # train, test, validation (SPLITS order codes)


# -- what modulus hashing does (README, --help) -----------------------------------------------------


def write_log(path, rows: int, values_per_feature: int, seed: int = 0) -> None:
    """A raw Kaggle-format TSV of `rows` lines whose categories take `values_per_feature` 32-bit values a feature."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**32, values_per_feature)  # hash-like values, as Criteo's are
    cats = pool[rng.integers(0, values_per_feature, (rows, 26))]
    lines = ["\t".join([str(rng.integers(0, 2))] + [str(v) for v in rng.integers(0, 100, 13)]
                       + [f"{int(v):08x}" for v in row]) for row in cats]
    path.write_text("\n".join(lines) + "\n")


def test_modulus_tables_share_rows_as_the_docs_now_say(tmp_path):
    """README said modulus hashing gives "every value its own row" (twice, next to measured AUCs): its tables have
    the distinct train values + 1 rows and a value goes to row (value + 1) mod rows, so most values share a row
    (64% of the train values of ../shared/criteo's 300 lines). --hashing had no help at all."""
    write_log(tmp_path / "log.txt", 700, 300)
    preprocess([tmp_path / "log.txt"], tmp_path / "mod", workers=1, progress=False)
    preprocess([tmp_path / "log.txt"], tmp_path / "voc", workers=1, progress=False, hashing="vocabulary")
    mod, voc = read_metadata(tmp_path / "mod"), read_metadata(tmp_path / "voc")
    _, _, sparse = split_table(tmp_path / "mod", "train")
    shared = total = 0
    for f in range(26):
        values = np.unique(sparse[f][sparse[f] >= 0])
        assert mod.cardinalities[f] == voc.cardinalities[f] == values.size + 1
        rows = (values + 1) % mod.cardinalities[f]
        _, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
        shared += int((counts[inverse] > 1).sum())
        total += values.size
    assert 0.5 < shared / total < 0.75  # about 1 - 1/e of the values share their row: hashing, not a dictionary
    readme = (REPO / "README.md").read_text()
    assert "modulus hashing (every value its own row)" not in readme
    assert "every value seen in train (modulus hashing)" not in readme
    out = subprocess.run([sys.executable, "-m", "dlrm.preprocess", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    assert "(value + 1) mod rows" in " ".join(out.split())


# -- --export ---------------------------------------------------------------------------------------


def test_export_of_a_dot_model_saves_without_torch_s_shared_storage_warning(tmp_path):
    """The dot interaction's index buffers were the two rows of one torch.tril_indices tensor, so every --export
    printed torch's "UserWarning: No complete tensor found in the group! Returning the first one. This may cause
    issues when your weights are not on CPU." (with its source line) after training."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    model = build_model(cfg.model, [7] * 26, None, cfg.kernels, "cpu").eval()
    arch = model.interaction_arch
    assert arch.tril_rows.untyped_storage().data_ptr() != arch.tril_cols.untyped_storage().data_ptr()
    assert arch.tril_rows.tolist() == torch.tril_indices(27, 27, offset=-1)[0].tolist()
    assert arch.tril_cols.tolist() == torch.tril_indices(27, 27, offset=-1)[1].tolist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export_mod.export_model(model, tmp_path / "m.pt2")
    assert not [w for w in caught if "complete tensor" in str(w.message)], [str(w.message) for w in caught]
    dense, raw = torch.randint(0, 50, (5, 13)), torch.randint(-1, 2**32, (5, 26))
    with torch.no_grad():
        expected = export_mod.RawInputDLRM(model)(dense, raw)
    np.testing.assert_allclose(torch.export.load(str(path)).module()(dense, raw).numpy(), expected.numpy(),
                               rtol=1e-6, atol=1e-7)
