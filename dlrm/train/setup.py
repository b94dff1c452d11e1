"""Everything a run needs before its first step: device, seeds, dataset tables (the run directory: run_dir.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from loguru import logger

from dlrm.config import Config, ConfigError
from dlrm.errors import DatasetError
from dlrm.data.schema import NUM_SPARSE, Metadata, read_metadata
from dlrm.data.vocabulary import read_vocabulary, vocab_path
from dlrm.logging_setup import run_logger
from dlrm.model.hashing import VOCABULARY_VALUE_LIMIT


def seed_rank(seed: int, rank: int) -> None:
    """A rank's own torch random stream, once the model is built (its initialization the same on every rank): with
    one seed everywhere the ranks drew the same dropout masks, correlated where one process draws independent ones
    for every sample. Rank 0 (and a one-process run) keeps its stream, unchanged. Each rank's checkpoint shard holds
    its own stream, so a resume continues it."""
    if rank > 0:
        torch.manual_seed(int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0]))


# What CUDA's start maps, measured with benchmarks/address_space_margin.py on an H200 (torch 2.11, session 83):
# configs/sample.json peaked at 22.9 GiB of address space. Under `ulimit -v 16 GB` cudaGetDeviceCount failed with
# "Error 2: out of memory" (a warning torch gives once) and the run said only "CUDA is not available", exit 2.
CUDA_START_GIB = 23


def cuda_held_by_limit() -> str:
    """This process's address-space limits ("ulimit -v 16.0 GiB (RLIMIT_AS)") where they are why CUDA is unavailable
    (a CUDA build of torch, an NVIDIA device node present); "" otherwise."""
    from dlrm.errors import address_limits

    if not torch.backends.cuda.is_built() or not os.path.exists("/dev/nvidiactl"):
        return ""
    return address_limits()


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without it is an error, not a fallback. A GPU that CUDA could
    not start under this process's `ulimit -v`/`-d` is said so: a warning for 'auto' (the run goes on on the CPU),
    for 'cuda' one line naming the limit, exit 4 (`dlrm.cli.out_of_memory_message`)."""
    if name not in ("auto", "cuda") or torch.cuda.is_available():
        return torch.device("cuda" if name == "auto" else name)
    limits = cuda_held_by_limit()
    why = (f"CUDA could not start under this process's limit, {limits} (its start maps address space: {CUDA_START_GIB} "
           "GiB for configs/sample.json on an H200)")
    if name == "auto":
        if limits:
            logger.warning(f"train.device auto: a GPU is present but {why}: training on the CPU; raise the limit "
                           "(ulimit -v unlimited) to train on the GPU")
        return torch.device("cpu")
    if limits:
        exc = MemoryError(f"train.device 'cuda': {why}: raise it (ulimit -v unlimited), or set train.device cpu")
        exc.dlrm_refused = True  # type: ignore[attr-defined]  # said as it is, exit 4
        raise exc
    raise ConfigError("train.device: 'cuda' was requested but CUDA is not available")


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seeds Python, numpy and torch; torch's deterministic algorithms on or off as `train.deterministic` says.

    Off is set too: the mode is process-wide, and a deterministic run earlier in the same process (a notebook, a
    test) would otherwise leave it on, and with it Inductor's deterministic mode, which refuses to time kernels (the
    combo kernels "auto" turns on for bf16 models fail to compile then)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
    elif torch.are_deterministic_algorithms_enabled():
        logger.info("train.deterministic false: torch's deterministic algorithms, left on in this process, turned off")
        torch.use_deterministic_algorithms(False)


@dataclass
class Tables:
    """Embedding table sizes (after any cap) and, for vocabulary hashing, the vocabularies."""

    cardinalities: list[int]
    vocabs: Optional[list[torch.Tensor]]
    hashing: str
    multi_hot_sizes: Optional[list[int]] = None
    """Values per sample of each feature (sum-pooled); None: one each."""
    dense_format: str = "counts"
    """The dataset's `Metadata.dense_format` ("counts" when no dataset is given: what synthetic batches stand for)."""

    @property
    def multi_hot(self) -> bool:
        return self.multi_hot_sizes is not None and any(s != 1 for s in self.multi_hot_sizes)


