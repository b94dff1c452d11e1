"""Mutation-audit tests of the data stream (host arena, device loader, validation, synthetic chunks, output dirs):
errors name the right file, row group and row; rows arrive once, in order, with their values; a failed swap of an
output directory never loses the user's old one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import split_files
from dlrm.data.schema import DatasetError, read_metadata
from tests.conftest import make_dataset


def _train_files(tmp_path, rows=40, **kw):
    root = tmp_path / "ds"
    make_dataset(root, {"train": rows, "validation": 10}, **kw)
    return split_files(root, read_metadata(root), "train")


def test_device_loader_names_the_row_group_that_cannot_be_read_not_the_file_index(tmp_path, monkeypatch):
    """Row group 2 of the first file fails to decode: the error names that row group (2), not the file's index (0)."""
    files = _train_files(tmp_path)  # 2 files of 20 rows, row groups of 7: groups 0, 1, 2 each
    real = pq.ParquetFile.read_row_group

    def failing(self, i, *args, **kwargs):
        if i == 2:
            raise OSError("corrupt page")
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", failing)
    with pytest.raises(DatasetError, match=r"part-00000\.parquet: row group 2: cannot be read \(corrupt page\)$"):
        DeviceLoader(files, 8, "cpu")


# -- output directories ---------------------------------------------------------------------------


