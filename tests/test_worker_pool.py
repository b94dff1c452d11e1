"""`dlrm.data.worker_pool.start_pool`: worker processes that never die of a Ctrl-C meant for the main process, even
one that reaches them while they are still starting (importing the parent's main module, before any initializer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dlrm.data.worker_pool import start_pool
from tests.conftest import REPO


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        start_pool(0)


# A script whose main module a "spawn" worker imports (as __mp_main__) before any initializer runs: there it marks
# that the worker is starting, then sleeps; the test sends each worker SIGINT during that sleep.
_SCRIPT = """
    import os
    import sys
    import time
    from pathlib import Path

    if __name__ == "__mp_main__":
        (Path(os.environ["POOL_TEST_DIR"]) / f"starting-{os.getpid()}").touch()
        time.sleep(2)

    VALUE = None


    def set_value(value):
        global VALUE
        VALUE = value


    def value_times(x):
        return VALUE, x * x


    if __name__ == "__main__":
        import multiprocessing
        import signal

        from dlrm.data.worker_pool import start_pool

        before = set(multiprocessing.active_children())
        pool = start_pool(2, set_value, ("teacher",))
        try:
            started = len(set(multiprocessing.active_children()) - before)
            blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            results = list(pool.map(value_times, range(10)))
            print(started, blocked, sorted({v for v, _ in results}), sum(sq for _, sq in results))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
"""


def test_a_sigint_while_the_workers_start_neither_kills_them_nor_stops_their_tasks(tmp_path):
    """A plain pool whose initializer ignores SIGINT loses these workers: each dies of KeyboardInterrupt in the
    import, with a traceback, and the map fails (BrokenProcessPool)."""
    script = tmp_path / "pool_script.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {**os.environ, "POOL_TEST_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(marks := list(tmp_path.glob("starting-*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        for mark in marks:
            os.kill(int(mark.name.split("-")[1]), signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # both workers started by start_pool itself (none left to start on demand, outside the blocked SIGINT), this
    # thread's mask restored, the initializer run in each worker, every task done
    assert stdout.split() == ["2", "False", "['teacher']", str(sum(x * x for x in range(10)))]
