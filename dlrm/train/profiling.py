"""torch.profiler into TensorBoard: one `step()` per training step, gzipped Chrome traces in the run dir.

At the end of the run `dlrm.train.reporting.log_profile` reads the newest trace back
(`dlrm.train.trace_summary`) and writes the step breakdown, top kernels and timeline into the run's
TensorBoard events (Text and Images dashboards, offline). The traces themselves open in the
PyTorch Profiler tab (`profile` extra; its charts need internet) or at https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from loguru import logger
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from dlrm.config import ProfileConfig
from dlrm.file_modes import file_mode
from dlrm.logging_setup import counted, native_output, run_logger

# The trace files each run directory (its real path) held when this process last started a profiler on it: they are
# an earlier session's (a resume in the same process, or one whose pid this process reused), never this session's
# step, so `own_trace` leaves them out.
_EARLIER: dict[str, frozenset[str]] = {}


class _StepProfile(profile):
    """A profiler that saves no trace of the loop's tail alone. Each ``step()`` after a trained step opens the next
    ``ProfilerStep#N`` range; when the run ends right where recording starts (it trained profile.wait +
    profile.warmup steps, or ended as a later cycle began), the exit saved a trace holding only that range over the
    work after the loop, which `dlrm.train.reporting.log_profile` then reported as "one training step"."""

    def stop(self) -> None:
        recording = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        # the open step is the tail; an earlier step of this trace was recorded only if the step before was RECORD
        # (a RECORD_AND_SAVE there ended the previous trace)
        if self.current_action in recording and (self.step_num == 0
                                                 or self.schedule(self.step_num - 1) != ProfilerAction.RECORD):
            self.on_trace_ready = None
        super().stop()

    def _transit_action(self, *args, **kwargs):
        """torch's one place for a change of action (start, step, stop), where kineto starts and stops its trace and
        writes its lines to fd 2 (`USDT:... profiler_start`, `profiler_stop`): those within `native_output`, on lines of
        their own (they were glued to the training bar's line). A step that changes nothing clears no bar. A private
        torch method (torch 2.13: ``(prev_action, current_action)``), taken as it comes: were its arguments to
        change, every call is wrapped; were it gone, the lines are glued again, nothing fails."""
        prev_action, current_action = (tuple(args) + (None, None))[:2]
        if prev_action == current_action and prev_action not in (None, ProfilerAction.RECORD_AND_SAVE):
            return super()._transit_action(*args, **kwargs)
        with native_output():
            return super()._transit_action(*args, **kwargs)


def saves_trace(prof: profile) -> bool:
    """Whether the next ``prof.step()`` ends a recording and saves its trace (`trace_handler`: a gzip JSON file,
    seconds for a GPU run's kernels): not training, which the loop leaves out of its throughput window."""
    return prof.current_action == ProfilerAction.RECORD_AND_SAVE


def trace_handler(run_dir: Path):
    """torch's `tensorboard_trace_handler` (gzip), its file name too (``<host>_<pid>.<ns>.pt.trace.json.gz``, which
    TensorBoard's profiler plugin and `own_trace` read), whole or not at all: written to a temporary file in `run_dir`
    (``.<name>.<random>.tmp.gz``, which `dlrm.train.run_dir` knows; torch gzips a name ending in ".gz"), then renamed.
    torch gzips straight into the final name: a long trace takes seconds to half a minute, TensorBoard polling saw it
    half-written, and a second Ctrl-C then (the stop at once), a kill or a full disk left a truncated trace there that
    the profiler tab and benchmarks/trace_timeline.py (the newest trace) took for the run's and failed on."""
    def save(prof: profile) -> None:
        name = f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json.gz"
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp.gz", dir=run_dir)
        os.close(fd)
        try:
            prof.export_chrome_trace(tmp)
            os.chmod(tmp, file_mode())  # mkstemp creates 0600; a trace is an ordinary file
            os.replace(tmp, Path(run_dir) / name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return save


def profiles_step(prof: profile) -> bool:
    """Whether the step just trained ran under the profiler (its warmup or recording, the save's step too), or the
    coming ``prof.step()`` starts it (a cycle's last wait step): the loop leaves its logging window out of the
    throughput (`dlrm.train.meter.StepMeter.mark_profiled`). That start (kineto's prepare: 0.9 s on the CPU in a fresh
    process, CUPTI's set-up on a GPU) runs inside the step's window; a window ending at that step (train.log_every
    dividing profile.wait, or a later cycle's start with profile.repeat 0) counted it as training, its rate a fraction
    of the others' in TensorBoard and in summary.json's samples/s."""
    return prof.current_action != ProfilerAction.NONE or prof.schedule(prof.step_num + 1) != ProfilerAction.NONE


def session_schedule(cfg: ProfileConfig, steps: Optional[int]):
    """torch's schedule of `cfg`, less the cycles that would record none of the session's `steps` (its profiler steps
    0 to steps - 1): NONE there. With profile.repeat 0 or > 1 the run's end cut such a cycle short: kineto prepared in
    the ``prof.step()`` before its warmup, the steps it warmed up ran under the profiler, and their logging windows were
    left out of samples/s (`profiles_step`), for no trace; one whose warmup was due right after the last step was prepared in
    that step's ``prof.step()``, and the last window, its steps trained with no profiler, had no rate (a first cycle
    that short starts no profiler at all, `make_profiler`). `steps` None: torch's schedule as it is."""
    torch_schedule = schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat)
    if steps is None:
        return torch_schedule
    cycle = cfg.wait + cfg.warmup + cfg.active

    def fn(step: int) -> ProfilerAction:
        # the step's cycle records from its start + wait + warmup: at or past `steps`, it records nothing
        if step // cycle * cycle + cfg.wait + cfg.warmup >= steps:
            return ProfilerAction.NONE
        return torch_schedule(step)
    return fn


def cut_cycle(cfg: ProfileConfig, steps: int) -> Optional[tuple[int, str]]:
    """What a session of `steps` (at least one cycle) says at its start of a later cycle its end cuts short, as a
    first cycle that short is (`make_profiler`), and the steps it records: one that records some saves a shorter
    trace, the newest, which the step breakdown reads; one that would record none is not started (`session_schedule`).
    None: the end falls in a wait, after the last cycle (profile.repeat), or at a cycle's end.

    >>> cut_cycle(ProfileConfig(wait=4, warmup=1, active=2, repeat=0), 13)[0], cut_cycle(ProfileConfig(), 26)
    (1, None)
    """
    cycle = cfg.wait + cfg.warmup + cfg.active
    index, into = divmod(steps - 1, cycle)  # the last step's cycle (from 0) and its place in it (from 0)
    if (cfg.repeat and index >= cfg.repeat) or into < cfg.wait or into == cycle - 1:
        return None
    start = f"profiling: this run trains {steps} steps, ending {counted(into + 1, 'step')} into the profiler's " \
            f"cycle {index + 1}"
    if into < cfg.wait + cfg.warmup:
        return 0, (f"{start} (profile.wait {cfg.wait} + profile.warmup {cfg.warmup} = {cfg.wait + cfg.warmup} steps "
                   f"before it records): that cycle would record no step, so it is not started")
    recorded = into + 1 - cfg.wait - cfg.warmup
    return recorded, (f"{start} (profile.wait {cfg.wait} + profile.warmup {cfg.warmup} + profile.active {cfg.active} = "
                      f"{cycle}): its trace, the one the step breakdown reads, will hold only {recorded} of the "
                      f"{cfg.active} active step(s); {counted(cycle - 1 - into, 'step')} more would make it whole")


def make_profiler(cfg: ProfileConfig, run_dir: Path, device: torch.device, steps: Optional[int] = None):
    """A started-on-enter profiler writing into `run_dir`, or a null context when disabled. `steps`: the steps this
    session will train; fewer than the schedule's first cycle profile fewer steps than profile.active (the profiler
    saves what it recorded when it exits: a shortened trace), which is said at the start. A session of no more than
    profile.wait + profile.warmup steps gets no profiler, said once at the start: it would record no step. Started,
    it prepared (kineto's warm-up) in the `prof.step()` after the last wait step and ran its warmup steps, and their
    logging windows were kept out of samples/s as profiled (`profiles_step`): --max-steps 5 under the default 5 + 3,
    its one steady window so marked, warned "it will profile no step", then that its samples/s, training's own, was
    "the profiler's", then "this run wrote no trace". A later cycle (profile.repeat 0 or > 1) the session's end cuts
    short is said at the start alike (`cut_cycle`), and one that would record no step is not started
    (`session_schedule`)."""
    if not cfg.enabled:
        return contextlib.nullcontext(None)
    cycle = cfg.wait + cfg.warmup + cfg.active
    if steps is not None and steps < cycle:
        recorded = max(0, steps - cfg.wait - cfg.warmup)
        if not recorded:
            run_logger.warning(f"profiling: this run trains {counted(steps, 'step')}, no more than the steps before "
                               f"the profiler records (profile.wait {cfg.wait} + profile.warmup {cfg.warmup} = "
                               f"{cfg.wait + cfg.warmup}): the profiler is not started and writes no trace; train "
                               f"longer or shorten those")
            return contextlib.nullcontext(None)
        run_logger.warning(f"profiling: this run trains {steps} step(s), fewer than the profiler's first cycle "
                           f"(profile.wait {cfg.wait} + profile.warmup {cfg.warmup} + profile.active {cfg.active} = "
                           f"{cycle}): its trace will hold only {recorded} of the {cfg.active} active step(s); train "
                           f"longer or shorten those")
    elif steps is not None and (cut := cut_cycle(cfg, steps)) is not None:
        # a shorter trace is warned as the first cycle's is; a cycle left out costs nothing (the earlier ones traced)
        recorded, said = cut
        (run_logger.warning if recorded else run_logger.info)(said)
    _EARLIER[os.path.realpath(run_dir)] = frozenset(p.name for p in Path(run_dir).glob("*.pt.trace.json*"))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        detach_cupti_after_cycles()
    logger.info(
        f"profiling: wait {cfg.wait}, warmup {cfg.warmup}, active {cfg.active}, repeat {cfg.repeat} steps; "
        f"traces go to {run_dir}; the logging windows holding profiled steps are left out of samples/s"
    )
    if cfg.warmup == 0:
        run_logger.warning("profiling: profile.warmup 0: the first recorded step also holds the profiler's own "
                           "start-up (CUPTI's on a GPU); 1 or more keeps it out of the trace")
    # torch says both in its own words, as a bare UserWarning in the run's log: the one above, and, as a second cycle
    # starts (repeat 0 or > 1), that each cycle's events replace the last's, which loses nothing here since the
    # trace handler has written each cycle's trace when it ended
    warnings.filterwarnings("ignore", message="Profiler won't be using warmup", category=UserWarning)
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle",
                            category=UserWarning)
    return _StepProfile(
        activities=activities,
        schedule=session_schedule(cfg, steps),
        on_trace_ready=trace_handler(run_dir),
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
        with_stack=cfg.with_stack,
    )


CUPTI_TEARDOWN_FROM = (12, 6)
"""The CUDA version from which CUPTI's re-init after a teardown no longer crashes with CUDA graphs (torch's comment in
`torch/profiler/profiler.py`, which keeps CUPTI attached below it for Inductor's graphs)."""


def detach_cupti_after_cycles() -> None:
    """Have Kineto detach CUPTI as each profiler cycle ends (``TEARDOWN_CUPTI=1``), unless the environment says
    otherwise. By default it stays subscribed to every CUDA call after the trace, and the steps after a --profile cycle
    ran at 26-77% of an unprofiled run's rate to the run's end (a host-bound run, 1000 steps; with the teardown 71-101%:
    sixty-eighth session, `benchmarks/results/profile_cupti_teardown_h200.md`; pytorch/pytorch#144455). Left alone
    before CUDA 12.6, where a re-init after a teardown crashed with CUDA graphs (the step's CUDA graph, and a second
    profiler cycle re-inits), and where ``DISABLE_CUPTI_LAZY_REINIT`` is set: a teardown then re-inits CUPTI eagerly,
    the combination torch's comment says crashes with CUDA graphs on CUDA 12 (torch sets that variable only together
    with ``TEARDOWN_CUPTI=0``). A ROCm build has no CUPTI: nothing to do, nothing said.

    The variable is the process's, and stays set: the later runs of the process (a sweep's trials, `--compare`'s
    variants) find it and keep it. Kineto reads it only as a profiler cycle ends, so an unprofiled run is unaffected.
    """
    # the user's, torch's own (Inductor's CUDA graphs before 12.6), or this function's in an earlier run of the process
    if "TEARDOWN_CUPTI" in os.environ:
        return
    cuda = torch.version.cuda
    if cuda is None:  # ROCm (or a build without CUDA): Kineto traces through roctracer, no CUPTI to detach
        return
    if "DISABLE_CUPTI_LAZY_REINIT" in os.environ:
        logger.info("profiling: DISABLE_CUPTI_LAZY_REINIT is set, TEARDOWN_CUPTI is not: CUPTI stays attached after "
                    "the trace (a teardown would re-init it eagerly, which crashes with CUDA graphs on CUDA 12)")
        return
    parts = cuda.split(".")
    version = tuple(int(x) for x in parts[:2]) if len(parts) >= 2 and all(x.isdigit() for x in parts[:2]) else None
    if version is None:
        logger.info(f"profiling: CUDA version {cuda!r} not read as MAJOR.MINOR: TEARDOWN_CUPTI left unset, so CUPTI "
                    f"stays attached after the trace (set TEARDOWN_CUPTI=1 on CUDA 12.6 or later to detach it)")
    elif version >= CUPTI_TEARDOWN_FROM:
        os.environ["TEARDOWN_CUPTI"] = "1"
    else:
        logger.info(f"profiling: CUDA {cuda} (before {'.'.join(map(str, CUPTI_TEARDOWN_FROM))}): CUPTI "
                    f"stays attached after the trace, and host-bound steps after it run slower than unprofiled ones")


def trace_files(run_dir: Path) -> list[Path]:
    """The run's gzipped Chrome traces, oldest name first (one per profiler cycle and rank)."""
    return sorted(Path(run_dir).glob("*.pt.trace.json.gz"))


def own_trace(run_dir: Path) -> Optional[Path]:
    """The newest trace this process wrote into `run_dir` since its profiler started (`make_profiler`), or None.
    `tensorboard_trace_handler` names its files ``<host>_<pid>.<ns>.pt.trace.json.gz``; in a distributed run every
    rank writes into the same directory, and another rank's file may still be being written; a resumed run's
    directory holds the earlier sessions' traces.

    >>> own_trace(Path("/nonexistent-run")) is None
    True
    """
    earlier = _EARLIER.get(os.path.realpath(run_dir), frozenset())
    mine = [p for p in Path(run_dir).glob(f"{socket.gethostname()}_{os.getpid()}.*.pt.trace.json*")
            if p.name not in earlier]
    return max(mine, key=lambda p: p.stat().st_mtime) if mine else None