def _finished_tmp(parent, name="new.txt"):
    """A finished output as the tools leave it: a mkdtemp (mode 0700) sibling holding one file."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix=".out.tmp-", dir=parent))
    (tmp / name).write_text("new\n")
    return tmp


def test_replace_dir_swaps_in_a_readable_directory_and_removes_the_old_one(tmp_path):
    """The finished directory replaces the old one whole, readable by others (0755, not mkdtemp's 0700), and the
    set-aside old directory is gone afterwards."""
    import stat

    from dlrm.data.output_dirs import replace_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old\n")
    tmp = _finished_tmp(tmp_path)
    replace_dir(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and (out / "new.txt").read_text() == "new\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # neither the tmp nor the set-aside old one is left


@pytest.mark.parametrize("fail", ["rename", "chmod"])
def test_a_failed_swap_leaves_the_users_old_directory_in_place(tmp_path, monkeypatch, fail):
    """The old output is set aside before the finished one is renamed in; if that rename (or the chmod before it)
    fails, or a Ctrl-C lands between the two renames, the user's directory must be back where it was, whole (not
    deleted, not left under a hidden ``.out.old-*`` name), and the error still raised."""
    import os

    from dlrm.data import output_dirs

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "precious.txt").write_text("precious\n")
    tmp = _finished_tmp(tmp_path)
    real_replace, real_chmod = os.replace, os.chmod

    def replace(src, dst):
        if fail == "rename" and os.fspath(src) == os.fspath(tmp):
            raise OSError("no space left on device")
        return real_replace(src, dst)

    def chmod(path, mode):
        if fail == "chmod":
            raise KeyboardInterrupt
        return real_chmod(path, mode)

    monkeypatch.setattr(output_dirs.os, "replace", replace)
    monkeypatch.setattr(output_dirs.os, "chmod", chmod)
    with pytest.raises(OSError if fail == "rename" else KeyboardInterrupt):
        output_dirs.replace_dir(tmp, out)
    assert (out / "sub" / "precious.txt").read_text() == "precious\n"
    assert sorted(p.name for p in out.rglob("*")) == ["precious.txt", "sub"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]


def test_device_loader_refuses_a_multi_hot_size_of_zero(tmp_path):
    """A feature of 0 slots would give a row no place for its value: refused before any file is read."""
    files = _train_files(tmp_path)
    for bad in (0, -1):
        sizes = [1] * 26
        sizes[4] = bad
        with pytest.raises(ValueError, match=r"multi_hot_sizes must be 26 integers >= 1"):
            DeviceLoader(files, 8, "cpu", multi_hot_sizes=sizes)


def test_an_output_under_a_file_is_refused_naming_that_file(tmp_path):
    """--out below an existing regular file cannot be created: one line naming the file as not a directory."""
    import click

    from dlrm.data.output_dirs import check_parent_writable

    blocker = tmp_path / "notes.txt"
    blocker.write_text("x\n")
    with pytest.raises(click.ClickException) as e:
        check_parent_writable(blocker / "a" / "ds", "--out")
    assert e.value.message == f"--out {blocker / 'a' / 'ds'}: {blocker} is not a directory"
    assert blocker.read_text() == "x\n"
    check_parent_writable(tmp_path / "new" / "ds", "--out")  # a missing parent under a writable directory is fine


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_dataset_directory_over_an_existing_file_is_refused_even_with_overwrite(tmp_path, overwrite):
    """--out naming a regular file: one line saying so, --overwrite or not, and the file is left as it was (the
    generator would otherwise fail late, after all its work, renaming a directory over a file)."""
    import click

    from dlrm.data import synthetic
    from dlrm.data.output_dirs import check_target

    target = tmp_path / "ds"
    target.write_text("not a dataset\n")
    with pytest.raises(click.ClickException) as e:
        check_target(target, overwrite, "directory")
    assert e.value.message == f"{target} exists and is not a directory"
    with pytest.raises(click.ClickException, match="exists and is not a directory"):
        synthetic.generate(target, 100, cardinalities="tiny", overwrite=overwrite)
    assert target.read_text() == "not a dataset\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary directory left behind


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_raw_tsv_path_that_is_a_directory_is_refused_and_left_alone(tmp_path, overwrite):
    """--raw-tsv naming an existing directory (even an empty one): one line saying a file path is expected, and the
    directory and what it holds stay as they were, --overwrite or not."""
    import click

    from dlrm.data.output_dirs import check_target

    folder = tmp_path / "raw"
    folder.mkdir()
    with pytest.raises(click.ClickException) as e:
        check_target(folder, overwrite, "file")
    assert e.value.message == f"{folder} is a directory, expected a file path for the raw TSV"
    (folder / "keep.txt").write_text("keep\n")
    with pytest.raises(click.ClickException) as e:
        check_target(folder, overwrite, "file")
    assert e.value.message == f"{folder} is a directory, expected a file path for the raw TSV"
    assert (folder / "keep.txt").read_text() == "keep\n"


# -- the compact (int32) sparse form -------------------------------------------------------------


def test_a_shard_without_statistics_never_travels_compactly(tmp_path):
    """Without max statistics nothing proves the values fit 32 bits: 0xFFFFFFFF (whose low bits read as -1, missing)
    must keep int64 and arrive exact, even when the compact form is asked for."""
    from dlrm.data.host_arena import compact_sparse_ok
    from dlrm.data.loader import ParquetLoader
    from tests.conftest import write_rows

    sparse = np.array([[7] * 26, [2**32 - 1] + [5] * 25, [-1] * 26], dtype=np.int64)
    label, dense = np.array([0, 1, 0]), np.arange(39).reshape(3, 13)
    write_rows(tmp_path / "with.parquet", label, dense, sparse, 2)
    table = pq.read_table(tmp_path / "with.parquet")
    pq.write_table(table, tmp_path / "without.parquet", row_group_size=2, write_statistics=False)
    assert not compact_sparse_ok([pq.ParquetFile(tmp_path / "without.parquet").metadata])
    assert not compact_sparse_ok([pq.ParquetFile(tmp_path / "with.parquet").metadata])  # the statistics show it
    sparse[1, 0] = 2**32 - 2  # now every value fits, but only the file with statistics can prove it
    write_rows(tmp_path / "with.parquet", label, dense, sparse, 2)
    pq.write_table(pq.read_table(tmp_path / "with.parquet"), tmp_path / "fits.parquet", write_statistics=False)
    assert compact_sparse_ok([pq.ParquetFile(tmp_path / "with.parquet").metadata])
    assert not compact_sparse_ok([pq.ParquetFile(tmp_path / "fits.parquet").metadata])
    loader = ParquetLoader([tmp_path / "without.parquet"], 3, compact_sparse=True)
    got = next(iter(loader)).sparse.numpy()
    assert got[1, 0] == 2**32 - 1 and got[2, 0] == -1
    np.testing.assert_array_equal(got, np.array([[7] * 26, [2**32 - 1] + [5] * 25, [-1] * 26]))


# -- synthetic chunks -----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_chunks_come_in_order_each_its_own_stream_and_the_last_one_short(monkeypatch, workers):
    """Small chunks (50 rows) so that one dataset spans several: every chunk arrives once, in row order, the last
    one holding just the rows left; each is exactly `make_chunk` of its own number, and no two chunks repeat one
    stream (chunk 2 is not chunk 0 again), whatever the number of worker processes."""
    from dlrm.data import synthetic, synthetic_chunks
    from dlrm.data.synthetic_chunks import chunks, make_chunk
    from dlrm.data.teacher import Teacher

    cards = synthetic.CARDINALITY_PRESETS["tiny"]
    teacher = Teacher(5, cards, bias=0.0)
    monkeypatch.setattr(synthetic_chunks, "CHUNK_ROWS", 50)
    got = list(chunks(5, 175, cards, teacher, workers=workers))
    assert [start for start, _ in got] == [0, 50, 100, 150]
    assert [len(chunk[2]) for _, chunk in got] == [50, 50, 50, 25]
    for c, (_, (rows, p, labels, sparse)) in enumerate(got):
        ref_rows, ref_p, ref_labels, ref_sparse = make_chunk(5, c, 50 if c < 3 else 25, cards, teacher)
        np.testing.assert_array_equal(rows.dense, ref_rows.dense)
        np.testing.assert_array_equal(p, ref_p)
        np.testing.assert_array_equal(labels, ref_labels)
        np.testing.assert_array_equal(sparse, ref_sparse)
    firsts = [chunk[3][:25].tobytes() for _, chunk in got]
    assert len(set(firsts)) == 4  # four independent streams


# -- labels checked at open -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2])
def test_a_label_the_footer_shows_out_of_range_fails_when_the_loader_opens(tmp_path, bad):
    """The footer's statistics show a label below 0 as well as one above 1: the stream loader refuses the file when
    it is made (before any epoch starts), naming file, row group and the row within the file."""
    from dlrm.data.loader import ParquetLoader

    files = _train_files(tmp_path)  # part-00001 holds rows 20..39 of the split, row groups of 7
    shard = files[1]
    cols = pq.read_table(shard).to_pydict()
    cols["label"][16] = bad  # row group 2 of that file
    table = pa.Table.from_pydict(cols, schema=pq.read_schema(shard))
    pq.write_table(table, shard, row_group_size=7)
    with pytest.raises(DatasetError, match=rf"part-00001\.parquet: column label: row index 16 \(row group 2\) "
                                           rf"holds {bad}; labels must be 0 or 1$"):
        ParquetLoader(files, 8)


def test_multi_hot_stored_values_hash_every_category_id_including_0():
    """Every multi-hot slot holding a category id (0 included: the first category is a category, not a missing
    value) stores that id's hash value; -1 (missing) and -2 (empty slot) stay as they are."""
    from dlrm.data import synthetic
    from dlrm.data.schema import MISSING_SPARSE, PAD_SPARSE, slot_offsets
    from dlrm.data.synthetic_chunks import stored_values
    from dlrm.data.teacher import category_values

    cards = synthetic.CARDINALITY_PRESETS["tiny"]
    sizes = [1] * 26
    sizes[2] = 3
    offsets = slot_offsets(sizes)
    ids = np.zeros((3, offsets[-1]), dtype=np.int64)  # every one-hot slot category 0
    ids[:, offsets[2] : offsets[3]] = [[0, 5, PAD_SPARSE], [MISSING_SPARSE, PAD_SPARSE, PAD_SPARSE], [7, 0, 1]]
    got = stored_values(9, cards, sizes, ids)
    for f in range(26):
        block, want = ids[:, offsets[f] : offsets[f + 1]], got[:, offsets[f] : offsets[f + 1]]
        present = block >= 0
        np.testing.assert_array_equal(want[present], category_values(9, f, cards[f], block[present]))
        np.testing.assert_array_equal(want[~present], block[~present])
    assert got[0, 0] == category_values(9, 0, cards[0], np.array([0]))[0]
    assert got[1, offsets[2]] == MISSING_SPARSE and got[1, offsets[2] + 1] == PAD_SPARSE
    assert ids[0, offsets[2]] == 0  # the ids given are left as they were


