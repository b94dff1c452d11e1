"""Config errors fail before any work with one line naming the key path and the value."""

import json
import subprocess
import sys

import pytest

from dlrm.config import Config, ConfigError, config_from_dict, load_config
from tests.conftest import REPO


@pytest.mark.parametrize("name", ["sample", "kaggle", "terabyte"])
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "configs" / f"{name}.json")
    assert isinstance(cfg, Config) and cfg.name == name
    assert cfg.model.top_mlp[-1] == 1


def test_published_architectures():
    kaggle = load_config(REPO / "configs/kaggle.json")
    assert (kaggle.model.embedding_dim, kaggle.model.bottom_mlp, kaggle.model.top_mlp) == (16, [512, 256, 64, 16], [512, 256, 1])
    assert kaggle.optim.dense.name == kaggle.optim.sparse.name == "sgd" and kaggle.optim.dense.lr == 0.1
    assert len(kaggle.model.cardinalities) == 26 and max(kaggle.model.cardinalities) == 10131227
    tb = load_config(REPO / "configs/terabyte.json")
    assert (tb.model.embedding_dim, tb.model.bottom_mlp, tb.model.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    # dataset tables as MLPerf caps them (40M); the model caps them again so fp32 fits 80 GB
    assert max(tb.model.cardinalities) == 40_000_000 and tb.data.max_rows_per_table == 10_000_000


BAD = [
    ({"data": {"batch_sise": 3}}, r"data.batch_sise: unknown key"),
    ({"bogus": 1}, r"bogus: unknown key"),
    ({"data": {"batch_size": "64"}}, r"data.batch_size: expected an integer, got '64'"),
    ({"data": {"batch_size": 0}}, r"data.batch_size: 0 must be > 0"),
    ({"data": {"batch_size": True}}, r"data.batch_size: expected an integer, got True"),
    ({"data": 5}, r"data: expected an object, got 5"),
    ({"model": {"interaction": "cross"}}, r"model.interaction: 'cross' is not one of 'dot' \| 'cat'"),
    ({"model": {"bottom_mlp": [64, 8]}}, r"model.bottom_mlp\[-1\]: 8 must equal model.embedding_dim \(16\)"),
    ({"model": {"bottom_mlp": [64, -16]}}, r"model.bottom_mlp\[1\]: -16 must be > 0"),
    ({"model": {"top_mlp": [64, 2]}}, r"model.top_mlp\[-1\]: 2 must be 1"),
    ({"model": {"top_mlp": []}}, r"model.top_mlp: must list at least one"),
    ({"model": {"cardinalities": [3] * 25}}, r"model.cardinalities: has 25 entries, expected 26"),
    ({"model": {"cardinalities": [3] * 25 + ["x"]}}, r"model.cardinalities\[25\]: expected an integer, got 'x'"),
    ({"optim": {"dense": {"lr": -1.0}}}, r"optim.dense.lr: -1.0 must be > 0"),
    ({"optim": {"dense": {"lr": float("nan")}}}, r"optim.dense.lr: nan must be a finite number"),
    ({"optim": {"sparse": {"eps": float("inf")}}}, r"optim.sparse.eps: inf must be a finite number"),
    ({"optim": {"dense": {"name": "lamb"}}}, r"optim.dense.name: 'lamb' is not one of"),
    ({"optim": {"sparse": {"name": "adam"}}}, r"optim.sparse.name: 'adam' is not one of"),
    ({"optim": {"schedule": {"end_factor": 2}}}, r"optim.schedule.end_factor: 2.0 must be within \[0, 1\]"),
    ({"train": {"precision": "fp16"}}, r"train.precision: 'fp16' is not one of 'fp32' \| 'tf32' \| 'bf16'"),
    ({"train": {"device": "tpu"}}, r"train.device: 'tpu' is not one of"),
    ({"train": {"max_steps": 0}}, r"train.max_steps: 0 must be > 0"),
    ({"train": {"epochs": 1.5}}, r"train.epochs: expected an integer, got 1.5"),
    ({"kernels": {"mlp": "cuda"}}, r"kernels.mlp: 'cuda' is not one of 'torch' \| 'triton'"),
    ({"log": {"run_name": "a/b"}}, r"log.run_name: 'a/b' must be a plain directory name"),
    ({"distributed": {"sharding": "rows"}}, r"distributed.sharding: 'rows' is not one of 'auto' \| 'table' \| 'row'"),
    ({"distributed": {"row_wise_min_rows": 0}}, r"distributed.row_wise_min_rows: 0 must be > 0"),
    ({"distributed": {"backend": "mpi"}}, r"distributed.backend: 'mpi' is not one of"),
    ({"optim": {"dense": {"fused": "yes"}}}, r"optim.dense.fused: expected"),
]


@pytest.mark.parametrize("raw,pattern", BAD)
def test_bad_values_name_their_key(raw, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        config_from_dict(raw, "x.json")
    message = str(err.value)
    assert message.startswith("x.json: ") and "\n" not in message


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": {"batch_size": 3,}}')
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 1"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_config(bad)


def test_overrides_are_validated_like_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"data": {"batch_size": 8}}))
    assert load_config(path, {"data.batch_size": 16}).data.batch_size == 16
    with pytest.raises(ConfigError, match=r"data.batch_size: -2 must be > 0"):
        load_config(path, {"data.batch_size": -2})


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_cli_bad_config_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"precision": "fp8"}}))
    res = run_cli("--config", str(path), "--tb-dir", str(tmp_path / "tb"), cwd=tmp_path)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "train.precision: 'fp8'" in errors[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "tb").exists()


