"""What the end-to-end checkpoint tests left open: each test here fails with a mutation of the checkpoint code that
they let through (a check dropped, a state not restored, a file left behind or replaced) or with a bug found then.
A tiny model and hand-built states keep every test well under a second."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from loguru import logger

from dlrm import checkpoint as ckpt
from dlrm.config import Config, ConfigError, ModelConfig
from dlrm.distributed import checkpoint as dist_ckpt
from dlrm.distributed import merge as merge_mod
from dlrm.distributed.env import DistEnv
from dlrm.distributed.sharding import plan_sharding
from dlrm.model.dlrm import build_model
from dlrm.train import export as export_mod
from dlrm.train.checkpointer import Checkpointer
from dlrm.train.meter import RunStats
from dlrm.train.resume_policy import check_resume_config
from dlrm.train.run_dir import RunDirectory, RunLock
from dlrm.train.setup import Tables
from tests.test_checkpoint_safety import StubEnv, draws, local_rows, raw_disk, seed_with_pending_gaussians

CARDS = [3, 5, 2]
SPARSE = dist_ckpt.SPARSE_WEIGHT


def tiny_config(**model) -> Config:
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def tiny_model(cfg: Config) -> torch.nn.Module:
    return build_model(cfg.model, CARDS, None, cfg.kernels, "cpu")


def tiny_state(step: int = 3, cfg: Config | None = None) -> dict:
    """A one-process checkpoint of the tiny model: a dense optimizer and a row-wise sparse one (one value a row)."""
    cfg = cfg or tiny_config()
    model = tiny_model(cfg)
    dense = [{"lr": 0.01, "params": list(range(len(model.state_dict()) - 1))}]
    sparse = {"state": {0: {"sum": torch.rand(sum(CARDS))}}, "param_groups": [{"lr": 0.05, "params": [0]}]}
    return {"model": model.state_dict(), "optimizers": [{"state": {}, "param_groups": dense}, sparse],
            "schedulers": [], "position": {"step": step, "epoch": 0, "batch": step}, "rng": ckpt.rng_state(),
            "cardinalities": list(CARDS), "config": cfg.to_dict()}


def save_sharded(run_dir: Path, state: dict) -> Path:
    """`state` as a two-rank sharded checkpoint (rank 0 last: it writes the manifest); the manifest's path."""
    plan = plan_sharding(state["cardinalities"], 2, "row", 1)
    sparse = state["optimizers"][1]
    for q in (1, 0):
        rows = local_rows(plan, q, sparse["state"][0]["sum"])
        opt = {"param_groups": sparse["param_groups"], "state": {0: {"sum": rows}}}
        shard = {**state, "model": {**state["model"], SPARSE: local_rows(plan, q, state["model"][SPARSE])},
                 "optimizers": [state["optimizers"][0], opt]}
        path = dist_ckpt.save_sharded(run_dir, shard, state["position"]["step"], 5, StubEnv(q, 2), plan)
    return path


# ---------------------------------------------------------------------------------------------
# Writing: nothing invalid, nothing half-written, nothing left behind


def test_an_invalid_state_is_refused_before_anything_is_written(tmp_path):
    state = tiny_state()
    state["position"]["step"] = -1
    with pytest.raises(ConfigError, match=r"step-00000003.pt: checkpoint key 'position.step' must be an int >= 0"):
        ckpt.write_atomic(tmp_path / "step-00000003.pt", state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error,free,raised", [
    (KeyboardInterrupt(), 1 << 40, KeyboardInterrupt),
    (RuntimeError("[enforce fail at inline_container.cc] unexpected pos 512 vs 448"), 1 << 40, RuntimeError),
    (RuntimeError("[enforce fail at inline_container.cc] unexpected pos 512 vs 448"), 1 << 20, OSError),  # disk full
])
def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch, error, free, raised):
    target = tmp_path / "best.pt"
    ckpt.write_atomic(target, tiny_state(step=3))
    before = target.read_bytes()

    def failing_save(obj, f):
        f.write(b"the first bytes of an archive")
        raise error

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("usage", "total used free")(free, 0, free))
    with pytest.raises(raised) as e:
        ckpt.write_atomic(target, tiny_state(step=6))
    if raised is OSError:
        assert e.value.errno == errno.ENOSPC and "no space left" in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"] and target.read_bytes() == before


