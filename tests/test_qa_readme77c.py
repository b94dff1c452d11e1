"""Found following README.md as a new user (2026-12-04, readme77c)."""

from loguru import logger

from dlrm.data import synthetic


def _done_lines(**kwargs):
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    try:
        synthetic.generate(rows=30, cardinalities="tiny", **kwargs)
    finally:
        logger.remove(handle)
    return [line for line in seen if line.startswith("wrote ")]


def test_generator_done_line_names_the_raw_tsv_it_wrote(tmp_path):
    """README's `python -m dlrm.data.synthetic ... --out data/syn-1m --raw-tsv data/syn-1m.txt` ended with
    `wrote data/syn-1m in 1.9s: ...`: the raw TSV the user asked for was written but named nowhere in the log."""
    out, tsv = tmp_path / "syn", tmp_path / "syn.txt"
    lines = _done_lines(out=out, raw_tsv=tsv)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"wrote {out} and its raw TSV {tsv} in "), lines[0]
    assert len(tsv.read_text().splitlines()) == 30  # the file it names holds every row
    # (the line without --raw-tsv, `wrote OUT in ...`, is held by tests/test_audit_journey52.py)

