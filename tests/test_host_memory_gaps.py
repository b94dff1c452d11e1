"""The CPU host-memory check before the build (`dlrm.train.builder.refuse_host_memory_shortfall`, exit 4; its earlier
tests: tests/test_host_memory_tables.py, tests/test_host_memory_limits.py), gaps found in review on 2026-12-04:

(1) cgroup v2's memory.high was not read: a cgroup whose memory.high is below its memory.max throttles and reclaims
    the run above memory.high (without swap it crawls, never killed), and a model larger than memory.high passed the
    check. Now the lower of the two is the limit, the line naming the file that binds.
(2) --eval-only and --export were not checked: they read the checkpoint whole (its optimizer state too) beside the
    model they build from it, and an export serializes the weights twice more (measured: 1.3 and 2.0 GiB above the
    interpreter where a training run is weighed at 674.5 MiB); short of it, the OOM killer ended them without a word.
    Now that need is weighed before the checkpoint is read (`dlrm.train.checkpoint_memory`): exit 4, one line, nothing
    written.
(3) There was no way past a refusal whose estimate is wrong for a system (train.allow_swap counts swap only, and
    beyond memory and swap refuses either way). Now train.check_host_memory false turns each refusal into a warning
    with its numbers, and the run goes on.
(4) A one-process --resume weighed the model as a fresh run does, yet held the checkpoint read whole (its tables and
    optimizer state) through the build while the restore read it again: peak RSS 2.0 GiB above the interpreter for a
    model weighed at 674.5 MiB (a fresh run: 0.8 GiB). Then the held copy dropped its weights and optimizer state
    before the build, and the restore's read was weighed with the model. Since 2026-12-04 (session 81) the checkpoint
    is memory-mapped (`dlrm.mapped_load`): no copy in the process's memory, so a resume fits where a fresh run does;
    its mapping is weighed against the process's rlimits (exit 4 naming the checkpoint, with advice that a resume can
    take: data.max_rows_per_table cannot change there), and no tensor of it is alive through the build nor in
    training (an optimizer's state is its own copy).

The memory is faked (`builder._host_memory`, or the files under /proc/self and /sys/fs/cgroup read from a tree under
tmp_path); the models trained are small (26 tables of 5000 rows)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import dlrm.train.builder as builder
from dlrm import cli
from dlrm.config import Config, ConfigError, ModelConfig, validate
from dlrm.train import export
from dlrm.train.checkpoint_memory import checkpoint_host_need
from dlrm.train.host_memory import HostMemory, cgroup_limits, read_host_memory
from dlrm.train.setup import Tables
from tests.conftest import make_dataset
from tests.test_audit_killfuzz import CONFIG
from tests.test_cli_errors import error_line, invoke
from tests.test_host_memory_limits import V2_MOUNT, _files, _one_process_need, fake_proc  # noqa: F401 (a fixture)

GiB, MiB = 2**30, 2**20

TABLES = Tables([10**6] * 26, None, "modulus")  # 26M rows x 16 fp32 with row-wise Adagrad: 1.6 GiB


def _cfg(allow_swap: bool = False):
    cfg = validate(Config())
    cfg.model.embedding_dim, cfg.model.embedding_dtype = 16, "fp32"
    cfg.train.allow_swap = allow_swap
    return cfg


# ------------------------------------------------------------------------------------------------------------------
# (1) cgroup v2's memory.high


def _job(root, **limits) -> str:
    """A cgroup v2 job (limits on it) holding this process in a task cgroup below it without limits of its own."""
    _files(root, "/proc/self", cgroup="0::/job/task", mountinfo=V2_MOUNT)
    _files(root, "/sys/fs/cgroup/job/task", memory__max="max", memory__high="max", memory__current=MiB,
           memory__stat="inactive_file 0")
    _files(root, "/sys/fs/cgroup/job", memory__current=256 * MiB, memory__stat=f"inactive_file {128 * MiB}", **limits)
    return "/sys/fs/cgroup/job"  # (as this process names it: the fixture reads it from under root)


def test_a_memory_high_below_memory_max_is_the_limit_and_named(fake_proc):
    """memory.high 1 GiB under memory.max 8 GiB: 1 GiB less the 128 MiB in use (the page cache counted free) is what
    the model may take; the 1.6 GiB model is refused naming memory.high, the model within it is not."""
    job = _job(fake_proc, memory__max=8 * GiB, memory__high=GiB)
    memory, _, limit = cgroup_limits()
    assert memory == GiB - 128 * MiB and builder._process_room() == GiB - 128 * MiB
    assert limit == (f"{job}/memory.high 1.0 GiB, 128.0 MiB of it in use, below memory.max 8.0 GiB: above "
                     "memory.high the kernel throttles the run and reclaims its memory, and it crawls"), limit
    with pytest.raises(MemoryError) as raised:
        builder.refuse_host_memory_shortfall(_cfg(), TABLES, read_host_memory())
    text = str(raised.value)
    assert (f"more than the 896.0 MiB the cgroup's memory limit leaves ({job}/memory.high 1.0 GiB, 128.0 MiB of it "
            "in use, below memory.max 8.0 GiB: above memory.high") in text, text
    assert "\n" not in text
    builder.refuse_host_memory_shortfall(_cfg(), Tables([10**5] * 26, None, "modulus"), read_host_memory())


def test_a_memory_high_without_memory_max_binds_and_memory_max_below_it_binds(fake_proc):
    job = _job(fake_proc, memory__max="max", memory__high=2 * GiB)
    assert cgroup_limits()[0] == 2 * GiB - 128 * MiB
    assert cgroup_limits()[2].startswith(f"{job}/memory.high 2.0 GiB, 128.0 MiB of it in use, memory.max none:")
    _job(fake_proc, memory__max=GiB, memory__high=2 * GiB)  # memory.max the lower: it binds, as before
    assert cgroup_limits() == (GiB - 128 * MiB, None, f"{job}/memory.max 1.0 GiB, 128.0 MiB of it in use")
    _job(fake_proc, memory__max=GiB, memory__high="max")
    assert cgroup_limits()[0] == GiB - 128 * MiB


def test_a_memory_high_on_an_ancestor_below_a_jobs_memory_max_binds(fake_proc):
    """The tightest level wins, whichever file it is: memory.max 4 GiB on the job, memory.high 1 GiB on its slice."""
    _files(fake_proc, "/proc/self", cgroup="0::/slice/job", mountinfo=V2_MOUNT)
    _files(fake_proc, "/sys/fs/cgroup/slice/job", memory__max=4 * GiB, memory__current=MiB, memory__stat="")
    _files(fake_proc, "/sys/fs/cgroup/slice", memory__max="max", memory__high=GiB, memory__current=MiB,
           memory__stat="")
    memory, _, limit = cgroup_limits()
    assert memory == GiB - MiB and limit.startswith("/sys/fs/cgroup/slice/memory.high 1.0 GiB"), limit


def test_swap_counted_under_allow_swap_still_names_the_binding_file():
    """Above memory.high the kernel reclaims to swap: with train.allow_swap the free swap counts there as it does
    under memory.max, and the line still names the file."""
    memory = HostMemory(available=64 * GiB, swap_free=GiB, cgroup=GiB, cgroup_limit="/cg/memory.high 1.0 GiB")
    with pytest.raises(MemoryError) as raised:
        builder.refuse_host_memory_shortfall(_cfg(allow_swap=True), Tables([2 * 10**6] * 26, None, "modulus"), memory)
    assert ("more than the 2.0 GiB the cgroup's memory and swap limits leave (/cg/memory.high 1.0 GiB; with its free "
            "swap, counted under train.allow_swap)") in str(raised.value), raised.value
    builder.refuse_host_memory_shortfall(_cfg(allow_swap=True), TABLES, memory)  # 1.6 GiB: within memory and swap


# ------------------------------------------------------------------------------------------------------------------
# (2) --eval-only and --export


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 steps on 26 tables of 5000 rows (D 4, Adam and row-wise Adagrad): its checkpoint and config."""
    root = tmp_path_factory.mktemp("trained")
    make_dataset(root / "ds", {"train": 40, "validation": 20}, cardinality=5000)
    cfg = {"data": {"path": str(root / "ds"), "batch_size": 20}, "model": CONFIG["model"], "optim": CONFIG["optim"],
           "train": {"device": "cpu", "max_steps": 2, "baseline": False}}
    (root / "c.json").write_text(json.dumps(cfg))
    result = invoke(root, root / "c.json", "--run-name", "r")
    assert result.exit_code == 0, result.output
    return root, root / "tb" / "r" / "checkpoints" / "best.pt"


