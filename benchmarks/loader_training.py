"""Does the streaming loader keep up with training? The same run fed by each data placement.

    python benchmarks/loader_training.py --data DIR [--batch-size 65536] [--steps 300]

Trains `--config` (default configs/kaggle.json: its table sizes, whatever the dataset's values) as
the `--variant` (default the fastest measured one, the whole step as one CUDA graph) on the
preprocessed dataset DIR, once with ``data.placement: "stream"`` (ParquetLoader: shuffle buffers
decoded on the host while training runs) and once with ``"gpu"`` (the whole split in device
memory: no loader work at all), shuffled, for `--steps` steps across epochs. Reports each run's
steady-state samples/s (summary.json: its logging windows after the warm-up, their samples over their
seconds; the median window until 2026-11-28) and the share of that time the GPU sat idle waiting for
the loader (the trainer's ``data_wait_fraction``; the host's time in the loader until 2026-11-29,
which also counted launches blocked behind a busy GPU). The stream loader keeps up when its samples/s
matches the gpu placement's and its wait share stays near zero.

Writes <stem>.csv / .md / .png under --out (default benchmarks/results/) with the GPU name,
versions and date; each run's train.py log under --out/<stem>_logs/ is removed unless --keep-logs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import REPO, date_stamp, markdown, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

KEYS = ["placement", "batch_size", "steps", "samples_per_sec", "data_wait_fraction", "auc", "status"]


def run(cfg_path: Path, placement: str, args, work: Path) -> dict:
    from dlrm.config import load_config
    from dlrm.train.compare import variant_config

    cfg = variant_config(load_config(cfg_path), args.variant)
    cfg.data.path, cfg.data.placement, cfg.data.shuffle = str(args.data), placement, True
    cfg.data.batch_size = args.batch_size
    cfg.train.epochs, cfg.train.max_steps = 1000, args.steps
    cfg.train.eval_every, cfg.train.log_every = None, args.log_every
    cfg.log.tb_dir, cfg.log.run_name = str(work / "tb"), f"loader-{placement}"
    path = work / f"{placement}.json"
    path.write_text(json.dumps(cfg.to_dict()))
    log = work / f"{placement}.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(path)], stdout=f,
                            stderr=subprocess.STDOUT, cwd=REPO).returncode
    summary_path = work / "tb" / f"loader-{placement}" / "summary.json"
    if rc != 0 or not summary_path.exists():
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"placement": placement, "batch_size": args.batch_size, "status": f"exit {rc}: {tail[0][:160]}"}
    s = json.loads(summary_path.read_text())
    shutil.rmtree(work / "tb" / f"loader-{placement}" / "checkpoints", ignore_errors=True)
    return {"placement": placement, "batch_size": args.batch_size, "steps": s["steps"],
            "samples_per_sec": s["samples_per_sec"], "data_wait_fraction": s["data_wait_fraction"],
            "auc": s["auc"], "status": "ok", "device_name": s["device_name"], "versions": s["versions"]}


def write(rows: list[dict], args, stem: str) -> list[Path]:
    plt = pyplot()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if r["status"] == "ok"]
    gpu = ok[0]["device_name"] if ok else "unknown"
    versions = ", ".join(f"{k} {v}" for k, v in (ok[0]["versions"] if ok else {}).items())
    date = date_stamp()
    env = f"gpu: {gpu}; {versions}; date: {date}"
    paths = [out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}.png"]
    write_csv(paths[0], rows, KEYS, {"variant": args.variant, "config": args.config, "gpu": gpu, "date": date})
    table = ["| placement | batch | steps | samples/s (steady state) | waiting for data | AUC | status |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        sps, wait, auc = r.get("samples_per_sec"), r.get("data_wait_fraction"), r.get("auc")
        table.append(f"| {r['placement']} | {r['batch_size']} | {r.get('steps', '-')} | "
                     f"{f'{sps / 1e6:.2f}M' if sps else '-'} | {f'{wait:.1%}' if wait is not None else '-'} | "
                     f"{f'{auc:.4f}' if auc is not None else '-'} | {r['status']} |")
    title = f"Training fed by each data placement: {args.config}, {args.variant}, dataset {Path(args.data).name}"
    paths[1].write_text(markdown(title, [env], table))
    print(env)
    print("\n".join(table))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar([r["placement"] for r in ok], [r["samples_per_sec"] / 1e6 for r in ok], color="tab:blue")
    ax.bar_label(bars, [f"{r['samples_per_sec'] / 1e6:.2f}M\nwait {r['data_wait_fraction'] or 0:.1%}" for r in ok],
                 fontsize=8)
    ax.set_ylabel("million samples/s (steady state)")
    ax.set_title(f"{Path(args.config).name}, {args.variant}, batch {args.batch_size}", fontsize=9)
    ax.margins(y=0.25)
    fig.suptitle(f"{gpu}, {date}", fontsize=8)
    save_figure(fig, paths[2])
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="preprocessed dataset directory")
    ap.add_argument("--config", default="configs/kaggle.json")
    ap.add_argument("--variant", default="triton-embedding-interaction+step-graph")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--placements", default="stream,gpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default=None, help="output stem (default loader_training_b<batch>)")
    ap.add_argument("--keep-logs", action="store_true")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    if not (args.data / "metadata.json").is_file():
        print(f"{args.data}: no metadata.json (preprocess a dataset first)", file=sys.stderr)
        return 2
    stem = args.name or f"loader_training_b{args.batch_size}"
    outputs = claim_outputs(ap, args, args.out,
                            [f"{stem}.{ext}" for ext in ("csv", "md", "png")] + [f"{stem}_logs"] * args.keep_logs)
    work = Path(tempfile.mkdtemp(prefix="loader_training_"))
    try:
        rows = []
        for placement in args.placements.split(","):
            rows.append(run(REPO / args.config, placement, args, work))
            print(f"  {placement}: {rows[-1]['status']}", flush=True)
        if args.keep_logs:
            logs = Path(args.out) / f"{stem}_logs"
            logs.mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, logs / log.name)
        write(rows, args, stem)
        outputs.report()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