def test_numpy_scalars_in_the_run_stats_are_written_as_plain_numbers(tmp_path):
    state = {**tiny_state(), "run_stats": {"samples": np.int64(24), "train_s": np.float64(1.5),
                                           "train_losses": [[np.int64(3), np.float32(0.5)]]}}
    ckpt.write_atomic(tmp_path / "c.pt", state)
    stats = ckpt.load_checkpoint(tmp_path / "c.pt")["run_stats"]
    assert stats == {"samples": 24, "train_s": 1.5, "train_losses": [[3, 0.5]]}
    assert type(stats["samples"]) is int and type(stats["train_losses"][0][1]) is float


# ---------------------------------------------------------------------------------------------
# Listing


def test_checkpoints_are_ordered_by_step_number_past_eight_digits(tmp_path):
    d = ckpt.checkpoint_dir(tmp_path)
    d.mkdir()
    for name in ("step-100000000.pt", "step-00000005.pt", "step-99999999.pt", ".step-200000000.pt.1-a.tmp",
                 "step-300000000.rank0-of-2.pt", "best.pt"):
        (d / name).write_bytes(b"")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000005.pt", "step-99999999.pt",
                                                                 "step-100000000.pt"]
    assert ckpt.resolve_resume("latest", tmp_path) == d / "step-100000000.pt"


# ---------------------------------------------------------------------------------------------
# Compatibility with the model a run builds


def compatible(state: dict, cfg: Config, multi_hot_sizes=None, dense_format: str = "counts") -> None:
    ckpt.check_compatible(state, tiny_model(cfg), CARDS, cfg.to_dict()["model"], Path("c.pt"), multi_hot_sizes,
                          dense_format)


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update({SPARSE: torch.zeros(sum(CARDS) + 1, 4)}),
     f"c.pt: {SPARSE} has shape ({sum(CARDS) + 1}, 4) in the checkpoint, ({sum(CARDS)}, 4) here"),
    (lambda m: m.pop(SPARSE), f"c.pt: state_dict keys differ: missing ['{SPARSE}'], unexpected []"),
    (lambda m: m.update({"extra.weight": torch.zeros(1)}), "c.pt: state_dict keys differ: missing [], unexpected "
                                                           "['extra.weight']"),
])
def test_a_model_state_that_does_not_fit_is_named(change, message):
    cfg = tiny_config()
    state = tiny_state(cfg=cfg)
    compatible(state, cfg)
    change(state["model"])
    with pytest.raises(ConfigError) as e:
        compatible(state, cfg)
    assert str(e.value) == message


@pytest.mark.parametrize("key,value", [("embedding_dim", 8), ("bottom_mlp", [8, 8]), ("top_mlp", [4, 1]),
                                       ("interaction", "cat"), ("activation", "gelu"), ("top_mlp_input_multiple", 8),
                                       ("bottom_mlp_input_multiple", 8)])
def test_each_architecture_difference_is_named(key, value):
    """Some (the activation, the interaction) change no tensor's shape: the state would load into the wrong model."""
    cfg = tiny_config()
    state = tiny_state(cfg=cfg)
    state["config"]["model"][key] = value
    with pytest.raises(ConfigError) as e:
        compatible(state, cfg)
    assert str(e.value) == f"c.pt: model.{key} differs: checkpoint {value!r}, this run {getattr(cfg.model, key)!r}"


