"""A new user's journey through README.md (session 60's audit): eval-only, export, resume, profile and --compare, what
they print and write. Each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from loguru import logger

from dlrm.config import config_from_dict
from dlrm.train.checkpointer import checkpoint_for
from dlrm.train.export import export_checkpoint
from dlrm.train.trainer import train
from tests.conftest import make_dataset


def _config(data: Path, tb: Path, name: str, **train_keys):
    return config_from_dict({
        "data": {"path": str(data), "batch_size": 16},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "train": {"max_steps": 4, "eval_every": 2, "device": "cpu", "seed": 3, "baseline": False, "compile": False,
                  **train_keys},
        "checkpoint": {"every": 4, "keep": 2},
        "log": {"tb_dir": str(tb), "run_name": name},
    })


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run that evaluated at steps 2 and 4 (best.pt: whichever was better) and checkpointed step 4."""
    root = tmp_path_factory.mktemp("journey60")
    make_dataset(root / "data", {"train": 64, "validation": 32})
    cfg = _config(root / "data", root / "tb", "r1")
    summary = train(cfg)
    return root, cfg, summary


@pytest.fixture
def log_lines():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def test_an_export_names_the_checkpoint_and_step_it_exported(run, log_lines, tmp_path):
    """README: `--checkpoint tb_logs/r1` (a run directory) means its best.pt, and `--export` after training exports the
    best model; `--eval-only`'s line names the checkpoint and its step, but the export's said only "exported inference
    program to model.pt2 (inputs: ...)": which model (best.pt of which step, or the last checkpoint) was not said."""
    root, cfg, summary = run
    best = checkpoint_for(root / "tb" / "r1")
    assert best.name == "best.pt"
    best_step = summary["best"]["step"]
    export_checkpoint(cfg, best, tmp_path / "m.pt2")
    said = [line for line in log_lines if line.startswith("exported inference program")]
    assert len(said) == 1, log_lines
    assert said[0].startswith(f"exported inference program to {tmp_path / 'm.pt2'} (inputs: "), said
    assert said[0].endswith(f") from {best} (step {best_step})"), said
    assert (tmp_path / "m.pt2").is_file()


def test_an_export_does_not_log_its_pytorch_copy_as_the_runs_kernels(run, log_lines, tmp_path):
    """`--export` after training builds the checkpoint's model again from PyTorch modules (a portable program), and
    logged "kernels: embedding=torch, interaction=torch, mlp=torch, loss=torch" after the run's last line: after a run
    with Triton kernels (a GPU's "auto") the log ended saying the PyTorch ones. The export's lines are its own; an
    evaluation of a checkpoint, which runs the kernels it names, still says them."""
    from dlrm.train.export import evaluate_checkpoint

    root, cfg, summary = run
    export_checkpoint(cfg, Path(summary["checkpoint"]), tmp_path / "m.pt2")
    assert [line for line in log_lines if line.startswith("kernels:")] == [], log_lines
    assert len(log_lines) == 1 and log_lines[0].startswith("exported inference program to "), log_lines
    eval_cfg = _config(root / "data", root / "tb", "eval")
    evaluate_checkpoint(eval_cfg, Path(summary["checkpoint"]), "validation")
    assert "kernels: embedding=torch, interaction=torch, mlp=torch, loss=torch" in log_lines, log_lines


def test_compare_skips_a_triton_variant_without_advising_a_flag_it_refuses(monkeypatch):
    """README's `--compare eager,compiled,triton,triton+compiled` on a CPU without TRITON_INTERPRET=1 skipped the triton
    variants "(use --kernels torch, or run on a CUDA device)" in the log and in compare.md/csv's status: `--kernels`
    with `--compare` is refused in one line. The skip names what works there; a run's own refusal keeps its advice."""
    import torch

    import kernels._backend as backend
    from dlrm.train.compare import unavailable_reason
    from kernels import TritonUnavailableError, check_triton_device

    monkeypatch.setattr(backend, "interpret_mode", lambda: False)
    for name in ("triton", "triton+compiled"):
        reason = unavailable_reason(name, torch.device("cpu"))
        assert reason.startswith("triton kernels cannot run on the CPU unless TRITON_INTERPRET=1 is set"), reason
        assert "--kernels" not in reason and "leave the triton variants out of --compare" in reason, reason
    with pytest.raises(TritonUnavailableError, match=r"\(use --kernels torch, or run on a CUDA device\)$"):
        check_triton_device("cpu")
    assert unavailable_reason("eager", torch.device("cpu")) is None


