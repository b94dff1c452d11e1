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
