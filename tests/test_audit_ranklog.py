"""What a user reads of a run of several ranks (gloo on the CPU, started as torchrun starts them: every rank writes
into the one stderr torchrun inherited).

(1) A bad config under `torchrun --nproc-per-node 2 train.py --config bad.json` was printed by every rank, rank 1's
    copy as `[rank 1] ...`: the ranks find it alike before they meet, and rank 0 says it once (each rank exits 2).
(2) A record of a rank other than 0 (its own warning) was glued to the end of rank 0's progress bar's line: that rank
    does not know what rank 0 left on the shared console; its records now always start a line of their own.
(3) Under torchrun a rank that never arrives made the other fail as a bug (gloo's "wait timeout" in the agent's
    store, a traceback and exit 1), not in one line after `distributed.timeout_s` with exit 5.
(4) What a 2-rank run printed twice: click's usage errors, and a --resume refused against its checkpoint's config.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from loguru import logger

from dlrm import cli
from dlrm.config import ConfigError, DistributedConfig
from dlrm.logging_setup import ConsoleStream, RecordSink, log_as_rank
from tests._ports import reserved_port
from tests.conftest import CHILD_ENV, make_dataset
from tests.test_audit_killfuzz import CONFIG
from tests.test_audit_logtext import _Terminal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rank 1 warns, on its own, at its 3rd training step (rank 0's bar is open on the shared stderr then)
WARNS = """
import os, sys
if os.environ["RANK"] == "1":
    from loguru import logger
    from dlrm.train import meter
    real, calls = meter.StepMeter.step, []
    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            logger.warning("rank 1's own warning")
        return real(self, *args, **kwargs)
    meter.StepMeter.step = step
from dlrm.cli import main
main(sys.argv[1:])
"""


def launch_two_ranks(tmp_path, cfg: dict, extra=(), script: str = WARNS) -> tuple[list[int], str]:
    """Both ranks of train.py, writing into one stderr file as under torchrun: their exit codes and that file."""
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    args = ["--config", str(tmp_path / "c.json"), "--run-name", "r", "--tb-dir", str(tmp_path / "tb"), *extra]
    with reserved_port() as port:  # (held until both ranks are done: tests/_ports.py)
        env = {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TRITON_INTERPRET": "1"}
        with open(tmp_path / "run.log", "w") as log:  # one open file, shared as a shell's `> run.log 2>&1` shares it
            procs = [subprocess.Popen([sys.executable, "-c", script, *args], cwd=tmp_path, stdout=log, stderr=log,
                                      env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
            try:
                codes = [p.wait(timeout=150) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
    return codes, (tmp_path / "run.log").read_bytes().decode()  # (read_text: the bar's carriage returns as newlines)


@pytest.mark.parametrize("change", [("model", "bogus_key", 1), ("optim", "dense", {"name": "adam", "lr": -1})])
def test_a_bad_config_on_two_ranks_is_said_once_and_every_rank_exits_2(tmp_path, change):
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(tmp_path / "ds")
    section, key, value = change
    cfg[section][key] = value
    codes, text = launch_two_ranks(tmp_path, cfg)
    assert codes == [2, 2], text[-3000:]
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and not errors[0].startswith("[rank"), text[-3000:]
    assert "c.json: " in errors[0] and ("model.bogus_key" in errors[0] or "optim.dense.lr: -1" in errors[0])
    assert "Traceback" not in text and not (tmp_path / "tb").exists()  # nothing written


def test_a_usage_error_on_two_ranks_is_said_once(tmp_path):
    """click's own errors (an unknown option, a value of the wrong type): its three lines came from every rank."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(tmp_path / "ds")
    codes, text = launch_two_ranks(tmp_path, cfg, extra=["--batch-size", "x"])
    assert codes == [2, 2], text[-3000:]
    assert text.count("error: Invalid value for '--batch-size': 'x' is not a valid integer. (see ") == 1, text
    assert "Usage: " not in text and not (tmp_path / "tb").exists(), text  # one line (`dlrm.one_line_usage`)


