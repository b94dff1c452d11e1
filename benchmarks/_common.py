"""What the benchmark scripts share: the environment line, timing, synthetic batches, run building
and the CSV / Markdown / PNG writers.

Import it from a script under ``benchmarks/`` (run as a file, or loaded by path in the tests) after
appending this folder to ``sys.path`` (appending: ahead of the repository, benchmarks/kernels.py
would shadow the `kernels` package):

    >>> sys.path.append(str(Path(__file__).resolve().parent))
    >>> from _common import Timer, environment, write_csv

Only the standard library is imported at module level: ``loader_throughput.py`` spawns preprocess
workers that re-import the script (and so this module), and they must start quickly, so torch,
triton and matplotlib are imported inside the functions that use them.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
# The repository first on sys.path: the scripts import dlrm and the `kernels` package without an
# install, and benchmarks/ (sys.path[0] when a script runs) holds a kernels.py that would shadow it.
if sys.path[:1] != [str(REPO)]:
    sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    import torch

    from dlrm.config import Config
    from dlrm.data.loader import Batch

DATE_FORMAT = "%Y-%m-%d %H:%M"


# ---- environment -----------------------------------------------------------------------------------


def date_stamp() -> str:
    """The current local time as every results file writes it (minutes, no seconds)."""
    return datetime.datetime.now().strftime(DATE_FORMAT)


def device_name(device: "torch.device") -> str:
    """The GPU's name on CUDA, else the CPU's (``platform.processor()``, which may be empty: "CPU")."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"


def environment(device: "torch.device") -> dict:
    """Where a training benchmark ran: device name, torch, triton and python versions, date."""
    import torch
    import triton

    return {
        "device": device_name(device), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "date": date_stamp(),
    }


def env_line(env: dict) -> str:
    """``key: value, key: value`` for the line under a results file's title."""
    return ", ".join(f"{k}: {v}" for k, v in env.items())


# ---- arguments -------------------------------------------------------------------------------------


def int_list(ap, flag: str, text: str, minimum: int = 1) -> list[int]:
    """The comma list of integers (each >= `minimum`) an option gave, or `ap.error` naming the option and its
    value (one line, exit 2): a bad value must not crash with a traceback after the run has started.

        >>> import argparse; int_list(argparse.ArgumentParser(), "--batch-sizes", "8, 64")
        [8, 64]
    """
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values):
        ap.error(f"{flag}: {text!r} is not a comma list of integers >= {minimum}")
    return values


def choice_list(ap, flag: str, text: str, choices) -> list[str]:
    """The comma list of names from `choices` an option gave ('': none), or `ap.error` naming the option and its
    value: an empty item is refused as `int_list` refuses it ('stream,' was taken as 'stream' where '1000,' is not
    a list of integers), and a misspelt name before any run (it failed in its own run, after the others).

        >>> import argparse; choice_list(argparse.ArgumentParser(), "--placements", "stream, gpu", ("stream", "gpu"))
        ['stream', 'gpu']
    """
    values = [v.strip() for v in text.split(",")] if text.strip() else []
    if any(v not in choices for v in values):
        ap.error(f"{flag}: {text!r} is not a comma list of {', '.join(choices)}")
    return values


def config_or_error(ap, path) -> "Config":
    """`dlrm.config.load_config(path)`, or `ap.error` with its one-line message (a missing or malformed config
    file is bad input, not a traceback)."""
    from dlrm.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        ap.error(str(e))


def run_config_or_error(ap, path, overrides: dict, variant: Optional[str] = None,
                        tables: Optional[str] = "config") -> "Config":
    """The config a script builds its run from, checked before anything is measured and before any CUDA check (a
    bad file or value must be the same one argparse line on a GPU as on the CPU, not a traceback after the device
    was set up): `path` loaded with the dotted-key `overrides` its options set (None: the config's own value), then
    `variant`'s kernels and compile settings (`dlrm.train.compare.variant_config`) validated as a config file's are,
    and the table sizes the script builds from: `tables` "config" (`dlrm.train.builder.tables_from_config`: the
    config must name ``model.cardinalities``), "dataset" (its dataset's filled in when it names none,
    `fill_cardinalities`) or None (the script reads a dataset of its own). Any of these refused: `ap.error` with the
    one-line reason (exit 2)."""
    from dlrm.config import ConfigError, load_config, validate
    from dlrm.errors import DatasetError

    try:
        cfg = load_config(path, {k: v for k, v in overrides.items() if v is not None})
        if variant is not None:
            from dlrm.train.compare import VARIANTS, variant_config

            if variant not in VARIANTS:
                ap.error(f"--variant: unknown variant {variant!r} (choose from {', '.join(VARIANTS)})")
            try:
                cfg = validate(variant_config(cfg, variant))
            except ConfigError as e:
                ap.error(f"{path}: --variant {variant}: {e}")
        if tables == "dataset":
            fill_cardinalities(cfg)
        elif tables == "config" and cfg.model.cardinalities is None:
            ap.error(f"{path}: model.cardinalities: needed (this script builds the tables from the config, not from "
                     "a dataset)")
    except (ConfigError, DatasetError) as e:
        ap.error(str(e))
    return cfg


