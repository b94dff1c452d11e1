"""The whole training step captured in one CUDA graph and replayed (``train.cuda_graph``).

torch.compile's reduce-overhead mode makes the forward and the backward CUDA graphs, but a step
still pays the host for everything around them: guards, autograd's AccumulateGrad per parameter,
the optimizer's launches, the learning-rate copies. At small batches that host time *is* the step
(benchmarks/results/profile_timeline_kaggle_b128_*.md: ~2.8 ms of host per step, profiled, for
0.18 ms of device work). Here forward, loss, backward (with the Triton embedding's fused sparse
update inside it) and the dense optimizer are captured once; every later step is three input
copies, the learning-rate copies and one graph launch, as in NVIDIA's DLRM. A shuffled batch of a
device-resident split (`GatheredBatch`, ``data.placement`` "gpu") has its gathers captured too: its
step is one copy of the batch's row indices, the learning-rate copies and the graph launch.

What it needs (``dlrm.config.validate`` and :func:`graph_train_step` check it): CUDA; an embedding
without sparse gradients (``kernels.embedding = "triton"``, or "torch" compiled, which is then
`dlrm.model.fused_sparse.FusedUpdateSparseArch`: static shapes, no host syncs); a fused
dense optimizer, whose learning rate becomes a device tensor the graph reads (Adam is switched to
``capturable``); compile mode other than reduce-overhead (no CUDA graphs inside the graph). A batch
of another size (an epoch's partial last batch) runs the ordinary step.

Several processes (torchrun, NCCL): the graph holds the collectives too (NCCL operations can be
captured since NCCL 2.9; PyTorch keeps captured work away from its NCCL watchdog): the sharded
lookup's all_to_alls and DDP's all_reduce of the dense gradients. What that needs, as PyTorch's and
NVIDIA's CUDA-graph guides say: the sharded tables' Triton kernel (fused update, no sparse
gradients); DDP constructed on the stream that warms up and captures
(`dlrm.distributed.data_parallel.capture_stream`), and at least 11 DDP iterations before the capture
(`DDP_WARMUP_STEPS`: DDP rebuilds its buckets after the first); and every rank replaying or not
replaying together, since a captured collective must be captured on every rank of the communicator:
the choice depends on the global batch size only, which all ranks share.
"""

from __future__ import annotations

import torch
from loguru import logger

from dlrm.data.batch import Batch, GatheredBatch, ResidentSplit
from dlrm.distributed.data_parallel import capture_stream
from dlrm.logging_setup import run_logger
from dlrm.train.meter import WARMUP_STEPS
from dlrm.train.optim import FusedSparseOptimizer
from dlrm.train.step import TrainStep

# DDP needs this many iterations before a capture (PyTorch's CUDA-graph notes: "at least 11 DDP-enabled
# eager iterations"); a one-process step needs WARMUP_STEPS (compilation, autotuning, lazy state)
DDP_WARMUP_STEPS = 11


