"""Audit of what a user reads in the terminal and in log files: log records on lines of their own beside the progress
bars (a terminal and a log file), no cursor codes from a second bar in a file, each hint and null-value warning said
once, under torchrun each run-wide warning (and a NaN loss) said once, not once per rank, one "loading to device" bar,
and `--eval-only` naming the checkpoint and step it evaluated, its numbers in TensorBoard too."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
import torch
from loguru import logger
from tqdm import tqdm

from dlrm.config import load_config
from dlrm.data import synthetic
from dlrm.distributed.env import DistEnv
from dlrm.logging_setup import ConsoleStream, RecordSink, configure_logging, run_logger
from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output

RECORD = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


@pytest.fixture(autouse=True)
def _restore_logging():
    """Tests here point loguru at their own streams: back to the process's stderr afterwards."""
    yield
    configure_logging()


def _train_cli(tmp_path, cfg: dict, name: str) -> tuple[int, str]:
    """train.py with stdout and stderr in one file (`> train.log 2>&1`): its exit code and the file's text."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(path), "--run-name", name],
                             cwd=tmp_path, env=CHILD_ENV, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    return out.returncode, log.read_text()


def _small_config(tmp_path, **train) -> dict:
    make_dataset(tmp_path / "ds", {"train": 400, "validation": 40})
    return {"data": {"path": str(tmp_path / "ds"), "batch_size": 20},
            "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
            "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 0, "baseline": False, **train},
            "log": {"tb_dir": str(tmp_path / "tb")}}


# -- (1) an evaluation's line glued to the training bar's ----------------------------------------------------------


@pytest.fixture(scope="module")
def evals_run(tmp_path_factory):
    """train.py with evaluations every 5 of its 20 steps, its output in a file: (tmp dir, exit code, the log)."""
    tmp_path = tmp_path_factory.mktemp("evals")
    rc, text = _train_cli(tmp_path, _small_config(tmp_path, eval_every=5), "evals")
    return tmp_path, rc, text


def test_evaluation_lines_start_their_own_line_in_a_log_file(evals_run):
    """`python train.py ... > run.log 2>&1` with evaluations during training: the bar's first draw (`\\rtrain: 0%|...`,
    no newline in a file) and the first evaluation's record were one line of the file:
    `train:   0%|          | 0/20 [00:00<?, ?step/s]15:40:15 INFO    step 5: eval auc ...` (grep, less and a
    SLURM log viewer show it so)."""
    _, rc, text = evals_run
    assert rc == 0, text[-3000:]
    lines = text.split("\n")
    evals = [line for line in lines if "step 5: eval auc" in line or "step 10: eval auc" in line]
    assert len(evals) == 2, text
    for line in evals:
        assert RECORD.match(line), f"an evaluation's record does not start its line: {line!r}"
    glued = [line for line in lines if "train:" in line and re.search(r"\d\d:\d\d:\d\d (INFO|WARNING)", line)]
    assert not glued, glued
    # the bar is still in the file, and its final state
    assert "20/20" in [seg for seg in text.replace("\n", "\r").split("\r") if seg.startswith("train:")][-1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_record_on_a_terminal_clears_the_bar_and_redraws_it_below():
    """On a terminal the record was written after the bar's text, on its line; now the bar is cleared (tqdm.write's
    way), the record written from the line's start, and the bar drawn again below it."""
    console = ConsoleStream(_Terminal())
    with tqdm(total=10, desc="train", file=console, mininterval=0, ncols=60) as bar:
        bar.update(3)
        drawn = console.stream.getvalue()
        RecordSink(console).write("12:00:00 INFO    step 3: eval auc 0.7\n")
        after = console.stream.getvalue()[len(drawn):]
        assert after.startswith("\r") and "train:" not in after.split("12:00:00")[0], repr(after)
        before_record = after.split("12:00:00")[0]
        # the bar's line blanked, cursor at its start, the line erased to its end (a `^C` echoed past the bar's width)
        assert before_record.replace(" ", "") == "\r\r\x1b[2K", repr(before_record)
        assert "train:" in after.split("step 3: eval auc 0.7\n")[1]  # redrawn below the record


