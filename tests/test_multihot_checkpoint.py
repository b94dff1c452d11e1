"""A multi-hot checkpoint evaluates and exports as it trained (issue #22).

1. `--eval-only` builds the model as training resolved it (dlrm/train/export.py::model_from_checkpoint
   resolves "auto"): bf16 tables need the Triton embedding there too, so on the CPU the bf16 config
   is the same ConfigError as training, never a silent fp32 model (104.5 GB for MLPerf's tables).
2. A checkpoint records the multi-hot sizes it was trained with (they come from the dataset's
   metadata.json), and a dataset with other sizes but the same table sizes is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrm.config import ConfigError
from dlrm.data import synthetic
from dlrm.train.export import evaluate_checkpoint, model_from_checkpoint
from dlrm.train.trainer import build_for_data, train
from tests.test_multihot_train import SIZES, _restore_logging, config  # noqa: F401


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("bugs")
    synthetic.generate(root / "mh", 300, seed=2, cardinalities="tiny", multi_hot_sizes=SIZES, multi_hot_fill="variable")
    synthetic.generate(root / "one", 300, seed=2, cardinalities="tiny")  # same table sizes, one-hot
    summary = train(config(root / "mh", root, "a", **{"kernels.embedding": "torch", "train.max_steps": 2}))
    return root, Path(summary["checkpoint"])


def test_model_from_checkpoint_honours_embedding_dtype(trained):
    """Expected: what training does on this device (a ConfigError here, on the CPU, where "auto"
    picks the torch embedding), or bf16 tables. Got: fp32 PooledSparseArch tables, silently."""
    root, checkpoint = trained
    cpu_bf16 = {"model.embedding_dtype": "bf16", "train.device": "cpu"}  # kernels.embedding "auto"
    cfg = config(root / "mh", root, "b", **cpu_bf16)
    with pytest.raises(ConfigError, match="bf16"):
        train(config(root / "mh", root, "c", **cpu_bf16))  # training refuses it
    _, _, _, tables = build_for_data(cfg)
    try:
        model = model_from_checkpoint(cfg, checkpoint, tables, torch.device("cpu"))
    except ConfigError as e:
        assert "model.embedding_dtype" in str(e)
        return
    assert model.sparse_arch.weight.dtype == torch.bfloat16, (type(model.sparse_arch).__name__,
                                                               model.sparse_arch.weight.dtype)


def test_checkpoint_of_other_multi_hot_sizes_is_refused(trained):
    """Expected: a ConfigError naming the multi-hot sizes, as for differing table sizes. Got: the
    one-hot dataset evaluates the multi-hot checkpoint with a one-hot SparseArch."""
    root, checkpoint = trained
    with pytest.raises(ConfigError, match="multi_hot"):
        evaluate_checkpoint(config(root / "one", root, "d"), checkpoint, "validation")
