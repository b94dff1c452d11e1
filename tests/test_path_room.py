"""A --tb-dir (log.tb_dir, a sweep's --tb-dir, an --export's directory) just under PATH_MAX passed the up-front check,
and the run failed where it first wrote deeper: train.py's SummaryWriter at the start ("this is a bug in dlrm
(OSError)", exit 1, with a traceback), or a checkpoint, a trace, a sweep's trial later, after training time was spent.
Now each command adds the longest path it writes under the directory (`dlrm.run_paths`) and refuses one byte over in
one line naming the flag or key and the bytes needed, exit 2, nothing created; at the limit itself it runs: real runs
of the tiny config (4 steps on the CPU, its profiler recording a trace, a checkpoint) write every file there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import dlrm.cli as cli
from dlrm.logging_setup import configure_logging
from dlrm.path_checks import PATH_MAX
from dlrm.run_paths import (MLPERF_FILES, PREPROCESS_DEEPEST, SYNTHETIC_FILES, atomic_temp, dataset_temp, export_temp,
                             run_deepest, sweep_deepest)
from tests.conftest import make_dataset
from tests.test_sweep import BASE


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    configure_logging()


@pytest.fixture
def tiny(tmp_path):
    """The tiny config (4 steps, a checkpoint at the end), profiling one step: its trace is written too."""
    make_dataset(tmp_path / "ds", {"train": 64, "validation": 16}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    raw["profile"] = {"enabled": True, "wait": 1, "warmup": 1, "active": 1, "repeat": 1}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def deep_dir(root: Path, size: int) -> Path:
    """A path under `root` of `size` bytes (absolute), of names of at most 200 bytes."""
    room = size - len(os.fsencode(str(root))) - 1
    names = ["d" * 200] * (room // 201)
    rest = room - 201 * len(names)
    if rest == 0:  # (a last name of 200 bytes: the one before it one shorter, a name of 2 after it)
        names[-1], rest = "d" * 199, 1
    path = root / "/".join([*names, "e" * rest])
    assert len(os.fsencode(str(path))) == size
    return path


def one_line(result, flag: str, needed: int) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "bug in dlrm" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].split("ERROR", 1)[1].strip().startswith(flag), lines[0]
    assert f"would need {needed} bytes (at most {PATH_MAX - 1})" in lines[0], lines[0]
    return lines[0]


def longest_written(top: Path) -> int:
    return max(len(os.fsencode(os.path.join(d, n))) for d, dirs, files in os.walk(top) for n in dirs + files)


# (arguments after --config, the run's deepest path under --tb-dir)
COMMANDS = {
    "train": (["--run-name", "r"], lambda: run_deepest("r", "tiny")),
    "compare": (["--run-name", "r", "--compare", "eager"], lambda: run_deepest("r", "tiny", variants="eager")),
    "default name": ([], lambda: run_deepest(None, "tiny")),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_tb_dir_one_byte_too_long_for_the_run_is_refused_up_front(tmp_path, tiny, command):
    args, deepest = COMMANDS[command]
    tb = deep_dir(tmp_path / "tb", PATH_MAX - len(os.fsencode(deepest())) - 1)  # one byte over: 4096
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), "--tb-dir", str(tb), *args])
    one_line(result, "--tb-dir", PATH_MAX)
    assert not (tmp_path / "tb").exists()


def test_log_tb_dir_of_the_config_is_named_with_its_file(tmp_path, tiny):
    raw = json.loads(tiny.read_text())
    raw["log"] = {"tb_dir": str(deep_dir(tmp_path / "tb", PATH_MAX - 1 - len(run_deepest("r", "c")) + 5))}
    config = tmp_path / "c.json"
    config.write_text(json.dumps(raw))
    result = CliRunner().invoke(cli.main, ["--config", str(config), "--run-name", "r"])
    one_line(result, f"{config}: log.tb_dir", PATH_MAX + 5)
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_run_at_the_limit_writes_every_file(tmp_path, tiny, command):
    """The tb dir as long as the check lets it be: the run trains, profiles, checkpoints and summarises there."""
    args, deepest = COMMANDS[command]
    tb = deep_dir(tmp_path / "tb", PATH_MAX - 1 - 1 - len(os.fsencode(deepest())))
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), "--tb-dir", str(tb), *args])
    assert result.exit_code == 0, result.output
    run = tb / "r" / ("eager" if command == "compare" else "")
    assert (run / "summary.json").is_file() and list(run.glob("*.pt.trace.json.gz"))
    assert (run / "checkpoints" / "step-00000004.pt").is_file()
    assert longest_written(tb) <= PATH_MAX - 1
    # --eval-only of that checkpoint beside it: its own run, its events and summary.json
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), "--tb-dir", str(tb), "--run-name", "e",
                                           "--eval-only", "--checkpoint", str(run / "checkpoints" / "step-00000004.pt")])
    assert result.exit_code == 0, result.output
    assert (tb / "e" / "summary.json").is_file()


def test_eval_only_and_export_are_checked_for_what_they_write(tmp_path, tiny):
    checkpoint = tmp_path / "none.pt"  # (refused before the checkpoint is read)
    tb = deep_dir(tmp_path / "tb", PATH_MAX - len(run_deepest("e", "tiny", evaluates_only=True)) - 1)
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), "--tb-dir", str(tb), "--run-name", "e",
                                           "--eval-only", "--checkpoint", str(checkpoint)])
    one_line(result, "--tb-dir", PATH_MAX)
    out = deep_dir(tmp_path / "out", PATH_MAX - len(export_temp(Path("m.pt2"))) - 1)
    out.mkdir(parents=True)
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), "--checkpoint", str(checkpoint), "--export",
                                           str(out / "m.pt2")])
    assert "/m.pt2 (" in one_line(result, "--export", PATH_MAX)  # (the export named, its length with it)
    assert list(out.iterdir()) == [] and not (tmp_path / "tb").exists()


def test_a_sweep_is_checked_for_its_deepest_trial(tmp_path, tiny):
    """tb_dir/<sweep>/<NN-setting>/seed-<k>/...: refused one byte over, before any trial; at the limit every trial
    (two settings, two seeds) and the sweep's tables and HParams are written."""
    from dlrm import sweep

    sets = ["--set", "optim.sparse.lr=0.01,0.03"]
    settings = sweep.grid([sweep.parse_set(s) for s in sets[1::2]])
    deepest = sweep_deepest("sw", [sweep.slug(i, s) for i, s in enumerate(settings)], 2)
    over = deep_dir(tmp_path / "over", PATH_MAX - len(os.fsencode(deepest)) - 1)
    args = ["--config", str(tiny), "--seeds", "2", "--run-name", "sw", *sets]
    one_line(CliRunner().invoke(sweep.main, [*args, "--tb-dir", str(over)]), "--tb-dir", PATH_MAX)
    assert not (tmp_path / "over").exists()
    tb = deep_dir(tmp_path / "tb", PATH_MAX - len(os.fsencode(deepest)) - 2)
    result = CliRunner().invoke(sweep.main, [*args, "--tb-dir", str(tb)])
    assert result.exit_code == 0, result.output
    assert len(list((tb / "sw").glob("*/seed-*/summary.json"))) == 4 and (tb / "sw" / "sweep.md").is_file()
    assert longest_written(tb) <= PATH_MAX - 1


