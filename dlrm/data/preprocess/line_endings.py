"""Lines ended by a carriage return alone (``\\r``: classic Mac OS, some exports), which the preprocessor does not read.

Lines end in ``\\n`` (``\\r\\n`` is read too). A file whose records end in ``\\r`` alone has no newline, or few: its
records run together into one line of thousands of fields, which was named as "found 3901 fields ...; the file ends in
this line, without a newline (cut off? ...)", or, for the CSV variant, "the header has 7840 fields". `cr_ended` tells
such a line from a damaged one: a carriage return inside it, after a whole record (40 fields, or the CSV header);
`cr_advice` says what the file is and how to convert it.
"""

from __future__ import annotations

import shlex

from dlrm.data.preprocess.constants import NUM_FIELDS


def cr_ended(line: bytes) -> bool:
    """Whether ``line`` (a line without its ``\\n``, or all a file holds up to its first one) is several records ended
    by ``\\r`` alone: a carriage return with more after it, the text before it one whole record (40 fields separated
    by tabs or by commas). A value never holds a ``\\r``: such a line is no damaged record."""
    first, cr, rest = line.partition(b"\r")
    return bool(cr and rest.strip(b"\r")) and (first.count(b"\t") == NUM_FIELDS - 1
                                              or first.count(b",") == NUM_FIELDS - 1)


def cr_advice(path: str | None, compressed: bool = False) -> str:
    """What a `cr_ended` first line of ``path`` means, and the command that converts the file; ``path`` None: of a
    later line (a file of both kinds of line endings), with the ``tr`` to use alone."""
    ending = "a carriage return alone ('\\r', old Mac line endings), not a newline"
    if path is None:
        return f"records in this line end in {ending}; convert the file, e.g. with tr '\\r' '\\n'"
    quoted = shlex.quote(str(path))
    how = f"zcat {quoted} | tr '\\r' '\\n' > NEW_FILE" if compressed else f"tr '\\r' '\\n' < {quoted} > NEW_FILE"
    return f"the file's lines end in {ending}; convert it, e.g. {how}"


def trailing_separator_hint(line: bytes, delim: int, nfields: int) -> str:
    """`` (...)`` when a line of more than 40 fields (or a header of more than 40 columns) ends in as many separators as
    it has fields too many: an exporter that writes a tab (or a comma) after the last field makes an empty 41st field of
    every line, which the field count alone ("found 41") did not say; else ""."""
    extra = nfields - NUM_FIELDS
    sep = bytes([delim])
    if extra <= 0 or not line.rstrip(b"\r").endswith(sep * extra):
        return ""
    name = {ord("\t"): "tab", ord(","): "comma"}.get(delim, repr(chr(delim)))
    escaped = "\\t" if delim == ord("\t") else chr(delim)
    if extra == 1:
        what, empty, them = f"a {name}", f"its {NUM_FIELDS + 1}st field is", "it"
    else:
        what, empty, them = f"{extra} {name}s", f"its fields {NUM_FIELDS + 1}-{nfields} are", "them"
    return (f" (the line ends with {what}, so {empty} empty: a separator after the last field? remove {them} from "
            f"every line, e.g. with sed 's/{escaped * extra}$//')")
