"""Audit tests of `dlrm.cli`, `dlrm.config` and `dlrm.config_parse`: exact messages, boundaries, defaults and
option mappings the other config and CLI tests leave open (each found by a mutation that the rest of the suite
let through), and the overrides of a section the file gives in a form its type does not take (a bug fixed here)."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest
from loguru import logger

from dlrm import cli, config
from dlrm.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_config_bytes,
)
from dlrm.errors import DatasetError, NonFiniteLoss, TrainingStopped

DATA_KEYS = ("batch_size, drop_last, eval_batch_size, eval_split, gpu_memory_share, max_rows_per_table, path, "
             "placement, prefetch, shuffle, shuffle_buffer_rows")


def refused(raw) -> str:
    """The one-line message `config_from_dict` refuses `raw` with (source "x.json")."""
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "x.json")
    return str(err.value)


def refused_bytes(data: bytes) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(parse_config_bytes(data, "f.json"), "f.json")
    return str(err.value)


def write(tmp_path: Path, raw) -> Path:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return path


# --- dlrm.config_parse: values and their messages ----------------------------------------------------------------

@pytest.mark.parametrize("text, shown", [
    (b"1" * 40, "1" * 40),  # 40 characters: still converted, shown in full
    (b"1" * 41, "<integer of 41 digits>"),
    (b"-" + b"1" * 60, "<integer of 60 digits>"),  # the sign is not a digit
])
def test_long_json_integers_are_shown_by_digit_count(text, shown):
    """Integers of more than 40 characters are not converted; the message counts their digits exactly."""
    message = refused_bytes(b'{"train": {"seed": ' + text + b"}}")
    assert message == f"f.json: train.seed: {shown} is out of range (integers must fit in int64)"


@pytest.mark.parametrize("value, shown", [
    (10**40, "<integer of about 41 digits>"),  # from 10**40 on, an int is summarised
    (10**40 - 1, "9" * 40),
    ("a" * 78, "'" + "a" * 78 + "'"),  # a repr of exactly 80 characters is shown whole
    ("a" * 79, "'" + "a" * 76 + "..."),  # longer: cut to 80 characters with the ellipsis
])
def test_values_are_shown_in_at_most_80_characters(value, shown):
    assert refused({"data": {"path": value} if isinstance(value, int) else {"batch_size": value}}) == (
        f"x.json: data.path: expected a string, got {shown}" if isinstance(value, int)
        else f"x.json: data.batch_size: expected an integer, got {shown}")


@pytest.mark.parametrize("raw, message", [
    ({"train": {"compile": 5}}, "train.compile: 5 is not true/false or 'auto' or an object"),
    ({"train": {"compile": None}}, "train.compile: None is not true/false or 'auto' or an object"),
    ({"profile": None}, "profile: None is not true/false or an object"),
    ({"train": {"compile": {"mode": "x"}}},  # an object goes to the section, whose message names the inner key
     ("train.compile.mode: 'x' is not one of 'auto' | 'default' | 'reduce-overhead' | 'max-autotune' | "
     "'max-autotune-no-cudagraphs' | 'max-autotune-gemm'")),
    ({"model": {"bottom_mlp": 5}}, "model.bottom_mlp: expected list of int, got 5"),
    ({"data": {"shuffle": 1}}, "data.shuffle: expected true or false, got 1"),
    ({"optim": {"dense": {"lr": True}}}, "optim.dense.lr: expected a number, got True"),
    ({"optim": {"dense": {"lr": 10**400}}}, ("optim.dense.lr: <integer of about 401 digits> overflows float32 "
                                           "(|x| must be <= 3.4e38)")),
    ({"optim": {"dense": {"lr": math.nextafter(config.FLOAT32_MAX, math.inf)}}},
     "optim.dense.lr: 3.402823466385289e+38 overflows float32 (|x| must be <= 3.4e38)"),
    ({"train": {"seed": -(2**63)}}, "train.seed: -9223372036854775808 must be within [0, 2**63)"),  # in int64
    ({"data": {"zz": 1}}, f"data.zz: unknown key (expected one of {DATA_KEYS})"),
    ({"data": {"k" * 80: 1}}, f"data.{'k' * 80}: unknown key (expected one of {DATA_KEYS})"),
    ({"data": {"k" * 81: 1}}, f"data.'{'k' * 76}...: unknown key (expected one of {DATA_KEYS})"),
    ({"data": {"a\nb": 1}}, f"data.'a\\nb': unknown key (expected one of {DATA_KEYS})"),
])
def test_type_errors_are_exact(raw, message):
    """Type names, union fallbacks, the int64 and float32 limits and key display, word for word."""
    assert refused(raw) == f"x.json: {message}"


def test_the_float32_limit_itself_is_accepted():
    assert config_from_dict({"optim": {"dense": {"lr": config.FLOAT32_MAX}}}).optim.dense.lr == config.FLOAT32_MAX


@pytest.mark.parametrize("data, where", [
    (b'{"a": "\xff"}', "line 1 column 8"),
    (b'\xef\xbb\xbf{"a": "\xff"}', "line 1 column 8"),  # the BOM is not part of the text an editor shows
    (b'\xef\xbb\xbf{\n"a": "\xff"}', "line 2 column 7"),
])
def test_a_byte_that_is_not_utf8_is_named_after_a_byte_order_mark_too(data, where):
    """Bug fixed here: decoded with "utf-8-sig", whose error offsets start after the BOM, a file with a BOM was
    reported with the wrong byte (0x3a, the ':' 3 bytes earlier) and a column 3 short on the lines after the first."""
    with pytest.raises(ConfigError) as err:
        parse_config_bytes(data, "f.json")
    assert str(err.value) == f"f.json: not UTF-8 text (byte 0xff at {where})"


@pytest.mark.parametrize("data, message", [
    (b'{"data": {"batch_size": 3,}}', ("invalid JSON at line 1 column 27: Expecting property name enclosed in double "
                                      "quotes")),
    (('{"' + "k" * 81 + '": 1, "' + "k" * 81 + '": 2}').encode(),
     f"key '{'k' * 76}... appears twice in one object (JSON would keep only the last)"),
    (b'{"a\\nb": 1, "a\\nb": 2}', "key 'a\\nb' appears twice in one object (JSON would keep only the last)"),
])
def test_json_errors_name_the_column_and_show_keys_on_one_line(data, message):
    with pytest.raises(ConfigError) as err:
        parse_config_bytes(data, "f.json")
    assert str(err.value) == f"f.json: {message}"


# --- dlrm.config: files, names, defaults -------------------------------------------------------------------------

def test_a_top_level_that_is_not_an_object_is_a_config_error():
    """config_from_dict is public: a list is refused in one line, not an AttributeError."""
    assert refused([1]) == "x.json: the top level must be a JSON object"


def test_size_limit_is_inclusive_and_printed_with_separators(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "MAX_CONFIG_BYTES", 1000)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"name": "x"}).ljust(1000))
    assert load_config(path).name == "x"  # exactly at the limit
    path.write_text(json.dumps({"name": "x"}).ljust(1001))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: 1,001 bytes is too large for a config file (at most 1,000)"


def test_a_config_of_one_mebibyte_loads(tmp_path):
    """The limit is 16 MiB: a large generated config (here 1 MiB of layout) is not refused."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"data": {"batch_size": 8}}).ljust(1 << 20))
    assert load_config(path).data.batch_size == 8


