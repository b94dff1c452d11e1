"""Audit of --eval-only and --export across the model variants: the export's target path.

Found only when the program was written (a whole training run later, with ``train.py --export``), an --export name
that torch's archive writer cannot take was a traceback reported as "a bug in dlrm" (exit 1): a name near the
255-byte file name limit (the temporary name beside it, `.<name>.<pid>-<hex>.tmp.pt2`, was longer still: ENAMETOOLONG),
one over it, and one not in UTF-8 (an AttributeError from torch.export.save, then an abort, exit 134).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dlrm.cli import check_export_path
from dlrm.config import ConfigError, ModelConfig
from dlrm.model.dlrm import build_model
from dlrm.train import export as export_mod
from tests.conftest import CHILD_ENV, REPO, process_output


def _model():
    torch.manual_seed(0)
    return build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [7] * 26).eval()


@pytest.fixture
def stub_export(monkeypatch):
    """torch.export stubbed: the calls it got (a refusal must come before the export's work)."""
    calls = []
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: calls.append("export") or "program")
    monkeypatch.setattr(torch.export, "save", lambda program, f: calls.append("save") or open(f, "w").write(program))
    return calls


def test_an_export_name_near_the_file_name_limit_is_written(tmp_path):
    """A 254-byte name is a valid file name: the program is written there (it failed with ENAMETOOLONG on the
    temporary name, a traceback), nothing else is left, and it predicts as the model does."""
    model = _model()
    out = tmp_path / ("m" * 250 + ".pt2")
    assert check_export_path(str(out)) == out
    export_mod.export_model(model, out)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    dense, raw = torch.randint(-3, 50, (3, 13)), torch.randint(-1, 2**32, (3, 26))
    with torch.no_grad():
        expected = export_mod.RawInputDLRM(model)(dense, raw)
    torch.testing.assert_close(torch.export.load(str(out)).module()(dense, raw), expected)


@pytest.mark.parametrize("name, problem", [("m" * 260 + ".pt2", r"a file name of 264 bytes is too long \(at most 255\)"),
                                           (os.fsdecode(b"caf\xe9.pt2"), r"is not valid UTF-8")],
                         ids=["too-long", "not-utf8"])
def test_an_export_name_that_cannot_be_written_is_refused_before_any_work(tmp_path, stub_export, name, problem):
    out = tmp_path / name
    with pytest.raises(ConfigError, match=rf"^--export: .*{problem}"):
        check_export_path(str(out))  # train.py checks the path before training
    with pytest.raises(ConfigError, match=rf"^--export: .*{problem}"):
        export_mod.export_model(_model(), out)
    assert stub_export == [] and list(tmp_path.iterdir()) == []


def test_train_py_refuses_such_an_export_name_in_one_line_before_training(tmp_path):
    """`train.py --export` checks the name first: no training, one ERROR line, exit 2 (the dataset named here does not
    exist, so a run that got past the check would fail on it instead)."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"data": {"path": str(tmp_path / "no-data")}, "log": {"tb_dir": str(tmp_path / "tb")}}))
    out = str(tmp_path / ("m" * 260 + ".pt2"))
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(config), "--export", out],
                            capture_output=True, text=True, env=CHILD_ENV, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, process_output(result)
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "too long" in errors[0] and "Traceback" not in result.stderr, process_output(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]
