"""A file that ends without a newline in the middle of its last value: a copy cut off there, not a category.

Criteo's files end every line with a newline, and its categories are 8-digit hex hashes. A day file whose download or
copy stopped part-way ends without its newline, inside its last line. When the cut falls before the last field, that
line has too few fields and the parser names it; when it falls inside the last value (C26), the line still has its 40
fields and a hex of 1 to 7 digits, which the parser's grammar accepts (it takes short hashes, for other writers), so the
run stored a category the log does not hold, without a word. `cut_last_line` finds that line, so that it is a bad line
(reason ``bad_category``) like any other: named with ``--on-bad-line stop``, dropped and counted with ``skip``. A last
line without a newline whose last value has 8 digits, or is empty (missing), is read as before: nothing tells it from a
whole line.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dlrm.data.preprocess.constants import NUM_FIELDS, RAW_COLUMNS
from dlrm.data.preprocess.errors import BadLine, field_text
from dlrm.data.preprocess.line_endings import cr_ended
from dlrm.data.preprocess.parse import _HEX_RE, MULTI_HOT_SEPARATOR, ParsedChunk, _delimiter_of
from dlrm.data.schema import is_multi_hot

_HASH_DIGITS = 8  # Criteo's categories are 32-bit hashes written as 8 hex digits
_NOTE = "the file ends in this line, without a newline (cut off? a truncated download or copy)"


def cut_last_line(data: bytes, fmt: str, source: str, first_line: int,
                  multi_hot_sizes: list[int] | None = None) -> BadLine | None:
    """The `BadLine` of the last line of ``data`` (a chunk; only a file's last chunk can lack the final newline) when
    it has no newline and its 40 fields end in a hex value of fewer than 8 digits; else None."""
    if not data or data.endswith(b"\n"):
        return None
    start = data.rfind(b"\n") + 1
    fields = data[start:].rstrip(b"\r").split(_delimiter_of(fmt))
    if len(fields) != NUM_FIELDS:
        return None  # the parser names a wrong field count (with `unterminated_note`)
    last = fields[-1]
    if is_multi_hot(multi_hot_sizes) and multi_hot_sizes[-1] > 1:
        last = last.rsplit(MULTI_HOT_SEPARATOR, 1)[-1]  # the list's last value is the one cut
    if not 0 < len(last) < _HASH_DIGITS or _HEX_RE.fullmatch(last) is None:
        return None
    value = field_text(fields[-1])
    return BadLine(source, first_line + data.count(b"\n"), "bad_category", RAW_COLUMNS[-1], value,
                   f"has fewer than {_HASH_DIGITS} hex digits and {_NOTE}")


def unterminated_note(bad: BadLine, data: bytes, first_line: int) -> BadLine:
    """``bad``, saying the file ends in it when it is the unterminated last line of ``data`` with a wrong field count
    (the message named only the count: "expected 40 fields ..., found 29")."""
    if data and not data.endswith(b"\n") and bad.line == first_line + data.count(b"\n") \
            and bad.reason == "wrong_field_count" and not cr_ended(data[data.rfind(b"\n") + 1:]):  # (not cut off)
        return dataclasses.replace(bad, detail=f"{bad.detail}; {_NOTE}")
    return bad


def drop_cut_line(parsed: ParsedChunk, cut: BadLine) -> ParsedChunk:
    """``parsed`` (of the lines before the cut one) with that line counted as a line and as a bad one (``skip``)."""
    bad = dict(parsed.bad)
    bad[cut.reason] = bad.get(cut.reason, 0) + 1
    return dataclasses.replace(parsed, n_lines=parsed.n_lines + 1, line_index=np.asarray(parsed.lines()), bad=bad,
                               first_bad=parsed.first_bad or cut)
