"""A distributed `--compare` (torchrun, 2 ranks) stopped by a SIGINT/SIGTERM that arrives after a variant's last
agreement (its summary's, `dlrm.train.signals.agreed_stop`). It was said "ignored: the run is writing its summary,
nothing is left to stop" and lost: the comparison trained the remaining variants and exited 0. Now the comparison's
hold (`dlrm.train.signals.run_hold`) keeps it for the agreement that follows each variant, every rank stops there
(128 + the signal), and rank 0 writes the partial report a one-process comparison writes on a stop: the finished
variant's row, the others "not run".

Each rank raises the signal itself, just after the first variant's summary agreement (the trainer's `agreed_stop`,
wrapped): under torchrun's agent every rank gets it; started another way, rank 1 alone. Two ranks (gloo), no timing.
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
    "distributed": {"timeout_s": 60},
}
SUMMARY_PHASE = "before writing the summary"


def _compare_on_rank(rank: int, root: str, signalled_ranks: tuple, agent: bool, results: dict) -> None:
    """Rank `rank` runs `--compare eager,auto` (both eager on the CPU); the ranks in `signalled_ranks` get a SIGTERM
    just after the first variant's summary agreement."""
    import contextlib
    import os

    import torch.distributed as dist
    from loguru import logger

    from dlrm.config import load_config
    from dlrm.errors import TrainingStopped
    from dlrm.stop_signal import StopAtOnce
    from dlrm.train import compare
    from dlrm.train import trainer as trainer_mod

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    if agent:
        os.environ["TORCHELASTIC_RUN_ID"] = "none"
    real = trainer_mod.agreed_stop
    summaries = []

    @contextlib.contextmanager
    def signalled(env, device, where, *args, **kwargs):
        with real(env, device, where, *args, **kwargs):
            yield
        if where == SUMMARY_PHASE:
            summaries.append(where)
            if len(summaries) == 1 and rank in signalled_ranks:
                signal.raise_signal(signal.SIGTERM)  # the first variant's last agreement found none

    trainer_mod.agreed_stop = signalled
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(Path(root) / "ds")
    path = Path(root) / f"c.rank{rank}.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(path, {"log.tb_dir": str(Path(root) / "tb"), "log.run_name": "c"})
    warnings: list[str] = []
    # what the rank's console shows: a rank other than 0 leaves out a record bound `same_on_every_rank`
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING",
                      filter=lambda r: rank == 0 or not r["extra"].get("same_on_every_rank"))
    try:
        with StopAtOnce():  # as train.py's main
            compare.run_comparison(cfg, ["eager", "auto"], trainer_mod.train)
        results[(rank, "outcome")] = 0
    except TrainingStopped as e:
        results[(rank, "outcome")] = (e.exit_code, str(e), e.agreed)
    finally:
        logger.remove(sink)
        dist.destroy_process_group()
    results[(rank, "warned")] = [w for w in warnings if w.startswith("SIGTERM")]
    results[(rank, "summaries")] = len(summaries)


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=16)
    return tmp_path


@pytest.mark.parametrize("signalled, agent", [((0, 1), True), ((1,), False)],
                         ids=["every-rank-under-torchrun", "rank-1-alone"])
def test_a_signal_after_a_variants_last_agreement_stops_the_distributed_comparison(root, signalled, agent):
    got, codes = call_on_ranks(_compare_on_rank, (str(root), signalled, agent), 2, root, timeout=240)
    assert codes == [0, 0], (codes, got)
    line = "SIGTERM: the comparison stopped after variant eager, once every rank knew (no checkpoint written now)"
    # was 0 on each rank: the second variant trained
    assert [got.get((q, "outcome")) for q in (0, 1)] == [(143, line, True)] * 2, got
    assert [got[(q, "summaries")] for q in (0, 1)] == [1, 1], got
    base = root / "tb" / "c"
    assert (base / "eager" / "summary.json").is_file() and not (base / "auto").exists()
    text = (base / "compare.md").read_text()
    assert "**Partial comparison: stopped by SIGTERM; not run: auto.**" in text, text
    assert "| eager |" in text and "not run: the comparison was stopped" in text
    held = ("SIGTERM: held until every rank knows, then stopping the comparison after this variant (send it again to "
            "stop at once)")
    # said by the rank that got it; one every rank got (torchrun's), by rank 0 for all (was: "ignored ... nothing is
    # left to stop" on each)
    assert [got[(q, "warned")] for q in (0, 1)] == ([[held], []] if agent else [[], [held]]), got
