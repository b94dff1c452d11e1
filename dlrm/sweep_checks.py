"""Checks of a sweep's grid before its first trial, each refusing in one line (exit 2) what would otherwise come out
only after trials had trained.

Two settings that would train the very same config (`check_same_configs`): a grid is the product of its ``--set``
lists, so ``--set model.interaction=dot,dcn --set model.cross_rank=4,8`` holds two "dot" settings that differ only in
``model.cross_rank``, which a dot model never reads (`dlrm.config_checks.DEPENDENT_KEYS`). Both were trained, under two
labels, and ranked as rivals: the same numbers twice in the tables, and, where the dot model won, a "runner-up" that
was itself (margin 0, "the per-seed differences are all equal"). `dlrm.config_checks.check_dependent_keys` refuses a key
only where no setting lets it act; here some do, so the grid is compared setting by setting: each one's config with the
keys that cannot act in it left out.

A setting whose dataset is missing (`check_datasets`): found by its first trial's run, it ended the sweep after the
settings before it had trained (``--set data.path=ds,d_typo``), and ``--resume`` (which must match the record) could
not mend the name.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dlrm.config import ConfigError, load_config
from dlrm.config_checks import DEPENDENT_KEYS


def effective(config: str, overrides: dict[str, Any]) -> str:
    """The config `overrides` make of `config`, as JSON, without the `DEPENDENT_KEYS` keys that cannot act in it."""
    tree = load_config(config, overrides).to_dict()
    for key, (on, acting) in DEPENDENT_KEYS.items():
        if _get(tree, on) not in acting:
            *sections, leaf = key.split(".")
            node = tree
            for part in sections:
                node = node[part]
            node.pop(leaf)
    return json.dumps(tree, sort_keys=True, default=str)


def check_same_configs(config: str, base: dict[str, Any], settings: list[dict[str, Any]]) -> None:
    """Refuse, in one line naming two settings, a grid with two settings that train the same config."""
    from dlrm.sweep import label

    seen: dict[str, dict[str, Any]] = {}
    for setting in settings:
        key = effective(config, {**base, **setting})
        first = seen.setdefault(key, setting)
        if first is setting:
            continue
        inert = [k for k in setting if setting[k] != first[k] and k in DEPENDENT_KEYS]
        why = "; ".join(f"{k} acts with {DEPENDENT_KEYS[k][0]} {' or '.join(map(json.dumps, DEPENDENT_KEYS[k][1]))} "
                        f"only" for k in inert) or "their values make one config"
        raise ConfigError(f"--set: {label(first)} and {label(setting)} train the same config ({why}): it would be "
                          "trained twice and ranked as its own rival; sweep those keys where they act in a sweep of "
                          "their own")


def check_datasets(config: str, base: dict[str, Any], settings: list[dict[str, Any]], workdir: str) -> None:
    """Refuse, in one line naming the setting, one whose ``data.path`` holds no dataset (its metadata.json read as
    its run reads it). `workdir`: what a relative data.path is read against (the working directory the sweep
    started in, as its trials read it: `dlrm.sweep._run_trials`)."""
    from dlrm.errors import DatasetError
    from dlrm.sweep import label
    from dlrm.train.setup import load_dataset_metadata  # (torch: not for --help)

    checked: set[str] = set()
    for setting in settings:
        cfg = load_config(config, {**base, **setting})
        cfg.data.path = os.path.join(workdir, cfg.data.path)  # (an absolute path stays itself)
        if cfg.data.path in checked:
            continue
        try:
            load_dataset_metadata(cfg)
        except (ConfigError, DatasetError) as e:
            given = any(k in ("data", "data.path") for k in setting)  # (else the file's or --data's: not a --set's)
            raise type(e)(f"--set {label(setting)}: {e}" if given else str(e)) from None
        checked.add(cfg.data.path)


def _get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree
