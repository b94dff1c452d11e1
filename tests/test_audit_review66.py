"""Review of session 66's changes (helper review66): a run's own summary.json, which holds every logged loss
(``train_losses``), is read past `dlrm.json_file.RECORD_LIMIT`, the size meant for hand-sized records: at 64 MB a long
run's summary (train.log_every 1 over some 1.4M steps) was taken for unreadable, so a resume replaced it without the
earlier sessions' records, a finished run looked unfinished and a sweep trained its finished trial again."""

import json
import os

from dlrm.json_file import RECORD_LIMIT
from tests.fastsweep_gc import frozen_heap  # noqa: F401 (autouse: gc.freeze() around each test)

LOSS = "[1234567,0.4567891234567891]"  # one logged window of `train_losses`, as json writes it (without the indent)


def _long_summary(path, **fields) -> dict:
    """A finished run's summary.json just past RECORD_LIMIT, its bulk the logged losses (written as a string: fast)."""
    head = {"steps": 10, "auc": 0.75, "logloss": 0.5, "best": None, "baseline": None, **fields}
    text = json.dumps(head)[:-1] + ', "train_losses": [' + ",".join([LOSS] * (RECORD_LIMIT // len(LOSS) + 1)) + "]}"
    path.write_text(text)
    assert os.path.getsize(path) > RECORD_LIMIT
    return head


def test_a_long_runs_summary_keeps_its_earlier_sessions_on_a_resume(tmp_path):
    from dlrm.train.sessions import with_sessions

    path = tmp_path / "summary.json"
    _long_summary(path, sessions=[{"start_step": 0, "end_step": 10, "device": "earlier"}])
    summary = {"steps": 12, "resumed_at_step": 10}
    with_sessions(summary, path)
    assert summary["sessions"][0].get("device") == "earlier"  # not "replaced by this session's, without the earlier"
    assert len(summary["sessions"]) == 2


def test_a_long_finished_run_is_finished_and_a_sweeps_trial_done(tmp_path):
    from dlrm.sweep_resume import _read_summary
    from dlrm.train.resume_policy import summarized

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    _long_summary(run / "summary.json")
    assert summarized(run / "checkpoints" / "step-00000010.pt", 10)  # else its last evaluation made again
    assert _read_summary(run / "summary.json") is not None  # else the sweep trains the trial again