# --- the data tools and the merge: a dataset built in a temporary sibling of --out, a file's temporary beside it ---

def _synthetic(out, tmp):
    from dlrm.data import synthetic

    return synthetic.main, ["--rows", "40", "--cardinalities", "tiny", "--out", str(out)]


def _relayout(out, tmp):
    from dlrm.data import relayout

    return relayout.main, ["--data", str(tmp / "ds"), "--output", str(out)]


def _preprocess(out, tmp):
    from dlrm.data.preprocess import cli as pp

    return pp.build_cli(), ["-i", str(tmp / "raw.tsv"), "-o", str(out), "--no-progress", "--workers", "1"]


def _mlperf(out, tmp):
    from dlrm.data import mlperf_import

    from tests.test_mlperf_import import CARDS, write_day

    rng = np.random.default_rng(0)
    (tmp / "days").mkdir()
    for day in (0, 23):
        write_day(tmp / "days", day, 12, rng)
    return mlperf_import.main, ["--input", str(tmp / "days"), "--output", str(out), "--train-days", "0", "--workers", "1",
                                "--num-embeddings", ",".join(map(str, CARDS))]


def _merge(out, tmp):
    from dlrm.distributed import merge

    return merge.main, [str(tmp / "none.pt"), str(out)]  # (refused before the checkpoint is read)


def _tsv(out, tmp):
    from dlrm.data import synthetic

    return synthetic.main, ["--rows", "40", "--cardinalities", "tiny", "--out", str(tmp / "ds-of-tsv"),
                            "--raw-tsv", str(out)]