def _loaded(root, checkpoint, portable: bool):
    """(config, tables, model) as --eval-only (`portable` False) or --export builds them from `checkpoint`."""
    from dlrm.config import load_config
    from dlrm.train.trainer import build_for_data

    cfg = load_config(str(root / "c.json"))
    tables = build_for_data(cfg)[3]
    cfg = export.as_trained(cfg, tables)
    return cfg, tables, export.model_from_checkpoint(cfg, checkpoint, tables, torch.device("cpu"), portable)


def test_the_need_counts_the_model_built_and_the_checkpoint_maps_beside_it(trained, monkeypatch):
    """The estimate against the real thing: the bytes of every tensor of the model built from the checkpoint (an
    export's: three times them, the model and two serialized copies); the checkpoint memory-mapped beside it, its
    size in address space (`mapped_bytes`)."""
    from dlrm.train.checkpoint_memory import mapped_bytes

    root, checkpoint = trained
    monkeypatch.setattr(builder, "_host_memory", HostMemory)  # (nothing known: nothing refused)
    for portable in (False, True):
        cfg, tables, model = _loaded(root, checkpoint, portable)
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        need, what = checkpoint_host_need(cfg, tables, checkpoint, portable)
        assert need == (3 * weights if portable else weights), (portable, need, weights, what)
    assert mapped_bytes(checkpoint) == checkpoint.stat().st_size > weights  # (the optimizers' state is in the file)
    assert mapped_bytes(checkpoint.parent / "missing.pt") == 0


