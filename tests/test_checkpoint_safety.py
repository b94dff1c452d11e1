"""Checkpoints are data, never code (issue #17): format 2 on disk, a schema check on load, format-1
conversion, refusal of pickles that would run code (library and CLI), stale temp files, fuzzing.

Sharded checkpoints and their merge are tested in test_checkpoint_safety_sharded.py, on the `trained` run
and with the helpers here (StubEnv and local_rows: the audit tests import them too)."""

import datetime
import json
import os
import random
import stat
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loguru import logger

from dlrm.config import ConfigError, load_config
from dlrm.model.dlrm import build_model
from dlrm import checkpoint as ckpt
from dlrm.train.trainer import build_for_data, train
from tests.conftest import REPO, make_dataset
from tests.prewarm.launch import real_python

CONFIG = {  # baseline off: no test here reads it, and its fit cost more CPU than a run's steps
    "data": {"batch_size": 8, "shuffle": True},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05},
              # a decay of its own length (the 3-step run's, to its end): the resumes of this run that extend it
              # (--max-steps 4, 6) go on with the same schedule; one that runs to the run's end is refused there
              # (its end moves: tests/test_resume_schedule_length.py)
              "schedule": {"warmup_steps": 2, "decay": "linear", "decay_steps": 3}},
    "train": {"epochs": 1, "log_every": 2, "device": "cpu", "deterministic": True, "seed": 3, "baseline": False},
    "checkpoint": {"every": 3, "keep": 2},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run: its config file, config, checkpoint path, and a model built as a resume would."""
    root = tmp_path_factory.mktemp("safety")
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(root / "ds")
    make_dataset(root / "ds", {"train": 200, "validation": 32, "test": 16}, row_group_size=50)
    cfg_path = root / "cfg.json"
    cfg_path.write_text(json.dumps(raw))
    cfg = load_config(cfg_path, {"log.tb_dir": str(root / "tb"), "log.run_name": "run", "train.max_steps": 3})
    path = Path(train(cfg)["checkpoint"])
    _, _, _, tables = build_for_data(cfg)
    model = build_model(cfg.model, tables.cardinalities, tables.vocabs, cfg.kernels, "cpu")
    return {"cfg_path": cfg_path, "cfg": cfg, "path": path, "model": model, "tables": tables}


def old_rng_state():
    """`rng_state()` as format 1 stored it (copied from the code before format 2)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def save_format_1(path: Path, state: dict) -> None:
    """What format 1's write_atomic put on disk: the in-memory state, pickled as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format_version": 1, **state}, path)


def seed_with_pending_gaussians(seed: int) -> None:
    """Seed the generators and leave a cached Gaussian in Python's and NumPy's states."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    random.gauss(0, 1)
    np.random.standard_normal()


def draws():
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.standard_normal()),
            torch.rand(1).item())


@contextmanager
def captured_logs():
    """loguru messages emitted inside the block."""
    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="DEBUG")
    try:
        yield messages
    finally:
        logger.remove(sink)