TOOLS = {  # (command, the flag, its deepest path beside (or, preprocess, under) the given path, whether under it)
    "synthetic --out": (_synthetic, "--out", lambda: dataset_temp("o", ".tmp-xxxxxxxx", SYNTHETIC_FILES), False),
    "synthetic --raw-tsv": (_tsv, "--raw-tsv", lambda: ".o.xxxxxxxx.tmp", False),
    "relayout --output": (_relayout, "--output",
                          lambda: dataset_temp("o", ".relayout-xxxxxxxx", ["validation/part-00001.parquet"]), False),
    "preprocess --output": (_preprocess, "--output", lambda: PREPROCESS_DEEPEST, True),
    "mlperf_import --output": (_mlperf, "--output", lambda: dataset_temp("o", ".import-partial", MLPERF_FILES), False),
    "merge OUT": (_merge, "OUT", lambda: atomic_temp("o"), False),
}


@pytest.fixture
def inputs(tmp_path):
    """A tiny dataset (relayout's --data) and a raw TSV (preprocess's input) in `tmp_path`."""
    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=16)
    (tmp_path / "raw.tsv").write_text("".join(f"{i % 2}" + "\t1" * 13 + "\tab" * 26 + "\n" for i in range(40)))


def tool_path(tmp_path: Path, tool: str, over: int) -> Path:
    """The tool's output `o` placed so that its deepest path is `over` bytes past the limit (0: at it)."""
    deepest = len(os.fsencode(TOOLS[tool][2]()))
    if TOOLS[tool][3]:
        return deep_dir(tmp_path / "t", PATH_MAX - 1 - 1 - deepest + over)
    return deep_dir(tmp_path / "t", PATH_MAX - 1 - 1 - deepest + over) / "o"


@pytest.mark.parametrize("tool", TOOLS)
def test_a_data_tool_refuses_an_output_one_byte_too_long_up_front(tmp_path, inputs, tool):
    make, flag, _, _ = TOOLS[tool]
    out = tool_path(tmp_path, tool, 1)
    command, args = make(out, tmp_path)
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert f"{flag}: " in lines[0] and f"would need {PATH_MAX} bytes (at most {PATH_MAX - 1})" in lines[0], lines[0]
    assert not (tmp_path / "t").exists() and not (tmp_path / "ds-of-tsv").exists()


@pytest.mark.parametrize("tool", [t for t in TOOLS if t != "merge OUT"])  # (a merge needs a sharded run)
def test_a_data_tool_at_the_limit_writes_its_output(tmp_path, inputs, tool):
    make, _, _, _ = TOOLS[tool]
    out = tool_path(tmp_path, tool, 0)
    command, args = make(out, tmp_path)
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0, result.output
    assert out.is_file() if tool.endswith("tsv") else (out / "metadata.json").is_file()
    assert longest_written(tmp_path / "t") <= PATH_MAX - 1


# --- a resume in place: the run's existing directory is where it writes, whatever --tb-dir says -----------------------
# A run moved deeper (`mv tb/r archive/.../r`), or resumed on a host of a longer name, passed every check and failed
# at its first event file write: "a bug in dlrm (OSError)", exit 1, after the data and the model were built.

def snapshot(top: Path) -> list:
    """Every path under `top` with its size and modification time: what a refusal must leave as it was (read through
    directory descriptors: a moved run's files may be past PATH_MAX as whole paths)."""
    return sorted((os.path.join(d, n), os.lstat(n, dir_fd=fd).st_size, os.lstat(n, dir_fd=fd).st_mtime_ns)
                  for d, dirs, files, fd in os.fwalk(top) for n in dirs + files)


def moved_run(tmp_path: Path, tiny: Path, over: int) -> Path:
    """The tiny config's run `r` (4 steps, its checkpoint), trained in a short --tb-dir and moved into one whose
    deepest path for it is `over` bytes past the limit (0: at it); the new --tb-dir."""
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), "--tb-dir", str(tmp_path / "tb"), "--run-name", "r"])
    assert result.exit_code == 0, result.output
    deep = deep_dir(tmp_path / "deep", PATH_MAX - 1 - 1 - len(os.fsencode(run_deepest("r", "tiny"))) + over)
    deep.mkdir(parents=True)
    os.rename(tmp_path / "tb" / "r", deep / "r")
    return deep


MORE = ["--max-steps", "8", "--epochs", "2", "--allow-config-change", "train.max_steps,train.epochs"]
RESUMES = {  # how the command names the run it continues in place
    "latest": lambda deep: ["--tb-dir", str(deep), "--run-name", "r", "--resume", "latest"],
    "checkpoint": lambda deep: ["--resume", str(deep / "r" / "checkpoints" / "step-00000004.pt")],
    "checkpoint of its run by name": lambda deep: ["--tb-dir", str(deep), "--run-name", "r", "--resume",
                                                   str(deep / "r" / "checkpoints" / "step-00000004.pt")],
}


