"""The prewarmed interpreter (tests/prewarm/launch.py) that the suite's processes start through: a served process sees
what the same command in a fresh interpreter sees, ends the same way, gets the same signals and descriptors, and what
it cannot serve runs in the real interpreter. Each test compares with the real interpreter itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.prewarm import launch

# what a program can see of how it was started (all but the interpreter's path and what it has imported)
PROBE = textwrap.dedent("""
    import json, os, sys
    main = sys.modules["__main__"]
    print(json.dumps({
        "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
        "builtins": type(__builtins__).__name__,
        "file": getattr(main, "__file__", None), "spec": getattr(getattr(main, "__spec__", None), "name", "no spec"),
        "env": os.environ.get("PREWARM_PROBE"), "stdin": sys.stdin.read(), "umask": os.umask(0o22),
        "stdio": [(s.encoding, s.errors, s.line_buffering, s.write_through, s.mode) for s in (sys.stdout, sys.stderr)],
        "sigint": repr(__import__("signal").getsignal(__import__("signal").SIGINT)),
        "sigterm": repr(__import__("signal").getsignal(__import__("signal").SIGTERM)),
        "main": sorted(vars(main)), "loader": getattr(main.__loader__, "__name__", type(main.__loader__).__name__),
        "loader_path": getattr(main.__loader__, "path", None), "names": [s.name for s in (sys.stdin, sys.stdout)],
    }))
""")


@pytest.fixture(scope="module")
def prewarmed():
    p = launch.Prewarmed(launch.real_python())
    p.wait_ready(180)
    yield p
    p.stop()


def both(prewarmed, args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """`args` run by the real interpreter and through the server (checked served: its log has one more child)."""
    kwargs = {"capture_output": True, "text": True, "timeout": 60, **kwargs}
    fresh = subprocess.run([launch.real_python(), *args], **kwargs)
    children = served_so_far(prewarmed)
    served = subprocess.run([str(prewarmed.wrapper), *args], **kwargs)
    assert served_so_far(prewarmed) == children + 1, prewarmed.log.read_text()[-2000:]
    return fresh, served


def served_so_far(prewarmed) -> int:
    """The children the server has forked (a line each in its log, written before the client learns the pid)."""
    return sum(line.startswith("served ") for line in prewarmed.log.read_text().splitlines())


PIDS = "import os; print(os.getpid(), os.getppid())"


def pids_through(prewarmed, **kwargs) -> tuple[int, int]:
    """(pid, parent's pid) of a process started through the wrapper: the server's child when served."""
    out = subprocess.run([str(prewarmed.wrapper), "-c", PIDS], capture_output=True, text=True, timeout=60, **kwargs)
    pid, ppid = map(int, out.stdout.split())
    return pid, ppid


@pytest.mark.parametrize("how", ["script", "module", "code", "unbuffered script"])
def test_a_served_program_sees_what_a_fresh_interpreter_shows(prewarmed, tmp_path, how):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    extra = tmp_path / "extra"
    extra.mkdir()
    target = {"script": ["pkg/probe.py"], "module": ["-m", "pkg.probe"], "code": ["-c", PROBE],
              "unbuffered script": ["-u", str(tmp_path / "pkg" / "probe.py")]}[how]
    env = {**os.environ, "PREWARM_PROBE": "é x",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(extra), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONUNBUFFERED", None)  # -u, not the environment, makes the streams unbuffered here
    fresh, served = both(prewarmed, [*target, "a", "--b=1"], cwd=tmp_path, env=env, input="from stdin\n")
    assert fresh.returncode == served.returncode == 0, served.stderr
    seen = json.loads(served.stdout)
    assert seen == json.loads(fresh.stdout)
    assert seen["stdin"] == "from stdin\n" and seen["env"] == "é x" and seen["path"][1] == str(extra)
    assert (seen["stdio"][0][3] is True) == how.startswith("unbuffered")
    assert pids_through(prewarmed, cwd=tmp_path, env=env)[1] == prewarmed.server.pid


@pytest.mark.parametrize("code", [
    "import sys; sys.exit(3)", "import sys; sys.exit('bye')", "raise ValueError('boom')", "import sys; sys.exit()",
    "raise KeyboardInterrupt", "import os; os._exit(5)", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "import sys; sys.exit(256 + 7)", "import sys; sys.stdout.write('no newline')",
])
def test_a_served_program_ends_as_in_a_fresh_interpreter(prewarmed, code):
    fresh, served = both(prewarmed, ["-c", code])
    assert served.returncode == fresh.returncode
    assert served.stdout == fresh.stdout
    assert served.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


@pytest.mark.parametrize("how", ["script", "module", "code syntax", "code interrupted"])
def test_an_uncaught_exception_prints_the_traceback_of_a_fresh_interpreter(prewarmed, tmp_path, how):
    """The program's frames only (and runpy's under -m, as Python shows them): none of the child's own."""
    (tmp_path / "boom.py").write_text("def f():\n    raise ValueError('boom')\nf()\n")
    target = {"script": ["boom.py"], "module": ["-m", "boom"], "code syntax": ["-c", "x = = 1"],
              "code interrupted": ["-c", "raise KeyboardInterrupt"]}[how]
    fresh, served = both(prewarmed, target, cwd=tmp_path)
    assert served.returncode == fresh.returncode != 0
    assert served.stderr == fresh.stderr


