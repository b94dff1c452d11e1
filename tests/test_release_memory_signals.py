"""A Ctrl-C or SIGTERM between two sweep trials (or `--compare` variants) must stop the run.

Found by a QA pass on 2026-12-04: `release_memory` (Dynamo's reset and a `gc.collect()` before each trial) runs
weakref callbacks; a signal whose handler ran inside one raised there, and Python prints an exception raised in a
weakref callback as "Exception ignored" and drops it: the sweep ran every remaining trial and exited 0. The signals
now wait until `release_memory` returns (`dlrm.stop_signal.signals_deferred`).
"""

from __future__ import annotations

import gc
import signal
import weakref

import pytest

from dlrm.errors import TrainingStopped
from dlrm.stop_signal import StopAtOnce
from dlrm.train import compare


def _collect_with_a_signal_in_a_weakref_callback(signum: int):
    """A `gc.collect` whose collection runs a weakref callback in which `signum` arrives (as when the signal comes
    while Dynamo's caches are freed)."""
    real = gc.collect
    calls = []

    def collect(*args):
        class Cached:
            pass

        obj = Cached()

        def callback(_):
            calls.append("callback")
            signal.raise_signal(signum)  # its Python handler runs here, inside the callback

        ref = weakref.ref(obj, callback)
        del obj  # the callback runs now
        assert ref() is None
        calls.append("collected")
        return real(*args)

    return collect, calls


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, TrainingStopped)])
def test_a_signal_inside_release_memory_is_raised_after_it(monkeypatch, signum, raised):
    collect, calls = _collect_with_a_signal_in_a_weakref_callback(signum)
    monkeypatch.setattr(compare.gc, "collect", collect)
    with StopAtOnce():  # a sweep's SIGTERM handler (a SIGINT: Python's default, KeyboardInterrupt)
        with pytest.raises(raised):
            compare.release_memory()
    assert calls == ["callback", "collected"]  # the release ran to its end before the signal acted


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the dropped KeyboardInterrupt)
def test_without_the_deferral_the_signal_was_lost(monkeypatch):
    """The failure itself: the same collection outside `release_memory` drops the KeyboardInterrupt."""
    collect, calls = _collect_with_a_signal_in_a_weakref_callback(signal.SIGINT)
    collect()  # no exception reaches here: Python printed it as "Exception ignored in: ..."
    assert calls == ["callback", "collected"]
