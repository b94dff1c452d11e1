"""Mutation audit of the Gluon cross kernels (`kernels/cross_ws.py`, `kernels/cross_ws_bwd.py`) on a Hopper GPU.

Gluon has no interpreter, so the CPU tests only compile these kernels; what their element-by-element tests on the
GPU would catch is measured here: each mutant (a barrier, fence or release moved or dropped, a mask or an operand
changed) is written into the kernel's source, its tests run (``pytest -x`` with a time limit: a mutant that
deadlocks counts as killed by the hang), and the source is restored. Survivors are the synchronization mistakes the
tests cannot see on this GPU, whose race windows its timing never opens.

    python benchmarks/gluon_mutants.py --out OUT [--only F1 B2 ...]   # on a Hopper GPU; writes OUT/mutants.{csv,md}

Results: benchmarks/results/gluon_mutants_h200.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

from _common import REPO, environment, env_line, markdown, md_row, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

FWD = "kernels/cross_ws.py"
BWD = "kernels/cross_ws_bwd.py"
# The tests each mutant runs (file, then pytest's -k expression).
T_COOP = ["tests/kernels/test_cross_ws.py", "-k", "(matches or many_tiles) and coop"]
T_PINGPONG = ["tests/kernels/test_cross_ws.py", "-k", "(matches or many_tiles) and pingpong"]
T_OP = ["tests/kernels/test_cross_ws_op.py", "-k", "module_matches_eager"]
T_BWD = ["tests/kernels/test_cross_ws_bwd.py", "-k", "matches or many_tiles"]
T_NET = ["tests/kernels/test_cross_ws_net.py", "-k", "bf16_kernels"]

_EPI_FENCE = "            fence_async_shared()\n            mbarrier.arrive(epi_empty.index(e), count=1)\n"

# (name, file, text, replacement, which occurrence of the text (1-based), tests)
MUTANTS = [
    ("F1 coop epilogue: pre's slot released before its TMA store has read it", FWD,
     "        tma.store_wait(0)\n        mbarrier.arrive(pre_empty.index(slot), count=1)",
     "        mbarrier.arrive(pre_empty.index(slot), count=1)", 1, T_COOP),
    ("F2 coop epilogue: no fence before the x0/x slot goes back to the TMA loader", FWD,
     _EPI_FENCE + "            p = buf", "            mbarrier.arrive(epi_empty.index(e), count=1)\n            p = buf",
     1, T_COOP),
    ("F3 coop MMA: a ring slot released at k == 0 too", FWD, "pred=k > 0", "pred=k >= 0", 2, T_COOP),
    ("F4 coop MMA: two wgmma groups in flight when a slot is released", FWD,
     "acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])", "acc = warpgroup_mma_wait(num_outstanding=2, deps=[acc])",
     2, T_COOP),
    ("F5 coop MMA: no fence between pre's shared store and its TMA store", FWD,
     "        pre_bufs.index(slot).store(pre)\n        fence_async_shared()\n", "        pre_bufs.index(slot).store(pre)\n",
     1, T_COOP),
    ("F6 coop epilogue: the column mask 8 too wide", FWD,
     "m = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)",
     "m = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N + 8, 0)", 1, T_COOP),
    ("F7 coop epilogue loader: every x slice from the tile's first row (control)", FWD,
     "_tma_load(x_desc, [om + r * SUB, on]", "_tma_load(x_desc, [om, on]", 1, T_COOP),
    ("F8 pingpong: the consumers' K loops not taking turns", FWD,
     "        mbarrier.wait(order.index(c), i & 1)\n", "", 1, T_PINGPONG),
    ("F9 F2 through the autograd op only (the GPU's default launch)", FWD,
     _EPI_FENCE + "            p = buf", "            mbarrier.arrive(epi_empty.index(e), count=1)\n            p = buf",
     1, T_OP),
    ("B1 bwd epilogue: no fence before the operands' slot goes back to the TMA loader", BWD,
     _EPI_FENCE, "            mbarrier.arrive(epi_empty.index(e), count=1)\n", 1, T_BWD),
    ("B2 bwd epilogue: the GEMM's staging slot released before its slices are read", BWD,
     "        mbarrier.wait(acc_ready.index(slot), (j // 2) & 1)\n",
     "        mbarrier.wait(acc_ready.index(slot), (j // 2) & 1)\n        mbarrier.arrive(acc_empty.index(slot), count=1)\n",
     1, T_BWD),
    ("B3 bwd: dx0 += dx * x0 instead of dx * pre (control)", BWD, "(dx0 + dx * pre)", "(dx0 + dx * x0)", 1, T_BWD),
    ("B4 bwd: g_pre from pre instead of x0, through the cross network", BWD, "(dx * x0).to(gpre_ptr",
     "(dx * pre).to(gpre_ptr", 1, T_NET),
    ("B5 bwd MMA: a ring slot released at k == 0 too (the shared MMA partition)", FWD, "pred=k > 0", "pred=k >= 0", 2,
     T_BWD),
]


def mutate(text: str, old: str, new: str, occurrence: int) -> str:
    """``text`` with the ``occurrence``-th ``old`` replaced by ``new``; a ValueError when there is no such one (the
    kernel changed under the mutant)."""
    start = -1
    for _ in range(occurrence):
        start = text.find(old, start + 1)
        if start < 0:
            raise ValueError(f"occurrence {occurrence} of {old!r} not found")
    return text[:start] + new + text[start + len(old):]


def run_tests(tests: list[str], limit: float) -> tuple[object, float, list[str]]:
    """(pytest's exit code or "timeout", seconds, its FAILED/ERROR lines)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "8", "-rfE", "-p", "no:cacheprovider", "-p",
           "no:benchmark", "-W", "ignore", *tests]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=REPO)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - t0, []
    lines = (p.stdout + p.stderr).splitlines()
    return p.returncode, time.time() - t0, [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))] + lines[-1:]


