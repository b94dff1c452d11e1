"""Session 59's audit of resumes, stops and logs (left59): checkpoint paths in log lines, the sweep's stop lines in
order, a free run name that fits a directory name, sessions overlapping after a resume from an older checkpoint,
another evaluation split's points, and the signal line of a torchrun run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrm.config import load_config
from dlrm.config_checks import MAX_NAME_BYTES, free_run_name
from dlrm.errors import TrainingStopped
from dlrm.train import evaluator as evaluator_mod
from dlrm.train.trainer import train
from tests.test_audit_overwrite52 import tiny_config


@pytest.mark.parametrize("name", ["r" * MAX_NAME_BYTES, "é" * (MAX_NAME_BYTES // 2) + "x"])
def test_a_free_run_name_beside_a_long_one_fits_a_directory_name(tmp_path, name):
    """``r``*255 taken: the advice named ``r``*255 + ``-2`` (257 bytes), which mkdir refuses (ENAMETOOLONG)."""
    (tmp_path / name).mkdir()
    free = free_run_name(tmp_path / name)
    assert len(os.fsencode(free)) <= MAX_NAME_BYTES, free
    (tmp_path / free).mkdir()  # the name it advises can be made
    again = free_run_name(tmp_path / name)  # and the next one is another (free) name
    assert again != free and len(os.fsencode(again)) <= MAX_NAME_BYTES
    (tmp_path / again).mkdir()


def test_a_signal_stops_line_names_the_checkpoint_by_its_absolute_path(tmp_path, monkeypatch):
    """With a relative --tb-dir a run's first session named its checkpoints relative ("checkpoint tb/r/...") in its
    log lines while a resumed session named them absolute (and summary.json always does): now absolute in both."""
    config = tiny_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    calls = []

    def evaluate(forward, loader, env=None):  # the second evaluation (step 4): as `kill PID` during the step
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"auc": 0.6, "logloss": 0.5, "accuracy": 0.75}

    monkeypatch.setattr(evaluator_mod, "evaluate", evaluate)
    with pytest.raises(TrainingStopped) as stopped:
        train(load_config(config, {"log.tb_dir": "tb", "log.run_name": "r"}))
    line = str(stopped.value)
    assert "checkpoint " in line, line
    named = line.split("checkpoint ", 1)[1].split()[0].rstrip(";,")
    assert os.path.isabs(named), line
    assert Path(named).is_file() and Path(named).parent == tmp_path / "tb" / "r" / "checkpoints"


def test_a_stopped_sweep_says_so_after_the_trials_own_stop_line(tmp_path, monkeypatch):
    """"sweep: stopped; ... --resume" came before the trial's "stopped by signal at step N; checkpoint ..." line
    (which `main` reports as the sweep's error): the log read as if the sweep stopped before its trial did."""
    from dlrm import sweep
    import dlrm.train.trainer as trainer_mod

    config = tiny_config(tmp_path)

    def stopped(cfg, run_dir=None, resume=None, **kw):
        (Path(run_dir) / "checkpoints").mkdir(parents=True)
        (Path(run_dir) / "checkpoints" / "step-00000002.pt").write_bytes(b"x")
        raise TrainingStopped(143, "stopped by signal at step 2; checkpoint X")

    monkeypatch.setattr(trainer_mod, "train", stopped)
    res = CliRunner().invoke(sweep.main, ["--config", str(config), "--set", "optim.dense.lr=0.1,0.2", "--seeds", "1",
                                          "--tb-dir", str(tmp_path / "tb"), "--run-name", "sw"])
    assert res.exit_code == 143, res.output
    trial, concluded = res.output.find("stopped by signal at step 2"), res.output.find("sweep: stopped;")
    assert trial >= 0 and concluded >= 0, res.output
    assert trial < concluded, res.output
    assert res.output.count("sweep: stopped;") == 1


def test_sessions_of_a_resume_from_an_older_checkpoint_mark_the_steps_it_trained_again(tmp_path):
    """A run trained to step 10 (its summary.json's one session 0-10), its step-10 checkpoint removed, resumed in place
    from step 8 (then the latest): ``sessions`` read 0-10 and 8-12, both counted as the run's; the first now says its
    steps after 8 were discarded."""
    from dlrm.train.sessions import with_sessions

    path = tmp_path / "summary.json"
    first = {"steps": 10, "resumed_at_step": None, "samples_per_sec": 5.0}
    with_sessions(first, path)
    path.write_text(json.dumps(first))
    assert "discarded_after" not in first["sessions"][0]
    second = {"steps": 12, "resumed_at_step": 8}
    with_sessions(second, path)
    old, new = second["sessions"]
    assert (old["start_step"], old["end_step"], old["discarded_after"]) == (0, 10, 8)
    assert (new["start_step"], new["end_step"]) == (8, 12) and "discarded_after" not in new
    # a resume at the run's end (a longer max_steps) discards nothing
    path.write_text(json.dumps(second))
    third = {"steps": 20, "resumed_at_step": 12}
    with_sessions(third, path)
    assert [s.get("discarded_after") for s in third["sessions"]] == [8, None, None]


# every rank listed in KILL_RANK (comma-separated) sends itself SIGINT during its third step, as a terminal's Ctrl-C
# reaches the whole process group (or `kill -INT PID` one process)
_SIGINT_SCRIPT = """
import os, signal, sys
if os.environ["RANK"] in os.environ["KILL_RANK"].split(","):
    from dlrm.train.meter import StepMeter
    real, calls = StepMeter.step, []
    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)
    StepMeter.step = step
from dlrm.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("ranks", ["0,1", "1"])
def test_a_ctrl_c_of_every_torchrun_rank_is_said_once(tmp_path, ranks):
    """A Ctrl-C reaches every rank: each printed "SIGINT: finishing the current step..." (rank 0's, then `[rank 1]`'s
    copy; one a GPU). Now rank 0 says it for all; a rank that alone got it (``kill -INT`` of rank 1) still says its
    own, at the ranks' agreement (the next logging window). Both stop with 130 after one checkpoint."""
    from tests.conftest import make_dataset
    from tests.test_audit_onerank_stop import launch

    make_dataset(tmp_path / "ds", {"train": 120, "validation": 40}, row_group_size=20)
    results = launch(tmp_path, tmp_path / "ds", "r", kill_at="step", kill_rank=ranks, script=_SIGINT_SCRIPT)
    for rank, (code, out) in enumerate(results):
        assert code == 130, f"rank {rank} exited {code}:\n{out[-3000:]}"
        assert "Traceback" not in out, out[-3000:]
    said = [out.count("SIGINT: finishing the current step") for _, out in results]
    assert said == ([1, 0] if ranks == "0,1" else [0, 1]), [out[-2000:] for _, out in results]
    assert "stopped by signal at step 5" in results[0][1], results[0][1][-2000:]


def _scalars(run: Path) -> dict[str, list[int]]:
    """Steps of each scalar tag in `run`'s event files, as TensorBoard loads them (purges included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_resume_at_the_end_on_another_eval_split_is_its_own_curve(tmp_path):
    """A run evaluated on 'validation' (eval/* at 2, 4, ..., 10), stopped before its summary and resumed at its end
    with data.eval_split 'test':
    its last evaluation, of 'test', was a second eval/auc point at step 10 (a vertical segment between two splits'
    numbers). Now it is eval/test/*, the run's eval/* left 'validation''s; a later resume on 'test' keeps that."""
    from tests.conftest import make_dataset

    config = tiny_config(tmp_path)
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16, "test": 16})
    train(load_config(config, {"log.run_name": "r"}))
    run = tmp_path / "tb" / "r"
    before = _scalars(run)
    assert before["eval/auc"] == [2, 4, 6, 8, 10]
    # as a signal during its last step leaves it: that step's checkpoint, no summary (the resume makes it)
    (run / "summary.json").unlink()
    summary = train(load_config(config, {"log.run_name": "r", "data.eval_split": "test"}), resume="latest")
    assert summary["split"] == "test" and summary["steps"] == 10
    after = _scalars(run)
    assert after["eval/auc"] == [2, 4, 6, 8, 10], after["eval/auc"]  # no second point at step 10
    assert after["eval/test/auc"] == [10]
    # the next session on 'test' (a longer run) goes on with eval/test/*: the run's eval/* stays one split's
    train(load_config(config, {"log.run_name": "r", "data.eval_split": "test", "train.epochs": 3}),
          resume="latest", allow_config_change=["train.epochs"])
    later = _scalars(run)
    assert later["eval/auc"] == [2, 4, 6, 8, 10] and later["eval/test/auc"] == [10, 12, 14, 15], later


def test_a_resume_in_place_from_an_earlier_checkpoint_purges_and_records_the_discarded_steps(tmp_path):
    """A run trained to step 10 (summary.json: one session 0-10); its step-8 and step-10 checkpoints removed (a
    user going back to step 6), resumed in place from step 6, its latest now: TensorBoard shows each step once (the
    writer's purge_step drops the first session's points after 6), and ``sessions`` says the first session's steps
    after 6 were discarded (they read as two overlapping ranges, 0-10 and 6-10, both the run's)."""
    config = tiny_config(tmp_path)
    train(load_config(config, {"log.run_name": "r"}))
    run = tmp_path / "tb" / "r"
    for step in (8, 10):
        (run / "checkpoints" / f"step-{step:08d}.pt").unlink()
    summary = train(load_config(config, {"log.run_name": "r"}), resume="latest")
    assert summary["resumed_at_step"] == 6
    first, second = summary["sessions"]
    assert (first["start_step"], first["end_step"], first["discarded_after"]) == (0, 10, 6)
    assert (second["start_step"], second["end_step"]) == (6, 10) and second.get("discarded_after") is None
    scalars = _scalars(run)
    assert scalars["eval/auc"] == [2, 4, 6, 8, 10] and scalars["train/loss"] == [2, 4, 6, 8, 10], scalars


def test_a_branch_on_another_eval_split_logs_its_own_eval_curve(tmp_path):
    """A branch (--run-name NEW) starts a run directory of its own, which holds no other split's eval/*: its
    evaluations are its eval/* (not eval/<split>/*, kept for a resume in place that changes the split)."""
    from tests.conftest import make_dataset

    config = tiny_config(tmp_path)
    make_dataset(tmp_path / "ds", {"train": 40, "validation": 16, "test": 16})
    train(load_config(config, {"log.run_name": "r"}))
    step6 = tmp_path / "tb" / "r" / "checkpoints" / "step-00000006.pt"
    train(load_config(config, {"log.run_name": "b", "data.eval_split": "test"}), resume=str(step6))
    scalars = _scalars(tmp_path / "tb" / "b")
    assert scalars["eval/auc"] == [8, 10] and not any(t.startswith("eval/test/") for t in scalars), scalars
