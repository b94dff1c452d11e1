"""The training loop, readable top to bottom: build, (resume), train with periodic eval and
checkpoints, summarize."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from loguru import logger
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from dlrm.config import Config, ConfigError
from dlrm.data.device_loader import DeviceLoader
from dlrm.data.loader import ParquetLoader, split_files
from dlrm.data.schema import write_json_atomic
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed.env import DistEnv, init_distributed
from dlrm.distributed.sharding import ShardingPlan, plan_sharding
from dlrm.model.dlrm import DLRM, build_loss, build_model
from dlrm.train import checkpoint as ckpt
from dlrm.train.metrics import evaluate_logits
from dlrm.train.optim import build_optimizers, build_schedulers
from dlrm.train.profiling import make_profiler, top_ops_table
from dlrm.train.setup import Tables, dataset_tables, load_dataset_metadata, make_run_dir, resolve_device, seed_everything
from dlrm.train.signals import GracefulStop
from dlrm.train.graphed_step import graph_train_step, plain_lr_state_dict
from dlrm.train.step import EvalForward, TrainStep, compile_counters, set_matmul_precision

WARMUP_STEPS = 3
"""Steps timed apart as warm-up (compilation, autotuning, allocator growth) before throughput windows."""


from dlrm.errors import NonFiniteLoss, TrainingStopped  # noqa: E402  (re-exported: tests import them from here)


def evaluate(forward: EvalForward, loader: ParquetLoader, env: DistEnv = DistEnv()) -> dict[str, float]:
    """AUC, logloss and accuracy over the whole split (logits gathered on the device, one sync);
    in a distributed run over every rank's rows, the same numbers on every rank."""
    forward.model.eval()
    logits, labels = [], []
    for batch in loader:
        logits.append(forward(batch))
        labels.append(batch.labels)
    forward.model.train()
    return evaluate_logits(env.all_gather_rows(torch.cat(logits)), env.all_gather_rows(torch.cat(labels)))


class _NoWriter:
    """Stands in for the SummaryWriter on ranks other than 0."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def versions() -> dict[str, str]:
    """Library versions recorded in summary.json, so numbers can be traced to what produced them."""
    import sys

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "absent"
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_loader(cfg: Config, files: list[Path], batch_size: int, device: torch.device, train: bool,
                env: DistEnv = DistEnv()):
    """The loader `data.placement` asks for: streamed from parquet, or the whole split in device
    memory; in a distributed run it delivers this rank's slice of every global batch."""
    d = cfg.data
    ranks = dict(rank=env.rank, world_size=env.world_size)
    if d.placement == "gpu":
        if device.type != "cuda":
            logger.warning("data.placement 'gpu' on a CPU device: the split is held in host memory instead")
        return DeviceLoader(files, batch_size, device, shuffle=train and d.shuffle, seed=cfg.train.seed,
                            drop_last=train and d.drop_last, **ranks)
    if train:
        return ParquetLoader(files, batch_size, device, shuffle=d.shuffle, seed=cfg.train.seed, drop_last=d.drop_last,
                             prefetch=d.prefetch, shuffle_buffer_rows=d.shuffle_buffer_rows, **ranks)
    return ParquetLoader(files, batch_size, device, prefetch=d.prefetch, **ranks)


def make_sharding(cfg: Config, tables: Tables, env: DistEnv) -> Optional[ShardingPlan]:
    """The embedding sharding plan of a distributed run (logged with each rank's share), else None."""
    if not env.distributed:
        return None
    plan = plan_sharding(tables.cardinalities, env.world_size, cfg.distributed.sharding,
                         cfg.distributed.row_wise_min_rows)
    for q in range(env.world_size):
        if plan.local_rows(q) == 0:
            raise ConfigError(f"distributed.sharding: {cfg.distributed.sharding!r} leaves rank {q} without "
                              f"embedding rows ({len(tables.cardinalities)} tables, {env.world_size} ranks); use 'row'")
    logger.info(f"embedding sharding ({cfg.distributed.sharding}) over {env.world_size} ranks:\n"
                + plan.describe(cfg.model.embedding_dim))
    return plan


