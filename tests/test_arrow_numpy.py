"""`dlrm.data.arrow_numpy.numpy_of`: the values of ``to_numpy`` (dtype and elements), through DLPack where it can,
``to_numpy``'s own fallback for the rest. (That the loaders read rows without importing pandas:
tests/test_multihot_data.py.)"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dlrm.data.arrow_numpy import numpy_of

CASES = {
    "int8": pa.array([1, 0, 1], pa.int8()),
    "int32": pa.array([-1, 7, 2**31 - 1], pa.int32()),
    "int64": pa.array([-(2**63), 0, 2**63 - 1], pa.int64()),
    "uint32": pa.array([0, 2**32 - 1], pa.uint32()),
    "float32": pa.array([1.5, -0.0, float("inf")], pa.float32()),
    "one value": pa.array([5], pa.int64()),
    "empty": pa.array([], pa.int64()),
    "sliced": pa.array(list(range(10)), pa.int64()).slice(3, 4),
    "list values": pa.array([[1, 2], [], [3]], pa.list_(pa.int64())).slice(1, 2).flatten(),
    "nulls (to_numpy)": pa.array([1, None, 3], pa.int64()),
    "bool (to_numpy)": pa.array([True, False, True]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunks", [1, 2])
def test_numpy_of_equals_to_numpy(name, chunks):
    array = CASES[name]
    column = pa.chunked_array([array] * chunks, type=array.type)
    want = column.to_numpy()
    got = numpy_of(column)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaN (a null's float) equal to NaN


def test_numpy_of_one_chunk_is_a_view_of_the_arrow_buffer():
    array = pa.array(np.arange(6, dtype=np.int32)).slice(2, 3)
    got = numpy_of(pa.chunked_array([array]))
    assert not got.flags.writeable  # as to_numpy's zero-copy view: Arrow data is immutable
    address = array.buffers()[1].address + array.offset * 4
    assert got.__array_interface__["data"][0] == address