def positive_or_error(ap, **options: float) -> None:
    """`ap.error` naming the first option (keyword: its flag with _ for -) whose value is not > 0: a zero count of
    steps or windows divided by zero, or took the median of nothing, after the whole measurement ran."""
    for name, value in options.items():
        if not value > 0:
            ap.error(f"--{name.replace('_', '-')}: {value!r} must be > 0")


# ---- measuring -------------------------------------------------------------------------------------


class Timer:
    """Wall time of a region: CUDA events on a GPU (no host sync inside the region), perf_counter on CPU.

    Example:
        >>> with Timer(device) as t:
        ...     step(batch)
        >>> t.seconds
    """

    def __init__(self, device: "torch.device"):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            import torch

            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def graph_replay_windows(step: Callable[[], None], calls: int, windows: int, warmup: int,
                         settle_s: float = 0.0) -> tuple[list[float], int]:
    """ms per call of each of `windows` replays of one CUDA graph of `calls` calls, and `calls`.

    `warmup` untimed calls run first on a side stream (Triton compiles there: compilation must not happen
    inside the capture). With `calls` <= 0 the count is chosen from a one-call graph's replay time: about
    20 ms of work a window, 2 to 200 calls. With `settle_s`, that many seconds of untimed replays come
    before the windows (the power-capped clock a sustained run gets, not the first second's boost: see
    `settle`). CUDA only: `wall_windows` is the CPU's."""
    import statistics

    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def capture(n: int) -> "torch.cuda.CUDAGraph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                step()
        return graph

    def replay_ms(graph: "torch.cuda.CUDAGraph") -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    if calls <= 0:
        one = capture(1)
        replay_ms(one)  # the first replay uploads the graph
        t = statistics.median(replay_ms(one) for _ in range(3))
        del one
        calls = max(2, min(200, int(20.0 / max(t, 1e-3))))
    graph = capture(calls)
    replay_ms(graph)  # the first replay uploads the graph
    settle(lambda _: graph.replay(), settle_s, torch.device("cuda"))
    times = [replay_ms(graph) / calls for _ in range(windows)]
    graph = None  # frees the graph's pool; rebinding, not del: settle's lambda closes over this name
    return times, calls


def wall_windows(step: Callable[[], None], calls: int, windows: int, warmup: int) -> tuple[list[float], int]:
    """`graph_replay_windows` on the CPU: ms per call of each of `windows` windows of `calls` (at least 1)
    calls, by perf_counter, after `warmup` untimed calls.

        >>> calls = []
        >>> times, n = wall_windows(lambda: calls.append(1), 2, windows=3, warmup=1)
        >>> len(times), n, len(calls)
        (3, 2, 7)
    """
    for _ in range(warmup):
        step()
    calls = max(1, calls)
    out = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return out, calls


def wall_ms(step: Callable[[], None]) -> float:
    """One call's wall time in ms (the CPU smoke runs: a check of a script, not a measurement).

        >>> wall_ms(lambda: None) >= 0
        True
    """
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def graph_replay_ms(step: Callable[[], None], calls: int, windows: int, warmup: int,
                    settle_s: float = 0.0) -> float:
    """Median ms per call of `step` by `graph_replay_windows` (`calls` > 0 calls a graph). Without CUDA, the
    wall time of one call (`wall_ms`; smoke runs: a check of the script, not a measurement)."""
    import statistics

    import torch

    if not torch.cuda.is_available():
        return wall_ms(step)
    return statistics.median(graph_replay_windows(step, calls, windows, warmup, settle_s)[0])


def synthetic_batches(n: int, batch_size: int, device: "torch.device", seed: int = 0,
                      multi_hot_sizes: Optional[list[int]] = None) -> list["Batch"]:
    """`n` Criteo-like batches already on `device`: heavy-tailed dense counts (log1p), raw sparse
    hash values drawn uniformly from [-1, 2**32) (every lookup a cold row: the hard case for the
    embedding), 25% positive labels. `multi_hot_sizes`: every slot filled (MLPerf's fixed sizes),
    ``sum(multi_hot_sizes)`` sparse columns."""
    import torch

    from dlrm.data.loader import Batch
    from dlrm.data.schema import NUM_DENSE, NUM_SPARSE

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(n):
        counts = torch.distributions.Exponential(0.05).sample((batch_size, NUM_DENSE))
        dense = torch.log1p(counts.floor())
        width = sum(multi_hot_sizes) if multi_hot_sizes else NUM_SPARSE
        sparse = torch.randint(-1, 2**32, (batch_size, width), generator=g)
        labels = (torch.rand(batch_size, generator=g) < 0.25).float()
        out.append(Batch(dense.to(device), sparse.to(device), labels.to(device)))
    return out


def fill_cardinalities(cfg: "Config") -> None:
    """Give `cfg` the table sizes of its dataset (``data.path``'s metadata) when it names none in
    ``model.cardinalities``: a benchmark builds the model without loading the data."""
    if cfg.model.cardinalities is None:
        from dlrm.data.schema import read_metadata

        cfg.model.cardinalities = read_metadata(cfg.data.path).cardinalities