@pytest.mark.parametrize("total, by_epochs, per_epoch, said", [
    (200, 198, 66, "200 steps, 3 epochs of 66 steps and 2 steps of epoch 4 (train.epochs 3 would give 198)"),
    (199, 198, 66, "199 steps, 3 epochs of 66 steps and 1 step of epoch 4 (train.epochs 3 would give 198)"),
    (67, 66, 66, "67 steps, 1 epoch of 66 steps and 1 step of epoch 2 (train.epochs 3 would give 66)"),
    (264, 198, 66, "264 steps, 4 epochs of 66 steps (train.epochs 3 would give 198)"),
    (200, 3, 1, "200 steps, 200 epochs of 1 step (train.epochs 3 would give 3)"),
])
def test_min_steps_says_the_epochs_it_trains(log_lines, total, by_epochs, per_epoch, said):
    """README's sweep on the small-real regime (criteo-small.json, train.min_steps 200, 66-step epochs) logged
    "train.min_steps 200: 200 steps, 4 epochs of 66 steps": 264 steps, not the 3 epochs and 2 steps it trains (README:
    "3 epochs are 198 steps, so it adds 2")."""
    from dlrm.config import Config
    from dlrm.train.train_data import _log_min_steps

    cfg = Config()
    cfg.train.min_steps, cfg.train.epochs = total, 3
    _log_min_steps(cfg, total, by_epochs, per_epoch)
    assert log_lines == [f"train.min_steps {total}: {said}"], log_lines


def test_a_split_the_dataset_lacks_is_refused_naming_the_splits_it_has(run):
    """README's `--eval-only ... --split validation` with `--split test` (the flag's other choice) on data/sample, which
    holds train and validation only, said "metadata.json: splits: has no 'test' split" and not which there are."""
    from dlrm.data.schema import read_metadata
    from dlrm.data.validation import split_files
    from dlrm.errors import DatasetError

    root, _, _ = run
    meta = read_metadata(root / "data")
    with pytest.raises(DatasetError) as e:
        split_files(root / "data", meta, "test")
    assert str(e.value) == f"{root / 'data' / 'metadata.json'}: splits: has no 'test' split (it has: train, validation)"
    assert len(split_files(root / "data", meta, "validation")) == 2


def test_an_evaluation_gives_the_oracle_auc_as_a_training_run_does(run, log_lines, tmp_path):
    """README's first promise: the run "prints the validation AUC next to the best AUC achievable on that data"
    (`... accuracy 0.7959 (oracle AUC 0.8161); ...`). `--eval-only` of data/sample's checkpoint said neither in its line
    nor in its summary.json, so an evaluation (of the test split, say) could not be read against the ceiling."""
    import shutil

    from dlrm.data.schema import read_metadata, write_metadata
    from dlrm.train.export import evaluate_checkpoint

    root, _, summary = run
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    meta = read_metadata(data)
    meta.extra = {**meta.extra, "oracle_auc": {"train": 0.9, "validation": 0.75}}
    write_metadata(data, meta)
    checkpoint = Path(summary["checkpoint"])
    result = evaluate_checkpoint(_config(data, tmp_path / "tb", "ev"), checkpoint, "validation")
    assert result["oracle_auc"] == 0.75
    said = log_lines[-1]
    assert said.startswith("validation: AUC ") and said.endswith(
        f"accuracy {result['accuracy']:.4f} (oracle AUC 0.7500) ({checkpoint}, step 4)"), said
    # real data (no planted teacher): null, and the line as before
    plain = evaluate_checkpoint(_config(root / "data", tmp_path / "tb", "ev2"), checkpoint, "validation")
    assert plain["oracle_auc"] is None and "oracle" not in log_lines[-1], log_lines[-1]
    assert log_lines[-1].endswith(f"accuracy {plain['accuracy']:.4f} ({checkpoint}, step 4)"), log_lines[-1]
