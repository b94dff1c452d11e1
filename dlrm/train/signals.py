"""SIGINT/SIGTERM during training: finish the step, checkpoint, flush, exit; a second signal stops at once. Outside
the steps (a run's start, its summary) SIGTERM stops at once as Ctrl-C does: `StopAtOnce`; the last evaluation and its
checkpoint finish first, then the run stops (`FinishAlone`); in a distributed run the start, and the time from its
first step to its summary, wait for the ranks to agree instead (`agreed_stop`, `held_signals`)."""

from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator, Optional

import torch
from loguru import logger

from dlrm.distributed import said_once
from dlrm.distributed.env import DistEnv
from dlrm.errors import TrainingStopped
from dlrm.stop_signal import StopAtOnce, take_pending  # noqa: F401 - re-exported: the runs' outer guard


class GracefulStop:
    """Context manager that turns the first SIGINT/SIGTERM into a flag the loop checks between steps.

    Example (the process signals itself, as ``kill <pid>`` would, during the third step):
        >>> import os, signal
        >>> with GracefulStop() as stop:
        ...     steps = 0
        ...     while not stop.requested:   # the training loop: a whole step, then look at the flag
        ...         steps += 1
        ...         if steps == 3:
        ...             os.kill(os.getpid(), signal.SIGTERM)
        >>> steps, stop.exit_code   # the step in flight finished; 128 + 15 (SIGTERM); 130 after SIGINT
        (3, 143)
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, doing: str = "finishing the current step, then checkpointing and exiting",
                 defer: bool = False) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}
        self._doing = doing  # what the first signal's warning says happens next
        # a torchrun rank other than 0 in the training loop: the first signal's warning kept for the ranks' agreement
        # (`say_deferred`); a terminal's Ctrl-C reaches every rank, and each printed it (8 lines on 8 GPUs)
        self._defer = defer
        self.deferred: Optional[str] = None
        self.said_by = logger  # the first signal's warning's logger (`agreed_stop`: after the run's last agreement)
        # `run_hold`'s: what a signal after the run's last agreement waits for when an enclosing command's agreement
        # follows (--compare's, after each variant); `after_last`: one came after the last agreement of all
        self.then: Optional[str] = None
        self.after_last = False

    def say_deferred(self, alone: bool) -> None:
        """The ranks agreed on a signal: a deferred first-signal warning is said when some rank got none (`alone`: a
        ``kill PID`` of this process, which the others' lines do not tell), dropped when every rank got it (rank 0's
        says it for all)."""
        line, self.deferred = self.deferred, None
        if line is not None and alone:
            logger.warning(line)

    def take_over(self, other: "GracefulStop") -> None:
        """Hold `other`'s signal, and its deferred warning, where this one holds none: the run's `held_signals` and the
        training loop's stop hand a signal on to each other (its warning, left behind, was never said)."""
        if self.signum is None and other.signum is not None:
            self.signum, self.deferred, other.deferred = other.signum, other.deferred, None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # second signal: give up at once
            # under torchrun's agent, which passes a signal on to every rank, said by each machine's first rank
            # (`said_once.signal_logger`); every rank said it, N lines on N ranks
            said_once.signal_logger().warning(f"{signal.Signals(signum).name} again: stopping now, without a "
                                              "checkpoint")
            raise SystemExit(128 + signum)
        self.signum = signum
        line = f"{signal.Signals(signum).name}: {self._doing} (send it again to stop at once)"
        if self._defer:
            self.deferred = line
        else:
            self.said_by.warning(line)

    def __enter__(self) -> "GracefulStop":
        for s in self.SIGNALS:
            try:
                # a signal whose starter set it to be ignored (nohup, a shell's background job, a supervisor) stays
                # ignored, as `StopAtOnce` leaves it: replaced, such a process stopped on it during the steps alone
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        # a signal before it whose `StopAtOnce` exception a library dropped (an import's catch-all): taken as if it
        # came now (the ranks' start-up agrees on it; lost, every rank trained on until torchrun's SIGKILL)
        pending = take_pending() if self._previous else None
        if pending is not None and self.signum is None:
            self._handle(pending, None)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            if signal.getsignal(s) == self._handle:  # (not one installed since: `LateSignals`, a run's last moments)
                signal.signal(s, handler)


HELD = "held until every rank knows, then stopping"
"""What `held_signals` says of a signal between the run's agreed phases, which the next agreement takes."""


