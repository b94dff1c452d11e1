"""Audit tests of `dlrm.data.preprocess` edge cases: a failed run must leave nothing that blocks the corrected
command, bad input must be refused before anything is written, an option that cannot apply must not be accepted
silently, and a failure or a kill must leave no temp file in the dataset. Synthetic lines only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dlrm.data import preprocess as pp
from dlrm.data.preprocess import finish as pp_finish
from dlrm.data.schema import read_metadata

FAST = dict(progress=False, workers=1)
HEADER = ",".join(["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]])


def tsv_line(k: int, sep: str = "\t") -> str:
    """A good 40-field line: label k % 2, I1 = k, I2..I13 "1", C1 a hash of k, C2..C26 "00000001"."""
    return sep.join([str(k % 2), str(k), *["1"] * 12, f"{k * 2654435761 % (1 << 32):08x}", *["00000001"] * 25])


def write_lines(path: Path, n: int, sep: str = "\t", header: bool = False) -> Path:
    path.write_text((HEADER + "\n" if header else "") + "".join(tsv_line(k, sep) + "\n" for k in range(n)))
    return path


def hidden_temp_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*.tmp"))


# -- a run that wrote no row must not leave an unfinished run behind -------------------------------------


def test_no_rows_to_write_leaves_nothing_and_the_corrected_command_works(tmp_path):
    """A TSV file read as CSV in skip mode: every line has the wrong field count, so no row is written and the
    run fails ("no rows to write"). Nothing could be resumed from it, so it must remove what it made (the docs:
    a run that fails before it wrote anything removes what it created, so that the corrected command starts
    afresh); before the fix it kept a progress record that refused the corrected command (another --format)."""
    src = write_lines(tmp_path / "a.tsv", 20)
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError, match="no rows to write"):
        pp.preprocess([src], out, input_format="csv", on_bad_line="skip", chunk_rows=8, **FAST)
    assert not out.exists()
    meta = pp.preprocess([src], out, input_format="tsv", on_bad_line="skip", chunk_rows=8, **FAST)
    assert sum(s.rows for s in meta.splits.values()) == 20


def test_no_rows_to_write_keeps_a_directory_that_existed(tmp_path):
    """The same failure into an existing empty directory: the directory stays, empty."""
    src = tmp_path / "junk.tsv"
    src.write_text("1\t2\n0\t3\n")
    out = tmp_path / "ds"
    out.mkdir()
    with pytest.raises(pp.PreprocessError, match="no rows to write"):
        pp.preprocess([src], out, on_bad_line="skip", **FAST)
    assert out.is_dir() and list(out.iterdir()) == []


# -- multi-hot fields and a CSV input: refused before anything is written ---------------------------------


def test_multi_hot_with_a_csv_input_is_refused_before_any_output(tmp_path):
    """--multi-hot-sizes needs TSV; a CSV input after a TSV one was found only when its chunks were due, after the
    TSV file's shards were written: the run then left an unfinished run that the same command can never finish."""
    a = write_lines(tmp_path / "a.tsv", 6)
    b = write_lines(tmp_path / "b.csv", 6, sep=",", header=True)
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError, match=r"b\.csv: is CSV; --multi-hot-sizes needs TSV"):
        pp.preprocess([a, b], out, multi_hot_sizes=[2] + [1] * 25, **FAST)
    assert not out.exists()


# -- --min-frequency N (N > 1) without --hashing vocabulary ----------------------------------------------


