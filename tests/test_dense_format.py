"""Float dense columns (``dense_format`` "float", schema version 4): float32 values the model takes as they
are, e.g. MLPerf's preprocessed ``log(x + 3)``. Metadata and file checks, both loaders value for value, bad
values as one-line errors, relayout, and the whole path (train, resume checks, eval, export) against the same
rows stored as counts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.config import ConfigError, load_config
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files, transform_dense
from dlrm.data.schema import (
    DENSE_COLUMNS,
    NUM_SPARSE,
    DatasetError,
    Metadata,
    arrow_schema,
    read_metadata,
    write_metadata,
)
from dlrm.data.validation import file_layout
from tests.conftest import make_dataset

SIZES = [1] * NUM_SPARSE
SIZES[2], SIZES[7] = 3, 2  # two multi-hot features


def float_copy(src, dst, values=None):
    """`src` with every dense column as float32: `values(counts)` (default: the loaders' own transform of the
    counts, so the model sees the same inputs bit for bit), metadata saying ``dense_format`` "float"."""
    meta = read_metadata(src)
    values = values or (lambda counts: transform_dense(torch.from_numpy(counts)).numpy())
    for split in meta.splits:
        for path in split_files(src, meta, split):
            table = pq.read_table(path)
            layout = file_layout(table.schema, meta.multi_hot_sizes)
            schema = arrow_schema(meta.multi_hot_sizes, layout, "float")
            counts = np.stack([table.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
            new = values(counts)
            arrays = [pa.array(new[:, DENSE_COLUMNS.index(name)], pa.float32()) if name in DENSE_COLUMNS
                      else table.column(name) for name in table.column_names]
            out = dst / path.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            groups = pq.ParquetFile(path).metadata
            pq.write_table(pa.Table.from_arrays(arrays, schema=schema), out,
                           row_group_size=groups.row_group(0).num_rows)
    meta.dense_format = "float"
    write_metadata(dst, meta)
    return meta


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """One-hot counts (make_dataset) and multi-hot counts (the generator, slots), each with its float copy:
    `float_copy` for the one-hot data, ``relayout --dense-format float`` (into list columns) for the multi-hot."""
    from dlrm.data import synthetic
    from dlrm.data.relayout import relayout

    root = tmp_path_factory.mktemp("dense")
    make_dataset(root / "counts", {"train": 120, "validation": 40}, row_group_size=16)
    synthetic.generate(root / "mh-counts", 300, seed=2, cardinalities="tiny", multi_hot_sizes=SIZES,
                       multi_hot_fill="variable", validation_fraction=0.2)
    float_copy(root / "counts", root / "float")
    relayout(root / "mh-counts", root / "mh-float", "lists", dense_format="float")
    return root


# -- metadata and files ----------------------------------------------------------------------------------


def test_float_datasets_are_version_4_and_counts_keep_their_version(tmp_path):
    cases = [("float", SIZES, "slots", 4), ("float", None, "lists", 4), ("counts", SIZES, "slots", 3),
             ("counts", None, "lists", 2)]
    for k, (fmt, sizes, layout, version) in enumerate(cases):
        meta = Metadata(cardinalities=[5] * NUM_SPARSE, multi_hot_sizes=sizes or [1] * NUM_SPARSE,
                        sparse_layout=layout, dense_format=fmt)
        write_metadata(tmp_path / str(k), meta)
        raw = json.loads((tmp_path / str(k) / "metadata.json").read_text())
        assert raw["schema_version"] == version and raw.get("dense_format") == ("float" if version == 4 else None)
        back = read_metadata(tmp_path / str(k))
        assert back.dense_format == fmt and back.to_json() == raw
    with pytest.raises(ValueError, match="dense format 'log' is not one of counts, float"):
        Metadata(cardinalities=[5] * NUM_SPARSE, dense_format="log")
    assert [f.type for f in arrow_schema(None, "lists", "float")][1:14] == [pa.float32()] * 13


@pytest.mark.parametrize("change,message", [
    ({"schema_version": 3, "dense_format": "float"}, r"dense_format: is a schema_version 4 key \(this file says version 3\)"),
    ({"schema_version": 4, "dense_format": "log"}, r"dense_format: 'log' is not 'counts' or 'float'"),
    ({"schema_version": 4, "dense_format": None}, r"dense_format: None is not 'counts' or 'float'"),
])
def test_bad_dense_format_in_metadata_is_one_named_error(tmp_path, change, message):
    raw = {**Metadata(cardinalities=[5] * NUM_SPARSE).to_json(), **change}
    (tmp_path / "metadata.json").write_text(json.dumps(raw))
    with pytest.raises(DatasetError, match=r"metadata.json: " + message) as e:
        read_metadata(tmp_path)
    assert "\n" not in str(e.value)


LOADERS = {
    "stream": lambda files, meta, **kw: ParquetLoader(files, 16, multi_hot_sizes=meta.multi_hot_sizes,
                                                      dense_format=meta.dense_format, shuffle_buffer_rows=40, **kw),
    "stream-compact": lambda files, meta, **kw: ParquetLoader(files, 16, multi_hot_sizes=meta.multi_hot_sizes,
                                                              dense_format=meta.dense_format, compact_sparse=True, **kw),
    "device": lambda files, meta, **kw: DeviceLoader(files, 16, "cpu", multi_hot_sizes=meta.multi_hot_sizes,
                                                     dense_format=meta.dense_format, **kw),
}


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("name", ["", "mh-"])
def test_loaders_feed_float_values_as_they_are(datasets, kind, name):
    """The float copy (values = the loaders' transform of the counts) gives the counts dataset's batches bit for
    bit, shuffled the same way; and the batches hold the stored float32 values themselves."""
    counts, floats = datasets / f"{name}counts", datasets / f"{name}float"
    meta_c, meta_f = read_metadata(counts), read_metadata(floats)
    assert meta_f.dense_format == "float" and meta_c.dense_format == "counts"
    a = list(LOADERS[kind](split_files(counts, meta_c, "train"), meta_c, shuffle=True, seed=4))
    b = list(LOADERS[kind](split_files(floats, meta_f, "train"), meta_f, shuffle=True, seed=4))
    assert len(a) == len(b) > 3
    for x, y in zip(a, b):
        assert y.dense.dtype == torch.float32 and torch.equal(x.dense, y.dense)
        assert torch.equal(x.sparse, y.sparse) and torch.equal(x.labels, y.labels)
    stored = pa.concat_tables([pq.read_table(f) for f in split_files(floats, meta_f, "validation")])
    want = np.stack([stored.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
    got = torch.cat([batch.dense for batch in LOADERS[kind](split_files(floats, meta_f, "validation"), meta_f)])
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))  # every bit, -0.0 included


def test_arbitrary_float_values_including_negatives_and_large_ones(tmp_path, datasets):
    """Values a counts transform could never give (negative, fractional, 1e30, subnormal) arrive unchanged."""
    special = np.array([-7.25, 1e30, -0.0, 1e-40, 3.5, -1e-3, 0.1, 2.0**-20, -65504.0, 1.0, 0.0, 42.0, 7e-8],
                       dtype=np.float32)
    float_copy(datasets / "counts", tmp_path / "f", lambda counts: np.tile(special, (len(counts), 1)) * (
        1 + (counts[:, :1] % 3)).astype(np.float32))
    meta = read_metadata(tmp_path / "f")
    for kind in LOADERS:
        batches = list(LOADERS[kind](split_files(tmp_path / "f", meta, "validation"), meta))
        dense = torch.cat([b.dense for b in batches]).numpy()
        stored = pa.concat_tables([pq.read_table(f) for f in split_files(tmp_path / "f", meta, "validation")])
        want = np.stack([stored.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
        np.testing.assert_array_equal(dense.view(np.int32), want.view(np.int32))
        assert dense[0, 1] == np.float32(1e30) * np.float32(1 + 0 % 3)


@pytest.mark.parametrize("kind", ["stream", "device"])
def test_a_file_in_the_other_dense_format_is_one_named_error(tmp_path, datasets, kind):
    """A counts file in a float dataset (and the other way round) is refused at open, naming the file and column."""
    shutil.copytree(datasets / "float", tmp_path / "mixed")
    meta = read_metadata(tmp_path / "mixed")
    counts_file = split_files(datasets / "counts", read_metadata(datasets / "counts"), "train")[1]
    target = split_files(tmp_path / "mixed", meta, "train")[1]
    shutil.copy(counts_file, target)
    with pytest.raises(DatasetError) as e:
        LOADERS[kind](split_files(tmp_path / "mixed", meta, "train"), meta)
    assert str(e.value) == (f"{target}: column DENSE_0: type int32 is not float (the dataset's dense_format is "
                            "'float': metadata.json, or the dense_format the loader was given)")
    c_meta = read_metadata(datasets / "counts")
    with pytest.raises(DatasetError, match=r"DENSE_0: type float is not int32 \(the dataset's dense_format is 'counts'"):
        LOADERS[kind](split_files(datasets / "float", meta, "train"), c_meta)


def _damage(path, row, column, value):
    table = pq.read_table(path)
    dense = table.column(column).to_pylist()
    dense[row] = value
    i = table.schema.get_field_index(column)
    field = table.schema.field(i).with_nullable(value is None)
    pq.write_table(table.set_column(i, field, pa.array(dense, pa.float32())), path, row_group_size=16)


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_one_line_naming_file_column_and_row(tmp_path, datasets, kind, value):
    shutil.copytree(datasets / "float", tmp_path / "ds")
    meta = read_metadata(tmp_path / "ds")
    path = split_files(tmp_path / "ds", meta, "train")[1]
    _damage(path, 21, "DENSE_5", value)
    with pytest.raises(DatasetError) as e:
        list(LOADERS[kind](split_files(tmp_path / "ds", meta, "train"), meta))
    assert str(e.value) == (f"{path}: column DENSE_5: row index 21 (row group 1) holds {value}; "
                            "float dense values must be finite")


def test_a_null_float_value_reads_as_zero_and_is_logged(tmp_path, datasets):
    from loguru import logger

    shutil.copytree(datasets / "float", tmp_path / "ds")
    meta = read_metadata(tmp_path / "ds")
    path = split_files(tmp_path / "ds", meta, "validation")[0]
    _damage(path, 3, "DENSE_2", None)
    messages = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        for kind in LOADERS:
            dense = torch.cat([b.dense for b in LOADERS[kind](split_files(tmp_path / "ds", meta, "validation"), meta)])
            assert dense[3, 2].item() == 0.0 and dense[4, 2].item() != 0.0
    finally:
        logger.remove(sink)
    assert f"{path}: 1 null dense values replaced by 0 (DENSE_2 1)" in [m.strip() for m in messages]


def test_relayout_makes_float_copies_and_keeps_float_values(tmp_path, datasets):
    """``--dense-format float`` stores the loaders' transform of the counts (float_copy's values, bit for bit);
    a float dataset relayouts with its values kept; float values cannot go back to counts (one line)."""
    from click.testing import CliRunner

    from dlrm.data.relayout import main, relayout

    res = CliRunner().invoke(main, ["--data", str(datasets / "counts"), "--output", str(tmp_path / "f"),
                                    "--dense-format", "float"])
    assert res.exit_code == 0, res.output
    meta = read_metadata(tmp_path / "f")
    assert meta.dense_format == "float" and meta.extra["relayout"]["from_dense_format"] == "counts"
    for split in meta.splits:
        for a, b in zip(split_files(datasets / "float", meta, split), split_files(tmp_path / "f", meta, split)):
            assert pq.read_table(a).equals(pq.read_table(b))
    new = relayout(datasets / "mh-float", tmp_path / "slots", "slots")
    assert new.dense_format == "float" and new.written_version == 4 and new.sparse_layout == "slots"
    for split in new.splits:
        for a, b in zip(split_files(datasets / "mh-float", new, split), split_files(tmp_path / "slots", new, split)):
            assert pq.read_table(a).select(DENSE_COLUMNS).equals(pq.read_table(b).select(DENSE_COLUMNS))
            assert pq.read_schema(b).field("DENSE_0").type == pa.float32()
    res = CliRunner().invoke(main, ["--data", str(datasets / "float"), "--output", str(tmp_path / "c"),
                                    "--dense-format", "counts"])
    assert res.exit_code == 2 and "'counts' is not one of" in res.output  # not a choice on the command line
    with pytest.raises(Exception, match="float values cannot be turned back into counts"):
        relayout(datasets / "float", tmp_path / "c", "slots", dense_format="counts")
    assert not (tmp_path / "c").exists()


# -- training, checkpoints, evaluation and export ---------------------------------------------------------

CONFIG = {
    "data": {"batch_size": 16, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 2, "log_every": 4, "device": "cpu", "deterministic": True, "seed": 3},
    "checkpoint": {"every": 8, "keep": 2},
}


def run_config(tmp_path, data, name):
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return load_config(path, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": name})


def test_a_float_dataset_trains_exactly_as_its_counts_and_exports_float_input(tmp_path, datasets):
    """The same rows as counts and as their transform in float columns: the same losses, weights and metrics; the
    checkpoint records the format, so resuming, evaluating or exporting it against the other dataset is refused
    with one line; the exported program takes float32 [B, 13] dense values (int64 counts refused) and predicts
    as the model does."""
    from dlrm import checkpoint as ckpt
    from dlrm.train.export import evaluate_checkpoint, export_checkpoint, model_from_checkpoint
    from dlrm.train.trainer import build_for_data, train

    runs = {name: train(run_config(tmp_path, datasets / name, name)) for name in ("counts", "float")}
    a, b = runs["counts"], runs["float"]
    assert a["train_losses"] == b["train_losses"] and a["auc"] == b["auc"] and a["logloss"] == b["logloss"]
    states = {k: ckpt.load_checkpoint(r["checkpoint"]) for k, r in runs.items()}
    assert states["counts"]["dense_format"] == "counts" and states["float"]["dense_format"] == "float"
    for k in states["counts"]["model"]:
        assert torch.equal(states["counts"]["model"][k], states["float"]["model"][k]), k
    # the float checkpoint against the counts data: refused where it would load
    cfg = run_config(tmp_path, datasets / "counts", "other")
    with pytest.raises(ConfigError) as e:
        evaluate_checkpoint(cfg, b["checkpoint"], "validation")
    assert str(e.value) == (f"{b['checkpoint']}: dense_format differs: the checkpoint was trained on 'float' dense "
                            "columns, this run's data holds 'counts' (metadata.json)")
    middle = ckpt.list_checkpoints(tmp_path / "tb" / "float")[0]  # step 8 of 14: a resume that would train
    with pytest.raises(ConfigError, match="dense_format differs"):  # even where another data.path is allowed
        train(run_config(tmp_path, datasets / "counts", "resumed"), resume=str(middle), allow_config_change=["data.path"])
    assert not (tmp_path / "tb" / "resumed").exists()
    assert not (tmp_path / "tb" / "other").exists()
    # evaluation and export on its own data
    cfg = run_config(tmp_path, datasets / "float", "float-eval")
    assert evaluate_checkpoint(cfg, b["checkpoint"], "validation")["auc"] == pytest.approx(b["auc"], abs=1e-6)
    program = torch.export.load(str(export_checkpoint(cfg, b["checkpoint"], tmp_path / "m.pt2"))).module()
    device, _, _, tables = build_for_data(cfg)
    model = model_from_checkpoint(cfg, b["checkpoint"], tables, device)
    rng = np.random.default_rng(1)
    for n in (1, 3, 33):
        dense = torch.from_numpy(rng.normal(0, 3, (n, 13)).astype(np.float32))
        raw = torch.from_numpy(rng.integers(-1, 2**32, (n, 26)))
        torch.testing.assert_close(program(dense, raw), model.predict(dense, raw), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="dtype"):
        program(dense.to(torch.int64), raw)
    with pytest.raises(ConfigError, match="dense_format differs"):
        export_checkpoint(run_config(tmp_path, datasets / "counts", "x"), b["checkpoint"], tmp_path / "n.pt2")
    assert not (tmp_path / "n.pt2").exists()


def test_an_old_checkpoint_without_the_key_is_counts(tmp_path, datasets):
    from dlrm import checkpoint as ckpt

    state = {"model": {}, "cardinalities": [11] * NUM_SPARSE, "config": {"model": {}}}
    with pytest.raises(ConfigError, match="dense_format differs: the checkpoint was trained on 'counts'"):
        ckpt.check_compatible(state, torch.nn.Linear(1, 1), [11] * NUM_SPARSE, {}, tmp_path / "c.pt",
                              dense_format="float")


@pytest.mark.gpu  # skipped without CUDA by the hook in tests/conftest.py
@pytest.mark.parametrize("name", ["", "mh-"])
def test_cuda_loaders_deliver_the_stored_bits(datasets, name):
    """On CUDA the values cross in pinned int32 buffers and are reinterpreted on the device: both loaders' batches
    hold the stored float32 values bit for bit, and the counts dataset's transform agrees within float32 rounding."""
    floats, counts = datasets / f"{name}float", datasets / f"{name}counts"
    meta = read_metadata(floats)
    stored = pa.concat_tables([pq.read_table(f) for f in split_files(floats, meta, "validation")])
    want = np.stack([stored.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
    for loader in (ParquetLoader(split_files(floats, meta, "validation"), 16, "cuda", multi_hot_sizes=meta.multi_hot_sizes,
                                 dense_format="float"),
                   DeviceLoader(split_files(floats, meta, "validation"), 16, "cuda", multi_hot_sizes=meta.multi_hot_sizes,
                                dense_format="float")):
        got = torch.cat([batch.dense for batch in loader]).cpu().numpy()
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    meta_c = read_metadata(counts)
    from_counts = torch.cat([b.dense for b in ParquetLoader(split_files(counts, meta_c, "validation"), 16, "cuda",
                                                            multi_hot_sizes=meta_c.multi_hot_sizes)]).cpu().numpy()
    np.testing.assert_allclose(from_counts, want, rtol=2e-7, atol=0)