def _invoke(root, *args):
    """train.py's main in-process; --eval-only's run directory under root/tb (a bare export takes no --tb-dir)."""
    if "--eval-only" in args:
        return invoke(root, root / "c.json", *args)
    return CliRunner().invoke(cli.main, ["--config", str(root / "c.json"), *args])


@pytest.mark.parametrize("mode", ["--eval-only", "--export"])
def test_eval_only_and_export_short_of_host_memory_are_refused_before_the_checkpoint_is_read(trained, monkeypatch,
                                                                                              mode):
    root, checkpoint = trained
    out = root / f"m-{mode[2:]}.pt2"
    args = (["--eval-only", "--run-name", "e"] if mode == "--eval-only" else ["--export", str(out)])
    monkeypatch.setattr(builder, "_host_memory", HostMemory)
    cfg, tables, _ = _loaded(root, checkpoint, mode == "--export")
    need = checkpoint_host_need(cfg, tables, checkpoint, mode == "--export")[0]

    def read(path):
        raise AssertionError(f"{path} read")

    with monkeypatch.context() as m:
        m.setattr(builder, "_host_memory", lambda: HostMemory(available=need - 1))
        m.setattr(export.ckpt, "load_checkpoint", read)
        line = error_line(_invoke(root, "--checkpoint", str(checkpoint), *args), 4,
                          f"{mode} of {checkpoint} needs ", "of host memory, ",
                          "more than the ", "the host has available (MemAvailable): run it on a host with more free "
                          "memory")
    written = root / "tb" / "e" / "summary.json" if mode == "--eval-only" else out
    assert not written.parent.exists() if mode == "--eval-only" else not out.exists(), line  # nothing written
    m = HostMemory(available=need)  # exactly enough: it runs
    monkeypatch.setattr(builder, "_host_memory", lambda: m)
    result = _invoke(root, "--checkpoint", str(checkpoint), *args)
    assert result.exit_code == 0, result.output
    assert written.is_file()


