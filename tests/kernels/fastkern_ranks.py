"""Run a check on several gloo ranks, each a process started through ``sys.executable``.

tests/spawned_ranks.py's `failures_on_ranks` starts its ranks with torch.multiprocessing.spawn: each rank a fresh
interpreter that imports torch (~2.3 s of CPU a rank on the CI machine). A process started through
``sys.executable`` is served by the test session's prewarmed interpreter (tests/prewarm/launch.py), which has imported
torch already, when its environment is the session's: the ranks here inherit it unchanged (the checkout goes onto
``sys.path`` from the command line, not through PYTHONPATH, which would send them to a fresh interpreter). The same
check runs on each rank, in the same process group (gloo, a file:// rendezvous), and what failed comes back as
tests/spawned_ranks.py gives it: ``{(rank, str(case)): message}``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import REPO, process_output

_RANK = """
import importlib, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
module, function, rank, world, init_file = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
check = getattr(importlib.import_module(module), function)
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
try:
    try:
        check(rank)
        print("RANK-RESULT ok", flush=True)
    except AssertionError as e:
        print("RANK-RESULT " + repr(f"AssertionError: {e}"), flush=True)
finally:
    dist.destroy_process_group()
"""


def failures_on_ranks(module: str, function: str, world: int, tmp_path: Path, timeout: float = 600) -> dict:
    """``module.function(rank)`` (a module-level function) on each of ``world`` gloo ranks; the ``(rank, "()")``
    that failed (the key tests/spawned_ranks.py gives a check without case arguments), with their messages. A rank
    that reported nothing (it died, or raised something other than an AssertionError) counts as failed, with the
    tail of its output; as torch.multiprocessing.spawn does, a rank that exits with an error ends the others (which
    would otherwise wait in a collective for it), and so does the timeout."""
    init = tmp_path / "init"
    logs = [(tmp_path / f"rank{rank}.out", tmp_path / f"rank{rank}.err") for rank in range(world)]
    procs = []
    for rank, (out, err) in enumerate(logs):
        with open(out, "w") as o, open(err, "w") as e:
            procs.append(subprocess.Popen([sys.executable, "-c", _RANK, str(REPO), module, function, str(rank),
                                           str(world), str(init)], cwd=REPO, stdin=subprocess.DEVNULL, stdout=o,
                                          stderr=e))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.02)
    failed = {}
    for rank, (proc, (out, err)) in enumerate(zip(procs, logs)):
        proc.wait()
        result = SimpleNamespace(stdout=out.read_text(), stderr=err.read_text())
        lines = [line[len("RANK-RESULT "):] for line in result.stdout.splitlines() if line.startswith("RANK-RESULT ")]
        if lines != ["ok"] or proc.returncode != 0:
            said = lines[0] if lines else "no result"
            failed[(rank, "()")] = f"{said} (exit {proc.returncode})\n{process_output(result)}"
    return failed
