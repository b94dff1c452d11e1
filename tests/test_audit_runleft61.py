"""Found by the runleft61 audit.

(1) Under torchrun a data error met after the ranks joined (a row group that cannot be read, a bad value met
    mid-epoch, a file deleted since the start) was said by every rank, rank 1's copy as `[rank 1] ...`: every rank
    reads every row group, and met the same error. The ranks now compare what they met before saying it
    (`dlrm.distributed.env.agree_on_input_error`): met alike, rank 0 says it once; met by one rank alone, that rank
    says it, naming itself. The streamed loader raised a failed decode of the next buffer at a batch the reader
    threads' timing picked, so that one rank could stop a batch or more before the others.
(2) `train.py --export PATH` wrote into what another thing owns (a run's checkpoints/, a dataset, a sweep): refused
    in one line naming a free place, as a new run's --tb-dir is (`dlrm.output_place`). So is the OUT of
    ``python -m dlrm.distributed.merge CHECKPOINT OUT`` (a merged file among a run's checkpoints/ is a step-*.pt its
    pruning and --resume read as the run's own).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm.data.parquet_loader import ParquetLoader
from dlrm.errors import DatasetError
from tests.conftest import make_dataset
from tests.test_audit_killfuzz import CONFIG
from tests.test_audit_ranklog import launch_two_ranks
from tests.test_distributed import run


def _bad_label(path, row: int, row_group_size: int) -> None:
    """Rewrite the shard at `path` with label 2 at `row`, without statistics: met only when its row group is decoded
    (the footer's statistics would have shown it at the loader's start)."""
    table = pq.read_table(path)
    label = table.column("label").to_numpy().copy()
    label[row] = 2
    table = table.set_column(0, table.schema.field(0), pa.array(label, type=table.schema.field(0).type))
    pq.write_table(table, path, row_group_size=row_group_size, write_statistics=False)


# ------------------------------------------------------------------------------------------
# (1) the streamed loader fails at the same batch whatever its reader threads' timing


@pytest.mark.parametrize("consumer_pause_s", [0.0, 0.3])
@pytest.mark.parametrize("damage", ["bad label", "file deleted"])
def test_a_failed_decode_is_raised_where_its_buffer_is_needed_whatever_the_timing(tmp_path, consumer_pause_s, damage):
    """Two files of 50 rows, row groups of 10 rows, one a shuffle buffer, batches of 10. Row 5 of the second file holds
    a bad label, or that file is deleted after the loader opened it (a data file removed during a run): the five
    batches of the first file come first, then the error. A consumer slower than the readers (the pause) found the
    failure queued while cutting an earlier buffer, and raised it before that buffer's batches."""
    make_dataset(tmp_path / "ds", {"train": 100}, files_per_split=2, row_group_size=10)
    shards = sorted((tmp_path / "ds" / "train").glob("*.parquet"))
    if damage == "bad label":
        _bad_label(shards[1], 5, 10)
    loader = ParquetLoader(shards, 10, shuffle=False, shuffle_buffer_rows=10, prefetch=2, reader_threads=2)
    if damage == "file deleted":
        shards[1].unlink()
    said = (r"part-00001.parquet: column label: row index 5 \(row group 0\) holds 2" if damage == "bad label" else
            r"part-00001.parquet: row group 0: cannot be read \(.*No such file")
    rows = []
    with pytest.raises(DatasetError, match=said):
        for batch in loader:
            rows += batch.dense[:, 0].tolist()
            time.sleep(consumer_pause_s)  # the readers decode ahead meanwhile (and fail)
    assert len(rows) == 50 and np.allclose(rows, np.log1p(np.arange(50)))  # every row before the bad buffer, in order


# ------------------------------------------------------------------------------------------
# (1) two ranks: a data error met alike is said once; one met by one rank alone, by that rank


def _two_rank_config(tmp_path, dataset) -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"].update({"path": str(dataset), "shuffle": False, "shuffle_buffer_rows": 20})
    cfg["train"]["epochs"] = 1
    return cfg


def _ours(text: str) -> list[str]:
    """Our log lines (a timestamp first, or `[rank N]`), not torchrun's agent's report of a failed worker."""
    return [line for line in text.splitlines() if line[:2].isdigit() or line.startswith("[rank")]


