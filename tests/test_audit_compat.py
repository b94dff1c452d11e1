"""Artifacts written by older versions of this program, read by this one (audit of backward compatibility).

Each old artifact is written here in the old layout, explicitly (what the old version wrote, less what it lacked):

1. a checkpoint written before checkpoints recorded ``data_placement`` (2026-11-30) by a run with an explicit
   ``data.placement`` ("stream" was the default until "auto" came; "gpu"): resumed with "auto" (free on a resume), it
   was taken for "placement unknown", so "auto" resolved afresh (on a CPU "stream", on a GPU "gpu" where the split
   fits) and the shuffled batches from there on were another loader's, silently;
2. a sweep recorded (sweep.json, its trials' summary.json) before ``train.early_stopping.target`` existed: a
   ``--resume`` with this version compared the record without the key to today's config with it (null) and refused
   the sweep as "started otherwise" (naming "<object object at 0x...>" as the recorded value).
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from dlrm import checkpoint as ckpt
from dlrm.config import ConfigError
from dlrm.errors import TrainingStopped
from dlrm.sweep import parse_set, run_sweep
from dlrm.train.trainer import train
from tests.conftest import make_dataset
from tests.test_audit_resume_edges import assert_same_state, last_state, one_hot, signal_at
from tests.test_sweep import BASE


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    make_dataset(root / "one", {"train": 100, "validation": 32}, row_group_size=30)
    return root


def as_written_before_data_placement(path):
    """Rewrite the checkpoint at `path` as versions before 2026-11-30 wrote it: no ``data_placement`` key."""
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw.pop("data_placement") == json.loads(raw["config_json"])["data"]["placement"]
    torch.save(raw, path)
    assert "data_placement" not in ckpt.load_checkpoint(path)


def test_an_old_checkpoint_of_an_explicit_placement_resumes_its_batches_with_auto(data, tmp_path, monkeypatch):
    """A run of data.placement "gpu" (on the CPU: the split held in host memory, the device loader's shuffle) stopped
    at step 8 by an older version, resumed with "auto" (on the CPU: "stream"): the uninterrupted run's batches."""
    gpu = {"data.placement": "gpu"}
    full = train(one_hot(data, tmp_path, "full", **gpu))
    with monkeypatch.context() as m:
        signal_at(m, 8)
        with pytest.raises(TrainingStopped):
            train(one_hot(data, tmp_path, "old", **gpu))
    stopped = ckpt.list_checkpoints(tmp_path / "tb" / "old")[-1]
    as_written_before_data_placement(stopped)
    resumed = train(one_hot(data, tmp_path, "old", **{"data.placement": "auto"}), resume="latest")
    assert resumed["resumed_at_step"] == 8
    assert resumed["resolved"]["placement"] == "gpu"  # was "stream": the stream loader's batches
    assert resumed["train_losses"] == full["train_losses"] and resumed["auc"] == full["auc"]
    assert_same_state(last_state(tmp_path, "full"), last_state(tmp_path, "old"))
    # another explicit placement is refused, as for a checkpoint that records it
    with pytest.raises(ConfigError, match=r"data.placement: 'stream', where the run resumed read its batches with "
                                          r"'gpu'.*--allow-config-change data.placement$"):
        train(one_hot(data, tmp_path, "other", **{"data.placement": "stream"}), resume=str(stopped))


def test_an_old_checkpoint_of_the_old_default_stream_placement_is_not_moved_to_the_gpu_loader():
    """The old default "stream" (in the saved config) against "auto" resolving to "gpu" (a GPU where the split fits):
    the run keeps streaming; "auto" in the saved config stays unknown (the resume's choice)."""
    from dlrm.config import Config
    from dlrm.train.placement import resumed_placement

    cfg = Config()
    assert cfg.data.placement == "auto" and cfg.data.shuffle
    old = {"config": {"data": {"placement": "stream"}}, "position": {"step": 8, "epoch": 0, "batch": 8}}
    assert resumed_placement(cfg, old, "gpu") == "stream"  # was "gpu"
    unknown = {"config": {"data": {"placement": "auto"}}}
    assert resumed_placement(cfg, unknown, "gpu") == "gpu"
    assert resumed_placement(cfg, {"config": {}}, "stream") == "stream"


def test_an_old_checkpoint_of_auto_placement_warns_that_its_choice_is_unknown():
    """A checkpoint of 2026-11-23..30 saved "auto" without what it resolved to: the resume cannot know which
    loader's batches the run trained on, and says so (once, naming the checkpoint); not for a known placement, nor
    unshuffled (both loaders then give the rows in file order)."""
    from loguru import logger

    from dlrm.config import Config
    from dlrm.train.placement import resumed_placement

    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        cfg = Config()
        assert resumed_placement(cfg, {"config": {"data": {"placement": "auto"}}}, "gpu", (), "ck.pt") == "gpu"
        assert len(seen) == 1 and "ck.pt does not record which placement" in seen[0] and "with gpu" in seen[0]
        assert resumed_placement(cfg, {"config": {"data": {"placement": "auto"}}, "data_placement": "gpu"}, "gpu") \
            == "gpu"
        assert resumed_placement(cfg, {"config": {"data": {"placement": "stream"}}}, "stream") == "stream"
        cfg.data.shuffle = False
        assert resumed_placement(cfg, {"config": {"data": {"placement": "auto"}}}, "gpu") == "gpu"
        assert len(seen) == 1
    finally:
        logger.remove(handle)


# ---------------------------------------------------------------------------------------------------------------------
# A sweep recorded before train.early_stopping.target existed


@pytest.fixture(scope="module")
def early_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat_sweep")
    make_dataset(root / "ds", {"train": 64, "validation": 32}, row_group_size=16)
    raw = json.loads(json.dumps(BASE))
    raw["data"]["path"] = str(root / "ds")
    raw["checkpoint"] = {"every": 2}
    raw["train"]["eval_every"] = 2
    raw["train"]["early_stopping"] = {"metric": "auc", "patience": 3}
    path = root / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def _drop_target(config: dict) -> None:
    early = config["train"]["early_stopping"]
    assert early["target"] is None
    del early["target"]


def test_a_sweep_recorded_before_early_stopping_target_resumes(tmp_path, early_config):
    """The sweep's record and its finished trial's summary as an older version wrote them (no
    train.early_stopping.target); the second trial interrupted after its checkpoint at step 2."""
    directory, _ = run_sweep(str(early_config), [parse_set("optim.sparse.lr=0.01,0.1")], 1, tb_dir=str(tmp_path),
                             run_name="sw")
    reference = {r["setting"]: r["auc"] for r in csv.DictReader(open(directory / "trials.csv"))}
    record = json.loads((directory / "sweep.json").read_text())
    _drop_target(record["resolved"])
    (directory / "sweep.json").write_text(json.dumps(record))
    for summary_path in directory.glob("*/seed-0/summary.json"):
        summary = json.loads(summary_path.read_text())
        _drop_target(summary["config"])
        summary_path.write_text(json.dumps(summary))
    second = directory / "01-sparse.lr=0.1" / "seed-0"
    (second / "summary.json").unlink()
    for later in ckpt.list_checkpoints(second)[1:]:
        later.unlink()
    calls = []

    def recording(cfg, run_dir=None, resume=None):
        calls.append((cfg.optim.sparse.lr, resume is not None))
        return train(cfg, run_dir=run_dir, resume=resume)

    from dlrm.sweep_resume import resume_sweep

    # was: ConfigError "... was started otherwise ...: the config ... differs in train.early_stopping.target:
    # "<object object at 0x...>" -> null"
    resume_sweep(directory, train_fn=recording)
    assert calls == [(0.1, True)]  # the finished trial gathered, the interrupted one resumed
    assert {r["setting"]: r["auc"] for r in csv.DictReader(open(directory / "trials.csv"))} == reference


def test_a_sweep_record_lacking_a_key_set_now_names_it_absent(tmp_path, early_config):
    """A key of the record that this version's config lacks is still refused, in a line that says it is absent now
    (not "<object object at 0x...>")."""
    directory, _ = run_sweep(str(early_config), [parse_set("optim.sparse.lr=0.01")], 1, tb_dir=str(tmp_path),
                             run_name="sw")
    record = json.loads((directory / "sweep.json").read_text())
    record["resolved"]["train"]["unknown_old_key"] = 1  # a key of the record this version does not have
    (directory / "sweep.json").write_text(json.dumps(record))
    from dlrm.sweep_resume import resume_sweep

    with pytest.raises(ConfigError, match=r"differs in train.unknown_old_key: 1 -> \(absent\); resume it as it "
                                          r"started") as e:
        resume_sweep(directory, train_fn=lambda *a, **k: pytest.fail("trained"))
    assert "object at 0x" not in str(e.value) and "early_stopping.target" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------------------
# An unfinished preprocessing run (of this or an older version) resumed from another working directory


def test_an_unfinished_preprocessing_run_resumes_from_another_working_directory(tmp_path, monkeypatch):
    """Started with a relative input path, stopped by a bad line (its finished chunks kept), resumed with
    --on-bad-line skip from another directory, naming the same file absolutely: the uninterrupted run's dataset.
    The manifest's file scans kept the relative spelling, and the resume failed "[Errno 2] No such file or directory"
    on the input it had been given."""
    from dlrm.data import preprocess as pp
    from dlrm.data.preprocess.errors import BadLineError
    from tests.test_preprocess import assert_same_dataset, make_fields

    rows = make_fields(400, seed=5)
    lines = ["\t".join(r) for r in rows]
    lines[330] = "garbage\tline"
    (tmp_path / "first").mkdir()
    (tmp_path / "elsewhere").mkdir()
    src = tmp_path / "first" / "raw.tsv"
    src.write_text("\n".join(lines) + "\n")
    opts = dict(chunk_rows=50, progress=False, workers=1)
    monkeypatch.chdir(tmp_path / "first")
    with pytest.raises(BadLineError, match=r"raw.tsv:331"):
        pp.preprocess(["raw.tsv"], tmp_path / "ds", **opts)
    assert (tmp_path / "ds" / "_progress" / "manifest.json").is_file()
    monkeypatch.chdir(tmp_path / "elsewhere")
    meta = pp.preprocess([src], tmp_path / "ds", on_bad_line="skip", **opts)
    assert sum(s.rows for s in meta.splits.values()) == 399
    pp.preprocess([src], tmp_path / "reference", on_bad_line="skip", **opts)
    assert_same_dataset(tmp_path / "ds", tmp_path / "reference")