def train_steps(run, batches: list, n: int, start: int = 0):
    """`n` training steps of `run` (a `dlrm.train.builder.Run`) as the trainer takes them, each
    followed by the LR schedules' step, cycling through `batches` from index `start`.
    Returns the last step's loss (a 0-dim device tensor; no host sync)."""
    loss = None
    for i in range(start, start + n):
        loss = run.train_step(batches[i % len(batches)])
        for sched in run.schedulers:
            sched.step()
    return loss


def settle(step: Callable[[int], None], seconds: float, device: "torch.device", start: int = 0,
           check_every: int = 10) -> int:
    """Call ``step(i)`` (i = start, start + 1, ...) untimed until ``seconds`` have passed (checked every
    `check_every` calls, each check a host sync); returns the calls. For GPUs that train at their power cap:
    an H200 reaches it within a second of the first MLPerf step and its SM clock then falls from 1980 to
    ~1635-1770 MHz (benchmarks/PERF.md, thirty-third run), so windows timed right after a few warm-up steps read
    the first second's boost (3.73M samples/s against 3.67M sustained there). Nothing on the CPU or for 0 s.

        >>> import torch; calls = []
        >>> settle(calls.append, 0.0, torch.device("cpu")), calls
        (0, [])
    """
    import torch

    if seconds <= 0 or device.type != "cuda":
        return 0
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(check_every):
            step(start + calls)
            calls += 1
        torch.cuda.synchronize(device)
    return calls


# ---- writers ---------------------------------------------------------------------------------------


def add_overwrite(ap) -> None:
    """The ``--overwrite`` option every script that writes results has: the policy of the app's own writers (the
    generator, the preprocessor, relayout and the importer refuse an output that exists without ``--overwrite``)."""
    ap.add_argument("--overwrite", action="store_true",
                    help="replace output files that already exist (refused otherwise, before anything runs)")


class Outputs:
    """The files a script will write, claimed before it measures anything (`claim_outputs`), and the line that names
    those it wrote (`report`)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self._before = {p: _stamp(p) for p in paths}

    def report(self) -> None:
        """``wrote A, B, C``: every claimed file this run wrote (new, or replaced under --overwrite)."""
        written = [p for p in self.paths if os.path.lexists(p) and _stamp(p) != self._before[p]]
        print("wrote " + (", ".join(str(p) for p in written) or "nothing"), flush=True)


def _stamp(path: Path) -> Optional[tuple[int, int, int]]:
    """What changes when a file is written (or replaced by a rename): None for a path that does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def claim_outputs(ap, args, folder: Any, names: Iterable[str], append: bool = False) -> Outputs:
    """The files `names` in `folder` (a script's ``--out``), refused in one line (`ap.error`: exit 2, nothing measured
    nor written) where one already exists, unless ``--overwrite`` (`add_overwrite`): a results file the user has is
    never replaced silently. The refusal names the first such file and how many more there are. Only the script's own
    files: ``--out`` is often benchmarks/results/, which holds every other script's. With `append` (a script's
    ``--append``: merge into the files, asked for) nothing is refused."""
    claimed = [Path(folder) / name for name in names]
    taken = [p for p in claimed if os.path.lexists(p)]
    if taken and not (args.overwrite or append):
        more = f" (and {len(taken) - 1} more of its outputs)" if len(taken) > 1 else ""
        ap.error(f"{taken[0]} already exists{more}; pass --overwrite to replace it, or choose another output path")
    return Outputs(claimed)


def write_csv(path: Path, rows: Iterable[dict], keys: list[str], extra: Optional[dict[str, Any]] = None) -> None:
    """One CSV row per dict: the columns `keys` (missing ones empty), then the constant columns
    `extra` (the environment) repeated on every row. A value that is missing (None) or was not measured (NaN, an
    infinity: a failed case's time) is an empty cell, as in the app's own CSVs (`dlrm.train.metric_text.csv_cell`): a
    failed case wrote "nan" in its measured columns and an empty cell in the others."""
    extra = extra or {}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + list(extra))
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(v) for k, v in {**{k: r.get(k) for k in keys}, **extra}.items()})


def _cell(value: Any) -> Any:
    """None for a NaN or infinite float (csv writes None as an empty cell); any other value as it is.

        >>> [_cell(v) for v in (1.5, float("nan"), float("inf"), "ok", None)]
        [1.5, None, None, 'ok', None]
    """
    return None if isinstance(value, float) and not math.isfinite(value) else value


def md_row(cells: Iterable[Any]) -> str:
    """One Markdown table row: ``| a | b |``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(title: str, paragraphs: Iterable[str], table: Iterable[str]) -> str:
    """A results file: ``# title``, each paragraph followed by a blank line, then the table lines."""
    lines = [f"# {title}", ""]
    for p in paragraphs:
        lines += [p, ""]
    return "\n".join([*lines, *table]) + "\n"


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only: no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110, **savefig_kwargs) -> None:
    """Lay out `fig`, write it to `path` (creating its folder) and close it (figures pile up in
    matplotlib's registry otherwise, across the cases of a long benchmark)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, **savefig_kwargs)
    pyplot().close(fig)