@pytest.mark.parametrize("how, over", [(how, 1) for how in RESUMES] + [("latest", 45)])
def test_a_resume_in_place_too_long_is_refused_up_front(tmp_path, tiny, how, over):
    """One byte over, and 45: where its checkpoint is read but the session's own event file did not fit (its name at
    least 45 bytes): "a bug in dlrm (OSError)", exit 1, after the data and the model were built."""
    deep = moved_run(tmp_path, tiny, over)
    before = snapshot(deep)
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), *MORE, *RESUMES[how](deep)])
    line = one_line(result, "--resume", PATH_MAX + over - 1)
    assert "/r (" in line and "): the deepest path written there" in line and "--run-name NEW" in line, line
    assert snapshot(deep) == before  # (no lock taken, no event file, no checkpoint)


def test_a_resume_in_place_at_the_limit_trains_there(tmp_path, tiny):
    deep = moved_run(tmp_path, tiny, 0)
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), *MORE, *RESUMES["latest"](deep)])
    assert result.exit_code == 0, result.output
    assert (deep / "r" / "checkpoints" / "step-00000008.pt").is_file()
    assert json.loads((deep / "r" / "summary.json").read_text())["steps"] == 8
    assert longest_written(deep) <= PATH_MAX - 1


def test_a_branch_of_a_run_too_deep_to_resume_in_place_goes_to_its_new_directory(tmp_path, tiny):
    """The refusal's way through: the deep run's checkpoint continued in a new run under a short --tb-dir."""
    deep = moved_run(tmp_path, tiny, 1)
    before = snapshot(deep)
    result = CliRunner().invoke(cli.main, ["--config", str(tiny), *MORE, "--tb-dir", str(tmp_path / "short"),
                                           "--run-name", "b", "--resume",
                                           str(deep / "r" / "checkpoints" / "step-00000004.pt")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "short" / "b" / "checkpoints" / "step-00000008.pt").is_file()
    assert [p for p in snapshot(deep) if p not in before] == []  # (the source run is not written)


def interrupted_sweep(tmp_path: Path, tiny: Path, over: int) -> tuple[Path, list]:
    """A sweep of two settings (one seed) stopped by Ctrl-C at its second trial, moved into a directory whose
    deepest path for it is `over` bytes past the limit; the sweep directory and its --set."""
    from dlrm import sweep
    from dlrm.train.trainer import train as real_train

    sets = ["optim.sparse.lr=0.01,0.03"]

    def train(cfg, run_dir=None, resume=None):
        if cfg.optim.sparse.lr == 0.03:
            raise KeyboardInterrupt()
        return real_train(cfg, run_dir=run_dir, resume=resume)

    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(str(tiny), [sweep.parse_set(s) for s in sets], 1, tb_dir=str(tmp_path / "tb"),
                        run_name="sw", train_fn=train)
    settings = sweep.grid([sweep.parse_set(s) for s in sets])
    deepest = sweep_deepest("sw", [sweep.slug(i, s) for i, s in enumerate(settings)], 1)
    deep = deep_dir(tmp_path / "deep", PATH_MAX - 1 - 1 - len(os.fsencode(deepest)) + over)
    deep.mkdir(parents=True)
    os.rename(tmp_path / "tb" / "sw", deep / "sw")
    return deep / "sw", sets


def test_a_sweep_resumed_where_its_trials_would_not_fit_is_refused_up_front(tmp_path, tiny):
    from dlrm import sweep

    directory, _ = interrupted_sweep(tmp_path, tiny, 1)
    before = snapshot(directory)
    line = one_line(CliRunner().invoke(sweep.main, ["--resume", str(directory), "--seeds", "1"]), "--resume",
                    PATH_MAX)
    assert "/sw (" in line and "move the sweep directory to a shorter path" in line, line
    assert snapshot(directory) == before


def test_a_sweep_resumed_at_the_limit_finishes_there(tmp_path, tiny):
    from dlrm import sweep

    directory, _ = interrupted_sweep(tmp_path, tiny, 0)
    result = CliRunner().invoke(sweep.main, ["--resume", str(directory), "--seeds", "1"])
    assert result.exit_code == 0, result.output
    assert len(list(directory.glob("*/seed-0/summary.json"))) == 2 and (directory / "sweep.md").is_file()
    assert longest_written(directory) <= PATH_MAX - 1