def test_a_new_session_is_a_session_of_its_own(prewarmed):
    """start_new_session: the program leads a session (no controlling terminal), not only a process group."""
    code = "import os; print(os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid())"
    fresh, served = both(prewarmed, ["-c", code], start_new_session=True)
    assert served.stdout == fresh.stdout == "True True\n", served.stderr
    code = "import os; print(os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid())"
    fresh, served = both(prewarmed, ["-c", code], process_group=0)
    assert served.stdout == fresh.stdout == "False True\n", served.stderr


def test_the_wrappers_shell_leaves_no_descriptor_open(prewarmed):
    """With descriptors 0-9 all open, /bin/sh (dash) reads the wrapper script on descriptor 10 without close-on-exec:
    the program must not see it (nor be sent it)."""
    code = "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"

    def fill():
        null = os.open(os.devnull, os.O_RDONLY)
        for n in range(3, 10):
            os.dup2(null, n)

    fresh, served = both(prewarmed, ["-c", code], close_fds=False, preexec_fn=fill)
    assert fresh.returncode == served.returncode == 0, served.stderr
    assert served.stdout == fresh.stdout


def test_each_served_program_draws_other_random_numbers(prewarmed):
    """torch, NumPy and `random` seed from the OS in a fresh interpreter: no two processes draw the same (the server
    imported torch and NumPy once, with one seed)."""
    code = ("import random, numpy, torch; print(torch.initial_seed(), torch.rand(1).item(), numpy.random.rand(), "
            "random.random())")
    draws = [subprocess.run([str(prewarmed.wrapper), "-c", code], capture_output=True, text=True, timeout=60)
             for _ in range(2)]
    first, second = (d.stdout.split() for d in draws)
    assert len(first) == 4 and all(a != b for a, b in zip(first, second)), (first, second)


