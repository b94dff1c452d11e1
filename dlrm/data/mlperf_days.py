"""MLPerf DLRM-DCNv2's input files of one day (``day_{i}_labels.npy``, ``day_{i}_dense.npy``,
``day_{i}_sparse_multi_hot.npz``, or TorchRec's one-hot ``day_{i}_sparse.npy`` in its place), opened as read-only
memory maps and checked for shape and dtype before any row is read (`dlrm.data.mlperf_import` reads their rows).
Every refusal is one `ImportInputError` line naming the file."""

from __future__ import annotations

import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from dlrm.data.schema import MAX_MULTI_HOT_SIZE, NUM_DENSE, NUM_SPARSE


class ImportInputError(click.ClickException):
    """A bad input file or value (one line, exit 2)."""


def npz_member(path: Path, name: str) -> np.ndarray:
    """Member `name` (without ``.npy``) of an uncompressed ``.npz`` as a read-only memory map.

    ``np.load`` reads npz members whole; MLPerf's are tens of GB, so the member's bytes are mapped
    where the zip stores them (``ZIP_STORED``: the data follow the local file header as they are)."""
    try:
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(f"{name}.npy")
    except KeyError:
        raise ImportInputError(f"{path}: no member {name}.npy (expected 0.npy .. {NUM_SPARSE - 1}.npy)") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise ImportInputError(f"{path}: not a readable .npz ({e})") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise ImportInputError(f"{path}: member {name}.npy is compressed (np.savez_compressed?); memory maps need "
                               f"np.savez's stored members: rewrite the file uncompressed")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise ImportInputError(f"{path}: member {name}.npy: no local file header where the zip directory says")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        try:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
        except ValueError as e:
            raise ImportInputError(f"{path}: member {name}.npy: not an .npy array ({e})") from None
        offset = f.tell()
    if dtype.hasobject:
        raise ImportInputError(f"{path}: member {name}.npy holds Python objects, not integers")
    if any(d < 0 for d in shape):  # a damaged header: np.memmap's OverflowError or ValueError, a traceback
        raise ImportInputError(f"{path}: member {name}.npy: shape {shape} is not a valid array shape (a negative "
                               "dimension: a damaged header)")
    # the zip says how many bytes the member holds: a member cut short would map the next member's (or the zip
    # directory's) bytes as ids, or past the file's end (numpy's ValueError, a traceback)
    need = offset - (info.header_offset + 30 + name_len + extra_len) + math.prod(shape) * dtype.itemsize
    if info.file_size < need:
        raise ImportInputError(f"{path}: member {name}.npy holds {info.file_size} bytes, but its header's shape "
                               f"{shape} {dtype} needs {need}: the member is cut short")
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, offset=offset, order="F" if fortran else "C")


