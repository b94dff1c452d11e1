"""The reports of --compare and of a sweep are one set of files, written as a whole or not at all: a failure while
they are written (the plot, TensorBoard, a full disk) leaves no half-written file and no mix of one session's tables
with another's (a sweep --resume's earlier complete report stays as it was). --eval-only records data.path absolute,
as a training run does, whatever the working directory. Fake trainers keep it fast."""

from __future__ import annotations

import csv
import errno
import json
import os
from pathlib import Path

import pytest

from dlrm.config import ConfigError, load_config
from dlrm.sweep import parse_set, run_sweep
from tests.conftest import REPO, make_dataset
from tests.test_sweep import BASE

# -- --compare ----------------------------------------------------------------------------------------------------


def fake_variant(cfg, run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "events").write_text("history")
    return {"samples_per_sec": 1000.0, "warmup_s": 1.0, "peak_memory_bytes": None, "final_train_loss": 0.3,
            "auc": 0.7, "compile": {"graph_breaks": 0}, "train_losses": [(2, 0.5), (4, 0.3)],
            "resolved": {"compile": False}}


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_comparison_whose_plot_fails_leaves_no_partial_report(tmp_path, monkeypatch):
    """compare.md and compare.csv were written, then the plot failed: two of the three files, claiming a report."""
    import matplotlib.figure

    from dlrm.train.compare import run_comparison

    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run_comparison(cfg, ["eager"], fake_variant)
    base = tmp_path / "tb" / "cmp"
    assert (base / "eager" / "events").is_file()  # the variant's run is kept
    left = sorted(p.name for p in base.iterdir() if p.name.startswith(("compare", ".compare")))
    assert left == [], left


def test_a_comparison_writes_its_report_files_whole(tmp_path):
    from dlrm.train.compare import run_comparison

    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                         "log.run_name": "cmp"})
    run_comparison(cfg, ["eager"], fake_variant)
    base = tmp_path / "tb" / "cmp"
    assert (base / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["variant"] for r in csv.DictReader((base / "compare.csv").read_text().splitlines())] == ["eager"]
    assert "| eager |" in (base / "compare.md").read_text()
    assert not [p.name for p in base.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")
                and p.name != ".lock"]


# -- sweeps -------------------------------------------------------------------------------------------------------


@pytest.fixture
def sweep_config(tmp_path):
    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(tmp_path / "ds")
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    return tmp_path / "tiny.json"


