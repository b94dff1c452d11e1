"""The checkpoint-writing bar (files of 1 GiB or more) in a log file or pipe: redrawn at most once a minute
(`dlrm.logging_setup.bar_interval`), as the training bar is; at tqdm's 0.1 s an 86 s MLPerf save wrote ~860 `\\r`
copies of it into a nohup/SLURM/CI log. On a terminal it keeps tqdm's defaults."""

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

    monkeypatch.setattr(ckpt, "tqdm", Recording)
    monkeypatch.setattr(ckpt, "PROGRESS_BYTES", 0)  # the bar shown for this small file
    monkeypatch.setattr("sys.stderr", stream)
    ckpt.write_atomic(tmp_path / "step-00000001.pt", tiny_state(step=1), progress=True)
    assert len(seen) == 1 and not seen[0]["disable"]
    assert seen[0].get("mininterval") == interval and seen[0].get("maxinterval") == interval
    assert "writing step-00000001.pt" in stream.getvalue()
