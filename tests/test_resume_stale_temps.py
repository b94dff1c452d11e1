"""A resume removes the temporary files a killed session left in its run directory: `write_json_atomic`'s
``.summary.json.<random>.tmp`` (killed while writing the summary) and best.pt's ``.best.pt.<pid>-link.tmp``
(killed between its link and its rename). A resume that trains nothing (the run's summary written again) kept them
for good; only a later checkpoint save removed those in checkpoints/."""

from __future__ import annotations

import os

from dlrm.train.trainer import train
from tests.test_audit_restart import config, dataset  # noqa: F401 (dataset: a fixture)


def test_a_resume_removes_what_a_killed_session_was_writing(tmp_path, dataset):  # noqa: F811
    train(config(tmp_path, dataset, "r"))
    run = tmp_path / "tb" / "r"
    (run / "summary.json").unlink()  # killed while writing it: its temporary file half written
    summary_tmp = run / ".summary.json.k1ll3d_a.tmp"
    summary_tmp.write_text('{"half": ')
    config_tmp = run / ".config.json.k1ll3d_b.tmp"
    config_tmp.write_text("{")
    link_tmp = run / "checkpoints" / f".best.pt.{2**22 + 12345}-link.tmp"  # a pid no process has here
    os.link(run / "checkpoints" / "step-00000010.pt", link_tmp)
    mine = run / ".notes.json.tmp"  # not a name the run writes: the user's, kept
    mine.write_text("keep")

    train(config(tmp_path, dataset, "r"), resume="latest")  # at its end already: writes the summary, trains nothing
    assert not summary_tmp.exists() and not config_tmp.exists() and not link_tmp.exists()
    assert mine.read_text() == "keep"
    assert (run / "summary.json").is_file() and (run / "checkpoints" / "step-00000010.pt").is_file()
