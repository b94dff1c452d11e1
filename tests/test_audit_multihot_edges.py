"""Multi-hot (MLPerf DLRM-DCNv2, issue #22) edge cases found by an audit: each test failed before its fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dlrm.config import ConfigError, load_config
from dlrm.data import mlperf_import as mi
from dlrm.data import synthetic
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import MAX_MULTI_HOT_SIZE, NUM_SPARSE, DatasetError, read_metadata
from tests.conftest import REPO

MLPERF = REPO / "configs" / "mlperf-dcnv2.json"

CARDS = [7 + f for f in range(NUM_SPARSE)]


def _mlperf_day(root, i: int, n: int, sizes: list[int]) -> None:
    """MLPerf's three files of day `i`: `n` rows, feature f `sizes[f]` ids a row."""
    rng = np.random.default_rng(i)
    np.save(root / f"day_{i}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    np.save(root / f"day_{i}_dense.npy", np.log(rng.integers(0, 3000, (n, 13)) + 3.0).astype(np.float32))
    np.savez(root / f"day_{i}_sparse_multi_hot.npz",
             **{str(f): rng.integers(0, CARDS[f], (n, s)).astype(np.int32) for f, s in enumerate(sizes)})


def test_mlperf_import_refuses_more_values_a_row_than_a_dataset_may_hold(tmp_path):
    """A member of more than MAX_MULTI_HOT_SIZE ids a row: the import used to finish (exit 0) and write a
    metadata.json every reader refuses ("multi_hot_sizes[1]: 65537 is not an integer in [1, 65536]"); now it
    stops at once, one line naming the file and member, --output not written."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    sizes = [2, MAX_MULTI_HOT_SIZE + 1] + [1] * (NUM_SPARSE - 2)
    for i in (0, 23):
        _mlperf_day(src, i, 2, sizes)
    res = CliRunner().invoke(mi.main, ["--input", str(src), "--output", str(out), "--train-days", "0",
                                       "--num-embeddings", ",".join(map(str, CARDS)), "--workers", "1",
                                       "--sparse-layout", "lists"])
    assert res.exit_code == 2, res.output
    assert f"day_0_sparse_multi_hot.npz: member 1.npy: {MAX_MULTI_HOT_SIZE + 1} values a row" in res.output
    assert "Traceback" not in res.output
    assert not out.exists() and not mi.partial_dir(out).exists()


SIZES = [1] * NUM_SPARSE
SIZES[5] = 3


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A multi-hot dataset (feature 5 of size 3) in each layout."""
    root = tmp_path_factory.mktemp("mh-sizes")
    for layout in ("lists", "slots"):
        synthetic.generate(root / layout, 40, seed=1, cardinalities="tiny", multi_hot_sizes=SIZES,
                           multi_hot_fill="variable", sparse_layout=layout)
    return root


@pytest.mark.parametrize("layout, feature, size, column", [
    ("lists", 6, 2, "column SPARSE_6: type int64 is not list"),  # one-hot in the file, multi-hot in metadata.json
    ("slots", 6, 2, "column SPARSE_6_0: missing"),
    ("slots", 5, 4, "column SPARSE_5_3: missing"),  # 3 slot columns in the file, 4 in metadata.json
    ("slots", 5, 2, "column SPARSE_5_2: not part of the dataset schema"),
    ("slots", 5, 1, "column SPARSE_5: missing"),
])
def test_multi_hot_sizes_other_than_the_files_name_the_key(written, tmp_path, layout, feature, size, column):
    """metadata.json's multi_hot_sizes[f] disagreeing with how the shards hold feature f: the one-line error named
    the column only ("column SPARSE_6_0: missing", "type int64 is not list<item: int64>"), though
    `validation._type_error` says it names a multi-hot mismatch (it did so only for a list column where the size is
    1); now it names the key and what the file holds."""
    meta = json.loads((written / layout / "metadata.json").read_text())
    meta["multi_hot_sizes"][feature] = size
    data = tmp_path / layout
    data.mkdir()
    for split in meta["splits"]:
        (data / split).symlink_to(written / layout / split)
    (data / "metadata.json").write_text(json.dumps(meta))
    info = read_metadata(data)
    with pytest.raises(DatasetError) as e:
        ParquetLoader(split_files(data, info, "train"), 8, multi_hot_sizes=info.multi_hot_sizes)
    message = str(e.value)
    assert "\n" not in message and str(data / "train") in message and column in message, message
    held = "one column SPARSE_6" if feature == 6 else "3 slot columns"
    assert f"(the file holds feature {feature} in {held}, the dataset's multi_hot_sizes[{feature}] is {size}: " \
           "metadata.json" in message, message


@pytest.mark.parametrize("sizes, message", [
    ([0] + [1] * (NUM_SPARSE - 1), "model.multi_hot_sizes[0]: 0 must be > 0"),
    ([2.5] + [1] * (NUM_SPARSE - 1), "model.multi_hot_sizes[0]: expected an integer, got 2.5"),
    ([1] * (NUM_SPARSE - 1) + [MAX_MULTI_HOT_SIZE + 1], f"model.multi_hot_sizes[25]: {MAX_MULTI_HOT_SIZE + 1} must be "
                                                        f"<= {MAX_MULTI_HOT_SIZE}"),
])
def test_a_bad_multi_hot_size_from_an_override_is_blamed_on_the_command_line(tmp_path, sizes, message):
    """An override's (a sweep's --set, or load_config's) bad list element was named as the config file's
    ("configs/mlperf-dcnv2.json: model.multi_hot_sizes[0]: ..."), which holds no such value; a scalar key's was
    "command line: ..." already (`dlrm.config._blame_overrides`)."""
    with pytest.raises(ConfigError) as err:
        load_config(MLPERF, {"model.multi_hot_sizes": sizes})
    assert str(err.value) == f"command line: {message}"
    # the file's own bad element is still the file's
    raw = json.loads(MLPERF.read_text())
    raw["model"]["multi_hot_sizes"] = sizes
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_config(path, {"model.embedding_dim": 128})
    assert str(err.value) == f"{path}: {message}"