def dataset_tables(cfg: Config, meta: Optional[Metadata], data_dir: Optional[Path]) -> Tables:
    """Table sizes from the dataset's metadata (capped by data.max_rows_per_table) or the config."""
    if meta is None:
        if cfg.model.cardinalities is None:
            raise ConfigError("model.cardinalities: needed when no dataset is given")
        cards = list(cfg.model.cardinalities)
        hashing = "modulus"
        sizes = cfg.model.multi_hot_sizes
    else:
        cards = list(meta.cardinalities)
        hashing = meta.hashing
        sizes = list(meta.multi_hot_sizes)
        if cfg.model.multi_hot_sizes is not None and list(cfg.model.multi_hot_sizes) != sizes:
            run_logger.warning(f"model.multi_hot_sizes: the dataset's metadata says {sizes}; training with those")
    vocabs = None
    if hashing == "vocabulary":
        check_table_cap(cfg, meta, data_dir)
        # Each file is read and checked once here (plain .npy, 1-D integers, sorted, unique, and
        # as long as its cardinality): an unsorted vocabulary trains, silently misplacing values.
        vocabs = [torch.from_numpy(read_vocabulary(data_dir, f, cards[f])) for f in range(NUM_SPARSE)]
        for f, v in enumerate(vocabs):  # the hashing's keys hold 32-bit values (a traceback from its build else)
            if v.numel() and not (int(v[0]) >= -VOCABULARY_VALUE_LIMIT and int(v[-1]) < VOCABULARY_VALUE_LIMIT):
                raise DatasetError(f"{vocab_path(data_dir, f)}: values {int(v[0])}..{int(v[-1])} lie outside "
                                   "[-2**32, 2**32), the 32-bit hashes a vocabulary holds (a damaged file?)")
    elif cfg.data.max_rows_per_table is not None:
        cards = [min(c, cfg.data.max_rows_per_table) for c in cards]
    return Tables(cards, vocabs, hashing, list(sizes) if sizes is not None else None,
                  meta.dense_format if meta is not None else "counts")


def check_table_cap(cfg: Config, meta: Metadata, data_dir: Optional[Path]) -> None:
    """Refuse ``data.max_rows_per_table`` below a table of a vocabulary-hashed dataset (`meta`, of `data_dir`), from
    its metadata alone (`dataset_tables`; a sweep's settings before their first trial, `dlrm.sweep_checks`)."""
    if meta.hashing != "vocabulary":
        return
    cards, cap = list(meta.cardinalities), cfg.data.max_rows_per_table
    # A cap no table exceeds changes nothing, so it is accepted: configs/terabyte.json (10M) was refused with
    # every vocabulary dataset, though README says any config trains on any dataset (`--data DIR`). Only a
    # table above the cap is refused: a vocabulary's rows cannot be folded as modulus hashing folds them.
    over = [f for f, c in enumerate(cards) if cap is not None and c > cap]
    if over:
        f = over[0]
        raise ConfigError(f"data.max_rows_per_table: cannot cap tables of a vocabulary-hashed dataset "
                          f"({data_dir}: SPARSE_{f} has {cards[f]:,} rows > {cap:,}; raise or remove the cap, "
                          "or preprocess with a higher --min-frequency)")


def as_trained(cfg: Config, tables: Tables) -> Config:
    """`cfg` with ``model.cardinalities`` and ``model.multi_hot_sizes`` set to the run's `tables` (`dataset_tables`:
    the dataset's, capped by data.max_rows_per_table), which win over the config's. A run records this config
    (config.json, summary.json's config, every checkpoint's): it held the config file's sizes (null, or the published
    Kaggle ones of configs/kaggle.json) beside a model trained on others, and runs compared by it looked alike or apart
    by sizes none of them trained. A resume does not compare them (`dlrm.train.resume_policy.DATASET_KEYS`): the
    checkpoint's own sizes are compared with the data's (`dlrm.checkpoint.check_compatible`)."""
    sizes = list(tables.multi_hot_sizes) if tables.multi_hot_sizes is not None else None
    model = dataclasses.replace(cfg.model, cardinalities=list(tables.cardinalities), multi_hot_sizes=sizes)
    return dataclasses.replace(cfg, model=model)


