"""Sharded checkpoints of a distributed run, and merging them into a one-process checkpoint.

A checkpoint of an N-rank run is N shard files plus a manifest, in the run's checkpoints/::

    step-00001000.rank0-of-2.pt   everything rank 0 needs to continue: model state (dense parts and
    step-00001000.rank1-of-2.pt   its embedding shard), optimizers, schedules, position, its RNG
    step-00001000.pt              the manifest: sharding plan, shard names, position, config
    best.pt                       the best evaluation's manifest, naming its own best-step-N.rankQ-of-W.pt shards

Every shard is written atomically; the manifest, which is what `--resume` and the pruning look
for, is written by rank 0 only after every rank has finished its shard, so a crash never leaves
a manifest whose shards are incomplete. Resume needs the same number of ranks;
``python -m dlrm.distributed.merge`` turns a sharded checkpoint into a one-process one.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
from loguru import logger

from dlrm.config import ConfigError
from dlrm.distributed.env import DistEnv, failure, failure_error
from dlrm.distributed.same_run import check_resumed_shard, first_difference
from dlrm.distributed.sharding import ShardingPlan
from dlrm import checkpoint as ckpt

SPARSE_WEIGHT = "sparse_arch.weight"
# The stochastic-rounding seed of a bf16 shard (`ShardedSparseArch`): part of a shard, so that
# a resumed run draws new rounding bits; a one-process table keeps its seed out of the state_dict.
SHARD_ONLY = ("sparse_arch.sr_seed",)


T = TypeVar("T")
State = dict[str, Any] | Callable[[], dict[str, Any]]
"""A rank's state to save, or a function gathering it (`save_sharded`)."""

BEST_PREFIX = "best-"
"""The shards of a sharded run's best.pt: ``best-step-N.rankQ-of-W.pt`` (`save_best_sharded`); never pruned."""


def shard_name(step: int, rank: int, world_size: int) -> str:
    return f"step-{step:08d}.rank{rank}-of-{world_size}.pt"


def _shard(state: dict[str, Any], env: DistEnv, plan: ShardingPlan) -> dict[str, Any]:
    # world_size: the ranks (a sharded run's epochs are its own ranks': `dlrm.checkpoint.trained_world_size`)
    return {**state, "rank": env.rank, "plan": plan.to_dict(), "world_size": env.world_size}


def _manifest(state: dict[str, Any], env: DistEnv, plan: ShardingPlan, shards: list[str]) -> dict[str, Any]:
    # (dataset_stamps, train_rows: a resume checks the data and the schedule's length with its manifest)
    manifest = {k: state[k] for k in ("position", "cardinalities", "config", "data_placement", "shuffle_scheme",
                                      "dataset_stamps", "train_rows") if k in state}
    manifest["world_size"] = env.world_size
    manifest["sharded"] = {"world_size": env.world_size, "plan": plan.to_dict(), "shards": shards}
    return manifest


def _agreed(env: DistEnv, part: Callable[[], None], what: str, doing: str = "write") -> None:
    """Run this rank's `part` of a save (or of a resume's load: `doing`), then learn every rank's outcome in one
    collective; in place of a barrier, at checkpoints only. A rank whose part failed raises its own error; every other
    rank raises one naming the failed rank and its file (the same kind: an OSError keeps its errno, so the command
    reports it in one line, exit 2).
    With a bare barrier the other ranks waited for a rank that would never come (the process group's timeout, 30
    minutes) or died with gloo's "Connection closed by peer" traceback."""
    error: Optional[BaseException] = None
    try:
        part()
    except Exception as e:  # noqa: BLE001 - a full disk, a quota, a removed directory, a state the schema refuses,
        error = e  # a bug: each raised below, after the others learnt of it (they waited for this rank forever)
    outcomes = env.all_gather_object(None if error is None else failure(error)) if env.distributed else [None]
    if error is not None:
        raise error
    for q, failed in enumerate(outcomes):
        if failed is not None:
            raise failure_error(failed, q, f"could not {doing} {what}")


