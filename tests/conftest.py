"""Shared test setup. TRITON_INTERPRET must be set before anything imports triton."""

import os
import re
import signal

# Under pytest-xdist (-n N) every worker, and every train.py or torchrun process a test starts, would
# otherwise take one intra-op thread per core: N x cores threads on the cores. On the 16-core GPU
# machine with -n 16 that made a CPU end-to-end run ~10x slower and time out. Each worker gets its
# share of the cores; the environment variable carries the share into the processes it starts.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

# Every Python process a test starts (train.py, torchrun's ranks) dumps its threads' Python tracebacks on a fatal
# signal: a rank that aborts in C++ ("terminate called without an active exception", SIGABRT; a rare gloo
# teardown abort on the 2-core CI machine, 2026-11-29) then says in the failing test's captured stderr where it was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import torch  # noqa: E402

# ... and this process too: the root conftest.py imported torch before the variable was set, and torch keeps the
# thread count it started with (2 intra-op threads a worker on the 2-core CI machine: 4 busy threads on 2 cores)
if _workers > 1 and os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from dlrm.data.schema import (  # noqa: E402
    DENSE_COLUMNS,
    LABEL_COLUMN,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    Metadata,
    SplitInfo,
    arrow_schema,
    write_metadata,
)

REPO = Path(__file__).resolve().parents[1]  # the repository root; tests import it from here
# a subprocess's environment: the checkout first, the caller's PYTHONPATH kept (the GPU machine's packages are there)
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
SHARED_CRITEO = REPO.parent / "shared" / "criteo"


def pytest_configure(config):
    """The prewarmed interpreter (tests/prewarm/launch.py) in each process that runs tests: an xdist worker, or a run
    without workers (not the controller of workers, which runs none)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        from tests.prewarm import launch

        launch.start()


def pytest_unconfigure(config):
    from tests.prewarm import launch

    launch.stop()


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked `gpu` where CUDA is absent: one rule here instead of a skipif per file."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # the marker itself, not item.keywords: a parameter id "gpu" (data.placement) is a keyword too
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# A session started with SIGINT ignored (`nohup pytest &`, a job launched in the background of a script) passed the
# ignore on to every process it started, as exec keeps an ignored signal ignored: Python then installs no
# KeyboardInterrupt handler, and the tests of Ctrl-C (the graceful stop, the tools' one-line interrupts) failed or
# waited for their timeouts. The tests run with SIGINT as an interactive shell gives it (a handled signal is reset to
# its default in the processes started).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# TensorBoard names an event file events.out.tfevents.<second>.<host>.<pid>.<n>, n a counter of the process, and reads
# a run directory's files in name order. Two sessions of one run trained in one test process within one second (a
# `train(..., resume=...)` after a short run) sorted by n as text: 10 before 9, the resumed session's events read
# before the first's (a test reading the run's scalars failed on the 16-worker GPU machine, where the runs are fast).
# The counter starts where one more digit is a billion event files away.
from tensorboard.summary.writer import event_file_writer as _event_file_writer  # noqa: E402

_event_file_writer._global_uid = _event_file_writer.AtomicCounter(10**9)


# torch's deterministic mode as the test session found it
_DETERMINISTIC_AT_START = (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled())


@pytest.fixture(autouse=True)
def _restore_deterministic_mode():
    """`torch.use_deterministic_algorithms` is process-wide, and it turns Inductor's deterministic mode on too, in which
    Inductor refuses to time kernels (combo kernels raise). A test that trains with train.deterministic must not leave
    it on for the tests after it in the same worker (on the GPU machine that failed a compiled step with combo kernels):
    restored to the session's start, not to what the test found (a module-scoped fixture that trained with it, before
    this test's snapshot, left it on for the whole worker)."""
    yield
    if (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) != _DETERMINISTIC_AT_START:
        torch.use_deterministic_algorithms(_DETERMINISTIC_AT_START[0], warn_only=_DETERMINISTIC_AT_START[1])


@pytest.fixture
def clock(monkeypatch):
    """``clock(seconds)`` makes `seconds` pass at once for every later ``time.perf_counter()`` (a monotonic clock that
    jumps, as it would across a sleep of the calling thread). A test that times a slow phase (a loader's shutdown, an
    evaluation) against the training steps around it jumps the clock instead of sleeping: a real sleep of 2 s was "far
    longer than the steps" until CI's 2 loaded cores trained 20 steps in more than 2 s."""
    import time

    real, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])

    def advance(seconds: float) -> None:
        skipped[0] += seconds
    return advance


