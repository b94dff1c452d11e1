"""Starts and stops the prewarmed interpreter for one pytest process (tests/conftest.py calls `start` and `stop`).

Every Python process a test starts through `sys.executable` (train.py, torchrun and its ranks, the tools, `-c`
snippets) spent ~2.3 s of CPU importing torch and torch._dynamo before doing anything: about a third of the suite's CPU
time on the 2-core CI machine. `start` runs a server that has imported them once (server.py) and points
`sys.executable` at a wrapper whose client (client.py) has the server fork a child that becomes the asked-for process:
its arguments, environment, working directory, descriptors and signals, the program run from a fresh `__main__`. What
it cannot serve as a fresh interpreter would (another startup environment, options it does not parse), and every
process started before the server is ready, runs in the real interpreter. DLRM_TEST_PREWARM=0 turns it off.
DLRM_PREWARM_LOG=FOLDER keeps each server's log there (a line for each process: served, or why not).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Prewarmed:
    """One server and the wrapper that reaches it.

    Args:
        real: the real interpreter (the server runs under it; a request it cannot serve execs it).

    `wrapper` is the executable to start processes with (tests/test_prewarm.py shows what they see).
    """

    def __init__(self, real: str):
        self.real = real
        self.folder = Path(tempfile.mkdtemp(prefix="dlrm-prewarm-"))
        self.socket, self.wrapper, self.log = self.folder / "server.sock", self.folder / "python", self.folder / "log"
        self.wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(real)} -S -E -s {shlex.quote(str(HERE / 'client.py'))} "
                                f"{shlex.quote(str(self.socket))} {shlex.quote(real)} \"$@\"\n")
        self.wrapper.chmod(0o755)
        with open(self.log, "wb") as log:
            self.server = subprocess.Popen([real, str(HERE / "server.py"), str(self.socket), str(self.wrapper)],
                                           env=dict(os.environ), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           cwd=self.folder)

    def runs(self) -> bool:
        """Whether the wrapper can be run here (a temporary folder mounted noexec cannot run it): an option the
        client does not parse, so the real interpreter answers at once, ready or not."""
        try:
            return subprocess.run([str(self.wrapper), "-S", "-c", "pass"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    def wait_ready(self, timeout: float) -> None:
        """Until the server listens (it imports torch first: seconds)."""
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prewarmed interpreter server not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (its running children with it) and remove its folder (the log kept where asked)."""
        self.server.terminate()
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        keep = os.environ.get("DLRM_PREWARM_LOG")
        if keep and self.log.exists():
            shutil.copy(self.log, Path(keep) / f"{self.folder.name}.log")
        shutil.rmtree(self.folder, ignore_errors=True)


_current: list[Prewarmed] = []


def real_python() -> str:
    """The real interpreter (`sys.executable` is the wrapper while a server runs)."""
    return _current[0].real if _current else sys.executable


def start() -> None:
    """Start this process's server (in the background: ready in ~2.5 s) and route `sys.executable` to it."""
    if os.environ.get("DLRM_TEST_PREWARM", "1") == "0" or _current:
        return
    p = Prewarmed(sys.executable)
    if not p.runs():  # every process would fail to start: fresh interpreters instead
        p.stop()
        return
    _current.append(p)
    sys.executable = str(p.wrapper)


def stop() -> None:
    """Give `sys.executable` back and stop the server."""
    if _current:
        p = _current.pop()
        sys.executable = p.real
        p.stop()