def test_cli_missing_dataset_is_named(tmp_path):
    res = run_cli("--config", str(REPO / "configs/sample.json"), "--data", str(tmp_path / "absent"),
                  "--tb-dir", str(tmp_path / "tb"), cwd=tmp_path)
    assert res.returncode == 2 and "data.path:" in res.stderr and "absent" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("precision,tf32", [("tf32", True), ("fp32", False), ("bf16", False)])
def test_precision_sets_tf32_for_cublas_and_triton(precision, tf32):
    """precision "tf32" turns TF32 matmuls on, the others turn it off; the Triton linear kernel
    reads the same switch as cuBLAS."""
    from dlrm.train.step import set_matmul_precision
    from kernels.linear import _default_allow_tf32

    cfg = config_from_dict({"train": {"precision": precision}})
    set_matmul_precision("tf32" if not tf32 else "fp32")  # start from the opposite
    try:
        set_matmul_precision(cfg.train.precision)
        assert _default_allow_tf32() is tf32
    finally:
        set_matmul_precision("fp32")


def _overrides(**given):
    from dlrm.cli import cli_overrides

    names = ("data", "device", "batch_size", "epochs", "max_steps", "seed", "run_name", "tb_dir", "checkpoint_every",
             "split", "compile_", "compile_mode", "profile", "kernels")
    return cli_overrides(**{n: given.get(n) for n in names})


def test_cli_compile_mode_implies_compile_and_sets_the_mode():
    cfg = load_config(REPO / "configs/kaggle.json", _overrides(compile_mode="reduce-overhead"))
    assert cfg.train.compile.enabled and cfg.train.compile.mode == "reduce-overhead"
    cfg = load_config(REPO / "configs/kaggle.json", _overrides(compile_=True))
    assert cfg.train.compile.enabled and cfg.train.compile.mode == "default"
    assert "train.compile.enabled" not in _overrides(batch_size=8)
    with pytest.raises(ConfigError, match="contradicts --no-compile"):
        _overrides(compile_=False, compile_mode="max-autotune")


def test_cli_compile_mode_contradiction_is_one_line(tmp_path):
    res = run_cli("--config", str(REPO / "configs/sample.json"), "--compile-mode", "reduce-overhead", "--no-compile",
                  "--tb-dir", str(tmp_path / "tb"), cwd=tmp_path)
    errors = [line for line in res.stderr.splitlines() if "ERROR" in line]
    assert res.returncode == 2 and len(errors) == 1 and "contradicts --no-compile" in errors[0]
    assert not (tmp_path / "tb").exists()
