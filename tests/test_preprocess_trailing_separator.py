"""A file whose every line ends in a separator after its 40th field (an exporter's trailing tab or comma): the error
said only "found 41"; it now says that the line ends with the separator, so the extra field is the empty one after
it, and how to remove it (`line_endings.trailing_separator_hint`). Lines with a field too many elsewhere get no such
hint."""

from __future__ import annotations

import pytest

from tests.test_preprocess_cli_errors import assert_one_line_error, raw_lines, run_cli

HINT_41 = "found 41 (the line ends with a tab, so its 41st field is empty: a separator after the last field? " \
          "remove it from every line, e.g. with sed 's/\\t$//')"


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_a_tab_at_the_end_of_every_line_is_named(tmp_path, eol):
    path = tmp_path / "a.tsv"
    path.write_bytes("".join(line + "\t" + eol for line in raw_lines(20).splitlines()).encode())
    assert_one_line_error(run_cli("-i", path, "-o", tmp_path / "ds"), f"{path}:1: expected 40 fields", HINT_41)
    assert not (tmp_path / "ds").exists()


def test_a_missing_last_category_then_a_tab_is_named_too(tmp_path):
    """C26 missing (the 40th field empty: the line already ends in a tab) and the exporter's tab after it."""
    lines = raw_lines(5).splitlines()
    lines[2] = lines[2][:lines[2].rfind("\t") + 1] + "\t"
    path = tmp_path / "a.tsv"
    path.write_text("\n".join(lines) + "\n")
    assert_one_line_error(run_cli("-i", path, "-o", tmp_path / "ds"), f"{path}:3: expected 40 fields", HINT_41)


def test_two_tabs_at_the_end_are_named_as_two(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("".join(line + "\t\t\n" for line in raw_lines(5).splitlines()))
    assert_one_line_error(run_cli("-i", path, "-o", tmp_path / "ds"),
                          "found 42 (the line ends with 2 tabs, so its fields 41-42 are empty", "sed 's/\\t\\t$//'")


def test_a_comma_after_the_last_column_of_a_csv_header_is_named(tmp_path):
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    path = tmp_path / "a.csv"
    path.write_text("".join(line + ",\n" for line in [header, *raw_lines(5).replace("\t", ",").splitlines()]))
    assert_one_line_error(run_cli("-i", path, "-o", tmp_path / "ds"),
                          f"{path}:1: the header has 41 fields, expected 40 (the line ends with a comma, so its 41st "
                          "field is empty", "sed 's/,$//'")


def test_a_field_too_many_elsewhere_gets_no_such_hint(tmp_path):
    lines = raw_lines(5).splitlines()
    lines[1] = lines[1].replace("\t", "\t7\t", 1)  # an extra count after the label: 41 fields, no tab at the end
    path = tmp_path / "a.tsv"
    path.write_text("\n".join(lines) + "\n")
    line = assert_one_line_error(run_cli("-i", path, "-o", tmp_path / "ds"), f"{path}:2: expected 40 fields")
    assert line.endswith("found 41"), line