def fake_trial(fail: set):
    """A trainer writing summary.json as a run does (so --resume gathers it); (lr, seed) in `fail` raises."""

    def train(cfg, run_dir=None, resume=None):
        key = (cfg.optim.sparse.lr, cfg.train.seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        if key in fail:
            (run_dir / "events").write_text("history")
            raise RuntimeError(f"trial {key} failed")
        auc = 0.7 + cfg.optim.sparse.lr + 0.001 * cfg.train.seed
        summary = {"auc": auc, "logloss": 1 - auc, "steps": 4, "run_dir": str(run_dir), "config": cfg.to_dict()}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    return train


def report(directory: Path) -> dict[str, str]:
    files = {name: (directory / name).read_text() for name in ("sweep.md", "sweep.csv", "trials.csv")}
    files["hparams"] = " ".join(sorted(str(p.relative_to(directory)) for p in (directory / "hparams").rglob("*")))
    return files


def test_a_resume_whose_report_fails_keeps_the_earlier_report_whole(tmp_path, sweep_config, monkeypatch):
    """The first session wrote its report (a trial failed); the resume trains that trial, then TensorBoard's HParams
    fail: the new tables had replaced the old ones and the old hparams/ was deleted (a report of two sessions)."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    from dlrm.sweep_resume import resume_sweep

    sets = [parse_set("optim.sparse.lr=0.01,0.03")]
    with pytest.raises(RuntimeError, match="failed"):
        run_sweep(str(sweep_config), sets, 2, tb_dir=str(tmp_path), run_name="sw", train_fn=fake_trial({(0.03, 1)}))
    directory = tmp_path / "sw"
    before = report(directory)
    assert "failed: RuntimeError" in before["trials.csv"] and "hparams/00-" in before["hparams"]
    monkeypatch.setattr(gfile.LocalFileSystem, "append", full_disk)  # the event files' writes
    with pytest.raises(OSError, match="No space left"):
        resume_sweep(directory, train_fn=fake_trial(set()))
    assert report(directory) == before
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]
    monkeypatch.undo()
    (directory / ".hparams.killed.tmp" / "00-x").mkdir(parents=True)  # what a write killed midway leaves
    (directory / ".sweep.md.killed.tmp").write_text("| half")
    resume_sweep(directory, train_fn=fake_trial(set()))  # the report, once it can be written: every trial ok
    after = report(directory)
    assert [r["status"] for r in csv.DictReader((directory / "trials.csv").read_text().splitlines())] == ["ok"] * 4
    assert after["hparams"] != "" and "failed" not in after["sweep.md"]
    assert sorted(p.name for p in directory.iterdir()) == ["00-sparse.lr=0.01", "01-sparse.lr=0.03", "hparams",
                                                           "sweep.csv", "sweep.json", "sweep.md", "trials.csv"]


def test_a_sweep_report_that_fails_midway_leaves_no_half_written_table(tmp_path, sweep_config, monkeypatch):
    """A failure while trials.csv was written (here: a value that cannot be formatted) left sweep.csv written and
    trials.csv cut off after its header."""

    class Unprintable(int):
        def __str__(self):
            raise OSError(errno.EIO, "Input/output error")

    def train(cfg, run_dir=None, resume=None):
        summary = fake_trial(set())(cfg, run_dir)
        return {**summary, "steps": Unprintable(4)}

    with pytest.raises(OSError, match="Input/output error"):
        run_sweep(str(sweep_config), [parse_set("optim.sparse.lr=0.01")], 1, tb_dir=str(tmp_path), run_name="sw",
                  train_fn=train)
    directory = tmp_path / "sw"
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith("00-")) == ["sweep.json"]


# -- --eval-only: data.path absolute ------------------------------------------------------------------------------


def _tiny(data: str, tb: str, name: str):
    from dlrm.config import config_from_dict

    return config_from_dict({
        "data": {"path": data, "batch_size": 16},
        "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
        "train": {"max_steps": 2, "device": "cpu", "seed": 3, "baseline": False, "compile": False},
        "checkpoint": {"every": 2, "keep": 1},
        "log": {"tb_dir": tb, "run_name": name},
    })


def test_eval_only_records_data_path_absolute_as_training_does(tmp_path, monkeypatch):
    from dlrm.train.export import evaluate_checkpoint
    from dlrm.train.trainer import train

    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=8)
    monkeypatch.chdir(tmp_path)
    trained = train(_tiny("ds", "tb", "r1"))
    assert json.loads((tmp_path / "tb" / "r1" / "summary.json").read_text())["config"]["data"]["path"] == str(
        tmp_path / "ds")
    summary = evaluate_checkpoint(_tiny("ds", "tb", "e1"), Path(trained["checkpoint"]), "validation")
    assert summary["auc"] == pytest.approx(trained["auc"], abs=1e-6)
    for name in ("summary.json", "config.json"):
        recorded = json.loads((tmp_path / "tb" / "e1" / name).read_text())
        assert recorded.get("config", recorded)["data"]["path"] == str(tmp_path / "ds"), name
    os.chdir(tmp_path / "tb")  # read from elsewhere, the record still names the same data
    assert Path(json.loads(Path("e1/summary.json").read_text())["config"]["data"]["path"]).is_dir()


def test_a_comparison_records_data_path_absolute(tmp_path, monkeypatch):
    """The comparison's own config.json: data.path as typed, while its variants' runs (the trainer's) record it
    absolute."""
    from dlrm.train.compare import run_comparison

    make_dataset(tmp_path / "ds", {"train": 16, "validation": 8}, row_group_size=8)
    monkeypatch.chdir(tmp_path)
    run_comparison(_tiny("ds", "tb", "cmp"), ["eager"], fake_variant)
    assert json.loads((tmp_path / "tb" / "cmp" / "config.json").read_text())["data"]["path"] == str(tmp_path / "ds")


def test_a_resumed_sweep_that_was_moved_names_its_trials_where_they_are(tmp_path, sweep_config):
    """trials.csv's run_dir of a trial gathered by --resume was the path its summary.json recorded when it ran: after
    the sweep directory moved (another disk, a rename), the rows named the old place, which no longer holds it (or
    holds another sweep's runs of the same names), while its failed trials' rows named the new one."""
    from dlrm.sweep_resume import resume_sweep

    (tmp_path / "a").mkdir()
    with pytest.raises(RuntimeError, match="failed"):
        run_sweep(str(sweep_config), [parse_set("optim.sparse.lr=0.01,0.03")], 1, tb_dir=str(tmp_path / "a"),
                  run_name="sw", train_fn=fake_trial({(0.03, 0)}))
    os.rename(tmp_path / "a", tmp_path / "b")
    directory = tmp_path / "b" / "sw"
    resume_sweep(directory, train_fn=fake_trial(set()))
    rows = list(csv.DictReader((directory / "trials.csv").read_text().splitlines()))
    assert [(r["status"], r["run_dir"]) for r in rows] == [
        ("ok", str(directory / "00-sparse.lr=0.01" / "seed-0")),
        ("ok", str(directory / "01-sparse.lr=0.03" / "seed-0"))]
    assert all((Path(r["run_dir"]) / "summary.json").is_file() for r in rows)


def test_export_of_a_finished_run_resumed_from_elsewhere_takes_that_runs_best(tmp_path, monkeypatch):
    """`train.py --tb-dir A/tb --run-name r1 --resume --export m.pt2` of a finished run: the export took summary.json's
    best_checkpoint, a path relative to the working directory the run trained in; from another one it named another
    run's best.pt (here a run of the same name under ./tb, whose model was exported silently) or none."""
    from dlrm import cli
    from dlrm.train import export as export_mod
    from dlrm.train.trainer import train

    make_dataset(tmp_path / "ds", {"train": 32, "validation": 16}, row_group_size=8)
    for place in ("A", "B"):  # the same relative names, two runs
        (tmp_path / place).mkdir()
        monkeypatch.chdir(tmp_path / place)
        cfg = _tiny(str(tmp_path / "ds"), "tb", "r1")
        cfg.train.eval_every, cfg.train.seed = 1, {"A": 3, "B": 4}[place]
        assert train(cfg)["best_checkpoint"] == str(tmp_path / place / "tb" / "r1" / "checkpoints" / "best.pt")
    # as an earlier version wrote it (summary.json's paths are absolute now: tests/test_audit_resumerec.py)
    written = tmp_path / "A" / "tb" / "r1" / "summary.json"
    written.write_text(json.dumps({**json.loads(written.read_text()),
                                   "best_checkpoint": str(Path("tb") / "r1" / "checkpoints" / "best.pt")}))
    exported = []
    monkeypatch.setattr(export_mod, "export_checkpoint", lambda cfg, ckpt, out: exported.append(Path(ckpt)))
    config = tmp_path / "c.json"
    config.write_text(json.dumps(cfg.to_dict()))
    cli.run(config_path=str(config), overrides={"log.tb_dir": str(tmp_path / "A" / "tb"), "train.seed": 3},
            eval_only=False, compare=None, resume="latest", checkpoint_path=None,
            export_path=str(tmp_path / "m.pt2"), allowed_changes=[], loaded=[])
    assert len(exported) == 1
    assert os.path.samefile(exported[0], tmp_path / "A" / "tb" / "r1" / "checkpoints" / "best.pt"), exported


def test_a_sweep_over_relative_data_paths_resumes_on_the_same_data_from_elsewhere(tmp_path, sweep_config,
                                                                                  monkeypatch):
    """`--set data.path=ds1,ds2` (relative) was recorded in sweep.json as typed: a --resume from another working
    directory trained the remaining trials on whatever ds1 and ds2 are there, in the same tables as the first
    session's (the record says --data is absolute so that a resume from elsewhere trains on the same data)."""
    from dlrm.sweep_resume import resume_sweep

    for place in ("A", "B"):
        for ds in ("ds1", "ds2"):
            make_dataset(tmp_path / place / ds, {"train": 16, "validation": 8}, row_group_size=8)
    seen = []

    def train(cfg, run_dir=None, resume=None):
        seen.append(os.path.abspath(cfg.data.path))
        return fake_trial({(0.01, 0)} if len(seen) <= 2 else set())(cfg, run_dir)

    monkeypatch.chdir(tmp_path / "A")
    sets = [parse_set("data.path=ds1,ds2"), parse_set("optim.sparse.lr=0.01")]
    with pytest.raises(RuntimeError, match="failed"):
        run_sweep(str(sweep_config), sets, 1, tb_dir=str(tmp_path), run_name="sw", train_fn=train)
    monkeypatch.chdir(tmp_path / "B")
    resume_sweep(tmp_path / "sw", train_fn=train)
    assert seen == [str(tmp_path / "A" / "ds1"), str(tmp_path / "A" / "ds2")] * 2
    # the same --set given again with the resume (relative to where it started) matches the record
    monkeypatch.chdir(tmp_path / "A")
    resume_sweep(tmp_path / "sw", sets=sets, train_fn=train)
    assert len(seen) == 4  # every trial finished: gathered, none trained again


def test_a_setting_with_a_bar_keeps_its_numbers_in_their_columns(tmp_path, sweep_config):
    """A swept value holding "|" (a dataset directory's name) split sweep.md's setting cell: every number of its row
    stood one column right of its heading (the AUC mean under "AUC mean" was the tail of the path)."""
    make_dataset(tmp_path / "v|1", {"train": 16, "validation": 8}, row_group_size=8)
    run_sweep(str(sweep_config), [parse_set(f"data.path={tmp_path / 'v|1'}")], 1, tb_dir=str(tmp_path),
              run_name="sw", train_fn=fake_trial(set()))
    head, _, row = (tmp_path / "sw" / "sweep.md").read_text().splitlines()[:3]
    cells = [c.strip() for c in row.replace("\\|", "\0").strip("|").split("|")]
    auc = float(next(csv.DictReader((tmp_path / "sw" / "sweep.csv").read_text().splitlines()))["auc_mean"])
    assert len(cells) == len(head.strip("|").split("|")) and cells[1] == f"{auc:.4f}", row
    assert cells[0].replace("\0", "|") == f'data.path="{tmp_path / "v|1"}"'


def test_two_relative_data_paths_of_one_directory_are_refused(tmp_path, sweep_config, monkeypatch):
    """Made absolute, ``ds1`` and ``./ds1`` are one value listed twice (a record the resume refuses)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--set data.path: .* names one directory twice"):
        run_sweep(str(sweep_config), [parse_set("data.path=ds1,./ds1")], 1, tb_dir=str(tmp_path), run_name="sw2",
                  train_fn=fake_trial(set()))
    assert not (tmp_path / "sw2").exists()