@pytest.fixture
def rank1_console(monkeypatch):
    """This process as torchrun's rank 1 of 2, logging (`log_as_rank`) into a StringIO: what it prints."""
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    console = ConsoleStream(out)
    monkeypatch.setattr(sys, "stderr", console)
    log_as_rank(1)
    assert console.bar_elsewhere and console.shared  # (rank 0's bar may hold the shared console's line)
    yield out
    logger.remove()
    logger.add(sys.__stderr__)  # loguru's default sink again, for the tests after this one


def test_a_launch_error_of_one_rank_alone_is_still_said_by_that_rank(rank1_console, monkeypatch):
    """A bad config before the ranks meet is rank 0's to say; a rank's own bad LOCAL_RANK is not (rank 0 is fine and
    waits for it): silenced, rank 1's exit 2 would have come without a word. The first rank of another node (LOCAL_RANK
    0) says a bad config too: its files are its own."""
    from dlrm.distributed.env import init_distributed

    assert cli.report_failure(ConfigError("c.json: model.bogus_key: unknown key"), None) == 2
    assert rank1_console.getvalue() == ""
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.raises(ConfigError) as raised:
        init_distributed(DistributedConfig(), torch.device("cpu"))
    assert cli.report_failure(raised.value, None) == 2
    said = [line for line in rank1_console.getvalue().splitlines() if line]  # (a StringIO, as a pipe: "\n" first)
    assert len(said) == 1 and said[0].startswith("[rank 1] ") and "LOCAL_RANK 7 is not in [0, WORLD_SIZE 2)" in said[0]
    monkeypatch.setenv("LOCAL_RANK", "0")  # (rank 1 as the first rank of a second machine)
    assert cli.report_failure(ConfigError("c.json: model.bogus_key: unknown key"), None) == 2
    said = [line for line in rank1_console.getvalue().splitlines() if line]
    assert len(said) == 2 and said[1].endswith("ERROR   c.json: model.bogus_key: unknown key")


BAR = "\rtrain:  25%|##        | 1/4 [00:01<00:03,  1.00step/s]"


def test_another_ranks_record_in_a_shared_file_starts_its_own_line_and_adds_no_empty_one(tmp_path):
    """In a file (`> run.log 2>&1`) rank 1 reads the file's last byte: a newline only after rank 0's bar. Rank 0's
    record after rank 1's ended the line adds no empty line (rank 0's own last character is its bar's)."""
    path = tmp_path / "run.log"
    # one open file, its offset shared by the two ranks' descriptors, as torchrun's children inherit a shell's `>`
    with open(path, "w") as f0, os.fdopen(os.dup(f0.fileno()), "w") as f1:
        rank0, rank1 = ConsoleStream(f0), ConsoleStream(f1)
        rank0.shared = True  # (configure_logging's under torchrun)
        rank1.bar_elsewhere = rank1.shared = True  # (log_as_rank's)
        RecordSink(rank1).write("[rank 1] 12:00:00 WARNING first\n")  # an empty file: no newline first
        rank0.write(BAR)
        rank0.flush()
        RecordSink(rank1).write("[rank 1] 12:00:01 WARNING second\n")
        RecordSink(rank1).write("[rank 1] 12:00:02 WARNING third\n")
        RecordSink(rank0).write("12:00:03 INFO    step 2: eval auc 0.7\n")
    assert path.read_bytes().decode() == ("[rank 1] 12:00:00 WARNING first\n" + BAR
                                          + "\n[rank 1] 12:00:01 WARNING second\n[rank 1] 12:00:02 WARNING third\n"
                                          "12:00:03 INFO    step 2: eval auc 0.7\n")