def test_an_unreadable_config_is_one_line(tmp_path, monkeypatch):
    path = write(tmp_path, {})

    def denied(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: cannot read the config file (Permission denied)"


def test_the_name_defaults_to_the_file_stem_but_an_explicit_one_wins(tmp_path):
    assert load_config(write(tmp_path, {})).name == "c"
    assert load_config(write(tmp_path, {"name": "mine"})).name == "mine"


def test_documented_defaults():
    """Defaults the docstrings and README promise (a changed default silently changes every run)."""
    cfg = config.validate(Config())
    assert (cfg.data.batch_size, cfg.data.prefetch, cfg.data.eval_split) == (512, 3, "validation")
    assert (cfg.optim.dense.name, cfg.optim.dense.lr, cfg.optim.sparse.name, cfg.optim.sparse.lr) == (
        "adam", 1e-3, "rowwise_adagrad", 0.05)
    assert (cfg.checkpoint.every, cfg.checkpoint.keep, cfg.train.log_every, cfg.train.epochs) == (None, 3, 50, 1)
    assert config_from_dict({}).to_dict() == cfg.to_dict()  # an empty file means these defaults


# --- overrides ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, overrides, compile_, profile", [
    ({"train": {"compile": False}}, {"train.compile.fullgraph": True}, (False, True), False),  # keeps enabled
    ({"train": {"compile": True}}, {"train.compile.mode": "default"}, (True, False), False),
    ({"train": {"compile": "auto"}}, {"train.compile.mode": "default"}, ("auto", False), False),
    ({"profile": False}, {"profile.enabled": True}, ("auto", False), True),
    ({"train": {"eval_every": 5, "early_stopping": None}}, {"train.early_stopping.patience": 2}, ("auto", False),
     False),
])
def test_overrides_expand_a_sections_short_form(tmp_path, raw, overrides, compile_, profile):
    """`"compile": false` plus --compile-mode etc. means {"enabled": false, ...}: the file's setting is kept."""
    cfg = load_config(write(tmp_path, raw), overrides)
    assert (cfg.train.compile.enabled, cfg.train.compile.fullgraph) == compile_
    assert cfg.profile.enabled is profile