def test_threads_and_atexit_finish_in_order(prewarmed):
    code = ("import atexit, threading, time; atexit.register(print, 'atexit', flush=True); "
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start(); print('main')")
    fresh, served = both(prewarmed, ["-c", code])
    assert served.stdout == fresh.stdout == "main\nthread\natexit\n"


# how a program below that handles a signal waits for it: short sleeps, not one long one. CPython runs a Python-level
# handler between bytecodes, and where the signal came after its last look but before the sleep's system call began
# (the program preempted as its `print` woke its reader), the handler ran when that sleep ended: 60 s on, past the
# test's timeout (a CI run under load; a fresh interpreter does the same). The loop looks between sleeps.
WAIT = "[time.sleep(0.05) for _ in range(1200)]"


def wait_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    return line.strip()


@pytest.mark.parametrize("sig, handled, expected", [
    (signal.SIGTERM, True, 7), (signal.SIGTERM, False, -signal.SIGTERM), (signal.SIGINT, False, -signal.SIGINT),
    (signal.SIGUSR1, True, 7),
])
def test_signals_sent_to_the_process_reach_the_program(prewarmed, sig, handled, expected):
    handler = f"signal.signal({int(sig)}, lambda *_: (print('got', flush=True), sys.exit(7)))" if handled else "0"
    code = f"import signal, sys, time\n{handler}\nprint('ready', flush=True)\n{WAIT}"
    proc = subprocess.Popen([str(prewarmed.wrapper), "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert wait_line(proc) == "ready"
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == expected
    assert ("got" in proc.stdout.read()) == handled


def test_a_signal_ignored_at_start_reaches_a_program_that_handles_it(prewarmed):
    """A signal its starter ignored (nohup, a supervisor) starts ignored in the program, which may set a handler of its
    own: then it gets the signal, as in a fresh interpreter. The client passed on none it had started with ignored,
    so the served program slept on."""
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
            f"print('ready', flush=True); {WAIT}")
    for exe in (launch.real_python(), str(prewarmed.wrapper)):
        proc = subprocess.Popen([exe, "-c", code], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
        try:
            assert wait_line(proc) == "ready"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 7, exe
        finally:
            proc.kill()
            proc.wait()


def test_a_signal_that_comes_as_the_process_begins_waiting_is_passed_on(prewarmed):
    """A signal whose C-level handler ran but whose Python-level one had not yet when the client began its blocking
    wait for the program's end (CPython runs that between bytecodes: the signal came just before the wait began) was
    passed on only when that wait ended, at the program's end: the program slept on. Here another thread takes it once
    the wait has begun (DLRM_PREWARM_TEST_SIGNAL_IN_WAIT), which leaves the client in that state."""
    env = {**os.environ, "DLRM_PREWARM_TEST_SIGNAL_IN_WAIT": str(int(signal.SIGTERM))}
    children = served_so_far(prewarmed)
    proc = subprocess.Popen([str(prewarmed.wrapper), "-c", "import time; time.sleep(60)"], env=env)
    try:
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert served_so_far(prewarmed) == children + 1
    finally:
        proc.kill()
        proc.wait()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_killing_the_process_kills_the_program(prewarmed):
    """SIGKILL cannot be passed on: the server sees the process's end of the connection close."""
    proc = subprocess.Popen([str(prewarmed.wrapper), "-c", "import os, time; print(os.getpid(), flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(wait_line(proc))
    assert child != proc.pid and alive(child)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


@pytest.mark.parametrize("exe", ["real", "served"])
def test_a_kill_of_a_process_group_it_leads_ends_the_programs_children(prewarmed, exe):
    """start_new_session (torchrun's ranks; tests that end a tool with its workers): the served program leads its own
    group, where what the process's group is sent goes, SIGKILL included."""
    code = ("import os, subprocess, sys, time; kid = subprocess.Popen(['sleep', '60']); "
            "print(os.getpid(), kid.pid, flush=True); time.sleep(60)")
    interpreter = launch.real_python() if exe == "real" else str(prewarmed.wrapper)
    proc = subprocess.Popen([interpreter, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    program, kid = map(int, wait_line(proc).split())
    assert (program == proc.pid) == (exe == "real")
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while (alive(program) or alive(kid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(program) and not alive(kid)


def test_a_signal_to_a_process_group_it_leads_reaches_the_programs_children(prewarmed):
    code = ("import os, signal, subprocess, sys, time; "
            "kid = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; "
            f"signal.signal(signal.SIGTERM, lambda *_: sys.exit(9)); print(1, flush=True); {WAIT}'], "
            "stdout=subprocess.PIPE, text=True); kid.stdout.readline(); "
            f"signal.signal(signal.SIGTERM, lambda *_: sys.exit(kid.wait())); print('ready', flush=True); {WAIT}")
    proc = subprocess.Popen([str(prewarmed.wrapper), "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert wait_line(proc) == "ready"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 9  # the kid got it too: its exit code is the program's


def test_descriptors_keep_their_numbers_and_ignored_signals_stay_ignored(prewarmed):
    r, w = os.pipe()
    try:
        code = f"import os, signal; os.write({w}, b'through'); print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
        for exe in (launch.real_python(), str(prewarmed.wrapper)):
            out = subprocess.run([exe, "-c", code], pass_fds=(w,), capture_output=True, text=True, timeout=60,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
            assert out.returncode == 0 and out.stdout == "True\n", out.stderr
            assert os.read(r, 100) == b"through"
    finally:
        os.close(r)
        os.close(w)


def test_what_it_cannot_serve_runs_in_the_real_interpreter(prewarmed):
    """A startup variable other than the server's (read by libgomp and torch when they load), or an option it does not
    parse: the process execs the real interpreter (the same pid), and the server's log says why."""
    threads = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    assert pids_through(prewarmed, env={**os.environ, "OMP_NUM_THREADS": threads})[1] != prewarmed.server.pid
    out = subprocess.Popen([str(prewarmed.wrapper), "-B", "-c", "import os; print(os.getpid())"],
                           stdout=subprocess.PIPE, text=True)
    assert int(wait_line(out)) == out.pid and out.wait(timeout=60) == 0
    assert "fallback environment differs in OMP_NUM_THREADS" in prewarmed.log.read_text()
    assert pids_through(prewarmed)[1] == prewarmed.server.pid


def test_a_wrapper_that_cannot_run_is_not_used(monkeypatch):
    """A temporary folder mounted noexec: the wrapper cannot be run, and `start` leaves `sys.executable` as it is
    (every process a test starts would fail otherwise)."""
    class NoExec(launch.Prewarmed):
        def __init__(self, real):
            super().__init__(real)
            assert self.runs()
            self.wrapper.chmod(0o644)  # as on a noexec mount: exec refuses it

    monkeypatch.delenv("DLRM_TEST_PREWARM", raising=False)
    monkeypatch.setattr(launch, "Prewarmed", NoExec)
    monkeypatch.setattr(launch, "_current", [])
    before = sys.executable
    launch.start()
    assert sys.executable == before and launch._current == []
