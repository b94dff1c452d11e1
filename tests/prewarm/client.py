"""The prewarmed interpreter's client: what `sys.executable` runs in a test process (through the `python` wrapper that
launch.py writes). It asks the server (server.py) for a child that becomes this process, then stands for it: signals
sent here are passed on, and it ends as the child ended (its exit code, or death by the same signal). What the
server cannot serve, or what this does not parse, runs in the real interpreter (exec: nothing of this stays).

Runs under `python -S -E -s` (no site, no PYTHON* variables): the standard library only, ~10 ms.

Usage (the wrapper's): python -S -E -s client.py SOCKET REAL_PYTHON [ARGS as given to python...]
"""

import json
import os
import select
import signal
import socket
import sys

from prewarm_signals import PASSED_ON, send  # this folder is sys.path[0]


def open_descriptors(wrapper: str) -> list[int]:
    """This process's open descriptors, as it got them from exec (listed before it opens any of its own), but the
    wrapper script's: /bin/sh (dash) reads it on a descriptor >= 10 left open across exec where 0-9 were all taken
    (it sets close-on-exec only on one it moved there); that one is closed, as a fresh interpreter never had it."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd")]
    try:
        script = os.stat(wrapper)
        script = (script.st_dev, script.st_ino)
    except OSError:  # removed since (the session ending)
        script = None
    numbers = []
    for fd in listed:
        try:
            st = os.fstat(fd)
        except OSError:  # the listing's own directory descriptor, closed by now
            continue
        if fd > 2 and (st.st_dev, st.st_ino) == script:
            os.close(fd)
            continue
        numbers.append(fd)
    return sorted(numbers)


def parse(args: list[str]) -> dict | None:
    """`python` arguments this serves: [-u]... then SCRIPT, -m MODULE or -c CODE, then the program's arguments."""
    unbuffered = False
    i = 0
    while i < len(args) and args[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(args):
        return None
    if args[i] in ("-m", "-c"):
        if i + 1 >= len(args):
            return None
        mode = "module" if args[i] == "-m" else "code"
        return {"unbuffered": unbuffered, "mode": mode, "target": args[i + 1], "args": args[i + 2:]}
    if args[i].startswith("-") or not args[i].endswith(".py") or not os.path.isfile(args[i]):
        return None
    return {"unbuffered": unbuffered, "mode": "script", "target": args[i], "args": args[i + 1:]}


def signal_in_wait(signum: int) -> None:
    """Tests only (DLRM_PREWARM_TEST_SIGNAL_IN_WAIT=N, tests/test_prewarm.py): signal N comes once the main thread
    blocks waiting for the program's end, and another thread takes it: its C-level handler runs, but no Python code
    in the main thread until the wait ends, as where it came just before the wait began (see `main`)."""
    import threading
    import time

    main_thread = threading.get_native_id()

    def waiting() -> bool:  # asleep in a system call, not for the GIL that this thread holds now and then (a futex)
        try:
            with open(f"/proc/self/task/{main_thread}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{main_thread}/wchan") as f:
                return state == "S" and "futex" not in f.read()
        except OSError:
            return False

    def deliver() -> None:
        deadline = time.monotonic() + 10
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signum)

    threading.Thread(target=deliver, daemon=True).start()


def main() -> None:
    sock_path, real, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    fds = open_descriptors(os.path.join(os.path.dirname(sock_path), "python"))  # launch.py's wrapper, beside it
    request = parse(args)

    def fresh_interpreter() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)  # exec keeps a mask (a pending signal acts now)
        os.execv(real, [real, *args])

    if request is None:
        fresh_interpreter()
    # a signal sent before the child's pid is known waits (blocked) and is passed on once it is
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    ignored = [int(s) for s in PASSED_ON if signal.getsignal(s) == signal.SIG_IGN]
    umask = os.umask(0)
    os.umask(umask)
    # a process started as a process group's leader (start_new_session: torchrun's ranks, tests that kill a tool's
    # workers with it): the child leads its own group, and what is sent to this one goes to that group
    group = os.getpgrp() == os.getpid()
    session = os.getsid(0) == os.getpid()  # start_new_session: the child leads a session of its own too
    request.update(env=dict(os.environ), cwd=os.getcwd(), umask=umask, fds=fds, ignored=ignored, orig_argv=args,
                   group=group, session=session)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.connect(sock_path)
        socket.send_fds(sock, [json.dumps(request).encode()], fds)
        reply = sock.recv(4096).decode()
    except OSError:  # no server (not started yet, or gone): a fresh interpreter
        fresh_interpreter()
    if not reply.startswith("pid "):  # the server says why in its log
        fresh_interpreter()
    for fd in fds:  # the child holds them now (a pipe's reader sees its end when the child closes it, not this)
        if fd > 2:
            os.close(fd)
    pid = int(reply.split()[1])

    # a signal is passed on from the wakeup descriptor, where its C-level handler writes its number at once, not by a
    # Python-level handler: CPython runs that between bytecodes, and for a signal that came after the unblocking below
    # had looked for one but before the blocking wait for the exit began, only when that wait ended (at the program's
    # end: it never got the signal). Its byte ends the poll at once. Every signal, those this process started with
    # ignored too: the program starts with them ignored (`ignored`) and may set a handler of its own, as a fresh
    # interpreter's program would get them then (and its children in a group it leads, whatever it does); where it
    # leaves one ignored, the one passed on does nothing there either
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    for s in PASSED_ON:
        signal.signal(s, lambda *_: None)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)  # one held since it began is written to wake_w now
    if os.environ.get("DLRM_PREWARM_TEST_SIGNAL_IN_WAIT"):
        signal_in_wait(int(os.environ["DLRM_PREWARM_TEST_SIGNAL_IN_WAIT"]))
    while True:
        ready = [fd for fd, _ in poller.poll()]
        if wake_r in ready:
            try:
                for signum in os.read(wake_r, 512):
                    send(pid, group, signum)
            except BlockingIOError:
                pass
        if sock.fileno() in ready:  # the exit, or the server's end (closed: it went away)
            break
    reply = sock.recv(4096)
    if not reply:
        print("prewarmed interpreter: the server went away before its child ended", file=sys.stderr)
        os._exit(1)
    code = int(reply.decode().split()[1])
    if code < 0:  # the same death (a handled or ignored signal is reset first: SIGKILL and SIGSTOP cannot be either)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    main()
