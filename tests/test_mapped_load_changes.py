"""A checkpoint written in place (``cp other.pt step-N.pt``: the same file, new bytes) while it is read memory-mapped
(`dlrm.mapped_load`): the mapping's pages are the file's, so the model's copy read the other file's bytes at the first
one's offsets (an --eval-only reported ``AUC n/a (NaN scores)``, exit 0; before the mapping, the first file's numbers).
Refused in one line naming the file (exit 2); a file replaced by a rename (an atomic write) or deleted is not: the
mapping holds the old file whole."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import dlrm.train.checkpointer as checkpointer
import dlrm.train.export as export
from tests.conftest import make_dataset
from tests.test_audit_killfuzz import CONFIG
from tests.test_cli_errors import error_line, invoke


@pytest.fixture
def run(tmp_path):
    """A 2-step run checkpointed at steps 1 and 2: (config path, step 1's checkpoint, step 2's)."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20}, cardinality=50)
    cfg = {"data": {"path": str(tmp_path / "ds"), "batch_size": 20}, "model": CONFIG["model"], "optim": CONFIG["optim"],
           "train": {"device": "cpu", "max_steps": 2, "baseline": False}, "checkpoint": {"every": 1, "keep": 2}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    assert invoke(tmp_path, tmp_path / "c.json", "--run-name", "r").exit_code == 0
    d = tmp_path / "tb" / "r" / "checkpoints"
    return tmp_path / "c.json", d / "step-00000001.pt", d / "step-00000002.pt"


def _auc(result) -> str:
    return next(line for line in result.stderr.splitlines() if "validation: AUC" in line).split("validation: ")[1]


def test_eval_only_of_a_checkpoint_written_in_place_while_the_model_is_built_is_refused(tmp_path, run, monkeypatch):
    config, first, second = run
    real = export.build_model

    def build_model(*a, **k):  # (the checkpoint is mapped; its tensors are read after the build)
        shutil.copyfile(second, first)  # as cp does: the same file, truncated and written
        return real(*a, **k)

    monkeypatch.setattr(export, "build_model", build_model)
    error_line(invoke(tmp_path, config, "--eval-only", "--checkpoint", str(first)), 2,
               f"{first}: written while it was read", "read it again once it is complete")


def test_eval_only_of_a_checkpoint_replaced_by_a_rename_evaluates_the_file_it_mapped(tmp_path, run, monkeypatch):
    config, first, second = run
    expected = _auc(invoke(tmp_path, config, "--eval-only", "--checkpoint", str(first)))
    kept = first.with_name("kept.pt")
    shutil.copyfile(first, kept)
    real = export.build_model

    def build_model(*a, **k):  # an atomic replacement (a new file renamed over it), then the file deleted
        tmp = first.with_name("new.pt")
        shutil.copyfile(second, tmp)
        os.replace(tmp, kept)
        kept.unlink()
        return real(*a, **k)

    monkeypatch.setattr(export, "build_model", build_model)
    result = invoke(tmp_path, config, "--eval-only", "--checkpoint", str(kept))
    assert result.exit_code == 0, result.output
    assert _auc(result).split(" (")[0] == expected.split(" (")[0]


def test_a_resume_from_a_checkpoint_written_in_place_during_the_restore_is_refused(tmp_path, run, monkeypatch):
    config, first, second = run
    real = checkpointer.dist_ckpt.load_for_rank

    def load_for_rank(*a, **k):  # mapped; its tensors copied into the model and optimizers after this
        state = real(*a, **k)
        shutil.copyfile(second, first)
        return state

    monkeypatch.setattr(checkpointer.dist_ckpt, "load_for_rank", load_for_rank)
    error_line(invoke(tmp_path, config, "--run-name", "r2", "--resume", str(first), "--max-steps", "3"), 2,
               f"{first}: written while it was read")


def test_eval_only_names_the_step_where_the_built_model_leaves_no_room_to_map_the_file_again(tmp_path, run,
                                                                                              monkeypatch):
    """The step (the line's ``, step N``, summary.json's ``step``) is read from the file mapped once more
    (`checkpoint_step`); read after the model was built, under ``ulimit -v`` that mapping failed (measured: a 666 MB
    checkpoint under ``ulimit -v`` 2.6 and 3.0 GiB) and the step went missing: read before the build."""
    config, first, _ = run
    built = []
    real_build, real_map = export.build_model, checkpointer.load_mapped

    def build_model(*a, **k):
        built.append(True)
        return real_build(*a, **k)

    def load_mapped(path, allowed):  # the built model took the address space a second mapping of the file needs
        if built:
            raise RuntimeError(f"unable to mmap 70000 bytes from file <{path}>: Cannot allocate memory (12)")
        return real_map(path, allowed)

    monkeypatch.setattr(export, "build_model", build_model)
    monkeypatch.setattr(checkpointer, "load_mapped", load_mapped)
    result = invoke(tmp_path, config, "--eval-only", "--checkpoint", str(first))
    assert result.exit_code == 0 and built, result.output
    assert _auc(result).endswith(f"({first}, step 1)"), _auc(result)
    summary = next((tmp_path / "tb").glob("c-*/summary.json"))
    assert json.loads(summary.read_text())["step"] == 1