def test_an_architecture_key_a_checkpoint_lacks_is_its_default():
    """A checkpoint older than a key compares as that key's default (this run's value here): it loads."""
    cfg = tiny_config()
    state = tiny_state(cfg=cfg)
    for key in ("interaction", "activation", "top_mlp_input_multiple", "bottom_mlp_input_multiple"):
        assert getattr(cfg.model, key) == getattr(ModelConfig(), key)
        del state["config"]["model"][key]
    compatible(state, cfg)
    with pytest.raises(ConfigError, match=r"^c.pt: model.activation differs: checkpoint 'relu', this run 'gelu'"):
        compatible(state, tiny_config(activation="gelu"))


def test_other_multi_hot_sizes_or_dense_format_are_named():
    cfg = tiny_config()
    state = tiny_state(cfg=cfg)
    compatible(state, cfg, multi_hot_sizes=[1, 1, 1])  # none saved: one-hot
    with pytest.raises(ConfigError, match=r"^c.pt: multi_hot_sizes differ: checkpoint \[1, 1, 1\], this run's data "
                                          r"\[1, 2, 1\]"):
        compatible(state, cfg, multi_hot_sizes=[1, 2, 1])
    compatible({**state, "dense_format": "float"}, cfg, dense_format="float")
    with pytest.raises(ConfigError, match=r"^c.pt: dense_format differs: the checkpoint was trained on 'counts'"):
        compatible(state, cfg, dense_format="float")


# ---------------------------------------------------------------------------------------------
# Checkpointer: what a save stores, a restore puts back


def tiny_run(cfg: Config, seed: int) -> SimpleNamespace:
    """A model, an optimizer and an LR schedule with state (two steps), as a `Run` holds them."""
    torch.manual_seed(seed)
    model = tiny_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(2):
        sum((p * p).sum() for p in model.parameters()).backward()
        opt.step()
        sched.step()
    return SimpleNamespace(model=model, optimizers=[opt], schedulers=[sched], plan=None)


def test_a_restore_puts_back_everything_a_save_stored(tmp_path):
    cfg = tiny_config()
    tables = SimpleNamespace(cardinalities=list(CARDS), multi_hot_sizes=[1, 2, 1], dense_format="float")
    saved = tiny_run(cfg, 1)
    stats = RunStats(samples=40, train_s=1.5, train_losses=[[5, 0.7]], best={"step": 4, "metric": "auc", "auc": 0.6},
                     evals_since_best=1)
    seed_with_pending_gaussians(11)
    path = Checkpointer(tmp_path, cfg, tables, DistEnv()).save(saved, ckpt.Position(5, 1, 2), stats)
    expected = draws()

    run = tiny_run(cfg, 2)
    seed_with_pending_gaussians(12)
    pos, restored_stats = Checkpointer(tmp_path, cfg, tables, DistEnv()).restore(path, run)
    assert draws() == expected  # Python, NumPy and torch generators where the save left them
    assert pos == ckpt.Position(5, 1, 2) and restored_stats == stats
    for k, v in saved.model.state_dict().items():
        assert torch.equal(run.model.state_dict()[k], v), k
    a, b = saved.optimizers[0].state_dict(), run.optimizers[0].state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        for name, value in st.items():
            assert torch.equal(value, b["state"][pid][name]), (pid, name)
    assert run.schedulers[0].state_dict() == saved.schedulers[0].state_dict()


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints


