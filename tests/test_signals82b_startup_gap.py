"""A SIGINT/SIGTERM on one rank of a distributed run between the start-up's agreement (the end of `Trainer.__init__`)
and the training's hold (`Trainer.fit`'s). The start's hold ended with its phase, and `StopAtOnce` stopped that rank
alone ("stopped at once, outside the training steps"): the other rank went on to the first collective and died there
(gloo's "Connection closed by peer", or the process group's timeout). Now the run's hold (`dlrm.train.signals.
run_hold`) is kept from the start's agreement on: the signal waits for the training loop's first agreement, where
both ranks stop with a checkpoint (143, the same line; at step 3: the loop reads a window one step late).

Rank 1 raises the signal itself at that point (`Trainer.fit` wrapped: before it runs): two ranks (gloo), no timing.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.conftest import make_dataset
from tests.fastdist_ranks import call_on_ranks

CONFIG = {
    "data": {"batch_size": 8, "shuffle": False},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "optim": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
    "train": {"epochs": 1, "log_every": 2, "device": "cpu", "seed": 3, "baseline": False},
    "checkpoint": {"every": 1000, "keep": 5},
    "distributed": {"timeout_s": 30},
}


def _run_on_rank(rank: int, root: str, results: dict) -> None:
    import os

    import torch.distributed as dist

    from dlrm.config import load_config
    from dlrm.errors import TrainingStopped
    from dlrm.stop_signal import StopAtOnce
    from dlrm.train import trainer as trainer_mod

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="localhost")
    real_fit = trainer_mod.Trainer.fit

    def fit(self):
        if rank == 1:  # the start's agreement found none; the training's hold is not set up yet
            signal.raise_signal(signal.SIGTERM)
        return real_fit(self)

    trainer_mod.Trainer.fit = fit
    raw = json.loads(json.dumps(CONFIG))
    raw["data"]["path"] = str(Path(root) / "ds")
    path = Path(root) / f"c.rank{rank}.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(path, {"log.tb_dir": str(Path(root) / "tb"), "log.run_name": "r"})
    try:
        with StopAtOnce():  # as train.py's main
            trainer_mod.train(cfg)
        results[(rank, "outcome")] = 0
    except TrainingStopped as e:
        results[(rank, "outcome")] = (e.exit_code, str(e), e.agreed)
    except Exception as e:  # noqa: BLE001 - the other rank's failure when this one left alone
        results[(rank, "outcome")] = f"{type(e).__name__}: {e}"[:300]
    finally:
        dist.destroy_process_group()


def test_a_signal_between_the_starts_agreement_and_the_trainings_hold_stops_every_rank_alike(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=16)
    got, codes = call_on_ranks(_run_on_rank, (str(tmp_path),), 2, tmp_path, timeout=240)
    assert codes == [0, 0], (codes, got)
    checkpoint = tmp_path / "tb" / "r" / "checkpoints" / "step-00000003.pt"
    stopped = (143, f"stopped by signal at step 3; checkpoint {checkpoint}", True)
    # was: rank 1 "SIGTERM: stopped at once, outside the training steps ...", rank 0 a gloo error in the first window
    assert [got.get((q, "outcome")) for q in (0, 1)] == [stopped, stopped], got
    assert checkpoint.is_file()
