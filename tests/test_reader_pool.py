"""The parquet loader's reader threads give way to the training thread (`dlrm.data.reader_pool`)."""

import os
import sys
import threading

import pytest

from dlrm.data.reader_pool import READER_NICENESS, lower_priority, reader_pool


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_reader_threads_run_below_the_thread_that_made_them_and_it_keeps_its_priority():
    mine = _nice()
    with reader_pool(3) as pool:
        theirs = set(pool.map(lambda _: _nice(), range(12)))
    assert theirs == {min(19, mine + READER_NICENESS)}
    assert _nice() == mine  # the caller (the training thread) is untouched


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_lowering_stops_at_the_lowest_priority():
    def lowest() -> int:
        lower_priority(by=100)
        return _nice()

    with reader_pool(1) as pool:
        assert pool.submit(lowest).result() == 19


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("multi_hot", [True, False])
def test_the_loaders_readers_are_lowered_only_without_pyarrows_pool(tmp_path, multi_hot):
    """Multi-hot rows decode on the readers alone (lowered); one-hot rows use pyarrow's pool too, whose threads keep
    the training thread's priority, so the readers keep it as well."""
    import torch

    from dlrm.data.parquet_loader import ParquetLoader
    from dlrm.data.reader_pool import default_arrow_threads, lower_readers
    from tests.conftest import REPO

    assert lower_readers(default_arrow_threads(multi_hot)) is multi_hot
    loader = ParquetLoader(sorted((REPO / "data" / "sample" / "validation").glob("*.parquet")), batch_size=64,
                           device=torch.device("cpu"), arrow_threads=not multi_hot, reader_threads=2)
    mine = _nice()
    theirs = set(loader._pool().map(lambda _: _nice(), range(8)))
    loader.close()
    assert theirs == {min(19, mine + READER_NICENESS) if multi_hot else mine}


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_readers_are_lowered_relative_to_an_already_lowered_caller():
    """A pool made by a thread already at nice 3 runs its readers at 3 + READER_NICENESS, not at READER_NICENESS."""
    seen = {}

    def caller() -> None:
        lower_priority(by=3)  # only in this thread: it cannot be undone without privileges
        seen["caller"] = _nice()
        with reader_pool(2) as pool:
            seen["readers"] = set(pool.map(lambda _: _nice(), range(4)))

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join()
    assert seen["readers"] == {min(19, seen["caller"] + READER_NICENESS)}
    assert seen["caller"] == min(19, _nice() + 3)
