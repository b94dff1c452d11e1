"""A distributed run's end agrees on a signal twice (`dlrm.train.signals.agreed_stop`): after its last evaluation and
its checkpoint, then once the summary is made. After the first agreement found none, a SIGINT/SIGTERM was warned of as
"ignored: the run is writing its summary, nothing is left to stop", though the second agreement, just after, took it:
the run stopped, 143, "stopped by signal (SIGTERM) at step N, after its last evaluation", with no summary.json. The
window: from the first phase's agreement to the second phase's start (`Trainer._fit`, between the two `with
agreed_stop(...)`). Now a signal there is held for the next agreement and said so; only one after the run's last
agreement (the summary's) is "ignored", and it is.

The signal is raised by each rank in that window: the trainer's `agreed_stop`, wrapped, raises it just before the
summary's phase begins (or, for the last case, just after that phase's agreement). Two ranks (gloo), no timing.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import make_dataset
from tests.fastdist_ranks import call_on_ranks

CONFIG = {
    "data": {"batch_size": 8, "shuffle": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
}
SUMMARY_PHASE = "before writing the summary"


def _run_on_rank(rank: int, root: str, at: str, agent: bool, results: dict) -> None:
    """Rank `rank` trains a tiny run to its end; a SIGTERM arrives at `at`: "before" the summary's agreed phase
    begins (after the last evaluation's agreement), or "after" that phase's agreement (the run's last). `agent`: as
    under torchrun's agent (TORCHELASTIC_RUN_ID)."""
    import contextlib
    import os

    import torch.distributed as dist
    from loguru import logger

    from dlrm.config import load_config
    from dlrm.errors import TrainingStopped
    from dlrm.train import trainer as trainer_mod

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    if agent:
        os.environ["TORCHELASTIC_RUN_ID"] = "none"
    real = trainer_mod.agreed_stop

    @contextlib.contextmanager
    def signalled(env, device, where, *args, **kwargs):
        if where == SUMMARY_PHASE and at == "before":
            signal.raise_signal(signal.SIGTERM)  # the previous phase agreed on none; this one has not begun
        with real(env, device, where, *args, **kwargs):
            yield
        if where == SUMMARY_PHASE and at == "after":
            signal.raise_signal(signal.SIGTERM)  # the run's last agreement found none

    trainer_mod.agreed_stop = signalled
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(Path(root) / "ds")
    path = Path(root) / f"c.rank{rank}.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(path, {"log.tb_dir": str(Path(root) / "tb"), "log.run_name": "r"})
    warnings: list[str] = []
    # what the rank's console shows: a rank other than 0 leaves out a record bound `same_on_every_rank`
    # (`dlrm.logging_setup.log_as_rank`)
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING",
                      filter=lambda r: rank == 0 or not r["extra"].get("same_on_every_rank"))
    try:
        trainer_mod.train(cfg)
        results[(rank, "outcome")] = 0
    except TrainingStopped as e:
        results[(rank, "outcome")] = (e.exit_code, str(e))
    finally:
        logger.remove(sink)
        dist.destroy_process_group()
    results[(rank, "warned")] = [w for w in warnings if w.startswith("SIGTERM")]


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=16)
    return tmp_path


def test_a_signal_between_the_last_evaluations_agreement_and_the_summarys_is_held_not_ignored(root):
    got, codes = call_on_ranks(_run_on_rank, (str(root), "before", True), 2, root, timeout=240)
    assert codes == [0, 0], (codes, got)
    checkpoint = root / "tb" / "r" / "checkpoints" / "step-00000004.pt"
    stopped = (143, f"stopped by signal (SIGTERM) at step 4, after its last evaluation; checkpoint {checkpoint}")
    assert [got.get((q, "outcome")) for q in (0, 1)] == [stopped, stopped], got
    assert not (root / "tb" / "r" / "summary.json").exists()
    # rank 0's warning says what happens; rank 1's, a signal every rank got, is left to it (was: "ignored" on each)
    assert [got[(q, "warned")] for q in (0, 1)] == [
        ["SIGTERM: held until every rank knows, then stopping (send it again to stop at once)"], []], got


@pytest.mark.parametrize("agent", [False, True], ids=["started-otherwise", "under-torchrun"])
def test_a_signal_after_the_summarys_agreement_is_ignored_as_said(root, agent):
    """No agreement follows: under torchrun's agent, which gets a signal to every rank, rank 0 says it for the run
    (each rank said it before); started another way, each rank's is its own."""
    got, codes = call_on_ranks(_run_on_rank, (str(root), "after", agent), 2, root, timeout=240)
    assert codes == [0, 0] and [got.get((q, "outcome")) for q in (0, 1)] == [0, 0], (codes, got)
    assert (root / "tb" / "r" / "summary.json").is_file()
    ignored = ("SIGTERM: ignored: the run is writing its summary, nothing is left to stop "
               "(send it again to stop at once)")
    assert [got[(q, "warned")] for q in (0, 1)] == [[ignored], [] if agent else [ignored]], got
