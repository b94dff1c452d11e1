"""Review of session 57's last commits (options that cannot act refused, 348e2a7): what the refusals still missed.

* ``--tb-dir`` with a bare ``--export`` of a ``--checkpoint`` was accepted and did nothing (the export writes no run
  directory), as ``--run-name`` and ``--batch-size`` did before they were refused.
* a sweep's ``--set`` of a section holding an inert key (``--set 'optim.dense={"momentum": 0},{"momentum": 0.9}'`` on
  Adam, ``--set 'model={"cross_layers": 1},...'`` on a dot model) trained the same model under each value, unrefused:
  only the dotted key itself was looked for.
* relayout of a one-hot dataset logged "wrote OUT (slots, ..., schema version 2)": one-hot columns have no layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrm.config import ConfigError
from tests.test_audit_noopflags import _gen, _sweep


def test_a_bare_export_refuses_tb_dir(tmp_path, monkeypatch):
    """`--checkpoint C --export M --tb-dir T` exported C, exit 0, and T was never used (no run directory is made);
    with --eval-only it places the evaluation's run directory, and is accepted."""
    import dlrm.cli as cli
    from dlrm.logging_setup import configure_logging
    from dlrm.train import checkpointer, export
    from tests.conftest import REPO

    calls: list = []
    monkeypatch.setattr(checkpointer, "checkpoint_for", lambda path: Path(path))
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda cfg, *a: calls.append(("eval", cfg.log.tb_dir)))
    monkeypatch.setattr(export, "export_checkpoint", lambda *a: calls.append(("export",)))
    common = ["--config", str(REPO / "configs" / "sample.json"), "--checkpoint", str(tmp_path / "c.pt"),
              "--export", str(tmp_path / "m.pt2"), "--tb-dir", str(tmp_path / "tb")]
    try:
        res = CliRunner().invoke(cli.main, common)
        assert res.exit_code == 2 and calls == [], res.output
        errors = [line for line in res.output.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "--tb-dir: acts only on an evaluation or a training run" in errors[0], res.output
        assert not (tmp_path / "tb").exists()
        res = CliRunner().invoke(cli.main, [*common, "--eval-only"])
        assert res.exit_code == 0 and calls == [("eval", str(tmp_path / "tb")), ("export",)], res.output
    finally:
        configure_logging()  # main() pointed loguru at CliRunner's stderr, closed now


def test_a_sweep_of_a_section_holding_an_inert_key_is_refused(tmp_path):
    from dlrm import sweep

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"interaction": "dot"}, "train": {"device": "cpu"}}))
    res = CliRunner().invoke(sweep.main, ["--config", str(config), "--set",
                                          'optim.dense={"momentum": 0},{"momentum": 0.9}', "--seeds", "1",
                                          "--tb-dir", str(tmp_path / "tb"), "--data", str(tmp_path / "no-data")])
    assert res.exit_code == 2, res.output
    assert ("--set optim.dense (optim.dense.momentum): acts with optim.dense.name 'sgd' only, and every setting of "
            "this sweep has 'adam'") in res.output
    assert "Traceback" not in res.output and not (tmp_path / "tb").exists()
    # a whole section too, and any depth of it
    with pytest.raises(ConfigError, match=r"^--set model \(model.cross_layers\): acts with model.interaction 'dcn'"):
        _sweep(tmp_path / "a", 'model={"cross_layers": 1},{"cross_layers": 2}')
    with pytest.raises(ConfigError, match=r"^--set optim \(optim.sparse.eps\): acts with optim.sparse.name"):
        _sweep(tmp_path / "b", 'optim={"sparse": {"name": "sgd", "eps": 1e-8}},{"sparse": {"name": "sgd", "eps": 1e-6}}')
    assert not (tmp_path / "a" / "tb").exists() and not (tmp_path / "b" / "tb").exists()
    # where the key acts (the section names the optimizer it acts with, or the model is dcn), the sweep runs
    assert _sweep(tmp_path / "c", 'model={"interaction": "dcn", "cross_layers": 1},{"interaction": "dcn", '
                                  '"cross_layers": 2}') == [("dcn", 1)]
    # (a section's value replaces the file's whole section: a dcn config's interaction gone, the message says so)
    with pytest.raises(ConfigError, match=r"^--set model \(model.cross_layers\): .* every setting of this sweep has 'dot'"):
        _sweep(tmp_path / "d", 'model={"cross_layers": 1},{"cross_layers": 2}', interaction="dcn")
    # and a section's other keys are no inert key's: swept as before, also where its values carry an inert key
    # unchanged (a section copied from a run's config.json holds every key: momentum 0 beside Adam's lr)
    assert _sweep(tmp_path / "e", 'optim.dense={"lr": 0.1},{"lr": 0.2}') == [("dot", 3)]
    assert _sweep(tmp_path / "f", 'optim.dense={"name": "adam", "lr": 0.1, "momentum": 0.0, "eps": 1e-8},'
                                  '{"name": "adam", "lr": 0.2, "momentum": 0.0, "eps": 1e-8}') == [("dot", 3)]


def test_relayout_of_a_one_hot_dataset_logs_no_sparse_layout(tmp_path):
    from dlrm.data import relayout
    from dlrm.data.schema import read_metadata

    assert _gen(tmp_path / "ds").exit_code == 0
    res = CliRunner().invoke(relayout.main, ["--data", str(tmp_path / "ds"), "--output", str(tmp_path / "out"),
                                             "--compression", "none"])
    assert res.exit_code == 0, res.output
    assert read_metadata(tmp_path / "out").written_version == 2  # one-hot columns: the same files, version 2
    wrote = [line for line in res.output.splitlines() if f"wrote {tmp_path / 'out'}" in line]
    assert len(wrote) == 1 and "(one-hot, dense counts, schema version 2)" in wrote[0], res.output
