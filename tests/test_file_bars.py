"""Progress bars in a log file or pipe: the checkpoint-writing bar (files of 1 GiB or more) and the preprocessing bars
are redrawn at most once a minute (`dlrm.logging_setup.bar_interval`), as the training bar is; at tqdm's 0.1 s an 86 s
MLPerf save wrote ~860 `\\r` copies of its bar into a nohup/SLURM/CI log. On a terminal they keep their intervals."""

from __future__ import annotations

import io

import pytest
import tqdm as tqdm_module

from dlrm import checkpoint as ckpt
from dlrm.logging_setup import FILE_BAR_INTERVAL_S
from tests.test_audit_checkpoint_files import tiny_state


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream,interval", [(io.StringIO(), FILE_BAR_INTERVAL_S), (_Tty(), None)],
                         ids=["file", "terminal"])
def test_the_checkpoint_bar_redraws_once_a_minute_into_a_file(tmp_path, monkeypatch, stream, interval):
    seen = []

    class Recording(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs)
            super().__init__(*args, **{**kwargs, "file": stream})

    monkeypatch.setattr(ckpt, "ProgressBar", Recording)
    monkeypatch.setattr(ckpt, "PROGRESS_BYTES", 0)  # the bar shown for this small file
    monkeypatch.setattr("sys.stderr", stream)
    ckpt.write_atomic(tmp_path / "step-00000001.pt", tiny_state(step=1), progress=True)
    assert len(seen) == 1 and not seen[0]["disable"]
    assert seen[0].get("mininterval") == interval and seen[0].get("maxinterval") == interval
    assert "writing step-00000001.pt" in stream.getvalue()


def test_the_preprocessing_bars_redraw_once_a_minute_into_a_file(tmp_path, monkeypatch):
    """The preprocessing bar (once a second before: 3,600 copies an hour of a long run's log) and its "counting lines"
    bar, with stderr not a terminal: at most once a minute."""
    from dlrm.data import preprocess as pp
    from dlrm.data.preprocess import run as pp_run, scan as pp_scan
    from tests.test_preprocess import make_fields, write_raw

    seen = {}

    class Recording(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs):
            seen[kwargs.get("desc")] = kwargs
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})

    monkeypatch.setattr(pp_run, "ProgressBar", Recording)
    monkeypatch.setattr(pp_scan, "ProgressBar", Recording)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    srcs = [write_raw(tmp_path / f"part-{i}.tsv", make_fields(30, seed=i)) for i in range(2)]
    pp.preprocess(srcs, tmp_path / "ds", progress=True, workers=1)
    assert {"preprocessing", "counting lines"} <= set(seen)
    for desc in ("preprocessing", "counting lines"):
        assert seen[desc]["mininterval"] == FILE_BAR_INTERVAL_S and seen[desc]["maxinterval"] == FILE_BAR_INTERVAL_S
