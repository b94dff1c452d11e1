"""Config errors fail before any work with one line naming the key path and the value."""

import json
import re
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
    from dlrm.data.schema import KAGGLE_CARDINALITIES

    assert kaggle.model.cardinalities == KAGGLE_CARDINALITIES  # the one list in code, the same in the config file
    tb = load_config(REPO / "configs/terabyte.json")
    assert (tb.model.embedding_dim, tb.model.bottom_mlp, tb.model.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    # dataset tables as MLPerf caps them (40M); the model caps them again so fp32 fits 80 GB
    assert max(tb.model.cardinalities) == 40_000_000 and tb.data.max_rows_per_table == 10_000_000
    # the top-MLP input padded to aligned widths (367 -> 368, 479 -> 480), as NVIDIA's DLRM pads it
    assert kaggle.model.top_mlp_input_multiple == tb.model.top_mlp_input_multiple == 8


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
    ({"model": {"top_mlp_input_multiple": 0}}, r"model.top_mlp_input_multiple: 0 must be > 0"),
    ({"model": {"bottom_mlp_input_multiple": -8}}, r"model.bottom_mlp_input_multiple: -8 must be > 0"),
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
    ({"kernels": {"mlp": "cuda"}}, r"kernels.mlp: 'cuda' is not one of 'auto' \| 'torch' \| 'triton'"),
    ({"log": {"run_name": "a/b"}}, r"log.run_name: 'a/b' must be a plain directory name"),
    ({"distributed": {"sharding": "rows"}}, r"distributed.sharding: 'rows' is not one of 'auto' \| 'table' \| 'row'"),
    ({"distributed": {"row_wise_min_rows": 0}}, r"distributed.row_wise_min_rows: 0 must be > 0"),
    ({"distributed": {"balance": "memory"}}, r"distributed.balance: 'memory' is not one of 'cost' \| 'lookups' \| 'rows'"),
    ({"distributed": {"backend": "mpi"}}, r"distributed.backend: 'mpi' is not one of"),
    ({"optim": {"dense": {"fused": "yes"}}}, r"optim.dense.fused: expected"),
    # issue #17: values that used to fail only later, or with a traceback
    ({"train": {"seed": -1}}, r"train.seed: -1 must be within \[0, 2\*\*63\)"),
    ({"train": {"seed": 2**63}}, r"train.seed: 9223372036854775808 is out of range \(integers must fit in int64\)"),
    ({"data": {"batch_size": 10**5000}}, r"data.batch_size: <integer of about 5001 digits> is out of range"),
    ({"data": {"batch_size": 2**31}}, r"data.batch_size: 2147483648 must be <= 2147483647"),
    ({"model": {"interaction": "cat", "bottom_mlp": [64, 8]}},
     r"model.bottom_mlp\[-1\]: 8 must equal model.embedding_dim \(16\) for the cat interaction"),
    ({"optim": {"dense": {"lr": 1e39}}}, r"optim.dense.lr: 1e\+39 overflows float32"),
    ({"optim": {"dense": {"weight_decay": -1e39}}}, r"optim.dense.weight_decay: -1e\+39 overflows float32"),
    ({"optim": {"sparse": {"lr": 10**40}}}, r"optim.sparse.lr: 1e\+40 overflows float32"),
    ({"optim": {"dense": {"eps": 1e-50}}}, r"optim.dense.eps: 1e-50 underflows to 0 in float32"),
    ({"data": {"path": "a\x00b"}}, r"data.path: 'a\\x00b' must not contain a NUL character"),
    ({"log": {"tb_dir": "\ud800"}}, r"log.tb_dir: '\\ud800' is not valid Unicode text"),
    ({"data": {"batch_size": [[[[1]]]]}}, r"data.batch_size: expected an integer, got \[\[\[\[1\]\]\]\]"),
]


