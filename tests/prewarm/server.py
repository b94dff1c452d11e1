"""The prewarmed interpreter's server: one process per pytest process that has imported torch and torch._dynamo (what
every train.py, torchrun launcher and rank imports: 2.3 s of CPU of the ~3.5 s a short train.py run takes on the
2-core CI machine) and forks a child for each Python process a test starts through `client.py`. The child becomes
that process: the client's argv, environment, working directory, umask, open file descriptors (by number) and ignored
signals; a fresh `__main__`, sys.path and stdio; then the script, `-m` module or `-c` code runs and the child exits as
Python does (SystemExit, an uncaught exception, KeyboardInterrupt's death by SIGINT, threads joined, atexit run).

A request this process cannot serve as a fresh interpreter would is answered "fallback" (the client then execs the
real interpreter): a variable of the environment that torch, Triton, OpenMP or Python read when they start differs
from this server's (it started with the test process's), or a descriptor number this server holds is asked for.

Protocol (one SOCK_SEQPACKET connection a process): the client sends a JSON request with its descriptors attached;
the server answers b"pid N" (or b"fallback REASON") and, when the child ends, b"exit CODE" (CODE as
`os.waitstatus_to_exitcode`: -N for signal N). The client closing the connection (it was killed) kills the child.

Usage: python tests/prewarm/server.py SOCKET_PATH WRAPPER_PATH
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import sys

# the environment this process started with (importing torch's compiler sets TORCHINDUCTOR_CACHE_DIR in its own)
START_ENV = dict(os.environ)

# imported before serving: the point of this process
import torch  # noqa: F401
import torch._dynamo  # noqa: F401

from prewarm_child import become  # this folder is sys.path[0]; the child's code, run after the fork
from prewarm_signals import PASSED_ON, send

# a variable whose name starts so, or names one of these, must be the server's own for a request to be served: read
# when Python, libgomp, torch, Dynamo, Inductor or Triton start (here, before any request). Those APPLIED_BY_CHILD
# the child applies itself or are read later, as are torchrun's rank variables.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "TRITON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS", "CUDA",
                    "LD_", "MALLOC", "LC_", "LANG", "NUMPY", "HOME", "XDG_", "TMPDIR")
APPLIED_BY_CHILD = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
                    # read when first compiling (Inductor's cache_dir() sets the first in a test process that compiled)
                    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# (torchrun's grace, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, is read when its LaunchConfig is made: tests/test_shutdown_grace.py
# set it for 5 processes that each started a fresh interpreter, ~2.5 s of CPU apiece)
READ_LATER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")

# stdio as this server made them (the child rebuilds its own on the client's descriptors with the same encodings)
STDIO = {name: (getattr(sys, name).encoding, getattr(sys, name).errors) for name in ("stdin", "stdout", "stderr")}


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` read when the interpreter and its preloaded modules start."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in APPLIED_BY_CHILD
            and not k.startswith(READ_LATER_PREFIXES)}


def fallback_reason(request: dict, kept: set[int]) -> str | None:
    """Why `request` must run in a fresh interpreter instead (None: it can be served); `kept`: the descriptors a
    child keeps (numbers >= 1024 are where the child moves what it places)."""
    mine, theirs = startup_env(START_ENV), startup_env(request["env"])
    if mine != theirs:
        changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        return f"environment differs in {', '.join(changed)}"
    taken = sorted(n for n in request["fds"] if n in kept or n >= 1024)
    if taken:
        return f"descriptors {taken} are the server's"
    return None


def log(line: str) -> None:
    """One line to this server's log (its stdout: the `log` file in launch.py's folder)."""
    print(line, flush=True)


def kept_descriptors() -> set[int]:
    """The descriptors a child keeps: those open before serving (the preloaded modules'; 0-2 are replaced). The
    server's own, made after, are closed in the child, so their numbers are free for the client's."""
    kept = set()
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            os.fstat(fd)
        except OSError:  # the listing's own directory descriptor, closed by now
            continue
        kept.add(fd)
    return kept - {0, 1, 2}


def serve(path: str, wrapper: str) -> None:
    kept = kept_descriptors()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients see the socket only once it listens
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the wakeup descriptor
    stop = []
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the test session's end, or its Ctrl-C
        signal.signal(s, lambda *_: stop.append(True))
    parent = os.getppid()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    conns: dict[int, socket.socket] = {}  # running child -> its client's connection (gone: the client was killed)
    groups: dict[int, bool] = {}  # running child -> whether it leads a process group

    def reap() -> None:
        while groups:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            groups.pop(pid, None)
            conn = conns.pop(pid, None)
            if conn is not None:
                sel.unregister(conn)
                try:
                    conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
                except OSError:
                    pass
                conn.close()

    try:
        while not stop and os.getppid() == parent:
            for key, _ in sel.select(timeout=1.0):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    open_conns = [c.fileno() for c in conns.values()]
                    server_fds = [listener.fileno(), wake_r, wake_w, sel.fileno(), conn.fileno(), *open_conns]
                    try:
                        served = accept(conn, kept, wrapper, server_fds)
                    except Exception as exc:  # noqa: BLE001 (a malformed request: its client falls back, others go on)
                        log(f"error {exc!r}")
                        served = None
                    if served is None:
                        conn.close()
                    else:
                        conns[served[0]], groups[served[0]] = conn, served[1]
                        sel.register(conn, selectors.EVENT_READ)
                elif key.fileobj == wake_r:
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    reap()
                else:  # a client's end closed: it was killed (it waits for the exit otherwise), SIGKILL passed on
                    pid = next((p for p, c in conns.items() if c is key.fileobj), None)
                    if pid is None:  # its child was reaped earlier in this batch (reap() closed the connection)
                        continue
                    send(pid, groups[pid], signal.SIGKILL)
                    sel.unregister(key.fileobj)
                    conns.pop(pid).close()  # reaped later, nobody to tell
    finally:
        for pid, group in groups.items():
            send(pid, group, signal.SIGKILL)
        os.unlink(path)


def accept(conn: socket.socket, kept: set[int], wrapper: str, server_fds: list[int]) -> tuple[int, bool] | None:
    """Read one request from `conn` and fork its child: (its pid, whether it leads a process group); None: answered
    fallback, or no request."""
    conn.settimeout(10)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 22, 1024)
        request = json.loads(data)
    except (OSError, ValueError):
        return None
    conn.settimeout(None)
    reason = fallback_reason(request, kept)
    if reason is None and len(fds) != len(request["fds"]):
        reason = "descriptors lost in transit"
    if reason is not None:
        for fd in fds:
            os.close(fd)
        log(f"fallback {reason}: {request.get('mode')} {str(request.get('target'))[:80]!r}")
        try:
            conn.send(f"fallback {reason}".encode())
        except OSError:
            pass
        return None
    # a session's leader (start_new_session) gets its session in the child (it cannot be made from here, and setsid
    # fails in a group's leader): the pid is told once it has it, so that what the client passes on reaches its group
    session = os.pipe() if request.get("session") else None
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)  # until the child's program runs (prewarm_signals.PASSED_ON)
    pid = os.fork()
    if pid == 0:
        try:
            if session:
                os.setsid()
                os.close(session[0])
                os.close(session[1])
            log_fd = fcntl.fcntl(sys.stdout.fileno(), fcntl.F_DUPFD_CLOEXEC, 1024)
            become(request, fds, server_fds, wrapper, STDIO, log_fd)
        finally:
            os._exit(70)  # become() ends the process itself; reaching here is a bug in it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    if session:
        os.close(session[1])
        os.read(session[0], 1)  # end of file: the child has its session (or died)
        os.close(session[0])
    elif request["group"]:  # here too (as a shell does): the group exists before the client can signal it
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
    for fd in fds:
        os.close(fd)
    log(f"served {pid}: {request['mode']} {request['target'][:80]!r}")
    try:
        conn.send(f"pid {pid}".encode())
    except OSError:  # the client is gone already: its end reads as closed in serve(), which kills the child
        pass
    return pid, request["group"]


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