# -- multi-hot lists ------------------------------------------------------------------------------


def _multi_hot_shard(path, sizes, lists, row_group_size):
    """A shard of len(lists) rows: feature 2 a list column holding `lists`, other multi-hot features empty lists,
    one-hot features 7, labels 0/1, DENSE_0 the row number."""
    from dlrm.data.schema import DENSE_COLUMNS, LABEL_COLUMN, SPARSE_COLUMNS, arrow_schema

    n = len(lists)
    cols = {LABEL_COLUMN: pa.array(np.arange(n) % 2, pa.int8())}
    cols.update({c: pa.array(np.arange(n) if j == 0 else np.zeros(n), pa.int32()) for j, c in enumerate(DENSE_COLUMNS)})
    for f, (c, size) in enumerate(zip(SPARSE_COLUMNS, sizes)):
        if size == 1:
            cols[c] = pa.array([7] * n, pa.int64())
        else:
            cols[c] = pa.array(lists if f == 2 else [[]] * n, pa.list_(pa.int64()))
    pq.write_table(pa.table(cols, schema=arrow_schema(sizes)), path, row_group_size=row_group_size)


def test_a_too_long_list_after_full_ones_names_its_own_row(tmp_path):
    """Full lists (exactly the feature's size) are fine; the error names the first row that holds more values, not
    the first full one before it, in both loaders."""
    from dlrm.data.loader import ParquetLoader

    sizes = [1] * 26
    sizes[2], sizes[9] = 3, 2
    lists = [[1, 2, 3], [4], [5, 6, 7], [], [8, 9, 10], [11, 12, 13, 14], [1, 2, 3, 4]]  # rows 5 and 6 too long
    _multi_hot_shard(tmp_path / "m.parquet", sizes, lists, row_group_size=4)
    message = (r"m\.parquet: column SPARSE_2: row index 5 \(row group 1\) holds 4 values; "
               r"multi_hot_sizes\[2\] allows at most 3$")
    with pytest.raises(DatasetError, match=message):
        list(ParquetLoader([tmp_path / "m.parquet"], 4, multi_hot_sizes=sizes))
    with pytest.raises(DatasetError, match=message):
        DeviceLoader([tmp_path / "m.parquet"], 4, "cpu", multi_hot_sizes=sizes)
    _multi_hot_shard(tmp_path / "ok.parquet", sizes, lists[:5], row_group_size=4)  # full lists only: accepted
    got = torch.cat([b.sparse for b in DeviceLoader([tmp_path / "ok.parquet"], 4, "cpu", multi_hot_sizes=sizes)])
    np.testing.assert_array_equal(got[:, 2:5].numpy(), [[1, 2, 3], [4, -2, -2], [5, 6, 7], [-2, -2, -2], [8, 9, 10]])