def load_dataset_metadata(cfg: Config) -> tuple[Path, Metadata]:
    from dlrm.path_checks import check_path

    # (a sweep's --set data.path too: is_dir raised ENAMETOOLONG, "a bug"; afile/x was "does not exist")
    check_path("data.path", cfg.data.path, under_file=True)
    data_dir = Path(cfg.data.path)
    if not data_dir.is_dir():
        state = "is not a directory" if data_dir.exists() else "does not exist"
        raise ConfigError(f"data.path: {str(data_dir)!r} {state} (make a dataset with `python -m dlrm.data.synthetic`, "
                          "`python -m dlrm.preprocess` or `python -m dlrm.data.mlperf_import`, see data/README.md; "
                          "`--data DIR` trains on another)")
    return data_dir, read_metadata(data_dir)


def dataset_held(cfg: Config):
    """A context holding ``data.path`` for reading (`dlrm.data.output_dirs.dataset_read_lock`) for as long as a run
    reads it: a generator's (or relayout's, an import's) ``--overwrite`` of it replaced the dataset under the run, whose
    later epochs trained on the new rows without a word. A tool writing it meanwhile refuses this run in one line."""
    from dlrm.data.output_dirs import dataset_read_lock  # (click: not needed by the rest of this module)

    return dataset_read_lock(Path(cfg.data.path), "data.path", ConfigError)


class DatasetHolds(contextlib.ExitStack):
    """Runs in one process one after another (a sweep's trials): each run's ``data.path`` held for reading
    (`dataset_held`) from the first run on it until the last has finished. Held per run only, a tool's
    ``--overwrite`` between two trials replaced the dataset, and the later trials trained on other rows than the
    earlier ones they are compared with, without a word."""

    def __init__(self) -> None:
        super().__init__()
        self._held: set[str] = set()

    def hold(self, cfg: Config) -> None:
        real = os.path.realpath(cfg.data.path)
        if real not in self._held:
            self.enter_context(dataset_held(cfg))
            self._held.add(real)


def check_device_rules(cfg) -> None:
    """The refusals only the device decides (`resolve_device`, `resolve_fast_path`, `build_model`'s kernel checks),
    made for a sweep's every setting before its first trial: made by a trial's run, they ended the sweep, or failed
    each trial, after the trials before had trained (`--device cpu --set model.embedding_dtype=fp32,bf16`: "auto"
    takes the torch embedding on a CPU, which bf16 tables cannot use)."""
    from dlrm.train.fast_path import _triton_usable, fp32_tables_note

    device = resolve_device(cfg.train.device)  # cuda asked for without CUDA: its one-line error
    if cfg.model.embedding_dtype == "bf16" and cfg.kernels.embedding == "auto":
        usable, why_not = _triton_usable(device)
        if not usable:
            raise ConfigError(f'model.embedding_dtype: "bf16" needs kernels.embedding "triton", which "auto" cannot '
                              f"pick here ({why_not}): use fp32 tables" + fp32_tables_note(cfg))
    chosen = {k: getattr(cfg.kernels, k) for k in ("embedding", "interaction", "mlp", "loss")}
    asked = [f'kernels.{k} "{v}"' for k, v in chosen.items() if v in ("triton", "fused", "wgrad", "gluon")]
    if asked:
        from kernels import TritonUnavailableError, check_triton_device

        try:
            check_triton_device(device, " and ".join(asked) + " (Triton kernels)")
        except TritonUnavailableError as e:
            raise ConfigError(str(e)) from None
    if chosen["interaction"] == "gluon":
        from kernels.cross_ws_op import gluon_hopper_available

        if not gluon_hopper_available(device):
            raise ConfigError(f'kernels.interaction: "gluon" needs a Hopper GPU (sm_90) and a Triton with Gluon\'s '
                              f"Hopper dialect; {device} is not one")
