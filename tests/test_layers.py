"""The package's import layers hold (issue #18): `lint-imports` checks pyproject.toml's contract."""

import os
import shutil
import subprocess

from tests.conftest import REPO
from tests.prewarm import launch


def test_import_layers_contract_is_kept():
    # beside this interpreter first (a virtual environment that is not activated), then on PATH; the real one, not the
    # prewarmed interpreter's wrapper (tests/prewarm/launch.py)
    exe = shutil.which("lint-imports", path=os.path.dirname(launch.real_python())) or shutil.which("lint-imports")
    assert exe, "import-linter is a dev dependency: pip install -e '.[dev]'"
    out = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_kernels_import_nothing_from_dlrm():
    """kernels/ is a library of ops on plain tensors (also covered by the layers contract)."""
    hits = subprocess.run(["grep", "-rn", "--include=*.py", "-E", r"^\s*(from|import) dlrm", "kernels"],
                          cwd=REPO, capture_output=True, text=True)
    assert hits.stdout == "", hits.stdout


def test_no_module_in_the_package_or_the_kernels_is_over_600_lines():
    """Small files with one job each (issue #18): a file that grows past 600 lines gets split."""
    long = {str(p.relative_to(REPO)): n for root in ("dlrm", "kernels") for p in (REPO / root).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, long


def test_tests_import_the_shared_setup_by_its_package_name():
    """`from conftest import ...` names whichever conftest module pytest loaded first: in the suite's one run (the
    README's command) tests/kernels/conftest.py, which has no CHILD_ENV: that test file failed to collect, CI red."""
    hits = subprocess.run(["grep", "-rn", "--include=*.py", "-E", r"^\s*(from|import) conftest\b", "tests"],
                          cwd=REPO, capture_output=True, text=True)
    assert hits.stdout == "", hits.stdout