def log_memory(env: DistEnv, model: DLRM, device: torch.device) -> None:
    """Parameters and device memory of every rank, logged by rank 0 (one gather at start-up)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    for q, (p, a) in enumerate(env.all_gather_object((params, allocated))):
        logger.info(f"rank {q}: parameters {p / 2**20:,.1f} MiB"
                    + (f", CUDA memory allocated {a / 2**20:,.1f} MiB" if a is not None else ""))


def build_for_data(cfg: Config) -> tuple[torch.device, Path, object, Tables]:
    device = resolve_device(cfg.train.device)
    data_dir, meta = load_dataset_metadata(cfg)
    return device, data_dir, meta, dataset_tables(cfg, meta, data_dir)


def train(cfg: Config, run_dir: Optional[Path] = None, resume: Optional[str] = None) -> dict:
    """Train a DLRM as `cfg` says; returns the summary also written to summary.json.

    Args:
        cfg: the resolved config.
        run_dir: write here instead of tb_logs/<run-name>/ (used by --compare).
        resume: "latest" (the run's newest checkpoint) or a checkpoint path.
    """
    t_start = time.perf_counter()
    device, data_dir, meta, tables = build_for_data(cfg)
    env, device = init_distributed(cfg.distributed, device)  # one process unless under torchrun
    seed_everything(cfg.train.seed, cfg.train.deterministic)

    d = cfg.data
    eval_batch_size = d.eval_batch_size or 4 * d.batch_size
    train_files = split_files(data_dir, meta, "train")
    train_loader = make_loader(cfg, train_files, d.batch_size, device, train=True, env=env)
    if len(train_loader) == 0 and env.world_size <= train_loader.num_rows < d.batch_size:
        # A split smaller than one batch (the 100-line real Criteo sample holds 86 train rows): train
        # on all of it as one batch an epoch rather than refuse; said, and recorded in the summary's config.
        logger.warning(f"data.batch_size: {d.batch_size} is more than the {train_loader.num_rows} rows of "
                       f"{data_dir}/train: training with batch {train_loader.num_rows} instead (one batch an epoch)")
        d.batch_size = train_loader.num_rows
        train_loader = make_loader(cfg, train_files, d.batch_size, device, train=True, env=env)
    eval_loader = make_loader(cfg, split_files(data_dir, meta, d.eval_split), eval_batch_size, device, train=False, env=env)
    total_steps = len(train_loader) * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    if total_steps == 0:
        raise ConfigError(f"data.batch_size: {d.batch_size} is more than the {train_loader.num_rows} rows of {data_dir}/train")

    plan = make_sharding(cfg, tables, env)
    model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, device,
                        shard=(plan, env.rank) if plan else None)
    if env.distributed:
        from dlrm.distributed.data_parallel import wrap_dense_parts

        wrap_dense_parts(model, device)
        log_memory(env, model, device)
    optimizers = build_optimizers(model, cfg.optim, cfg.train.deterministic)
    schedulers = build_schedulers(optimizers, cfg.optim.schedule, total_steps)
    if cfg.train.compile.enabled:
        logger.info(f"torch.compile: mode {cfg.train.compile.mode}, fullgraph {cfg.train.compile.fullgraph}")
    set_matmul_precision(cfg.train.precision)
    train_step = TrainStep(model, build_loss(cfg.kernels), optimizers, cfg.train.precision, device, cfg.train.compile)
    train_step = graph_train_step(train_step, cfg.train.cuda_graph, env.distributed)
    eval_forward = EvalForward(model, cfg.train.precision, device, cfg.train.compile, eval_batch_size)
    logger.info(
        f"device {device}, precision {cfg.train.precision}, {sum(p.numel() for p in model.parameters()):,} parameters "
        f"({sum(tables.cardinalities):,} embedding rows, hashing {tables.hashing}), "
        f"{train_loader.num_rows:,} train rows, {len(train_loader)} steps/epoch, {total_steps} steps"
    )

    pos = ckpt.Position()
    last_ckpt: Optional[Path] = None
    if resume is not None:
        if resume == "latest":
            if not cfg.log.run_name:
                raise ConfigError("--resume: name the run to resume with --run-name (or give a checkpoint path)")
            last_ckpt = ckpt.resolve_resume(resume, Path(cfg.log.tb_dir) / cfg.log.run_name)
        else:
            last_ckpt = Path(resume)
        run_dir = last_ckpt.resolve().parent.parent
        pos = restore(last_ckpt, model, optimizers, schedulers, tables, cfg, env, plan)
        logger.info(f"resumed from {last_ckpt} at step {pos.step} (epoch {pos.epoch}, batch {pos.batch})")
    elif run_dir is None:
        run_dir = env.broadcast_object(make_run_dir(cfg) if env.is_main else None)

    def save() -> Path:
        nonlocal last_ckpt
        if last_ckpt is not None and last_ckpt.name == ckpt.checkpoint_name(pos.step):
            return last_ckpt  # this step is already saved
        state = {
            "model": model.state_dict(),
            "optimizers": [plain_lr_state_dict(o) for o in optimizers],
            "schedulers": [s.state_dict() for s in schedulers],
            "position": asdict(pos),
            "rng": ckpt.rng_state(),
            "cardinalities": tables.cardinalities,
            "config": cfg.to_dict(),
        }
        if plan is not None:
            last_ckpt = dist_ckpt.save_sharded(run_dir, state, pos.step, cfg.checkpoint.keep, env, plan)
        else:
            last_ckpt = ckpt.save_checkpoint(run_dir, state, pos.step, cfg.checkpoint.keep)
        return last_ckpt

    def check_finite() -> None:
        # intended host sync: logging / checkpoint interval only (and the ranks agree on it)
        bad = int(env.all_reduce_max(first_bad.clone()).item())
        if bad >= 0:
            where = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written"
            raise NonFiniteLoss(f"loss became NaN or Inf at step {bad}; stopped; {where}")

    writer = SummaryWriter(str(run_dir), purge_step=pos.step + 1 if pos.step else None) if env.is_main else _NoWriter()
    counters_before = compile_counters()
    samples, loss_steps, window_samples = 0, 0, 0
    data_wait = 0.0  # host seconds spent waiting for the loader in this logging window
    wait_fractions: list[float] = []
    loss_sum = torch.zeros((), device=device)  # accumulated on the device; read at log steps only
    device_step = torch.full((), pos.step, dtype=torch.int64, device=device)
    first_bad = torch.full((), -1, dtype=torch.int64, device=device)  # first step with a non-finite loss
    losses: list[tuple[int, float]] = []
    window_rates: list[float] = []
    warmup_s = float("nan")
    loop_start = window_start = time.perf_counter()
    start_step = pos.step
    bar = tqdm(total=total_steps, initial=pos.step, desc="train", unit="step", dynamic_ncols=True, disable=not env.is_main)
    stopping = False  # a signal arrived; with several ranks, once they all know (at a logging step)
    with make_profiler(cfg.profile, run_dir, device) as prof, GracefulStop() as stop:
        for epoch in range(pos.epoch, cfg.train.epochs):
            if pos.step >= total_steps or stopping:
                break
            if epoch != pos.epoch:
                pos.epoch, pos.batch = epoch, 0
            train_loader.set_epoch(epoch, start_batch=pos.batch)
            batches = iter(train_loader)
            while pos.step < total_steps and not stopping:
                t_wait = time.perf_counter()
                with record_function("data"):
                    batch = next(batches, None)
                data_wait += time.perf_counter() - t_wait
                if batch is None:
                    break
                loss = train_step(batch)
                for sched in schedulers:
                    sched.step()
                device_step += 1
                first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss), device_step, first_bad)
                loss_sum += loss
                pos.step += 1
                pos.batch += 1
                loss_steps += 1
                samples += batch.global_len
                window_samples += batch.global_len
                bar.update(1)
                if prof is not None:
                    prof.step()

                if pos.step - start_step == WARMUP_STEPS:
                    synchronize(device)  # intended sync, once: separates warm-up from steady state
                    window_start = time.perf_counter()
                    warmup_s, window_samples, data_wait = window_start - loop_start, 0, 0.0
                log_step = pos.step % cfg.train.log_every == 0 or pos.step == total_steps
                if log_step:
                    check_finite()
                    # intended host sync: logging interval (the ranks' shares summed: the global mean)
                    mean_loss = env.all_reduce_sum(loss_sum.clone()).item() / env.world_size / loss_steps
                    loss_sum.zero_()
                    loss_steps = 0
                    losses.append((pos.step, mean_loss))
                    now = time.perf_counter()
                    steady = pos.step - start_step > WARMUP_STEPS and window_samples
                    if steady:
                        window_rates.append(window_samples / (now - window_start))
                        # the share of the window the loop waited for batches: the loader starving the step
                        wait_fractions.append(data_wait / (now - window_start))
                    window_start, window_samples, data_wait = now, 0, 0.0
                    log_train(writer, pos.step, mean_loss, optimizers, window_rates[-1] if steady else None,
                              wait_fractions[-1] if steady else None)
                    bar.set_postfix(loss=f"{mean_loss:.4f}", **({"samples_s": f"{window_rates[-1]:,.0f}"} if window_rates else {}))
                if cfg.train.eval_every and pos.step % cfg.train.eval_every == 0 and pos.step != total_steps:
                    log_eval(writer, evaluate(eval_forward, eval_loader, env), pos.step)
                if cfg.checkpoint.every and pos.step % cfg.checkpoint.every == 0:
                    check_finite()  # never save a checkpoint of a diverged model
                    save()
                if not env.distributed:
                    stopping = stop.requested
                elif log_step:  # ranks must stop together: they agree at logging steps (a host sync)
                    stopping = env.any(stop.requested, device)
            batches.close()  # stops the loader's thread when max_steps ends an epoch early
        bar.close()
        check_finite()
        if stopping:
            writer.close()
            raise TrainingStopped(stop.exit_code, f"stopped by signal at step {pos.step}; checkpoint {save()}")
    train_s = time.perf_counter() - loop_start
    save()

    metrics = log_eval(writer, evaluate(eval_forward, eval_loader, env), pos.step)
    counters = {k: v - counters_before[k] for k, v in compile_counters().items()}
    if cfg.train.compile.enabled:
        logger.info(f"torch.compile: {counters['graphs']} graphs compiled, {counters['graph_breaks']} graph breaks")
    ops = top_ops_table(prof, device)
    if ops is not None and env.is_main:
        logger.info("top operators by " + ("device" if device.type == "cuda" else "CPU") + " time:\n" + ops)
        writer.add_text("profile/top_ops", "```\n" + ops + "\n```", pos.step)
    samples_per_sec = statistics.median(window_rates) if window_rates else samples / train_s
    summary = {
        **metrics,
        "split": d.eval_split,
        "steps": pos.step,
        "samples": samples,
        "samples_per_sec": samples_per_sec,
        "data_wait_fraction": statistics.median(wait_fractions) if wait_fractions else None,
        "warmup_s": warmup_s,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "final_train_loss": losses[-1][1] if losses else None,
        "train_losses": losses,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "compile": counters,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": versions(),
        "oracle_auc": meta.extra.get("oracle_auc", {}).get(d.eval_split),
        "checkpoint": str(last_ckpt),
        "run_dir": str(run_dir),
        "config": cfg.to_dict(),
        "world_size": env.world_size,
    }
    writer.add_hparams(
        {"batch_size": d.batch_size, "embedding_dim": cfg.model.embedding_dim, "dense_lr": cfg.optim.dense.lr,
         "sparse_lr": cfg.optim.sparse.lr, "precision": cfg.train.precision, "interaction": cfg.model.interaction},
        {"hparam/auc": metrics["auc"], "hparam/logloss": metrics["logloss"], "hparam/accuracy": metrics["accuracy"]},
        run_name="hparams",
    )
    writer.close()
    if env.is_main:
        write_json_atomic(Path(run_dir) / "summary.json", summary)
    logger.info(
        f"{d.eval_split}: AUC {metrics['auc']:.4f}, logloss {metrics['logloss']:.4f}, accuracy {metrics['accuracy']:.4f}"
        + (f" (oracle AUC {summary['oracle_auc']:.4f})" if summary["oracle_auc"] is not None else "")
        + f"; {pos.step} steps, {samples:,} samples, {samples_per_sec:,.0f} samples/s"
        + (f" (waiting for data {summary['data_wait_fraction']:.0%} of the time)" if wait_fractions else "")
        + f", {summary['wall_s']:.1f}s"
    )
    return summary


def restore(path: Path, model: DLRM, optimizers, schedulers, tables: Tables, cfg: Config,
            env: DistEnv = DistEnv(), plan: Optional[ShardingPlan] = None) -> ckpt.Position:
    """Load a checkpoint into the freshly built objects (after checking it fits); returns its position.
    A distributed run loads its rank's shard of a sharded checkpoint (same ranks and plan)."""
    state = dist_ckpt.load_for_rank(path, env, plan)
    ckpt.check_compatible(state, model, tables.cardinalities, cfg.to_dict()["model"], path)
    model.load_state_dict(state["model"])
    for opt, s in zip(optimizers, state["optimizers"]):
        opt.load_state_dict(s)
    for sched, s in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(s)
    ckpt.set_rng_state(state["rng"])
    return ckpt.Position(**state["position"])


def log_train(writer: SummaryWriter, step: int, loss: float, optimizers, samples_per_sec: Optional[float],
              data_wait_fraction: Optional[float] = None) -> None:
    writer.add_scalar("train/loss", loss, step)
    # float(): a device-tensor lr (train.cuda_graph) is read here, at the logging interval
    writer.add_scalar("train/lr_dense", float(optimizers[0].param_groups[0]["lr"]), step)
    writer.add_scalar("train/lr_sparse", float(optimizers[1].param_groups[0]["lr"]), step)
    if samples_per_sec is not None:
        writer.add_scalar("train/samples_per_sec", samples_per_sec, step)
    if data_wait_fraction is not None:
        writer.add_scalar("train/data_wait_fraction", data_wait_fraction, step)


def log_eval(writer: SummaryWriter, metrics: dict[str, float], step: int) -> dict[str, float]:
    for k, v in metrics.items():
        writer.add_scalar(f"eval/{k}", v, step)
    logger.info(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
