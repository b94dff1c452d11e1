"""The address space a CPU run maps after its host-memory check (`dlrm.train.builder.refuse_host_memory_shortfall`):
threads' stacks and malloc arenas, buffers. Prints VmSize and Threads at the check and at the run's peak.

    python benchmarks/address_space_margin.py [train.py arguments, default: --config configs/sample.json]
"""

import re
import sys
import threading

del sys.path[0]  # (this folder: its kernels.py would shadow the kernels package)


def status() -> dict:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmSize", "VmData", "Threads")}


def main() -> None:
    peak = {"VmSize": 0, "VmData": 0, "Threads": 0}
    done = threading.Event()

    def poll() -> None:  # (this thread is one of the Threads counted, 8 MiB of stack and one arena: said below)
        while not done.wait(0.005):
            for k, v in status().items():
                peak[k] = max(peak[k], v)

    threading.Thread(target=poll, daemon=True).start()
    from dlrm import cli
    from dlrm.train import builder

    at_check = {}
    real = builder.refuse_host_memory_shortfall

    def check(*a, **k):
        at_check.update(status())
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


if __name__ == "__main__":
    main()
