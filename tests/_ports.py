"""The TCP port of a launch that must be told its port in advance: the MASTER_PORT of ranks started without
torchrun's agent (the tests that kill or stop one rank: the agent would SIGTERM the others), a TensorBoard server's
--port. Where the launcher can pick its own port, let it: `torchrun --standalone` binds its rendezvous store to port 0
(tests/test_distributed.py); no test runs torchrun on its default port 29500, which every other such run, of this
suite or of another checkout's on the same host, would want too.

The tests' `free_port()` bound port 0, read the port and closed the socket. Between that close and the child's own
bind the port was free again, and the kernel hands free ports to whoever asks (pytest-xdist's workers run many
launches at once: their stores and gloo's listeners bound to port 0, the source ports of their connections): rank 0
then failed to listen (`DistNetworkError ... EADDRINUSE`, reported as a bug, exit 1) while rank 1 joined whatever
listened there (another test's store) and waited for its peer until the test's own timeout (150 s); TensorBoard exited
"could not bind to port" and the browser test waited 90 s for it (tests/test_ports.py).

`reserved_port()` keeps the probing socket bound, with SO_REUSEADDR and never listening, until the launch is over.
Linux never gives a bound port to anyone who asks for a port (bind to port 0, connect()'s source port), with
SO_REUSEADDR or without, so no other process can be handed this one; and a socket that names the port and sets
SO_REUSEADDR may bind and listen beside a bound socket that also set it and does not listen: the child does, as torch's
TCPStore (libuv and the legacy server alike) and Python's socketserver (werkzeug's server under TensorBoard) set it.
That removes the window instead of narrowing it. A retry on "address already in use" would not: by the time rank 0
fails, rank 1 may have joined the rendezvous of whichever test took the port, which no retry of ours undoes.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def _bound_socket() -> socket.socket:
    """A socket bound to an unused port on every local address, IPv4 and IPv6 (dual-stack) where the host has IPv6:
    a v6-only listener of another process (gloo's, on a host whose name resolves to an IPv6 address) would otherwise
    be given the port while the reservation stood on IPv4 alone."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # (no IPv6 in this kernel or container)
            continue
        try:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, 0))
            return s
        except OSError:
            s.close()
    raise OSError("no TCP port could be reserved on this host")


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A TCP port that no other process is given until the block ends; the launch in the block binds it (with
    SO_REUSEADDR, as torch's store and TensorBoard do) and listens on it.

    >>> with reserved_port() as port:
    ...     0 < port < 65536
    True
    """
    with _bound_socket() as s:
        yield s.getsockname()[1]