def test_min_frequency_above_one_with_modulus_hashing_is_refused(tmp_path):
    """A threshold applies to vocabulary hashing only; "auto" was refused with modulus hashing, but a number was
    accepted and silently ignored (a modulus dataset, every value its own row, no threshold)."""
    src = write_lines(tmp_path / "a.tsv", 14)
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError, match=r"^--min-frequency 3: .*--hashing vocabulary"):
        pp.preprocess([src], out, min_frequency=3, **FAST)
    assert not out.exists()
    result = CliRunner().invoke(pp.build_cli(), ["-i", str(src), "-o", str(out), "--min-frequency", "5",
                                                 "--no-progress", "--workers", "1"])
    assert result.exit_code == 2 and "--min-frequency 5:" in result.stderr
    assert not out.exists()
    # the default (1) and a threshold with vocabulary hashing still work
    assert pp.preprocess([src], out, min_frequency=1, **FAST).hashing == "modulus"
    meta = pp.preprocess([src], tmp_path / "voc", hashing="vocabulary", min_frequency=3, **FAST)
    assert meta.extra["options"]["min_frequency"] == 3


# -- no temp file of a vocabulary in the dataset -----------------------------------------------------------


def test_failed_vocabulary_write_leaves_no_temp_file_and_the_resumed_dataset_has_none(tmp_path, monkeypatch):
    """A vocabulary write that fails (a full disk) after some bytes removes its temp file; a temp file a kill left
    in vocab/ is removed when the run resumes, so the finished dataset holds only its own files."""
    src = write_lines(tmp_path / "a.tsv", 30)
    out = tmp_path / "ds"
    real_save = np.save
    calls = []

    def failing_save(fh, arr, *a, **k):
        calls.append(1)
        if len(calls) == 4:
            fh.write(b"\x93NUMPY half")
            raise OSError(28, "No space left on device")
        return real_save(fh, arr, *a, **k)

    monkeypatch.setattr(pp_finish.np, "save", failing_save)
    kw = dict(hashing="vocabulary", min_frequency=2, chunk_rows=10, **FAST)
    with pytest.raises(OSError, match="No space left"):
        pp.preprocess([src], out, **kw)
    assert hidden_temp_files(out) == []
    monkeypatch.setattr(pp_finish.np, "save", real_save)
    (out / "vocab" / ".SPARSE_7.npy.4242.tmp").write_bytes(b"\x93NUMPY cut by a kill")
    (out / ".metadata.json.abc123.tmp").write_text("{")  # write_json_atomic's temp file, cut by a kill
    meta = pp.preprocess([src], out, **kw)
    assert hidden_temp_files(out) == []
    assert read_metadata(out).cardinalities == meta.cardinalities
    assert sorted(p.name for p in (out / "vocab").iterdir()) == sorted(f"SPARSE_{f}.npy" for f in range(26))


# -- a --min-frequency beyond the counts' range ------------------------------------------------------------


@pytest.mark.parametrize("value", [2**64, 2**63 + 5])
def test_min_frequency_beyond_the_counts_range_is_one_line(tmp_path, value):
    """The frequency counts are uint32 saturating at the threshold: 2**64 raised OverflowError in the worker (a
    traceback, exit code 1, "this is a bug"). Now one line naming the option, before anything is written."""
    src = write_lines(tmp_path / "a.tsv", 14)
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError, match=rf"^--min-frequency: {value} must be at most 4294967295$"):
        pp.preprocess([src], out, hashing="vocabulary", min_frequency=value, **FAST)
    assert not out.exists()
    result = CliRunner().invoke(pp.build_cli(), ["-i", str(src), "-o", str(out), "--hashing", "vocabulary",
                                                 "--min-frequency", str(value), "--no-progress", "--workers", "1"])
    assert result.exit_code == 2 and f"error: --min-frequency: {value} must be at most" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_row_group_rows_beyond_int64_is_one_line(tmp_path):
    """pyarrow takes the row group size as an int64: --row-group-rows 10**20 was an OverflowError in the worker (a
    traceback, exit code 1). Now one line naming the option, before anything is written."""
    src = write_lines(tmp_path / "a.tsv", 14)
    out = tmp_path / "ds"
    with pytest.raises(pp.PreprocessError, match=r"^--row-group-rows: 100000000000000000000 must be at most"):
        pp.preprocess([src], out, row_group_rows=10**20, **FAST)
    assert not out.exists()
    result = CliRunner().invoke(pp.build_cli(), ["-i", str(src), "-o", str(out), "--row-group-rows", str(10**20),
                                                 "--no-progress", "--workers", "1"])
    assert result.exit_code == 2 and "error: --row-group-rows: 100000000000000000000 must be at most" in result.stderr
    assert not out.exists()
    assert pp.preprocess([src], out, row_group_rows=2**63 - 1, **FAST).splits["train"].rows == 12