# -- schema ---------------------------------------------------------------------------------------


def test_a_file_whose_first_column_is_not_the_label_is_named_at_position_0(tmp_path):
    """The label must be column 0 (the footer's label check reads column 0's statistics): a file that puts DENSE_0
    first is refused naming that column and position 0, by both loaders."""
    from dlrm.data.loader import ParquetLoader

    files = _train_files(tmp_path)
    table = pq.read_table(files[0])
    names = table.column_names
    pq.write_table(table.select([names[1], names[0]] + names[2:]), files[0])
    message = r"part-00000\.parquet: column DENSE_0: at position 0, where label belongs \(columns out of order\)$"
    with pytest.raises(DatasetError, match=message):
        ParquetLoader(files, 8)
    with pytest.raises(DatasetError, match=message):
        DeviceLoader(files, 8, "cpu")


@pytest.fixture
def warnings_logged():
    from loguru import logger

    logger.enable("dlrm")
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")
    yield messages
    logger.remove(handle)


def test_null_lists_are_counted_and_logged_and_load_as_empty(tmp_path, warnings_logged):
    """A multi-hot column with null lists (and no null values): each null list loads as an empty one (padding
    only), and the file's one warning counts the null lists and a null value together."""
    from dlrm.data.schema import DENSE_COLUMNS, LABEL_COLUMN, SPARSE_COLUMNS, arrow_schema

    sizes = [1] * 26
    sizes[2] = 3
    schema = pa.schema([pa.field(f.name, f.type, nullable=True) for f in arrow_schema(sizes)])
    n = 6
    cols = {LABEL_COLUMN: pa.array([0, 1] * 3, pa.int8()),
            **{c: pa.array(list(range(n)) if j == 0 else [0] * n, pa.int32()) for j, c in enumerate(DENSE_COLUMNS)},
            **{c: pa.array([7] * n, pa.int64()) for c in SPARSE_COLUMNS}}
    cols["SPARSE_2"] = pa.array([[1, 2], None, [3], None, [4, 5, 6], None], pa.list_(pa.int64()))
    pq.write_table(pa.table(cols, schema=schema), tmp_path / "a.parquet", row_group_size=4)
    got = torch.cat([b.sparse for b in DeviceLoader([tmp_path / "a.parquet"], 4, "cpu", multi_hot_sizes=sizes)])
    np.testing.assert_array_equal(got[:, 2:5].numpy(), [[1, 2, -2], [-2, -2, -2], [3, -2, -2], [-2, -2, -2],
                                                        [4, 5, 6], [-2, -2, -2]])
    assert [m for m in warnings_logged if "null" in m] == [
        f"{tmp_path / 'a.parquet'}: 3 null multi-hot lists or values replaced by an empty list or -1 (SPARSE_2 3)"]
    cols["SPARSE_2"] = pa.array([[1, None], None, [3], [], [4, 5, 6], [None]], pa.list_(pa.int64()))
    pq.write_table(pa.table(cols, schema=schema), tmp_path / "b.parquet", row_group_size=4)
    got = torch.cat([b.sparse for b in DeviceLoader([tmp_path / "b.parquet"], 4, "cpu", multi_hot_sizes=sizes)])
    np.testing.assert_array_equal(got[:, 2:5].numpy(), [[1, -1, -2], [-2, -2, -2], [3, -2, -2], [-2, -2, -2],
                                                        [4, 5, 6], [-1, -2, -2]])
    assert [m for m in warnings_logged if "null" in m][1:] == [
        f"{tmp_path / 'b.parquet'}: 3 null multi-hot lists or values replaced by an empty list or -1 (SPARSE_2 3)"]


