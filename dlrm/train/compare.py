"""Side-by-side variants (eager, compiled, cudagraphs, triton, triton+compiled) on the same batches.

Each variant trains from the same seed on the same batches for the same steps, as its own
TensorBoard run under ``tb_logs/<run-name>/<variant>/`` so the curves overlay; the comparison
table goes to ``compare.md``, ``compare.csv`` and ``compare.png`` in ``tb_logs/<run-name>/``, and
into that parent run's TensorBoard events (text ``compare/table``, image ``compare/plot``). The three files are made
first and written as one set (`dlrm.checkpoint.write_files_atomic`): a failure while they are made or written leaves
none of them, never two of three or half a file. In compare.csv a missing or undefined value (a skipped variant's, a
one-class split's AUC) is an empty cell, as in the sweep's CSVs; compare.md says "n/a" ("n/a (one class)" for the AUC).

A variant that fails while it trains (an error, a diverged loss, out of memory) does not end the comparison: the
others run, its row's status is ``failed: <reason>``, and once the reports are written the command exits with the
first failure's code (dlrm.cli's). If no variant finished, there is no report: the first failure ends it as a
single run's would, and if every variant was skipped (none can run on this device, model or data) a one-line error
names each one's reason. Any failure under torchrun ends it at once (one rank going on to the next variant while the
others wait in the failed one's collectives would hang them). Ctrl-C or SIGTERM stops it (the variant in flight stops
as a single run would; in its steps, after that step's checkpoint): the variants that finished are written as the reports of a partial
comparison (compare.md says so, naming the signal, the variant it stopped and those not run; their rows' status
``stopped by SIGTERM``, ``not run: the comparison was stopped``), then the command exits 128 + the signal (130, 143);
none finished, no report. (A stop wrote no report before 2026-12-04: the finished variants' numbers were lost.) One
while the plot is made, once the variants are done (one a library's catch-all dropped there too), stops the plot:
compare.md (saying so) and compare.csv are written, no compare.png, exit 128 + the signal (`_write_without_plot`).
One once the plot is made, as the reports are written, stops nothing (`run_comparison`'s `results_written`: said,
exit 0). Under torchrun the ranks hold a signal (`dlrm.train.signals.run_hold`) and agree on it after each variant.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import datetime
import gc
import io
import json
import math
import os
import traceback
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Union

import torch
from loguru import logger

from dlrm.config import CompileConfig, Config, ConfigError, KernelsConfig, validate
from dlrm.errors import TrainingStopped, failure_reason
from dlrm.logging_setup import run_logger  # (said alike by every rank: rank 0 says it for the run)
from dlrm.stop_signal import EXIT_INTERRUPTED, raise_pending, signals_deferred, stop_signal_name, stopped_at_once
from dlrm.train.metric_text import auc_text, csv_cell
from dlrm.train.run_dir import RunDirectory
from dlrm.train.setup import as_trained, dataset_tables, load_dataset_metadata, resolve_device

# Which implementation each part gets, (embedding, interaction, mlp, loss), per kernel set.
KERNEL_SETS: dict[str, tuple[str, str, str, str]] = {
    "torch": ("torch",) * 4,
    "triton": ("triton",) * 4,
    # only the embedding (with its fused sparse update) in Triton; the MLPs are cuBLAS GEMMs, which
    # beat the Triton linear kernel at most DLRM shapes (benchmarks/results/kernels.md)
    "triton-embedding": ("triton", "torch", "torch", "torch"),
    # the embedding and the dot interaction in Triton (the eager interaction's tiny batched GEMMs run
    # on non-tensor-core cuBLAS kernels), MLPs and loss in PyTorch
    "triton-embedding-interaction": ("triton", "triton", "torch", "torch"),
    # and the MLPs as kernels.mlp.FusedMLP (cuBLASLt bias+ReLU epilogues, one Triton kernel for the
    # ReLU mask and bias gradient, weight gradients on a side stream in tf32; issue #20)
    "triton-fused-mlp": ("triton", "triton", "fused", "torch"),
    # PyTorch MLPs whose weight and bias gradients come from kernels.wgrad (one Triton GEMM with the ReLU
    # mask and bias sum fused; issue #20)
    "triton-wgrad": ("triton", "triton", "wgrad", "torch"),
    # the same MLPs with the PyTorch interaction (the DCN models: their Triton cross layer is slower)
    "triton-embedding-wgrad": ("triton", "torch", "wgrad", "torch"),
    # the DCN cross layers' forward GEMM and epilogue as one warp-specialized Gluon kernel (Hopper)
    "triton-embedding-gluon-cross": ("triton", "gluon", "torch", "torch"),
    # and the MLPs as kernels.mlp.FusedMLP (the DCN models on Hopper in bf16)
    "triton-embedding-gluon-cross-fused-mlp": ("triton", "gluon", "fused", "torch"),
    # what the defaults pick on the run's device (dlrm.train.fast_path)
    "auto": ("auto",) * 4,
}

class Variant(NamedTuple):
    kernels: str  # a KERNEL_SETS key
    compile_mode: Optional[str]  # torch.compile mode ("auto": resolved by dlrm.train.fast_path), or None for eager
    step_graph: Union[bool, str] = False  # train.cuda_graph: the whole step in one CUDA graph ("auto": fast_path)


VARIANTS: dict[str, Variant] = {
    "eager": Variant("torch", None),
    # every "auto" resolved as train.py resolves it with no explicit setting (dlrm.train.fast_path): kernels,
    # compile (and its mode and combo kernels), the whole-step graph; the fastest measured on the run's device
    "auto": Variant("auto", "auto", step_graph="auto"),
    # torch.compile of the PyTorch model in the mode "auto" picks (dlrm.train.fast_path): on one CUDA
    # process reduce-overhead (torch.compile's own CUDA graphs), elsewhere mode default
    "compiled": Variant("torch", "auto"),
    "compiled-default": Variant("torch", "default"),  # host-bound at small batches (compile_host_bound_b8192.md)
    "compiled-cudagraphs": Variant("torch", "reduce-overhead"),
    # torch.compile of the PyTorch model (its embedding's update compiled into the backward) with the
    # whole step, optimizer included, captured as one CUDA graph: no Triton kernel of ours
    "compiled+step-graph": Variant("torch", "default", step_graph=True),
    "triton": Variant("triton", None),
    "triton+compiled": Variant("triton", "default"),
    "triton+cudagraphs": Variant("triton", "reduce-overhead"),
    "triton-embedding+cudagraphs": Variant("triton-embedding", "reduce-overhead"),
    "triton-embedding-interaction+cudagraphs": Variant("triton-embedding-interaction", "reduce-overhead"),
    # compiled (Inductor fusions) and then the whole step, optimizer included, captured as one graph
    "triton-embedding+step-graph": Variant("triton-embedding", "default", step_graph=True),
    "triton-embedding-interaction+step-graph": Variant("triton-embedding-interaction", "default", step_graph=True),
    "triton-fused-mlp+step-graph": Variant("triton-fused-mlp", "default", step_graph=True),
    "triton-wgrad+step-graph": Variant("triton-wgrad", "default", step_graph=True),
    "triton-embedding-wgrad+step-graph": Variant("triton-embedding-wgrad", "default", step_graph=True),
    "triton-embedding-gluon-cross+step-graph": Variant("triton-embedding-gluon-cross", "default", step_graph=True),
    "triton-embedding-gluon-cross-fused-mlp+step-graph": Variant("triton-embedding-gluon-cross-fused-mlp", "default",
                                                                 step_graph=True),
    # the same with Inductor's max-autotune: Triton GEMM templates with fused epilogues where they beat
    # cuBLAS (issue #20: "pick between Triton kernels, cuBLASLt epilogues and Inductor's templates")
    "triton-embedding+autotune+step-graph": Variant("triton-embedding", "max-autotune-no-cudagraphs", step_graph=True),
    "triton-embedding-interaction+autotune+step-graph": Variant("triton-embedding-interaction",
                                                                "max-autotune-no-cudagraphs", step_graph=True),
    "triton-wgrad+autotune+step-graph": Variant("triton-wgrad", "max-autotune-no-cudagraphs", step_graph=True),
    # Inductor's GEMM template autotuning alone (compile mode max-autotune-gemm): max-autotune's pointwise and
    # coordinate-descent tuning left out; the same gains, not reliably less autotuning (results/autotune_gemm.md)
    "triton-embedding+autotune-gemm+step-graph": Variant("triton-embedding", "max-autotune-gemm", step_graph=True),
    "triton-embedding-interaction+autotune-gemm+step-graph": Variant("triton-embedding-interaction",
                                                                     "max-autotune-gemm", step_graph=True),
    # compiled (mode default) without the whole-step graph
    "triton-embedding+compiled": Variant("triton-embedding", "default"),
    "triton-embedding-interaction+compiled": Variant("triton-embedding-interaction", "default"),
    "triton-fused-mlp+compiled": Variant("triton-fused-mlp", "default"),
}

COLUMNS = [
    ("variant", "variant", "{}"),
    ("samples_per_sec", "samples/s (steady state)", "{:,.0f}"),
    ("warmup_s", "warm-up/compile s", "{:.2f}"),
    # the variant's whole session: a compiled evaluation compiles at the first evaluation, outside the warm-up steps
    ("wall_s", "wall s", "{:.1f}"),
    ("peak_memory_mb", "peak device MiB", "{:,.0f}"),
    ("final_train_loss", "final train loss", "{:.5f}"),
    ("max_loss_diff_vs_eager", "max \\|loss - eager\\|", "{:.2e}"),  # escaped: a bare | splits a Markdown cell
    ("auc", "eval AUC", "{:.4f}"),
    ("graph_breaks", "graph breaks", "{}"),
    ("status", "status", "{}"),
]


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise ConfigError(f"--compare: unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    if not names:
        raise ConfigError("--compare: name at least one variant")
    twice = [v for v in dict.fromkeys(names) if names.count(v) > 1]
    if twice:  # each variant trains once, in a run directory named after it: said, not dropped silently
        run_logger.warning(f"--compare: {', '.join(repr(v) for v in twice)} given more than once; each variant trains "
                           "once (its run directory is named after it): compare two runs of one variant with two "
                           "--compare runs")
    return list(dict.fromkeys(names))


def variant_config(cfg: Config, name: str) -> Config:
    kernels, mode, step_graph = VARIANTS[name]
    v = copy.deepcopy(cfg)
    v.kernels = KernelsConfig(**dict(zip(("embedding", "interaction", "mlp", "loss"), KERNEL_SETS[kernels])))
    enabled = "auto" if name == "auto" else mode is not None
    v.train.compile = CompileConfig(enabled=enabled, mode=mode or "default", fullgraph=cfg.train.compile.fullgraph,
                                    combo_kernels="auto" if name == "auto" else cfg.train.compile.combo_kernels)
    v.train.cuda_graph = step_graph
    if step_graph is True and v.optim.dense.fused is False:
        v.optim.dense.fused = None  # the captured step needs the fused dense optimizer
    return v


# What `variant_config` sets for each variant (train.compile.fullgraph is the config's in every one)
SET_BY_VARIANT = ("kernels.embedding", "kernels.interaction", "kernels.mlp", "kernels.loss", "train.compile.enabled",
                  "train.compile.mode", "train.compile.combo_kernels", "train.cuda_graph", "optim.dense.fused")


def replaced_settings(cfg: Config, variants: list[str]) -> list[str]:
    """The config's settings of `SET_BY_VARIANT` (those not at their defaults) that a variant of `variants` trains
    with another value, as ``key value``: the variants replaced them without a word."""
    def value(c: Config, dotted: str):
        node = c
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    default = validate(Config())  # (its compile section whole)
    return [f"{key} {json.dumps(value(cfg, key))}" for key in SET_BY_VARIANT
            if value(cfg, key) != value(default, key)
            and any(value(variant_config(cfg, name), key) != value(cfg, key) for name in variants)]


def data_reason(name: str, multi_hot: bool, distributed: bool = False) -> Optional[str]:
    """Why a variant cannot train this run's data (`multi_hot`: the dataset's metadata.json sizes, which win over the
    config's) or process group (`distributed`: under torchrun), on any device, or None. The whole-step CUDA graph
    cannot replay the torch embedding's sparse gradients where they have data-dependent shapes: the multi-hot
    EmbeddingBag's (dlrm.train.builder refuses it) and the sharded tables' (dlrm.train.graphed_step refuses them).
    Unchecked, such a variant was built and refused: a "failed" row and a non-zero exit for the comparison, or,
    under torchrun, the end of it."""
    kernels, _, step_graph = VARIANTS[name]
    if step_graph is True and KERNEL_SETS[kernels][0] == "torch":
        if multi_hot:
            return ("the dataset is multi-hot: the torch multi-hot embedding (EmbeddingBag) has sparse gradients with "
                    "data-dependent shapes, which the whole-step CUDA graph cannot replay (a triton-embedding "
                    "step-graph variant can)")
        if distributed:
            return ("several processes with the torch embedding: the sharded tables' sparse gradients have "
                    "data-dependent shapes, which the whole-step CUDA graph cannot replay")
    return None


def unavailable_reason(name: str, device: torch.device, cfg: Optional[Config] = None, multi_hot: bool = False,
                       distributed: bool = False) -> Optional[str]:
    """Why a variant cannot run here, or None. With `cfg`, also why it cannot run this config's model: the variant's
    settings are checked as a config file's are (a Triton interaction for a "cat" model, the Gluon cross layer for a
    dot model, bf16 tables with the torch embedding, the fused MLP with dropout...), since the variants replace the
    config's kernels and compile settings after it was validated; unchecked, such a variant trained with another
    kernel or fp32 tables than its name says, or failed with a traceback. `multi_hot`, `distributed`: see
    `data_reason`, checked first (those variants run on no device)."""
    kernels, mode, step_graph = VARIANTS[name]
    reason = data_reason(name, multi_hot, distributed)
    if reason:
        return reason
    if (mode == "reduce-overhead" or step_graph is True) and device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if kernels.startswith("triton"):
        from kernels import TritonUnavailableError, check_triton_device

        try:
            # (--kernels, which the refusal's usual advice names, is refused with --compare)
            check_triton_device(device, "triton kernels", instead="leave the triton variants out of --compare")
        except TritonUnavailableError as e:
            return str(e)
    if cfg is not None:
        try:
            validate(variant_config(cfg, name))
        except ConfigError as e:
            return str(e)
        if kernels == "auto" and cfg.model.embedding_dtype == "bf16":
            from dlrm.train.fast_path import _triton_usable

            # what dlrm.train.fast_path.resolve_fast_path refuses once the variant is built: bf16 tables need the
            # Triton embedding, which "auto" takes only where Triton runs
            usable, why_not = _triton_usable(device)
            if not usable:
                return (f'model.embedding_dtype "bf16" needs kernels.embedding "triton", which "auto" cannot pick '
                        f"here ({why_not})")
    return None


def max_loss_diff(losses: list, reference: list) -> Optional[float]:
    ref = dict((int(s), l) for s, l in reference)
    diffs = [abs(l - ref[int(s)]) for s, l in losses if int(s) in ref]
    return max(diffs) if diffs else None


def run_comparison(cfg: Config, variants: list[str], train_fn: Callable,
                   results_written: Optional[Callable[[Path], None]] = None) -> list[dict]:
    """Train each variant with `train_fn(cfg, run_dir=...)`; write and print the reports. `results_written(the
    comparison's directory)`: called as its reports are about to be written, once the plot is made (train.py's: a
    signal from then on stops nothing, `dlrm.stop_signal.LateSignals`)."""
    from dlrm.data.schema import is_multi_hot
    from dlrm.distributed.env import init_distributed

    # data.path absolute, as the trainer records it in each variant's run: the comparison's own config.json held it
    # as typed, naming other data (or none) read from another working directory
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=os.path.abspath(cfg.data.path)))
    replaced = replaced_settings(cfg, variants)
    if replaced:
        run_logger.warning(f"--compare: the config's {', '.join(replaced)} replaced by each variant's own (its name "
                           "says its kernels and compile settings)")
    # the dataset's sizes, as the trainer reads them (they win over model.multi_hot_sizes): which variants can run
    # them is decided before any is built; a missing or bad dataset is refused here, before the run directory exists.
    # The comparison's config.json records them, as each variant's does (`as_trained`), not the config file's
    data_dir, meta = load_dataset_metadata(cfg)
    cfg = as_trained(cfg, dataset_tables(cfg, meta, data_dir))
    multi_hot = is_multi_hot(meta.multi_hot_sizes)
    env, device = init_distributed(cfg.distributed, resolve_device(cfg.train.device))
    owned = RunDirectory.create(cfg) if env.is_main else None  # rank 0 writes the reports
    base = env.broadcast_object(owned.path if owned else None)
    try:
        rows = _run_variants(cfg, variants, train_fn, env, device, base, owned, multi_hot, results_written)
    except BaseException as e:  # the base directory is removed only if no variant finished or left a run behind
        if owned:
            # a variant that failed after its first step keeps its own run directory (RunDirectory's rule: it has
            # history, checkpoints perhaps); removing the base directory would remove it with it
            if any((base / name).exists() for name in variants):
                owned.started()
            owned.abandon(e)
        raise
    if owned:
        owned.close()
    return rows


def release_memory(device: Optional[torch.device] = None) -> None:
    """Free what a finished variant may still hold before the next one builds its model: compiled
    graphs (dynamo's caches), reference cycles (a captured step and its CUDA graph pool) and the CUDA
    caching allocator's blocks. Without it benchmarks/train_throughput.py's next case ran out of memory
    on the H100 with the Terabyte tables (27 GB) of the case before still allocated.

    A sweep calls it before each trial (`device` None: the CUDA blocks too, where CUDA was initialized), which then
    runs as train.py alone: kept, the trials before's compiled graphs counted toward Dynamo's recompile limit (once a
    sweep had compiled 8 model structures, every later trial ran eager, said by a torch warning alone), and their
    models, optimizer state and arenas (reference cycles) stayed in memory beside the next trials' own.

    Ctrl-C and SIGTERM wait until it returns: arriving in a weakref callback of the collection (Dynamo's caches hold
    many), the handler's exception was printed as "Exception ignored" and dropped, and a sweep stopped between two
    trials ran all the others and exited 0."""
    with signals_deferred():
        torch._dynamo.reset()
        gc.collect()
        if device is None or device.type == "cuda":
            torch.cuda.empty_cache()  # (a no-op where CUDA was never initialized)


def _run_variants(cfg: Config, variants: list[str], train_fn: Callable, env, device: torch.device, base: Path,
                  owned: Optional[RunDirectory], multi_hot: bool = False,
                  results_written: Optional[Callable[[Path], None]] = None) -> list[dict]:
    from dlrm.train.signals import agreed_stop, run_hold

    rows, summaries, failures = [], {}, []
    name = None
    try:
        # several ranks: a signal is held (after a variant's last agreement too: it was said "ignored" and lost, the
        # next variants trained) for the ranks' agreement after each variant, which stops the comparison on it
        with run_hold(env, then="held until every rank knows, then stopping the comparison after this variant") as held:
            for i, name in enumerate(variants):
                _run_variant(cfg, name, train_fn, env, device, base, owned, multi_hot, rows, summaries, failures)
                if held is None:
                    continue
                last = i + 1 == len(variants)
                held.then = None if last else held.then  # (after the last one's agreement a signal stops nothing)
                with agreed_stop(env, device, "after this variant", lambda signal_name, v=name: (
                        f"{signal_name}: the comparison stopped after variant {v}, once every rank knew (no "
                        "checkpoint written now)"), held, followed=not last, ignored="every variant is done"):
                    pass
    except (TrainingStopped, KeyboardInterrupt) as stop:  # a signal stopped it: the finished variants' report first
        if summaries and env.is_main:
            _write_partial(base, rows, summaries, variants, name, stop, device)
        between = name is not None and any(r["variant"] == name for r in rows)  # (its row made: the next not begun)
        if between and isinstance(stop, TrainingStopped) and str(stop) == stopped_at_once(stop.exit_code - 128):
            # (one process: the signal came as a finished variant's memory was released; it said only "stopped at
            # once, outside the training steps")
            line = (f"{stop_signal_name(stop)}: the comparison stopped after variant {name}, before the next began "
                    "(no checkpoint written now)")
            raise TrainingStopped(stop.exit_code, line) from None
        raise
    _loss_diffs(rows, summaries)
    if failures and not summaries:  # nothing to compare: the first failure, as a single run would end
        raise failures[0]
    if not summaries:  # every variant skipped: nothing ran, which is no comparison (it wrote an empty one, exit 0)
        raise ConfigError("--compare: no variant can run here (" + "; ".join(
            f"{r['variant']}: {r['status'][len('skipped: '):]}" for r in rows) + ")")
    if env.is_main:
        write_reports(base, rows, device, written=results_written)
    elif results_written is not None:  # (the other ranks: rank 0 writes them)
        results_written(base)
    if failures:  # the reports are written: now the non-zero exit
        failed = [r["variant"] for r in rows if r["status"].startswith("failed")]
        logger.error(f"compare: {len(failed)} of {len(variants)} variants failed ({', '.join(failed)}); their rows in "
                     f"{base / 'compare.md'} say why; the first:")
        raise failures[0]
    return rows


def _run_variant(cfg: Config, name: str, train_fn: Callable, env, device: torch.device, base: Path,
                 owned: Optional[RunDirectory], multi_hot: bool, rows: list[dict], summaries: dict,
                 failures: list) -> None:
    """One variant: skipped, failed or trained, its row appended to `rows` (and its summary to `summaries`, its error
    to `failures`). A stop (`TrainingStopped`, KeyboardInterrupt) passes, its row left to `_write_partial`."""
    reason = unavailable_reason(name, device, cfg, multi_hot, env.distributed)
    if reason:
        run_logger.warning(f"compare: skipping {name}: {reason}")
        rows.append({"variant": name, "status": f"skipped: {reason}"})
        return
    logger.info(f"compare: variant {name}")
    try:
        s = train_fn(variant_config(cfg, name), run_dir=base / name)
    except TrainingStopped:  # a signal stopped it (after its checkpoint): stop the comparison
        raise
    except Exception as e:  # (KeyboardInterrupt is no Exception: it stops the comparison)
        if env.distributed:
            raise
        reason = failure_reason(e)
        logger.error(f"compare: variant {name} failed: {reason}; the comparison goes on")
        traceback.clear_frames(e.__traceback__)  # the failed run's model and tensors, freed for the next variant
        failures.append(e)
        rows.append({"variant": name, "status": f"failed: {reason}"})
        release_memory(device)
        return
    # its row before `release_memory`, whose deferred signal would otherwise stop the comparison without this
    # finished variant's numbers
    if owned:
        owned.started()  # a finished variant: the base directory now holds results worth keeping
    summaries[name] = s
    rows.append({
        "variant": name,
        "samples_per_sec": s["samples_per_sec"],
        "warmup_s": s["warmup_s"],
        "wall_s": s.get("wall_s"),
        "peak_memory_mb": s["peak_memory_bytes"] / 2**20 if s["peak_memory_bytes"] is not None else None,
        "final_train_loss": s["final_train_loss"],
        "auc": s["auc"],
        "logloss": s.get("logloss"),  # (not a column: why an AUC is undefined, `metric_text.auc_text`)
        # only a compiled run has graph breaks to count ("auto" may resolve to eager, on a CPU say)
        "graph_breaks": s["compile"]["graph_breaks"] if s["resolved"]["compile"] else None,
        "status": "ok",
    })
    release_memory(device)


def _loss_diffs(rows: list[dict], summaries: dict) -> None:
    """Each finished variant's row gets its largest loss difference from eager's (when eager finished)."""
    eager = summaries.get("eager")
    for row in rows:
        if eager is not None and row["variant"] in summaries:
            row["max_loss_diff_vs_eager"] = max_loss_diff(summaries[row["variant"]]["train_losses"], eager["train_losses"])


def _write_partial(base: Path, rows: list[dict], summaries: dict, variants: list[str], current: Optional[str],
                   stop: BaseException, device: torch.device) -> None:
    """The reports of a comparison a signal stopped (`stop`) while `current` ran (None, or a variant with its row
    already: between two variants): the rows so far, the stopped variant's and those not run, under a line saying it
    is partial. A failure to write them is said in one line; the stop's exit code stays the command's."""
    signal_name = stop_signal_name(stop)
    done = {r["variant"] for r in rows}
    stopped = current if current is not None and current not in done else None
    rows = [dict(r) for r in rows]
    if stopped is not None:
        rows.append({"variant": stopped, "status": f"stopped by {signal_name}"})
    not_run = [v for v in variants if v not in done and v != stopped]
    rows += [{"variant": v, "status": "not run: the comparison was stopped"} for v in not_run]
    _loss_diffs(rows, summaries)
    note = (f"Partial comparison: stopped by {signal_name}" + (f" while variant {stopped} trained" if stopped else "")
            + (f"; not run: {', '.join(not_run)}" if not_run else "") + ".")
    try:
        write_reports(base, rows, device, note)
    except Exception as e:  # (a second SIGTERM's TrainingStopped too; a second Ctrl-C passes: it stops at once)
        logger.error(f"compare: {note} Its reports were not written: {failure_reason(e)}")
        return
    logger.warning(f"compare: {note} The finished variants ({', '.join(summaries)}) are in {base / 'compare.md'}")


def _text(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):  # NaN: a session without its warm-up's end
        # an undefined AUC reads as the other reports write it ("n/a (one class)"), not a plain "n/a"
        return auc_text(row) if key == "auc" and row.get("status") == "ok" else "n/a"
    return fmt.format(value)


def _fmt(row: dict, key: str, fmt: str) -> str:
    # a bare | in a text cell (a failure's reason) would split the Markdown cell
    return _text(row, key, fmt).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    sep = "|" + "|".join(" --- " for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_fmt(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def console_table(rows: list[dict]) -> str:
    """The table for the console: plain columns aligned with spaces, numbers to the right. Markdown's escapes
    (``max \\|loss - eager\\|``, a failure's reason) are right in compare.md but were noise in the log."""
    titles = [title.replace("\\|", "|") for _, title, _ in COLUMNS]
    cells = [[_text(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in [titles, *cells]) for i in range(len(COLUMNS))]
    left = {"variant", "status"}  # text columns; the others are numbers, or "n/a"

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if key in left else v.rjust(w)
                         for v, w, (key, _, _) in zip(values, widths, COLUMNS)).rstrip()

    return "\n".join([line(titles), "  ".join("-" * w for w in widths), *map(line, cells)])


def write_reports(base: Path, rows: list[dict], device: torch.device, partial: Optional[str] = None,
                  written: Optional[Callable[[Path], None]] = None) -> None:
    """compare.md, compare.csv and compare.png in `base`, and the table and plot in its TensorBoard events.
    `partial`: the line of a comparison a signal stopped (`_write_partial`), under compare.md's title and in the log;
    compare.csv says it in its rows' status. `written(base)`: called once the plot is made, as the three files are
    about to be written (`run_comparison`'s `results_written`)."""
    from dlrm.checkpoint import write_files_atomic
    from dlrm.train.reporting import versions

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    table = markdown_table(rows)
    # what produced the numbers, as the benchmarks' reports record it: libraries and the date (UTC)
    made = ", ".join(f"{name} {version}" for name, version in versions().items())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"# Variant comparison: {base.name}\n\n" + (f"**{partial}**\n\n" if partial else "")
            + f"Device: {device_name}; {made}; {date}.\n"
            "Throughput is the steady state: the logging windows after the warm-up steps, their samples over their "
            "seconds. Warm-up: those first training steps (the step's compile); wall: the variant's whole session, "
            "start-up, evaluations (a compiled evaluation compiles at the first) and checkpoints included.\n\n"
            + table + "\n")
    out = io.StringIO(newline="")
    w = csv.DictWriter(out, fieldnames=[k for k, _, _ in COLUMNS])
    w.writeheader()
    for r in rows:
        # a missing or undefined value (NaN: a one-class AUC, no warm-up's end) an empty cell, as in the sweep's CSVs
        w.writerow({k: csv_cell(r.get(k)) for k, _, _ in COLUMNS})
    try:
        png = plot_comparison(rows, f"{base.name} on {device_name}" + (" (partial)" if partial else ""))
        if partial is None:  # a stop a library's catch-all dropped as the plot was made stops the plot all the same
            raise_pending()  # (it was said as a signal after the command finished, exit 0)
    except (TrainingStopped, KeyboardInterrupt) as stop:
        if partial is not None:  # (a second signal, in a stopped comparison's reports: `_write_partial` says it)
            raise
        _write_without_plot(base, text, out.getvalue(), rows, stop)
    if written is not None:  # from here a signal stops nothing: the set, then its events, are written whole (it
        written(base)  # stopped the command at once, "no checkpoint written now", with the reports in place)
    # all three made first, then written as one set: a plot that failed after the table was written left
    # compare.md and compare.csv without compare.png (and an interrupted write, half a file)
    write_files_atomic(base, {"compare.md": text, "compare.csv": out.getvalue(), "compare.png": png})
    log_comparison(base, text, png)
    logger.info(f"{'partial ' if partial else ''}comparison ({base}):\n" + console_table(rows))


def _write_without_plot(base: Path, text: str, csv_text: str, rows: list[dict], stop: BaseException) -> None:
    """A Ctrl-C or SIGTERM (`stop`) while a finished comparison's plot was made (the variants done): the plot step
    stopped, compare.md (saying so) and compare.csv written as a set, complete, without compare.png (no half-written
    plot), then the stop raised as `TrainingStopped` (128 + the signal) whose line says it. Before, one that a
    library's catch-all dropped there was said as having come after the command finished (exit 0), and one that
    stopped the plot left no report of the finished variants, said "stopped at once, outside the training steps (no
    checkpoint written now)". A failure to write them (a second signal's stop too) is said; the stop's code stays."""
    from dlrm.checkpoint import write_files_atomic

    name, code = stop_signal_name(stop), getattr(stop, "exit_code", EXIT_INTERRUPTED)
    note = f"Its plot (compare.png) was not made: {name} stopped it, once the variants were done."
    title_end = text.index("\n\n") + 2
    text = text[:title_end] + f"**{note}**\n\n" + text[title_end:]
    try:
        write_files_atomic(base, {"compare.md": text, "compare.csv": csv_text})
        log_comparison(base, text, None)
    except Exception as e:  # (a second Ctrl-C passes: it stops at once)
        raise TrainingStopped(code, f"compare: {name} stopped the comparison as its plot was made, once the variants "
                                    f"were done: its reports were not written ({failure_reason(e)})") from None
    logger.info(f"comparison ({base}):\n" + console_table(rows))
    line = (f"compare: {name} stopped the comparison's plot, once the variants were done: compare.png not made; the "
            f"table is in {base / 'compare.md'} and compare.csv")
    raise TrainingStopped(code, line) from None


def plot_comparison(rows: list[dict], title: str) -> bytes:
    """Bars of steady-state samples/s and warm-up seconds per variant that ran, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.get("samples_per_sec") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    try:
        names = [r["variant"] for r in ran]
        axes[0].bar(names, [r["samples_per_sec"] for r in ran], color="tab:blue")
        axes[0].set_title("steady-state samples/s (higher is better)")
        axes[1].bar(names, [r["warmup_s"] for r in ran], color="tab:orange")
        axes[1].set_title("warm-up / compile seconds")
        for ax in axes:
            ax.tick_params(axis="x", rotation=20)
        fig.suptitle(title)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
    finally:
        plt.close(fig)
    return png.getvalue()


def log_comparison(base: Path, text: str, png: Optional[bytes]) -> None:
    """The comparison in the parent run's own TensorBoard events (text ``compare/table``, image
    ``compare/plot``; none where the plot was stopped), so TensorBoard shows it next to the variants' runs, offline.
    Rank 0 only.

    Example (a throwaway directory):
        >>> import io, tempfile, matplotlib.image
        >>> png = io.BytesIO(); matplotlib.image.imsave(png, [[[0.0, 0.0, 0.0]]], format="png")  # 1x1 pixel
        >>> with tempfile.TemporaryDirectory() as d:
        ...     log_comparison(Path(d), "| variant |\\n| --- |\\n| eager |", png.getvalue())
        ...     any(p.name.startswith("events.out.tfevents") for p in Path(d).iterdir())
        True
    """
    from dlrm.train.reporting import add_markdown, add_png, open_writer

    # open_writer: a full disk is an OSError naming the event file (a plain SummaryWriter's thread died of it with a
    # traceback, and the error raised here named no file)
    with open_writer(base) as writer:
        add_markdown(writer, "compare/table", text, 0)
        if png is not None:
            add_png(writer, "compare/plot", png, 0)