def raw_disk(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_one_line_error(text: str, *needles: str) -> None:
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert len(errors) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


class RunsShellCommand:
    """A pickle payload: unpickling it calls os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def malicious_checkpoint(path: Path, sentinel: Path) -> Path:
    torch.save({"format_version": 2, "model": RunsShellCommand(f"touch {sentinel}")}, path)
    return path


# ---------------------------------------------------------------------------------------------
# Format 2


def test_written_checkpoint_is_plain_data(trained):
    path = trained["path"]
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    disk = raw_disk(path)  # no allowlist needed
    assert disk["format_version"] == 2 and "config" not in disk and isinstance(disk["config_json"], str)
    assert disk["rng"]["python"]["state"].dtype == torch.int64 and disk["rng"]["python"]["state"].shape == (625,)
    assert disk["rng"]["numpy"]["key"].shape == (624,)
    state = ckpt.load_checkpoint(path)
    recorded = json.loads(disk["config_json"])
    # the config the run trained with: the given one, with the dataset's table sizes (`dlrm.train.setup.as_trained`)
    given = trained["cfg"].to_dict()
    tables = trained["tables"]
    sizes = None if tables.multi_hot_sizes is None else list(tables.multi_hot_sizes)
    given["model"].update(cardinalities=list(tables.cardinalities), multi_hot_sizes=sizes)
    assert state["config"] == recorded == given
    assert state["rng"]["python"][0] == 3 and len(state["rng"]["python"][1]) == 625
    assert state["rng"]["numpy"][0] == "MT19937" and state["rng"]["numpy"][1].dtype == np.uint32
    assert {"samples", "train_s", "train_losses"} <= set(state["run_stats"]) and state["run_stats"]["samples"] == 24


def test_checkpoints_are_ordinary_files(trained, tmp_path):
    """A checkpoint gets the mode of the run's other files (0666 less the umask: 0644 under 022), not mkstemp's 0600:
    a teammate's --eval-only or --export of a shared run read none of its checkpoints, best.pt included, while its
    config.json and summary read; under a private umask (077) it stays private (tests/test_file_modes.py)."""
    run = trained["path"].parent.parent
    config_mode = stat.S_IMODE((run / "config.json").stat().st_mode)
    for path in run.glob("checkpoints/*.pt"):
        assert stat.S_IMODE(path.stat().st_mode) == config_mode, path
    state = ckpt.load_checkpoint(trained["path"])
    for umask in (0o022, 0o077):
        old = os.umask(umask)
        try:
            ckpt.write_atomic(tmp_path / f"again-{umask:o}.pt", state)
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / f"again-{umask:o}.pt").stat().st_mode) == 0o666 & ~umask


def test_rng_streams_survive_a_format_2_round_trip(trained, tmp_path):
    state = ckpt.load_checkpoint(trained["path"])
    seed_with_pending_gaussians(11)
    state["rng"] = ckpt.rng_state()
    expected = draws()
    out = tmp_path / "again.pt"
    ckpt.write_atomic(out, state)
    seed_with_pending_gaussians(12)
    ckpt.set_rng_state(ckpt.load_checkpoint(out)["rng"])
    assert draws() == expected
    assert raw_disk(out)["format_version"] == 2


def test_a_large_checkpoint_shows_its_progress_and_writes_the_same_bytes(trained, tmp_path, monkeypatch, capsys):
    """A checkpoint of at least PROGRESS_BYTES (1 GiB; lowered here) is written through a progress bar on stderr
    that counts every byte; the file is byte for byte the one written without it, and loads."""
    state = ckpt.load_checkpoint(trained["path"])
    total = ckpt.tensor_bytes(ckpt.schema.to_disk(state))
    assert total > 1000
    ckpt.write_atomic(tmp_path / "quiet.pt", state)  # below the threshold: no bar
    assert "writing" not in capsys.readouterr().err
    monkeypatch.setattr(ckpt, "PROGRESS_BYTES", total)
    ckpt.write_atomic(tmp_path / "shown.pt", state)
    err = capsys.readouterr().err
    assert "writing shown.pt" in err and "100%" in err
    ckpt.write_atomic(tmp_path / "rank1.pt", state, progress=False)  # another rank's shard: no bar
    assert "writing" not in capsys.readouterr().err
    quiet, shown = (tmp_path / "quiet.pt").read_bytes(), (tmp_path / "shown.pt").read_bytes()
    assert shown == quiet == (tmp_path / "rank1.pt").read_bytes()
    assert ckpt.load_checkpoint(tmp_path / "shown.pt")["position"] == state["position"]


# ---------------------------------------------------------------------------------------------
# Format 1


def test_format_1_checkpoint_converts_with_one_warning_and_resumes(trained, tmp_path):
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k not in ("format_version", "run_stats")}
    seed_with_pending_gaussians(5)
    state["rng"] = old_rng_state()
    expected = draws()
    old = tmp_path / "tb" / "old" / "checkpoints" / ckpt.checkpoint_name(3)
    save_format_1(old, state)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(old)  # genuinely format 1: a pickled ndarray
    with pytest.raises(Exception):
        torch.load(old, weights_only=True)

    seed_with_pending_gaussians(6)
    with captured_logs() as messages:
        loaded = ckpt.load_checkpoint(old)
    converted = [m for m in messages if "converted format 1 checkpoint" in m]
    assert len(converted) == 1 and str(old) in converted[0] and "to format 2" in converted[0]
    assert loaded["config"] == state["config"] and loaded["position"] == state["position"]
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    ckpt.set_rng_state(loaded["rng"])
    assert draws() == expected

    cfg = load_config(trained["cfg_path"], {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "old",
                                            "train.max_steps": 6})
    summary = train(cfg, resume=str(old))
    assert summary["resumed_at_step"] == state["position"]["step"] == 3  # it went on from the converted checkpoint
    resumed = old.parent / ckpt.checkpoint_name(6)
    assert raw_disk(resumed)["format_version"] == 2  # what the resumed run writes is format 2
    assert ckpt.load_checkpoint(resumed)["position"]["step"] == 6


def test_format_1_needing_code_or_malformed_is_refused(trained, tmp_path):
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k != "format_version"}
    state["rng"] = old_rng_state()
    with_date = tmp_path / "date.pt"
    save_format_1(with_date, {**state, "config": {**state["config"], "when": datetime.date(2024, 1, 1)}})
    with pytest.raises(ConfigError, match=r"date.pt: refused: loading it would call 'datetime.date'"):
        ckpt.load_checkpoint(with_date)
    # numpy arrays are allowed only to be read: anywhere but the NumPy RNG state they are refused
    array_cards = tmp_path / "cards.pt"
    save_format_1(array_cards, {**state, "cardinalities": np.array(state["cardinalities"], dtype=np.uint32)})
    with pytest.raises(ConfigError, match=r"cards.pt: checkpoint key 'cardinalities' must be a non-empty list"):
        ckpt.load_checkpoint(array_cards)
    short_rng = tmp_path / "rng.pt"
    save_format_1(short_rng, {**state, "rng": {**state["rng"], "numpy": state["rng"]["numpy"][:3]}})
    with pytest.raises(ConfigError, match=r"rng.pt: checkpoint key 'rng' is not format 1's RNG states"):
        ckpt.load_checkpoint(short_rng)


# ---------------------------------------------------------------------------------------------
# Files that would run code


def test_malicious_pickle_never_runs(tmp_path, monkeypatch):
    sentinel = tmp_path / "SENTINEL"
    bad = malicious_checkpoint(tmp_path / "bad.pt", sentinel)
    with pytest.raises(ConfigError, match=r"bad.pt: refused: loading it would call 'posix.system'") as e:
        ckpt.load_checkpoint(bad)
    assert "\n" not in str(e.value)
    # even when the pre-scan is fooled, the weights-only loader refuses (and still one line)
    monkeypatch.setattr(ckpt, "_globals_needed", lambda path: set())
    with pytest.raises(ConfigError, match=r"bad.pt: not a readable checkpoint \(UnpicklingError: .*posix.system") as e:
        ckpt.load_checkpoint(bad)
    assert "\n" not in str(e.value)
    assert not sentinel.exists()


def run_cli(args, cwd=REPO):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_cli_refuses_malicious_checkpoint_with_one_line(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    bad = malicious_checkpoint(tmp_path / "BAD.pt", sentinel)
    tb = tmp_path / "tb"
    result = run_cli(["train.py", "--config", "configs/sample.json", "--tb-dir", str(tb), "--eval-only",
                      "--checkpoint", str(bad)])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, str(bad), "refused")
    assert not tb.exists()  # no run directory was made for the evaluation
    out = tmp_path / "OUT.pt2"
    result = run_cli(["train.py", "--config", "configs/sample.json", "--export", str(out),  # (no run directory)
                      "--checkpoint", str(bad)])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, str(bad), "refused")
    merged = tmp_path / "OUT.pt"
    result = run_cli(["-m", "dlrm.distributed.merge", str(bad), str(merged)])
    assert result.returncode == 2
    assert_one_line_error(result.stderr, str(bad), "refused")
    assert not out.exists() and not merged.exists() and not sentinel.exists()


# ---------------------------------------------------------------------------------------------
# The schema


def _parent(d: dict, dotted: str):
    """(the container holding the dotted key's entry, its last key)."""
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[int(p)] if isinstance(d, list) else d[p]
    return d, last


def _set(d: dict, dotted: str, value) -> None:
    parent, key = _parent(d, dotted)
    parent[key] = value


def _drop(d: dict, dotted: str, _value=None) -> None:
    parent, key = _parent(d, dotted)
    del parent[key]


def _poke(d: dict, dotted: str, index_value) -> None:
    """Set one item of the entry (a list or tensor): `index_value` is (index, value)."""
    parent, key = _parent(d, dotted)
    index, value = index_value
    parent[key][index] = value


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("change,key,value,message", [
    (_drop, "position", None, "checkpoint key 'position' missing"),
    (_set, "extra", 1, "checkpoint key 'extra' unexpected"),
    (_set, "position.step", "3", "checkpoint key 'position.step' must be an int >= 0, got str '3'"),
    (_set, "position.epoch", True, "checkpoint key 'position.epoch' must be an int >= 0, got bool"),
    (_drop, "position.batch", None, "checkpoint key 'position.batch' missing"),
    (_set, "model.x", [1.0], "checkpoint key 'model.x' must be a dense tensor, got list"),
    (_set, "optimizers", {}, "checkpoint key 'optimizers' must be a list"),
    (_drop, "optimizers.0.param_groups", None, "checkpoint key 'optimizers[0].param_groups' missing"),
    (_set, "schedulers", [{1, 2}], "checkpoint key 'schedulers[0]' must be a scheduler state_dict"),
    (_set, "cardinalities", [11, "11"], "checkpoint key 'cardinalities' must be a list of ints >= 1"),
    (_set, "config_json", "{", "checkpoint key 'config_json' is not valid JSON"),
    (_set, "config_json", "[1]", "checkpoint key 'config_json' must be a JSON object"),
    (_set, "rng.python.state", torch.zeros(5, dtype=torch.int64),
     "checkpoint key 'rng.python.state' must be an int64 tensor of 625 values"),
    (_set, "rng.numpy.pos", 10**6, "checkpoint key 'rng.numpy.pos' must be an int in [0, 624]"),
    (_set, "rng.torch", torch.zeros(5056, dtype=torch.uint8),
     "checkpoint key 'rng.torch' is not a valid generator state"),
    (_set, "run_stats.note", {1, 2}, "checkpoint key 'run_stats.note' must be plain data"),
    (_set, "run_stats.samples", torch.tensor(3), "checkpoint key 'run_stats.samples' must be plain data"),
    (_set, "run_stats.train_losses", [[1, 0.5, 2]], "checkpoint key 'run_stats.train_losses' must be a list of"),
    (_set, "format_version", 3, "not a checkpoint of this program (format_version 3)"),
    # a sparse tensor's indices are not checked on load: out of range, they read and write outside the table
    (_set, "model.x", torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,), check_invariants=True),
     "checkpoint key 'model.x' must be a dense tensor"),
    (_set, "optimizers.0.param_groups.0.params", [0, "1"],
     "checkpoint key 'optimizers[0].param_groups[0].params' must be a list of ints >= 0"),
    (_set, "optimizers.0.state.0", 5, "checkpoint key 'optimizers[0].state.0' must be a dict of str -> state"),
    (_set, "run_stats.note", _nested(40), "[0]' is nested more than 32 levels deep"),
    (_set, "dense_format", "log", "checkpoint key 'dense_format' must be 'counts' or 'float', got str 'log'"),
    (_set, "multi_hot_sizes", [1], "checkpoint key 'multi_hot_sizes' must be a list of"),
    (_set, "cardinalities", [], "checkpoint key 'cardinalities' must be a non-empty list of ints"),
    (_set, "rng.numpy.key", torch.full((624,), -1, dtype=torch.int64),
     "checkpoint key 'rng.numpy.key' must be an int64 tensor of 624 values in [0, 4294967296)"),
    (_poke, "rng.python.state", (-1, 625), "checkpoint key 'rng.python.state' must be a position <= 624 last"),
    (_set, "rng.numpy.has_gauss", 2, "checkpoint key 'rng.numpy.has_gauss' must be 0 or 1, got int 2"),
    (_set, "rng.cuda", [torch.zeros(3)], "checkpoint key 'rng.cuda' must be None or a list of 1-D uint8 tensors"),
    (_set, "config_json", '{"data": {}}', "checkpoint key 'config_json.model' must be a JSON object, got NoneType"),
    (_set, "run_stats.samples", -1, "checkpoint key 'run_stats.samples' must be an int >= 0, got int -1"),
    (_set, "run_stats.evals_since_best", "2", "checkpoint key 'run_stats.evals_since_best' must be an int >= 0"),
    (_set, "run_stats.best", {"step": 3, "metric": "auc"}, "checkpoint key 'run_stats.best' must be None or a dict"),
])
def test_schema_errors_name_the_file_and_key(trained, tmp_path, change, key, value, message):
    disk = raw_disk(trained["path"])
    change(disk, key, value)
    bad = tmp_path / "ckpt.pt"
    torch.save(disk, bad)
    with pytest.raises(ConfigError) as e:
        ckpt.load_checkpoint(bad)
    assert str(e.value).startswith(f"{bad}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_run_stats_is_optional_and_other_files_are_refused(trained, tmp_path):
    disk = raw_disk(trained["path"])
    del disk["run_stats"]
    ok = tmp_path / "no-stats.pt"
    torch.save(disk, ok)
    assert "run_stats" not in ckpt.load_checkpoint(ok)
    for name, content in (("list.pt", [1, 2]), ("truncated.pt", None)):
        bad = tmp_path / name
        if content is None:
            bad.write_bytes(trained["path"].read_bytes()[:1000])  # truncated
        else:
            torch.save(content, bad)
        with pytest.raises(ConfigError, match=rf"{name}: not a (readable )?checkpoint"):
            ckpt.load_checkpoint(bad)


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints: the helpers (the tests are in test_checkpoint_safety_sharded.py)


class StubEnv:
    """One rank of a process group whose barrier is a no-op (shards written one after the other)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.is_main, self.distributed = rank, world_size, rank == 0, True

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj):
        """Every rank's outcome of a save's part (`dist_ckpt._agreed`): as this one's (the others wrote before)."""
        return [obj] * self.world_size


def local_rows(plan, q: int, full: torch.Tensor) -> torch.Tensor:
    """Rank q's rows of a full per-row tensor (the inverse of `assemble`)."""
    offsets = np.cumsum([0, *plan.cardinalities[:-1]])
    layout = plan.local_layout(q)
    return torch.cat([full[offsets[f] + start: offsets[f] + start + count] for f, start, count, _ in layout])


# ---------------------------------------------------------------------------------------------
# Temporary files of killed writes


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from dlrm import checkpoint as ckpt

    state = ckpt.load_checkpoint(sys.argv[1])
    def hang(fd):
        print("writing", flush=True)
        time.sleep(600)
    os.fsync = hang  # stop between writing the temporary file and renaming it
    ckpt.write_atomic(Path(sys.argv[2]), state)
""")


def test_stale_temp_files_are_removed_before_a_save(trained, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    d = ckpt.checkpoint_dir(run_dir)
    d.mkdir(parents=True)
    target = d / ckpt.checkpoint_name(9)
    # the real interpreter: a temporary file names its writer's pid, this process's (tests/prewarm/launch.py)
    writer = subprocess.Popen([real_python(), "-c", KILLED_WRITER, str(trained["path"]), str(target)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait(timeout=30)
    killed = list(d.glob(f".{ckpt.checkpoint_name(9)}.*.tmp"))
    assert len(killed) == 1 and f".{writer.pid}-" in killed[0].name
    old_style = d / f".{ckpt.checkpoint_name(1)}.k3j2h1.tmp"  # format 1's names carry no pid
    killed_best = d / f".best.pt.{writer.pid}-q1w2e3.tmp"
    live = d / f".{ckpt.checkpoint_name(2)}.{os.getppid()}-abc.tmp"  # another process writing now
    others = [d / ".notes.tmp", d / "notes.txt"]
    for p in (old_style, killed_best, live, *others):
        p.write_bytes(b"x")

    state = ckpt.load_checkpoint(trained["path"])
    during = []
    real_fsync = os.fsync

    def fsync_and_clean(fd):  # a second cleanup while this process writes: its own file stays
        during.append(ckpt.remove_stale_temp_files(d))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_and_clean)
    with captured_logs() as messages:
        saved = ckpt.save_checkpoint(run_dir, state, 10, keep=5)
    assert during == [[]]
    assert not killed[0].exists() and not old_style.exists() and not killed_best.exists()
    assert live.exists() and all(p.exists() for p in others)
    assert any("removed 3 temporary file(s)" in m for m in messages)
    assert ckpt.load_checkpoint(saved)["position"] == state["position"]


# ---------------------------------------------------------------------------------------------
# Fuzzing


WRONG = [None, "x", 1.5, -1, True, [], {}, [1, "a"], {"a": 1}, {1, 2}, b"xy", (1, 2), torch.zeros(2),
         torch.zeros(3, dtype=torch.uint8), torch.zeros(625, dtype=torch.int64), 2**70]


def node_paths(obj, prefix=(), depth=0):
    """Paths of every dict/list/tuple entry, down to 5 levels (tensors are leaves)."""
    if depth > 5:
        return []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = []
    for k, v in list(items)[:40]:
        out.append(prefix + (k,))
        out.extend(node_paths(v, prefix + (k,), depth + 1))
    return out


def mutated(obj, path, drop, value):
    """A copy of `obj` with the entry at `path` dropped or replaced by `value`."""
    key, rest = path[0], path[1:]
    new = dict(obj) if isinstance(obj, dict) else list(obj)
    if rest:
        new[key] = mutated(obj[key], rest, drop, value)
    elif drop:
        del new[key]
    else:
        new[key] = value
    return tuple(new) if isinstance(obj, tuple) else new


def assert_loads_or_config_error(path: Path, trained) -> None:
    """load_checkpoint + check_compatible succeed, or raise a one-line ConfigError naming the file."""
    try:
        state = ckpt.load_checkpoint(path)
        ckpt.check_compatible(state, trained["model"], trained["tables"].cardinalities,
                              trained["cfg"].to_dict()["model"], path)
    except ConfigError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e)
        return
    before = ckpt.rng_state()
    ckpt.set_rng_state(state["rng"])  # what load accepts, a resume can apply
    ckpt.set_rng_state(before)


mutation = st.tuples(st.integers(0, 10**6), st.booleans(), st.sampled_from(range(len(WRONG))))


@settings(max_examples=80, deadline=None)
@given(mutations=st.lists(mutation, min_size=1, max_size=3), cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_checkpoints_load_or_raise_config_error(trained, tmp_path_factory, mutations, cut):
    disk = raw_disk(trained["path"])
    for pick, drop, which in mutations:
        paths = node_paths(disk)
        disk = mutated(disk, paths[pick % len(paths)], drop, WRONG[which])
    path = tmp_path_factory.mktemp("fuzz") / "ckpt.pt"
    torch.save(disk, path)
    if cut is not None:
        data = path.read_bytes()
        path.write_bytes(data[: int(cut * (len(data) - 1))])
    assert_loads_or_config_error(path, trained)
