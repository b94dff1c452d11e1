"""dlrm.sweep's parsing and verdict edge cases, and the profiler's short-run warning against what it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm.config import ConfigError
from dlrm.sweep import SettingResult, Verdict, grid, parse_set, split_values, verdict


def test_a_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match=r"a key is given twice \(model.dropout, model.dropout\)"):
        grid([parse_set("model.dropout=0,0.1"), parse_set("model.dropout=0.2")])


def test_brackets_inside_quotes_do_not_hide_commas():
    assert split_values('"a[b",0.1,"c}d",2') == ['"a[b"', "0.1", '"c}d"', "2"]


def test_a_margin_of_exactly_twice_the_noise_counts_as_beyond_it():
    # (two seeds: with one, no noise is measured, whatever a caller passes: None, `test_audit_sweeprest`)
    a, b = SettingResult(0, {"x": 1}, [{"auc": 0.7}] * 2), SettingResult(1, {"x": 2}, [{"auc": 0.6}] * 2)
    assert Verdict(a, b, 0.02, 0.01).beyond_noise is True
    assert Verdict(a, b, 0.0199, 0.01).beyond_noise is False
    assert Verdict(a, None, None, None).beyond_noise is None


def test_equal_per_seed_differences_say_there_is_no_spread():
    a = SettingResult(0, {"x": 1}, [{"auc": v} for v in (0.5, 0.625)])
    b = SettingResult(1, {"x": 2}, [{"auc": v + 0.25} for v in (0.5, 0.625)])  # exact in binary: diffs all 0.25
    v = verdict([a, b])
    assert v.winner is b and v.margin == 0.25 and v.noise == 0.0
    assert v.text().endswith("+0.2500 AUC over x=1 (0.5625); the per-seed differences are all equal "
                             "(no spread to compare with)")


@pytest.mark.parametrize("steps, recorded", [(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)])
def test_the_short_run_warning_says_what_the_trace_will_hold(tmp_path, steps, recorded):
    """The profiler saves what it recorded on exit: a run shorter than the cycle still writes a trace of the active
    steps it reached (the warning used to say "no trace" for all of them). A run that reaches none gets no profiler
    (as the trainer runs it: no prof.step()), said so."""
    import gzip
    import json

    import torch
    from loguru import logger

    from dlrm.config import ProfileConfig
    from dlrm.train.profiling import make_profiler, trace_files

    seen: list[str] = []
    handle = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        with make_profiler(ProfileConfig(enabled=True, wait=1, warmup=1, active=3), tmp_path, torch.device("cpu"),
                           steps) as prof:
            assert (prof is None) == (recorded == 0)
            for _ in range(steps):
                torch.ones(4).sum()
                if prof is not None:
                    prof.step()
    finally:
        logger.remove(handle)
    traces = trace_files(tmp_path)
    profiled = {e.get("name") for t in traces for e in json.loads(gzip.decompress(t.read_bytes()))["traceEvents"]
                if str(e.get("name", "")).startswith("ProfilerStep#")}
    trained = {n for n in profiled if int(n.split("#")[1]) < steps}  # not the empty one opened by the last step()
    assert len(trained) == recorded
    if steps < 5:
        assert len(seen) == 1
        assert (f"only {recorded} of the 3 active step(s)" in seen[0]) if recorded else seen[0].rstrip("\n") == (
            f"profiling: this run trains {steps} step{'s' if steps > 1 else ''}, no more than the steps before the "
            "profiler records (profile.wait 1 + profile.warmup 1 = 2): the profiler is not started and writes no "
            "trace; train longer or shorten those")
    else:
        assert not seen and len(traces) == 1


@pytest.mark.parametrize("order", [(4, 8, 16), (16, 8, 4)])
def test_no_setting_with_an_auc_names_no_winner_whatever_the_grid_order(order):
    """Every trial's validation split of one class (AUC null in summary.json): the sweep named the grid's first
    setting "best" (NaN ranks last, all tied), a winner that flipped with the order of --set. Now: no winner, and the
    mean loglosses lowest first (what a trial's own best checkpoint falls back to)."""
    loss = {4: 0.4080, 8: 0.0485, 16: 0.2}
    results = [SettingResult(i, {"model.cross_rank": k}, [{"auc": None, "logloss": loss[k]}] * 2)
               for i, k in enumerate(order)]
    text = verdict(results).text()
    assert text == ("no winner: no setting has an AUC (a trial's validation split has one class, or its scores are "
                    "NaN); mean validation logloss, lowest first: model.cross_rank=8 0.0485, model.cross_rank=16 "
                    "0.2000, model.cross_rank=4 0.4080"), text


def test_a_setting_with_an_auc_still_wins_over_those_without():
    a = SettingResult(0, {"x": 1}, [{"auc": None, "logloss": 0.1}] * 2)
    b = SettingResult(1, {"x": 2}, [{"auc": 0.7, "logloss": 0.5}] * 2)
    assert verdict([a, b]).text().startswith("best: x=2 (AUC 0.7000 mean of 2 seeds)")


def test_a_sweep_stopped_by_a_refusal_says_resume_once_it_is_fixed(tmp_path, monkeypatch):
    """A trial refused (here as a --resume's checkpoint no longer fits the dataset): "--resume finishes it" alone
    read as if the same --resume would, which repeats the refusal until its cause is fixed."""
    from click.testing import CliRunner

    import dlrm.train.trainer as trainer_mod
    from dlrm import sweep
    from tests.test_audit_overwrite52 import tiny_config

    config = tiny_config(tmp_path)

    def refused(cfg, run_dir=None, resume=None, **kw):
        (Path(run_dir) / "checkpoints").mkdir(parents=True)
        (Path(run_dir) / "checkpoints" / "step-00000002.pt").write_bytes(b"x")
        raise ConfigError("step-00000002.pt: table sizes differ (checkpoint vs this run): [0] 14 vs 13")

    monkeypatch.setattr(trainer_mod, "train", refused)
    res = CliRunner().invoke(sweep.main, ["--config", str(config), "--set", "optim.dense.lr=0.1,0.2", "--seeds", "1",
                                          "--tb-dir", str(tmp_path / "tb"), "--run-name", "sw"])
    assert res.exit_code == 2, res.output
    assert "table sizes differ" in res.output, res.output
    assert "sweep: stopped; once the error above is fixed, `python -m dlrm.sweep --resume" in res.output, res.output