def test_a_record_in_a_file_ends_the_bars_line_first_and_adds_no_bar_copy():
    """In a file the `\\r` copies of a bar stay: a record after a bar's draw starts a new line, and nothing else is
    written (clearing and redrawing the bar, as on a terminal, would add a copy a record)."""
    console = ConsoleStream(io.StringIO())
    with tqdm(total=10, desc="train", file=console, mininterval=0, ncols=60) as bar:
        bar.update(3)
        drawn = console.stream.getvalue()
        RecordSink(console).write("12:00:00 INFO    step 3\n")
        RecordSink(console).write("12:00:01 INFO    step 3 again\n")
        assert console.stream.getvalue()[len(drawn):] == "\n12:00:00 INFO    step 3\n12:00:01 INFO    step 3 again\n"


# -- (2) the multi-hot hint twice ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_multi_hot(tmp_path_factory):
    """A multi-hot dataset (zstd, the generator's default codec) of 80 train rows: fewer than a batch of 256."""
    root = tmp_path_factory.mktemp("mh") / "ds"
    synthetic.generate(root, 100, seed=0, cardinalities="tiny", multi_hot_sizes=[2] + [1] * 24 + [3])
    return root


def _messages(fn) -> list[str]:
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
    try:
        fn()
    finally:
        logger.remove(handle)
    return messages


def test_multi_hot_hint_is_said_once_for_a_split_smaller_than_a_batch(small_multi_hot):
    """The train split (80 rows) is smaller than data.batch_size (256): the loader is made again for one batch of all
    rows, and each loader logged the "multi-hot rows stream from zstd files" hint: the same line twice."""
    from dlrm.train.setup import load_dataset_metadata
    from dlrm.train.train_data import TrainData

    cfg = load_config(REPO / "configs" / "sample.json", {"data.path": str(small_multi_hot), "data.batch_size": 256,
                                                          "train.device": "cpu"})
    data_dir, meta = load_dataset_metadata(cfg)
    built: list = []
    messages = _messages(lambda: built.append(TrainData.build(cfg, data_dir, meta, torch.device("cpu"), DistEnv(),
                                                              "stream")))
    assert built[0].batch_size == 80
    assert sum("zstd files" in m for m in messages) == 1, messages
    assert sum("training with batch 80 instead" in m for m in messages) == 1, messages


# -- (3) torchrun: every rank repeated the run's warnings ------------------------------------------------------------


def _rank_console(monkeypatch, rank: int) -> io.StringIO:
    """configure_logging as a torchrun rank starts it (RANK, WORLD_SIZE in its environment); what it writes."""
    out = io.StringIO()
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging(ranks=True)  # (train.py's)
    return out


def test_other_ranks_leave_out_the_run_wide_records_from_the_start(monkeypatch):
    """Rank 1, from its first record (before the process group is joined: the config's and the dataset's warnings):
    its own warnings, named `[rank 1]`; not its INFO records, nor the warnings every rank makes alike (rank 0 says
    those). Before, each rank printed the records before the process group at INFO, with no rank named, and each
    warning after it once more with `[rank 1]`."""
    out = _rank_console(monkeypatch, 1)
    logger.info("started")
    run_logger.warning("optim.schedule.warmup_steps 100 is longer than this run")
    logger.warning("this rank's own")
    text = out.getvalue()
    assert "started" not in text and "warmup_steps" not in text, text
    # (a StringIO tells, as a pipe does, nothing of rank 0's bar on the shared console: a newline first)
    assert re.fullmatch(r"\n\[rank 1\] \d\d:\d\d:\d\d WARNING this rank's own\n", text), repr(text)
    out = _rank_console(monkeypatch, 0)
    run_logger.warning("optim.schedule.warmup_steps 100 is longer than this run")
    assert "WARNING optim.schedule.warmup_steps" in out.getvalue()
    # a tool (the preprocessor, ...) in a node whose launcher set RANK and WORLD_SIZE for the node: not quietened
    configure_logging()
    logger.info("counting the lines")
    assert re.fullmatch(r"\d\d:\d\d:\d\d INFO    counting the lines\n", out.getvalue().splitlines(True)[-1])


