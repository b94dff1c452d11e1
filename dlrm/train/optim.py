"""Optimizers: dense ones from torch.optim, sparse ones that touch only the rows a batch used."""

from __future__ import annotations

import math
from typing import Optional

import torch
from loguru import logger
from torch import nn

from dlrm.config import OptimConfig, ScheduleConfig
from dlrm.logging_setup import counted, run_logger
from dlrm.model.masked_lookup import unchecked_sparse_coo
from dlrm.train.adagrad import CapturableAdagrad


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per embedding row, for sparse (COO) gradients.

    For each row r the batch touched, with g_r its summed gradient:
    ``state[r] += mean(g_r ** 2)``; ``w[r] -= lr * g_r / (sqrt(state[r]) + eps)``.
    One float per row instead of D (as in FBGEMM's and TorchRec's row-wise Adagrad).

    Args:
        params: the embedding weights ([R, D] each; sparse COO or dense gradients).
        lr: learning rate.
        eps: added to the root of the row's accumulated mean square.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3, 2))
        >>> opt = RowWiseAdagrad([w], lr=0.5)
        >>> nn.functional.embedding(torch.tensor([0, 0, 2]), w, sparse=True).sum().backward()
        >>> opt.step()   # row 0: g = 2, sum 4, w -= 0.5 * 2 / 2; row 2: g = 1, sum 1; row 1 untouched
        >>> w.detach(), opt.state[w]["sum"]
        (tensor([[0.5000, 0.5000],
                [1.0000, 1.0000],
                [0.5000, 0.5000]]), tensor([4., 0., 1.]))

    Shapes: state ``sum`` [R] (fp32, or the weight's dtype if wider) for a weight [R, D].
    """

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                acc_dtype = torch.promote_types(p.dtype, torch.float32)  # fp32 state for bf16/fp32 weights
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=acc_dtype, device=p.device)
                grad = p.grad
                if grad.is_sparse:
                    # sums the gradients of rows that repeat in the batch. On CUDA a host sync every step (the number
                    # of distinct rows sizes the result), as torch's sparse optimizers' own coalesce: inherent to the
                    # eager sparse path; the fused updates (Triton, FusedUpdateSparseArch) have none
                    grad = grad.coalesce()
                    rows, values = grad.indices()[0], grad.values()
                else:
                    rows, values = torch.arange(p.shape[0], device=p.device), grad
                values = values.to(acc_dtype)
                acc = state["sum"].index_add_(0, rows, values.square().mean(dim=1))
                scale = group["lr"] / (acc[rows].sqrt() + group["eps"])
                p.index_add_(0, rows, (-scale.unsqueeze(1) * values).to(p.dtype))
        return None


def decay_touched_rows_(weight: torch.Tensor, weight_decay: float) -> None:
    """Lazy L2 on an embedding weight: ``grad[r] += weight_decay * w[r]`` for every row r the batch touched.

    The touched rows are those of the sparse gradient (every row looked up, also one whose gradient
    summed to zero; repeated rows are coalesced first, so each gets the decay once) or, for a dense
    gradient, its non-zero rows. Other rows keep no gradient and are not decayed: no pass over the
    whole table, which is what lets L2 work with sparse updates. The Triton fused update applies the
    same rule inside its kernel (``kernels.embedding.embedding_sparse_update_``, ``weight_decay``).

    Args:
        weight: the embedding weight [R, D] whose ``.grad`` is replaced (sparse) or updated (dense).
        weight_decay: the L2 coefficient (0: nothing happens).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, 2))
        >>> torch.nn.functional.embedding(torch.tensor([1, 1, 3]), w, sparse=True).sum().backward()
        >>> decay_touched_rows_(w, 0.5)
        >>> w.grad.to_dense()
        tensor([[0.0000, 0.0000],
                [2.5000, 2.5000],
                [0.0000, 0.0000],
                [1.5000, 1.5000]])
    """
    grad = weight.grad
    if grad is None or weight_decay == 0.0:
        return
    w = weight.detach()
    if grad.is_sparse:
        grad = grad.coalesce()  # a host sync on CUDA (data-dependent size), as the eager sparse optimizers' own
        rows = grad.indices()[0]
        values = grad.values() + weight_decay * w[rows].to(grad.dtype)
        weight.grad = unchecked_sparse_coo(grad.indices(), values, grad.shape, is_coalesced=True)  # coalesce()'s
    else:
        touched = grad.ne(0).any(dim=1, keepdim=True)
        grad.add_(w * touched, alpha=weight_decay)


def add_sparse_weight_decay(optimizer: torch.optim.Optimizer, weight_decay: float) -> torch.optim.Optimizer:
    """Make `optimizer` (an eager sparse one) apply lazy L2 (`decay_touched_rows_`) before each step.

    A step pre-hook, so the optimizer class, its state_dict and its checkpoints stay what they are.
    Returns `optimizer`.
    """
    if weight_decay:
        def decay(opt, args, kwargs) -> None:
            for group in opt.param_groups:
                for p in group["params"]:
                    decay_touched_rows_(p, weight_decay)

        optimizer.register_step_pre_hook(decay)
    return optimizer


class FusedSparseOptimizer(torch.optim.Optimizer):
    """The sparse optimizer of a Triton embedding whose backward applies the update itself.

    With ``kernels.embedding = "triton"`` the embedding's backward (``kernels.embedding.fused_embedding``)
    updates the rows a batch touched in place, so no ``[rows, D]`` gradient ever exists and ``step()``
    has nothing left to do. This class is what the rest of the trainer sees in its place: a param
    group whose ``lr`` the LR schedulers drive (copied into the kernel's one-element device tensor by
    :meth:`load_lr` before each forward: a kernel launch, not a host sync), and a ``state_dict`` that
    carries the optimizer state (Adagrad sums) so checkpoints resume exactly.

    Args:
        embedding: a ``kernels.embedding.TritonSparseEmbedding``; switched to fused-update mode here.
        name: "sgd" | "adagrad" | "rowwise_adagrad" (same update rules as the eager optimizers).
        lr, eps: as for the eager optimizers.
        deterministic: bitwise reproducible updates where rows repeat in a batch.
        weight_decay: lazy L2 on the rows a batch touches, as `decay_touched_rows_` (in the kernel).

    Example (on the CPU the kernels run in Triton's interpreter, TRITON_INTERPRET=1):
        >>> from kernels.embedding import TritonSparseEmbedding
        >>> emb = TritonSparseEmbedding([4, 3], dim=2)   # rows 0-3: feature 0, rows 4-6: feature 1
        >>> opt = FusedSparseOptimizer(emb, "rowwise_adagrad", lr=0.5, eps=1e-8, deterministic=True)
        >>> before = emb.weight.detach().clone()
        >>> emb(torch.tensor([[1, 0]])).sum().backward()   # rows 2 and 5; the backward updates them
        >>> opt.step()   # nothing left to do
        >>> emb.weight.grad, (emb.weight.detach() - before)[[2, 5]], opt.state_dict()["state"][0]["sum"]
        (None, tensor([[-0.5000, -0.5000],
                [-0.5000, -0.5000]]), tensor([0., 0., 1., 0., 0., 1., 0.]))

    Shapes: state ``sum`` fp32 [R] (rowwise_adagrad), [R, D] (adagrad) or none (sgd) for the [R, D] weight.
    """

    def __init__(self, embedding: nn.Module, name: str, lr: float, eps: float, deterministic: bool,
                 weight_decay: float = 0.0) -> None:
        from kernels.embedding import SparseOptimizerConfig

        weight = embedding.weight
        super().__init__([weight], {"lr": lr, "eps": eps})
        lr_tensor = torch.tensor([lr], dtype=torch.float32, device=weight.device)
        self._loaded_lr = lr  # what `lr_tensor` holds (`load_lr`)
        self.fused = embedding.use_fused_update(SparseOptimizerConfig(name, lr_tensor, eps=eps, deterministic=deterministic,
                                                                      weight_decay=weight_decay))
        if self.fused.state is not None:
            self.state[weight]["sum"] = self.fused.state  # the kernel's own tensor: checkpoints save it as is
        # bf16 tables' stochastic-rounding seed (advanced on the device every step): part of the update's
        # state, so a resumed run draws the rounding bits the uninterrupted one would have drawn
        self.sr_seed: Optional[torch.Tensor] = getattr(embedding, "sr_seed", None)
        if self.sr_seed is not None:
            self.state[weight]["sr_seed"] = self.sr_seed

    def load_lr(self, force: bool = False) -> None:
        """Copy the scheduled learning rate into the tensor the fused backward reads, when it changed (`force`: in any
        case). Called before every step: the copy is a kernel launch (~8-10 us of host on an H200, a step of a
        CUDA-graphed run at batch 256 taking ~200), and only this method writes the tensor, so the value it last
        wrote is the one the tensor holds."""
        lr = self.param_groups[0]["lr"]
        if force or isinstance(lr, torch.Tensor) or lr != self._loaded_lr:
            self.fused.lr.fill_(lr)
            self._loaded_lr = lr

    @torch.no_grad()
    def step(self, closure=None):
        return None  # the embedding's backward already applied this step's update

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        weight = self.param_groups[0]["params"][0]
        # Copy the saved tensors themselves into the kernel's tensors, in place: Optimizer.load_state_dict
        # casts floating state to the parameter's dtype (the fp32 Adagrad sums of a bf16 table would come
        # back rounded to bf16) and would turn the int64 seed into a float.
        saved = next(iter(state_dict.get("state", {}).values()), {})
        if self.fused.state is not None:
            if "sum" in saved:
                self.fused.state.copy_(saved["sum"])
            else:  # the eager row-wise Adagrad's state before its first step: its sums would start at zero
                self.fused.state.zero_()
            self.state[weight]["sum"] = self.fused.state
        if self.sr_seed is not None:
            if "sr_seed" in saved:  # written before the seed was saved: it keeps the start from train.seed
                self.sr_seed.copy_(saved["sr_seed"])
            self.state[weight]["sr_seed"] = self.sr_seed
        else:
            self.state[weight].pop("sr_seed", None)
        self.load_lr(force=True)


def default_fused(name: str, device: torch.device) -> bool:
    """Whether the dense optimizer uses torch.optim's fused implementation when the config leaves
    it open: on CUDA for SGD and Adam; never for Adagrad, which torch has no fused CUDA kernel for
    (torch 2.11 raises "`fused=True` requires ... supported devices: [... 'cpu' ...]")."""
    return device.type == "cuda" and name in ("sgd", "adam")


def build_optimizers(model: nn.Module, cfg: OptimConfig, deterministic: bool = False) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(dense optimizer over the MLPs, sparse optimizer over the embedding weight).

    A sparse arch whose backward applies the optimizer (``fused_optimizer``, see
    `dlrm.model.interfaces.SparseArchInterface`) gets a
    :class:`FusedSparseOptimizer`: its update runs inside the embedding's backward.

    Args:
        model: a DLRM (``model.sparse_arch.weight`` goes to the sparse optimizer, every other
            parameter to the dense one).
        cfg: the ``optim`` section (``dense`` and ``sparse``; ``schedule`` is `build_schedulers`').
        deterministic: bitwise reproducible fused sparse updates (``train.deterministic``).

    Example:
        >>> from dlrm.config import ModelConfig
        >>> from dlrm.model.dlrm import build_model
        >>> model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[4], top_mlp=[1]), [5, 5], log_kernels=False)
        >>> dense, sparse = build_optimizers(model, OptimConfig())
        >>> type(dense).__name__, type(sparse).__name__, sparse.param_groups[0]["params"][0] is model.sparse_arch.weight
        ('Adam', 'RowWiseAdagrad', True)
    """
    sparse_params = [model.sparse_arch.weight]
    sparse_ids = {id(p) for p in sparse_params}
    dense_params = [p for p in model.parameters() if id(p) not in sparse_ids]
    d = cfg.dense
    fused = d.fused if d.fused is not None else default_fused(d.name, dense_params[0].device)
    extra = {"fused": True} if fused else {}  # only when asked: fused and foreach exclude each other
    if d.name == "sgd":
        dense = torch.optim.SGD(dense_params, lr=d.lr, momentum=d.momentum, weight_decay=d.weight_decay, **extra)
    elif d.name == "adagrad" and not fused and dense_params[0].device.type == "cuda":
        # torch's foreach Adagrad, bitwise, without its host sync: a captured step can hold it
        dense = CapturableAdagrad(dense_params, lr=d.lr, eps=d.eps, weight_decay=d.weight_decay)
    elif d.name == "adagrad":
        dense = torch.optim.Adagrad(dense_params, lr=d.lr, eps=d.eps, weight_decay=d.weight_decay, **extra)
    else:
        dense = torch.optim.Adam(dense_params, lr=d.lr, eps=d.eps, weight_decay=d.weight_decay, **extra)
    s = cfg.sparse
    logger.info(f"dense optimizer: {d.name}" + (" (fused)" if fused else "") + f"; sparse optimizer: {s.name}"
                + (f", lazy weight decay {s.weight_decay:g} on touched rows" if s.weight_decay else ""))
    dense = keeps_configured_hyperparameters(dense)
    if model.sparse_arch.fused_optimizer:
        return dense, keeps_configured_hyperparameters(
            FusedSparseOptimizer(model.sparse_arch, s.name, s.lr, s.eps, deterministic, s.weight_decay))
    if s.name == "sgd":
        sparse = torch.optim.SGD(sparse_params, lr=s.lr)
    elif s.name == "adagrad":
        sparse = torch.optim.Adagrad(sparse_params, lr=s.lr, eps=s.eps)
    else:
        sparse = RowWiseAdagrad(sparse_params, lr=s.lr, eps=s.eps)
    return dense, add_sparse_weight_decay(keeps_configured_hyperparameters(loads_fused_state(sparse)), s.weight_decay)


CONFIGURED = ("lr", "eps", "weight_decay", "momentum")
"""The param-group entries an `OptimConfig` sets (the lr before any schedule)."""

IMPLEMENTATION = ("fused", "foreach", "capturable")
"""The param-group entries that choose how a torch optimizer runs here (the device, `train.cuda_graph`), not what it
computes: a checkpoint's do not apply to the run that loads it."""


def keeps_configured_hyperparameters(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer` keep the hyperparameters it was built with (`CONFIGURED`) when a state dict loads; returns it.

    torch's Optimizer.load_state_dict takes the saved param groups whole, so a resumed run trained on with
    the checkpoint's learning rate, eps, weight decay and momentum even where ``--allow-config-change``
    let the config change them (and logged the change). The state (sums, moments, step counters) is the
    checkpoint's; the hyperparameters are the config's. A schedule then scales the lr (`build_schedulers`).

    The implementation entries (`IMPLEMENTATION`) are the live optimizer's as the load starts: a checkpoint
    of a CPU run (Adam neither fused nor capturable) resumed on a GPU with ``train.cuda_graph`` made the
    captured step's Adam non-capturable (the capture then failed) and the dense optimizer silently unfused.
    Step counters move where torch keeps them for the live entries (on the parameter's device when fused or
    capturable, else on the CPU), as torch's load does for the saved ones.
    """
    configured = [{k: group[k] for k in CONFIGURED if k in group} for group in optimizer.param_groups]
    live: list[dict] = []

    def remember(opt, state_dict) -> None:
        # the entries as the run set them, up to this load (GraphedTrainStep sets capturable after the build)
        live[:] = [{k: group[k] for k in IMPLEMENTATION if k in group} for group in opt.param_groups]

    def restore(opt) -> None:
        for group, values, flags in zip(opt.param_groups, configured, live or [{}] * len(configured)):
            group.update(values)
            if "initial_lr" in group and "lr" in values:  # a schedule's base (LambdaLR reads it when built)
                group["initial_lr"] = values["lr"]
            if flags and any(group.get(k) != v for k, v in flags.items()):
                group.update(flags)
                _place_step_counters(opt, group)

    optimizer.register_load_state_dict_pre_hook(remember)
    optimizer.register_load_state_dict_post_hook(restore)
    return optimizer


def _place_step_counters(opt: torch.optim.Optimizer, group: dict) -> None:
    """Each "step" tensor of `group`'s parameters where torch's optimizers keep it for the group's flags: an fp32
    tensor on the parameter's device when fused or capturable, else on the CPU (torch's own load places a step by
    the saved group's flags, which `keeps_configured_hyperparameters` has just replaced)."""
    # CapturableAdagrad keeps them on the device whatever its flags say (its own load hook put them there)
    on_device = bool(group.get("fused")) or bool(group.get("capturable")) or isinstance(opt, CapturableAdagrad)
    for p in group["params"]:
        state = opt.state.get(p)
        step = state.get("step") if state else None
        if isinstance(step, torch.Tensor):
            state["step"] = step.to(dtype=torch.float32, device=p.device if on_device else "cpu")


def loads_fused_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer` (an eager sparse one) load a `FusedSparseOptimizer`'s state dict too; returns it.

    ``kernels.embedding`` and ``train.compile`` may change on resume (`dlrm.train.resume_policy`), so a
    checkpoint of the fused update (its param groups hold only ``lr`` and ``eps``, its state only the
    sums) resumes with the eager optimizer: the groups get the optimizer's defaults for the keys they lack
    (torch's SGD read ``group["momentum"]``: KeyError), and torch's Adagrad its ``step`` counter (which,
    without ``lr_decay``, the update does not use).
    """
    def fill(opt, state_dict):
        groups = [{**opt.defaults, **group} for group in state_dict["param_groups"]]
        state = state_dict["state"]
        if isinstance(opt, torch.optim.Adagrad):
            state = {k: {"step": torch.zeros((), dtype=torch.float32), **v} if "sum" in v else v
                     for k, v in state.items()}
        return {**state_dict, "param_groups": groups, "state": state}

    optimizer.register_load_state_dict_pre_hook(fill)
    return optimizer


def lr_multiplier(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at `step` (0-based): warm-up, hold, then decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "none" or step < cfg.decay_start_step:
        return 1.0
    span = cfg.decay_steps or max(total_steps - cfg.decay_start_step, 1)
    t = min((step - cfg.decay_start_step) / span, 1.0)
    if cfg.decay == "linear":
        return 1.0 - (1.0 - cfg.end_factor) * t
    return cfg.end_factor + (1.0 - cfg.end_factor) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_schedulers(optimizers, cfg: ScheduleConfig, total_steps: int) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One LambdaLR per optimizer following `lr_multiplier`; none when the multiplier is always 1
    (no warm-up, no decay): stepping a constant schedule costs host time every step for nothing.

    Args:
        optimizers: the run's optimizers (`build_optimizers`).
        cfg: ``optim.schedule``.
        total_steps: the run's length (a decay without ``decay_steps`` runs to it).

    Example:
        >>> opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> [sched] = build_schedulers([opt], ScheduleConfig(warmup_steps=4), total_steps=10)
        >>> lrs = [opt.param_groups[0]["lr"]]   # step s of the warm-up: (s + 1) / 4
        >>> for _ in range(3):
        ...     opt.step(); sched.step(); lrs.append(opt.param_groups[0]["lr"])
        >>> lrs
        [0.25, 0.5, 0.75, 1.0]
        >>> build_schedulers([opt], ScheduleConfig(), total_steps=10)   # a constant multiplier: no scheduler
        []
    """
    if cfg.warmup_steps == 0 and cfg.decay == "none":
        return []
    # accepted, and then without effect in this run: said (a decay that never starts trained at the full rate)
    if cfg.decay != "none" and cfg.decay_start_step >= total_steps:
        run_logger.warning(f"optim.schedule.decay_start_step {cfg.decay_start_step} is at or after this run's end (step "
                           f"{total_steps}): the {cfg.decay} decay never starts")
    if cfg.warmup_steps > total_steps:
        run_logger.warning(f"optim.schedule.warmup_steps {cfg.warmup_steps} is longer than this run ({counted(total_steps, 'step')}): "
                           f"it ends at {_share(total_steps / cfg.warmup_steps)} of the learning rate")
    return [ScheduledLR(opt, lambda step: lr_multiplier(step, cfg, total_steps)) for opt in optimizers]


def _share(fraction: float) -> str:
    """`fraction` as a percentage with the digits it needs to be neither 0% nor 100% (a 1-step run of a 200-step
    warm-up "ended at 0%" of the learning rate, 200 steps of 201 "at 100%").

    Example:
        >>> _share(0.25), _share(1 / 200), _share(200 / 201)
        ('25%', '0.5%', '99.5%')
    """
    for digits in range(6):
        text = f"{fraction:.{digits}%}"
        if 0 < float(text[:-1]) < 100:
            return text
    return text


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """`LambdaLR` whose base learning rates stay the configured ones when a checkpoint's state loads, and whose step
    costs the host little.

    LambdaLR.load_state_dict restores the saved ``base_lrs``: a learning rate changed on resume
    (``--allow-config-change optim.dense.lr``) would be undone at the next step. Here the position
    (``last_epoch``) is the checkpoint's, the base the optimizer's own (`keeps_configured_hyperparameters`),
    and the groups' lr is set at once to ``base * multiplier(last_epoch)``: with an unchanged config,
    exactly the value the checkpoint holds.

    `step` leaves LambdaLR's own to its first call (its checks of the call order) and to the deprecated ``epoch``
    argument; every later step sets the same state LambdaLR's does, without its machinery (measured on an H200,
    `configs/sample.json`: 15-20 us of host time a scheduler a step, two schedulers, in a step of ~200 us that
    is host-bound), and writes a group's lr only when it changes (a tensor lr, which a CUDA-graphed step reads,
    costs a kernel launch a write): not during a hold at the full rate or after a decay's end.
    """

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or self._step_count < 2 or not hasattr(self, "_written"):
            super().step(epoch)
            self._written = [group["lr"] for group in self.optimizer.param_groups]
            self._last_lr = [float(lr) if isinstance(lr, torch.Tensor) else lr for lr in self._last_lr]
            return
        self._step_count += 1
        self._set(self.last_epoch + 1)

    def trained_lr(self) -> float:
        """The first group's rate the last step trained with: ``base * multiplier(last_epoch - 1)``. After N steps
        the scheduler stands at N, its groups holding step N + 1's rate (the step trains, then the schedule steps);
        computed on the host, as a captured step's tensor lr already holds the next step's value (no sync, no copy)."""
        return self.base_lrs[0] * self.lr_lambdas[0](self.last_epoch - 1)

    def state_dict(self) -> dict:
        """LambdaLR's, without `_set`'s record of the objects it wrote (a device tensor has no place in a checkpoint)."""
        state = super().state_dict()
        state.pop("_written", None)
        return state

    def load_state_dict(self, state_dict) -> None:
        base_lrs = list(self.base_lrs)
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs
        self.start_at(self.last_epoch)

    def start_at(self, step: int) -> None:
        """Stand at `step` of the schedule, the groups' lr set to ``base * multiplier(step)``. Also for a checkpoint
        written without a schedule (``--allow-config-change optim.schedule`` adding one): built, the schedule stood
        at step 0, so a decay from step N began N steps late (or never) and a warm-up ran again mid-run."""
        self._written = None  # every group written
        self._set(step)

    def _set(self, step: int) -> None:
        """``last_epoch`` = `step`; each group's lr ``base * multiplier(step)``, written unless it already holds that
        value as this scheduler wrote it (the same float or tensor object, with the same value: anything that put
        another object there, an optimizer's load or a captured step's tensor, gets it written)."""
        self.last_epoch = step
        lrs = [base * f(step) for base, f in zip(self.base_lrs, self.lr_lambdas)]
        groups = self.optimizer.param_groups
        written = self._written
        for k, (group, lr) in enumerate(zip(groups, lrs)):
            held = group["lr"]
            if written is not None and held is written[k] and lr == self._last_lr[k]:
                continue  # unchanged
            if isinstance(held, torch.Tensor):
                held.fill_(lr)  # a captured step's lr tensor: filled in place, as the schedulers do
            else:
                group["lr"] = lr
        self._last_lr = lrs
        self._written = [group["lr"] for group in groups]


def trained_lrs(optimizers, schedulers: list) -> list:
    """The learning rate (first param group) each of `optimizers` trained its last step with, for the logging window
    at that step. A scheduled optimizer's groups already hold the next step's rate (`ScheduledLR.trained_lr`); one
    without a schedule trains every step at its group's rate (a captured step's: a device tensor, copied with the
    window)."""
    by_optimizer = {id(sched.optimizer): sched for sched in schedulers}
    return [by_optimizer[id(opt)].trained_lr() if id(opt) in by_optimizer else opt.param_groups[0]["lr"]
            for opt in optimizers]
