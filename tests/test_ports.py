"""The port of a launch told its port in advance (tests/_ports.py).

The tests' `free_port()` closed its probe before the launch bound the port: another process of the suite could be
given it in between. Holding that port with a listener (as such a process would) before the launch, on 2026-12-04:
two ranks started as torchrun starts them failed as `test_audit_killfuzz` did, "a rank still runs 150 s after the
other died: [1, -9]" after 168 s (rank 0: `DistNetworkError ... EADDRINUSE`, "this is a bug", exit 1; rank 1 joined
the store that held the port and waited); rank 0 alone (`test_distributed_timeout`) exited 1, not 5, with that
traceback; TensorBoard exited "could not bind to port ..., it was already in use" and the browser test's fixture
waited 90 s for it; `torchrun --master-port` exited 1 in 3 s with the same DistNetworkError.
"""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, REPO


def test_no_other_socket_is_given_a_reserved_port_until_the_launch_is_done():
    """A bind of the port by anyone but the launch is refused for as long as the block runs: the kernel counts it as
    taken (the rule that keeps it out of every bind to port 0 and every connect's source port, on IPv4 and IPv6).
    The probe of `free_port()` was closed when the port was returned: this bind succeeded."""
    with reserved_port() as port:
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
            with socket.socket(family) as other:
                with pytest.raises(OSError) as refused:
                    other.bind((address, port))
                assert refused.value.errno == errno.EADDRINUSE, (address, refused.value)
        if socket.has_ipv6:
            try:
                other = socket.socket(socket.AF_INET6)
            except OSError:  # (IPv6 compiled in, but not in this kernel or container: nothing to bind there)
                pass
            else:
                with other, pytest.raises(OSError) as refused:
                    other.bind(("::", port))
                assert refused.value.errno == errno.EADDRINUSE, refused.value


@pytest.mark.parametrize("libuv", [True, False])
def test_torchs_store_listens_on_a_reserved_port(libuv):
    """The launch's own server binds it: the store rank 0 makes for env:// (libuv's, torch's default, and the
    legacy one), a client of it connected."""
    with reserved_port() as port:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60), use_libuv=libuv)
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60), use_libuv=libuv)
        client.set("from", "client")
        assert store.get("from") == b"client"
        del client, store


RANKS = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(t)
print("sum", t.item())
dist.destroy_process_group()
"""


def test_two_ranks_meet_on_a_reserved_port():
    """Two gloo ranks started as the tests start them (MASTER_PORT, no agent) meet there and reduce."""
    with reserved_port() as port:
        env = {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [subprocess.Popen([sys.executable, "-c", RANKS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        try:
            results = [(p.wait(timeout=120), p.stdout.read()) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [code for code, _ in results] == [0, 0], results
    assert all("sum 3" in out for _, out in results), results


def test_tensorboard_serves_on_a_reserved_port(tmp_path):
    """TensorBoard (the browser test's server, which skips without Chromium) binds and serves it."""
    with reserved_port() as port:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--port",
                                   str(port), "--host", "127.0.0.1"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugins_listing", timeout=5) as r:
                        assert r.status == 200
                        break
                except OSError:
                    assert server.poll() is None, server.stderr.read()[-2000:]  # ("could not bind to port")
                    assert time.monotonic() < deadline, "TensorBoard did not answer within 90 s"
                    time.sleep(0.2)
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_no_test_lets_go_of_a_port_before_its_launch_binds_it():
    """Every launch told its port in advance takes it from `reserved_port()` (no probe read and closed:
    `getsockname()[1]`), and every torchrun is `--standalone` (its own port; without it, 29500, or a port given)."""
    probes, torchruns = [], []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name in ("_ports.py", "test_ports.py"):
            continue
        text = path.read_text()
        probes += [path.name for _ in re.finditer(r"getsockname\(\)\[1\]", text)]
        for m in re.finditer(r"""["']torch\.distributed\.run["']""", text):
            if "--standalone" not in text[m.end():m.end() + 120] or "--master-port" in text[m.end():m.end() + 400]:
                torchruns.append(f"{path.name}: {text[m.start():m.end() + 120]!r}")
    assert not probes, f"a port probed and let go before its launch: {probes}; use tests/_ports.py's reserved_port()"
    assert not torchruns, f"torchrun not --standalone: {torchruns}"