@pytest.mark.parametrize("which,change,message", [
    ("manifest", lambda d: d["sharded"]["plan"].update(world_size=3),
     "checkpoint key 'sharded.plan.world_size' must be sharded.world_size (2), got int 3"),
    ("manifest", lambda d: d["sharded"]["plan"].update(table_rank=[0, 2, 1]),
     "checkpoint key 'sharded.plan.table_rank' must be one int in [-1, 2) per table"),
    ("shard", lambda d: d.update(rank=2), "checkpoint key 'rank' must be an int in [0, 2), got int 2"),
    ("shard", lambda d: d["plan"].update(table_rank=[0, -2, 1]),
     "checkpoint key 'plan.table_rank' must be one int in [-1, 2) per table"),
    # a valid plan, not the manifest's: its rows are laid out otherwise
    ("shard", lambda d: d["plan"].update(table_rank=[0, 1, 0]), "sharding plan differs from the one of its manifest"),
])
def test_a_malformed_manifest_or_shard_is_named(tmp_path, which, change, message):
    manifest = save_sharded(tmp_path, tiny_state())
    path = manifest if which == "manifest" else manifest.parent / dist_ckpt.shard_name(3, 1, 2)
    disk = raw_disk(path)
    change(disk)
    torch.save(disk, path)
    with pytest.raises(ConfigError) as e:
        merge_mod.merge_to_file(manifest, tmp_path / "merged.pt")
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "merged.pt").exists()


@pytest.mark.parametrize("rows,dtype,message", [
    (5, torch.float32, "shard of rank 1 has 5 rows, the plan says 4"),  # one row too many: never silently dropped
    (3, torch.float32, "shard of rank 1 has 3 rows, the plan says 4"),
    (4, torch.bfloat16, "shard of rank 1 holds torch.bfloat16 rows of shape (2,), rank 0 torch.float32 rows"),
])
def test_shards_that_do_not_fit_the_plan_are_not_assembled(rows, dtype, message):
    plan = plan_sharding(CARDS, 2, "row", 1)
    assert (plan.local_rows(0), plan.local_rows(1)) == (6, 4)
    shards = [torch.zeros(6, 2), torch.zeros(rows, 2, dtype=dtype)]
    with pytest.raises(ConfigError) as e:
        dist_ckpt.assemble(plan, shards)
    assert str(e.value).startswith(message)


def test_shards_of_another_step_than_their_manifest_are_refused(tmp_path):
    """A manifest naming another checkpoint's shards (each of the right rank and plan): the resume or merge would go on
    from that step, not the manifest's."""
    save_sharded(tmp_path, tiny_state(step=3))
    manifest = save_sharded(tmp_path, tiny_state(step=6))
    disk = raw_disk(manifest)
    disk["sharded"]["shards"] = [dist_ckpt.shard_name(3, q, 2) for q in range(2)]
    torch.save(disk, manifest)
    message = r"rank0-of-2.pt: at \{'step': 3, .*\}, where its manifest .*step-00000006.pt is at \{'step': 6, "
    with pytest.raises(ConfigError, match=message):
        merge_mod.merge_to_file(manifest, tmp_path / "merged.pt")
    plan = plan_sharding(CARDS, 2, "row", 1)
    with pytest.raises(ConfigError, match=message):
        dist_ckpt.load_for_rank(manifest, StubEnv(0, 2), plan)
    assert not (tmp_path / "merged.pt").exists()


def test_a_merged_checkpoint_has_a_one_process_models_keys(tmp_path):
    """The bf16 shards' stochastic-rounding seed is left out of the merged model (a one-process table keeps it out of
    its state_dict): the merged checkpoint loads into the one-process model."""
    cfg = tiny_config()
    state = tiny_state(cfg=cfg)
    state["model"] = {**state["model"], "sparse_arch.sr_seed": torch.tensor([7])}
    merged = merge_mod.merge_to_file(save_sharded(tmp_path / "run", state), tmp_path / "merged.pt")
    assert "sparse_arch.sr_seed" not in merged["model"]
    compatible(ckpt.load_checkpoint(tmp_path / "merged.pt"), cfg)


def test_shards_whose_sparse_optimizer_states_differ_are_named(tmp_path):
    manifest = save_sharded(tmp_path / "run", tiny_state())
    shard = manifest.parent / dist_ckpt.shard_name(3, 1, 2)
    disk = raw_disk(shard)
    disk["optimizers"][1]["state"][0] = {"momentum": torch.zeros(4)}
    torch.save(disk, shard)
    with pytest.raises(ConfigError, match=r"step-00000003.pt: the sparse optimizer's state 0 differs between ranks 0 "
                                          r"and 1$"):
        merge_mod.merge_to_file(manifest, tmp_path / "merged.pt")


