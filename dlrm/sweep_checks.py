"""Checks of a sweep's grid before its first trial, each refusing in one line (exit 2) what would otherwise come out
only after trials had trained.

Two settings that would train the very same config (`check_same_configs`): a grid is the product of its ``--set``
lists, so ``--set model.interaction=dot,dcn --set model.cross_rank=4,8`` holds two "dot" settings that differ only in
``model.cross_rank``, which a dot model never reads (`dlrm.config_checks.DEPENDENT_KEYS`). Both were trained, under two
labels, and ranked as rivals: the same numbers twice in the tables, and, where the dot model won, a "runner-up" that
was itself (margin 0, "the per-seed differences are all equal"). `dlrm.config_checks.check_dependent_keys` refuses a key
only where no setting lets it act; here some do, so the grid is compared setting by setting: each one's config with the
keys that cannot act in it left out, and as its run trains it (`trained_config`): with what the device decides resolved
(on a CPU ``--set train.precision=fp32,tf32`` trained one fp32 model twice, as did a compile mode under
``train.compile.enabled`` "auto", which runs eager there) and the dataset's tables (a ``data.max_rows_per_table`` that
no table reaches caps nothing; two names of one dataset are one).

A setting whose dataset is missing (`check_datasets`): found by its first trial's run, it ended the sweep after the
settings before it had trained (``--set data.path=ds,d_typo``), and ``--resume`` (which must match the record) could
not mend the name. So did a ``data.max_rows_per_table`` below a table of a vocabulary-hashed dataset.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Any, Optional

from loguru import logger

from dlrm.config import Config, ConfigError, load_config
from dlrm.config_checks import DEPENDENT_KEYS


def effective(config: str, overrides: dict[str, Any], metadata: Optional[dict] = None) -> str:
    """The config `overrides` make of `config` as its run trains it, as JSON: what the device decides resolved
    (`trained_config`; under both of the run lengths that can decide a compile mode "auto", so that two settings
    are one only where they are one whatever the run's length) and the `DEPENDENT_KEYS` keys that cannot act in it
    left out. `metadata`: a cache of the datasets' metadata by path."""
    cfg = load_config(config, overrides)
    metadata = {} if metadata is None else metadata
    return json.dumps([_without_inert(trained_config(cfg, metadata, steps)[0]) for steps in (None, _LONG_RUN)],
                      sort_keys=True, default=str)


# A run length past every threshold `dlrm.train.fast_path` resolves "auto" by (its autotuning pays from ~1M steps).
_LONG_RUN = 10**15


def trained_config(cfg: Config, metadata: dict, total_steps: Optional[int] = None) -> tuple[dict, str]:
    """(`cfg` as its run trains it, as ``Config.to_dict()``; the device's type). What the run takes from its device
    (`dlrm.train.fast_path.resolve_fast_path`: the kernels', compile's and CUDA graph's "auto"; on a CPU: tf32
    matmuls, which stay IEEE fp32 there, a CUDA graph, ignored there, and data.placement "auto", which streams there)
    and from its dataset (the tables: the dataset's sizes under data.max_rows_per_table, which then stands for no more
    than those sizes). A config the device cannot resolve (its run refuses it, named by `dlrm.sweep.check_settings`)
    or a dataset not readable here (`check_datasets` names it) leaves those parts as given."""
    from dlrm.errors import DatasetError
    from dlrm.train.fast_path import resolve_fast_path
    from dlrm.train.setup import load_dataset_metadata, resolve_device  # (torch: not for --help)

    cfg = copy.deepcopy(cfg)
    try:
        device = resolve_device(cfg.train.device)
    except ConfigError:
        return cfg.to_dict(), cfg.train.device
    path = os.path.abspath(cfg.data.path)
    if path not in metadata:
        try:
            metadata[path] = load_dataset_metadata(cfg)[1]
        except (ConfigError, DatasetError, OSError):
            metadata[path] = None
    meta, cap = metadata[path], cfg.data.max_rows_per_table
    if meta is not None and (meta.hashing == "modulus" or cap is None or max(meta.cardinalities) <= cap):
        # (a vocabulary-hashed table over the cap is refused by the run: left as given)
        cfg.model.cardinalities = [c if cap is None or meta.hashing != "modulus" else min(c, cap)
                                   for c in meta.cardinalities]
        cfg.model.multi_hot_sizes = list(meta.multi_hot_sizes)
        cfg.data.max_rows_per_table = None
    sizes = cfg.model.multi_hot_sizes
    try:
        with _quiet("dlrm.train.fast_path"):  # (its log lines are each trial's to say)
            cfg, _ = resolve_fast_path(cfg, device, False, sizes is not None and any(s != 1 for s in sizes),
                                       total_steps)
    except ConfigError:
        return cfg.to_dict(), device.type
    if device.type != "cuda":  # (dlrm.train.step.set_matmul_precision, graph_train_step, choose_placement)
        cfg.train.precision = "fp32" if cfg.train.precision == "tf32" else cfg.train.precision
        cfg.train.cuda_graph = False
        cfg.data.placement = "stream" if cfg.data.placement == "auto" else cfg.data.placement
    cfg.train.device = device.type
    cfg.data.path = path if metadata[path] is None else os.path.realpath(path)  # (two names of one dataset: one)
    return cfg.to_dict(), device.type


@contextlib.contextmanager
def _quiet(module: str):
    logger.disable(module)
    try:
        yield
    finally:
        logger.enable(module)


def _without_inert(tree: dict) -> dict:
    """`tree` without the `DEPENDENT_KEYS` keys that cannot act in it."""
    tree = copy.deepcopy(tree)
    for key, (on, acting) in DEPENDENT_KEYS.items():
        if _get(tree, on) not in acting:
            *sections, leaf = key.split(".")
            node = tree
            for part in sections:
                node = node[part]
            node.pop(leaf)
    return tree


def check_same_configs(config: str, base: dict[str, Any], settings: list[dict[str, Any]]) -> None:
    """Refuse, in one line naming two settings, a grid with two settings that train the same config: the same as
    given, or made one by what the device or the dataset decides (`trained_config`)."""
    from dlrm.sweep import label

    seen: dict[str, dict[str, Any]] = {}
    metadata: dict = {}
    for setting in settings:
        key = effective(config, {**base, **setting}, metadata)
        first = seen.setdefault(key, setting)
        if first is setting:
            continue
        reasons = _why_one(config, base, first, setting, metadata)
        why = "; ".join(clause for clause, _ in reasons) or "their values make one config"
        advice = "; ".join(dict.fromkeys(a for _, a in reasons)) or _WHERE_THEY_ACT
        raise ConfigError(f"--set: {label(first)} and {label(setting)} train the same config ({why}): it would be "
                          f"trained twice and ranked as its own rival; {advice}")


_WHERE_THEY_ACT = "sweep those keys where they act in a sweep of their own"


def _why_one(config: str, base: dict[str, Any], first: dict[str, Any], other: dict[str, Any],
             metadata: dict) -> list[tuple[str, str]]:
    """Why the keys `first` and `other` set apart make one config: (a clause, what to do instead) per key."""
    raw = [load_config(config, {**base, **s}) for s in (first, other)]
    (tree, device), (other_tree, _) = (trained_config(cfg, metadata) for cfg in raw)
    given = [cfg.to_dict() for cfg in raw]
    # "(here: cpu)" read as if the CPU were where they act: it is where they train alike
    on_device = f"sweep them on a device where they act ({device} trains them as one)"
    out = []
    for k in (k for k in other if k in first and other[k] != first[k]):
        try:
            resolved = [_get(tree, k), _get(other_tree, k)] if k != "data.max_rows_per_table" else None
        except (KeyError, TypeError):  # (a section's value: compared whole)
            continue
        shown = " and ".join(json.dumps(s[k]) for s in (first, other))  # (as given: a section's not expanded)
        if k in DEPENDENT_KEYS:
            on, acting = DEPENDENT_KEYS[k]
            text = f"{k} acts with {on} {' or '.join(map(json.dumps, acting))} only"
            switch = _get(given[1], on)
            if _get(other_tree, on) != switch:  # the device's choice
                out.append((f"{text}, and {json.dumps(switch)} is {json.dumps(_get(other_tree, on))} on {device}",
                            on_device))
            else:
                out.append((text, _WHERE_THEY_ACT))
        elif k == "data.path" and resolved is not None and resolved[0] == resolved[1]:
            out.append((f"data.path {shown} name one dataset, {resolved[0]}", "sweep distinct datasets"))
        elif k == "data.max_rows_per_table":
            meta = metadata.get(os.path.abspath(raw[1].data.path))
            largest = f" (the largest has {max(meta.cardinalities):,} rows)" if meta is not None else ""
            out.append((f"{k} {shown} cap the tables of {raw[1].data.path} alike{largest}",
                        "sweep caps below its largest table's rows"))
        elif resolved is not None and resolved[0] == resolved[1]:
            out.append((f"{k} {shown} both train as {json.dumps(resolved[0])} on {device}", on_device))
    return out


def check_datasets(config: str, base: dict[str, Any], settings: list[dict[str, Any]], workdir: str) -> None:
    """Refuse, in one line naming the setting, one whose ``data.path`` holds no dataset (its metadata.json read as
    its run reads it), or whose ``data.max_rows_per_table`` is below a table of its vocabulary-hashed dataset (which
    its run refuses as it reads the tables: found by that setting's first trial, it ended the sweep after the settings
    before it had trained), or that lacks the split it trains on or evaluates (``data.eval_split``). Two settings
    whose caps bind no table of their dataset are `check_same_configs`'s to refuse (`trained_config`). `workdir`:
    what a relative data.path is read against (the working directory the sweep started in, as its trials read it:
    `dlrm.sweep._run_trials`)."""
    from dlrm.errors import DatasetError
    from dlrm.path_checks import shown_path
    from dlrm.sweep import label
    from dlrm.train.setup import check_table_cap, load_dataset_metadata  # (torch: not for --help)

    datasets: dict[str, tuple] = {}
    for setting in settings:
        cfg = load_config(config, {**base, **setting})
        cfg.data.path = os.path.join(workdir, cfg.data.path)  # (an absolute path stays itself)
        try:
            if cfg.data.path not in datasets:
                datasets[cfg.data.path] = load_dataset_metadata(cfg)
            data_dir, meta = datasets[cfg.data.path]
            check_table_cap(cfg, meta, data_dir)
            # a split it lacks (--set data.eval_split=validation,test of a dataset without a test split): every trial
            # of that setting failed after reading it, and the sweep exited 2 after training the other settings
            for split in dict.fromkeys(("train", cfg.data.eval_split)):
                if split not in meta.splits:
                    held = ", ".join(meta.splits) or "none"
                    raise DatasetError(f"{os.path.join(data_dir, 'metadata.json')}: splits: has no '{split}' split "
                                       f"(it has: {held})")
        except (ConfigError, DatasetError) as e:
            # (else the file's or --data's: not a --set's)
            given = any(k in ("data", "data.path", "data.max_rows_per_table", "data.eval_split") for k in setting)
            # (the setting shortened: a 5,000-byte data.path was printed whole, before the error's own shortened copy)
            raise type(e)(f"--set {shown_path(label(setting))}: {e}" if given else str(e)) from None


def _get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def check_nested_sets(sets: list[tuple[str, list[Any]]]) -> None:
    """Refuse, in one line, a grid that sweeps a key and, in a value of another ``--set``, a section holding it set too
    (``--set optim.sparse.lr=0.1 --set 'optim.sparse={"lr": 0.2}'``): the key's own value is applied after the section
    (`dlrm.config.apply_overrides`), so every setting trained lr 0.1 while its label, its directory and the tables said
    ``optim.sparse={"lr": 0.2}`` too. A section value that leaves the key out (``{"name": "adagrad"}``) is a product
    of the two, and accepted."""
    from dlrm.sweep import label

    for section, values in sets:
        for key, key_values in sets:
            if not key.startswith(section + "."):
                continue
            rest = key[len(section) + 1:].split(".")
            for value in values:
                if _holds(value, rest):
                    raise ConfigError(f"--set {label({section: value})} sets {key}, which --set "
                                      f"{key}={','.join(json.dumps(v) for v in key_values)} sweeps too (that value "
                                      f"would be trained, not the section's); set {key} in one --set only")


def _holds(value: Any, path: list[str]) -> bool:
    """Whether the section `value` of a ``--set`` sets the key at `path` under it. A section's short form (``"compile":
    true``, not an object) stands for ``{"enabled": value}``; null, for an absent section, sets nothing."""
    for i, part in enumerate(path):
        if value is None:
            return False
        if not isinstance(value, dict):
            return path[i:] == ["enabled"]
        if part not in value:
            return False
        value = value[part]
    return True


_OPTIONS = {"data.path": "--data", "train.device": "--device"}  # the sweep's options that set a config key


def check_options_and_sets(base: dict[str, Any], sets: list[tuple[str, list[Any]]],
                           record: Optional[str] = None) -> None:
    """Refuse, in one line, ``--data`` or ``--device`` beside a ``--set`` of the key it sets (``--set data.path=...``,
    or a ``data`` section value holding ``path``): one of the two was dropped without a word (``--data`` under
    ``--set data.path``, which every setting trained instead, though ``--data`` "overrides data.path in every
    trial"). `record`: the sweep.json of a ``--resume``, whose ``--set`` the option is then to give way to."""
    from dlrm.sweep import label

    for dotted, option in _OPTIONS.items():
        if dotted not in base:
            continue
        for key, values in sets:
            clash = [v for v in values if key == dotted or dotted.startswith(key + ".")
                     and _holds(v, dotted[len(key) + 1:].split("."))]
            if clash:
                advice = "give one of them" if record is None else f"the sweep ({record}) sweeps it: leave {option} out"
                raise ConfigError(f"{('--resume: ' if record else '')}{option} and --set {label({key: clash[0]})} both "
                                  f"set {dotted}; {advice}")
