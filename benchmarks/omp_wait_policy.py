"""The default job on the CPU under OpenMP's wait policies, on an idle machine and beside busy processes.

    python benchmarks/omp_wait_policy.py --repeats 3 --out benchmarks/results --name omp_wait_policy

Runs ``python train.py --config configs/sample.json`` (the README's first command) in fresh processes with
``OMP_WAIT_POLICY`` set to each of ``--policies`` ("default": libgomp's own spin-then-sleep, as
``GOMP_SPINCOUNT=300000``, which also keeps dlrm from setting PASSIVE; "ACTIVE"; "PASSIVE": sleep at once),
alternating, ``--repeats`` times, first on the machine as it is, then beside ``--load`` busy processes (default: one per core: a CI machine running other jobs). Reports each run's wall seconds
and the samples/s its final line prints. Writes ``<name>.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

from _common import REPO, add_overwrite, claim_outputs, date_stamp, markdown, md_row, write_csv  # noqa: E402


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def run_once(policy: str, tb_dir: str, name: str) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy == "default":  # libgomp's own (300,000 spins, then sleep); set, so dlrm leaves the policy alone
        env["GOMP_SPINCOUNT"] = "300000"
    else:
        env["OMP_WAIT_POLICY"] = policy
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/sample.json"),
                          "--tb-dir", tb_dir, "--run-name", name], cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{name}: exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    rates = re.findall(r"([\d,]+) samples/s", out.stderr + out.stdout)
    return seconds, float(rates[-1].replace(",", "")) if rates else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="default,PASSIVE")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes beside the loaded runs")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="omp_wait_policy")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.csv", f"{args.name}.md"])  # (before measuring)
    policies = [p.strip() for p in args.policies.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tb:
        for machine in ("idle", f"beside {args.load} busy processes"):
            stop = multiprocessing.Event()
            count = args.load if machine != "idle" else 0
            busy = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(count)]
            for p in busy:
                p.start()
            try:
                for i in range(args.repeats):
                    for policy in policies:
                        seconds, rate = run_once(policy, tb, f"{policy}-{len(rows)}")
                        rows.append({"machine": machine, "policy": policy, "repeat": i, "seconds": round(seconds, 2),
                                     "samples_per_s": rate})
                        print(f"{machine:28s} {policy:8s} {seconds:7.2f} s {rate:10,.0f} samples/s", flush=True)
            finally:
                stop.set()
                for p in busy:
                    p.join()
    env = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "date": date_stamp()}
    args.out.mkdir(parents=True, exist_ok=True)
    keys = ["machine", "policy", "repeat", "seconds", "samples_per_s"]
    write_csv(args.out / f"{args.name}.csv", rows, keys, extra=env)
    table = [md_row(["machine", "policy", "runs", "seconds (median, min-max)", "samples/s (median)"]),
             md_row(["---"] * 5)]
    for machine in dict.fromkeys(r["machine"] for r in rows):
        for policy in policies:
            mine = [r for r in rows if r["machine"] == machine and r["policy"] == policy]
            s = [r["seconds"] for r in mine]
            table.append(md_row([machine, policy, len(mine), f"{statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f})",
                                 f"{statistics.median(r['samples_per_s'] for r in mine):,.0f}"]))
    (args.out / f"{args.name}.md").write_text(markdown(
        f"configs/sample.json on the CPU under OpenMP wait policies ({date_stamp()})",
        [", ".join(f"{k}: {v}" for k, v in env.items())], table))
    outputs.report()


if __name__ == "__main__":
    main()
