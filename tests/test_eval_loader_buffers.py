"""The evaluation loaders (the run's evaluations and `--eval-only`) decode ``data.shuffle_buffer_rows`` rows at a time,
as the training loader does: they took the loader's default (1M rows, ~0.9 GB a buffer of MLPerf's rows, prefetch + 1
of them pinned) whatever the config said. The rows, their order and the metrics do not depend on it."""

from __future__ import annotations

import torch

import dlrm.train.export as export
from dlrm import checkpoint as ckpt
from dlrm.config import config_from_dict
from dlrm.data.parquet_loader import ParquetLoader
from dlrm.data.loader import split_files
from dlrm.data.schema import read_metadata
from dlrm.train.export import evaluate_checkpoint
from dlrm.train.trainer import make_loader, train
from tests.conftest import make_dataset

BUFFER = 64


def _config(data, tb, name, buffer_rows):
    return config_from_dict({
        "data": {"path": str(data), "batch_size": 16, "shuffle_buffer_rows": buffer_rows},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "train": {"max_steps": 3, "device": "cpu", "seed": 3, "baseline": False, "compile": False},
        "log": {"tb_dir": str(tb), "run_name": name},
    }, "test")


def _batches(loader):
    return [(b.dense.clone(), b.sparse.clone(), b.labels.clone()) for b in loader]


def test_the_run_s_evaluation_loader_takes_the_configured_buffer(tmp_path):
    data = tmp_path / "ds"
    make_dataset(data, {"train": 64, "validation": 300}, row_group_size=20)
    meta = read_metadata(data)
    files = split_files(data, meta, "validation")
    loaders = {rows: make_loader(_config(data, tmp_path, "x", rows), files, 32, torch.device("cpu"), train=False)
               for rows in (BUFFER, 1_000_000)}
    assert loaders[BUFFER].shuffle_buffer_rows == BUFFER
    assert loaders[BUFFER]._new_rows < 300 == loaders[1_000_000]._new_rows  # 64 - 1 + a row group, not the split
    small, whole = (_batches(loaders[r]) for r in (BUFFER, 1_000_000))
    assert len(small) == len(whole) == 10  # 300 rows, 32 a batch, the last one of 12 kept
    for a, b in zip(small, whole):  # every row, in the files' order, whatever the buffer
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_eval_only_takes_the_configured_buffer(tmp_path, monkeypatch):
    data = tmp_path / "ds"
    make_dataset(data, {"train": 64, "validation": 300}, row_group_size=20)
    summary = train(_config(data, tmp_path / "tb", "run", BUFFER))
    made = []

    def recording(*args, **kwargs):
        made.append(ParquetLoader(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(export, "ParquetLoader", recording)
    last = ckpt.list_checkpoints(tmp_path / "tb" / "run")[-1]
    evaluated = evaluate_checkpoint(_config(data, tmp_path / "tb", "eval", BUFFER), last, "validation")
    assert [loader.shuffle_buffer_rows for loader in made] == [BUFFER]
    assert evaluated["rows"] == 300
    for metric in ("auc", "logloss", "accuracy"):  # the run's own last evaluation, on buffers of the same size
        assert evaluated[metric] == summary[metric], metric
