"""torchrun's grace after a SIGTERM, against the time a sharded checkpoint takes to write.

A SIGTERM (or SIGINT) to torchrun itself, a scheduler's stop or a Ctrl-C in its terminal, is passed on to the ranks,
which finish their step, checkpoint and stop (`dlrm.train.signals`); but torchrun SIGKILLs them `grace` seconds
later (30 s; configurable with ``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` only in torch versions
that read them: torch 2.11's does not). MLPerf DLRM-DCNv2's full tables on two H200 ranks make shards of 10.5 and
42.8 GB, written in 65-99 s (2026-12-04, benchmarks/results/nccl_resume_2026-12-04_s79.md): a SIGTERM to torchrun
as such a run ended killed both ranks in its last checkpoint, and nothing of its 100 steps was saved. Nothing a rank
does outlives a SIGKILL, so the run says so before it matters: at the start, from the size of the biggest rank's
shard (`StopGrace.check_start`), and after each checkpoint, from the seconds it took (`StopGrace.check_save`), with
what stops such a run whole (signal the ranks, or give torchrun a longer grace where it takes one). One process under
torchrun (``--nproc-per-node 1``) is SIGKILLed alike, and weighed alike.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch
from loguru import logger

from dlrm.distributed.env import DistEnv

DEFAULT_GRACE_S = 30.0
"""torchrun's seconds between passing a SIGTERM on to the ranks and SIGKILLing them (torch's default)."""
ASSUMED_WRITE_BYTES_PER_S = 1e9
"""The start's estimate of a shard's write: a fast local disk's rate (H200 machines' disks wrote 0.8-1.3 GB/s with
the streamed save, `dlrm.stream_save`; 0.53-0.66 GB/s through torch.save before it), so
that the start warns only where even such a disk would exceed the grace; `check_save` measures the real one."""
_ENV_KEY = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")


def grace_configurable() -> bool:
    """Whether this torch's torchrun takes a grace (``--shutdown-timeout``, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``): its
    `LaunchConfig` has the field (torch 2.11's has not; its 30 s are fixed)."""
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:  # a torch built without distributed: no torchrun to ask
        return False
    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def _flag_value(argv: Iterable[str]) -> Optional[str]:
    """``--shutdown-timeout N`` or ``--shutdown-timeout=N`` in torchrun's command line (its last one wins, as
    argparse's)."""
    found, args = None, list(argv)
    for i, a in enumerate(args):
        for flag in _FLAGS:
            if a == flag and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(flag + "="):
                found = a[len(flag) + 1:]
    return found


def _parent_argv() -> list[str]:
    """The command line of this process's parent (torchrun's agent, which started the rank), [] where unreadable
    (not Linux, the parent gone)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def torchrun_grace_s(environ: Optional[Mapping[str, str]] = None, parent_argv: Optional[list[str]] = None,
                     configurable: Optional[bool] = None) -> Optional[float]:
    """The seconds torchrun waits after a SIGTERM before it SIGKILLs this process; None outside torchrun (no
    ``TORCHELASTIC_RUN_ID``). Where torchrun takes a grace: its ``--shutdown-timeout`` (read from the parent's
    command line), else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30; an unreadable value counts as 30, as torchrun
    would refuse it.

    Example:
        >>> torchrun_grace_s({}) is None                      # not under torchrun
        True
        >>> ranks = {"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}  # a rank's environment
        >>> torchrun_grace_s(ranks, [], configurable=True), torchrun_grace_s(ranks, [], configurable=False)
        (300.0, 30.0)
        >>> torchrun_grace_s({"TORCHELASTIC_RUN_ID": "x"}, ["torchrun", "--shutdown-timeout=600", "train.py"], True)
        600.0
    """
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    if not (grace_configurable() if configurable is None else configurable):
        return DEFAULT_GRACE_S
    value = _flag_value(_parent_argv() if parent_argv is None else parent_argv)
    if value is None:
        value = environ.get(_ENV_KEY)
    try:
        grace = float(value) if value is not None else DEFAULT_GRACE_S
    except ValueError:
        return DEFAULT_GRACE_S
    return grace if grace >= 0 else DEFAULT_GRACE_S


def _first_step_state(opt: torch.optim.Optimizer, group: dict) -> int:
    """How many tensors of a parameter's size `opt` makes for it at its first step: Adam's two moments, SGD's
    momentum buffer (with momentum), nothing for Adagrad (its sums are made with the optimizer) or plain SGD."""
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return 2
    if isinstance(opt, torch.optim.SGD) and group.get("momentum", 0):
        return 1
    return 0


def state_bytes(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """The bytes of a rank's checkpoint (its shard), near enough: its model's state (its embedding shard, the dense
    layers) and its optimizers' state tensors, those an optimizer makes only at its first step (Adam's moments: twice
    the dense layers' bytes) counted before they exist, so the start weighs the checkpoints the run will write."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        for group in opt.param_groups:
            lazy = _first_step_state(opt, group)
            total += sum(lazy * p.numel() * p.element_size() for p in group["params"] if not opt.state.get(p))
    return total


def _advice(grace: float, configurable: bool) -> str:
    longer = (f"or start torchrun with a longer grace (--shutdown-timeout {max(300, int(4 * grace))}, or "
              f"{_ENV_KEY})" if configurable else
              "(this torch's torchrun waits a fixed 30 s; versions that read --shutdown-timeout can wait longer)")
    return ("a stop by a SIGTERM to torchrun (a scheduler's, or Ctrl-C in its terminal) is SIGKILLed while it "
            "writes its checkpoint, losing every step since the last one (without checkpoint.every: all of them); "
            f"stop such a run by signalling the ranks themselves (pkill -TERM -P <torchrun's pid>) {longer}")


class StopGrace:
    """Warns, once a run, where a sharded checkpoint would outlast torchrun's grace after a SIGTERM.

    Args:
        env: the process group (one process under torchrun is checked too; nothing outside torchrun).
        grace_s: torchrun's grace; default: `torchrun_grace_s` (None outside torchrun).
        configurable: whether torchrun takes a longer one (`grace_configurable`), for the advice.

    Example (two ranks' sizes, as `check_start` gathers them):
        >>> g = StopGrace(DistEnv(), grace_s=30.0, configurable=False)
        >>> g.start_line([10.5e9, 42.8e9]).split(":")[0]
        "rank 1's checkpoint shard is about 42.8 GB"
        >>> g.start_line([10.5e9, 12e9]) is None          # 12 s at 1 GB/s: within the 30
        True
    """

    def __init__(self, env: DistEnv, grace_s: Optional[float] = None, configurable: Optional[bool] = None) -> None:
        self.env = env
        # one process under torchrun (--nproc-per-node 1, as in many SLURM scripts) is SIGKILLed alike
        self.configurable = grace_configurable() if configurable is None else configurable
        self.grace_s = torchrun_grace_s(configurable=self.configurable) if grace_s is None else grace_s
        self.warned = False

    @property
    def active(self) -> bool:
        return self.grace_s is not None

    def start_line(self, shard_bytes: list[float]) -> Optional[str]:
        """The start's warning for every rank's shard bytes, None where the biggest, written at
        `ASSUMED_WRITE_BYTES_PER_S`, fits in the grace."""
        q = max(range(len(shard_bytes)), key=lambda i: shard_bytes[i])
        seconds = shard_bytes[q] / ASSUMED_WRITE_BYTES_PER_S
        if seconds <= self.grace_s:
            return None
        what = f"rank {q}'s checkpoint shard" if len(shard_bytes) > 1 else "the run's checkpoint"
        return (f"{what} is about {shard_bytes[q] / 1e9:.1f} GB: {seconds:.0f} s to write at "
                f"1 GB/s (H200 machines' local disks wrote 0.8-1.3 GB/s), more than the {self.grace_s:g} s torchrun "
                f"waits after a SIGTERM before it SIGKILLs the ranks: {_advice(self.grace_s, self.configurable)}")

    def check_start(self, model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """At the start (every rank: one gather): warn from the shards' sizes."""
        if not self.active:
            return
        sizes = [float(b) for b in self.env.all_gather_object(state_bytes(model, optimizers))]
        line = self.start_line(sizes)
        if line is not None:
            self.warned = True
            if self.env.is_main:
                logger.warning(line)

    def check_save(self, seconds: float, name: str) -> None:
        """After a sharded checkpoint (`name`) that took `seconds` (its save ends in the ranks' agreement, so the
        slowest rank's): warn once where it took longer than the grace."""
        if not self.active or self.warned or seconds <= self.grace_s:
            return
        self.warned = True
        if self.env.is_main:
            logger.warning(f"checkpoint {name} took {seconds:.0f} s to write, more than the {self.grace_s:g} s "
                           f"torchrun waits after a SIGTERM before it SIGKILLs the ranks: "
                           f"{_advice(self.grace_s, self.configurable)}")
