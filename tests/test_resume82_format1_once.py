"""A resume from a format-1 checkpoint says its conversion to format 2 once: the resume reads the file twice (its
config and position before the build, its tensors at the restore), and each read said it, two identical warnings a
resume. A fresh read of the file (another command: --eval-only, --export, the next resume) says it again."""

from __future__ import annotations

from dlrm import checkpoint as ckpt
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.test_checkpoint_safety import CONFIG, captured_logs, old_rng_state, save_format_1, trained  # noqa: F401

assert CONFIG  # (the run the `trained` fixture makes: a 3-step run on a tiny dataset)


def _format_1_copy(trained, tmp_path, run: str):  # noqa: F811 - the imported fixture's value
    state = {k: v for k, v in ckpt.load_checkpoint(trained["path"]).items() if k not in ("format_version", "run_stats")}
    state["rng"] = old_rng_state()
    old = tmp_path / "tb" / run / "checkpoints" / ckpt.checkpoint_name(3)
    save_format_1(old, state)
    return old


def _conversions(messages: list[str]) -> list[str]:
    return [m for m in messages if "converted format 1 checkpoint" in m]


def test_a_resume_from_a_format_1_checkpoint_says_its_conversion_once(trained, tmp_path):  # noqa: F811
    old = _format_1_copy(trained, tmp_path, "old")
    cfg = load_config(trained["cfg_path"], {"log.tb_dir": str(tmp_path / "tb"), "log.run_name": "old",
                                            "train.max_steps": 6})
    with captured_logs() as messages:
        summary = train(cfg, resume=str(old))
    assert summary["resumed_at_step"] == 3  # it resumed from the converted checkpoint
    converted = _conversions(messages)
    assert len(converted) == 1, converted
    assert str(old) in converted[0] and "to format 2 in memory" in converted[0]


def test_each_read_outside_a_resume_still_says_it(trained, tmp_path):  # noqa: F811
    """The warning is a resume's to say once, not the file's: each load of it elsewhere (an evaluation, an export,
    the library's own calls) converts it again and says so."""
    old = _format_1_copy(trained, tmp_path, "other")
    with captured_logs() as messages:
        ckpt.load_checkpoint(old)
        ckpt.load_checkpoint(old, mmap=True)
    assert len(_conversions(messages)) == 2, messages
