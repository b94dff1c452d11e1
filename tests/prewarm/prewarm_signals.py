"""The signals the client passes on to its served program, and how (imported by client.py, under `python -S`, and by
the server and its child: the standard library only)."""

import os
import signal

# what a client passes on (SIGKILL and SIGSTOP cannot be caught; SIGPIPE and SIGCHLD are the client's own); blocked in
# the server across a fork and in the child until its program runs, so that one passed on at once (the client sends it
# as soon as it has the pid) finds the program's dispositions, not the server's handlers (which would swallow it)
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGCONT, signal.SIGWINCH)


def send(pid: int, group: bool, sig: int) -> None:
    """`sig` to a served program, or to its process group where it leads one (as its client's process did); nothing
    where it has ended."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
