"""Arrow columns as NumPy arrays without pyarrow's pandas conversion.

``pa.Array.to_numpy`` goes through pyarrow's Arrow-to-pandas converter, whose first use imports pandas when it is
installed (about 0.5 s of CPU, in every process that reads a row group: each training run, each torchrun rank, each
loader worker). A null-free array of a fixed-width type is exported through DLPack instead: the same zero-copy,
read-only view of the same buffer, without pandas. Anything else (nulls, booleans, strings) keeps ``to_numpy``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def numpy_of(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``column.to_numpy(zero_copy_only=False)``'s values: a read-only view when one chunk of a null-free integer or
    floating-point type (several chunks are joined first, one copy, as ``to_numpy`` joins them).

    Example:
        >>> numpy_of(pa.chunked_array([pa.array([1, 2], pa.int32()), pa.array([3], pa.int32())]))
        array([1, 2, 3], dtype=int32)
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if column.null_count == 0 and (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return np.from_dlpack(column)
    return column.to_numpy(zero_copy_only=False)