def test_a_data_error_met_mid_epoch_on_two_ranks_is_said_once_and_no_later_checkpoint(tmp_path):
    """torchrun, two ranks, 200 train rows in row groups of 20, batches of 20: row 97 of the second file (the
    epoch's last batch, step 10) holds label 2, unseen by the footer. Each rank met it at step 10's fetch and said it:
    the same ERROR line twice. The checkpoints of steps 6 and 9 stay (checkpoint.every 3, keep 2), none of step 10."""
    make_dataset(tmp_path / "ds", {"train": 200, "validation": 20}, row_group_size=20)
    bad = tmp_path / "ds" / "train" / "part-00001.parquet"
    _bad_label(bad, 97, 20)
    (tmp_path / "c.json").write_text(json.dumps(_two_rank_config(tmp_path, tmp_path / "ds")))
    result = run(["--config", str(tmp_path / "c.json"), "--run-name", "r", "--tb-dir", str(tmp_path / "tb")],
                 tmp_path, nproc=2)
    assert result.returncode != 0
    ours = _ours(result.stderr)
    errors = [line for line in ours if " ERROR " in line]
    assert errors == [errors[0]] and not errors[0].startswith("[rank"), result.stderr[-4000:]
    assert errors[0].endswith(f"ERROR   {bad}: column label: row index 97 (row group 4) holds 2; labels must be 0 "
                              "or 1"), errors
    assert "this is a bug" not in result.stderr and "Traceback" not in "\n".join(ours)
    assert "exitcode  : 2" in result.stderr  # (torchrun's report: the rank that exited first, 2)
    checkpoints = sorted(p.name for p in (tmp_path / "tb" / "r" / "checkpoints").iterdir())
    assert checkpoints == [f"step-0000000{s}{part}.pt" for s in (6, 9) for part in ("", ".rank0-of-2", ".rank1-of-2")]
    assert not (tmp_path / "tb" / "r" / "summary.json").exists()


# rank 1 alone meets a data error, at its 3rd training batch (its disk, say); rank 0 goes on into that step
ONE_RANK = """
import os, sys
if os.environ["RANK"] == "1":
    from dlrm.data import parquet_loader
    from dlrm.errors import DatasetError
    real = parquet_loader.ParquetLoader.__iter__
    def batches(self):
        for i, batch in enumerate(real(self)):
            if i == 2:
                raise DatasetError("/data/train/part-00000.parquet: row group 0: cannot be read (Input/output error)")
            yield batch
    parquet_loader.ParquetLoader.__iter__ = batches
from dlrm.cli import main
main(sys.argv[1:])
"""


def test_a_data_error_of_one_rank_alone_is_said_by_that_rank_naming_it(tmp_path):
    """The other rank, inside that step's collectives, met nothing: rank 1 says its error, naming itself (after a
    bounded wait for the others, half of distributed.timeout_s here), and rank 0 stops as a rank whose peer is gone."""
    make_dataset(tmp_path / "ds", {"train": 200, "validation": 20}, row_group_size=20)
    cfg = _two_rank_config(tmp_path, tmp_path / "ds")
    cfg["distributed"]["timeout_s"] = 6
    codes, text = launch_two_ranks(tmp_path, cfg, script=ONE_RANK)
    assert codes == [5, 2], text[-3000:]
    errors = [line for line in _ours(text) if " ERROR " in line]
    said = [line for line in errors if "Input/output error" in line]
    assert len(said) == 1 and said[0].startswith("[rank 1] ") and said[0].endswith(
        "ERROR   rank 1: /data/train/part-00000.parquet: row group 0: cannot be read (Input/output error)"), text[-3000:]
    assert len(errors) == 2 and "another rank of this distributed run" in [e for e in errors if e not in said][0]
    assert "this is a bug" not in text and "Traceback" not in text


def test_a_data_error_met_by_every_rank_at_the_start_after_they_joined_is_said_once(tmp_path):
    """A label the footer's statistics show out of range: every rank's training loader refuses the file when it is
    made, after the ranks joined; each said it. The new run's directory is not left behind."""
    make_dataset(tmp_path / "ds", {"train": 200, "validation": 20}, row_group_size=20)
    bad = tmp_path / "ds" / "train" / "part-00001.parquet"
    table = pq.read_table(bad)
    label = table.column("label").to_numpy().copy()
    label[3] = 7
    pq.write_table(table.set_column(0, table.schema.field(0), pa.array(label, type=table.schema.field(0).type)), bad,
                   row_group_size=20)
    codes, text = launch_two_ranks(tmp_path, _two_rank_config(tmp_path, tmp_path / "ds"),
                                   script="import sys\nfrom dlrm.cli import main\nmain(sys.argv[1:])")
    assert codes == [2, 2], text[-3000:]
    errors = [line for line in _ours(text) if " ERROR " in line]
    assert len(errors) == 1 and not errors[0].startswith("[rank"), text[-3000:]
    assert errors[0].endswith(f"{bad}: column label: row index 3 (row group 0) holds 7; labels must be 0 or 1")
    assert not (tmp_path / "tb" / "r").exists()


# ------------------------------------------------------------------------------------------
# (2) --export PATH inside what another thing owns


def _places(root):
    """A run directory (its config.json beside checkpoints/), a dataset (metadata.json) and a sweep (sweep.json) whose
    trial is a run directory, under `root`."""
    for run_dir in (root / "tb" / "r1", root / "sweep" / "01-lr-0.1" / "seed-0"):
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps({"log": {}, "data": {}}))
        (run_dir / "checkpoints" / "step-00000010.pt").write_bytes(b"checkpoint")
    (root / "sweep" / "sweep.json").write_text(json.dumps({"sets": [], "seeds": [0]}))
    (root / "ds").mkdir()
    (root / "ds" / "metadata.json").write_text("{}")


