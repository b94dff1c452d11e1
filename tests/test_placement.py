"""data.placement "auto": the data goes to GPU memory when it fits the stated share, else it streams (issue #19)."""

import pytest
import torch
from loguru import logger

from dlrm.config import load_config
from dlrm.data.schema import Metadata, SplitInfo
from dlrm.train.placement import DEVICE_BYTES_PER_ROW, choose_placement, device_bytes_per_row, table_bytes
from tests.conftest import REPO

GiB = 2**30
CARDS = [1000] * 26


def meta(train_rows, validation_rows=0):
    return Metadata(cardinalities=CARDS, splits={"train": SplitInfo(train_rows, 0, []),
                                                 "validation": SplitInfo(validation_rows, 0, [])})


@pytest.fixture
def free_memory(monkeypatch):
    """Pretend the CUDA device has `free` bytes free."""
    def set_free(free):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    return set_free


def test_fits_the_share_goes_to_gpu_else_streams(free_memory):
    cfg = load_config(REPO / "configs" / "sample.json")
    tables = table_bytes(cfg, CARDS)
    free_memory(tables + 8 * GiB)  # 25% of 8 GiB after the tables: 2 GiB for the data
    rows_fitting = (2 * GiB) // DEVICE_BYTES_PER_ROW
    cuda = torch.device("cuda")
    assert choose_placement(cfg, meta(rows_fitting - 10, 10), CARDS, cuda) == "gpu"
    assert choose_placement(cfg, meta(rows_fitting, 10), CARDS, cuda) == "stream"


def test_the_share_is_a_setting(free_memory):
    cfg = load_config(REPO / "configs" / "sample.json", {"data.gpu_memory_share": 1.0})
    free_memory(table_bytes(cfg, CARDS) + 8 * GiB)
    assert choose_placement(cfg, meta((7 * GiB) // DEVICE_BYTES_PER_ROW), CARDS, torch.device("cuda")) == "gpu"


def test_cpu_streams_and_explicit_settings_are_kept():
    cfg = load_config(REPO / "configs" / "sample.json")
    assert choose_placement(cfg, meta(10), CARDS, torch.device("cpu")) == "stream"
    for explicit in ("gpu", "stream"):
        cfg = load_config(REPO / "configs" / "sample.json", {"data.placement": explicit})
        assert choose_placement(cfg, meta(10**12), CARDS, torch.device("cuda")) == explicit


def test_the_choice_is_logged_with_its_numbers(free_memory):
    cfg = load_config(REPO / "configs" / "sample.json")
    free_memory(table_bytes(cfg, CARDS) + 4 * GiB)
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    try:
        choose_placement(cfg, meta(1000, 100), CARDS, torch.device("cuda"))
    finally:
        logger.remove(handle)
    assert any(m.startswith("data.placement auto: gpu (train + validation: 1,100 rows") for m in seen), seen


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1])
def test_share_out_of_range_is_a_config_error(bad):
    from dlrm.config import ConfigError

    with pytest.raises(ConfigError, match="data.gpu_memory_share"):
        load_config(REPO / "configs" / "sample.json", {"data.gpu_memory_share": bad})


def test_mlperf_counts_bf16_tables_and_every_multi_hot_slot(free_memory):
    """MLPerf DLRM-DCNv2 on an H200 (found there, twenty-fifth run): the tables are bf16 (2 B a value, plus row-wise
    Adagrad's fp32 sum a row), not fp32 (which counted 98 GiB for 49); a row on the device holds its 214 slots, not
    26. 139 GiB free: 2.34M rows (2.0 GiB) go to the GPU, 450M rows (382 GiB) stream."""
    cfg = load_config(REPO / "configs" / "mlperf-dcnv2.json")
    cards = cfg.model.cardinalities
    assert table_bytes(cfg, cards) == sum(cards) * (128 * 2 + 4)  # 53.1 GB
    sizes = cfg.model.multi_hot_sizes
    assert device_bytes_per_row(sizes) == 13 * 4 + 214 * 4 + 4 and device_bytes_per_row([1] * 26) == DEVICE_BYTES_PER_ROW
    assert table_bytes(cfg, cards, world_size=2) == table_bytes(cfg, cards) // 2

    def mlperf_meta(rows, validation_rows=0):
        return Metadata(cardinalities=cards, multi_hot_sizes=sizes,
                        splits={"train": SplitInfo(rows, 0, []), "validation": SplitInfo(validation_rows, 0, [])})

    free_memory(139 * GiB)
    cuda = torch.device("cuda")
    assert choose_placement(cfg, mlperf_meta(2_080_000, 260_000), cards, cuda) == "gpu"
    assert choose_placement(cfg, mlperf_meta(400_000_000, 50_000_000), cards, cuda) == "stream"
    # the share of what the tables leave: (139 GiB - 49.5) * 25% = 22.4 GiB, 26.4M rows of 912 B
    fitting = int((139 * GiB - table_bytes(cfg, cards)) * 0.25) // device_bytes_per_row(sizes)
    assert choose_placement(cfg, mlperf_meta(fitting - 10, 10), cards, cuda) == "gpu"
    assert choose_placement(cfg, mlperf_meta(fitting, 10), cards, cuda) == "stream"
