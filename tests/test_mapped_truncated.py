"""A checkpoint truncated by another program while dlrm reads it memory-mapped (`dlrm.mapped_load.reading`): its pages
past the new end raised SIGBUS when touched, and the process died ("Bus error", exit 135 in a shell, -7 here) without a
line naming the file. Now one ERROR line naming the file, exit 2, no output (no export, no OUT nor its temporary).

Each command runs in a subprocess (a SIGBUS would kill the test's own process) whose hook, once the file is mapped and
before its tensors are read, says "mapped" on stdout and waits for a line on stdin: the test truncates the file in
between, as another program would (`truncate -s`, `cp small.pt over it`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dlrm.distributed import checkpoint as dist_ckpt
from tests.conftest import CHILD_ENV
from tests.test_audit_checkpoint_files import save_sharded, tiny_state
from tests.test_mapped_load_changes import run as two_step_run  # noqa: F401 - a fixture: config, checkpoints



def _driver(target: str, when: str, command: str) -> str:
    """A script that replaces `target` (``module:attribute.path``) with a wrapper handing off to the test `when`
    ("before" or "after") the real call, then runs `command`."""
    module, attrs = target.split(":")
    *owner, name = attrs.split(".")
    return textwrap.dedent(f"""
        import functools, importlib, sys
        owner = functools.reduce(getattr, {owner!r}, importlib.import_module({module!r}))
        real = getattr(owner, {name!r})

        def hand_off():
            print("mapped", flush=True)
            sys.stdin.readline()

        def wrapper(*a, **k):
            if {when!r} == "before":
                hand_off()
            result = real(*a, **k)
            if {when!r} == "after":
                hand_off()
            return result

        setattr(owner, {name!r}, wrapper)
        {command}
    """)


def _truncated_during(script: str, args: list[str], cwd: Path, cut) -> subprocess.CompletedProcess:
    """Run `script` with `args`; at its hand-off call `cut` (which changes the file), then let it go on."""
    env = {**CHILD_ENV, "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=cwd, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    if line.strip() == "mapped":
        cut()
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out, err = proc.communicate(timeout=300)
    assert line.strip() == "mapped", (proc.returncode, err[-3000:])  # (the file was mapped, then cut)
    return subprocess.CompletedProcess(proc.args, proc.returncode, line + out, err)


def _one_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


CLI = "from dlrm import cli; sys.argv[0] = 'train.py'; cli.main()"
MERGE = "from dlrm.distributed import merge; merge.main()"


def test_eval_only_of_a_checkpoint_truncated_while_mapped_names_it(tmp_path, two_step_run):
    config, first, _ = two_step_run
    script = _driver("dlrm.train.export:build_model", "before", CLI)
    result = _truncated_during(script, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--eval-only",
                                        "--checkpoint", str(first)], tmp_path, lambda: os.truncate(first, 0))
    _one_error(result, f"{first}: changed while it was read (truncated", "read it again once it is complete")


def test_export_of_a_checkpoint_replaced_by_a_shorter_file_names_it_and_writes_nothing(tmp_path, two_step_run):
    config, first, _ = two_step_run
    out = tmp_path / "m.pt2"
    script = _driver("dlrm.train.export:build_model", "before", CLI)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 100)

    def cp_small():  # as cp does: the same file, truncated and written
        with open(small, "rb") as src, open(first, "r+b") as dst:
            dst.truncate(0)
            dst.write(src.read())

    result = _truncated_during(script, ["--config", str(config), "--checkpoint", str(first), "--export", str(out)],
                               tmp_path, cp_small)
    _one_error(result, f"{first}: changed while it was read")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".m.pt2")]


def test_a_resume_from_a_checkpoint_truncated_during_the_restore_names_it(tmp_path, two_step_run):
    config, first, _ = two_step_run
    script = _driver("dlrm.train.checkpointer:dist_ckpt.load_for_rank", "after", CLI)
    result = _truncated_during(script, ["--config", str(config), "--tb-dir", str(tmp_path / "tb"), "--run-name",
                                        "r2", "--resume", str(first), "--max-steps", "3"], tmp_path,
                               lambda: os.truncate(first, 0))
    _one_error(result, f"{first}: changed while it was read")


def test_a_merge_whose_shard_is_truncated_names_it_and_leaves_no_out(tmp_path):
    manifest = save_sharded(tmp_path / "run", tiny_state(step=3))
    shard = manifest.parent / dist_ckpt.shard_name(3, 0, 2)
    out = tmp_path / "m.pt"
    script = _driver("dlrm.distributed.merge:write_atomic", "before", MERGE)
    result = _truncated_during(script, [str(manifest), str(out)], tmp_path, lambda: os.truncate(shard, 0))
    _one_error(result, f"{shard}: changed while it was read")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".m.pt")]


def test_a_mapped_file_truncated_outside_a_read_still_dies_of_sigbus(tmp_path):
    """The handler takes only the faults of the files a `reading` reads: another (here a file mapped outside one, read
    after the phase) keeps SIGBUS's previous action, not zeros read as data."""
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(1 << 16)}, path)
    script = textwrap.dedent(f"""
        import os, sys
        from dlrm.mapped_load import load_mapped, reading
        with reading([{str(path)!r}]):
            pass
        state = load_mapped({str(path)!r}, [])
        os.truncate({str(path)!r}, 0)
        print(float(state["w"].sum()))
    """)
    result = subprocess.run([sys.executable, "-c", script], env=CHILD_ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -7, (result.returncode, result.stdout, result.stderr[-2000:])  # SIGBUS


@pytest.mark.parametrize("threads", [1, 2])
def test_a_read_inside_reading_gets_zeros_past_the_end_and_the_error(tmp_path, threads):
    """In-process: a copy (one thread or torch's parallel one) of a tensor truncated away reads zeros and the phase
    ends in the one-line error; the data read before the cut is the file's."""
    from dlrm.errors import ConfigError
    from dlrm.mapped_load import load_mapped, reading

    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(1 << 20)}, path)  # 4 MiB: torch copies it in parallel
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(ConfigError) as e:
            with reading([path]):
                w = load_mapped(str(path), [])["w"]
                size = path.stat().st_size
                os.truncate(path, size // 2)
                copy = w.clone()
    finally:
        torch.set_num_threads(before)
    assert str(e.value).startswith(f"{path}: changed while it was read") and "\n" not in str(e.value)
    assert copy[:1000].eq(1).all() and copy[-1000:].eq(0).all()