def _set_aside(shard: Path, previous: Path) -> bool:
    """Keep `shard` (a saved one, about to be replaced) as `previous` too, so that a failed replacement on any rank can
    be undone on every rank; whether there was one. A link (a copy where links fail), not a rename: killed in between,
    the shard its manifest names is still there."""
    if not shard.exists():
        return False
    previous.unlink(missing_ok=True)
    try:
        os.link(shard, previous)
    except OSError:
        shutil.copyfile(shard, previous)
    return True


def _gathered(state: State) -> dict[str, Any]:
    """`state`, or what the function `state` gathers (the caller's checks and state: in the first agreed part)."""
    return state() if callable(state) else state


def save_sharded(run_dir: Path, state: State, step: int, keep: int, env: DistEnv, plan: ShardingPlan) -> Path:
    """Every rank writes its shard; then rank 0 writes the manifest and prunes old checkpoints. A failed write on any
    rank stops every rank (`_agreed`) without a manifest, and the shards that were written are removed.

    `state`: this rank's state, or a function returning it: called (with the making of checkpoints/) inside the first
    agreed part, so that its failure on one rank (the run directory gone, the state's gathering) stops every rank;
    raised before that part, it left the others waiting in its collective (gloo's "Connection closed by peer")."""
    d = ckpt.checkpoint_dir(run_dir)
    mine = d / shard_name(step, env.rank, env.world_size)
    path = d / ckpt.checkpoint_name(step)
    # a manifest of this step already there (the run's last step saved again after a resume) keeps its shards: the
    # new ones are written beside them (`written`) and moved over them only once every rank's is complete (replaced
    # in place, a failure on one rank left the manifest naming the others' new shards beside its old one: ranks of
    # another dense state and run totals, resumed as one checkpoint). Not a temporary's name: rank 0 removes those
    existed = path.exists()
    written = mine.with_name(mine.name + ".pending") if existed else mine
    previous = mine.with_name(mine.name + ".previous")  # the old shard, while the new ones are moved over theirs
    gathered: dict[str, Any] = {}
    aside = False  # this rank's old shard is at `previous`

    def shard() -> None:
        gathered.update(_gathered(state))
        d.mkdir(parents=True, exist_ok=True)
        ckpt.write_atomic(written, _shard(gathered, env, plan), progress=env.is_main)  # one bar: rank 0's own shard's

    def move() -> None:
        # agreed before rank 0 writes the manifest (it wrote it while another rank's move failed: its old shard beside
        # rank 0's new one); the old shard kept aside, so that a move that failed on any rank is undone on every rank.
        nonlocal aside
        aside = _set_aside(mine, previous)
        os.replace(written, mine)

    try:
        _agreed(env, shard, f"its shard of step {step}")  # all shards complete before the manifest names them
        if existed:
            _agreed(env, move, f"its shard of step {step} over the previous save's")
    except Exception:
        # named by no manifest (this step's complete shards would never be pruned), or the pending copy of one
        written.unlink(missing_ok=True)
        if aside:  # every shard back to the previous save's, which its manifest names
            os.replace(previous, mine)
            previous.unlink(missing_ok=True)  # still there when not moved (rename's no-op: a link to `mine`)
        raise
    previous.unlink(missing_ok=True)

    def manifest() -> None:
        if env.is_main:
            ckpt.remove_stale_temp_files(d)  # no rank is writing now: any temporary file is a killed write's
            ckpt.write_atomic(path, _manifest(gathered, env, plan, [shard_name(step, q, env.world_size)
                                                                    for q in range(env.world_size)]))
            ckpt.prune_checkpoints(run_dir, keep)

    try:
        _agreed(env, manifest, f"the manifest of step {step}")  # nobody goes on (or reads "latest") before it exists
    except Exception:
        if not existed and not path.exists():
            mine.unlink(missing_ok=True)
        raise
    if env.is_main:  # as a one-process run's save says it (`dlrm.checkpoint.save_checkpoint`): a torchrun run said none
        logger.info(f"checkpoint: {path}")
    return path