@dataclass(frozen=True)
class Day:
    """One day's three files, opened as memory maps, checked for shape and dtype."""

    index: int
    labels: np.ndarray  # [N]
    dense: np.ndarray  # float [N, 13]
    sparse: tuple  # 26 integer arrays [N, size_f]
    paths: tuple  # labels, dense, sparse file

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    @classmethod
    def open(cls, root: Path, i: int) -> "Day":
        paths = (root / f"day_{i}_labels.npy", root / f"day_{i}_dense.npy", root / f"day_{i}_sparse_multi_hot.npz")
        one_hot = root / f"day_{i}_sparse.npy"
        if not paths[2].is_file() and one_hot.is_file():
            # TorchRec's one-hot layout (`BinaryCriteoUtils`: int [N, 26], one id a feature), before MLPerf's multi-hot
            # step: imported as 26 one-hot features. It was refused, pointing at MLPerf's multi-hot synthesis, which
            # a user training the one-hot DLRM on those files does not want.
            paths = (*paths[:2], one_hot)
        for p in paths:
            if not p.is_file():
                raise ImportInputError(f"{p}: missing (MLPerf's day {i} needs day_{i}_labels.npy, day_{i}_dense.npy "
                                       f"and day_{i}_sparse_multi_hot.npz, or TorchRec's one-hot day_{i}_sparse.npy)")
        labels, dense = (_npy(p) for p in paths[:2])
        if labels.ndim == 2 and labels.shape[1] == 1:
            labels = labels[:, 0]
        if labels.ndim != 1 or labels.dtype.kind not in "iuf":
            raise ImportInputError(f"{paths[0]}: shape {labels.shape} {labels.dtype}, expected numbers [N] or [N, 1]")
        n = labels.shape[0]
        if n == 0:  # a day without rows is a broken preprocessing; imported, it leaves a split out of the dataset
            raise ImportInputError(f"{paths[0]}: no rows (shape {labels.shape}); every day of MLPerf's holds rows")
        # float32 as the reference writes it: a float64 copy would be rounded to float32 silently (either byte order)
        if dense.shape != (n, NUM_DENSE) or dense.dtype.kind != "f" or dense.dtype.itemsize != 4:
            raise ImportInputError(f"{paths[1]}: shape {dense.shape} {dense.dtype}, expected float32 "
                                   f"[{n}, {NUM_DENSE}] (the rows of {paths[0].name})")
        if paths[2] == one_hot:
            ids = _npy(one_hot)
            if ids.shape != (n, NUM_SPARSE) or ids.dtype.kind not in "iu":
                raise ImportInputError(f"{one_hot}: shape {ids.shape} {ids.dtype}, expected integers "
                                       f"[{n}, {NUM_SPARSE}] (the rows of {paths[0].name}, one id a feature)")
            return cls(i, labels, dense, tuple(ids[:, f:f + 1] for f in range(NUM_SPARSE)), paths)
        _refuse_other_members(paths[2])
        sparse = tuple(npz_member(paths[2], str(f)) for f in range(NUM_SPARSE))
        for f, ids in enumerate(sparse):
            if ids.ndim != 2 or ids.shape[0] != n or ids.shape[1] < 1 or ids.dtype.kind not in "iu":
                raise ImportInputError(f"{paths[2]}: member {f}.npy: shape {ids.shape} {ids.dtype}, expected integers "
                                       f"[{n}, size] (the rows of {paths[0].name})")
            if ids.shape[1] > MAX_MULTI_HOT_SIZE:  # metadata.json could not hold it: every reader refused the
                # finished dataset ("multi_hot_sizes[f]: ... is not an integer in [1, 65536]") after a whole import
                raise ImportInputError(f"{paths[2]}: member {f}.npy: {ids.shape[1]} values a row, more than the "
                                       f"{MAX_MULTI_HOT_SIZE} a dataset's multi_hot_sizes allows")
        return cls(i, labels, dense, sparse, paths)

    @property
    def one_hot_npy(self) -> bool:
        """Whether the ids come from TorchRec's one-hot ``day_{i}_sparse.npy`` (not MLPerf's multi-hot npz)."""
        return self.paths[2].suffix == ".npy"

    def where(self, feature: int) -> str:
        """Where `feature`'s ids are in the sparse file, for an error line: its npz member, or its column."""
        if self.one_hot_npy:
            return f"column {feature}"
        return f"member {feature}.npy"

    @property
    def sizes(self) -> list[int]:
        return [int(ids.shape[1]) for ids in self.sparse]


def _refuse_other_members(path: Path) -> None:
    """Refuse an npz holding a member besides MLPerf's ``0.npy`` .. ``25.npy``, or one of them twice: a 27th feature
    (another feature set, or one written at the front, which shifts every feature's ids onto another's table) was
    left out without a word, and the dataset trained on the other 26 as if they were MLPerf's; of a member written
    twice the last copy was read."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        raise ImportInputError(f"{path}: not a readable .npz ({e})") from None
    expected = {f"{f}.npy" for f in range(NUM_SPARSE)}
    other = [n for n in names if n not in expected]
    if other:
        raise ImportInputError(f"{path}: member {other[0]} is not one of MLPerf's {NUM_SPARSE} features (0.npy .. "
                               f"{NUM_SPARSE - 1}.npy; the file holds {len(names)} members)")
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:  # a zip appended to: the last copy was read, the first left out, unsaid
        raise ImportInputError(f"{path}: member {twice} is in the file twice (an archive appended to?); which holds "
                               f"feature {twice[:-4]}'s ids is unclear: write the file again with np.savez")


def _npy(path: Path) -> np.ndarray:
    # EOFError: an empty file (a copy cut off); BadZipFile: a file starting "PK", which np.load takes for an .npz
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    # OverflowError: a header whose shape has a negative dimension (np.memmap's "length must be positive")
    except (OSError, ValueError, OverflowError, EOFError, zipfile.BadZipFile) as e:
        raise ImportInputError(f"{path}: not a readable .npy array ({e})") from None
    if not isinstance(array, np.ndarray):  # an .npz (np.load's NpzFile) under the .npy name
        array.close()
        raise ImportInputError(f"{path}: an .npz archive, not an .npy array")
    return array