def test_a_checkpoints_need_counts_swap_under_allow_swap_and_no_rlimit_is_lifted(trained, monkeypatch):
    root, checkpoint = trained
    monkeypatch.setattr(builder, "_host_memory", HostMemory)
    cfg, tables, _ = _loaded(root, checkpoint, False)
    need = checkpoint_host_need(cfg, tables, checkpoint, False)[0]
    from dlrm.train.checkpoint_memory import refuse_checkpoint_shortfall

    short = HostMemory(available=need // 2, swap_free=need)
    with pytest.raises(MemoryError, match=r"or set train\.allow_swap true to go on with .* of it in swap, of "):
        refuse_checkpoint_shortfall(cfg, tables, checkpoint, False, short)
    cfg.train.allow_swap = True
    refuse_checkpoint_shortfall(cfg, tables, checkpoint, False, short)  # warned: it goes on in swap
    with pytest.raises(MemoryError, match=r"this process may take \(ulimit -v, ulimit -d\): raise those limits, or run "
                                          r"it on a GPU \(--device cuda"):
        refuse_checkpoint_shortfall(cfg, tables, checkpoint, False,
                                    HostMemory(available=need, swap_free=need, process=need - 1))

    from dlrm.train.checkpoint_memory import mapped_bytes

    # the model and the mapping fit, what the evaluation maps after them (threads, buffers: `later_address_space`,
    # as a training run counts it) does not: refused before the build, not a death of libgomp or a segfault later
    mapped = mapped_bytes(checkpoint)
    fits = HostMemory(available=need, process=need + mapped + 10 * MiB, reserved=10 * MiB)
    refuse_checkpoint_shortfall(cfg, tables, checkpoint, False, fits)  # exactly enough: it goes on
    with pytest.raises(MemoryError, match=r"and maps the checkpoint \(.*\) and 10\.0 MiB for its threads \(stacks, "
                                          r"malloc arenas\) and buffers beside it, more than the .* this process may "
                                          r"take \(ulimit -v, ulimit -d; 0\.0 MiB more at least\): raise those limits"):
        refuse_checkpoint_shortfall(cfg, tables, checkpoint, False,
                                    HostMemory(available=need, process=need + mapped + 10 * MiB - 1,
                                               reserved=10 * MiB))


# ------------------------------------------------------------------------------------------------------------------
# (3) the opt-out: train.check_host_memory false


def test_check_host_memory_false_trains_evaluates_and_exports_with_a_warning_of_the_numbers(trained, monkeypatch):
    """1 MiB available, no swap: refused with the key at its default (even with train.allow_swap), each goes on with
    it false, warning with the refusal's numbers."""
    root, checkpoint = trained
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=MiB))
    cfg = json.loads((root / "c.json").read_text())
    cfg["train"]["allow_swap"] = True
    (root / "c.json").write_text(json.dumps(cfg))
    error_line(invoke(root, root / "c.json", "--run-name", "t"), 4, "more than the 1.0 MiB the host has available "
               "with its free swap")
    error_line(_invoke(root, "--checkpoint", str(checkpoint), "--eval-only", "--run-name", "e3"), 4,
               "--eval-only of ", "more than the 1.0 MiB the host has available")
    cfg["train"]["check_host_memory"] = False
    (root / "c.json").write_text(json.dumps(cfg))
    try:
        result = invoke(root, root / "c.json", "--run-name", "t")
        assert result.exit_code == 0, result.output
        warned = [line for line in result.stderr.splitlines() if "WARNING" in line and "host memory:" in line]
        assert len(warned) == 1 and "the model needs " in warned[0] and (
            "more than the 1.0 MiB the host has available with its free swap") in warned[0], result.stderr
        assert warned[0].endswith("going on: train.check_host_memory is false (short of memory, the OOM killer ends "
                                  "the run without a word)"), warned
        out = root / "m-opt.pt2"
        for args, written in ((["--eval-only", "--run-name", "e3"], root / "tb" / "e3" / "summary.json"),
                              (["--export", str(out)], out)):
            result = _invoke(root, "--checkpoint", str(checkpoint), *args)
            assert result.exit_code == 0 and written.is_file(), result.output
            assert f"{args[0]} of {checkpoint} needs " in result.stderr and (
                "going on: train.check_host_memory is false") in result.stderr, result.stderr
    finally:
        del cfg["train"]["check_host_memory"], cfg["train"]["allow_swap"]
        (root / "c.json").write_text(json.dumps(cfg))


