"""A recommender engineer's pass over the real-data path (README "Data": `python -m dlrm.preprocess` on raw
Criteo TSV / the CSV variant): what a bad input printed, against what it should say."""

from __future__ import annotations

from tests.test_preprocess import error_lines, make_fields, run_cli, write_raw


def test_a_csv_of_its_header_alone_is_not_called_an_empty_file(tmp_path):
    # A CSV export with its header and no record said "empty file (no data lines)": the user sees a line in it.
    src = tmp_path / "head.csv"
    write_raw(src, make_fields(3, seed=0), "csv")
    src.write_text(src.read_text().splitlines()[0] + "\n")
    out = tmp_path / "out"
    result = run_cli(["--input", str(src), "--output", str(out)])
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {src}: no data lines: the file holds only its header line"]
    assert not out.exists()


def test_a_header_line_inside_the_file_is_named_as_one(tmp_path):
    # `cat a.csv b.csv > all.csv` puts b's header after a's records: it said only "column label: 'label' is not a label
    # (0 or 1)", which reads as a bad record, not as two files joined.
    part = write_raw(tmp_path / "part.csv", make_fields(5, seed=1), "csv").read_text()
    src = tmp_path / "all.csv"
    src.write_text(part + part)
    out = tmp_path / "out"
    result = run_cli(["--input", str(src), "--output", str(out)])
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {src}:7: column label: 'label' is not a label (0 or 1): a header line after "
                                   "the file's first line (files joined with cat? give each one as its own --input)"]
    assert not out.exists()


def test_a_file_with_neither_separator_gets_no_advice_that_cannot_help(tmp_path):
    # "cannot detect the format (no tab or comma in the first line); use --format": no --format reads a line without
    # separators (each then says "expected 40 fields ..., found 1"). A space-separated export is named as one.
    rows = make_fields(3, seed=2)
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("".join(" ".join(x or "0" for x in r) + "\n" for r in rows))
    other = tmp_path / "notes.txt"
    other.write_text("hello\n")
    for src, tail in ((spaced, "; it has 40 fields separated by ' ': replace them with tabs"), (other, "")):
        result = run_cli(["--input", str(src), "--output", str(tmp_path / "out")])
        assert result.exit_code == 2
        assert error_lines(result) == [f"error: {src}:1: cannot detect the format: no tab or comma in the first line (a "
                                       "Criteo line holds 40 fields separated by tabs, or by commas in the CSV variant)"
                                       + tail]
        assert not (tmp_path / "out").exists()


_EXPORT_COLUMN_MAJOR = """
import sys, torch
from dlrm.config import ModelConfig
from dlrm.model.dlrm import build_model
from dlrm.train.export import export_model
torch.manual_seed(0)
vocabs = [torch.arange(0, 50, dtype=torch.int64) for _ in range(26)]  # vocabulary hashing: a searchsorted
model = build_model(ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]), [51] * 26, vocabs=vocabs,
                    log_kernels=False).eval()
export_model(model, sys.argv[1])
program = torch.export.load(sys.argv[1]).module()
dense, sparse = torch.randint(0, 9, (13, 5)).T, torch.randint(-1, 60, (26, 5)).T  # column-major, as pandas' .values
assert not sparse.is_contiguous()
assert torch.equal(program(dense, sparse), program(dense.contiguous(), sparse.contiguous()))
"""