def test_a_single_chunk_dataset_starts_no_worker_processes(monkeypatch):
    """--workers N on a dataset of one chunk: the chunk is made in this process (no pool of processes to spawn and
    import for one chunk), and it is the same chunk."""
    from dlrm.data import synthetic, synthetic_chunks
    from dlrm.data.synthetic_chunks import chunks, make_chunk
    from dlrm.data.teacher import Teacher

    def no_pool(*args, **kwargs):
        raise AssertionError("a pool was started for a single chunk")

    monkeypatch.setattr(synthetic_chunks, "start_pool", no_pool)
    cards = synthetic.CARDINALITY_PRESETS["tiny"]
    teacher = Teacher(2, cards, bias=0.0)
    got = list(chunks(2, 30, cards, teacher, workers=4))
    assert [start for start, _ in got] == [0] and len(got[0][1][2]) == 30
    np.testing.assert_array_equal(got[0][1][3], make_chunk(2, 0, 30, cards, teacher)[3])


# -- worker pool ----------------------------------------------------------------------------------


def test_a_pool_that_fails_while_starting_releases_the_workers_already_waiting(monkeypatch):
    """A Ctrl-C (or any error) while the workers are being started: the workers already started, which wait at the
    start barrier for all the others, are released (the barrier broken) before the pool is shut down, instead of
    waiting out the start timeout; the error reaches the caller and SIGINT is unblocked again."""
    import signal
    from concurrent.futures import ProcessPoolExecutor

    from dlrm.data import worker_pool

    broken_at_shutdown: list[bool] = []

    class FailingSecondStart(ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.barrier, self.submitted = kwargs["initargs"][0], 0

        def submit(self, *args, **kwargs):
            self.submitted += 1
            if self.submitted == 2:
                raise KeyboardInterrupt
            return super().submit(*args, **kwargs)

        def shutdown(self, *args, **kwargs):
            broken_at_shutdown.append(self.barrier.broken)
            if not self.barrier.broken:
                self.barrier.abort()  # never leave the started worker (and this test) waiting out the timeout
            super().shutdown(*args, **kwargs)

    monkeypatch.setattr(worker_pool, "ProcessPoolExecutor", FailingSecondStart)
    with pytest.raises(KeyboardInterrupt):
        worker_pool.start_pool(2)
    assert broken_at_shutdown == [True]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_null_label_the_footer_counts_fails_when_the_loader_opens(tmp_path):
    """The footer's null count shows a null label: the stream loader refuses the file when it is made, naming the
    row within the file."""
    from dlrm.data.loader import ParquetLoader

    files = _train_files(tmp_path)
    shard = files[1]
    cols = pq.read_table(shard).to_pydict()
    cols["label"][9] = None  # row group 1 of that file
    schema = pa.schema([pa.field(f.name, f.type, nullable=True) for f in pq.read_schema(shard)])
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), shard, row_group_size=7)
    with pytest.raises(DatasetError, match=r"part-00001\.parquet: column label: row index 9 \(row group 1\) is null; "
                                           r"every row needs a label 0 or 1$"):
        ParquetLoader(files, 8)