@pytest.mark.parametrize("raw,pattern", BAD)
def test_bad_values_name_their_key(raw, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        config_from_dict(raw, "x.json")
    message = str(err.value)
    assert message.startswith("x.json: ") and "\n" not in message


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.json: config file not found") as err:
        load_config(tmp_path / "nope.json")
    assert str(err.value).startswith(f"{tmp_path / 'nope.json'}: ")  # the path as given, first
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": {"batch_size": 3,}}')
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 1"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"bad.json: the top level must be a JSON object"):
        load_config(bad)


@pytest.mark.parametrize("content, pattern", [
    (b'{"name": "caf\xe9"}', r"f.json: not UTF-8 text \(byte 0xe9 at line 1 column 14\)"),
    (b'{\n  "a": 1,\n\x80}', r"f.json: not UTF-8 text \(byte 0x80 at line 3 column 1\)"),
    (b"[" * 100_000 + b"]" * 100_000, r"f.json: invalid config: JSON nested too deeply"),
    (b'{"train": {"seed": ' + b"1" * 5000 + b"}}", r"f.json: train.seed: <integer of 5000 digits> is out of range"),
    (b'{"optim": {"dense": {"lr": ' + b"1" * 5000 + b"}}}", r"f.json: optim.dense.lr: <integer of 5000 digits> overflows"),
    (b'{"optim": {"dense": {"lr": 1e400}}}', r"f.json: optim.dense.lr: inf must be a finite number"),
    (b'{"optim": {"dense": {"lr": NaN}}}', r"f.json: optim.dense.lr: nan must be a finite number"),
    (b'{"optim": {"dense": {"momentum": -Infinity}}}', r"f.json: optim.dense.momentum: -inf must be a finite number"),
    (b'{"data": {"batch_size": 4}, "data": {"batch_size": 8}}', r"f.json: key 'data' appears twice in one object"),
    (b'{"data": {"batch_size": 4, "batch_size": 8}}', r"f.json: key 'batch_size' appears twice in one object"),
])
def test_hostile_files_are_one_line_config_errors(tmp_path, content, pattern):
    path = tmp_path / "f.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=pattern) as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"data": {"batch_size": 8}}).encode())
    assert load_config(path).data.batch_size == 8


def test_oversized_or_unreadable_config_file(tmp_path, monkeypatch):
    import dlrm.config as config

    path = tmp_path / "big.json"
    path.write_text(json.dumps({"name": "x" * 200}))
    monkeypatch.setattr(config, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(ConfigError, match=r"big.json: 2\d\d bytes is too large for a config file"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"config file not found \(or not a regular file\)") as err:
        load_config(tmp_path)
    assert str(err.value).startswith(f"{tmp_path}: ")  # names the directory given as the config


def test_config_keys_are_the_dotted_keys_of_the_dataclasses():
    from dlrm.config import config_keys

    keys = config_keys()
    assert {"data.batch_size", "optim.dense.lr", "optim.dense", "optim", "train.compile.mode", "profile.wait",
            "name", "train.seed"} <= keys
    assert "data.batch_sise" not in keys and "train.compile.enabled.x" not in keys


def test_seed_limits_are_inclusive_where_they_should_be():
    assert config_from_dict({"train": {"seed": 0}}).train.seed == 0
    assert config_from_dict({"train": {"seed": 2**63 - 1}}).train.seed == 2**63 - 1
    assert config_from_dict({"optim": {"dense": {"lr": 3.4e38, "eps": 1.5e-45}}}).optim.dense.lr == 3.4e38
    cat = config_from_dict({"model": {"interaction": "cat", "embedding_dim": 8, "bottom_mlp": [32, 8]}})
    assert cat.model.interaction == "cat"


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
    assert cfg.train.compile.enabled and cfg.train.compile.mode == "auto"  # resolved by dlrm.train.fast_path
    assert "train.compile.enabled" not in _overrides(batch_size=8)
    with pytest.raises(ConfigError, match="contradicts --no-compile"):
        _overrides(compile_=False, compile_mode="max-autotune")


def test_cli_compile_mode_contradiction_is_one_line(tmp_path):
    res = run_cli("--config", str(REPO / "configs/sample.json"), "--compile-mode", "reduce-overhead", "--no-compile",
                  "--tb-dir", str(tmp_path / "tb"), cwd=tmp_path)
    errors = [line for line in res.stderr.splitlines() if "ERROR" in line]
    assert res.returncode == 2 and len(errors) == 1 and "contradicts --no-compile" in errors[0]
    assert not (tmp_path / "tb").exists()


def test_a_bad_override_is_blamed_on_the_command_line_not_the_file(tmp_path):
    """train.py's --max-steps, --batch-size, --run-name... reach load_config as overrides: an error in one of them
    names the command line; an error in the file still names the file."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"max_steps": 5}}))
    with pytest.raises(ConfigError, match=r"^command line: train.max_steps: -1 must be > 0$"):
        load_config(path, {"train.max_steps": -1})
    path.write_text(json.dumps({"train": {"max_steps": -1}}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: train.max_steps: -1 must be > 0$"):
        load_config(path, {"data.batch_size": 8})


def test_a_section_override_replaces_the_files_section(tmp_path):
    """README (sweeps): `--set 'optim.dense={...}'` replaces the file's section; the keys the object leaves out take
    their defaults, not the file's values, while a dotted key keeps the rest of the file's section."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"optim": {"dense": {"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}}}))
    default = Config().optim.dense
    whole = load_config(path, {"optim.dense": {"name": "sgd", "lr": 0.1}}).optim.dense
    assert (whole.lr, whole.momentum, whole.weight_decay) == (0.1, default.momentum, default.weight_decay)
    one = load_config(path, {"optim.dense.lr": 0.1}).optim.dense
    assert (one.lr, one.momentum, one.weight_decay) == (0.1, 0.9, 0.01)