def test_another_ranks_record_in_a_pipe_or_on_a_terminal_never_continues_a_line():
    """A pipe says nothing of what rank 0 wrote: the record starts with a newline. On a terminal it erases the line
    (rank 0's bar, which rank 0 redraws below at its next update) and takes it."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as w, os.fdopen(read_end) as r:
        pipe = ConsoleStream(w)
        pipe.bar_elsewhere = pipe.shared = True
        RecordSink(pipe).write("[rank 1] 12:00:00 WARNING w\n")
        w.close()
        assert r.read() == "\n[rank 1] 12:00:00 WARNING w\n"
    terminal = ConsoleStream(_Terminal())
    terminal.bar_elsewhere = terminal.shared = True
    RecordSink(terminal).write("[rank 1] 12:00:00 WARNING w\n")
    assert terminal.stream.getvalue() == "\r\x1b[2K[rank 1] 12:00:00 WARNING w\n"


def test_a_warning_of_rank_1_alone_is_not_glued_to_rank_0s_bar_and_a_refused_resume_is_said_once(tmp_path):
    """Two ranks training, one stderr file: rank 1's warning came right after rank 0's bar, `\\rtrain:   0%|...|
    0/4 [...][rank 1] 12:00:00 WARNING ...` on one line. Then a --resume of that run with another batch size: every
    rank checks it against the same checkpoint after the ranks met, and rank 1 repeated rank 0's refusal."""
    dataset = tmp_path / "ds"
    make_dataset(dataset, {"train": 80, "validation": 20}, row_group_size=20)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(dataset)
    cfg["train"]["epochs"], cfg["checkpoint"]["every"] = 1, None
    codes, text = launch_two_ranks(tmp_path, cfg)
    assert codes == [0, 0], text[-3000:]
    lines = text.replace("\r", "\n").splitlines()
    assert any(line.startswith("train:") for line in lines), text[-3000:]  # rank 0's bar was open
    warned = [line for line in text.splitlines() if "rank 1's own warning" in line]
    assert len(warned) == 1 and warned[0].startswith("[rank 1] "), text[-3000:]
    cfg["data"]["batch_size"] = 10
    codes, text = launch_two_ranks(tmp_path, cfg, extra=["--resume"])
    assert codes == [2, 2], text[-3000:]
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and not errors[0].startswith("[rank") and "data.batch_size: 20 -> 10" in errors[0], text


# rank 1 never arrives (it sleeps before train.py starts; torchrun's agent stops it once rank 0 has failed)
LATE = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(120)
from dlrm.cli import main
main(sys.argv[1:])
"""


def test_under_torchrun_a_rank_that_never_arrives_stops_the_other_in_one_line_within_the_timeout(tmp_path):
    """Under torchrun the agent's store is there from the start, and rank 0 waited in gloo's set-up for rank 1's
    address: torch's `DistStoreError: wait timeout after 2000ms, keys: /default_pg/0//cpu//0/1` came as a bug's
    traceback (exit 1); tests/test_distributed_timeout.py launches the ranks without the agent, where the store's own
    wait says "timed out"."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["path"] = str(tmp_path / "ds")
    cfg["distributed"]["timeout_s"] = 2
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, row_group_size=20)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    (tmp_path / "late.py").write_text(LATE)
    # (--standalone: torchrun binds its rendezvous store to a port of its own choosing; tests/_ports.py)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(tmp_path / "late.py"), "--config", str(tmp_path / "c.json"),
                        "--run-name", "r", "--tb-dir", str(tmp_path / "tb")], cwd=ROOT, capture_output=True,
                       text=True, env={**CHILD_ENV, "TRITON_INTERPRET": "1"}, timeout=150)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line[:2].isdigit() or line.startswith("[rank")]
    assert "this is a bug" not in p.stderr and "DistStoreError" not in "".join(ours), p.stderr[-3000:]
    errors = [line for line in ours if " ERROR " in line]
    assert len(errors) == 1 and "rank 0: the other ranks of this distributed run did not join it at " in errors[0]
    assert "within 2 s (distributed.timeout_s): wait timeout after 2000ms" in errors[0], errors
    assert "exitcode  : 5" in p.stderr and not (tmp_path / "tb" / "r").exists()  # (torchrun's summary: rank 0's 5)
