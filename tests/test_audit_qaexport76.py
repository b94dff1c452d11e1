"""QA pass over --export and a run's TensorBoard output (2026-12-04).

`--export` names the checkpoint's step before it loads (and checks) the file: `checkpoint_step` read the file as it
came and indexed it, so a .pt holding a tensor (anything torch.save wrote is a candidate `--checkpoint`) printed
torch's two-line "Using a non-tuple sequence for multidimensional indexing is deprecated" warning above the one-line
refusal "not a checkpoint of this program (holds a Tensor)".

A `--checkpoint` (or `--resume`) that is a damaged archive was refused with torch's reader message cut at 200
characters, mid-word: "... This is an internal miniz error. If you are seeing this error, there is a high likelihood
that your checkpoint f)"; one that is the .pt2 program `--export` wrote (an easy mix-up) with "PytorchStreamReader failed
locating file data.pkl: file not found. This is an internal miniz error ...", which did not say what the file is.

An --export into a directory that takes no new file with an errno the CLI does not report in one line (ENOENT as root in
/proc: `train.py --checkpoint RUN --export /proc/m.pt2`) was "this is a bug in dlrm (FileNotFoundError)" with a
traceback naming the export's temporary name, after the checkpoint was loaded and the program traced.

`train.py --export OUT` whose OUT appeared while it trained was refused after the training, "OUT already exists; remove
it or choose another path": the same command with another path is then refused too (the run directory exists), and the
line did not say that the trained run can be exported as it is (`--checkpoint RUN --export OTHER`).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError, ModelConfig
from dlrm.model.dlrm import build_model
from dlrm.train.checkpointer import checkpoint_step
from dlrm.train import export as export_mod
from dlrm.train.export import export_model
from click.testing import CliRunner

import dlrm.cli as cli
from tests.conftest import CHILD_ENV, REPO, make_dataset, process_output


@pytest.mark.parametrize("content", [torch.ones(3), {"position": torch.ones(2)}, {"position": {"step": 2.5}},
                                     {"position": {"step": True}}, {"position": {"step": torch.tensor([7])}},
                                     [1, 2], {"position": [3]}])
def test_checkpoint_step_of_a_file_that_is_no_checkpoint_is_none_without_a_warning(tmp_path, content):
    path = tmp_path / "x.pt"
    torch.save(content, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint_step(path) is None
    assert [str(w.message) for w in caught] == []


def test_checkpoint_step_of_a_checkpoint_is_its_step(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"format_version": 2, "position": {"step": 40, "epoch": 0, "batch": 40}}, path)
    assert checkpoint_step(path) == 40


def test_export_of_a_pt_holding_a_tensor_is_one_error_line(tmp_path):
    """Through train.py: exit 2, one line on stderr (the refusal), no warning, nothing written."""
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20})
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
                                  "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                                  "train": {"device": "cpu"}, "log": {"tb_dir": str(tmp_path / "tb")}}))
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(config), "--checkpoint",
                             str(tmp_path / "tensor.pt"), "--export", str(tmp_path / "m.pt2")],
                            capture_output=True, text=True, env=CHILD_ENV, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, process_output(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not a checkpoint of this program (holds a Tensor)" in lines[0], process_output(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "ds", "tensor.pt"]


def test_a_damaged_archive_is_refused_with_torch_s_reason_without_its_advice_cut_mid_word():
    message = ("PytorchStreamReader failed reading zip archive: invalid header or archive is corrupted. This is an "
               "internal miniz error. If you are seeing this error, there is a high likelihood that your checkpoint "
               "file is corrupted. This can happen if the checkpoint was not saved properly, was transferred "
               "incorrectly, or the file was modified after saving.")
    assert ckpt._reason(RuntimeError(message)) == ("RuntimeError: PytorchStreamReader failed reading zip archive: "
                                                   "invalid header or archive is corrupted.")


def test_an_exported_program_given_as_a_checkpoint_is_named_so(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [7] * 26).eval()
    program = export_model(model, tmp_path / "m.pt2")
    with pytest.raises(ConfigError) as e:
        ckpt.load_checkpoint(program)
    assert str(e.value) == (f"{program}: a torch.export program (what --export writes), not a checkpoint: give the .pt "
                            "checkpoint (or run directory) it was exported from")
    assert "\n" not in str(e.value)


def test_an_export_whose_temporary_file_cannot_be_created_is_one_line_naming_the_directory(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [7] * 26).eval()
    real_open = os.open

    def refuse_new_files(path, flags, *args):
        if str(path).endswith(".tmp.pt2"):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(export_mod.os, "open", refuse_new_files)
    with pytest.raises(ConfigError) as e:
        export_model(model, tmp_path / "m.pt2")
    assert str(e.value) == f"--export: cannot create a file in {tmp_path} (No such file or directory)"
    assert list(tmp_path.iterdir()) == []


def test_an_export_after_training_that_is_refused_says_how_to_export_the_trained_run(tmp_path, monkeypatch):
    import dlrm.train.trainer as trainer

    make_dataset(tmp_path / "ds", {"train": 40, "validation": 20})
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
                                  "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
                                  "train": {"device": "cpu", "max_steps": 4, "baseline": False},
                                  "log": {"tb_dir": str(tmp_path / "tb"), "run_name": "r"}}))
    out, other = tmp_path / "m.pt2", tmp_path / "other.pt2"
    real_train = trainer.train

    def train_while_out_appears(cfg, **kwargs):
        summary = real_train(cfg, **kwargs)
        out.write_text("mine")  # another process's file, made while the run trained
        return summary

    monkeypatch.setattr(trainer, "train", train_while_out_appears)
    result = CliRunner().invoke(cli.main, ["--config", str(config), "--export", str(out)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    run = tmp_path / "tb" / "r"
    assert len(errors) == 1 and errors[0].endswith(
        f"--export: {out} already exists; remove it or choose another path (the run is trained and kept: export it "
        f"with --checkpoint {run} --export OUT.pt2)"), result.output
    assert out.read_text() == "mine" and (run / "checkpoints" / "best.pt").is_file()
    monkeypatch.undo()
    # the advice works: the trained run's best model, exported without training again
    result = CliRunner().invoke(cli.main, ["--config", str(config), "--checkpoint", str(run), "--export", str(other)])
    assert result.exit_code == 0, result.output
    assert torch.export.load(str(other)).module()(torch.zeros(2, 13, dtype=torch.int64),
                                                   torch.zeros(2, 26, dtype=torch.int64)).shape == (2,)
