"""The parsed parquet footers a streaming loader keeps between its reads (`FooterCache`), within a memory budget.

A parsed footer (pyarrow's ``FileMetaData``) costs far more memory than its bytes on disk: every column chunk of every
row group with its statistics. A file of MLPerf DLRM-DCNv2's import (8 row groups of 131,072 rows, 228 slot columns;
a 214 KB footer) holds 1.65 MB parsed, and the ~4,000 train files of its 4.2e9 rows held 6.5 GB of host memory in
each loader of each rank, kept for the whole run (measured: 4,000 such files, `ParquetLoader` 0.26 -> 6.8 GB RSS).
Only `FOOTER_CACHE_BYTES` of footers (their size on disk) are kept now; a file's footer beyond them is read again for
each of its row groups' reads: ~2 ms for such a file against the seconds its 131,072-row group takes to decode
(4,000 such files: the loader's 6.5 GB are ~0.25 GB, most of them the footers it keeps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pyarrow.parquet as pq

FOOTER_CACHE_BYTES = 16 << 20
"""Footer bytes (their serialized size, about 1/8 of their parsed size) a loader keeps parsed: every footer of a split
of up to ~75 files of MLPerf's import (78M rows) or some hundreds of one-hot files (5.8 KB of footer a row group of 40
columns; the loader then parses each footer once, as it always did); of a larger split, its first files' (~130 MB of
host memory at most)."""

REPARSE_BYTES_PER_VALUE = 1 / 16
"""A footer is kept past the budget when it holds more than this many bytes per value of its average row group (rows x
columns): parsing it again would cost more than ~5% of that row group's decode (measured: ~6 ns a footer byte to parse,
~8 ns a one-hot value to decode). A footer grows with its file's row groups, and one parsed again at each of them costs
their count squared: a one-hot file of 1,000 row groups of 4,096 rows (a 4.2 MB footer) took 25 ms a parse against
1.35 ms a row group's read, its epoch 19x slower than with the footer kept (as every footer was before the budget).
MLPerf's files (8 row groups of 131,072 rows x 228 columns, 214 KB) hold 0.007 bytes a value: parsed again."""


class FooterCache:
    """Parsed footers of a loader's files by file index, the first ones `put` up to `budget` bytes of footer
    (``FileMetaData.serialized_size``); any other is parsed again at each `footer` call and dropped after its read.

    Kept, never replaced: footers taken in and dropped one by one as they were used (least recently used first) left
    the host allocator's heap fragmented, and the process grew by 1.6 GB over 2,000 MLPerf-shaped files with 156 of
    them kept; parsed and freed at once, the same memory serves the next one.

    Example:
        >>> cache = FooterCache(budget=0)
        >>> cache.get(0) is None  # nothing kept: the reader parses the file's footer itself
        True
    """

    def __init__(self, budget: Optional[int] = None, reparse_limit: Optional[float] = None) -> None:
        self.budget = FOOTER_CACHE_BYTES if budget is None else budget
        self.reparse_limit = REPARSE_BYTES_PER_VALUE if reparse_limit is None else reparse_limit
        self._held: dict[int, pq.FileMetaData] = {}
        self._bytes = 0

    def put(self, index: int, footer: pq.FileMetaData) -> None:
        """Keep `footer` as file `index`'s if it fits within the budget (called as the loader opens its files, before
        its reader threads start: only `get` and `footer` run in them); kept past the budget too when parsing it
        again would cost much of a row group's read (`REPARSE_BYTES_PER_VALUE`)."""
        size = footer.serialized_size
        values = footer.num_rows * footer.num_columns / max(1, footer.num_row_groups)  # an average row group's
        if index not in self._held and (self._bytes + size <= self.budget or size > self.reparse_limit * values):
            self._held[index] = footer
            self._bytes += size

    def get(self, index: int) -> Optional[pq.FileMetaData]:
        """File `index`'s footer if kept, else None."""
        return self._held.get(index)

    def footer(self, index: int, path: Path,
               check: Optional[Callable[[pq.FileMetaData], None]] = None) -> pq.FileMetaData:
        """File `index`'s footer: the kept one, else parsed from `path` again (pyarrow's errors pass through) and
        passed to `check`: the file may have been rewritten since it was opened and its schema checked. A kept footer
        reads the file as it was (a rewritten file fails to decode); one parsed again reads it as it is now, and a
        column of another type (float ids, truncated in silence), a missing column (a KeyError, no file named) or
        another layout went through unchecked."""
        footer = self._held.get(index)
        if footer is None:
            with pq.ParquetFile(path) as reader:  # (closed at once: no descriptor left to the garbage collector)
                footer = reader.metadata
            if check is not None:
                check(footer)
        return footer

    def __len__(self) -> int:
        return len(self._held)
