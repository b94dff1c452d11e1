"""The line train.py says when a run runs out of memory (exit 4): what ran out, and what makes the run fit.

Kept light (no torch at import, the builder imported only for a Config's dense layers): `dlrm.cli` imports it at
start-up, and its handlers must exist whenever the failure happens."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from dlrm.config import Config


def one_line(exc: BaseException, limit: int = 2000, first_only: bool = False) -> str:
    """The exception's message as one line of at most `limit` characters: its lines joined (a
    message quoting a multi-line library error keeps all of it), or only the first."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    text = lines[0] if first_only else " ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resume_state(resume: Optional[str], cfg: Optional[Config]) -> Union[bool, str]:
    """What the next ``--resume`` of a run that failed meets, for its out-of-memory advice: True where a checkpoint
    is there (a ``--resume PATH``; the run by name holds one, also one this session wrote before it failed), which
    fixes the tables and layers; "restart" where the run's directory holds its config.json and no checkpoint (a
    ``--resume`` that found none, restarted from step 0, and failed before its first one: the next compares its
    config with that file, so every change needs ``--allow-config-change``, `dlrm.train.resume_policy.restart_config`);
    False for no ``--resume``, or a run whose directory was never made (the next starts a new run)."""
    if resume is None:
        return False
    if resume != "latest" or cfg is None or not cfg.log.run_name:
        return True
    import dlrm.checkpoint as ckpt  # (torch: loaded by a run that ran out of memory)
    from dlrm.train.checkpointer import BEST_NAME

    run = Path(cfg.log.tb_dir) / cfg.log.run_name
    try:
        if ckpt.list_checkpoints(run) or (ckpt.checkpoint_dir(run) / BEST_NAME).is_file():
            return True
        return "restart" if (run / "config.json").is_file() else False
    except OSError:  # (the run's directory unreadable now: a resume's advice, as before this was weighed)
        return True


def out_of_memory_message(exc: BaseException, cfg: Optional[Config], resuming: Union[bool, str] = False) -> str:
    """What ran out, and the settings that shrink a run's memory: while the model was built, the tables' size and
    what makes them fit (`dlrm_tables`, from `dlrm.train.builder.tables_named_if_out_of_memory`); else the batch size
    too. `resuming` (`resume_state`): True, a --resume of a checkpoint, which fixes the tables and the dense layers (no
    cap, no smaller model: it is told to run where there is more memory) and takes another batch size only under
    --allow-config-change; "restart", a --resume of a run with no checkpoint, its config.json compared: a fresh run's
    advice, each key with the flag the next --resume takes it with."""
    if getattr(exc, "dlrm_refused", False):  # refused before the build (`refuse_host_memory_shortfall`): as it is
        return one_line(exc)
    gpu = type(exc).__name__ == "OutOfMemoryError"
    what = "GPU memory" if gpu else "host memory"
    tables = getattr(exc, "dlrm_tables", None)
    if tables is not None:
        return f"out of {what} building the model ({one_line(exc, limit=200, first_only=True)}): {tables}"
    batch = f" (now {cfg.data.batch_size})" if cfg is not None else ""
    if resuming == "restart":  # (said "the checkpoint fixes the tables" of a run that has none)
        flag = " with --allow-config-change {}"
        return (f"out of {what} ({one_line(exc, limit=200, first_only=True)}): retry the --resume with a smaller "
                f"data.batch_size{batch} (--batch-size{flag.format('data.batch_size')}), or cap the embedding tables "
                f"with data.max_rows_per_table{flag.format('data.max_rows_per_table')} (the run has no checkpoint: "
                "its config.json is compared)")
    if resuming:  # ("cap the embedding tables" and "shrink model.cross_rank" were advised: each refused on a resume)
        return (f"out of {what} ({one_line(exc, limit=200, first_only=True)}): resume with a smaller data.batch_size"
                f"{batch} (--batch-size with --allow-config-change data.batch_size), or on a {'GPU' if gpu else 'host'}"
                " with more free memory (the checkpoint fixes the tables and layers: data.max_rows_per_table cannot "
                "cap them)")
    text = (f"out of {what} ({one_line(exc, limit=200, first_only=True)}): retry with a smaller "
            f"data.batch_size{batch} (--batch-size), or cap the embedding tables with data.max_rows_per_table")
    if cfg is not None:  # (an oversized cross network's step ran out: the advice named the batch and the tables alone)
        from dlrm.data.schema import NUM_SPARSE
        from dlrm.train.builder import dense_layers_text

        dense = dense_layers_text(cfg, NUM_SPARSE)
        if dense is not None:
            text += f", or {dense}"
    return text