def test_the_exported_program_takes_a_column_major_batch_without_a_torch_warning(tmp_path):
    # The README's `torch.export.load(path).module()(dense, raw)` on a batch built from a DataFrame printed torch's
    # "[W... BucketizationUtils.h:32] Warning: torch.searchsorted(): input value tensor is non-contiguous, ..." on
    # stderr: the model's `.contiguous()` before its searchsorted was traced on a contiguous example and left out.
    import subprocess
    import sys

    from tests.conftest import CHILD_ENV, REPO

    res = subprocess.run([sys.executable, "-c", _EXPORT_COLUMN_MAJOR, str(tmp_path / "m.pt2")], cwd=REPO,
                         env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "non-contiguous" not in res.stderr, res.stderr


def test_a_max_steps_beyond_the_epochs_says_the_epochs_end_the_run(tmp_path):
    # `train.py --config configs/mlperf-dcnv2.json --max-steps 20` (train.epochs 1) on a 67-row split at batch 32 trained
    # 2 steps; the log said "2 steps/epoch, 2 steps" and nothing of the 20 asked for.
    import torch
    from loguru import logger

    from dlrm.config import load_config
    from dlrm.distributed.env import DistEnv
    from dlrm.train.setup import load_dataset_metadata
    from dlrm.train.train_data import TrainData
    from tests.conftest import REPO, make_dataset

    make_dataset(tmp_path / "ds", {"train": 100, "validation": 30})
    said = {}
    for max_steps in (20, 3, 2):
        cfg = load_config(REPO / "configs" / "sample.json", {"data.path": str(tmp_path / "ds"), "data.batch_size": 32,
                                                              "train.device": "cpu", "train.epochs": 1,
                                                              "train.max_steps": max_steps})
        messages: list[str] = []
        handle = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
        try:
            built = TrainData.build(cfg, *load_dataset_metadata(cfg), torch.device("cpu"), DistEnv(), "stream")
        finally:
            logger.remove(handle)
        said[max_steps] = (built.total_steps, [m for m in messages if m.startswith("train.max_steps")])
    assert said[20] == (3, ["train.max_steps 20: no effect, train.epochs 1 ends the run at 3 steps (3 steps an epoch; "
                            "--epochs for a longer run)"])
    assert said[3] == (3, []) and said[2] == (2, [])  # the epochs' length, or shorter: it acts, nothing to say


def test_the_baseline_fit_shows_its_iterations_once_it_runs_long(monkeypatch, capsys):
    # After the run's last checkpoint line the baseline's fit ran with nothing on the console (19-25 s for 100
    # iterations on 1,900,000 rows on one H100): a bar of its L-BFGS iterations now shows once it has run
    # FIT_BAR_DELAY_S (0 here, so that a fit of a second shows it).
    import torch

    from dlrm.train import baseline

    monkeypatch.setattr(baseline, "FIT_BAR_DELAY_S", 0.0, raising=False)
    gen = torch.Generator().manual_seed(0)
    n = 500
    dense = torch.randn(n, 13, dtype=torch.float64, generator=gen)
    rows = torch.randint(0, 300, (n, 26), generator=gen)
    labels = (torch.rand(n, generator=gen) < 0.3).double()
    _, facts = baseline.fit(dense, rows, labels)
    err = capsys.readouterr().err
    assert "baseline fit:" in err, err
    assert f"| {facts['iterations']}/{baseline.MAX_ITERATIONS} [" in err, err  # the bar ends at the iterations run


def test_a_checkpoint_of_other_tables_names_the_data_its_run_trained_on():
    # README's `--eval-only` line (`--config configs/sample.json --eval-only --checkpoint RUN`) for a run trained with
    # `--data /tmp/part0` (README "Data") evaluates data/sample, the file's data.path: it said "table sizes differ
    # (checkpoint vs this run): [0] 19 vs 30, ..." and not that the checkpoint was trained on other data, or which.
    from pathlib import Path

    import pytest

    from dlrm.checkpoint import check_compatible
    from dlrm.config import ConfigError

    state = {"model": {}, "cardinalities": [19, 49] + [5] * 24, "config": {"data": {"path": "/tmp/part0"}}}
    with pytest.raises(ConfigError) as e:
        check_compatible(state, None, [30, 20] + [5] * 24, {}, Path("best.pt"))
    assert str(e.value) == ("best.pt: table sizes differ (checkpoint vs this run): [0] 19 vs 30, [1] 49 vs 20; the "
                            "checkpoint's run trained on /tmp/part0 (give its dataset with --data)")


def test_a_stream_as_input_is_refused_saying_why(tmp_path):
    # `zcat day_0.gz | python -m dlrm.preprocess --input - ...` said "-: no such file", and `--input <(zcat day_0.gz)`
    # "/dev/fd/63: not a regular file": neither said that a stream cannot be read twice, nor what to do.
    import os

    fifo = tmp_path / "day_0"
    os.mkfifo(fifo)
    why = "the preprocessor reads each input twice (counting its lines first); write the stream to a file (gzip is read " \
          "as it is)"
    for given, said in (("-", f"-: standard input is not read: {why}"),
                        (str(fifo), f"{fifo}: not a regular file (a pipe or a device): {why}")):
        result = run_cli(["--input", given, "--output", str(tmp_path / "out")])
        assert result.exit_code == 2
        assert error_lines(result) == [f"error: {said}"]
        assert not (tmp_path / "out").exists()


def test_the_count_pass_bar_says_its_counts_are_bytes(tmp_path, capsys):
    # `python -m dlrm.preprocess --input part-0.tsv` (100 lines, 24,174 bytes) showed "counting lines: 100%|...|
    # 23.6k/23.6k [00:00<00:00, 121MB/s]": tqdm writes the unit in the rate only, so the counts read as 23.6k lines.
    from dlrm.data.preprocess import scan

    src = write_raw(tmp_path / "day_0", make_fields(100, seed=3))
    assert scan._count_pass([src], "auto", 1000, None, 1, True)[0].lines == 100
    from tqdm import tqdm

    size = tqdm.format_sizeof(src.stat().st_size, divisor=1024)  # e.g. 23.6k
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("counting lines: 100%|") and f"| {size}B/{size}B read [" in last, last


def test_the_export_line_names_the_missing_values_codes(tmp_path):
    # README's `--export` takes "raw hash values as int64" and its line said "raw sparse hashes [B, 26]": a user from
    # facebookresearch/dlrm (a missing category read as 0) fed 0, which hashes to another row than the dataset's -1 (on
    # part-0's modulus model: 0.5227 for a row of zeros, 0.5540 with -1).
    from loguru import logger

    from dlrm.config import ModelConfig
    from dlrm.model.dlrm import build_model
    from dlrm.train.export import export_model

    model = build_model(ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]), [7] * 26, log_kernels=False)
    lines: list[str] = []
    handle = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        export_model(model.eval(), tmp_path / "m.pt2")
    finally:
        logger.remove(handle)
    assert lines == [f"exported inference program to {tmp_path / 'm.pt2'} (inputs: raw dense counts, int64 [B, 13], "
                     "missing 0; raw sparse hashes, int64 [B, 26], missing -1)"]