def save_best_sharded(path: Path, state: State, step: int, env: DistEnv, plan: ShardingPlan,
                      link: Callable[[Path, Path], bool], saved: Optional[Path] = None) -> Path:
    """The best evaluation's sharded checkpoint as `path` (a manifest, ``checkpoints/best.pt``) and its shards
    ``best-step-N.rankQ-of-W.pt``: outside the step checkpoints' names, so their pruning never removes them.

    `saved`: this step's regular manifest, when the step was just checkpointed: each rank then hard-links its shard
    (`link`, the same model; a copy where links fail) instead of writing it again. Crash-safe: the shards are written
    beside their names (``.pending``) and moved over them only once every rank's is complete, the manifest replaced
    once every rank's is moved, and the previous best's shards removed after that. `state`: as `save_sharded`'s (a
    function's failure on one rank stops every rank)."""
    d = path.parent
    names = [BEST_PREFIX + shard_name(step, q, env.world_size) for q in range(env.world_size)]
    mine = d / names[env.rank]
    source = saved.parent / shard_name(step, env.rank, env.world_size) if saved is not None else None
    # a best of the current best.pt's step (a resume at the run's end on another data.eval_split, one re-evaluated for
    # its summary) has its shards' names: written in place, a failure on another rank (or a kill before the manifest)
    # left best.pt naming this rank's new shard beside the others' old ones (two models, merged or resumed as one).
    # So, as `save_sharded` does for a step saved again: written beside (`written`), moved over in an agreed part once
    # every rank's is complete, the old one kept aside (`previous`) and put back if any rank's move fails. The move's
    # agreed part runs on every rank (one collective each): a rank whose name is new wrote it in place, moves nothing
    written = mine.with_name(mine.name + ".pending") if mine.exists() else mine
    previous = mine.with_name(mine.name + ".previous")
    gathered: dict[str, Any] = {}
    aside, moved = False, False

    def shard() -> None:
        gathered.update(_gathered(state))
        d.mkdir(parents=True, exist_ok=True)
        if source is None or not source.is_file() or not link(source, written):
            ckpt.write_atomic(written, _shard(gathered, env, plan), progress=env.is_main)

    def move() -> None:
        nonlocal aside, moved
        if written == mine:
            return
        aside = _set_aside(mine, previous)
        os.replace(written, mine)
        moved = True

    def manifest() -> None:
        if env.is_main:
            ckpt.write_atomic(path, _manifest(gathered, env, plan, names))
            for old in _best_shards(d):
                if old.name not in names:  # the previous best's shards (any world size), no longer named, and a
                    old.unlink(missing_ok=True)  # killed save's .pending/.previous (no rank is saving now)

    try:
        _agreed(env, shard, f"its shard of best.pt (step {step})")  # every shard complete before any is moved
        _agreed(env, move, f"its shard of best.pt (step {step}) over the previous best's")
    except Exception:
        if aside:  # every shard back to the current best.pt's
            os.replace(previous, mine)
            previous.unlink(missing_ok=True)  # still there when not moved (rename's no-op: a link to `mine`)
        elif (moved or written == mine) and mine.name not in _named_shards(path):  # named by no best.pt: never
            mine.unlink(missing_ok=True)  # removed
        if written != mine:
            written.unlink(missing_ok=True)  # the pending one, named by no manifest
        raise
    previous.unlink(missing_ok=True)
    try:
        _agreed(env, manifest, f"best.pt (step {step})")  # a failure on any rank stops every rank
    except Exception:
        if mine.name not in _named_shards(path):  # named by no best.pt (it is still the previous one): never removed
            mine.unlink(missing_ok=True)
        raise
    return path


def _named_shards(manifest_path: Path) -> list[str]:
    """The shard names of the manifest at `manifest_path`; none when it is missing or unreadable. Memory-mapped: a
    one-process checkpoint given in its place (53 GB for MLPerf's) is not read whole to learn that it names none."""
    try:
        return list(ckpt.load_checkpoint(manifest_path, mmap=True)["sharded"]["shards"])
    except Exception:  # noqa: BLE001 - missing, damaged, or not sharded: it names no shard
        return []


