"""A Ctrl-C or SIGTERM while `--compare` makes its plot, once the variants are done (`dlrm.train.compare.
write_reports`). One that a library's catch-all dropped there (`StopAtOnce` raises where the signal arrives: inside
matplotlib) was said as a signal that came once the results were written: "SIGTERM arrived after the command finished
(its results written): nothing left to stop, exit 0", the plot and reports written as if none had come. One that was
not dropped stopped the comparison with no report at all, said "stopped at once, outside the training steps (no
checkpoint written now)" or "interrupted (Ctrl-C)". Now either stops the plot step: compare.md (saying so) and
compare.csv are written whole, no compare.png (nor half of one), and the command exits 128 + the signal with a line
saying the plot was stopped and where the table is.

The library is a wrapper around matplotlib's real `Figure.tight_layout` (called while the plot is made) that raises
the signal inside, dropping what it raises or not: no timing.
"""

from __future__ import annotations

import signal

import pytest

from tests.test_swallowed_signal_commands import _invoke


def _signal_in_the_plot(monkeypatch, name: str, dropped: bool) -> None:
    import matplotlib.figure

    real = matplotlib.figure.Figure.tight_layout

    def tight_layout(self, *args, **kwargs):
        if dropped:
            try:
                signal.raise_signal(getattr(signal, name))  # the handler runs here, raising into the `try`
            except Exception:  # noqa: BLE001 - the library's catch-all: the stop's exception dropped
                pass
        else:
            signal.raise_signal(getattr(signal, name))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout", tight_layout)


@pytest.mark.parametrize("name, dropped, code", [("SIGTERM", True, 143), ("SIGTERM", False, 143),
                                                 ("SIGINT", False, 130)],
                         ids=["sigterm-dropped", "sigterm", "ctrl-c"])
def test_a_signal_during_the_comparisons_plot_stops_the_plot_and_writes_the_table(tmp_path, monkeypatch, name,
                                                                                   dropped, code):
    from dlrm import cli
    from tests.test_audit_review52 import tiny_config

    config = tiny_config(tmp_path)
    _signal_in_the_plot(monkeypatch, name, dropped)
    result = _invoke(cli.main, ["--config", str(config), "--compare", "eager", "--tb-dir", str(tmp_path / "tb"),
                                "--run-name", "c", "--max-steps", "2"])
    base = tmp_path / "tb" / "c"
    assert result.exit_code == code, result.output  # sigterm-dropped: was 0
    assert result.output.strip().splitlines()[-1].endswith(
        f" WARNING compare: {name} stopped the comparison's plot, once the variants were done: compare.png not made; "
        f"the table is in {base / 'compare.md'} and compare.csv"), result.output
    assert "arrived after" not in result.output and "stopped at once" not in result.output, result.output
    assert "interrupted (Ctrl-C)" not in result.output, result.output
    # the table whole, no plot and no temporary of one; the variant's run kept
    assert sorted(p.name for p in base.iterdir() if "compare" in p.name) == ["compare.csv", "compare.md"]
    text = (base / "compare.md").read_text()
    assert f"**Its plot (compare.png) was not made: {name} stopped it, once the variants were done.**" in text
    assert "| eager |" in text and (base / "compare.csv").read_text().splitlines()[1].startswith("eager,")
    assert (base / "eager" / "summary.json").is_file()


def test_a_table_that_cannot_be_written_after_a_stopped_plot_is_said_with_the_stops_code(tmp_path, monkeypatch):
    """A failure writing compare.md and compare.csv (a full disk; a second SIGTERM's stop alike) is said in the stop's
    line, whose exit code stays."""
    import errno

    import torch

    from dlrm import checkpoint
    from dlrm.errors import TrainingStopped
    from dlrm.stop_signal import StopAtOnce
    from dlrm.train import compare

    def full(directory, files):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "compare.md"))

    _signal_in_the_plot(monkeypatch, "SIGTERM", dropped=True)
    monkeypatch.setattr(checkpoint, "write_files_atomic", full)
    rows = [{"variant": "eager", "samples_per_sec": 100.0, "warmup_s": 1.0, "auc": 0.7, "status": "ok"}]
    with pytest.raises(TrainingStopped) as stopped, StopAtOnce():
        compare.write_reports(tmp_path, rows, torch.device("cpu"))
    assert stopped.value.exit_code == 143
    assert str(stopped.value).startswith("compare: SIGTERM stopped the comparison as its plot was made, once the "
                                         "variants were done: its reports were not written ("), str(stopped.value)
    assert "No space left on device" in str(stopped.value) and str(tmp_path / "compare.md") in str(stopped.value)
    assert list(tmp_path.iterdir()) == []
