"""Files and directories the project finishes from mkstemp/mkdtemp (0600/0700) get the mode open()/mkdir() would
have given them under the process's umask: 0644/0755 under 022, private under 077 (they were set to 0644/0755
outright before 2026-12-04, readable by every user whatever the umask said)."""

import os
import stat
import tempfile
from pathlib import Path

import pytest

from dlrm import checkpoint as ckpt
from dlrm.data.output_dirs import replace_dir
from dlrm.data.schema import write_json_atomic
from dlrm.file_modes import current_umask, dir_mode, file_mode


@pytest.fixture(params=[0o022, 0o077, 0o027])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_umask_is_read_as_set_and_left_as_it_was(umask):
    assert current_umask() == umask
    assert current_umask() == umask  # not changed by reading it
    assert file_mode() == 0o666 & ~umask and dir_mode() == 0o777 & ~umask


def test_the_proc_less_fallback_reads_the_same_umask(umask, monkeypatch):
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path) == "/proc/self/status":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    assert current_umask() == umask
    assert current_umask() == umask


def test_finished_files_and_directories_follow_the_umask(umask, tmp_path):
    expected_file, expected_dir = 0o666 & ~umask, 0o777 & ~umask
    # what open() gives a file here: the mode the run's other files (config.json, events) have
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert mode(plain) == expected_file

    ckpt.write_files_atomic(tmp_path, {"report.md": "# r\n", "report.csv": "a\n"})
    write_json_atomic(tmp_path / "metadata.json", {"a": 1})
    for name in ("report.md", "report.csv", "metadata.json"):
        assert mode(tmp_path / name) == expected_file, name

    made = Path(tempfile.mkdtemp(dir=tmp_path))
    assert mode(made) == 0o700
    replace_dir(made, tmp_path / "dataset")
    assert mode(tmp_path / "dataset") == expected_dir
