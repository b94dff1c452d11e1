"""The stream loader's per-epoch shuffle generator, and what a checkpoint records of it.

Epoch `e` of ``train.seed`` `s` used to come from ``np.random.default_rng([s, e])``. numpy's SeedSequence turns
each int into its 32-bit words and pads its 4-word pool with zero words, so a seed >= 2**32 (two words, lo and hi)
made ``[lo, hi, e]``, and at epoch 0 ``[lo, hi, 0]``, the same entropy as ``[lo, hi]``: seed ``lo + hi * 2**32``'s
epoch 0 shuffled exactly as seed lo's epoch hi. Seeds below 2**32 keep that generator (``[s, e]`` is one-to-one over
them, and their runs and checkpoints keep their batches, bit for bit); a seed >= 2**32 draws from
``SeedSequence(s, spawn_key=(e,))``, whose entropy (the seed's words padded to the 4-word pool, then the epoch's)
holds at least 5 words: never one of the 2- or 3-word entropies of the seeds below, one-to-one over the seeds above.

Checkpoints of a seed >= 2**32 record ``shuffle_scheme`` (`SHUFFLE_SCHEME`); one without it was written by a version
that shuffled such a run otherwise, and `check_resumed_shuffle` refuses to resume it on other batches silently.
Checkpoints of the seeds below record nothing: their batches did not change, and older versions still read them.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from dlrm.errors import ConfigError
from dlrm.logging_setup import run_logger

SHUFFLE_SCHEME = 2
"""The stream loader's shuffle for seeds >= 2**32 (1, never written: ``default_rng([seed, epoch])`` for every seed)."""

_WORD_SEEDS = 2**32  # seeds of one 32-bit word: the generator they always had


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator of epoch `epoch`'s row-group order and buffer permutations (`ParquetLoader`)."""
    if 0 <= seed < _WORD_SEEDS:
        return np.random.default_rng([seed, epoch])
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(epoch,)))


def shuffle_scheme(seed: int) -> dict[str, int]:
    """A checkpoint's ``shuffle_scheme`` entry for a run of `seed` (none below 2**32, see the module docstring)."""
    return {"shuffle_scheme": SHUFFLE_SCHEME} if seed >= _WORD_SEEDS else {}


def check_resumed_shuffle(cfg: Any, state: dict[str, Any], placement: str, allowed: Iterable[str],
                          source: object) -> None:
    """Refuse, in one line, to resume checkpoint `source` (`state`) of a shuffled stream-loader run of a seed
    >= 2**32 written before `SHUFFLE_SCHEME` (no ``shuffle_scheme``): this version would train its remaining epochs
    on other batches than the run would have. ``--allow-config-change data.shuffle`` (or ``data``) lets it go on
    with this version's; a resume with another train.seed (allowed) or another placement trains on others anyway."""
    seed = cfg.train.seed
    saved = state.get("config")
    saved = saved.get("train") if isinstance(saved, dict) else None
    if ("shuffle_scheme" in state or seed < _WORD_SEEDS or not isinstance(saved, dict) or saved.get("seed") != seed
            or not cfg.data.shuffle or placement != "stream" or state.get("data_placement") not in (None, "stream")):
        return
    if any(k in ("data", "data.shuffle") for k in allowed):
        run_logger.warning(f"--resume: train.seed {seed} (>= 2**32): the checkpoint's run shuffled its stream batches "
                           "otherwise (no 'shuffle_scheme'); allowed by --allow-config-change, it goes on with this "
                           "version's batches")
        return
    raise ConfigError(f"{source}: train.seed {seed} (>= 2**32) was shuffled by the stream loader of a version that "
                      f"drew some of its epochs' batches as other seeds' (no key 'shuffle_scheme'); this version "
                      f"draws others, so the resumed run would not continue its batches; start the run afresh, or "
                      f"pass --allow-config-change data.shuffle to go on with this version's")