@pytest.mark.parametrize("raw, overrides, message", [
    ({"train": {"compile": "fast"}}, {"train.compile.mode": "default"},
     "train.compile: 'fast' is not true/false or 'auto' or an object"),
    ({"profile": "auto"}, {"profile.enabled": True}, "profile: 'auto' is not true/false or an object"),
    ({"profile": None}, {"profile.enabled": True}, "profile: None is not true/false or an object"),
    ({"data": True}, {"data.batch_size": 8}, "data: expected an object, got True"),
    ({"data": 5}, {"data.batch_size": 8}, "data: expected an object, got 5"),
    ({"train": 5}, {"train.compile.enabled": True}, "train: expected an object, got 5"),
])
def test_an_override_never_hides_or_renames_the_files_own_error(tmp_path, raw, overrides, message):
    """Bug fixed here: apply_overrides expanded any true/false/"auto" parent into {"enabled": ...}, so `"profile":
    "auto"` plus --profile loaded (the bad value vanished), `"data": true` plus --batch-size blamed a key
    "data.enabled" the file does not hold, and a bad train.compile was named "compile". Now the file's own error."""
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert str(err.value) == f"{path}: {message}"


def test_blame_goes_to_the_command_line_only_for_the_overridden_key_itself(tmp_path):
    """data.shuffle is overridden; data.shuffle_buffer_rows (same prefix) is the file's error."""
    path = write(tmp_path, {"data": {"shuffle_buffer_rows": 0}})
    with pytest.raises(ConfigError) as err:
        load_config(path, {"data.shuffle": False})
    assert str(err.value) == f"{path}: data.shuffle_buffer_rows: 0 must be > 0"


# --- dlrm.cli: options to config keys ----------------------------------------------------------------------------

NO_OPTIONS = dict.fromkeys(("data", "device", "batch_size", "epochs", "max_steps", "seed", "run_name", "tb_dir",
                            "checkpoint_every", "split", "compile_", "compile_mode", "profile", "kernels"))