def test_check_host_memory_false_lets_dense_layers_past_the_process_limit_on_the_cpu(monkeypatch):
    dcn = ModelConfig(embedding_dim=8, bottom_mlp=[32, 8], top_mlp=[32, 1], interaction="dcn", cross_layers=2,
                      cross_rank=1000)
    monkeypatch.setattr(builder, "_process_room", lambda: MiB)
    with pytest.raises(ConfigError, match="more than this process's"):
        builder.refuse_dense_layers_beyond_memory(dcn, 26, torch.device("cpu"), 4)
    builder.refuse_dense_layers_beyond_memory(dcn, 26, torch.device("cpu"), 4, check_host=False)


def test_check_host_memory_is_validated_and_refused_where_it_cannot_act(tmp_path):
    from dlrm.config import load_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"check_host_memory": "no"}}))
    with pytest.raises(ConfigError, match=r"train\.check_host_memory: expected true or false, got 'no'"):
        load_config(str(path))
    path.write_text(json.dumps({"train": {"check_host_memory": False, "device": "cuda"}}))
    with pytest.raises(ConfigError, match=r"train\.check_host_memory: false has no effect: it acts with train\.device "
                                          r'"auto" or "cpu" only'):
        load_config(str(path), {}, "refuse")


# ------------------------------------------------------------------------------------------------------------------
# (4) --resume: the checkpoint the restore reads beside the built model


def test_a_resume_maps_the_checkpoint_fits_where_a_fresh_run_does_and_holds_none_of_it_after_the_restore(
        tmp_path, monkeypatch):
    import gc

    import dlrm.checkpoint as ckpt_mod
    import dlrm.train.trainer as trainer

    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, cardinality=5000)
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 20}, "model": CONFIG["model"], "optim": CONFIG["optim"],
           "train": {"device": "cpu", "max_steps": 2, "baseline": False}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    assert invoke(tmp_path, tmp_path / "c.json", "--run-name", "r").exit_code == 0
    checkpoint = tmp_path / "tb" / "r" / "checkpoints" / "step-00000002.pt"
    size = checkpoint.stat().st_size
    assert builder.resume_read_bytes(checkpoint) == size
    assert builder.resume_read_bytes(None) == 0
    tables, dense = _one_process_need(ModelConfig(**{**vars(ModelConfig()), **CONFIG["model"]}), 26 * 5000, 4)
    need = tables + dense  # a fresh run's: fp32 rows with row-wise Adagrad, the dense layers with Adam's two moments
    resume = ("--run-name", "r", "--resume", "--max-steps", "4", "--epochs", "2")
    # under rlimits (ulimit -v, -d) the mapping's address space counts: refused with a fresh run's exact need
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=8 << 30, process=need))
    error_line(invoke(tmp_path, tmp_path / "c.json", *resume), 4, "the model needs ",
               f"the checkpoint it resumes from maps {size / MiB:,.1f} MiB more (memory-mapped), more than the ",
               "this process may take (ulimit -v, ulimit -d): ", ": resume it on a host with more free memory")

    def checkpoints_alive() -> list:
        # issubclass(type(o)): isinstance() on a dead weakref.proxy among the objects raises ReferenceError (the
        # clean-clone CI's worker held one); type() does not look through the proxy
        return [o for o in gc.get_objects() if issubclass(type(o), dict) and "position" in o and "model" in o]

    def mapped_now() -> list[str]:  # the files this process has mapped
        return [line.split()[-1] for line in open("/proc/self/maps") if line.rstrip().endswith(".pt")]

    # (checkpoints that earlier tests in this process left alive are not this resume's: kept referenced, so that
    # their ids are not reused, and left out)
    before = checkpoints_alive()
    earlier = {id(o) for o in before}
    held, at_build, at_save = [], [], []
    real, real_save = trainer.build_run, ckpt_mod.save_checkpoint

    def build_run(*a, **k):  # no checkpoint's tensors alive through the build (the restore reads them after it)
        held.extend(o for o in checkpoints_alive() if id(o) not in earlier)
        # nor any tensor of its first read's mapping (the RNG state's kept the whole file mapped, and the restore
        # mapped it again: twice its size in address space, which ulimit -v bounds)
        gc.collect()
        at_build.append(mapped_now())
        return real(*a, **k)

    def save_checkpoint(*a, **k):  # trained past the restore: nothing it loaded still views the file
        gc.collect()
        at_save.append(mapped_now())
        return real_save(*a, **k)

    monkeypatch.setattr(trainer, "build_run", build_run)
    monkeypatch.setattr(ckpt_mod, "save_checkpoint", save_checkpoint)
    # the host's memory a fresh run needs is enough: the checkpoint takes the page cache's
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=need))
    result = invoke(tmp_path, tmp_path / "c.json", *resume)
    assert result.exit_code == 0 and "resumed from " in result.stderr, result.output
    assert held == [], [sorted(h) for h in held]
    assert at_build and all(str(checkpoint) not in maps for maps in at_build), at_build
    assert at_save and all(str(checkpoint) not in maps for maps in at_save), at_save


