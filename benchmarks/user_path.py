"""What a user gets: `train.py` on a parquet dataset, as the README says to run it, against the
device-resident benchmark of the same variant.

    python benchmarks/user_path.py --data DIR [--batch-sizes 128,2048,65536] [--epochs 6]
    python benchmarks/user_path.py --config configs/mlperf-dcnv2.json --data DIR --batch-sizes 65536 --epochs 13

For each batch size it runs ``python train.py --config configs/kaggle.json --data DIR --batch-size B``
with nothing else (every "auto" default: on a GPU the fast path and data placement "auto"), then the
same with ``data.placement: "stream"`` forced (and "gpu", with --placements), for several epochs of
the dataset, and reads each run's summary.json (steady-state samples/s: the logging windows after the
warm-up, their samples over their seconds; the share of that time the GPU sat idle waiting for data;
what "auto" chose). ``--set KEY=VALUE`` (repeatable; VALUE as JSON, else a string) changes the config of
every run, e.g. logging windows short enough for a short run to have several (each window is read with a host
sync, one step late since the thirtieth run; before, at ``train.log_every`` 10 MLPerf DLRM-DCNv2 lost ~1% from GPU
memory and ~10% streamed against the config's 100, PERF.md twenty-ninth run, so a user's rate is measured with the
config's own). Beside them,
`train_throughput.measure` times the variant "auto" (the run train.py's defaults build) on synthetic
batches already on the device (no loader, no bookkeeping), in the config's precision, in a process of
its own: the ratio says how much of the device-resident rate a user gets.

Writes user_path.csv / .md / .png under --out (default benchmarks/results/) with the GPU name,
versions and date, and each train.py run's output under user_path_logs/ (``--name`` names both).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

# _common (which puts the repository first on sys.path), also when loaded by path (tests);
# appended: benchmarks/kernels.py must not shadow the kernels package
sys.path.append(str(Path(__file__).resolve().parent))

from _common import REPO, choice_list, date_stamp, int_list, markdown, pyplot, save_figure, write_csv  # noqa: E402
from _common import add_overwrite, claim_outputs  # noqa: E402

from dlrm.config import DataConfig  # noqa: E402
from dlrm.data.schema import read_metadata  # noqa: E402

PLACEMENTS = typing.get_args(typing.get_type_hints(DataConfig)["placement"])
"""data.placement's values (auto, stream, gpu): what --placements may name."""

KEYS = ["batch_size", "run", "samples_per_sec", "ratio", "data_wait_fraction", "steps", "placement", "kernels",
        "compile", "cuda_graph", "status"]
REFERENCE_VARIANT = "auto"
"""The run train.py's defaults build (what "auto" resolves to for the config on this machine)."""


def train_py(config: Path, data: Path, batch: int, epochs: int, max_steps: int, name: str, work: Path,
             overrides: dict | None = None) -> dict:
    """One `train.py` run as a user makes it; `overrides` go into a copy of the config file."""
    cfg_path = config
    if overrides:
        raw = json.loads(config.read_text())
        for dotted, value in overrides.items():
            section, key = dotted.split(".")
            raw.setdefault(section, {})[key] = value
        cfg_path = work / f"{name}.json"
        cfg_path.write_text(json.dumps(raw))
    log = work / f"{name}.log"
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(cfg_path), "--data", str(data),
           "--batch-size", str(batch), "--epochs", str(epochs), "--max-steps", str(max_steps),
           "--tb-dir", str(work / "tb"), "--run-name", name]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    summary = work / "tb" / name / "summary.json"
    if rc != 0 or not summary.exists():
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"status": f"exit {rc}: {tail[0][:160]}"}
    s = json.loads(summary.read_text())
    shutil.rmtree(work / "tb" / name / "checkpoints", ignore_errors=True)
    r = s.get("resolved", {})
    return {"samples_per_sec": s["samples_per_sec"], "data_wait_fraction": s["data_wait_fraction"], "steps": s["steps"],
            "placement": r.get("placement"), "kernels": ",".join(f"{k}={v}" for k, v in r.get("kernels", {}).items()),
            "compile": r.get("compile"), "cuda_graph": r.get("cuda_graph"), "status": "ok",
            "device_name": s["device_name"], "versions": s["versions"]}


