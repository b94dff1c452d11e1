"""Options accepted in a mode where they cannot act: each one was silently dropped (the output the same as without
it, no message). They are refused in one line, exit 2, before anything is written."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from dlrm.data import preprocess as pp
from dlrm.data import synthetic
from dlrm.data.schema import read_metadata

MULTI = ",".join(["3"] + ["1"] * 25)


def _tsv(path: Path, n: int = 30) -> Path:
    lines = []
    for k in range(n):
        dense = [str((k * (j + 3)) % 97) for j in range(13)]
        sparse = [f"{(k * 2654435761 + j * 40503) % (1 << 32):08x}" for j in range(26)]
        lines.append("\t".join([str(k % 2), *dense, *sparse]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _gen(out: Path, *extra: str):
    return CliRunner().invoke(synthetic.main, ["--rows", "200", "--out", str(out), "--cardinalities", "tiny", *extra])


def test_synthetic_multi_hot_fill_on_one_hot_data_is_refused(tmp_path):
    res = _gen(tmp_path / "ds", "--multi-hot-fill", "variable")
    assert res.exit_code == 2, res.output
    assert "--multi-hot-fill variable" in res.output and "multi-hot" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "ds").exists()


def test_synthetic_sparse_layout_on_one_hot_data_is_refused(tmp_path):
    for sizes in ([], ["--multi-hot-sizes", "one-hot"], ["--multi-hot-sizes", ",".join(["1"] * 26)]):
        res = _gen(tmp_path / "ds", "--sparse-layout", "lists", *sizes)
        assert res.exit_code == 2, (sizes, res.output)
        assert "--sparse-layout lists" in res.output and not (tmp_path / "ds").exists()


def test_synthetic_multi_hot_options_still_work_on_multi_hot_data(tmp_path):
    res = _gen(tmp_path / "ds", "--multi-hot-sizes", MULTI, "--multi-hot-fill", "variable", "--sparse-layout", "lists")
    assert res.exit_code == 0, res.output
    meta = read_metadata(tmp_path / "ds")
    assert meta.sparse_layout == "lists" and meta.extra["multi_hot_fill"] == "variable"
    # a bad --multi-hot-sizes is still named as such, not as the option it made inert
    res = _gen(tmp_path / "bad", "--multi-hot-sizes", "1,2", "--multi-hot-fill", "variable")
    assert res.exit_code == 2 and "--multi-hot-sizes" in res.output, res.output


def test_preprocess_sparse_layout_on_one_hot_data_is_refused(tmp_path):
    src = _tsv(tmp_path / "a.tsv")
    for sizes in ([], ["--multi-hot-sizes", "one-hot"]):
        res = CliRunner().invoke(pp.build_cli(), [str(src), "-o", str(tmp_path / "out"), "--sparse-layout", "lists",
                                                  "--no-progress", "--workers", "1", *sizes])
        assert res.exit_code == 2, (sizes, res.output)
        assert "--sparse-layout lists" in res.stderr and "multi-hot" in res.stderr
        assert not (tmp_path / "out").exists()


def test_relayout_sparse_layout_of_a_one_hot_dataset_is_refused(tmp_path):
    from dlrm.data import relayout

    assert _gen(tmp_path / "ds").exit_code == 0
    res = CliRunner().invoke(relayout.main, ["--data", str(tmp_path / "ds"), "--output", str(tmp_path / "out"),
                                             "--sparse-layout", "lists"])
    assert res.exit_code == 2, res.output
    assert "--sparse-layout lists" in res.output and "one-hot" in res.output
    assert not (tmp_path / "out").exists()
    # another codec is still a real change for a one-hot dataset (the layout left to its default)
    res = CliRunner().invoke(relayout.main, ["--data", str(tmp_path / "ds"), "--output", str(tmp_path / "out"),
                                             "--compression", "none"])
    assert res.exit_code == 0, res.output


def _sweep(tmp_path, *sets: str, interaction: str = "dot"):
    """run_sweep over `sets` on a config of `interaction`, training nothing: the trials it would run."""
    import json

    from dlrm.sweep import parse_set, run_sweep

    tmp_path.mkdir(exist_ok=True)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"interaction": interaction}, "train": {"device": "cpu"}}))
    trained: list = []

    def fake_train(cfg, run_dir=None):
        trained.append((cfg.model.interaction, cfg.model.cross_layers))
        raise KeyboardInterrupt  # stop at the first trial: only whether the sweep started matters

    try:
        run_sweep(str(config), [parse_set(s) for s in sets], 1, tb_dir=str(tmp_path / "tb"), run_name="sw",
                  train_fn=fake_train)
    except KeyboardInterrupt:
        pass
    return trained


def test_sweep_of_a_dcn_only_key_on_a_dot_model_is_refused(tmp_path):
    import pytest

    from dlrm.config import ConfigError

    for key, on in (("model.cross_layers=1,2", "model.interaction 'dcn'"),
                    ("model.cross_rank=8,16", "model.interaction"),
                    ("optim.dense.momentum=0,0.9", "optim.dense.name 'sgd' only, and every setting of this sweep has "
                     "'adam'")):
        with pytest.raises(ConfigError, match=rf"^--set {key.split('=')[0]}: acts with {on}"):
            _sweep(tmp_path, key)
        assert not (tmp_path / "tb" / "sw").exists()
    # SGD has no eps: a sweep of it trains one model
    with pytest.raises(ConfigError, match=r"^--set optim.dense.eps: acts with optim.dense.name 'adagrad' or 'adam'"):
        _sweep(tmp_path, "optim.dense.eps=1e-8,1e-6", "optim.dense.name=sgd")
    # where it acts: a dcn model, or a grid that sweeps the interaction too
    assert _sweep(tmp_path / "a", "model.cross_layers=1,2", interaction="dcn") == [("dcn", 1)]
    assert _sweep(tmp_path / "b", "model.interaction=dcn,dot", "model.cross_layers=1")[0][0] == "dcn"
    # (over two values, the grid's two dot settings would train one config: refused, tests/test_audit_sweepreport.py)
    with pytest.raises(ConfigError, match=r'^--set: model.interaction="dot", model.cross_layers=1 and '
                                          r'model.interaction="dot", model.cross_layers=2 train the same config'):
        _sweep(tmp_path / "c", "model.interaction=dcn,dot", "model.cross_layers=1,2")


def test_sweep_cli_names_the_inert_key_in_one_line(tmp_path):
    import json

    from dlrm import sweep

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"interaction": "cat"}, "train": {"device": "cpu"}}))
    res = CliRunner().invoke(sweep.main, ["--config", str(config), "--set", "model.cross_layers=1,2", "--seeds", "1",
                                          "--tb-dir", str(tmp_path / "tb"), "--data", str(tmp_path / "no-data")])
    assert res.exit_code == 2, res.output
    assert "--set model.cross_layers: acts with model.interaction 'dcn' only" in res.output and "'cat'" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "tb").exists()


def test_a_bare_export_refuses_batch_size(tmp_path, monkeypatch):
    """`--checkpoint C --export M --batch-size 8` exported C, exit 0: the batch size sets an evaluation's batches, and
    a bare export evaluates nothing (its program's batch dimension is dynamic). With --eval-only it acts."""
    import dlrm.cli as cli
    from dlrm.logging_setup import configure_logging
    from dlrm.train import checkpointer, export
    from tests.conftest import REPO

    calls: list = []
    monkeypatch.setattr(checkpointer, "checkpoint_for", lambda path: Path(path))
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda cfg, *a: calls.append(("eval", cfg.data.batch_size)))
    monkeypatch.setattr(export, "export_checkpoint", lambda *a: calls.append(("export",)))
    common = ["--config", str(REPO / "configs" / "sample.json"), "--checkpoint", str(tmp_path / "c.pt"),
              "--export", str(tmp_path / "m.pt2"), "--batch-size", "8"]
    try:
        res = CliRunner().invoke(cli.main, common)
        assert calls == [] and res.exit_code == 2, res.output
        assert "--batch-size: acts only on an evaluation or a training run" in res.output
        res = CliRunner().invoke(cli.main, [*common, "--eval-only", "--tb-dir", str(tmp_path / "tb")])
        assert res.exit_code == 0 and calls == [("eval", 8), ("export",)], res.output
    finally:
        configure_logging()  # main() pointed loguru at CliRunner's stderr, closed now