def test_a_column_that_appears_twice_is_named_with_its_count(tmp_path):
    """A shard holding DENSE_3 twice (an extra copy at the end): one DatasetError naming the column and how often it
    appears, from both loaders."""
    from dlrm.data.loader import ParquetLoader

    files = _train_files(tmp_path)
    table = pq.read_table(files[1])
    table = pa.Table.from_arrays(table.columns + [table.column("DENSE_3")], names=table.column_names + ["DENSE_3"])
    pq.write_table(table, files[1])
    message = r"part-00001\.parquet: column DENSE_3: appears 2 times$"
    with pytest.raises(DatasetError, match=message):
        ParquetLoader(files, 8)
    with pytest.raises(DatasetError, match=message):
        DeviceLoader(files, 8, "cpu")


def test_a_split_that_lists_no_files_is_named(tmp_path):
    """metadata.json listing a split with no files (and 0 rows, so the row counts agree): one DatasetError naming
    metadata.json and the split, instead of a loader over nothing."""
    from dlrm.data.schema import SplitInfo, write_metadata

    root = tmp_path / "ds"
    make_dataset(root, {"train": 20, "validation": 10})
    meta = read_metadata(root)
    meta.splits["test"] = SplitInfo(rows=0, positives=0, files=[])
    write_metadata(root, meta)
    with pytest.raises(DatasetError, match=r"metadata\.json: splits\.test: lists no files \(the split has no rows: "
                                           r"preprocess again with more lines, .* for a 'test' split to use\)$"):
        split_files(root, read_metadata(root), "test")
    assert len(split_files(root, read_metadata(root), "train")) == 2


# -- the first bad row is the one named -----------------------------------------------------------


@pytest.mark.parametrize("statistics", [True, False])
def test_of_two_bad_labels_in_a_row_group_the_first_is_named(tmp_path, statistics):
    """Labels 2 at rows 12 and 9 of a file (both in row group 1): the error names row 9, the first one, whether the
    footer shows it (checked at open) or only the decode does."""
    from dlrm.data.loader import ParquetLoader

    files = _train_files(tmp_path)
    cols = pq.read_table(files[0]).to_pydict()
    cols["label"][12] = cols["label"][9] = 2
    pq.write_table(pa.Table.from_pydict(cols, schema=pq.read_schema(files[0])), files[0], row_group_size=7,
                   write_statistics=statistics)
    message = r"part-00000\.parquet: column label: row index 9 \(row group 1\) holds 2; labels must be 0 or 1$"
    with pytest.raises(DatasetError, match=message):
        list(ParquetLoader(files, 8))
    with pytest.raises(DatasetError, match=message):
        DeviceLoader(files, 8, "cpu")