def device_resident(config: Path, batch: int, precision: str | None, overrides: dict | None = None) -> dict:
    """`measure_reference` in a process of its own: what it leaves on the GPU (the compiled step's graph pool,
    Inductor's caches; with MLPerf DLRM-DCNv2's 52 GB of tables) must not shrink the memory the train.py runs see,
    which `data.placement` "auto" reads."""
    args = json.dumps([str(config), batch, precision, overrides or {}])
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import user_path; "
            "print('REFERENCE ' + json.dumps(user_path.measure_reference(*json.loads(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), args], cwd=REPO,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    result = next((ln[len("REFERENCE "):] for ln in reversed(lines) if ln.startswith("REFERENCE ")), None)
    if done.returncode != 0 or result is None:
        tail = (done.stderr.strip().splitlines() or lines or ["no output"])[-1]
        return {"status": f"failed: exit {done.returncode}: {tail[:160]}"}
    return json.loads(result)


def measure_reference(config: str, batch: int, precision: str | None, overrides: dict) -> dict:
    """train_throughput's number for the reference variant (eager PyTorch on a machine without CUDA):
    synthetic batches already on the device; ``precision`` None: the config's."""
    import torch

    from dlrm.config import load_config
    from train_throughput import measure

    cfg = load_config(Path(config), overrides or {})
    cuda = torch.cuda.is_available()
    device, variant = (torch.device("cuda"), REFERENCE_VARIANT) if cuda else (torch.device("cpu"), "eager")
    try:
        r = measure(cfg, variant, precision or cfg.train.precision, batch, device, warmup=20 if cuda else 3,
                    steps=50 if cuda else 5, windows=5 if cuda else 2)
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others' numbers
        return {"status": f"failed: {type(e).__name__}: {str(e)[:120]}"}
    finally:
        torch._dynamo.reset()
    return {"samples_per_sec": r["samples_per_sec"], "status": "ok", "run": f"device-resident ({variant})"}


