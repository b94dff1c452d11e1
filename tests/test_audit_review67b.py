"""Review of session 67's scale changes (audit helper, review67b): the streaming loader's footers parsed again at each
read (`dlrm.data.footer_cache`) are checked as the ones parsed at open were, and are not parsed again where that costs
more than the reads themselves."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.data import footer_cache
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import DatasetError, read_metadata
from tests.conftest import make_dataset


@pytest.mark.parametrize("change,match", [
    ("float", "part-00001.parquet: column SPARSE_3: type double"),
    ("drop", "part-00001.parquet: column SPARSE_3: missing"),
])
def test_a_shard_rewritten_since_open_is_checked_when_its_footer_is_parsed_again(tmp_path, monkeypatch, change, match):
    """A file whose footer was not kept, rewritten between the loader's open and its read: the footer parsed again
    describes the new file, whose schema nobody checked. Float ids were truncated to int64 in silence (the epoch ran
    on), a missing column raised a bare KeyError naming no file; a kept (stale) footer failed to decode, named."""
    monkeypatch.setattr(footer_cache, "FOOTER_CACHE_BYTES", 0)
    monkeypatch.setattr(footer_cache, "REPARSE_BYTES_PER_VALUE", float("inf"), raising=False)  # all parsed again
    root = tmp_path / "ds"
    make_dataset(root, {"train": 40, "validation": 20}, files_per_split=2, row_group_size=5)
    files = split_files(root, read_metadata(root), "train")
    loader = ParquetLoader(files, 8, "cpu")
    table = pq.read_table(files[1])
    i = table.schema.get_field_index("SPARSE_3")
    if change == "float":
        table = table.set_column(i, "SPARSE_3", pa.array(table.column(i).to_numpy().astype(np.float64) + 0.5))
    else:
        table = table.remove_column(i)
    pq.write_table(table, files[1], row_group_size=5)
    with pytest.raises(DatasetError, match=match):
        list(loader)


def _parses(monkeypatch) -> list[str]:
    """The footers `FooterCache` parses again (a ParquetFile opened without one)."""
    seen: list[str] = []
    real = footer_cache.pq.ParquetFile

    def counted(path, *args, **kwargs):
        if kwargs.get("metadata") is None:  # (the loader's reads pass the footer: pq is pyarrow's module, shared)
            seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(footer_cache.pq, "ParquetFile", counted)
    return seen


def test_a_footer_costlier_to_parse_than_its_row_groups_to_read_is_kept(tmp_path, monkeypatch):
    """A footer grows with its file's row groups, and one parsed again at each of them costs their count squared:
    measured, a one-hot file of 1,000 row groups of 4,096 rows took 25 ms a parse against 1.35 ms a row group's read
    (its epoch 19x slower). Such footers are kept past the budget; one small against its row groups (MLPerf's files)
    is still parsed again, within the budget."""
    monkeypatch.setattr(footer_cache, "FOOTER_CACHE_BYTES", 0)
    many = tmp_path / "many"
    make_dataset(many, {"train": 240, "validation": 20}, files_per_split=3, row_group_size=2)  # 40 row groups a file
    loader = ParquetLoader(split_files(many, read_metadata(many), "train"), 16, "cpu", shuffle=True, seed=1)
    seen = _parses(monkeypatch)
    assert sum(1 for _ in loader) == 15
    assert seen == [] and len(loader._footers) == 3  # (120 parses before: one a row group)

    monkeypatch.undo()
    monkeypatch.setattr(footer_cache, "FOOTER_CACHE_BYTES", 0)
    big = tmp_path / "big"
    make_dataset(big, {"train": 8000, "validation": 20}, files_per_split=2, row_group_size=4000)
    loader = ParquetLoader(split_files(big, read_metadata(big), "train"), 1000, "cpu")
    seen = _parses(monkeypatch)
    assert sum(1 for _ in loader) == 8
    assert len(seen) == 2 and len(loader._footers) == 0  # the budget holds for these