def link_best_sharded(found: Path, path: Path, link: Callable[[Path, Path], bool]) -> bool:
    """Make `path` (a run's best.pt) the sharded checkpoint whose manifest is `found` (another run's best.pt or a step
    checkpoint, holding the recorded best evaluation's model) without copying it: each shard hard-linked (`link`) under
    best.pt's own shard names (`BEST_PREFIX`, never pruned), then a manifest naming them. A link to `found`'s manifest
    alone would name shards beside `found`, which its run prunes or replaces. False where a link fails (then `path`
    is not written). Called by one process (rank 0): the checkpoints/ of the ranks are one directory."""
    manifest = ckpt.load_checkpoint(found)
    sharded = manifest["sharded"]
    step, world = manifest["position"]["step"], sharded["world_size"]
    names = [BEST_PREFIX + shard_name(step, q, world) for q in range(world)]
    kept, made, done = set(_named_shards(path)), [], False  # the current best.pt's shards are kept whatever fails
    try:
        for name, mine in zip(sharded["shards"], names):
            if not link(Path(found).parent / name, path.parent / mine):
                return False
            made.append(path.parent / mine)
        ckpt.write_atomic(path, {**manifest, "sharded": {**sharded, "shards": names}})
        done = True
    finally:
        for mine in made if not done else []:  # a link failed, or the manifest's write: named by no best.pt, the
            if mine.name not in kept:  # links made would never be removed (a shard's space once `found`'s run prunes)
                mine.unlink(missing_ok=True)
    for old in _best_shards(path.parent):
        if old.name not in names:  # a previous best's shards, no longer named
            old.unlink(missing_ok=True)
    return True


# with a killed save's ``.pending`` and ``.previous`` (`save_best_sharded`), each a shard's size, removed only here
_BEST_SHARD = re.compile(re.escape(BEST_PREFIX) + r"step-\d{8,}\.rank\d+-of-\d+\.pt(\.pending|\.previous)?")


def _best_shards(d: Path) -> list[Path]:
    """The files in `d` named as a best.pt's shards are, or as a killed save's pending or set-aside ones (matched
    whole: the glob alone also took a user's ``best-step-N.rank0-of-2.old.pt`` for one, and deleted it with the
    previous best's)."""
    return [p for p in d.glob(BEST_PREFIX + "step-*.rank*-of-*.pt*") if _BEST_SHARD.fullmatch(p.name)]


def _plan(sharded: dict[str, Any]) -> ShardingPlan:
    """The plan of a validated manifest (see checkpoint_schema: its fields are checked on load)."""
    return ShardingPlan.from_dict(sharded["plan"])