def test_a_resume_needs_the_manifest_its_ranks_and_its_plan(tmp_path):
    manifest = save_sharded(tmp_path / "run", tiny_state())
    plan = plan_sharding(CARDS, 2, "row", 1)
    assert dist_ckpt.load_for_rank(manifest, StubEnv(1, 2), plan)["rank"] == 1
    shard = manifest.parent / dist_ckpt.shard_name(3, 1, 2)
    one = tmp_path / "one.pt"
    ckpt.write_atomic(one, tiny_state())
    refusals = [
        (manifest, DistEnv(), None, "written by 2 ranks, resumed by 1; resume with torchrun --nproc-per-node 2"),
        (manifest, StubEnv(0, 3), plan, "written by 2 ranks, resumed by 3"),
        (manifest, StubEnv(0, 2), plan_sharding(CARDS, 2, "table", 1), "sharding plan differs"),
        (shard, DistEnv(), None, "one shard of a sharded checkpoint; resume from its manifest (step-00000003.pt)"),
        (one, StubEnv(0, 2), plan, "a one-process checkpoint cannot be resumed by 2 ranks"),
    ]
    for path, env, rank_plan, message in refusals:
        with pytest.raises(ConfigError) as e:
            dist_ckpt.load_for_rank(path, env, rank_plan)
        assert str(e.value).startswith(f"{path}: ") and message in str(e.value), (message, str(e.value))


def test_merge_never_replaces_an_out_that_appeared_while_it_ran(tmp_path, monkeypatch):
    manifest = save_sharded(tmp_path / "run", tiny_state())
    out = tmp_path / "merged.pt"
    check_same_run = merge_mod.check_same_run

    def and_meanwhile(path):
        check_same_run(path)
        out.write_text("mine")  # another merge, or the user, wrote OUT after the check at the start

    monkeypatch.setattr(merge_mod, "check_same_run", and_meanwhile)
    with pytest.raises(ConfigError, match=r"merged.pt: already exists"):
        merge_mod.merge_to_file(manifest, out)
    assert out.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["merged.pt", "run"]
    monkeypatch.undo()
    out.unlink()
    merged = merge_mod.merge_to_file(manifest, out)
    assert torch.equal(ckpt.load_checkpoint(out)["model"][SPARSE], merged["model"][SPARSE])


# ---------------------------------------------------------------------------------------------
# Export: the output file


@pytest.fixture
def stub_export(monkeypatch):
    """torch.export's export and save replaced: the program is a marker, saving it writes the marker; the calls."""
    calls = []
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: calls.append("export") or "program")
    monkeypatch.setattr(torch.export, "save", lambda program, f: calls.append("save") or Path(f).write_text(program))
    return calls


def test_export_writes_through_its_own_temporary_file(tmp_path, stub_export):
    mine = tmp_path / ".tmp-m.pt2"  # the user's file, named as the temporary file once was
    mine.write_text("mine")
    out = export_mod.export_model(tiny_model(tiny_config()), tmp_path / "m.pt2")
    assert out.read_text() == "program" and mine.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-m.pt2", "m.pt2"]


@pytest.mark.parametrize("stop", [SystemExit(143), KeyboardInterrupt()])
def test_a_stop_inside_a_checkpoint_write_is_raised_as_itself(tmp_path, monkeypatch, stop):
    """A second SIGTERM while a checkpoint is written raises `GracefulStop`'s SystemExit inside the file's ``write``,
    which torch's zip writer turned into "RuntimeError: [enforce fail at inline_container.cc] unexpected pos": a
    traceback, "this is a bug", exit 1 on every rank (found by a QA pass, 2026-12-04). The stop now leaves as itself,
    and no temporary file stays."""
    real, calls = ckpt._ProgressFile.write, []

    class Signalled:  # the file, whose second write is where the signal's handler runs
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise stop

    def write(self, data):
        calls.append(len(data))
        if len(calls) == 2:
            self._f = Signalled(self._f)
        return real(self, data)

    monkeypatch.setattr(ckpt._ProgressFile, "write", write)
    with pytest.raises(type(stop)) as raised:
        ckpt.write_atomic(tmp_path / "step-3.pt", tiny_state())
    assert raised.value is stop and list(tmp_path.iterdir()) == []


