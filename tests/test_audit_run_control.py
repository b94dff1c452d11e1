"""Audit of dlrm/train/resume_policy.py and dlrm/train/run_dir.py without training: every config key is
classified (trajectory keys refused on --resume, observation keys free, length keys logged), an allowed
key does not allow its longer-named siblings, a released lock leaves no stale holder behind, and a
failed start removes only a directory this process created (never a resumed run's, nor one that
already existed)."""

from __future__ import annotations

import copy

import pytest
from loguru import logger

from dlrm.checkpoint import fixed_model_keys
from dlrm.config import ConfigError, config_from_dict
from dlrm.train.resume_policy import _flatten, check_resume_config
from dlrm.train.run_dir import LOCK_NAME, RunDirectory, RunLock

# Keys whose change on a resume changes the training trajectory: refused unless allowed.
TRAJECTORY = ("model.", "optim.", "data.batch_size", "data.drop_last", "data.max_rows_per_table", "data.path",
              "data.shuffle", "data.shuffle_buffer_rows", "train.seed", "train.deterministic", "train.precision",
              "train.early_stopping")
# Keys that change how the run is observed or executed only: free.
OBSERVATION = ("log.", "checkpoint.", "profile", "kernels.", "name", "distributed.", "train.log_every",
               "train.eval_every", "train.compile", "train.cuda_graph", "train.device", "train.baseline", "train.allow_swap",
               "train.check_host_memory", "data.prefetch", "data.placement", "data.gpu_memory_share", "data.eval_batch_size", "data.eval_split")
LENGTH = ("train.epochs", "train.max_steps", "train.min_steps")
# Keys a run takes from its dataset, recorded as trained (`dlrm.train.setup.as_trained`): free (the restore compares
# the checkpoint's own table sizes with the data's).
DATASET = ("model.cardinalities", "model.multi_hot_sizes")


def _matches(key: str, names) -> bool:
    return any(key.startswith(n) if n.endswith(".") else (key == n or key.startswith(n + ".")) for n in names)


def _base() -> dict:
    return config_from_dict({"log": {"tb_dir": "/nonexistent/tb", "run_name": "r"}}).to_dict()


def _changed(saved: dict, key: str) -> dict:
    current = copy.deepcopy(saved)
    *parents, leaf = key.split(".")
    node = current
    for p in parents:
        node = node[p]
    node[leaf] = ["changed", node[leaf]]  # differs from any value the key can hold
    return current


def _keys() -> list[str]:
    return sorted(_flatten(_base()))


@pytest.mark.parametrize("key", _keys())
def test_each_config_key_has_its_resume_rule(key):
    kinds = [_matches(key, TRAJECTORY) and not _matches(key, DATASET), _matches(key, OBSERVATION) or
             _matches(key, DATASET), _matches(key, LENGTH)]
    assert sum(kinds) == 1, f"{key}: classify it here (trajectory, observation, dataset or length)"
    saved = _base()
    current = _changed(saved, key)
    if kinds[0]:
        # a model key the checkpoint's tensors fix: named, not advised for the flag (test_resume_fixed_model_keys.py)
        fixed = key.removeprefix("model.") in fixed_model_keys(saved["model"])
        with pytest.raises(ConfigError, match=rf"\({key}: fixed by the checkpoint, .*\)$" if fixed
                           else f"--allow-config-change {key}$"):
            check_resume_config(saved, current, [], "ckpt.pt")
        check_resume_config(saved, current, [key], "ckpt.pt")  # named: allowed
    else:
        check_resume_config(saved, current, [], "ckpt.pt")


def test_an_allowed_key_does_not_allow_a_sibling_whose_name_extends_it():
    saved = _base()
    current = _changed(saved, "data.shuffle_buffer_rows")
    with pytest.raises(ConfigError, match="--allow-config-change data.shuffle_buffer_rows$"):
        check_resume_config(saved, current, ["data.shuffle"], "ckpt.pt")
    current = _changed(saved, "optim.dense.lr")
    with pytest.raises(ConfigError, match="--allow-config-change optim.dense.lr$"):
        check_resume_config(saved, current, ["optim.dense.l"], "ckpt.pt")
    check_resume_config(saved, current, ["optim.dense"], "ckpt.pt")  # a whole section by its dotted prefix


def test_a_released_lock_leaves_no_stale_holder(tmp_path):
    seen = []
    handle = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        RunLock.acquire(tmp_path).release()
        assert (tmp_path / LOCK_NAME).read_text() == ""
        lock = RunLock.acquire(tmp_path)
    finally:
        logger.remove(handle)
    lock.release()
    assert not any("stale lock" in m for m in seen), seen


def _cfg(tmp_path, run_name):
    return config_from_dict({"log": {"tb_dir": str(tmp_path / "tb"), "run_name": run_name}})


def test_failed_start_in_a_directory_that_already_existed_keeps_it(tmp_path):
    path = tmp_path / "tb" / "mine"
    path.mkdir(parents=True)  # the user's own (empty) directory: not this process's to delete
    run = RunDirectory.create(_cfg(tmp_path, "mine"))
    run.abandon()
    assert path.is_dir()


def test_failed_start_in_a_new_directory_removes_it_and_one_that_trained_is_kept(tmp_path):
    with pytest.raises(RuntimeError):
        with RunDirectory.create(_cfg(tmp_path, "fresh")):
            raise RuntimeError("fails before the first step")
    assert not (tmp_path / "tb" / "fresh").exists()
    with pytest.raises(RuntimeError):
        with RunDirectory.create(_cfg(tmp_path, "trained")) as run:
            run.started()
            raise RuntimeError("fails after the first step")
    assert (tmp_path / "tb" / "trained" / "config.json").is_file()
    RunLock.acquire(tmp_path / "tb" / "trained").release()  # its lock was released


def test_failed_resume_before_its_first_step_keeps_the_run_it_resumes(tmp_path):
    run_path = tmp_path / "tb" / "victim"
    (run_path / "checkpoints").mkdir(parents=True)
    checkpoint = run_path / "checkpoints" / "step-00000005.pt"
    checkpoint.write_bytes(b"weights")
    (run_path / "config.json").write_text("{}")
    for name in ("victim", None):  # --run-name naming the run, or none
        run, copied = RunDirectory.for_resume(_cfg(tmp_path, name), checkpoint, checkpoint)
        assert not copied and run.path == run_path
        run.abandon()  # e.g. the checkpoint fails to restore
        assert checkpoint.read_bytes() == b"weights" and (run_path / "config.json").read_text() == "{}"
    with RunDirectory.for_resume(_cfg(tmp_path, "victim"), checkpoint, checkpoint)[0]:
        pass  # and the lock was released each time


def test_a_key_missing_on_one_side_is_a_change():
    """A checkpoint written before a key existed (or a run whose config lacks one the checkpoint has): the key's
    value is a change like any other, so a trajectory key set now is refused, not passed over."""
    saved, current = _base(), _base()
    del saved["optim"]["sparse"]["weight_decay"]
    current["optim"]["sparse"]["weight_decay"] = 0.3
    with pytest.raises(ConfigError, match=r"optim.sparse.weight_decay: \(absent\) -> 0.3.*--allow-config-change "
                                          r"optim.sparse.weight_decay$"):
        check_resume_config(saved, current, [], "ckpt.pt")
    with pytest.raises(ConfigError, match=r"train.seed: .* -> \(absent\)"):
        check_resume_config(_base(), {**_base(), "train": {k: v for k, v in _base()["train"].items() if k != "seed"}},
                            [], "ckpt.pt")