@pytest.mark.parametrize("inside,owner,free", [
    ("tb/r1/checkpoints/m.pt2", "the run directory {root}/tb/r1", "{root}/tb/m.pt2"),
    ("tb/r1/m.pt2", "the run directory {root}/tb/r1", "{root}/tb/m.pt2"),
    ("ds/m.pt2", "the dataset {root}/ds", "{root}/m-2.pt2"),  # ({root}/m.pt2 exists)
    ("sweep/01-lr-0.1/seed-0/checkpoints/m.pt2", "the run directory {root}/sweep/01-lr-0.1/seed-0", "{root}/m-2.pt2"),
    ("sweep/01-lr-0.1/m.pt2", "the sweep {root}/sweep", "{root}/m-2.pt2"),
])
def test_an_export_inside_a_run_a_dataset_or_a_sweep_is_refused_naming_a_free_path(tmp_path, inside, owner, free):
    """It was written there: among a run's checkpoints, in a dataset a tool's --overwrite replaces whole, in a sweep."""
    from click.testing import CliRunner

    from dlrm import cli

    root = Path(os.path.realpath(tmp_path)) / "place"  # (the refusal names the owner's real path)
    root.mkdir()
    _places(root)
    (root / "m.pt2").write_bytes(b"another export")
    before = sorted(str(p) for p in root.rglob("*"))
    result = CliRunner().invoke(cli.main, ["--config", "configs/sample.json", "--checkpoint",
                                           str(root / "tb" / "r1" / "checkpoints" / "step-00000010.pt"),
                                           "--export", str(root / inside)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].split(" ERROR ", 1)[1].strip() == (
        f"--export: {root / inside} is inside {owner.format(root=root)}, which holds its own files only; write the "
        f"program outside it (--export {free.format(root=root)} is free)")
    assert sorted(str(p) for p in root.rglob("*")) == before  # nothing written


def test_an_export_beside_the_owners_is_not_refused_and_an_existing_file_still_is(tmp_path):
    from dlrm.cli import check_export_path
    from dlrm.config import ConfigError

    _places(tmp_path)
    assert check_export_path(str(tmp_path / "tb" / "m.pt2")) == tmp_path / "tb" / "m.pt2"  # beside a run: its root
    (tmp_path / "tb" / "m.pt2").write_bytes(b"kept")
    with pytest.raises(ConfigError, match=r"^--export: .*m.pt2 already exists; remove it or choose another path$"):
        check_export_path(str(tmp_path / "tb" / "m.pt2"))
    assert (tmp_path / "tb" / "m.pt2").read_bytes() == b"kept"


@pytest.mark.parametrize("inside,owner,free", [
    ("tb/r1/checkpoints/step-00000020.pt", "the run directory {root}/tb/r1", "{root}/tb/step-00000020.pt"),
    ("ds/merged.pt", "the dataset {root}/ds", "{root}/merged.pt"),
    ("sweep/01-lr-0.1/merged.pt", "the sweep {root}/sweep", "{root}/merged.pt"),
])
def test_a_merge_out_inside_a_run_a_dataset_or_a_sweep_is_refused_before_the_shards_are_read(tmp_path, inside, owner,
                                                                                               free):
    from click.testing import CliRunner

    from dlrm.distributed import merge

    root = Path(os.path.realpath(tmp_path)) / "place"
    root.mkdir()
    _places(root)
    before = sorted(str(p) for p in root.rglob("*"))
    # the checkpoint is no manifest at all: OUT is refused first, before any shard is read
    result = CliRunner().invoke(merge.main, [str(root / "tb" / "r1" / "checkpoints" / "step-00000010.pt"),
                                             str(root / inside)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].split(" ERROR ", 1)[1].strip() == (
        f"OUT: {root / inside} is inside {owner.format(root=root)}, which holds its own files only; write the merged "
        f"checkpoint outside it (OUT {free.format(root=root)} is free)")
    assert sorted(str(p) for p in root.rglob("*")) == before


def _relayed(rank: int) -> None:
    """Rank 0 met a data error writing best.pt (`DistEnv.on_main`); rank 1 relays it (`failure_error`)."""
    from dlrm.distributed.env import agree_on_input_error

    line = "f.parquet: bad label" if rank == 0 else "rank 0 could not write best.pt: f.parquet: bad label"
    said: list[str] = []
    error = DatasetError(line)
    agree_on_input_error(error, line, said.append, timeout_s=4)
    assert error.this_rank_only and said == [f"rank 0: {line}" if rank == 0 else line], said


def test_a_failure_relayed_from_another_rank_is_said_as_it_was(tmp_path):
    """Two ranks' different errors are each said by its rank, naming it; a relayed one names its rank already (it read
    `rank 1: rank 0 could not ...`)."""
    from tests.fastdist_ranks import failures_on_ranks

    assert failures_on_ranks(_relayed, [()], world=2, tmp_path=tmp_path) == {}
