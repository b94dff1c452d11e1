"""tests/conftest.py's collection hook: tests marked `gpu` skip without CUDA ("needs CUDA") and run with it."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["pytester"]

# A marked test, an unmarked one, and an unmarked test whose parameter id is "gpu" (a keyword, not the marker).
TESTS = """
import pytest

@pytest.mark.gpu
def test_marked():
    pass

def test_plain():
    pass

@pytest.mark.parametrize("placement", ["gpu"])
def test_param_named_gpu(placement):
    pass
"""


@pytest.fixture
def run_hook(pytester):
    """Run `TESTS` in a scratch pytest session whose conftest is the project's hook; returns the result."""
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makepyfile(test_sample=TESTS)
    return lambda: pytester.runpytest_inprocess("-rs")


def test_marked_tests_skip_without_cuda(run_hook, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_hook()
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * test_sample.py:*: needs CUDA"])


def test_marked_tests_run_with_cuda(run_hook, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the hook asks only this
    run_hook().assert_outcomes(passed=3)


def test_processes_started_by_tests_dump_python_tracebacks_on_an_abort():
    """tests/conftest.py sets PYTHONFAULTHANDLER for every process a test starts: an abort in C++ (SIGABRT, as a
    rank's "terminate called without an active exception") prints where each Python thread was."""
    import subprocess
    import sys

    code = "import os\ndef where_it_aborted():\n    os.abort()\nwhere_it_aborted()\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "Fatal Python error: Aborted" in result.stderr and "where_it_aborted" in result.stderr, result.stderr


def test_process_output_leads_with_the_abort_report_a_long_tail_would_push_out():
    """A rank's abort: faulthandler's report, then thousands of characters (the extension-module list, torchrun's
    traceback) in the stderr tail. The assertion message keeps the report and shortens the list."""
    import subprocess
    import sys

    from tests.conftest import process_output

    code = "import os\ndef where_it_aborted():\n    os.abort()\nwhere_it_aborted()\n"
    aborted = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    modules = "\nExtension modules: " + ", ".join(f"pandas._libs.m{i}" for i in range(400)) + " (total: 400)\n"
    noise = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError\n" * 100
    result = subprocess.CompletedProcess(aborted.args, 1, "stdout line\n", aborted.stderr + modules + noise)
    message = process_output(result)
    assert "Fatal Python error: Aborted" not in result.stderr[-3000:]  # what a plain tail would have shown
    assert message.index("Fatal Python error: Aborted") < message.index("where_it_aborted") < message.index("stdout")
    assert "pandas._libs.m399" not in message and message.endswith(noise[-3000:])
    short = subprocess.CompletedProcess(aborted.args, 1, "", aborted.stderr + modules + "the last line\n")
    assert "pandas._libs" not in process_output(short)  # the list shortened in the tail too
    assert process_output(short).endswith("Extension modules: (list left out)\nthe last line\n")
    clean = subprocess.CompletedProcess(["x"], 1, "out", "err")
    assert process_output(clean) == "outerr"  # nothing to lead with when no process aborted
