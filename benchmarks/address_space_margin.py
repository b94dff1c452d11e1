"""The address space a CPU run maps after its host-memory check (`dlrm.train.builder.refuse_host_memory_shortfall`):
threads' stacks and malloc arenas, buffers. Prints VmSize and Threads at the check and at the run's peak, and what
grew between them by mapping (/proc/self/maps: a file's name, or anonymous mappings by size: 64 MiB a malloc arena,
8 MiB + a guard page a thread's stack).

    python benchmarks/address_space_margin.py [train.py arguments, default: --config configs/sample.json]
"""

import re
import sys
import threading

del sys.path[0]  # (this folder: its kernels.py would shadow the kernels package)


def status() -> dict:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmSize", "VmData", "Threads")}


def maps() -> dict:
    """Address space (KiB) by what is mapped: a file's path, or "[anon N MiB]" for anonymous regions of N MiB
    (adjacent anonymous mappings as one region: a malloc arena's 64 MiB reservation is a used and a PROT_NONE part,
    a thread's stack its guard page and its 8 MiB)."""
    regions: list = []
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        name = parts[5].strip() if len(parts) > 5 else ""
        if not name and regions and not regions[-1][2] and regions[-1][1] == lo:
            regions[-1][1] = hi
        else:
            regions.append([lo, hi, name])
    out: dict = {}
    for lo, hi, name in regions:
        mib = (hi - lo) / 2**20
        key = name or (f"[anon {mib:,.0f} MiB]" if mib >= 1 else "[anon < 1 MiB]")
        out[key] = out.get(key, 0) + ((hi - lo) >> 10)
    return out


def grown(before: dict, after: dict, top: int = 12) -> str:
    rows = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in set(before) | set(after)), reverse=True)
    return "; ".join(f"{k} +{d / 1024:,.0f} MiB" for d, k in rows[:top] if d > 0)


def main() -> None:
    peak = {"VmSize": 0, "VmData": 0, "Threads": 0}
    at_peak: dict = {}
    done = threading.Event()

    def poll() -> None:  # (this thread is one of the Threads counted, 8 MiB of stack and one arena: said below)
        while not done.wait(0.005):
            now = status()
            if now["VmSize"] > peak["VmSize"] + 65536:  # 64 MiB more than the last peak: its mappings kept
                at_peak.update(maps=maps())
            for k, v in now.items():
                peak[k] = max(peak[k], v)

    threading.Thread(target=poll, daemon=True).start()
    from dlrm import cli
    from dlrm.train import builder

    at_check = {}
    real = builder.refuse_host_memory_shortfall

    def check(*a, **k):
        at_check.update(status(), maps=maps())
        return real(*a, **k)

    builder.refuse_host_memory_shortfall = check
    sys.argv = ["train.py", *(sys.argv[1:] or ["--config", "configs/sample.json"])]
    try:
        cli.main()
    except SystemExit as e:
        code = e.code
    done.set()
    print(f"exit {code}; at the check: VmSize {at_check.get('VmSize', 0) / 1024:,.0f} MiB, Threads "
          f"{at_check.get('Threads')}; peak: VmSize {peak['VmSize'] / 1024:,.0f} MiB, Threads {peak['Threads']} "
          f"(1 of them the poller); after the check: {(peak['VmSize'] - at_check.get('VmSize', 0)) / 1024:,.0f} MiB, "
          f"{peak['Threads'] - at_check.get('Threads', 0)} threads", file=sys.stderr)
    print(f"grown from the check (or the start) to the peak: {grown(at_check.get('maps', {}), at_peak.get('maps', {}))}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