def process_output(result, tail: int = 3000) -> str:
    """A failed subprocess's output for an assertion message: the last `tail` characters of its stdout and stderr,
    led, when a process it started died of a fatal signal, by faulthandler's report (the signal and each thread's
    Python traceback: PYTHONFAULTHANDLER above). Each report ends with the list of loaded extension modules, for
    torch's ranks thousands of characters, which pushed the report out of a plain tail; the lists are shortened."""
    err = result.stderr or ""
    err = re.sub(r"\nExtension modules: [^\n]*", "\nExtension modules: (list left out)", err)
    fatal = [m.group(0) for m in re.finditer(r"Fatal Python error(?:.|\n)*?(?=\nExtension modules: |\Z)", err)]
    head = "".join(f"{report[:4000]}\n...\n" for report in fatal)
    return head + (result.stdout or "")[-tail:] + err[-tail:]


def write_rows(path: Path, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray, row_group_size: int) -> None:
    """Write one parquet shard with the project's schema."""
    cols = {LABEL_COLUMN: label.astype(np.int8)}
    cols.update({c: dense[:, i].astype(np.int32) for i, c in enumerate(DENSE_COLUMNS)})
    cols.update({c: sparse[:, i].astype(np.int64) for i, c in enumerate(SPARSE_COLUMNS)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols, schema=arrow_schema()), path, row_group_size=row_group_size)


def make_dataset(root: Path, rows: dict[str, int], *, files_per_split: int = 2, row_group_size: int = 7,
                 cardinality: int = 11, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """A small dataset where row i of a split has DENSE_0 == i (so tests can track rows).

    Returns the arrays written per split.
    """
    rng = np.random.default_rng(seed)
    splits, written = {}, {}
    for split, n in rows.items():
        label = rng.integers(0, 2, n)
        dense = rng.integers(-3, 1000, (n, NUM_DENSE))
        dense[:, 0] = np.arange(n)
        sparse = rng.integers(-1, 2**32, (n, NUM_SPARSE))
        files = []
        for k, idx in enumerate(np.array_split(np.arange(n), files_per_split)):
            rel = f"{split}/part-{k:05d}.parquet"
            write_rows(root / rel, label[idx], dense[idx], sparse[idx], row_group_size)
            files.append(rel)
        splits[split] = SplitInfo(rows=n, positives=int(label.sum()), files=files)
        written[split] = {"label": label, "dense": dense, "sparse": sparse}
    write_metadata(root, Metadata(cardinalities=[cardinality] * NUM_SPARSE, splits=splits))
    return written


@pytest.fixture
def tiny_dataset(tmp_path):
    root = tmp_path / "ds"
    arrays = make_dataset(root, {"train": 100, "validation": 30})
    return root, arrays


# A multi-hot dataset of MLPerf DLRM-DCNv2's presets (40M-row tables, 214 values a row), as `python -m
# dlrm.data.synthetic` writes it with these arguments (2,000 rows: 1,600 train, 200 validation, 200 test).
MLPERF_PRESET_ARGS = ["--rows", "2000", "--cardinalities", "mlperf", "--multi-hot-sizes", "mlperf"]


@pytest.fixture(scope="session")
def mlperf_preset_dataset(tmp_path_factory) -> Path:
    """`MLPERF_PRESET_ARGS`' dataset, zstd (the default codec, named), made once per test run and shared by the
    workers (`tests.shared_once`). Writing it costs seconds whatever the row count: the teacher's bias is tuned on a
    131k-row pilot of 214 values a row (~6 s a dataset in CI, where the test that wrote two took 12.7 s). Three tests
    wrote one each before (two in test_multihot_data.py, one in test_benchmark_scripts.py). Tests only read it."""
    from click.testing import CliRunner

    from dlrm.data import synthetic
    from tests.shared_once import computed_once

    def make(root: Path) -> None:
        res = CliRunner().invoke(synthetic.main,
                                 MLPERF_PRESET_ARGS + ["--out", str(root / "ds"), "--compression", "zstd"])
        assert res.exit_code == 0, res.output

    return computed_once(tmp_path_factory, "mlperf-preset-zstd", make) / "ds"