@contextlib.contextmanager
def agreed_stop(env: DistEnv, device: torch.device, where: str, message: Callable[[str], str],
                held: Optional[GracefulStop] = None, said_alone: bool = False, followed: bool = False,
                ignored: str = "the run is writing its summary") -> Iterator[None]:
    """A distributed run's phase outside the training steps that holds collectives (its start; its last evaluation,
    checkpoint and summary): a SIGINT/SIGTERM there is held until the phase ends, where the ranks agree on it (one
    all-reduce MAX), and then every rank raises `TrainingStopped` with the same code (128 + the largest signal any rank got) and
    ``message(signal name)``. Stopped at once as `StopAtOnce` does, a rank that alone got the signal (a user's ``kill
    PID``, a scheduler pre-empting one process) left while the others waited for it in the phase's next collective, to
    die of gloo's "Connection closed by peer" traceback (a bug's exit 1) or at the process group's timeout. The stop
    comes at the phase's end (the start: no checkpoint; the last evaluation: after its checkpoint); a second signal
    stops at once. `held`: the run's `held_signals`, which holds the phase's signals (and any from before it) instead
    of a handler of its own. One process: nothing changes (`StopAtOnce` stops it at once), unless `said_alone`
    (the summary's making, after the last checkpoint): its stop at once says ``message`` too, as several ranks' does
    (it said "SIGTERM: stopped at once, outside the training steps (no checkpoint written now)" or "interrupted
    (Ctrl-C)", and not that the last step's checkpoint holds the whole run, for a --resume to make the summary).
    `followed`: another agreed phase comes after this one (the last evaluation's: the summary's), which takes a signal
    `held` gets after this one's agreement; without it this is the run's last, and such a signal stops nothing (said
    "ignored"). Said "ignored" after the last evaluation's agreement too, a signal there was taken by the summary's
    agreement: the run stopped, 143, just after its ranks read that nothing was left to stop."""
    doing = f"stopping {where}, once every rank knows"
    if env.distributed and held is None and (_outer is not None or _arming):  # the command's hold, kept from here
        held, followed = _outer or _arm(env, doing), True  # on (`run_hold`: the start's agreement to the run's end)
    if not env.distributed:
        try:
            yield
            pending = take_pending()  # a signal whose `StopAtOnce` exception a library dropped: stops here, at the end
            if pending is not None:  # (lost, the run trained to its end as if none had come)
                raise TrainingStopped(128 + pending, message(signal.Signals(pending).name), agreed=True)
        except (TrainingStopped, KeyboardInterrupt) as e:  # (raised where it arrived: `StopAtOnce`, Ctrl-C)
            if not said_alone or getattr(e, "agreed", False):
                raise
            code = getattr(e, "exit_code", 128 + signal.SIGINT)
            raise TrainingStopped(code, message(signal.Signals(code - 128).name), agreed=True) from None
        return
    if held is not None:  # installed (`held_signals`): what it holds from before this phase counts too
        held._doing, held._defer = doing, not env.is_main  # (a rank other than 0: its warning kept for the agreement)
        held.said_by, held.after_last = logger, False  # (`run_hold`'s, used again phase after phase)
    # a rank other than 0 keeps its first signal's warning until the agreement (as the training loop's ranks do): a
    # signal every rank got (torchrun's, or one a library dropped during the imports) was warned of by each
    with contextlib.nullcontext(held) if held is not None else GracefulStop(doing, defer=not env.is_main) as stop:
        yield
        # the largest signal, (the MAX of 1 - got) whether some rank got none, and (the MAX of -signal) the smallest:
        # a rank's warning is said when some rank got none or another signal (SIGINT here, SIGTERM there)
        agreed, alone, least = (int(v) for v in env.all_reduce_max(torch.tensor(
            [int(stop.signum or 0), int(stop.signum is None), -int(stop.signum or 0)], device=device)).tolist())
    if agreed:
        stop.say_deferred(alone=bool(alone) or -least != agreed)
        raise TrainingStopped(128 + agreed, message(signal.Signals(agreed).name), agreed=True)
    if held is not None and (followed or held.then):  # agreed that none came: one now waits for the next agreement
        held._doing, held._defer = HELD if followed else held.then, not env.is_main  # (--compare's: `held.then`)
    elif held is not None:  # agreed that none came: one now (after the run's last agreement) has nothing left to
        # stop; said by the rank that got it (no agreement follows to tell one every rank got from a rank's own), or
        # under torchrun's agent, which gets it to every rank, by each machine's first rank (`said_once.signal_logger`)
        held._doing, held._defer = f"ignored: {ignored}, nothing is left to stop", False
        held.said_by, held.after_last = said_once.signal_logger(), True


