"""The stream loader across epoch boundaries (``chain_epochs``, issue #19): the producer decodes
the next epoch's buffers while this epoch's last batches are cut, and the batches stay exactly
those of the plain sequential reference, epoch after epoch."""

import threading
import time

import pytest

from dlrm.data.loader import ParquetLoader
from tests.test_loader import _to_cpu, assert_same_batches, reference_batches, uneven_dataset  # noqa: F401 - fixture


def chained(files, batch_size, buffer_rows, device="cpu", **kw):
    return ParquetLoader(files, batch_size, device, shuffle=True, seed=2, shuffle_buffer_rows=buffer_rows,
                         prefetch=2, chain_epochs=True, **kw)


@pytest.mark.parametrize("batch_size,buffer_rows", [(16, 1_000_000), (16, 100), (7, 60), (300, 50), (10, 1)])
def test_chained_epochs_equal_the_reference(uneven_dataset, batch_size, buffer_rows):
    """One to several shuffle buffers an epoch (1_000_000: the whole split is one buffer), several epochs."""
    loader = chained(uneven_dataset, batch_size, buffer_rows)
    try:
        for epoch in range(4):
            loader.set_epoch(epoch)
            assert_same_batches(list(loader), reference_batches(uneven_dataset, batch_size, shuffle=True, seed=2,
                                                                epoch=epoch, shuffle_buffer_rows=buffer_rows))
    finally:
        loader.close()
    assert loader._live is None


def test_the_next_epoch_is_decoded_before_it_is_asked_for(uneven_dataset):
    loader = chained(uneven_dataset, 16, 100)
    loader.set_epoch(0)
    list(loader)
    run = loader._live
    assert run is not None and run.next_epoch == 1 and run.thread.is_alive()
    deadline = time.monotonic() + 10
    while run.first is None and run.q.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    # the next epoch's first buffer: uploaded while epoch 0's last batches were cut, or waiting decoded
    assert run.first is not None or not run.q.empty()
    loader.set_epoch(1)
    batches = list(loader)
    assert loader._live is run  # the same producer, now one epoch further
    assert_same_batches(batches, reference_batches(uneven_dataset, 16, shuffle=True, seed=2, epoch=1,
                                                   shuffle_buffer_rows=100))
    loader.close()
    assert not run.thread.is_alive()
    assert 1 <= len(loader._spare_arenas) <= loader._max_arenas


def test_jumps_breaks_and_resumes_restart_the_producer(uneven_dataset):
    loader = chained(uneven_dataset, 16, 60)
    ref = lambda epoch, start=0: reference_batches(uneven_dataset, 16, shuffle=True, seed=2, epoch=epoch,
                                                   shuffle_buffer_rows=60, start_batch=start)
    loader.set_epoch(0)
    list(loader)
    first = loader._live
    loader.set_epoch(3)  # not the epoch decoded ahead: that producer stops, a new one starts
    assert_same_batches(list(loader), ref(3))
    assert not first.thread.is_alive()
    loader.set_epoch(4, start_batch=2)  # resume inside the epoch decoded ahead
    assert_same_batches(list(loader), ref(4, 2))
    others = {t for t in threading.enumerate() if t.name == "parquet-loader"}
    for i, _ in enumerate(loader):  # the same epoch again, abandoned: nothing stays running
        if i == 1:
            running = [t for t in threading.enumerate() if t.name == "parquet-loader" and t not in others]
            break
    assert loader._live is None
    assert len(running) == 1 and not running[0].is_alive()  # its producer stopped and joined by the break
    loader.set_epoch(5)
    assert_same_batches(list(loader), ref(5))
    pairs = list(zip(loader, loader))  # two iterations of one epoch at once: one producer survives
    assert_same_batches([a for a, _ in pairs], ref(5))
    assert_same_batches([b for _, b in pairs], ref(5))
    loader.close()
    assert loader._live is None


def test_a_decode_error_in_the_next_epoch_reaches_the_consumer(uneven_dataset, tmp_path):
    """A file that goes bad after epoch 0 fails epoch 1 with the DatasetError naming it."""
    import shutil

    from dlrm.data.schema import DatasetError

    files = [shutil.copy(f, tmp_path / f.name) for f in uneven_dataset]
    loader = chained([type(uneven_dataset[0])(f) for f in files], 16, 1_000_000)
    loader.set_epoch(0)
    list(loader)
    loader.close()  # the chained producer may have read the good file already; start clean
    with open(files[1], "r+b") as fh:  # corrupt the data pages, keep the footer
        fh.seek(4)
        fh.write(b"\0" * 200)
    loader.set_epoch(1)
    with pytest.raises(DatasetError, match=type(uneven_dataset[0])(files[1]).name):
        list(loader)
    loader.close()


@pytest.mark.gpu  # skipped without CUDA by the hook in tests/conftest.py
def test_chained_cuda_epochs_equal_the_reference(uneven_dataset):
    loader = chained(uneven_dataset, 16, 30, device="cuda")
    try:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert_same_batches([_to_cpu(b) for b in loader],
                                reference_batches(uneven_dataset, 16, shuffle=True, seed=2, epoch=epoch,
                                                  shuffle_buffer_rows=30), "cuda")
    finally:
        loader.close()


def test_the_next_epochs_first_buffer_uploaded_during_the_last_one_is_cut_by_its_own_plan(uneven_dataset):
    """The look-ahead upload (`_look_ahead`), made certain: the consumer waits, at every look-ahead, until the
    producer has queued the epoch's end and the next epoch's first buffer. That buffer holds a different number of
    rows in each epoch here, so it must be uploaded by the next epoch's plan, not this one's."""
    import numpy as np

    loader = chained(uneven_dataset, 16, 100)
    firsts = {loader._plan(np.random.default_rng([2, epoch]))[0].rows for epoch in range(4)}
    assert len(firsts) > 1  # the first buffers differ in size between epochs
    look_ahead = loader._look_ahead

    def patient(run, ended):
        deadline = time.monotonic() + 10
        while run.q.qsize() < (1 if ended else 2) and time.monotonic() < deadline:
            time.sleep(0.002)
        return look_ahead(run, ended)

    loader._look_ahead = patient
    try:
        for epoch in range(4):
            loader.set_epoch(epoch)
            assert_same_batches(list(loader), reference_batches(uneven_dataset, 16, shuffle=True, seed=2, epoch=epoch,
                                                                shuffle_buffer_rows=100))
            assert loader._live.first is not None  # the next epoch's first buffer is already uploaded
    finally:
        loader.close()