def verdict(rc: object) -> str:
    return "survived" if rc == 0 else "killed (hang)" if rc == "timeout" else "killed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for mutants.csv / mutants.md")
    ap.add_argument("--only", nargs="*", default=[], help="mutant ids to run (F1, B2, ...); 'base' the unmutated tests")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a mutant's tests may run (a hang is a kill)")
    add_overwrite(ap)
    args = ap.parse_args()
    outputs = claim_outputs(ap, args, args.out, ["mutants.csv", "mutants.md"])
    import torch

    env = environment(torch.device("cuda"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.only or "base" in args.only:
        for tests in (T_COOP, T_PINGPONG, T_BWD):
            rc, sec, lines = run_tests(tests, 2 * args.limit)
            rows.append({"mutant": "unmutated: " + " ".join(tests), "verdict": "passes" if rc == 0 else "FAILS",
                         "seconds": round(sec, 1), "detail": " / ".join(lines[:3])})
            print(rows[-1], flush=True)
    for name, path, old, new, occurrence, tests in MUTANTS:
        if args.only and name.split()[0] not in args.only:
            continue
        source = (REPO / path).read_text()
        (REPO / path).write_text(mutate(source, old, new, occurrence))
        try:
            rc, sec, lines = run_tests(tests, args.limit)
        finally:
            (REPO / path).write_text(source)
        rows.append({"mutant": name, "verdict": verdict(rc), "seconds": round(sec, 1), "detail": " / ".join(lines[:3])})
        print(rows[-1], flush=True)
        keys = ["mutant", "verdict", "seconds", "detail"]
        write_csv(args.out / "mutants.csv", rows, keys, env)
        (args.out / "mutants.md").write_text(markdown(
            "Gluon cross kernels: mutants against their GPU tests", [env_line(env)],
            [md_row(keys), md_row(["---"] * len(keys)), *(md_row(r[k] for k in keys) for r in rows)]))
    outputs.report()


if __name__ == "__main__":
    main()