def test_of_two_non_finite_dense_values_the_first_is_named(tmp_path):
    """A "float" dataset with inf at row 11 and NaN at row 8 of DENSE_4 (both in row group 1): the error names row 8
    and its value, in both loaders."""
    from dlrm.data.loader import ParquetLoader
    from dlrm.data.schema import DENSE_COLUMNS

    files = _train_files(tmp_path)
    for k, path in enumerate(files):  # both files as float dense values
        table = pq.read_table(path)
        cols = {c: [float(v) for v in table.column(c).to_pylist()] if c in DENSE_COLUMNS else table.column(c)
                for c in table.column_names}
        if k == 1:
            cols["DENSE_4"][11], cols["DENSE_4"][8] = float("inf"), float("nan")
        schema = pa.schema([pa.field(f.name, pa.float32() if f.name in DENSE_COLUMNS else f.type)
                            for f in table.schema])
        pq.write_table(pa.table(cols, schema=schema), path, row_group_size=7)
    message = (r"part-00001\.parquet: column DENSE_4: row index 8 \(row group 1\) holds nan; "
               r"float dense values must be finite$")
    with pytest.raises(DatasetError, match=message):
        list(ParquetLoader(files, 8, dense_format="float"))
    with pytest.raises(DatasetError, match=message):
        DeviceLoader(files, 8, "cpu", dense_format="float")


def test_device_loader_pads_the_ranks_a_short_last_batch_leaves_empty(tmp_path):
    """pad_ranks (evaluation): 42 rows in batches of 8 over 4 ranks: the last global batch holds 2 rows, so ranks 2
    and 3 get one padding row each (a copy of the batch's last row, pad 1) and ranks 0 and 1 one real row each;
    together the ranks' real rows are every row once, in order."""
    files = _train_files(tmp_path, rows=42)
    per_rank = [list(DeviceLoader(files, 8, "cpu", rank=r, world_size=4, pad_ranks=True)) for r in range(4)]
    assert [len(batches) for batches in per_rank] == [6] * 4
    last = [batches[-1] for batches in per_rank]
    assert [(len(b), b.pad, b.global_size) for b in last] == [(1, 0, 2), (1, 0, 2), (1, 1, 2), (1, 1, 2)]
    ids = lambda b: torch.expm1(b.real(b.dense)[:, 0]).round().long().tolist()  # DENSE_0 is the row number
    assert [ids(b) for b in last] == [[40], [41], [], []]
    assert torch.equal(last[3].sparse, last[1].sparse) and torch.equal(last[2].labels, last[1].labels)
    rows = [i for k in range(6) for r in range(4) for i in ids(per_rank[r][k])]
    assert rows == list(range(42))


def test_a_slots_file_whose_first_feature_is_one_hot_is_read_as_slots(tmp_path):
    """The "slots" layout is recognised by the first multi-hot feature's first slot column, wherever that feature
    is: with SPARSE_0 one-hot and SPARSE_5 of 2 slots, both loaders read the file and deliver its slot values."""
    from dlrm.data.loader import ParquetLoader
    from dlrm.data.schema import arrow_schema
    from dlrm.data.validation import file_layout

    sizes = [1] * 26
    sizes[5] = 2
    schema = arrow_schema(sizes, "slots")
    n = 5
    cols = {}
    for f in schema:
        if f.name == "label":
            cols[f.name] = pa.array([0, 1, 0, 1, 1], f.type)
        elif f.name.startswith("DENSE_"):
            cols[f.name] = pa.array(range(n), f.type)
        elif f.name == "SPARSE_5_0":
            cols[f.name] = pa.array([10, 11, 12, 13, 14], f.type)
        elif f.name == "SPARSE_5_1":
            cols[f.name] = pa.array([20, -2, 22, -2, 24], f.type)
        else:
            cols[f.name] = pa.array([3] * n, f.type)
    pq.write_table(pa.table(cols, schema=schema), tmp_path / "s.parquet", row_group_size=3)
    assert file_layout(pq.read_schema(tmp_path / "s.parquet"), sizes) == "slots"
    want = [[10, 20], [11, -2], [12, 22], [13, -2], [14, 24]]
    for loader in (ParquetLoader([tmp_path / "s.parquet"], 5, multi_hot_sizes=sizes),
                   DeviceLoader([tmp_path / "s.parquet"], 5, "cpu", multi_hot_sizes=sizes)):
        batch = next(iter(loader))
        assert batch.sparse.shape == (5, 27)
        np.testing.assert_array_equal(batch.sparse[:, 5:7].numpy(), want)
        np.testing.assert_array_equal(batch.labels.numpy(), [0, 1, 0, 1, 1])
