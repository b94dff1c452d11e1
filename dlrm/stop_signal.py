"""SIGTERM outside a run's training steps: raise `TrainingStopped` where it arrives, so the run's own cleanup runs.

Below `dlrm.distributed` in the layers (pyproject.toml's import contract), so that every entry point can use it:
train.py and `dlrm.train.trainer.train`, ``python -m dlrm.sweep``, ``python -m dlrm.distributed.merge``. The training
steps themselves stop gracefully instead (`dlrm.train.signals.GracefulStop`). The data tools (``python -m
dlrm.preprocess``, ``dlrm.data.synthetic``, ``dlrm.data.mlperf_import``, ``dlrm.data.relayout``) use
``StopAtOnce(interrupt=True)``: SIGTERM raises `Terminated`, a KeyboardInterrupt, so it takes their Ctrl-C paths.
Once train.py's results are all written, a SIGINT or SIGTERM stops nothing: `LateSignals`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Optional

from loguru import logger

from dlrm.errors import TrainingStopped


EXIT_INTERRUPTED = 130
"""The exit code of Ctrl-C (128 + SIGINT)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM in a data tool (`StopAtOnce` with ``interrupt=True``), raised where it arrives as Ctrl-C's
    KeyboardInterrupt is: every cleanup those tools run on Ctrl-C (a staging directory removed, an unfinished run kept
    for the same command to resume) runs on it too, and no ``except Exception`` takes it for an error of the work.
    ``exit_code``: 128 + the signal (143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.exit_code = signum, 128 + signum


def interruption(exc: BaseException) -> tuple[int, str]:
    """A data tool's KeyboardInterrupt (`Terminated`, or anything carrying its ``exit_code``) as its exit code and
    what stopped it: (143, "SIGTERM"), or (130, "Ctrl-C")."""
    code = getattr(exc, "exit_code", EXIT_INTERRUPTED)
    return code, "Ctrl-C" if code == EXIT_INTERRUPTED else signal.Signals(code - 128).name


def stop_signal_name(exc: BaseException) -> Optional[str]:
    """The signal that `exc` says stopped the work ("SIGTERM", "SIGINT"): a `TrainingStopped` (128 + the signal), a
    KeyboardInterrupt (Ctrl-C's SIGINT, or a data tool's `Terminated`); None for anything else, a failure.

        >>> stop_signal_name(TrainingStopped(143, "stopped")), stop_signal_name(KeyboardInterrupt())
        ('SIGTERM', 'SIGINT')
        >>> stop_signal_name(ValueError("bad")) is None
        True
    """
    if not isinstance(exc, (TrainingStopped, KeyboardInterrupt)):
        return None
    code = getattr(exc, "exit_code", EXIT_INTERRUPTED)
    try:
        return signal.Signals(code - 128).name
    except ValueError:  # (a code that is no signal's: still a stop)
        return f"exit code {code}"


def signal_stop_inside(exc: BaseException) -> Optional[TrainingStopped]:
    """The `TrainingStopped` of a signal that a library wrapped in its own error (SIGTERM during ``--export``:
    torch.export's serializer raised ``SerializeError: Failed serializing node ...`` from it, which read as a bug,
    exit 1, where a stop exits 143), found among `exc`'s causes and contexts; None where there is none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TrainingStopped):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


_pending: Optional[int] = None
"""The signal whose exception `StopAtOnce` raised last, until a guard takes it (`take_pending`) or the guard that
installed the handler ends: the exception is raised where the signal arrives, often inside a library (an import, a
call), and code there that catches every error drops it (torch's C init imports numpy and drops its failure: a
SIGTERM to torchrun that reached the ranks as they imported torch was lost, and every rank trained on)."""


def take_pending() -> Optional[int]:
    """The signal `StopAtOnce` raised whose exception has not stopped the command yet (dropped where it was raised,
    see `_pending`), forgotten here; None where there is none. A guard installed after it (`dlrm.train.signals`'
    `GracefulStop`) acts on it as on its own signal; a run's start-up stops on it (`raise_pending`).

        >>> take_pending() is None
        True
    """
    global _pending
    signum, _pending = _pending, None
    return signum


_pending_interrupt = False
"""Whether `_pending`'s guard was a data tool's (`StopAtOnce(interrupt=True)`: its exception `Terminated`)."""


def raise_pending() -> None:
    """Raise `StopAtOnce`'s exception again for a signal whose first one was dropped (`take_pending`): just before a
    command puts its output in place. A data tool's `Terminated` (a KeyboardInterrupt) passes an ``except
    Exception``, yet not a bare ``except:``, an ``except BaseException`` nor a finalizer's "Exception ignored"."""
    interrupt, signum = _pending_interrupt, take_pending()
    if signum is not None and interrupt:
        raise Terminated(signum)
    if signum is not None:
        raise TrainingStopped(128 + signum, stopped_at_once(signum))


def stopped_at_once(signum: int) -> str:
    """The line of a signal that stopped a command where no step or phase of its own says more."""
    return f"{signal.Signals(signum).name}: stopped at once, outside the training steps (no checkpoint written now)"


class StopAtOnce:
    """Context manager (a whole run, around `GracefulStop`'s loop): SIGTERM raises `TrainingStopped` (exit 143) where
    it arrives, as Ctrl-C raises KeyboardInterrupt, so the run's own cleanup runs. Left to its default action, a SIGTERM
    while a run started (its checkpoint restored, say) killed the process before `RunDirectory.abandon`: the new run
    directory stayed, and its name was refused from then on ("already exists"). A handler set by whoever started the
    process (ignored, say) is left as it is. ``interrupt=True`` (the data tools): SIGTERM raises `Terminated`
    instead, a KeyboardInterrupt, so that it takes the tool's Ctrl-C paths."""

    def __init__(self, interrupt: bool = False) -> None:
        self._previous: Optional[object] = None
        self._interrupt = interrupt

    def _handle(self, signum, frame) -> None:
        global _pending, _pending_interrupt
        # until the exception stops the command: dropped, a later guard acts on it (`take_pending`, `raise_pending`)
        _pending, _pending_interrupt = signum, self._interrupt
        if self._interrupt:
            raise Terminated(signum)
        raise TrainingStopped(128 + signum, stopped_at_once(signum))

    def __enter__(self) -> "StopAtOnce":
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:  # the guard that installed the handler: its signal stopped the command, or
            take_pending()  # the command ended without meeting a guard that takes it (nothing left to stop)
        # (unless replaced meanwhile: `LateSignals`, begun inside, holds the signals to the process's end)
        if self._previous is not None and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside wait until it ends, then act as they would have (through the handlers in
    place before it; a default action takes effect then): for a few steps that must all happen or none, as the renames that
    publish a set of report files (`dlrm.checkpoint.write_files_atomic`); a Ctrl-C between two of them left a new file
    beside the older others. Only the main thread handles signals: elsewhere it defers nothing.

    Example:
        >>> import os
        >>> got = []
        >>> previous = signal.signal(signal.SIGTERM, lambda n, f: got.append("handled"))
        >>> with signals_deferred():
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     got.append("finished")
        >>> got
        ['finished', 'handled']
        >>> _ = signal.signal(signal.SIGTERM, previous)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(arrived):  # each once, in the order they came
            signal.raise_signal(signum)


class LateSignals:
    """train.py's SIGINT and SIGTERM once its results are all written (`begin`: as the run's summary.json, its last
    output, is written; the other modes' when they return), to the end of the process: noted, said in one line
    (`say`, `at_exit`), and the command exits 0. Before, one there raised (`StopAtOnce`, Ctrl-C's KeyboardInterrupt)
    or, once `StopAtOnce` had put the default action back, killed the process: a finished run ended 143 or 130, with
    "stopped at once ... (no checkpoint written now)" or no line at all (in the interpreter's shutdown: its threads
    joined, its exit functions, the modules torn down), and a scheduler or a script took it for a killed run, where
    its ``--resume`` trains nothing. Exit 0, not 128 + the signal: everything the run was to write is written and
    whole, the signal came to stop a process that was ending anyway, and a finished distributed run's rank 0 already
    ignored one during its summary's write (every rank exits 0). A second signal stops at once (a shutdown that
    hangs), as a kill would."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    # train.py's (its `dlrm.cli.main` is the process's program): held through the interpreter's exit (`at_exit`).
    # False: `main` called by other code (click's CliRunner in the tests) puts the handlers it found back as it returns
    until_exit = False

    def __init__(self, said_by=None, again_said: bool = True) -> None:
        # `said_by`: the logger of `say` (train.py's: `dlrm.distributed.said_once.signal_logger`, under torchrun one
        # line for the ranks, whose every one got the agent's signal); `again_said`: whether this process writes the
        # second signal's line (False for the ranks that logger silences: `said_once.late_signals`)
        self._said_by, self._again_said = said_by or logger, again_said
        self.arrived: Optional[int] = None
        self._what = ""
        self._begun = self._said = False
        # the handlers the command found (made at its start): `end` puts them back, whatever guards came between
        self._outer = {s: signal.getsignal(s) for s in self.SIGNALS}

    def begin(self, what: str) -> None:
        """From now on the command's results are written (`what` says which): a signal is noted, not acted on. Only
        the main thread handles signals (elsewhere: nothing changes); one a starter ignored (nohup) stays ignored."""
        if self._begun or threading.current_thread() is not threading.main_thread():
            return
        self._what, self._begun = what, True
        # a SIGTERM whose `StopAtOnce` exception a library dropped, not acted on before the results were written (each
        # mode stops on one before its own output: `raise_pending`): it too came once nothing was left to stop, and
        # is said as one that arrives from now on (forgotten by `StopAtOnce`'s end, the command exited 0 without a word)
        self.arrived = take_pending()
        for s in self.SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, self._note)

    def end(self) -> None:
        """The handlers the command found back; one noted and not said is dropped (the command failed after `begin`,
        summary.json's write on a full disk: the failure's line and exit code stand)."""
        self._begun = False
        for s, outer in self._outer.items():
            if outer is not None and signal.getsignal(s) == self._note:
                signal.signal(s, outer)

    def _note(self, signum: int, frame) -> None:
        if self.arrived is None:
            self.arrived = signum  # said at the next `say` (logged here, a record could meet loguru's own, re-entered)
            return
        # (written directly: a handler's write to sys.stderr or loguru can re-enter the one it interrupted)
        if self._again_said:
            os.write(2, f"{time.strftime('%H:%M:%S')} WARNING {signal.Signals(signum).name} again after {self._what}: "
                        "stopping now\n".encode())
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def say(self) -> None:
        """The line of a signal noted since `begin`, once."""
        if self._begun and self.arrived is not None and not self._said:
            self._said = True
            self._said_by.warning(f"{signal.Signals(self.arrived).name} arrived after {self._what}: nothing left to "
                                  "stop, exit 0")

    def at_exit(self) -> None:
        """The last of the interpreter's exit functions (`dlrm.cli.main` registers it before torch is imported, so
        torch's, multiprocessing's and the others' run before it). A signal during the threads' joins or those
        functions is said now. After it, in the modules' teardown (seconds on a loaded 2-core machine), Python's own
        handlers are gone and a signal took its default action: a SIGTERM killed the finished run, 143 without a line.
        Ignored there instead, unsaid (no Python code runs after this one to say it; every output is closed by then)."""
        if not self._begun:
            return
        for s in self.SIGNALS:
            if signal.getsignal(s) == self._note:
                signal.signal(s, signal.SIG_IGN)
        self.say()
