"""`dlrm.data.mlperf_import` refuses a ``day_{i}_sparse_multi_hot.npz`` that holds more than MLPerf's members
``0.npy`` .. ``25.npy`` (what the reference's ``np.savez(path, **{str(j): ids})`` writes), or one of them twice.

A 27th member (another feature set, or an extra feature written first, which puts every feature's ids in the next
one's place) was left out without a word: the import finished and the dataset trained. Of a member stored twice (a
zip appended to) the last copy was read, also without a word. Either is now one line naming the file and the member,
exit 2, nothing written."""

from __future__ import annotations

import io
import warnings
import zipfile

import numpy as np
import pytest

from tests.test_audit_mlperf_import_edges import assert_refused, run, src  # noqa: F401  (src: days 0 and 23)


def _append_member(path, name, array):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    with warnings.catch_warnings():  # zipfile's "Duplicate name" for the member written twice: that is the point
        warnings.simplefilter("ignore", UserWarning)
        with zipfile.ZipFile(path, "a") as z:
            z.writestr(name, buf.getvalue())


@pytest.mark.parametrize("name, needle", [
    ("26.npy", "member 26.npy is not one of MLPerf's 26 features (0.npy .. 25.npy; the file holds 27 members)"),
    ("extra/", "member extra/ is not one of MLPerf's 26 features"),
    ("7.npy", "member 7.npy is in the file twice"),
])
def test_an_npz_with_another_member_or_one_twice_is_refused(src, tmp_path, name, needle):  # noqa: F811
    npz = src / "day_0_sparse_multi_hot.npz"
    _append_member(npz, name, np.zeros((6, 1), np.int32))
    out = tmp_path / "ds"
    res = run(src, out, "--max-rows-per-day", 3)
    assert_refused(res, out, f"{npz}: {needle}")


def test_mlperfs_own_members_still_import(src, tmp_path):  # noqa: F811
    res = run(src, tmp_path / "ds")
    assert res.exit_code == 0, res.output
