"""The forked child of the prewarmed interpreter's server (server.py): becomes the process a client asked for and runs
it to its end, as `python [-u] SCRIPT|-m MODULE|-c CODE ARGS...` would have in a fresh interpreter."""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import fcntl
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
import traceback
import types

from prewarm_signals import PASSED_ON

# the server's own sys.path and PYTHONPATH (this module is imported by the server before it serves)
_SERVER_PATH = list(sys.path)
_SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

# signals a fresh interpreter starts with at their default (Python sets SIGINT's handler and ignores SIGPIPE and
# SIGXFSZ itself); an ignored one the client inherited stays ignored, as exec keeps it
_RESET = [s for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
                      signal.SIGALRM) if s is not None]


def place_descriptors(numbers: list[int], fds: list[int], server_fds: list[int]) -> None:
    """Give the client's descriptors their numbers (received ones got the lowest free numbers: moved aside first) and
    close the server's; the server's stdio is replaced, or closed where the client had none."""
    aside = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in fds]
    for fd in {*fds, *server_fds}:
        os.close(fd)
    for n in range(3):
        if n not in numbers:
            os.close(n)
    for n, fd in zip(numbers, aside):
        os.dup2(fd, n, inheritable=True)
    for fd in aside:
        os.close(fd)


def make_stdio(unbuffered: bool, stdio: dict) -> None:
    """sys.stdin/stdout/stderr as Python's startup makes them (Python/pylifecycle.c create_stdio) on descriptors 0-2."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        write = fd > 0
        raw_only = unbuffered and write
        buffer = io.open(fd, "wb" if write else "rb", buffering=0 if raw_only else -1, closefd=False)
        encoding, errors = stdio[name]
        line_buffering = not unbuffered and (fd == 2 or (write and os.isatty(fd)))
        stream = io.TextIOWrapper(buffer, encoding=encoding, errors=errors, newline="\n",
                                  line_buffering=line_buffering, write_through=raw_only)
        stream.mode = "w" if write else "r"
        (buffer if raw_only else buffer.raw).name = f"<{name}>"  # as create_stdio names them (not the number)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def set_sys_path(request: dict, path0: str) -> None:
    """sys.path as the fresh interpreter's: its first entry (script folder, working directory, ''), then PYTHONPATH's,
    then the server's own (standard library, site-packages: the interpreter and environment are the same)."""
    base = _SERVER_PATH[1:]
    for p in _SERVER_PYTHONPATH:  # the server's PYTHONPATH entries follow its first entry, in order
        if base and base[0] == p:
            base.pop(0)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [path0, *extra, *base]
    sys.path_importer_cache.clear()


def exit_code(exc: SystemExit) -> int:
    """Python's handling of an uncaught SystemExit (Python/pythonrun.c handle_system_exit)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        if sys.stderr is not None:
            print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 (a broken stderr: the exit code stays)
        pass
    return 1


def become(request: dict, fds: list[int], server_fds: list[int], wrapper: str, stdio: dict, log_fd: int) -> None:
    """Become the process `request` describes and run its program to the process's end (never returns). A failure
    before the program starts goes to the server's log (`log_fd`, closed before the program runs), exit 70."""
    try:
        prepare(request, fds, server_fds, wrapper, stdio)
    except BaseException:  # noqa: BLE001
        os.write(log_fd, f"child {os.getpid()} could not start {request['target'][:80]!r}:\n"
                         f"{traceback.format_exc()}".encode())
        os._exit(70)
    os.close(log_fd)
    run(request)


def prepare(request: dict, fds: list[int], server_fds: list[int], wrapper: str, stdio: dict) -> None:
    """The process's state as a fresh interpreter started by the client would have it."""
    signal.set_wakeup_fd(-1)
    if request["group"] and not request.get("session"):  # the client leads a process group (process_group): this one
        os.setpgid(0, 0)  # its own (a session's leader, start_new_session, got its session right after the fork)
    for s in _RESET:
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in request["ignored"]:
        signal.signal(s, signal.SIG_IGN)
    place_descriptors(request["fds"], fds, server_fds)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    make_stdio(unbuffered, stdio)
    faulthandler.disable()  # the server's, on its log
    if request["env"].get("PYTHONFAULTHANDLER") and sys.stderr is not None:
        faulthandler.enable(file=sys.stderr)
    sys.executable = wrapper  # the processes this one starts come here too (torchrun's ranks)
    sys.orig_argv = [wrapper, *request["orig_argv"]]
    # a fresh interpreter seeds torch's CPU generator and NumPy's global one from the OS (`random` reseeds at fork)
    sys.modules["torch"].default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def run(request: dict) -> None:
    """Run the program in a fresh `__main__` and end the process as Python would."""
    mode, target, args = request["mode"], request["target"], request["args"]
    main = types.ModuleType("__main__")
    main.__annotations__ = {}  # as pylifecycle.c's add_main_module makes it (before __builtins__, in its order)
    main.__builtins__ = builtins  # the module, as in a fresh __main__ (other modules get its dict)
    sys.modules["__main__"] = main
    sys.modules.pop("prewarm_child", None)
    code, interrupted = 0, False
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)  # blocked since the fork (server.py): one pending acts now
        if mode == "module":
            set_sys_path(request, request["cwd"])
            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target, alter_argv=True)  # noqa: SLF001 (what `python -m` calls)
        else:
            script = os.path.abspath(target) if mode == "script" else None
            set_sys_path(request, os.path.dirname(os.path.realpath(script)) if script else "")
            sys.argv = [target if script else "-c", *args]
            if script:
                with io.open_code(script) as f:
                    source = f.read()
                main.__file__ = script  # absolute, as Python >= 3.9 makes it
                main.__cached__ = None
                main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)  # pythonrun.c's
            else:
                source = target
                main.__loader__ = importlib.machinery.BuiltinImporter  # add_main_module's, kept for -c
            main.__spec__ = None
            exec(compile(source, script or "<string>", "exec"), main.__dict__)  # noqa: S102
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt as exc:
        report(exc)  # prints nothing where stderr is closed, as Python's own
        code, interrupted = 130, True
    except BaseException as exc:  # noqa: BLE001 (Python prints it and exits 1)
        report(exc)
        code = 1
    finish(code, interrupted)


def report(exc: BaseException) -> None:
    """An uncaught exception through sys.excepthook, its traceback starting below run(): a fresh interpreter's shows
    the program's frames (and runpy's under -m), not this module's."""
    exc = exc.with_traceback(exc.__traceback__.tb_next if exc.__traceback__ else None)
    sys.excepthook(type(exc), exc, exc.__traceback__)


def finish(code: int, interrupted: bool) -> None:
    """Python's finalization as far as a program sees it: non-daemon threads joined, atexit functions, stdio flushed;
    an uncaught KeyboardInterrupt ends the process by SIGINT (Python >= 3.8)."""
    try:
        threading._shutdown()  # noqa: SLF001 (what Py_FinalizeEx calls first)
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 (Python exits 120 when it cannot flush)
            code = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