def test_a_non_finite_loss_is_reported_once_under_torchrun(monkeypatch):
    """A NaN loss stops every rank (the ranks agree on it): each printed the same ERROR line, rank 1's glued to rank
    0's progress bar. Rank 0's line says it; the exit code is every rank's."""
    from dlrm.cli import EXIT_NON_FINITE_LOSS, report_failure
    from dlrm.errors import NonFiniteLoss

    for rank in (1, 0):
        out = _rank_console(monkeypatch, rank)
        assert report_failure(NonFiniteLoss("loss became NaN or Inf at step 2; stopped"), None) == EXIT_NON_FINITE_LOSS
        assert ("loss became NaN" in out.getvalue()) == (rank == 0), (rank, out.getvalue())


def test_torchrun_says_each_run_wide_warning_once(tmp_path, small_multi_hot):
    """`torchrun --nproc-per-node 2 train.py` (CPU, gloo) on a multi-hot split smaller than a batch, with a warm-up
    longer than the run and the config's multi_hot_sizes not the dataset's: each warning, and the zstd hint, once.
    Before: the sizes' warning twice (once a rank, before the process group, no rank named), the batch, warm-up and
    one-class warnings again as `[rank 1] ...` (one of them glued to the training bar)."""
    cfg = {"data": {"path": str(small_multi_hot), "batch_size": 256},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1], "multi_hot_sizes": [1] * 26},
           "train": {"epochs": 2, "log_every": 1, "device": "cpu", "seed": 0, "baseline": False},
           "optim": {"schedule": {"warmup_steps": 100}},
           "log": {"tb_dir": str(tmp_path / "tb")}}
    path = tmp_path / "dist.json"
    path.write_text(json.dumps(cfg))
    env = {**CHILD_ENV, "OMP_NUM_THREADS": "1"}
    # (--standalone: without it torchrun rendezvouses on port 29500, which any other such run on the host wants too)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(REPO / "train.py"), "--config", str(path), "--run-name", "d"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, process_output(out)
    text = out.stdout + out.stderr
    for needle in ("model.multi_hot_sizes: the dataset's metadata says", "training with batch 80 instead",
                   "optim.schedule.warmup_steps 100 is longer", "zstd files"):
        assert text.count(needle) == 1, (needle, text[-4000:])
    assert "[rank 1]" not in text, text[-4000:]
    assert json.loads((tmp_path / "tb" / "d" / "summary.json").read_text())["steps"] == 2


# -- (4) a file's null warning once more for each loader of it (the baseline's) --------------------------------------


