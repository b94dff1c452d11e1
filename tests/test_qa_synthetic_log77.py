"""The generator's log as a new user reads it (README "Data": the synthetic generator with `--raw-tsv`)."""
import re

import pyarrow.parquet as pq
from click.testing import CliRunner
from loguru import logger

from dlrm.data import synthetic


def _generate_logged(*args, **kwargs) -> list[str]:
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO", format="{message}")
    try:
        synthetic.generate(*args, **kwargs)
    finally:
        logger.remove(handle)
    return seen


def test_log_names_the_raw_tsv_and_the_split_rows_plainly(tmp_path):
    """The finished line named the dataset directory only, not the `--raw-tsv` file it also wrote, and the start line
    gave the split sizes as a Python dict repr without thousands separators (`writing 10000 rows ({'train': 8572,
    ...})`): both now read as the rest of the tools' logs do."""
    tsv = tmp_path / "raw.txt"
    lines = _generate_logged(tmp_path / "ds", 1200, cardinalities="tiny", raw_tsv=tsv)
    start = next(line for line in lines if "writing" in line)
    assert start.endswith(f"writing 1,200 rows (train 960, validation 120, test 120) to {tmp_path / 'ds'}"), start
    done = next(line for line in lines if line.startswith("wrote "))
    assert done.startswith(f"wrote {tmp_path / 'ds'} and its raw TSV {tsv} in "), done
    assert tsv.is_file() and len(tsv.read_text().splitlines()) == 1200

    lines = _generate_logged(tmp_path / "plain", 30, cardinalities="tiny")
    done = next(line for line in lines if line.startswith("wrote "))
    assert done.startswith(f"wrote {tmp_path / 'plain'} in "), done


def _labels(path) -> list[int]:
    return pq.read_table(path, columns=["label"]).column("label").to_pylist()


def test_raw_tsv_help_states_the_order_its_lines_are_in(tmp_path):
    """`--help` said the TSV holds "train, validation, test", but the small-real regime writes train, test,
    validation (the order `dlrm.preprocess --split sequential` cuts its twin in); the help now says both."""
    helptext = " ".join(CliRunner().invoke(synthetic.main, ["--help"]).output.split())
    said = re.search(r"--raw-tsv FILE Also write all rows in Kaggle's raw train\.txt format: (\w+), (\w+), (\w+) "
                     r"\(small-real: (\w+), (\w+), (\w+)\)", helptext)
    assert said is not None, helptext
    for regime, order in (("default", said.groups()[:3]), ("small-real", said.groups()[3:])):
        out, tsv = tmp_path / regime, tmp_path / f"{regime}.txt"
        synthetic.generate(out, 280, cardinalities="tiny", raw_tsv=tsv, regime=regime)
        in_tsv = [int(line.split("\t", 1)[0]) for line in tsv.read_text().splitlines()]
        assert in_tsv == [y for split in order for y in _labels(out / split)], regime
        assert in_tsv != [y for split in sorted(order) for y in _labels(out / split)], regime  # the order matters