# -- an --overwrite cut short while it removes the old dataset -----------------------------------------------


def test_overwrite_interrupted_while_removing_the_old_dataset_leaves_the_new_one_whole(tmp_path, monkeypatch):
    """--overwrite removed the old dataset after the count pass, and a Ctrl-C after train/ was removed left
    metadata.json listing shards that were gone. Now the old dataset is set aside once the new one is complete and
    swapped in (`dlrm.data.preprocess.replace`), and removed last: a Ctrl-C in that removal leaves the new dataset
    whole, says so, and leaves nothing of the old one behind."""
    from dlrm.data.preprocess import replace as pp_replace

    src = write_lines(tmp_path / "a.tsv", 14)
    new_src = write_lines(tmp_path / "b.tsv", 20)
    out, reference = tmp_path / "ds", tmp_path / "reference"
    pp.preprocess([src], out, **FAST)
    pp.preprocess([new_src], reference, chunk_rows=5, **FAST)
    real_rmtree = pp_replace.shutil.rmtree
    interrupted = []

    def interrupted_rmtree(path, *a, **k):
        real_rmtree(path, *a, **k)
        if Path(path).name == pp_replace.ASIDE and not interrupted:
            interrupted.append(path)
            raise KeyboardInterrupt

    monkeypatch.setattr(pp_replace.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(pp.InterruptedWhenComplete):
        pp.preprocess([new_src], out, overwrite=True, chunk_rows=5, **FAST)
    monkeypatch.setattr(pp_replace.shutil, "rmtree", real_rmtree)
    assert interrupted
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert files == {str(p.relative_to(reference)): p.read_bytes() for p in sorted(reference.rglob("*"))
                     if p.is_file()}


# -- command-line options their mode ignores ---------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--validation-fraction", "0.3"], "error: --validation-fraction 0.3: applies to --split random only (this run has "
                                       "--split sequential)"),
    (["--split", "days", "--test-fraction", "0.5"], "error: --test-fraction 0.5: applies to --split random only"),
    (["--seed", "7"], "error: --seed 7: applies to --split random only"),
    (["--hashing", "vocabulary", "--max-rows-per-table", "1000"],
     "error: --max-rows-per-table 1000: applies to --hashing modulus only (this run has --hashing vocabulary)"),
])
def test_an_option_the_mode_ignores_is_refused_on_the_command_line(tmp_path, args, message):
    """--validation-fraction 0.3 without --split random gave the sequential split (1/14 validation) silently; the
    same for --test-fraction, --seed and --max-rows-per-table with vocabulary hashing."""
    a = write_lines(tmp_path / "day_0", 8)
    b = write_lines(tmp_path / "day_1", 8)
    out = tmp_path / "ds"
    result = CliRunner().invoke(pp.build_cli(), ["-i", str(a), "-i", str(b), "-o", str(out), *args, "--no-progress",
                                                 "--workers", "1"])
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert not out.exists()


def test_options_of_the_mode_in_use_are_still_accepted(tmp_path):
    src = write_lines(tmp_path / "a.tsv", 40)
    out = tmp_path / "ds"
    result = CliRunner().invoke(pp.build_cli(), ["-i", str(src), "-o", str(out), "--split", "random", "--seed", "3",
                                                 "--validation-fraction", "0.3", "--test-fraction", "0.1",
                                                 "--max-rows-per-table", "5", "--no-progress", "--workers", "1"])
    assert result.exit_code == 0, result.stderr
    meta = read_metadata(out)
    assert meta.extra["options"]["seed"] == 3 and meta.extra["options"]["validation_fraction"] == 0.3
    assert max(meta.cardinalities) == 5