@contextlib.contextmanager
def held_signals(env: DistEnv) -> Iterator[GracefulStop]:
    """A distributed run's training and end (`Trainer.fit`): a SIGINT/SIGTERM that arrives between its agreed phases
    (the loop's `GracefulStop`, the last evaluation's `agreed_stop`) is held for the next one, which agrees on it.
    Left to `StopAtOnce` there, the signalled rank stopped alone: between the loop and the last evaluation the others
    died in its collectives (gloo's "Connection closed by peer" traceback, exit 1); during the summary they exited 0
    beside its 143, and a signalled rank 0 wrote no summary.json. One process: one not installed (it holds nothing,
    `StopAtOnce` stays), so nothing changes. A rank other than 0 keeps its warning for the agreement that takes the
    signal (`GracefulStop.say_deferred`): a signal every rank got (torchrun's) was warned of by every rank."""
    if not env.distributed:
        yield GracefulStop()
        return
    if _outer is not None:  # the command's (`run_hold`): held since the start's agreement, and kept after the run
        yield _outer
        return
    with GracefulStop(HELD, defer=not env.is_main) as held:
        yield held


_outer: Optional[GracefulStop] = None
"""A distributed command's hold of SIGINT/SIGTERM (`run_hold`) once it is installed: every agreed phase of its runs
(`agreed_stop`, `held_signals`) holds with it, so that one between two phases waits for the next agreement."""
_arming = False  # a `run_hold` is open whose hold the first distributed agreed phase installs (it knows the ranks)


def _arm(env: DistEnv, doing: str = HELD) -> GracefulStop:
    global _outer  # (`doing`: the first phase's, which a signal a library dropped before it, taken now, is said with)
    _outer = GracefulStop(doing, defer=not env.is_main).__enter__()
    return _outer


@contextlib.contextmanager
def run_hold(env: Optional[DistEnv] = None, then: Optional[str] = None) -> Iterator[Optional[GracefulStop]]:
    """A distributed command's SIGINT/SIGTERM, held from its first agreed phase to its end (`dlrm.train.trainer.train`:
    from the start's agreement on, installed by that phase's `agreed_stop`; --compare's `env`: from now on, across its
    variants' runs, `then` what a signal after a run's last agreement waits for). Each phase's hold used to end with
    the phase: a signal between the start's agreement and the training's hold stopped its rank alone (`StopAtOnce`),
    the others left waiting in the first collective until the timeout or gloo's "Connection closed by peer"; one after
    a --compare variant's last agreement was said "ignored" and lost, the next variants trained. Yields the hold (None
    until installed, and for one process: nothing changes). Inside another `run_hold` (a --compare's variant's
    `train`), that one's. A signal it holds that no agreement took (a finished run's resume: nothing follows its
    start's agreement) stops the command as it ends; one after the last agreement (said "ignored") stops nothing."""
    global _outer, _arming
    if _outer is not None or _arming:
        yield _outer
        return
    _arming = True
    try:
        if env is not None and env.distributed:
            _arm(env).then = then
        yield _outer
        hold = _outer
        if hold is not None and hold.signum and not hold.after_last:
            raise TrainingStopped(128 + hold.signum, f"{signal.Signals(hold.signum).name}: stopped, outside the "
                                                     "training steps (no checkpoint written now)")
    finally:
        hold, _outer, _arming = _outer, None, False
        if hold is not None:
            hold.__exit__(None, None, None)


class FinishAlone:
    """One process's last evaluation and the checkpoint that holds it (`Trainer.fit`): a SIGINT/SIGTERM there lets
    both finish, then stops at `release` (`TrainingStopped`: 128 + the signal, ``message(signal name)``), the summary
    left to a --resume, as a signal after the training loop's last look leaves it; a second signal stops at once.
    Stopped at once there (`StopAtOnce`, Ctrl-C's KeyboardInterrupt), the run lost every step since its last
    checkpoint: all of a run without checkpoint.every, which its --resume trained again from step 0. `pending`: a
    signal the training loop got after its last look at one (during an early stop's evaluation: its checkpoint is
    this phase's), held as if it came here (lost, the run went on to its summary and exit 0, a sweep to its next
    trial). Several ranks: nothing changes (`agreed_stop` holds the phase for them)."""

    def __init__(self, env: DistEnv, message: Callable[[str], str], pending: Optional[int] = None) -> None:
        self._stop = None if env.distributed else GracefulStop("finishing the last evaluation and its checkpoint, "
                                                               "then exiting")
        if self._stop is not None:
            self._stop.signum = pending  # (a second signal, here, stops at once)
        self._message = message

    def __enter__(self) -> "FinishAlone":
        if self._stop is not None:
            self._stop.__enter__()
        return self

    def release(self) -> None:
        """The handlers before it back; a signal it held stops the run now."""
        stop, self._stop = self._stop, None
        if stop is not None:
            stop.__exit__(None, None, None)
            if stop.signum:
                raise TrainingStopped(128 + stop.signum, self._message(signal.Signals(stop.signum).name), agreed=True)

    def __exit__(self, *exc) -> None:
        if self._stop is not None:  # an error before `release`: its handlers back, the error goes on
            self._stop.__exit__(*exc)
            self._stop = None