def test_a_ctrl_c_as_the_exports_temporary_file_is_created_leaves_nothing(tmp_path, stub_export, monkeypatch):
    """A Ctrl-C right after the temporary file's creation, before the `try` that removes it: the file stayed beside OUT
    (seen once in a QA pass, 2026-12-04). The signal now waits until the file is marked as the export's."""
    import signal

    real_open = export_mod.os.open

    def open_then_ctrl_c(path, *args):
        fd = real_open(path, *args)
        if str(path).endswith(".tmp.pt2"):
            signal.raise_signal(signal.SIGINT)  # Python's handler runs here, before the export could mark it
        return fd

    monkeypatch.setattr(export_mod.os, "open", open_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        export_mod.export_model(tiny_model(tiny_config()), tmp_path / "m.pt2")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and stub_export == ["export"]


@pytest.mark.parametrize("dangling", [False, True])
def test_export_refuses_an_existing_file_or_a_dangling_symlink_before_exporting(tmp_path, stub_export, dangling):
    out = tmp_path / "m.pt2"
    if dangling:
        out.symlink_to(tmp_path / "nowhere.pt2")
    else:
        out.write_text("mine")
    with pytest.raises(ConfigError, match=r"--export: .*m.pt2 already exists"):
        export_mod.export_model(tiny_model(tiny_config()), out)
    assert stub_export == []  # refused at once, not after the export's work
    assert out.is_symlink() == dangling and sorted(p.name for p in tmp_path.iterdir()) == ["m.pt2"]
    if not dangling:
        assert out.read_text() == "mine"


def test_export_into_a_missing_directory_is_refused_before_exporting(tmp_path, stub_export):
    with pytest.raises(ConfigError, match=r"^--export: directory .*missing does not exist$"):
        export_mod.export_model(tiny_model(tiny_config()), tmp_path / "missing" / "m.pt2")
    assert stub_export == [] and list(tmp_path.iterdir()) == []


def test_the_exported_program_returns_plain_probabilities_and_the_model_stays_trainable(tmp_path):
    """A program loaded back and called as a user would (no no_grad around it) returns probabilities without an
    autograd graph, so `.numpy()` works, equal to the model's own; the exported model's parameters that were
    trainable still are."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = build_model(cfg.model, [7] * 26, None, cfg.kernels, "cpu").eval()  # Criteo's 26 features, as exported
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    path = export_mod.export_model(model, tmp_path / "m.pt2")
    assert trainable and [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    program = torch.export.load(str(path)).module()
    dense = torch.randint(0, 50, (3, 13))
    raw = torch.randint(-1, 2**40, (3, 26))
    probs = program(dense, raw)
    assert not probs.requires_grad and probs.grad_fn is None
    with torch.no_grad():
        expected = export_mod.RawInputDLRM(model)(dense, raw)
    np.testing.assert_allclose(probs.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)


def test_the_portable_model_is_fp32_whatever_the_config_says(tmp_path):
    """An exported program must not need this package's Triton ops: a bf16 checkpoint's tables come out fp32 PyTorch
    modules from a config that asks for bf16 tables and "auto" kernels; the caller's config is left as it was."""
    cfg = tiny_config(embedding_dtype="bf16")
    state = tiny_state(cfg=cfg)
    state["model"][SPARSE] = state["model"][SPARSE].to(torch.bfloat16)
    ckpt.write_atomic(tmp_path / "c.pt", state)
    tables = Tables(list(CARDS), None, "modulus")
    model = export_mod.model_from_checkpoint(cfg, tmp_path / "c.pt", tables, torch.device("cpu"), portable=True)
    assert model.sparse_arch.weight.dtype == torch.float32
    assert torch.equal(model.sparse_arch.weight, state["model"][SPARSE].float())
    assert cfg.model.embedding_dtype == "bf16" and cfg.kernels.embedding == "auto"


def test_export_never_replaces_a_file_that_appeared_while_it_ran(tmp_path, monkeypatch):
    out = tmp_path / "m.pt2"

    def save_and_meanwhile(program, f):
        Path(f).write_text(program)
        out.write_text("mine")

    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: "program")
    monkeypatch.setattr(torch.export, "save", save_and_meanwhile)
    with pytest.raises(ConfigError, match=r"--export: .*m.pt2 already exists"):
        export_mod.export_model(tiny_model(tiny_config()), out)
    assert out.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["m.pt2"]


