"""Writes the reference that tests/test_regression.py holds the trainer to (issue #18: no behaviour change).

Run once, with the code *before* a refactor, from the repository root:

    python tests/data/regression/make_reference.py OUT_DIR

It trains configs/sample.json for 60 deterministic CPU steps and writes OUT_DIR/sample_run.json
(the logged losses, the evaluation metrics and a checksum of every final parameter) and the run's
final checkpoint, OUT_DIR/sample-step-60.pt. The committed files were made at commit 172338a (the
last commit before the one-builder refactor), whose checkpoints are format_version 1.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from dlrm.config import load_config  # noqa: E402
from dlrm.train.trainer import train  # noqa: E402

OVERRIDES = {"train.device": "cpu", "train.deterministic": True, "train.max_steps": 60, "train.log_every": 10,
             "train.eval_every": None, "checkpoint.every": None, "log.run_name": "regression"}


def checksums(model_state: dict) -> dict:
    """Per parameter: sum and sum of squares in float64 (a change anywhere moves one of them)."""
    return {k: [float(v.double().sum()), float(v.double().square().sum())] for k, v in model_state.items()}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tb = out / "tb"
    cfg = load_config("configs/sample.json", {**OVERRIDES, "log.tb_dir": str(tb)})
    summary = train(cfg)
    ckpt = Path(summary["checkpoint"])
    state = torch.load(ckpt, map_location="cpu", weights_only=False)  # our own file, just written
    reference = {"train_losses": summary["train_losses"], "auc": summary["auc"], "logloss": summary["logloss"],
                 "params": checksums(state["model"]), "overrides": OVERRIDES, "torch": torch.__version__}
    (out / "sample_run.json").write_text(json.dumps(reference, indent=1) + "\n")
    shutil.copy(ckpt, out / "sample-step-60.pt")
    shutil.rmtree(tb)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