def test_every_option_sets_its_own_key():
    """Each command-line option lands on its documented key; falsy values (seed 0, --no-baseline) are kept."""
    given = {"data": "d", "device": "cpu", "batch_size": 8, "epochs": 2, "max_steps": 3, "seed": 0, "run_name": "r",
             "tb_dir": "tb", "checkpoint_every": 4, "split": "test", "compile_": False, "compile_mode": None,
             "profile": True, "kernels": "torch", "baseline": False}
    assert cli.cli_overrides(**given) == {
        "data.path": "d", "train.device": "cpu", "data.batch_size": 8, "train.epochs": 2, "train.max_steps": 3,
        "train.seed": 0, "log.run_name": "r", "log.tb_dir": "tb", "checkpoint.every": 4, "data.eval_split": "test",
        "train.baseline": False, "train.compile.enabled": False, "profile.enabled": True,
        "kernels.embedding": "torch", "kernels.interaction": "torch", "kernels.mlp": "torch", "kernels.loss": "torch"}
    assert cli.cli_overrides(**NO_OPTIONS) == {}


def test_compile_mode_turns_a_files_compile_false_on(tmp_path):
    """--compile-mode implies --compile, also over `"compile": false` in the file."""
    overrides = cli.cli_overrides(**{**NO_OPTIONS, "compile_mode": "default"})
    cfg = load_config(write(tmp_path, {"train": {"compile": False}}), overrides)
    assert (cfg.train.compile.enabled, cfg.train.compile.mode) == (True, "default")


def test_an_empty_allow_config_change_is_refused():
    with pytest.raises(ConfigError) as err:
        cli.parse_allowed_changes("")
    assert str(err.value) == ("--allow-config-change: empty key in '' (comma-separated dotted keys, e.g. "
                              "data.batch_size,optim.dense.lr)")


def test_export_path_refuses_a_dangling_symlink(tmp_path):
    """Writing through a dangling link would create a file somewhere else."""
    link = tmp_path / "m.pt2"
    link.symlink_to(tmp_path / "elsewhere.pt2")
    with pytest.raises(ConfigError) as err:
        cli.check_export_path(str(link))
    assert str(err.value) == f"--export: {link} already exists; remove it or choose another path"


def test_export_path_refuses_an_unwritable_directory(tmp_path, monkeypatch):
    """(os.access is faked: the tests may run as root, for whom every directory is writable.)"""
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError) as err:
        cli.check_export_path(str(tmp_path / "m.pt2"))
    assert str(err.value) == f"--export: directory {tmp_path} is not writable"


MODES = {"eval_only": False, "compare": None, "resume": None, "export_path": None, "checkpoint_path": None,
         "allowed_changes": []}


@pytest.mark.parametrize("given, world_size, message", [
    ({"compare": "eager", "resume": "latest"}, "1", "--compare cannot be combined with --resume"),
    ({"compare": "eager", "eval_only": True, "checkpoint_path": "c.pt"}, "1",
     "--compare cannot be combined with --eval-only"),
    ({"eval_only": True, "resume": "latest", "checkpoint_path": "c.pt"}, "1",
     "--eval-only cannot be combined with --resume (evaluate a --checkpoint instead)"),
    ({"eval_only": True, "checkpoint_path": "c.pt"}, "2", ("--eval-only and --export run in one process (not under "
     "torchrun): merge a sharded checkpoint first with python -m dlrm.distributed.merge CHECKPOINT OUT")),
    ({"checkpoint_path": "c.pt", "export_path": "m.pt2"}, "1", None),
    ({"eval_only": True, "checkpoint_path": "c.pt"}, " 1 ", None),
    ({"eval_only": True, "checkpoint_path": "c.pt"}, "0", None),
    ({"eval_only": True, "checkpoint_path": "c.pt"}, "", None),
])
def test_option_combinations(monkeypatch, given, world_size, message):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    if message is None:
        cli.check_modes(**{**MODES, **given})
        return
    with pytest.raises(ConfigError) as err:
        cli.check_modes(**{**MODES, **given})
    assert str(err.value) == message


# --- dlrm.cli: failure reports -----------------------------------------------------------------------------------

@pytest.fixture
def logged():
    """The messages loguru logs while the test runs."""
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), format="{message}")
    yield messages
    logger.remove(sink)


