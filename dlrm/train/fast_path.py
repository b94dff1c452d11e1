"""Resolve every "auto" in the config to the fastest path measured correct on the run's device.

The one place that turns ``kernels.* = "auto"``, ``train.compile = "auto"`` and
``train.cuda_graph = "auto"`` into concrete choices, each with its reason, logged in one line and
recorded in summary.json (``fast_path``). Explicit settings are kept as they are (and validated by
`dlrm.config.validate`, which refuses combinations that cannot run).

What "auto" picks, and why (numbers in benchmarks/results/ and PERF.md):

* On CUDA: the Triton embedding (hashing + lookup in one kernel, the sparse optimizer fused into its
  backward: no COO gradient, static shapes) and the Triton dot interaction (the eager one runs tiny
  batched GEMMs off the tensor cores); PyTorch MLPs (cuBLAS beats the Triton linear kernel at DLRM
  shapes; the fused MLP, kernels.mlp.FusedMLP, only where compile mode default runs tf32 from batch
  65536, where it won by 5%; in compiled bf16 runs from batch 8192 the PyTorch MLPs whose weight and
  bias gradients come from one Triton GEMM each, kernels.wgrad: +1.5% to +8%); the PyTorch loss
  (Inductor fuses it into the compiled step);
  ``torch.compile``: mode default, and from batch 65536 in runs planned for at least 1M steps
  Inductor's max-autotune without its own CUDA graphs (Triton GEMM templates with fused epilogues where
  they beat cuBLAS: +2% to +13% on four models, for 2.5-5 minutes of autotuning at the first steps, which
  shorter runs do not win back); the whole step in one CUDA graph whenever the run
  allows it (one process, a fused SGD or Adam dense optimizer or Adagrad
  (dlrm.train.adagrad.CapturableAdagrad), no compile mode with CUDA graphs of its own): at batch 128 it
  turned 2.8 ms of host time per step into one launch. This is the
  ``triton-embedding-interaction+step-graph`` variant (``...+autotune+step-graph`` in those long runs at
  batch 65536), the fastest in every throughput table so far. In compiled bf16 one-hot dot runs below batch 65536,
  Inductor's combo kernels (autocast's weight casts and other small kernels as one launch: +1.5% to +11.5%).
  Where the step graph is off (one process, one-hot tables), ``train.compile.mode`` "auto" takes
  torch.compile's reduce-overhead mode (its own CUDA graphs of the forward and the backward), since
  mode default is host-bound below batch ~16384.
* On the CPU: PyTorch everywhere, eager. Triton would run in its interpreter, and compiling the
  step costs about a minute of warm-up on a small CPU for little gain.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional

import torch
from loguru import logger

from dlrm.config import COMPILE_MODES_WITH_CUDA_GRAPHS, Config
from dlrm.logging_setup import run_logger

COMPONENTS = ("embedding", "interaction", "mlp", "loss")
# kernels.mlp "auto" takes the fused MLP for tf32 from this batch size: measured +5% at 65536 and -1% at
# 2048 (results/train_throughput_kaggle_fusedmlp.md), +14% (Kaggle) and +12% (Terabyte) at 65536 in the thirteenth
# run (results/autopick_seventeenth.md) and again in the fourteenth (+15%, +12%; results/autopick.md); bf16 lost at
# both (-14% at 65536). Not under an explicit max-autotune, whose
# templates fuse the epilogues themselves; "auto" keeps mode default for it (the two measured the same, below).
FUSED_MLP_MIN_BATCH = 65536
# train.compile.mode "auto" takes max-autotune-no-cudagraphs inside the whole-step graph from this batch size:
# Inductor benchmarks its Triton GEMM templates (bias and ReLU fused as epilogues) against cuBLAS per shape.
# At 65536 on the H100, against the fastest variant before (2026-11-24, results/train_throughput_*_autotune.md,
# mlperf_dcnv2_autotune.md): Kaggle bf16 42.2M vs 37.3M (+13%), Kaggle tf32 23.4M vs the fused MLP's 22.0M (+6%),
# Terabyte bf16 14.6M vs 13.6M (+7.5%), MLPerf DLRM-DCNv2 2.77M vs 2.72M (+2%); eval AUC as eager's on planted
# data (compare_kaggle_b2048_bf16_autotune.md). The price: 2.5 to 5 minutes of autotuning at the first steps
# (Inductor caches the picks on the machine: a second start of max-autotune-gemm warmed up in 2.4 s,
# results/autotune_gemm.md). At batch 16384 the GEMM templates gained 9-13% but saved only 0.07-0.08 ms a step,
# repaid after 1-2M steps: mode default there.
# The autotuning repays itself only in a long run: the step-time savings above (0.18-0.46 ms a step) cover
# 170-300 s of autotuning after 0.4M (MLPerf) to 1M (Kaggle tf32) steps, i.e. 27-66 billion samples at 65536.
# So "auto" takes it only for runs planned that long; shorter ones (a few epochs of Criteo, one of MLPerf)
# finish sooner in mode default, and an explicit train.compile.mode takes it for any run. Not in tf32 where the fused
# MLP applies: since the fused MLP's 26.57M (2026-11-25, results/autopick_seventeenth.md) the templates' 26.59M gain
# nothing.
# kernels.mlp "auto" takes the wgrad MLPs (kernels.wgrad) for compiled bf16 runs from this batch size. Against PyTorch
# MLPs in the same process, H100, whole-step graph, combo kernels as "auto" sets them (2026-11-25,
# results/wgrad_threshold.md): Kaggle -8.1% at 2048, 0.0% at 4096, +4.9% at 8192, +4.7% at 16384, +5.5% at 32768,
# +8.0% at 65536 (+5.1% with max-autotune); Terabyte +2.1% at 8192, +1.7% at 16384, +1.5% at 32768, +2.4% at 65536.
# In tf32 its layers keep PyTorch's backward (the kernel lost 33% there). Eager runs keep PyTorch MLPs
# (results/wgrad_fused_bias_mask.md). The multi-hot / DCN models keep PyTorch MLPs too: on MLPerf DLRM-DCNv2 at
# 65536 the wgrad MLPs measured +0.2% to +0.9% in five pairs on the H100 but -0.9% and -2.3% in two pairs on an
# H200 (2026-11-25, results/mlperf_dcnv2_wgrad.md): no clear win on both.
WGRAD_MIN_BATCH = 8192
# kernels.mlp "auto" takes the fused MLP beside the Gluon cross layers (the DCN models on Hopper in bf16) from this
# batch size. MLPerf DLRM-DCNv2 on the H100, alternating in one process with PyTorch MLPs (2026-11-25,
# results/mlperf_dcnv2_fusedmlp*.md): at 65536 20.51 and 20.22 ms against 20.95 and 20.87 (+2.2%, +3.2%), at 55296
# +1.4-1.8%, at 32768 +1.0-1.4%, at 16384 no difference (5.64-5.67 against 5.65-5.67 ms). cuBLASLt's bias+ReLU
# epilogue saves the forward's ReLU passes (0.39 ms at 65536) and one Triton pass a layer takes the ReLU mask and the
# bias gradient (Inductor's bias sums re-read the gradient). On an H200 at 65536 within the run-to-run spread
# (19.31/19.44 against 19.28/19.60 ms, results/mlperf_dcnv2_h200_twentyfirst.md).
DCN_FUSED_MLP_MIN_BATCH = 32768
AUTOTUNE_MIN_BATCH = 65536
# train.compile.combo_kernels "auto" is on below this batch size for one-hot dot models, up to it for multi-hot DCN
# models (_combo_kernels)
COMBO_KERNELS_MAX_BATCH = 65536
AUTOTUNE_MIN_STEPS = 1_000_000
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"
# the modes in which Inductor's GEMM templates replace the fused MLP (kernels.mlp "auto" keeps PyTorch MLPs)
TEMPLATE_MODES = ("max-autotune", "max-autotune-no-cudagraphs", "max-autotune-gemm")


def fp32_tables_note(cfg) -> str:
    """What fp32 tables would take, for the advice to use them, where that is 8 GiB or more: configs/mlperf-dcnv2.json
    on a CPU was told "use fp32 tables", which then ran out of memory building 97 GiB of them."""
    cards = cfg.model.cardinalities
    if not cards:
        return ""
    cap = cfg.data.max_rows_per_table
    rows = sum(min(c, cap) if cap else c for c in cards)
    size = rows * cfg.model.embedding_dim * 4
    if size < 8 * 2**30:
        return ""
    return (f" (fp32 tables of {rows:,} rows x {cfg.model.embedding_dim} take {size / 2**30:,.1f} GiB: cap them with "
            "data.max_rows_per_table, or train on a GPU)")


def _triton_usable(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"no CUDA device ({device})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, ""


def _kernel_choice(component: str, cfg: Config, device: torch.device, multi_hot: bool = False) -> tuple[str, str]:
    usable, why_not = _triton_usable(device)
    if component == "embedding":
        return ("triton", "fused hashing, lookup and sparse update") if usable else ("torch", why_not)
    if component == "interaction":
        if cfg.model.interaction == "dcn" and usable and cfg.train.precision == "bf16":
            from kernels.cross_ws_op import gluon_hopper_available

            if gluon_hopper_available(device):
                return "gluon", ("the Gluon cross layer (GEMM and x0 * (. + b) + x in one warp-specialized kernel "
                                 "took 0.71-0.74 ms a layer against 0.93 for cuBLAS + Inductor at MLPerf DLRM-DCNv2's "
                                 "shapes on an H100: the step +2.5-2.7%; the network's backward as one op of cuBLAS "
                                 "GEMMs and Triton passes, +2.2-2.7%)")
        # without a GPU that is the reason, as for the dot (a dcn run on the CPU was told the cross layer measured slower)
        if cfg.model.interaction != "dot" and usable:
            return "torch", (f"the Triton dot kernel is for the dot interaction, not {cfg.model.interaction!r} (dcn's Triton "
                             "cross layer, kernels.interaction \"triton\", measured slower than the compiled torch one: "
                             "40.9 vs 37.1 ms an MLPerf DLRM-DCNv2 step; the Gluon one needs a Hopper GPU and bf16)")
        return ("triton", "the eager dot's small batched GEMMs miss the tensor cores") if usable else ("torch", why_not)
    if component == "mlp":
        if not usable:
            return "torch", why_not
        m = cfg.model
        # the run's tables (the dataset's sizes win over model.multi_hot_sizes, dlrm.train.setup.dataset_tables)
        one_hot_dot = m.interaction == "dot" and not multi_hot
        if (cfg.train.precision == "bf16" and cfg.data.batch_size >= WGRAD_MIN_BATCH and m.activation == "relu"
                and cfg.train.compile.enabled and one_hot_dot):
            return "wgrad", ("kernels.wgrad (the ReLU mask and bias gradients fused into Triton weight-gradient GEMMs) "
                             f"won bf16 from batch {WGRAD_MIN_BATCH}: Kaggle +4.7% to +8.0%, Terabyte +1.5% to +2.4%")
        if (cfg.kernels.interaction == "gluon" and cfg.train.precision == "bf16" and m.activation == "relu"
                and not m.dropout and cfg.data.batch_size >= DCN_FUSED_MLP_MIN_BATCH
                and cfg.train.compile.mode not in TEMPLATE_MODES):
            return "fused", ("kernels.mlp.FusedMLP (cuBLASLt bias+ReLU epilogues, one pass for the ReLU mask and bias "
                             "gradient, weight gradients in series in bf16) beside the Gluon cross layers: MLPerf "
                             "DLRM-DCNv2 +1.0-3.2% on an H100 from batch 32768")
        if cfg.train.compile.enabled and cfg.train.compile.mode in TEMPLATE_MODES:
            return "torch", ("Inductor's max-autotune GEMM templates fuse the MLPs' epilogues (Kaggle tf32 at 65536: "
                             "23.4M samples/s against the fused MLP's 22.0M)")
        if (cfg.train.precision == "tf32" and cfg.data.batch_size >= FUSED_MLP_MIN_BATCH and m.activation == "relu"
                and not m.dropout):
            return "fused", ("kernels.mlp.FusedMLP (cuBLASLt bias+ReLU epilogues, weight gradients on a side stream) "
                             f"won tf32 at batch {FUSED_MLP_MIN_BATCH} (Kaggle +15%, Terabyte +12%)")
        return "torch", ("cuBLAS beats the Triton linear kernel at DLRM shapes, and the fused MLP (kernels.mlp "
                         "\"fused\") won only tf32 at batch 65536 (+12-15%; bf16 -14%, tf32 at 2048 -1%)")
    return "torch", "fused into the compiled step by Inductor" if usable else why_not


def _cuda_graph_blocker(cfg: Config, device: torch.device, distributed: bool, multi_hot: bool = False) -> str:
    """Why the whole-step CUDA graph cannot run here ("" when it can)."""
    if device.type != "cuda":
        return f"no CUDA device ({device})"
    if distributed and cfg.kernels.embedding != "triton":
        return "several processes with the torch embedding (the sharded tables' sparse gradients have data-dependent shapes)"
    if distributed and cfg.distributed.backend == "gloo":
        return "several processes on the gloo backend (only NCCL's collectives can be captured)"
    # several processes with the Triton embedding: the collectives are captured too (dlrm.train.graphed_step); on
    # two H200s (2026-11-28, results/mlperf_dcnv2_two_gpus.md) Kaggle trained at 38.7M samples/s against 12.5M
    # without the graph (host-bound), MLPerf DLRM-DCNv2 (table-wise shards) at 5.68M against 5.50M
    if multi_hot and cfg.kernels.embedding == "torch":
        return "the torch multi-hot embedding (EmbeddingBag) has sparse gradients with data-dependent shapes"
    if cfg.kernels.embedding == "torch" and not cfg.train.compile.enabled:
        return "kernels.embedding is torch without train.compile (its sparse gradients have data-dependent shapes)"
    if cfg.optim.dense.name == "adagrad":
        if cfg.optim.dense.fused is True:
            return "optim.dense.fused is true with Adagrad (torch's fused Adagrad runs on the CPU only)"
        # else dlrm.train.adagrad.CapturableAdagrad: its captured step trains exactly like the ordinary
        # one on the H100 (tests/test_graphed_step.py, tests/test_multihot_graphed.py, 2026-11-24)
    elif cfg.optim.dense.name not in ("sgd", "adam") or cfg.optim.dense.fused is False:
        return f"the dense optimizer ({cfg.optim.dense.name}, fused {cfg.optim.dense.fused}) is not a fused SGD or Adam"
    if cfg.train.compile.enabled and cfg.train.compile.mode in COMPILE_MODES_WITH_CUDA_GRAPHS:
        return f"train.compile.mode is {cfg.train.compile.mode} (CUDA graphs of its own)"
    return ""


def _compile_mode(cfg: Config, device: torch.device, distributed: bool, multi_hot: bool,
                  total_steps: Optional[int] = None) -> tuple[str, str]:
    """torch.compile's mode for `train.compile.mode: "auto"`, and why (after train.cuda_graph is resolved).

    Mode default leaves every kernel launch to the host: at batch 8192 the compiled Kaggle step
    spends 3.0 ms of host time to enqueue 0.83 ms of device work (results/compile_host_bound_b8192.md),
    and reduce-overhead (torch.compile's own CUDA graphs) doubled its rate (2.27x eager, against 1.22x).
    Where the whole step is already one graph, or where reduce-overhead was not measured (several
    processes, multi-hot tables), mode default stays."""
    if device.type != "cuda":
        return "default", f"no CUDA device ({device}) for reduce-overhead's CUDA graphs"
    if cfg.train.cuda_graph and cfg.data.batch_size >= AUTOTUNE_MIN_BATCH:
        m = cfg.model
        if (cfg.train.precision == "tf32" and cfg.kernels.mlp in ("auto", "fused") and m.activation == "relu"
                and not m.dropout and not multi_hot and m.interaction == "dot"):
            # the fused MLP (kernels.mlp "auto" in mode default) trained Kaggle tf32 at 65536 at 26.57M samples/s,
            # the autotuned templates at 26.57-26.59M (2026-11-25, results/autopick_seventeenth.md): nothing to
            # autotune for
            return "default", ("the whole step is one CUDA graph already, and in tf32 the fused MLP in mode default "
                               "matched max-autotune's templates (Kaggle at 65536: 26.57M against 26.59M samples/s) "
                               "without 2.5-5 minutes of autotuning")
        if total_steps is not None and total_steps >= AUTOTUNE_MIN_STEPS:
            return AUTOTUNE_MODE, (f"Inductor's autotuned GEMM templates beat mode default at batch {AUTOTUNE_MIN_BATCH} "
                                   "(+2% to +13% on four models); the first steps autotune for 2.5-5 minutes, repaid "
                                   f"within this run's {total_steps:,} steps")
        return "default", (f"the whole step is one CUDA graph already; {AUTOTUNE_MODE} (+2% to +13% at batch "
                           f"{AUTOTUNE_MIN_BATCH}) would autotune for 2.5-5 minutes, repaid only from ~{AUTOTUNE_MIN_STEPS:,} "
                           f"steps ({'unknown' if total_steps is None else f'{total_steps:,}'} planned; a second start on "
                           "this machine reuses Inductor's cached picks): set train.compile.mode to take it")
    if cfg.train.cuda_graph:
        return "default", "the whole step is one CUDA graph already"
    if distributed:
        return "default", "several processes (reduce-overhead not measured with collectives)"
    if multi_hot:
        return "default", "multi-hot tables (reduce-overhead not measured there)"
    return "reduce-overhead", "without the whole-step graph, mode default is host-bound at small batches"


def _combo_kernels(cfg: Config, device: torch.device, distributed: bool, multi_hot: bool) -> tuple[bool, str]:
    """`train.compile.combo_kernels: "auto"`, and why.

    On for compiled bf16 one-hot dot models on one CUDA process below batch COMBO_KERNELS_MAX_BATCH: Inductor then
    generates independent small kernels (autocast's weight casts above all) as one launch, which pays where launches
    are a large share of the step. Off vs on in the same call, H100 (2026-11-25, results/combo_kernels.md), Kaggle
    bf16: 0.854M -> 0.952M samples/s at batch 128 (+11.5%), 9.68M -> 10.78M and 9.70M -> 10.48M at 2048 (+11.4%,
    +8.0%), 22.6M -> 24.4M at 8192 (+8.0%), 31.9M -> 33.8M at 16384 (+5.8%); Terabyte bf16 at 32768 14.82M -> 15.04M
    (+1.5%). At 65536 it measured -0.7% to +2.3% on three machines (10 fewer kernels, slightly longer ones), and tf32
    (no casts) the same at 128, 2048 and 65536: those keep Inductor's default. Multi-hot DCN models (MLPerf
    DLRM-DCNv2) on one process: on up to batch 65536; there, on an H200 (2026-11-28, twenty-fourth run,
    results/combo_kernels_mlperf.md), the step's Inductor kernels (autocast's 14 weight and gradient casts among them)
    went from 17 distinct ones to 4 (0.114 -> 0.064 ms) and the step took 17.65-17.69 ms against 17.71-17.89 (three
    interleaved pairs, -0.45%
    at the medians); its smaller batches were not measured (combo kernels gained more at the one-hot models' smaller
    batches). On two H200s (two ranks, results/combo_kernels_mlperf_2gpu.md) the same change was within the spread
    (20.42 / 20.70 ms with, 20.60 / 20.51 without): off on several processes. One-hot DCN models were not measured."""
    m = cfg.model
    if device.type != "cuda":
        return False, f"no CUDA device ({device})"
    if cfg.train.deterministic:  # torch.use_deterministic_algorithms turns Inductor's deterministic mode on too
        return False, "train.deterministic: Inductor keeps a combo only where it times faster, and times nothing then"
    if cfg.train.precision == "tf32":
        return False, "measured the same in tf32, which has no weight casts to merge: Kaggle at 128, 2048 and 65536"
    if cfg.train.precision != "bf16":
        return False, f"measured in bf16 only, not {cfg.train.precision}"
    if distributed:
        return False, "on one process only (within the run-to-run spread on two ranks of MLPerf DLRM-DCNv2)"
    if multi_hot and m.interaction == "dcn":
        if cfg.data.batch_size > COMBO_KERNELS_MAX_BATCH:
            return False, f"multi-hot DCN models measured up to batch {COMBO_KERNELS_MAX_BATCH} only"
        return True, ("autocast's weight and gradient casts merged (Inductor's 17 kernels became 4): MLPerf DLRM-DCNv2 "
                      "at batch 65536 on an H200 -0.45% a step (17.68 against 17.76 ms, interleaved)")
    if multi_hot or m.interaction != "dot":
        return False, "measured on one-hot dot models and multi-hot DCN models only"
    if cfg.data.batch_size >= COMBO_KERNELS_MAX_BATCH:
        return False, (f"from batch {COMBO_KERNELS_MAX_BATCH} it measured -0.7% to +2.3% on three machines (launches are "
                       "a small share of the step there)")
    return True, ("autocast's weight casts and other small independent kernels in one launch: bf16 +1.5% for Terabyte "
                  "at 32768 to +11.5% for Kaggle at 128")


def resolve_fast_path(cfg: Config, device: torch.device, distributed: bool = False,
                      multi_hot: bool = False, total_steps: Optional[int] = None) -> tuple[Config, dict[str, Any]]:
    """A copy of `cfg` with no "auto" left, and ``{key: {"value": ..., "why": ...}}`` for what was chosen.

    Args:
        cfg: the validated config (not modified).
        device: the run's device.
        distributed: more than one process.
        multi_hot: the tables pool several values per feature (the dataset's or the config's sizes).
        total_steps: the run's planned length (None: unknown), which decides whether autotuning pays off.

    Example:
        >>> from dlrm.config import Config, validate
        >>> resolved, chosen = resolve_fast_path(validate(Config()), torch.device("cpu"))
        >>> resolved.kernels.embedding, resolved.train.compile.enabled, resolved.train.cuda_graph
        ('torch', False, False)
        >>> resolved.train.compile.mode
        'default'
    """
    out = copy.deepcopy(cfg)
    chosen: dict[str, Any] = {}
    # the MLPs last: their choice depends on the compile mode, which depends on the embedding's
    for component in ("embedding", "interaction", "loss"):
        if getattr(out.kernels, component) == "auto":
            value, why = _kernel_choice(component, out, device)
            setattr(out.kernels, component, value)
            chosen[f"kernels.{component}"] = {"value": value, "why": why}
    if out.model.embedding_dtype == "bf16" and out.kernels.embedding != "triton":
        from dlrm.config import ConfigError

        raise ConfigError(f'model.embedding_dtype: "bf16" needs kernels.embedding "triton", which "auto" cannot pick '
                          f"here ({chosen.get('kernels.embedding', {}).get('why', 'set to torch')}): use fp32 tables"
                          + fp32_tables_note(out))
    if out.train.compile.enabled == "auto":
        on = device.type == "cuda"
        out.train.compile.enabled = on
        chosen["train.compile"] = {"value": on, "why": "Inductor fuses the dense part on CUDA" if on else
                                   "eager on the CPU (compiling costs about a minute of warm-up for little gain)"}
        # the settings of a compiled run, set in a file that runs on both devices: told where "auto" runs eager (a
        # max-autotune mode there was dropped without a word); explicit false with them is dlrm.config_checks'
        unused = [f"{key} {json.dumps(value)}" for key, value, default in (
            ("mode", cfg.train.compile.mode, "auto"), ("fullgraph", cfg.train.compile.fullgraph, False),
            ("combo_kernels", cfg.train.compile.combo_kernels, "auto")) if value != default]
        if not on and unused:
            run_logger.warning(f"train.compile: {', '.join(unused)} set, but train.compile \"auto\" runs eager on "
                               f"{device.type}: ignored")
    if out.train.cuda_graph == "auto":
        blocker = _cuda_graph_blocker(out, device, distributed, multi_hot)
        out.train.cuda_graph = not blocker
        chosen["train.cuda_graph"] = {"value": not blocker, "why": blocker or "one graph launch per step"}
    if out.train.compile.mode == "auto":
        mode, why = _compile_mode(out, device, distributed, multi_hot, total_steps)
        out.train.compile.mode = mode
        if out.train.compile.enabled:  # a mode of an eager run is not worth a clause in the log line
            chosen["train.compile.mode"] = {"value": mode, "why": why}
    if out.train.compile.combo_kernels == "auto":
        on, why = _combo_kernels(out, device, distributed, multi_hot) if out.train.compile.enabled else (False, "")
        out.train.compile.combo_kernels = on
        if out.train.compile.enabled:
            chosen["train.compile.combo_kernels"] = {"value": on, "why": why}
    if out.kernels.mlp == "auto":
        value, why = _kernel_choice("mlp", out, device, multi_hot)
        out.kernels.mlp = value
        chosen["kernels.mlp"] = {"value": value, "why": why}
    if chosen:  # one line: settings that share a reason share its clause
        by_why: dict[str, list[str]] = {}
        for key, v in chosen.items():
            by_why.setdefault(v["why"], []).append(f"{key}={v['value']}")
        logger.info(f"auto on {device.type}: " + "; ".join(f"{', '.join(keys)} ({why})" for why, keys in by_why.items()))
    return out, chosen