def test_a_failed_export_leaves_no_file(tmp_path, monkeypatch):
    def failing_save(program, f):
        Path(f).write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: "program")
    monkeypatch.setattr(torch.export, "save", failing_save)
    with pytest.raises(OSError):
        export_mod.export_model(tiny_model(tiny_config()), tmp_path / "m.pt2")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# The resume policy


def test_a_checkpoint_config_without_data_path_is_a_config_error():
    """A checkpoint's config that no longer validates is compared as it is: a key it lacks is a difference, never a
    KeyError (data.path was looked up unguarded)."""
    current = tiny_config().to_dict()
    saved = {k: v for k, v in current.items() if k != "data"}
    with pytest.raises(ConfigError, match=r"^--resume c.pt: the config differs .*data.path: \(absent\) -> "):
        check_resume_config(saved, current, (), "c.pt")
    check_resume_config(saved, current, ("data",), "c.pt")  # allowed: goes through


def test_a_free_key_frees_only_itself_and_what_is_under_it():
    """``train.log_every`` is free; a key that only starts with the same letters (``train.log_every_x``) is not."""
    current = tiny_config().to_dict()
    saved = {**current, "train": {**current["train"], "log_every_x": 1}}
    with pytest.raises(ConfigError, match=r"train.log_every_x: 1 -> \(absent\)"):
        check_resume_config(saved, current, (), "c.pt")
    check_resume_config({**current, "log": {"run_name": "other"}}, current, (), "c.pt")


# ---------------------------------------------------------------------------------------------
# The run directory


def test_a_failed_resume_keeps_the_run_it_resumes(tmp_path):
    """A resume writes into an existing run: failing before its first step must not remove what the run holds."""
    cfg = tiny_config()
    cfg.log.tb_dir, cfg.log.run_name = str(tmp_path), "run"
    manifest = save_sharded(tmp_path / "run", tiny_state())
    before = sorted(p.name for p in manifest.parent.iterdir())
    run, copied = RunDirectory.for_resume(cfg, manifest, manifest)
    assert not copied and run.path == tmp_path / "run"
    run.abandon()
    assert sorted(p.name for p in manifest.parent.iterdir()) == before


def test_a_failed_start_keeps_an_empty_directory_it_did_not_make(tmp_path):
    cfg = tiny_config()
    mine = tmp_path / "mine"
    mine.mkdir()
    RunDirectory.create(cfg, mine).abandon()
    assert mine.is_dir()
    RunDirectory.create(cfg, tmp_path / "new").abandon()
    assert not (tmp_path / "new").exists()


def test_a_dangling_symlink_as_the_run_directory_is_named(tmp_path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"run is a dangling symbolic link; remove it or choose another --run-name"):
        RunDirectory.create(tiny_config(), link)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_released_lock_is_not_taken_for_a_stale_one(tmp_path):
    RunLock.acquire(tmp_path).release()
    assert (tmp_path / ".lock").read_text() == ""
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        RunLock.acquire(tmp_path).release()
    finally:
        logger.remove(handle)
    assert seen == []