def _with_nulls(root):
    """Every third DENSE_1 of each train shard null; returns the shards."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = sorted((root / "train").glob("part-*.parquet"))
    for shard in shards:
        table = pq.read_table(shard)
        schema = pa.schema([pa.field(f.name, f.type, nullable=True) for f in table.schema])
        dense = table.column("DENSE_1").to_numpy()
        table = table.set_column(2, "DENSE_1", pa.array(dense, mask=np.arange(len(dense)) % 3 == 0)).cast(schema)
        pq.write_table(table, shard, row_group_size=7)
    return shards


def test_a_files_null_warning_is_said_once_per_run_not_once_per_loader(tmp_path):
    """A run whose train files hold nulls: the training loader warned about each file, and the baseline's loader (the
    same files, at the run's end) warned again, the same counts, as if more nulls had been found. Said once; a file
    rewritten since is news again."""
    from dlrm.data.loader import ParquetLoader, split_files
    from dlrm.data.schema import read_metadata

    make_dataset(tmp_path / "ds", {"train": 60, "validation": 20})
    shards = _with_nulls(tmp_path / "ds")
    files = split_files(tmp_path / "ds", read_metadata(tmp_path / "ds"), "train")

    def read_twice():
        for _ in range(2):  # the training loader, then the baseline's
            list(ParquetLoader(files, 16))

    nulls = [m for m in _messages(read_twice) if "null dense values" in m]
    assert sorted(nulls) == sorted(f"{shard}: 10 null dense values replaced by 0 (DENSE_1 10)" for shard in shards)
    _with_nulls(tmp_path / "ds")  # rewritten (the same nulls, a new file): said again
    assert len([m for m in _messages(lambda: list(ParquetLoader(files, 16))) if "null dense values" in m]) == 2


# -- (5) a second bar (a large checkpoint's, during training) wrote cursor-up codes into a log file ------------------


def test_a_checkpoint_bar_during_training_writes_no_escape_codes_into_a_log_file(tmp_path, monkeypatch):
    """A checkpoint of 1 GiB or more (MLPerf's) written during training shows its bar while the training bar is open:
    tqdm put it on the next line and moved back up with the terminal's cursor-up code, so a nohup/SLURM log got
    `\\x1b[A` at each of its redraws. In a file the bars share the current line (`\\r` copies, as README says)."""
    from dlrm import checkpoint as ckpt
    from dlrm.logging_setup import bar_interval
    from tests.test_audit_checkpoint_files import tiny_state

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", ConsoleStream(log))
    monkeypatch.setattr(ckpt, "PROGRESS_BYTES", 0)  # the bar shown for this small file
    with tqdm(total=4, desc="train", **bar_interval()) as bar:
        bar.update(2)
        ckpt.write_atomic(tmp_path / "step-00000002.pt", tiny_state(step=2), progress=True)
        bar.update(2)
    text = log.getvalue()
    assert "writing step-00000002.pt" in text and "4/4" in text
    assert "\x1b[" not in text, repr(text)


# -- (6) --eval-only: which model its line was about, and no TensorBoard --------------------------------------------


def test_eval_only_names_the_checkpoint_and_step_and_writes_tensorboard(evals_run):
    """`--eval-only --checkpoint RUN` evaluates RUN's best.pt (else its newest checkpoint); its line said only
    `validation: AUC 0.6160, ...`: not which file nor which step (best.pt is step 10 here, not the run's last, 20), and
    its numbers were in summary.json alone, not in TensorBoard beside the runs' evaluations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dlrm.train.export import evaluate_checkpoint

    tmp_path, rc, text = evals_run
    assert rc == 0, text[-3000:]
    run = tmp_path / "tb" / "evals"
    best = json.loads((run / "summary.json").read_text())["best"]
    cfg = load_config(tmp_path / "evals.json", {"log.run_name": "ev"})
    summaries: list = []
    messages = _messages(lambda: summaries.append(evaluate_checkpoint(cfg, run / "checkpoints" / "best.pt",
                                                                      "validation")))
    line = messages[-1]
    assert line.startswith(f"validation: AUC {best['auc']:.4f}, logloss "), line
    assert line.endswith(f"({run / 'checkpoints' / 'best.pt'}, step {best['step']})"), line
    assert summaries[0]["step"] == best["step"]
    events = EventAccumulator(str(tmp_path / "tb" / "ev"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("eval/auc")] == [(best["step"], round(best["auc"], 4))]
    assert {"eval/logloss", "eval/accuracy"} <= set(events.Tags()["scalars"])


# -- (7) torchrun with data.placement gpu: every rank drew its "loading to device" bar on the one terminal ----------


def test_only_rank_0_draws_the_loading_to_device_bar(tmp_path, monkeypatch):
    """Every rank loads the whole split into its device memory, and each drew its own bar on the terminal they share
    (two bars overwriting one line, then a finished copy a rank). Rank 0's bar says it for all."""
    from dlrm.data.device_loader import DeviceLoader
    from dlrm.data.loader import split_files
    from dlrm.data.schema import read_metadata

    make_dataset(tmp_path / "ds", {"train": 40, "validation": 8})
    files = split_files(tmp_path / "ds", read_metadata(tmp_path / "ds"), "train")
    for rank, shown in ((0, True), (1, False)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", ConsoleStream(terminal))
        loader = DeviceLoader(files, 4, "cpu", rank=rank, world_size=2)
        assert loader.num_rows == 40
        assert ("loading to device" in terminal.getvalue()) == shown, (rank, terminal.getvalue())


def test_placement_gpu_on_a_cpu_is_said_once(small_multi_hot):
    """data.placement "gpu" on a CPU device: each loader made (train, evaluation, and the train split's again when it
    is smaller than a batch) warned that the split is held in host memory: the same warning three times."""
    from dlrm.train.setup import load_dataset_metadata
    from dlrm.train.train_data import TrainData

    cfg = load_config(REPO / "configs" / "sample.json", {"data.path": str(small_multi_hot), "data.batch_size": 256,
                                                          "train.device": "cpu", "data.placement": "gpu"})
    data_dir, meta = load_dataset_metadata(cfg)
    messages = _messages(lambda: TrainData.build(cfg, data_dir, meta, torch.device("cpu"), DistEnv(), "gpu"))
    assert sum("data.placement 'gpu' on a CPU device" in m for m in messages) == 1, messages
