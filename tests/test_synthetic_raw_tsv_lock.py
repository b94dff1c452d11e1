"""Two generator runs with different ``--out`` and one ``--raw-tsv`` (`dlrm.data.synthetic.generate`): the TSV is an
output too, locked as ``--out`` is (`dlrm.data.output_dirs.output_lock`). Unlocked, both runs checked the TSV's path
before either had written it, and the later one silently replaced the other's TSV at its end, --overwrite or not."""

from __future__ import annotations

import click
import pytest

from dlrm.data.output_dirs import output_lock
from dlrm.data.synthetic import generate


def test_a_raw_tsv_another_run_is_writing_is_refused(tmp_path):
    tsv = tmp_path / "log.txt"
    with output_lock(tsv, "--raw-tsv"):  # the other run, writing its TSV
        with pytest.raises(click.ClickException, match=rf"--raw-tsv {tsv}: in use by pid \d+"):
            generate(tmp_path / "b", 50, seed=1, cardinalities="tiny", raw_tsv=tsv)
    assert not tsv.exists() and not (tmp_path / "b").exists()  # nothing written, nothing left
    generate(tmp_path / "b", 50, seed=1, cardinalities="tiny", raw_tsv=tsv)  # once it is free
    assert len(tsv.read_text().splitlines()) == 50
    assert not list(tmp_path.glob(".*.lock"))  # both locks released and removed
