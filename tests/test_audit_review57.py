"""Review of the concurrency, checkpoint and option changes of this session (audit review 57)."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest

from dlrm.config import ConfigError
from dlrm.data.output_dirs import dataset_read_lock, lock_name


# -- 1. the last reader of a dataset leaving as another run starts ---------------------------------------------------

def test_a_run_starting_as_the_last_reader_leaves_is_not_refused(tmp_path, monkeypatch):
    """The last reader of a dataset takes its lock file exclusively for a moment, to remove it. A run that started in
    that moment (a second training run, a sweep's or a benchmark's next process on the same data) was refused with
    "data.path D: being written by pid N on HOST, a run reading it ...; wait for it to finish": no tool was writing
    the dataset, and the process it named was a reader that had just finished."""
    data = tmp_path / "D"
    data.mkdir()
    lock = data.parent / lock_name(data)
    real_unlink = pathlib.Path.unlink
    outcome: dict[str, object] = {}
    started = threading.Event()

    def second_run() -> None:
        started.set()
        try:
            with dataset_read_lock(data, "data.path", ConfigError):
                outcome["read"] = True
        except ConfigError as e:
            outcome["refused"] = str(e)

    def unlink(self, *args, **kwargs):  # the first reader removes its lock file, holding it exclusively
        if self == lock and "thread" not in outcome:
            outcome["thread"] = threading.Thread(target=second_run)
            outcome["thread"].start()
            started.wait()
            time.sleep(0.3)  # the second run tries while the first one holds the file
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    with dataset_read_lock(data, "data.path", ConfigError):
        assert lock.is_file()
    outcome["thread"].join(10)
    assert "refused" not in outcome, outcome["refused"]
    assert outcome.get("read") is True
    assert not lock.exists()  # the second run, the last one now, removed it


# -- 2. relayout read its --data's metadata before holding it ---------------------------------------------------------

def test_relayout_holds_its_data_from_before_it_reads_the_metadata(tmp_path, monkeypatch):
    """relayout read --data's metadata.json (and its vocabularies, seconds for a large one) and only then took its
    read lock: a generator's --overwrite in between (here another dataset, of the "tiny" table sizes) was let through,
    and the copy got the new dataset's files under the old dataset's metadata (its table sizes and positive counts),
    exit 0. The writer is refused now, and the copy is the dataset that relayout read."""
    import click

    from dlrm.data import relayout as relayout_mod
    from dlrm.data.schema import read_metadata
    from dlrm.data.synthetic import generate

    data = tmp_path / "D"
    generate(data, rows=600, seed=1)
    refusals = []
    real_check_apart = relayout_mod.check_apart

    def check_apart_while_the_data_is_replaced(*args, **kwargs):
        try:  # (another process, in the test this one)
            generate(data, rows=600, seed=2, cardinalities="tiny", overwrite=True)
        except click.ClickException as e:
            refusals.append(e.format_message())
        return real_check_apart(*args, **kwargs)

    monkeypatch.setattr(relayout_mod, "check_apart", check_apart_while_the_data_is_replaced)
    copied = relayout_mod.relayout(data, tmp_path / "copy", "lists")
    source = read_metadata(data)
    assert copied.cardinalities == source.cardinalities  # was: [300, 200, 4000, ...] for files of [30, 20, 400, ...]
    assert read_metadata(tmp_path / "copy").cardinalities == source.cardinalities
    assert len(refusals) == 1 and f"in use by pid {os.getpid()} on " in refusals[0], refusals
    assert not (tmp_path / lock_name(data)).exists()


# -- 3. a bare --export's accepted values, accepted for every option ---------------------------------------------------

def test_a_bare_export_refuses_run_name_torch_as_any_run_name(tmp_path):
    """--checkpoint C --export M refuses --run-name (no run directory is written). Accepting --no-compile and --kernels
    torch (what the export does) let any of those options through with the value "torch" or false: `--run-name torch`
    was ignored without a word, where `--run-name other` is refused. --no-compile and --kernels torch stay accepted."""
    from dlrm.cli import check_modes

    def check(overrides):
        check_modes(eval_only=False, compare=None, resume=None, export_path=str(tmp_path / "m.pt2"),
                    checkpoint_path=str(tmp_path / "c.pt"), allowed_changes=[], overrides=overrides)

    for name in ("other", "torch"):
        with pytest.raises(ConfigError) as e:  # was: "torch" accepted
            check({"log.run_name": name})
        assert str(e.value).startswith("--run-name: acts only on an evaluation or a training run")
    check({"train.compile.enabled": False, **{f"kernels.{k}": "torch" for k in ("embedding", "interaction", "mlp",
                                                                                   "loss")}})
    with pytest.raises(ConfigError, match="^--kernels: acts only on"):
        check({f"kernels.{k}": "triton" for k in ("embedding", "interaction", "mlp", "loss")})
