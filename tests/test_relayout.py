"""`python -m dlrm.data.relayout`: a dataset's multi-hot features rewritten in the other sparse layout,
the rows (and so every batch) unchanged, the output all or nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.loader import open_shard, split_files
from dlrm.data.relayout import relayout
from dlrm.data.schema import DatasetError, arrow_schema, read_metadata, write_metadata
from tests.conftest import REPO
from tests.test_multihot_data import SIZES, random_lists, write_shard
from tests.test_sparse_layout import all_batches, make_split


def layouts_of(root) -> list[str]:
    return [open_shard(f, SIZES)[1] for f in split_files(root, read_metadata(root), "train")]


@pytest.fixture(scope="module")
def lists_split(tmp_path_factory):
    root = tmp_path_factory.mktemp("lists")
    make_split(root, ["lists"] * 3)
    (root / "vocab").mkdir()
    np.save(root / "vocab" / "SPARSE_0.npy", np.arange(5))  # copied as it is (the split's hashing is modulus)
    return root


def test_lists_to_slots_and_back_keep_every_row(lists_split, tmp_path):
    slots, back = tmp_path / "slots", tmp_path / "back"
    meta = relayout(lists_split, slots, "slots", workers=2)
    assert layouts_of(slots) == ["slots"] * 3 and meta.sparse_layout == "slots"
    raw = json.loads((slots / "metadata.json").read_text())
    assert raw["schema_version"] == 3 and raw["sparse_layout"] == "slots"
    assert raw["extra"]["relayout"] == {"from": str(lists_split), "from_layout": "lists", "compression": "kept",
                                        "from_dense_format": "counts"}
    assert raw["splits"] == json.loads((lists_split / "metadata.json").read_text())["splits"]
    assert np.array_equal(np.load(slots / "vocab" / "SPARSE_0.npy"), np.arange(5))
    for kind in ("stream", "device"):
        for a, b in zip(all_batches(lists_split, kind), all_batches(slots, kind), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b))

    relayout(slots, back, "lists")
    assert read_metadata(back).sparse_layout == "lists"
    assert json.loads((back / "metadata.json").read_text())["schema_version"] == 2
    for src in split_files(lists_split, read_metadata(lists_split), "train"):
        again = pq.ParquetFile(back / src.relative_to(lists_split))
        assert again.read().equals(pq.read_table(src))  # lists -> slots -> lists: the same lists
        assert [again.metadata.row_group(g).num_rows for g in range(again.num_row_groups)] == \
            [pq.ParquetFile(src).metadata.row_group(g).num_rows for g in range(again.num_row_groups)]


def test_codec_changes_with_compression(lists_split, tmp_path):
    relayout(lists_split, tmp_path / "z", "slots", codec="zstd")
    f = split_files(tmp_path / "z", read_metadata(tmp_path / "z"), "train")[0]
    footer = pq.ParquetFile(f).metadata
    assert {footer.row_group(0).column(c).compression for c in range(footer.num_columns)} == {"ZSTD"}


def test_a_bad_file_stops_it_naming_the_file_and_leaves_nothing(tmp_path):
    root = tmp_path / "bad"
    make_split(root, ["lists"] * 3)
    rng = np.random.default_rng(0)
    shard = root / "train" / "part-00002.parquet"
    n = pq.ParquetFile(shard).metadata.num_rows  # as many rows as metadata.json counts for it
    features = random_lists(rng, n, SIZES)
    features[20] = [[1, 2, 3, 4, 5, 6]] * n  # 6 values where multi_hot_sizes[20] is 5
    write_shard(shard, np.zeros(n), np.zeros((n, 13)), features, SIZES, 4)
    out = tmp_path / "out"
    with pytest.raises(DatasetError, match=r"part-00002.parquet: column SPARSE_20: row index 0 .* holds 6 values"):
        relayout(root, out, "slots", workers=1)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]  # no temporary left either


def test_refuses_an_occupied_output_and_the_input_itself(lists_split, tmp_path):
    import click

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(click.ClickException, match="refusing to overwrite non-empty"):
        relayout(lists_split, tmp_path / "full", "slots")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(click.ClickException, match="is --data itself"):
        relayout(lists_split, lists_split, "slots", overwrite=True)
    # --overwrite replaces a dataset only: a folder without metadata.json is refused, its files kept
    with pytest.raises(click.ClickException, match=r"--output .*full: refusing to replace it: it holds no dataset "
                                                   r"\(no metadata.json; it has keep.txt\)"):
        relayout(lists_split, tmp_path / "full", "slots", overwrite=True)
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "full" / "metadata.json").write_text("{}")  # (a dataset's mark)
    relayout(lists_split, tmp_path / "full", "slots", overwrite=True)
    assert layouts_of(tmp_path / "full") == ["slots"] * 3 and not (tmp_path / "full" / "keep.txt").exists()


def _contents(root) -> dict:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_an_output_that_holds_or_lies_inside_the_data_is_refused_even_with_overwrite(tmp_path):
    """--overwrite replaces --output whole: an --output that is a parent of --data (or inside it, or --data
    through a symlink) would delete the dataset being read. Refused in one line, exit 2, the data untouched."""
    from click.testing import CliRunner

    from dlrm.data.relayout import main

    data = tmp_path / "parent" / "ds"
    make_split(data, ["lists"] * 3)
    before = _contents(tmp_path)
    (tmp_path / "link").symlink_to(data, target_is_directory=True)
    for output, needle in [(tmp_path / "parent", f"--data {data} is inside --output {tmp_path / 'parent'}"),
                           (tmp_path, "is inside --output"),
                           (data / "train", f"--output {data / 'train'} is inside --data {data}"),
                           (data / "new", "is inside --data"),
                           (tmp_path / "link", "is --data itself")]:
        res = CliRunner().invoke(main, ["--data", str(data), "--output", str(output), "--overwrite"])
        assert res.exit_code == 2 and needle in res.output, (output, res.output)
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
        assert _contents(tmp_path) == before and (tmp_path / "link").is_symlink(), output
    # the other way round: --data reached through a symlink inside the --output it would replace
    res = CliRunner().invoke(main, ["--data", str(tmp_path / "link"), "--output", str(data), "--overwrite"])
    assert res.exit_code == 2 and "is --data itself" in res.output and _contents(tmp_path) == before, res.output


@pytest.mark.parametrize("output", [".", ".."])
def test_the_working_directory_as_output_is_refused_before_any_work(tmp_path, monkeypatch, output):
    """``--output .`` (or ``..``) copied every file, then failed renaming the copy onto the working directory ("Device
    or resource busy"), leaving ``..old-*`` in it; refused before any work now, as the generator and the import do."""
    from click.testing import CliRunner

    from dlrm.data.relayout import main

    data = tmp_path / "ds"
    make_split(data, ["lists"] * 3)
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    res = CliRunner().invoke(main, ["--data", str(data), "--output", output, "--overwrite"])
    assert res.exit_code == 2 and f"--output {output}: name the dataset directory itself, not . or .." in res.output
    assert list(cwd.iterdir()) == [] and [p.name for p in cwd.parent.iterdir()] == ["b"], res.output


def test_nullable_files_are_written_back_without_nulls(tmp_path):
    root = tmp_path / "n"
    make_split(root, ["lists"] * 3)
    f = root / "train" / "part-00000.parquet"
    table = pq.read_table(f)
    schema = pa.schema([pa.field(x.name, x.type, nullable=True) for x in table.schema])
    dense = table.column("DENSE_1").to_numpy()
    table = table.set_column(2, "DENSE_1", pa.array(dense, mask=np.arange(len(dense)) % 3 == 0)).cast(schema)
    pq.write_table(table, f, row_group_size=7)
    relayout(root, tmp_path / "s", "slots")
    out = pq.read_table(tmp_path / "s" / "train" / "part-00000.parquet")
    assert out.schema == arrow_schema(SIZES, "slots") and out.column("DENSE_1").null_count == 0
    assert (out.column("DENSE_1").to_numpy()[::3] == 0).all()


def test_cli_one_line_errors_and_exit_codes(lists_split, tmp_path):
    from click.testing import CliRunner

    from dlrm.data.relayout import main

    def run(*args):  # a process of its own: the exit code and stderr as a user sees them
        return subprocess.run([sys.executable, "-m", "dlrm.data.relayout", *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    done = run("--data", lists_split, "--output", tmp_path / "ok", "--compression", "lz4")
    assert done.returncode == 0, done.stderr
    assert layouts_of(tmp_path / "ok") == ["slots"] * 3
    missing = tmp_path / "nodata"
    missing.mkdir()
    write_metadata(missing, read_metadata(lists_split))  # lists files that are not there
    gone = run("--data", missing, "--output", tmp_path / "x")
    assert gone.returncode == 2 and "listed in metadata.json splits.train but missing" in gone.stderr
    assert "Traceback" not in gone.stderr and not (tmp_path / "x").exists()
    # the other refusals in this process (their message lines: test_refuses_an_occupied_output_...)
    again = CliRunner().invoke(main, ["--data", str(lists_split), "--output", str(tmp_path / "ok")])
    assert again.exit_code == 2 and layouts_of(tmp_path / "ok") == ["slots"] * 3
    bad = CliRunner().invoke(main, ["--data", str(lists_split), "--output", str(tmp_path / "y"), "--sparse-layout", "rows"])
    assert bad.exit_code == 2 and "'rows' is not one of" in bad.output and not (tmp_path / "y").exists()


def test_version_1_one_hot_data_copies_unchanged(tmp_path):
    sample = REPO / "data" / "sample"
    meta = relayout(sample, tmp_path / "s", "slots")
    assert meta.written_version == 1 and json.loads((tmp_path / "s" / "metadata.json").read_text())["schema_version"] == 1
    src = split_files(sample, read_metadata(sample), "validation")[0]
    assert pq.read_table(tmp_path / "s" / src.relative_to(sample)).equals(pq.read_table(src))
    assert read_metadata(tmp_path / "s").splits == read_metadata(sample).splits