@pytest.mark.parametrize("first_line, shown", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB.", "CUDA out of memory. Tried to allocate 2.00 GiB."),
    ("CUDA out of memory. " + "x" * 300, f"CUDA out of memory. {'x' * 177}..."),
])
def test_gpu_out_of_memory_is_its_first_line_cut_to_200_characters(logged, first_line, shown):
    """torch's OOM message runs over many lines (a memory summary): only the first, at most 200 characters."""
    import torch

    cfg = config.validate(Config())
    code = cli.report_failure(torch.OutOfMemoryError(first_line + "\nGPU 0 has a total capacity of 79 GiB"), cfg)
    assert code == cli.EXIT_OUT_OF_MEMORY
    assert logged == [(f"out of GPU memory ({shown}): retry with a smaller data.batch_size (now 512) (--batch-size), "
                       "or cap the embedding tables with data.max_rows_per_table")]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM])
def test_every_environment_errno_is_one_line_exit_2(logged, code):
    assert cli.report_failure(OSError(code, os.strerror(code), "/r/ckpt.pt"), None) == cli.EXIT_BAD_INPUT
    assert logged == [f"file system error: /r/ckpt.pt: {os.strerror(code)}"]


def test_a_file_system_error_without_a_file_name_names_none(logged):
    assert cli.report_failure(OSError(errno.ENOSPC, "No space left on device"), None) == cli.EXIT_BAD_INPUT
    assert logged == ["file system error: No space left on device"]


@pytest.mark.parametrize("exc, code", [
    (DatasetError("data.path: x"), cli.EXIT_BAD_INPUT),
    (NonFiniteLoss("loss NaN"), cli.EXIT_NON_FINITE_LOSS),
    (TrainingStopped(143, "stopped"), 143),
])
def test_exit_codes(logged, exc, code):
    assert cli.report_failure(exc, None) == code and logged == [str(exc)]


def test_long_and_empty_messages(logged):
    """A message is cut to 2000 characters (ellipsis included); an empty one is named by its class."""
    cli.report_failure(ConfigError("y" * 2500), None)
    cli.report_failure(ConfigError(""), None)
    assert logged == ["y" * 1997 + "...", "ConfigError"]


# --- dlrm.cli.run: which checkpoint, which split -----------------------------------------------------------------

@pytest.fixture
def actions(monkeypatch):
    """Record train / evaluate_checkpoint / export_checkpoint instead of running them."""
    from dlrm.train import checkpointer, export, trainer

    calls: list[tuple] = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: calls.append(("train",)) or {
        "checkpoint": "last.pt", "best_checkpoint": "best.pt"})
    monkeypatch.setattr(checkpointer, "checkpoint_for", lambda path: Path(f"resolved-{path}"))
    monkeypatch.setattr(export, "evaluate_checkpoint", lambda cfg, ckpt, split: calls.append(("eval", ckpt, split)))
    monkeypatch.setattr(export, "export_checkpoint", lambda cfg, ckpt, out: calls.append(("export", ckpt, out)))
    return calls


def run_cli(tmp_path, *, eval_only=False, checkpoint_path=None, export_path=None, overrides=None):
    cli.run(config_path=str(write(tmp_path, {})), overrides=overrides or {}, eval_only=eval_only, compare=None,
            resume=None, checkpoint_path=checkpoint_path, export_path=export_path, allowed_changes=[], loaded=[])


def test_export_after_training_takes_the_best_checkpoint(tmp_path, actions):
    run_cli(tmp_path, export_path=str(tmp_path / "m.pt2"))
    assert actions == [("train",), ("export", Path("best.pt"), tmp_path / "m.pt2")]


def test_export_of_a_checkpoint_does_not_train(tmp_path, actions):
    run_cli(tmp_path, checkpoint_path="c.pt", export_path=str(tmp_path / "m.pt2"))
    assert actions == [("export", Path("resolved-c.pt"), tmp_path / "m.pt2")]


def test_eval_only_uses_the_configured_split(tmp_path, actions):
    run_cli(tmp_path, eval_only=True, checkpoint_path="c.pt", overrides={"data.eval_split": "test"})
    assert actions == [("eval", Path("resolved-c.pt"), "test")]