class GraphedTrainStep:
    """A `TrainStep` whose steps of the first full batch's size replay one captured CUDA graph.

    Args:
        step: the ordinary step (its model, optimizers and compiled loss are used as they are).
        warmup_steps: ordinary steps on a side stream before the capture (compilation, autotuning,
            cuBLAS workspaces and lazily created optimizer state must exist before capturing).

    Example (not a doctest: capturing a CUDA graph needs a CUDA device, and the step's model, loss,
    optimizers and batch come from a built run, `dlrm.train.builder`; tests/test_graphed_step.py runs it)::

        step = GraphedTrainStep(TrainStep(model, loss_fn, optimizers, "tf32", device, compile_cfg))
        loss = step(batch)  # a 0-dim device tensor

    Returns, like `TrainStep`, the loss as a detached 0-dim device tensor. After the capture it is
    the graph's output buffer: the next step overwrites it, so use it (in stream order, as the
    trainer's running sums do) or clone it before then.
    """

    def __init__(self, step: TrainStep, warmup_steps: int = WARMUP_STEPS) -> None:
        if step.device.type != "cuda":
            raise ValueError(f"train.cuda_graph: CUDA graphs need a CUDA device, not {step.device}")
        self.step = step
        self.warmup_steps = self.warmup_left = warmup_steps
        # the global batch size the graph is for: every rank of a distributed run decides alike
        self.batch_size: int | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Batch | None = None
        # a GatheredBatch's split: the graph holds the batch's gathers from it, its input then `static_rows` alone
        self.gather_source: ResidentSplit | None = None
        self.static_rows: torch.Tensor | None = None
        self.warned_other_source = False
        self.static_loss: torch.Tensor | None = None
        self.stream = capture_stream(step.device)
        self.lr_tensors: list[tuple[dict, torch.Tensor]] = []  # (dense param group, the lr the graph reads)
        step.autocast_cache = False
        for opt in self._dense_optimizers():
            if isinstance(opt, torch.optim.Adam):
                for group in opt.param_groups:
                    group["capturable"] = True  # its step counters live on the device

    def _dense_optimizers(self) -> list[torch.optim.Optimizer]:
        # a fused sparse optimizer's step() does nothing (its update runs in the backward) and its
        # lr tensor is filled by TrainStep.load_lrs
        return [o for o in self.step.optimizers if not isinstance(o, FusedSparseOptimizer)]

    def __call__(self, batch: Batch) -> torch.Tensor:
        if self.batch_size is None or (self.graph is None and batch.global_len > self.batch_size):
            # the graph is for the full batch size: a run resumed just before an epoch's partial last batch sees
            # that smaller batch first (the larger one then takes over, with its own warm-up)
            self.batch_size = batch.global_len
            self.warmup_left = self.warmup_steps
        if batch.global_len != self.batch_size:
            return self.step(batch)  # e.g. the epoch's partial last batch: the ordinary step
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return self._side_stream_step(batch)
        if self.graph is not None and self.gather_source is not None and not self._reads_gather_source(batch):
            return self.step(batch)  # rows of another split than the captured gathers read: the ordinary step
        self.step.load_lrs()
        self._load_dense_lrs()
        if self.graph is None:
            return self._capture(batch)
        if self.gather_source is not None:
            self.static_rows.copy_(batch.rows, non_blocking=True)  # the graph gathers the batch itself
        else:
            for static, new in zip((self.static.dense, self.static.sparse, self.static.labels),
                                   (batch.dense, batch.sparse, batch.labels)):
                static.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.static_loss

    def _reads_gather_source(self, batch: Batch) -> bool:
        """Whether `batch` is rows of the split whose gathers the graph holds (`GatheredBatch`): always so in a run,
        whose training loader is one; anything else is trained by the ordinary step, once said."""
        if isinstance(batch, GatheredBatch) and batch.source.holds_same_tensors(self.gather_source):
            return True
        if not self.warned_other_source:
            self.warned_other_source = True
            run_logger.warning("train.cuda_graph: a batch not from the split the graph gathers from: trained by "
                               "the ordinary step (and any such batch after it)")
        return False

    def _side_stream_step(self, batch: Batch) -> torch.Tensor:
        """An ordinary step on the side stream (warm-up work must not run on the default stream)."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            loss = self.step(batch)
        main.wait_stream(self.stream)
        loss.record_stream(main)  # freed later, after use on the main stream
        return loss

    def _load_dense_lrs(self) -> None:
        """Make each dense group's lr the device tensor the graph reads, holding the scheduled value.

        LR schedulers either fill a tensor lr in place (newer torch) or replace it with a float;
        a float is copied into the tensor (a kernel launch, no host sync) and the tensor put back.
        """
        if not self.lr_tensors:
            for opt in self._dense_optimizers():
                for group in opt.param_groups:
                    lr = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.step.device)
                    group["lr"] = lr
                    self.lr_tensors.append((group, lr))
            return
        for group, lr in self.lr_tensors:
            if group["lr"] is not lr:
                lr.fill_(float(group["lr"]))
                group["lr"] = lr

    def _capture(self, batch: Batch) -> torch.Tensor:
        """Capture one step on static copies of `batch`, then replay it: that runs this batch's step
        (a capture records kernels without running them)."""
        if isinstance(batch, GatheredBatch):  # the gathers and the widening go into the graph, its input the rows
            self.gather_source, self.static_rows = batch.source, batch.rows.clone()
        else:
            self.static = Batch(batch.dense.clone(), batch.sparse.clone(), batch.labels.clone(), batch.global_size,
                                batch.pad)
        for opt in self.step.optimizers:
            opt.zero_grad(set_to_none=True)  # the backward allocates the gradients from the graph's pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            if self.gather_source is not None:
                self.static = GatheredBatch(self.gather_source, self.static_rows, batch.global_size, batch.pad)
            self.static_loss = self.step.run(self.static)
        self.graph = graph
        gathers = " with the batch's gathers from the device-resident split" if self.gather_source is not None else ""
        logger.info(f"train.cuda_graph: captured the training step{gathers} at batch size {self.batch_size}")
        graph.replay()
        return self.static_loss


def graph_train_step(step: TrainStep, enabled: bool, distributed: bool):
    """`step` wrapped in a `GraphedTrainStep` when ``train.cuda_graph`` asks for it and this run can
    (on the CPU: a warning and the ordinary step, as compile mode reduce-overhead does)."""
    if not enabled:
        return step
    if step.device.type != "cuda":
        run_logger.warning(f"train.cuda_graph needs CUDA; training with the ordinary step on {step.device}")
        return step
    warmup = WARMUP_STEPS
    if distributed:
        from dlrm.config import ConfigError

        if not step.model.sparse_arch.fused_optimizer:
            raise ConfigError('train.cuda_graph: with several processes needs kernels.embedding "triton" (the '
                              "sharded torch embedding has sparse gradients of data-dependent shapes)")
        if torch.distributed.get_backend() != "nccl":
            raise ConfigError(f"train.cuda_graph: with several processes needs the nccl backend, not "
                              f"{torch.distributed.get_backend()!r} (only NCCL's collectives can be captured)")
        warmup = DDP_WARMUP_STEPS
    logger.info("train.cuda_graph: the whole training step (forward, backward, embedding update, dense "
                f"optimizer{', collectives' if distributed else ''}) is captured in one CUDA graph after "
                f"{warmup} warm-up steps")  # fmt: skip
    return GraphedTrainStep(step, warmup)


def plain_lr_state_dict(opt: torch.optim.Optimizer) -> dict:
    """`opt.state_dict()` with tensor learning rates (set by GraphedTrainStep) saved as floats, so a
    checkpoint loads into any run the same way (a host sync: checkpoint time only)."""
    state = opt.state_dict()
    for group in state["param_groups"]:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state
