"""What an input file is, from its first bytes: the archives and codecs the preprocessor does not read.

The preprocessor reads text, plain or gzip. Criteo's downloads are not all that: Kaggle's is ``dac.tar.gz`` (a tar of
train.txt, test.txt and readme.txt inside gzip), and day files get recompressed with bzip2, xz or zstd. Read as text,
such a file failed on its first line with a message about its fields (``column label: 'train.txt\\x00\\x00...' is not a
label``, ``expected 40 fields ... found 4``, or ``cannot detect the format ...; use --format``), none of which says
what is wrong or helps. `unreadable_kind` names the container from its magic bytes, so the input check can say it in
one line, before anything is written.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

_TAR_MAGIC_AT = 257  # POSIX ustar and GNU tar headers: "ustar" at byte 257 of the first 512-byte block

# magic bytes -> (what the file is, the command that makes text of it)
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"BZh", "a bzip2-compressed file", "bunzip2 -k {name}"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "unxz -k {name}"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "unzstd {name}"),
    (b"\x04\x22\x4d\x18", "an lz4-compressed file", "unlz4 {name}"),
    (b"PK\x03\x04", "a zip archive", "unzip {name}"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "7z x {name}"),
)


def _is_tar(head: bytes) -> bool:
    return head[_TAR_MAGIC_AT : _TAR_MAGIC_AT + 5] == b"ustar"


def _gzip_head(path: Path, n: int) -> bytes:
    """The first ``n`` decompressed bytes of a gzip file (fewer where it is shorter or damaged: the count pass reports
    a damaged stream in its own words)."""
    try:
        with gzip.open(path, "rb") as f:
            return f.read(n)
    except (OSError, EOFError, zlib.error):
        return b""


def unreadable_kind(path: Path) -> str | None:
    """None for a file the preprocessor can read as text (plain or gzip), else one line saying what it is and what to
    do, e.g. ``a gzip-compressed tar archive: ...``."""
    with open(path, "rb") as f:
        head = f.read(512)
    name = path.name
    if head[:2] == b"\x1f\x8b":
        if _is_tar(_gzip_head(path, 512)):
            return (f"a gzip-compressed tar archive (Kaggle's download, dac.tar.gz, is one): extract it "
                    f"(tar xzf {name}) and give the text file it holds (train.txt; its test.txt has no labels)")
        return None
    if _is_tar(head):
        return f"a tar archive: extract it (tar xf {name}) and give the text files it holds"
    for magic, what, command in _MAGIC:
        if head.startswith(magic):
            return f"{what}: decompress it first ({command.format(name=name)}), or recompress it with gzip"
    return None