def load_shard(manifest_path: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank `rank`'s shard of the sharded checkpoint whose loaded manifest is `manifest`, checked to be that rank's,
    of the manifest's plan and at the manifest's position."""
    sharded = manifest["sharded"]
    path = Path(manifest_path).parent / sharded["shards"][rank]
    shard = ckpt.load_checkpoint(path, mmap=True, read="all")  # (a merge's shards: page cache, not copies in memory)
    if "rank" not in shard:
        raise ConfigError(f"{path}: not a shard of a sharded checkpoint (named by {manifest_path})")
    if shard["rank"] != rank:
        raise ConfigError(f"{path}: the shard of rank {shard['rank']}, where {manifest_path} names rank {rank}'s")
    if shard["plan"] != sharded["plan"]:
        raise ConfigError(f"{path}: sharding plan differs from the one of its manifest {manifest_path}")
    if shard["position"] != manifest["position"]:
        raise ConfigError(f"{path}: at {shard['position']}, where its manifest {manifest_path} is at "
                          f"{manifest['position']}: a shard of another checkpoint")
    return shard


def restore_agreed(env: DistEnv, restore: Callable[[], T], path: Path) -> T:
    """What `restore` (this rank's load of the checkpoint at `path`, into its run) returns, once every rank's succeeded;
    one collective, at a resume only. A rank whose shard is damaged or does not fit raised alone: the others went on
    to the run's first collective and died of gloo's "Connection closed by peer" (a traceback, exit 1)."""
    out: list[T] = []
    _agreed(env, lambda: out.append(restore()), str(path), doing="resume from")
    return out[0]


def check_resumable_by(path: Path, state: dict[str, Any], env: DistEnv) -> None:
    """Refuse a checkpoint (`state`, loaded from `path`) that these ranks cannot resume: a shard, a one-process file under
    torchrun, a sharded one of other ranks. Checked as soon as it is read (`dlrm.train.trainer`): at the restore, after
    the run's build, a resume-config refusal came first (fixed, the next try met this one)."""
    sharded = state.get("sharded")
    if sharded is None:
        if "rank" in state:
            # (a best shard's manifest is best.pt)
            raise ConfigError(shard_refusal(Path(path), state, lambda m: f"resume from its manifest ({m.name})"))
        if env.distributed:
            raise ConfigError(f"{path}: a one-process checkpoint cannot be resumed by {env.world_size} ranks; "
                              "start a new run, or resume it with one process")
    elif not env.distributed or sharded["world_size"] != env.world_size:
        raise ConfigError(
            f"{path}: written by {sharded['world_size']} ranks, resumed by {env.world_size}; resume with "
            f"torchrun --nproc-per-node {sharded['world_size']}, or merge it for one process: "
            f"python -m dlrm.distributed.merge {path} OUT.pt")


def load_for_rank(path: Path, env: DistEnv, plan: ShardingPlan, say_conversion: bool = True) -> dict[str, Any]:
    """The state this rank resumes from: its shard of a sharded checkpoint (same ranks, same plan), its tensors
    memory-mapped (`dlrm.checkpoint.load_checkpoint`; the caller owns what it keeps: `dlrm.mapped_load.own_copies`).
    `say_conversion`: whether a format-1 file's conversion is said (a resume said it at its first read)."""
    state = ckpt.load_checkpoint(path, mmap=True, read="all", say_conversion=say_conversion)  # (a manifest: a few kB)
    check_resumable_by(path, state, env)
    sharded = state.get("sharded")
    if sharded is None:
        return state
    saved_plan = _plan(sharded)
    if saved_plan != plan:
        raise ConfigError(f"{path}: sharding plan differs (distributed.sharding / balance / row_wise_min_rows or table "
                          f"sizes, or, with balance 'cost', GPU memory; a checkpoint saved before distributed.balance "
                          f"existed resumes with balance 'rows', one saved before 'cost' with 'lookups'): checkpoint "
                          f"table ranks {list(saved_plan.table_rank)}, this run {list(plan.table_rank)}")
    shard = load_shard(path, state, env.rank)
    # a shard of another run at the same step (a copied file: same plan, shapes and position) was resumed silently
    # into its rank: another model, dense weights other than the other ranks', a config other than the one the resume
    # checked (the manifest's). Its config against the manifest's here; a run of the same config (its dense layers
    # differ) against rank 0's shard, as `python -m dlrm.distributed.merge` compares them (`same_run`)
    for key in ("config", "cardinalities"):
        differs = first_difference(state.get(key), shard.get(key), key) if key in state else None
        if differs is not None:
            raise ConfigError(f"{Path(path).parent / sharded['shards'][env.rank]}: {differs} differs from its "
                              f"manifest {path}'s: a shard of another run")
    check_resumed_shard(Path(path), sharded["shards"], env.rank)
    return shard


def assemble(plan: ShardingPlan, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full [R, ...] tensor of per-row values (weights, optimizer state) from each rank's local rows."""
    offsets = [0]
    for n in plan.cardinalities[:-1]:
        offsets.append(offsets[-1] + n)
    for q, local in enumerate(shards):
        if local.dim() == 0 or local.shape[0] != plan.local_rows(q):
            raise ConfigError(f"shard of rank {q} has {local.shape[0] if local.dim() else 0} rows, "
                              f"the plan says {plan.local_rows(q)}")
        if local.shape[1:] != shards[0].shape[1:] or local.dtype != shards[0].dtype:
            raise ConfigError(f"shard of rank {q} holds {local.dtype} rows of shape {tuple(local.shape[1:])}, "
                              f"rank 0 {shards[0].dtype} rows of shape {tuple(shards[0].shape[1:])}")
    out = torch.zeros((sum(plan.cardinalities), *shards[0].shape[1:]), dtype=shards[0].dtype)
    for q, local in enumerate(shards):
        for f, start, count, at in plan.local_layout(q):
            out[offsets[f] + start : offsets[f] + start + count] = local[at : at + count]
    return out


def _assembled(plan: ShardingPlan, shards: list[torch.Tensor], where: Path, what: str) -> torch.Tensor:
    """`assemble`, its errors naming the checkpoint and the tensor."""
    try:
        return assemble(plan, shards)
    except ConfigError as e:
        raise ConfigError(f"{where}: {what}: {e}") from None


_STEP_SHARD = re.compile(r"step-\d{8,}\.rank\d+-of-\d+\.pt(\.pending|\.previous)?")


def manifest_of(shard_path: Path, shard: dict[str, Any]) -> Optional[Path]:
    """The manifest that names the shard at `shard_path`: best.pt for a best shard (`save_best_sharded`), its step's
    checkpoint for a step's shard (or a shard under that checkpoint's name); None where its name is neither: a best
    shard holds what its step's shard holds (a hard link to it, when the step was checkpointed), so only the name
    tells them apart (copied to best.pt or model.pt, one was sent to a step-N.pt that may never have been written)."""
    step_manifest = ckpt.checkpoint_name(shard["position"]["step"])
    if _BEST_SHARD.fullmatch(shard_path.name):
        return shard_path.parent / "best.pt"
    if _STEP_SHARD.fullmatch(shard_path.name) or shard_path.name == step_manifest:
        return shard_path.parent / step_manifest
    return None


def shard_refusal(shard_path: Path, shard: dict[str, Any], advice: Callable[[Path], str]) -> str:
    """The line refusing the shard at `shard_path` where a whole checkpoint was wanted: ``advice(its manifest)`` after
    "one shard of a sharded checkpoint; ". A shard under its manifest's own name (copied over it, or given that name)
    is told so instead: the advice named that same file, "merge its manifest, X" where X was the shard refused. One
    under a name that says no manifest (`manifest_of`): what it is, the manifests it may belong to, and
    ``advice(MANIFEST)``."""
    manifest = manifest_of(shard_path, shard)
    if manifest is None:
        step, rank = shard["position"]["step"], shard["rank"]
        world = shard.get("world_size") or shard["plan"]["world_size"]
        return (f"{shard_path}: rank {rank}'s shard of a sharded checkpoint of {world} ranks at step {step}, not a "
                "manifest (which holds no model: it names every rank's shard), under a name that does not say which "
                "manifest names it, nor can the file (a best.pt's shard holds what its step's does): its run's "
                f"{ckpt.checkpoint_name(step)}, or its best.pt (shards {BEST_PREFIX}{shard_name(step, rank, world)}) "
                f"where step {step} was the best evaluation; {advice(Path('MANIFEST'))}")
    if manifest.name != shard_path.name:
        return f"{shard_path}: one shard of a sharded checkpoint; {advice(manifest)}"
    return (f"{shard_path}: rank {shard['rank']}'s shard of a sharded checkpoint under its manifest's name, not the "
            f"manifest (which holds no model: it names every rank's shard); the {shard_path.name} its run wrote beside "
            "the shards is the one to give")


def _merge_sparse_optimizer(plan: ShardingPlan, shards: list[dict[str, Any]], where: Path) -> dict[str, Any]:
    """The sparse optimizer's state over all rows: its per-row tensors assembled from the shards."""
    if any(len(s["optimizers"]) != 2 for s in shards):
        raise ConfigError(f"{where}: a shard holds {[len(s['optimizers']) for s in shards]} optimizers, "
                          "not 2 (dense, sparse)")
    sparse_opt = [s["optimizers"][1] for s in shards]
    merged = {"param_groups": sparse_opt[0]["param_groups"], "state": {}}
    for key, st in sparse_opt[0]["state"].items():
        per_rank = [o["state"].get(key, {}) for o in sparse_opt]
        missing = [q for q, o in enumerate(per_rank) if set(o) != set(st)]
        if missing:
            raise ConfigError(f"{where}: the sparse optimizer's state {key} differs between ranks 0 and {missing[0]}")
        merged["state"][key] = {
            name: _assembled(plan, [o[name] for o in per_rank], where, f"sparse optimizer state {key}.{name}")
            if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == plan.local_rows(0) else value
            for name, value in st.items()
        }
    return merged


def merge(manifest_path: Path) -> dict[str, Any]:
    """A one-process checkpoint state from a sharded checkpoint (see `save_sharded`).

    Dense parameters and their optimizer come from rank 0 (DDP keeps the ranks identical); the
    embedding weight (in the shards' dtype: bf16 shards give a bf16 table, which loads as a one-process
    bf16 table does) and every per-row tensor of the sparse optimizer's state (fp32) are assembled
    from the shards; state only a shard has (`SHARD_ONLY`) is left out, so the model's keys are a
    one-process model's; its world_size is the sharded run's; RNG states and run totals are rank 0's, except the
    logging window's losses, the ranks' shares summed (`_merge_run_stats`). Shards that do not fit together are a
    ConfigError.
    """
    manifest = ckpt.load_checkpoint(manifest_path)
    sharded = manifest.get("sharded")
    if sharded is None:
        if "rank" in manifest:  # a shard, which no one process loads (it said "it already loads in one process")
            raise ConfigError(shard_refusal(Path(manifest_path), manifest, lambda m: f"merge its manifest, {m}"))
        raise ConfigError(f"{manifest_path}: not a sharded checkpoint (it already loads in one process)")
    plan = _plan(sharded)
    shards = [load_shard(manifest_path, manifest, q) for q in range(sharded["world_size"])]
    if any(SPARSE_WEIGHT not in s["model"] for s in shards):
        raise ConfigError(f"{manifest_path}: a shard holds no {SPARSE_WEIGHT}")
    full = {k: v for k, v in shards[0].items() if k not in ("rank", "plan", "format_version")}
    # the ranks that trained it, which one process resuming it must know (its epochs: `dlrm.train.train_data`); the
    # manifest holds them also where its shards (written before checkpoints recorded world_size) do not
    full["world_size"] = sharded["world_size"]
    full["model"] = {k: v for k, v in shards[0]["model"].items() if k not in SHARD_ONLY}
    full["model"][SPARSE_WEIGHT] = _assembled(plan, [s["model"][SPARSE_WEIGHT] for s in shards], manifest_path,
                                              SPARSE_WEIGHT)
    full["optimizers"] = [shards[0]["optimizers"][0], _merge_sparse_optimizer(plan, shards, manifest_path)]
    if isinstance(full.get("run_stats"), dict):
        full["run_stats"] = _merge_run_stats(shards, manifest_path)
    return full


def _merge_run_stats(shards: list[dict[str, Any]], where: Path) -> dict[str, Any]:
    """Rank 0's run totals (the same on every rank: global losses, samples, evaluations) with the logging window's
    losses of the whole global batch: each rank's ``window_losses`` are its share of each step's global mean loss
    (`dlrm.train.step.TrainStep._share`), which one process, resuming the merged checkpoint between two logging
    steps, puts back in its first logging window; their sum over the ranks divided by W is that step's loss as one
    process computes it (rank 0's alone made the first logged loss after the resume another number)."""
    stats = dict(shards[0]["run_stats"])
    per_rank = [list((s.get("run_stats") or {}).get("window_losses") or []) for s in shards]
    if any(len(w) != len(per_rank[0]) for w in per_rank):
        raise ConfigError(f"{where}: the shards hold logging windows of {[len(w) for w in per_rank]} losses, "
                          "where one checkpoint's ranks hold as many")
    if per_rank[0]:
        stats["window_losses"] = [math.fsum(step) / len(shards) for step in zip(*per_rank)]
    return stats
