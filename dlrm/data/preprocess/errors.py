"""The errors of preprocessing: one-line messages meant for the user."""

from __future__ import annotations

import re
from dataclasses import dataclass

# `repr` of a str decoded with "surrogateescape" shows an undecodable byte 0xNN as \udcNN (after an even run of
# backslashes, which are literal ones doubled): it is shown as the byte's own escape, \xNN
_ESCAPED_BYTE = re.compile(r"(?<!\\)((?:\\\\)*)\\udc([89a-f][0-9a-f])")


def field_text(raw: bytes) -> str:
    r"""A field's bytes as text for a message, decoded as UTF-8 with its undecodable bytes kept ("surrogateescape"),
    so that `quoted` shows them as \xNN. Decoded with "replace" each read U+FFFD ('\ufffd\ufffd' for two: printed
    as two question-mark glyphs) and the user could not tell which bytes to look for in the file."""
    return raw.decode("utf-8", "surrogateescape")


def quoted(text: str) -> str:
    r"""`repr` of a `field_text`, its undecodable bytes as \xNN escapes (b"ab\xff" reads 'ab\xff')."""
    return _ESCAPED_BYTE.sub(r"\1\\x\2", repr(text))


class PreprocessError(Exception):
    """Bad input or a refused output directory; the message is one line meant for the user."""


@dataclass(frozen=True)
class BadLine:
    """The first bad line of a chunk or file: where it is and why it is bad."""

    path: str
    line: int | None  # 1-based line number in the file (the CSV header is line 1); None: whole file
    reason: str  # one of BAD_LINE_REASONS
    column: str | None = None  # raw column name (label, I1..I13, C1..C26)
    value: str | None = None  # `field_text` of the raw bytes
    detail: str = ""

    def message(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        if self.column is not None:
            return f"{where}: column {self.column}: {quoted(self.value)} {self.detail}"
        return f"{where}: {self.detail}"


class BadLineError(PreprocessError):
    """Raised in ``on_bad_line="stop"`` mode; ``.bad`` is the `BadLine`."""

    def __init__(self, bad: BadLine):
        super().__init__(bad.message())
        self.bad = bad

    def __reduce__(self):
        return (BadLineError, (self.bad,))


class _Interrupted(PreprocessError):
    """A run stopped by ``_max_new_chunks`` (tests: the state a kill leaves behind)."""


class InterruptedWhenComplete(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: ``exit_code`` 143) after metadata.json was written: the dataset is complete, only the
    tidying up after it (removing the progress records, the summary) was cut short. ``.output`` is the dataset."""

    def __init__(self, output, exit_code: int = 130):
        super().__init__(str(output))
        self.output = output
        self.exit_code = exit_code


class InterruptedBeforeReplacing(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: ``exit_code`` 143) in an --overwrite run before it removed or took over anything in its
    output (the count pass): what the output held (a dataset, an unfinished run of other settings) is as it was, and
    only the same command, with --overwrite, starts over (without it, an unfinished run of other settings is refused,
    and one of the same settings resumes the run --overwrite was given to replace)."""

    def __init__(self, exit_code: int = 130):
        super().__init__()
        self.exit_code = exit_code
