"""A Ctrl-C or SIGTERM while `--compare` writes its reports, once its plot is made: compare.md, compare.csv and
compare.png published as one set (`dlrm.checkpoint.write_files_atomic`), then the table and plot in the TensorBoard
events (`log_comparison`). It stopped the command with "SIGTERM: stopped at once, outside the training steps (no
checkpoint written now)", exit 143 (or "interrupted (Ctrl-C)", 130), though the reports were written (the set's
renames finish first), or the events were cut short. From the set's write on, the comparison's results are written as
train.py's summary.json is (`dlrm.stop_signal.LateSignals`): the signal is said in one line, everything is written,
exit 0.

The signal is raised inside the step (the set's first rename, the events' table): no timing.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.test_swallowed_signal_commands import _invoke


def _signal_in(monkeypatch, where: str, name: str) -> None:
    if where == "report-set":
        from dlrm import checkpoint

        real_write = checkpoint.write_files_atomic
        real_replace = os.replace

        def write_files_atomic(directory, files, *args, **kwargs):
            def replace(src, dst):
                real_replace(src, dst)
                if os.path.basename(dst) == "compare.md":  # the first of the set in place
                    signal.raise_signal(getattr(signal, name))

            monkeypatch.setattr(os, "replace", replace)
            try:
                return real_write(directory, files, *args, **kwargs)
            finally:
                monkeypatch.setattr(os, "replace", real_replace)

        monkeypatch.setattr(checkpoint, "write_files_atomic", write_files_atomic)
    else:  # the events: as the table is added
        from dlrm.train import reporting

        real_add = reporting.add_markdown

        def add_markdown(writer, tag, *args, **kwargs):
            if tag == "compare/table":
                signal.raise_signal(getattr(signal, name))
            return real_add(writer, tag, *args, **kwargs)

        monkeypatch.setattr(reporting, "add_markdown", add_markdown)


@pytest.mark.parametrize("where, name", [("report-set", "SIGTERM"), ("events", "SIGTERM"), ("events", "SIGINT")])
def test_a_signal_while_the_comparisons_reports_are_written_is_said_and_everything_is_written(tmp_path, monkeypatch,
                                                                                            where, name):
    from dlrm import cli
    from tests.test_audit_review52 import tiny_config

    config = tiny_config(tmp_path)
    _signal_in(monkeypatch, where, name)
    result = _invoke(cli.main, ["--config", str(config), "--compare", "eager", "--tb-dir", str(tmp_path / "tb"),
                                "--run-name", "c", "--max-steps", "2"])
    base = tmp_path / "tb" / "c"
    assert result.exit_code == 0, result.output  # was 143 (130): "stopped at once ... (no checkpoint written now)"
    assert result.output.strip().splitlines()[-1].endswith(
        f" WARNING {name} arrived after the comparison finished (its reports written in {base}): nothing left to stop, "
        "exit 0"), result.output
    assert "stopped at once" not in result.output and "interrupted" not in result.output, result.output
    assert sorted(p.name for p in base.iterdir() if "compare" in p.name) == ["compare.csv", "compare.md", "compare.png"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(base), size_guidance={"tensors": 0, "images": 0}).Reload()
    assert "compare/table" in events.Tags()["tensors"] and "compare/plot" in events.Tags()["images"], events.Tags()
