"""Review of the fiftieth session's fixes (audit helper): the paths those fixes left out."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from dlrm import cli
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset

SAMPLE = REPO / "configs" / "sample.json"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("review50") / "ds"
    make_dataset(root, {"train": 320, "validation": 64}, row_group_size=80)
    return root


def tiny_config(dataset, tb, **overrides):
    base = {"data.path": str(dataset), "log.tb_dir": str(tb), "data.batch_size": 32, "train.max_steps": 3,
            "train.log_every": 3, "train.device": "cpu", "train.baseline": False}
    return load_config(SAMPLE, {**base, **overrides})


def test_eval_only_with_export_refuses_a_config_name_that_cannot_name_its_run_before_loading(tmp_path):
    """--eval-only --checkpoint C --export M evaluates (into a run directory of the default name) and exports: the
    default name's check (aa5d52e) was skipped for it as for a bare export, so a config file "my config.json" failed
    after the checkpoint and the model were loaded, naming log.run_name, a key the user never set."""
    bad = tmp_path / "my config.json"
    bad.write_text(SAMPLE.read_text())
    res = CliRunner().invoke(cli.main, ["--config", str(bad), "--eval-only", "--checkpoint", str(tmp_path / "none.pt"),
                                        "--export", str(tmp_path / "m.pt2"), "--tb-dir", str(tmp_path / "tb")])
    assert res.exit_code == 2, res.output
    assert "name: 'my config'" in res.output and "none.pt" not in res.output, res.output
    assert not (tmp_path / "tb").exists() and not (tmp_path / "m.pt2").exists()
    # a bare export of a --checkpoint writes no run directory: the name does not matter there (nor does --tb-dir,
    # refused with it)
    res = CliRunner().invoke(cli.main, ["--config", str(bad), "--checkpoint", str(tmp_path / "none.pt"),
                                        "--export", str(tmp_path / "m.pt2")])
    assert res.exit_code == 2 and "none.pt" in res.output, res.output


def test_resume_latest_of_a_run_reached_through_a_symbolic_link(dataset, tmp_path):
    """tb/r a symbolic link to a run kept elsewhere: --resume --run-name r was refused as naming "another existing
    run (tb/r)", the very run the checkpoint belongs to (the names compared, the link's with the real directory's),
    and the message said to omit --run-name, which --resume (latest) needs."""
    train(tiny_config(dataset, tmp_path / "big", **{"log.run_name": "real"}))
    (tmp_path / "tb").mkdir()
    os.symlink(tmp_path / "big" / "real", tmp_path / "tb" / "r")
    summary = train(tiny_config(dataset, tmp_path / "tb", **{"log.run_name": "r", "train.max_steps": 6}),
                    resume="latest")
    assert summary["resumed_at_step"] == 3 and summary["steps"] == 6
    # the checkpoint named by its real path, the run by the link's name: the same run, continued in place too
    real = tmp_path / "big" / "real" / "checkpoints"
    summary = train(tiny_config(dataset, tmp_path / "tb", **{"log.run_name": "r", "train.max_steps": 9}),
                    resume=str(real / "step-00000006.pt"))
    assert summary["resumed_at_step"] == 6 and summary["steps"] == 9
    assert sorted(p.name for p in real.glob("step-*.pt")) == ["step-00000003.pt", "step-00000006.pt", "step-00000009.pt"]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["r"]  # no copy made beside it


def test_resume_in_place_when_checkpoints_is_a_symbolic_link_to_another_disk(dataset, tmp_path):
    """<run>/checkpoints a symbolic link to another disk (a 50 GB checkpoint): the run was taken to be the link
    target's parent (the checkpoint's path resolved), so --resume --run-name r refused the run's own latest checkpoint
    as another run's ("belongs to run 'disk'": before d785aff it continued "in place" in that other folder)."""
    train(tiny_config(dataset, tmp_path / "tb", **{"log.run_name": "r"}))
    run = tmp_path / "tb" / "r"
    (tmp_path / "disk").mkdir()
    shutil.move(str(run / "checkpoints"), str(tmp_path / "disk" / "r-ckpts"))
    os.symlink(tmp_path / "disk" / "r-ckpts", run / "checkpoints")
    summary = train(tiny_config(dataset, tmp_path / "tb", **{"log.run_name": "r", "train.max_steps": 6}),
                    resume="latest")
    assert summary["resumed_at_step"] == 3 and summary["steps"] == 6
    assert (tmp_path / "disk" / "r-ckpts" / "step-00000006.pt").is_file()
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["r-ckpts"]  # nothing written beside it
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_checkpointer_links_best_pt_when_checkpoints_is_a_symbolic_link(tmp_path, monkeypatch):
    """The same symbolic link, seen by the checkpointer: its test "this step is saved in this run" compared the
    checkpoint's resolved grandparent with the run, so a step was saved twice (the end's save after a checkpoint.every
    one) and best.pt was a second full copy of the model, not a hard link to the step's checkpoint."""
    from types import SimpleNamespace

    import torch

    from dlrm import checkpoint as ckpt
    from dlrm.config import Config
    from dlrm.distributed.env import DistEnv
    from dlrm.model.dlrm import build_model
    from dlrm.train.checkpointer import Checkpointer
    from dlrm.train.meter import RunStats

    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    model = build_model(cfg.model, [3, 5, 2], None, cfg.kernels, "cpu")
    run = SimpleNamespace(model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], schedulers=[],
                          plan=None)
    tables = SimpleNamespace(cardinalities=[3, 5, 2], multi_hot_sizes=None, dense_format="counts")
    (tmp_path / "disk").mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "disk", tmp_path / "run" / "checkpoints")
    cp = Checkpointer(tmp_path / "run", cfg, tables, DistEnv())
    first = cp.save(run, ckpt.Position(4, 0, 4), RunStats())
    saves = []
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *a, **k: saves.append(a) or first)
    assert cp.save(run, ckpt.Position(4, 0, 4), RunStats()) == first and saves == []  # saved once
    best = cp.save_best(run, ckpt.Position(4, 0, 4), RunStats())
    assert best.samefile(tmp_path / "disk" / ckpt.checkpoint_name(4))


