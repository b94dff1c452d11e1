"""dlrm.sweep's parsing and verdict edge cases, and the profiler's short-run warning against what it writes."""

from __future__ import annotations

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


@pytest.mark.parametrize("steps, recorded", [(1, 0), (3, 1), (4, 2), (5, 3)])
def test_the_short_run_warning_says_what_the_trace_will_hold(tmp_path, steps, recorded):
    """The profiler saves what it recorded on exit: a run shorter than the cycle still writes a trace of the active
    steps it reached (the warning used to say "no trace" for all of them)."""
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
            for _ in range(steps):
                torch.ones(4).sum()
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
        assert (f"only {recorded} of the 3 active step(s)" in seen[0]) if recorded else ("profile no step" in seen[0])
    else:
        assert not seen and len(traces) == 1
