"""A SIGTERM that a library wraps in its own error still stops the run as a signal (found by a QA pass, 2026-12-04).

SIGTERM during ``--export`` raised `TrainingStopped` inside torch.export's serializer, which re-raised it as
``SerializeError: Failed serializing node ...``: train.py printed three tracebacks and "this is a bug in dlrm", exit 1,
where a stop exits 143 in one line (a scheduler's pre-emption read as a crash).
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from dlrm import cli
from dlrm.errors import TrainingStopped


class SerializeError(Exception):
    """Stands for torch._export.serde.serialize.SerializeError."""


def test_a_stop_wrapped_by_a_library_exits_as_the_stop(tmp_path, monkeypatch):
    def export_stopped(**kwargs):
        try:
            raise TrainingStopped(143, "SIGTERM: stopped at once, outside the training steps (no checkpoint written "
                                       "now)")
        except TrainingStopped as e:
            raise SerializeError("Failed serializing node sym_size_int_5") from e

    monkeypatch.setattr(cli, "run", export_stopped)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({}))
    res = CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb")])
    assert res.exit_code == 143, res.output
    assert "Traceback" not in res.output and "this is a bug" not in res.output, res.output
    assert "SIGTERM: stopped at once" in res.output, res.output


def test_an_error_without_a_stop_inside_is_still_a_bug(tmp_path, monkeypatch):
    def broken(**kwargs):
        raise SerializeError("Failed serializing node x")

    monkeypatch.setattr(cli, "run", broken)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({}))
    res = CliRunner().invoke(cli.main, ["--config", str(config), "--tb-dir", str(tmp_path / "tb")])
    assert res.exit_code == 1 and "this is a bug" in res.output, res.output


def test_signal_stop_inside_follows_causes_and_contexts():
    stop = TrainingStopped(143, "SIGTERM")
    try:
        try:
            raise stop
        except TrainingStopped:
            raise ValueError("while handling it")  # an implicit context, not a cause
    except ValueError as e:
        assert cli.signal_stop_inside(e) is stop
    assert cli.signal_stop_inside(ValueError("no stop")) is None
