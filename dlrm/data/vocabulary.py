"""The sorted vocabularies of hashing mode "vocabulary": ``DIR/vocab/SPARSE_<i>.npy``, one a feature,
read as untrusted input (`read_vocabulary`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dlrm.data.schema import _MAX_INT, SPARSE_COLUMNS, DatasetError


def vocab_path(dataset_dir: str | os.PathLike, feature: int) -> Path:
    """Where the sorted vocabulary of sparse feature `feature` lives (hashing mode "vocabulary")."""
    return Path(dataset_dir) / "vocab" / f"{SPARSE_COLUMNS[feature]}.npy"


def _read_npy_header(fh, path: Path) -> tuple[tuple[int, ...], Any, int]:
    """(shape, dtype, data offset) of an open ``.npy`` file, from its header alone."""
    import numpy as np

    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, EOFError, OSError, SyntaxError, TypeError) as e:
        raise DatasetError(f"{path}: not a readable .npy array ({e})") from None
    return shape, dtype, fh.tell()


def read_vocabulary(dataset_dir: str | os.PathLike, feature: int, cardinality: int):
    """The sorted vocabulary of sparse feature `feature` as int64 numpy, validated against the contract.

    The file must be a plain ``.npy`` (no pickles) holding a 1-D integer array, strictly
    increasing (sorted, no duplicates: the hashing's binary search silently misplaces values
    otherwise), of ``cardinality - 1`` values (row 0 is the out-of-vocabulary row) and exactly as
    long as its header says. The header is checked before any data is read, so a corrupt header
    cannot ask for a huge allocation. Raises `DatasetError` naming the file.
    """
    import numpy as np

    path = vocab_path(dataset_dir, feature)
    if not path.is_file():
        raise DatasetError(f"{path}: vocabulary file missing (metadata.json says hashing 'vocabulary')")
    try:
        with open(path, "rb") as fh:
            shape, dtype, offset = _read_npy_header(fh, path)
            if dtype.kind not in "iu" or len(shape) != 1:
                raise DatasetError(f"{path}: must hold a 1-D integer array, holds {dtype} of shape {shape}")
            if shape[0] != cardinality - 1:
                raise DatasetError(f"{path}: holds {shape[0]} values but metadata.json cardinalities[{feature}] "
                                   f"is {cardinality} (a vocabulary of {cardinality - 1} values plus row 0)")
            size = os.fstat(fh.fileno()).st_size
            if size != offset + shape[0] * dtype.itemsize:
                raise DatasetError(f"{path}: is {size} bytes, its header promises {offset + shape[0] * dtype.itemsize} "
                                   "(truncated or corrupt)")
            values = np.fromfile(fh, dtype=dtype, count=shape[0])
    except OSError as e:
        raise DatasetError(f"{path}: cannot be read ({e.strerror or e})") from None
    return _checked_vocabulary(path, values)


def _checked_vocabulary(path: Path, values):
    """`values` as int64, checked to fit int64 and to be strictly increasing."""
    import numpy as np

    if values.dtype.kind == "u" and values.size and int(values.max()) > _MAX_INT:
        raise DatasetError(f"{path}: value {int(values.max())} does not fit int64")
    values = values.astype(np.int64)
    bad = np.flatnonzero(values[1:] <= values[:-1])
    if bad.size:
        i = int(bad[0]) + 1
        raise DatasetError(f"{path}: not strictly increasing (sorted, unique) at index {i}: "
                           f"{int(values[i - 1])} then {int(values[i])}")
    return values