def test_check_host_memory_false_lets_every_rank_go_on_and_rank_0_alone_warns(monkeypatch):
    """Under torchrun each rank reaches the same verdict: with the key false none raises, and one warning is said."""
    from dlrm.distributed.sharding import plan_sharding
    from tests.test_host_memory_limits import _Gathered

    cfg = _cfg()
    plan = plan_sharding(TABLES.cardinalities, 2, "row", 10)
    tight = HostMemory(available=MiB)
    entries = [("a", "alpha", plan.local_rows(q) * (16 * 4 + 4), tight, 0) for q in range(2)]
    with pytest.raises(MemoryError, match="^the 2 ranks on host alpha need "):
        builder.refuse_host_memory_shortfall(cfg, TABLES, tight, _Gathered(0, 2, entries), plan)
    cfg.train.check_host_memory = False
    warned = []
    monkeypatch.setattr(builder.run_logger, "warning", warned.append)
    for rank in range(2):
        builder.refuse_host_memory_shortfall(cfg, TABLES, tight, _Gathered(rank, 2, entries), plan)
    assert len(warned) == 1 and warned[0].startswith("host memory: the 2 ranks on host alpha need "), warned
    assert warned[0].endswith("going on: train.check_host_memory is false (short of memory, the OOM killer ends the "
                              "run without a word)"), warned


def test_an_export_after_training_refused_for_memory_says_the_run_is_kept(tmp_path, monkeypatch):
    """Training fits (the host has exactly its need), the export after it does not (three copies of the weights):
    exit 4 after the run, the line saying it is trained and kept and how to export it."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, cardinality=5000)
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 20}, "model": CONFIG["model"], "optim": CONFIG["optim"],
           "train": {"device": "cpu", "max_steps": 2, "baseline": False}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    tables, dense = _one_process_need(ModelConfig(**{**vars(ModelConfig()), **CONFIG["model"]}), 26 * 5000, 4)
    monkeypatch.setattr(builder, "_host_memory", lambda: HostMemory(available=tables + dense))
    out = tmp_path / "m.pt2"
    line = error_line(invoke(tmp_path, tmp_path / "c.json", "--run-name", "r", "--export", str(out)), 4,
                      "--export of ", "the two copies of its weights torch.export.save serializes")
    assert line.endswith(f"(the run is trained and kept: export it with --checkpoint {tmp_path / 'tb' / 'r'} "
                         "--export OUT.pt2)"), line
    assert (tmp_path / "tb" / "r" / "summary.json").is_file() and not out.exists()