def parse_sets(items: list[str]) -> dict:
    """``--set section.key=value`` items as config overrides (value parsed as JSON, else kept as a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key.count(".") != 1 or not all(key.split(".")):
            raise ValueError(f"--set {item!r}: expected section.key=value, e.g. train.log_every=10")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def write(rows: list[dict], args, stem: str) -> list[Path]:
    plt = pyplot()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if r["status"] == "ok"]
    users = [r for r in ok if r.get("device_name")]
    gpu = users[0]["device_name"] if users else "unknown"
    versions = ", ".join(f"{k} {v}" for k, v in (users[0]["versions"] if users else {}).items())
    date = date_stamp()
    env = f"gpu: {gpu}; {versions}; date: {date}; dataset {Path(args.data).name}, {args.epochs} epochs"
    if args.set:
        env += "; every run with " + ", ".join(args.set)
    paths = [out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}.png"]
    write_csv(paths[0], rows, KEYS, {"config": args.config, "gpu": gpu, "date": date})
    table = ["| batch | run | samples/s | of device-resident | waiting for data | placement | compile | step graph | status |",
             "| ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for r in rows:
        sps, ratio, wait = r.get("samples_per_sec"), r.get("ratio"), r.get("data_wait_fraction")
        table.append(f"| {r['batch_size']} | {r['run']} | {f'{sps / 1e6:.2f}M' if sps else '-'} | "
                     f"{f'{ratio:.0%}' if ratio else '-'} | {f'{wait:.1%}' if wait is not None else '-'} | "
                     f"{r.get('placement') or '-'} | {r.get('compile', '-')} | {r.get('cuda_graph', '-')} | {r['status']} |")
    paths[1].write_text(markdown(f"What a user gets: train.py {args.config} vs the device-resident benchmark", [env],
                                 table))
    print(env)
    print("\n".join(table))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    runs = list(dict.fromkeys(r["run"] for r in rows))
    batches = list(dict.fromkeys(r["batch_size"] for r in rows))
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        vals = [next((r["samples_per_sec"] / 1e6 for r in ok if r["run"] == run and r["batch_size"] == b), 0)
                for b in batches]
        bars = ax.bar([j + i * width for j in range(len(batches))], vals, width, label=run)
        ax.bar_label(bars, [f"{v:.2f}" for v in vals], fontsize=7)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("million samples/s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"train.py {args.config} as a user runs it vs device-resident", fontsize=9)
    fig.suptitle(f"{gpu}, {date}", fontsize=8)
    save_figure(fig, paths[2])
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="preprocessed (or synthetic) dataset directory")
    ap.add_argument("--config", default="configs/kaggle.json")
    ap.add_argument("--batch-sizes", default="128,2048,65536")
    ap.add_argument("--epochs", type=int, default=6, help="epochs of the dataset per run (epoch boundaries count)")
    ap.add_argument("--placements", default="stream", help="forced placements run beside the default (auto)")
    ap.add_argument("--max-steps", type=int, default=3000, help="cap per run (small batches on a large dataset)")
    ap.add_argument("--buffer-rows", default="",
                    help="comma list of data.shuffle_buffer_rows: one more stream run each (shuffle buffers an epoch)")
    ap.add_argument("--precision", default=None, help="of the device-resident reference (default: the config's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run, e.g. train.log_every=10 (repeatable)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="user_path")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    # the folder of the runs' logs too: a log of the same name in it was replaced
    outputs = claim_outputs(ap, args, args.out, [f"{args.name}.{ext}" for ext in ("csv", "md", "png")] + [f"{args.name}_logs"])
    try:
        sets = parse_sets(args.set)
    except ValueError as e:
        ap.error(str(e))
    # the int lists checked before anything runs: a bad --buffer-rows crashed with a traceback after the reference
    # and the first batch size's runs (0: a ZeroDivisionError), a bad --batch-sizes with one before any
    batches = int_list(ap, "--batch-sizes", args.batch_sizes)
    buffer_rows = int_list(ap, "--buffer-rows", args.buffer_rows) if args.buffer_rows else []
    placements = choice_list(ap, "--placements", args.placements, PLACEMENTS)
    if not (args.data / "metadata.json").is_file():
        print(f"{args.data}: no metadata.json (make a dataset first)", file=sys.stderr)
        return 2
    config = REPO / args.config
    work = Path(tempfile.mkdtemp(prefix="user_path_"))
    meta = read_metadata(args.data)
    # the reference's tables as train.py's: the dataset's sizes win over the config's
    dataset_tables = {"model.cardinalities": meta.cardinalities, "model.multi_hot_sizes": meta.multi_hot_sizes}
    rows = []
    try:
        for batch in batches:
            ref = device_resident(config, batch, args.precision, {**sets, **dataset_tables})
            rows.append({"batch_size": batch, "run": "device-resident", **ref})
            runs = [("train.py (defaults)", {})] + [(f"train.py, placement {p}", {"data.placement": p})
                                                    for p in placements]
            rows_total = meta.splits["train"].rows
            runs += [(f"train.py, placement stream, {math.ceil(rows_total / n)} buffers/epoch",
                      {"data.placement": "stream", "data.shuffle_buffer_rows": n}) for n in buffer_rows]
            for label, overrides in runs:
                name = f"b{batch}-{overrides.get('data.placement', 'default')}-{overrides.get('data.shuffle_buffer_rows', '')}"
                r = train_py(config, args.data, batch, args.epochs, args.max_steps, name, work, {**sets, **overrides})
                logs = Path(args.out) / f"{args.name}_logs"  # each run's own output, kept beside the tables
                logs.mkdir(parents=True, exist_ok=True)
                if (work / f"{name}.log").exists():
                    shutil.copyfile(work / f"{name}.log", logs / f"{name}.log")
                if r.get("samples_per_sec") and ref.get("samples_per_sec"):
                    r["ratio"] = r["samples_per_sec"] / ref["samples_per_sec"]
                rows.append({"batch_size": batch, "run": label, **r})
                print(f"B={batch} {label}: {r['status']} {r.get('samples_per_sec', 0):,.0f}", flush=True)
            write(rows, args, args.name)  # after every batch size: a run cut short keeps what it measured
    finally:
        shutil.rmtree(work, ignore_errors=True)
    outputs.report()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