def test_a_sweep_started_in_the_same_second_as_another_gets_its_own_directory(tmp_path, monkeypatch):
    """Two sweeps of one config without --run-name started in the same second: the default directory name
    (<config>-sweep-<date>-<time>) was the other's; refused as "--run-name ... already exists" (no --run-name was
    given) once that one wrote, and shared while it was still empty (the two sweeps' trials collided). Runs get
    -2, -3, ... since d785aff; sweeps now too."""
    from dlrm import sweep

    monkeypatch.setattr(sweep.time, "strftime", lambda fmt, *a: "20261130-120000")
    tb = tmp_path / "tb"
    first, created = sweep.sweep_directory(str(tb), None, "configs/my.json")
    assert first == tb / "my-sweep-20261130-120000" and created
    second, created = sweep.sweep_directory(str(tb), None, "configs/my.json")  # the first one still empty
    assert second == tb / "my-sweep-20261130-120000-2" and created
    (second / "0-setting").mkdir()
    third, _ = sweep.sweep_directory(str(tb), None, "configs/my.json")
    assert third == tb / "my-sweep-20261130-120000-3"
    # an explicit --run-name is never renamed: an existing one is refused
    with pytest.raises(sweep.ConfigError, match="already exists"):
        sweep.sweep_directory(str(tb), "my-sweep-20261130-120000-2", "configs/my.json")


def test_resume_of_a_copied_checkpoint_into_an_existing_run_names_no_bogus_run(tmp_path):
    """--resume models/mine.pt (a copy, outside any run) --run-name EXISTING is refused, but the message said the copy
    "belongs to run '<the copy's grandparent folder>'", a folder that is no run."""
    from dlrm.config import ConfigError
    from dlrm.train.run_dir import RunDirectory

    copy = tmp_path / "home" / "models" / "mine.pt"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"")
    (tmp_path / "tb" / "existing").mkdir(parents=True)
    (tmp_path / "tb" / "existing" / "config.json").write_text("{}")
    cfg = load_config(SAMPLE, {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "existing"})
    with pytest.raises(ConfigError) as e:
        RunDirectory.for_resume(cfg, copy, None)
    message = str(e.value)
    assert "'home'" not in message and "belongs to run" not in message, message
    assert "not in a run's checkpoints/" in message and "existing" in message and "\n" not in message, message


def test_a_schedule_added_on_resume_starts_at_the_checkpoints_step(dataset, tmp_path):
    """A run trained without a schedule, resumed with --allow-config-change optim.schedule adding a decay from step
    3: the new schedule stood at its step 0 (LambdaLR as built; the checkpoint held no scheduler state), so the decay
    began 3 steps late (here: never, the run ended at its step 6 at the full lr). The lr after resume must be the one
    an uninterrupted run with that schedule has at that step (before step 3 the two schedules agree)."""
    import torch

    decay = {"optim.schedule.warmup_steps": 0, "optim.schedule.decay": "linear", "optim.schedule.decay_start_step": 3,
             "optim.schedule.decay_steps": 3, "optim.schedule.end_factor": 0.1, "train.max_steps": 6}
    constant = {"optim.schedule.warmup_steps": 0, "optim.schedule.decay": "none"}
    whole = train(tiny_config(dataset, tmp_path, **decay, **{"log.run_name": "whole"}))
    train(tiny_config(dataset, tmp_path, **constant, **{"log.run_name": "r"}))
    resumed = train(tiny_config(dataset, tmp_path, **decay, **{"log.run_name": "r"}), resume="latest",
                    allow_config_change=["optim.schedule"])
    a, b = (torch.load(tmp_path / run / "checkpoints" / "step-00000006.pt", weights_only=False)
            for run in ("whole", "r"))
    assert [g["lr"] for o in b["optimizers"] for g in o["param_groups"]] == pytest.approx(
        [g["lr"] for o in a["optimizers"] for g in o["param_groups"]], rel=1e-12)
    assert b["optimizers"][0]["param_groups"][0]["lr"] == pytest.approx(0.002 * 0.1)  # decayed to end_factor
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert resumed["final_train_loss"] == whole["final_train_loss"]
