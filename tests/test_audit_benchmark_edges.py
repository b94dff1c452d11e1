"""Audit of the benchmark scripts' edges on the CPU: bad option values and missing config files must end in one
clear argparse line (exit 2) naming the option / file, before anything is measured or written."""

from __future__ import annotations

import argparse

import pytest

from tests.test_benchmark_scripts import load_script


def _refused(capsys, main, argv) -> str:
    """Run `main(argv)`, expect argparse's exit 2, return its stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["12x", "64,", "0"])
def test_train_throughput_bad_batch_sizes_is_one_line_error(tmp_path, capsys, value):
    tt = load_script("train_throughput")
    err = _refused(capsys, tt.main, ["--config", "configs/sample.json", "--batch-sizes", value,
                                     "--variants", "eager", "--precisions", "fp32", "--out", str(tmp_path)])
    assert "--batch-sizes" in err and repr(value) in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_train_throughput_missing_config_is_one_line_error(tmp_path, capsys):
    tt = load_script("train_throughput")
    missing = tmp_path / "nope.json"
    err = _refused(capsys, tt.main, ["--config", str(missing), "--out", str(tmp_path / "out")])
    assert str(missing) in err and "not found" in err
    assert not (tmp_path / "out").exists()


def test_mlperf_dcnv2_bad_batch_sizes_refused_before_measuring(tmp_path, capsys, monkeypatch):
    ml = load_script("mlperf_dcnv2")
    # the device peaks are measured before the cases: a bad --batch-sizes must be refused before them
    monkeypatch.setattr(ml, "device_peaks", lambda *a, **k: pytest.fail("measured before checking --batch-sizes"))
    err = _refused(capsys, ml.main, ["--smoke", "--no-clocks", "--batch-sizes", "6x", "--out", str(tmp_path)])
    assert "--batch-sizes" in err and "'6x'" in err
    assert list(tmp_path.iterdir()) == []


def test_mlperf_dcnv2_missing_config_is_one_line_error(tmp_path, capsys):
    ml = load_script("mlperf_dcnv2")
    missing = tmp_path / "nope.json"
    err = _refused(capsys, ml.main, ["--smoke", "--config", str(missing), "--out", str(tmp_path / "out")])
    assert str(missing) in err and "not found" in err


def test_mlp_bad_batch_sizes_is_one_line_error(tmp_path, capsys):
    mlp = load_script("mlp")
    err = _refused(capsys, mlp.main, ["--smoke", "--batch-sizes", "6x", "--out", str(tmp_path)])
    assert "--batch-sizes" in err and "'6x'" in err
    assert list(tmp_path.iterdir()) == []


def test_pooled_embedding_bad_batch_sizes_refused_before_the_tables(tmp_path, capsys, monkeypatch):
    pe = load_script("pooled_embedding")
    # the copy bandwidth is measured, and an empty results file written, before the tables: refused before both
    monkeypatch.setattr(pe, "copy_bandwidth", lambda *a, **k: pytest.fail("measured before checking --batch-sizes"))
    err = _refused(capsys, pe.main, ["--smoke", "--batch-sizes", "6x", "--out", str(tmp_path)])
    assert "--batch-sizes" in err and "'6x'" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--workers", "--reader-threads"])
def test_loader_throughput_bad_int_lists_refused_without_a_scratch_dir(tmp_path, capsys, monkeypatch, flag):
    lt = load_script("loader_throughput")
    made = []
    real = lt.tempfile.mkdtemp
    monkeypatch.setattr(lt.tempfile, "mkdtemp", lambda *a, **k: made.append(real(dir=tmp_path)) or made[-1])
    err = _refused(capsys, lt.main, [flag, "2,x", "--out", str(tmp_path / "out")])
    assert flag in err and "'2,x'" in err
    assert made == []  # no scratch directory left behind
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--workers", "2,x"], ["--arrow-threads", "sometimes"]])
def test_loader_throughput_option_errors_leave_logging_on_and_no_scratch_dir(tmp_path, capsys, monkeypatch, argv):
    """An option error is an argparse exit: it disabled the "dlrm" logger first and never enabled it again (main() runs
    in-process in tests: later tests' log captures got nothing), and --arrow-threads was checked after the scratch
    directory was made (left behind)."""
    from loguru import logger

    lt = load_script("loader_throughput")
    made = []
    real = lt.tempfile.mkdtemp
    monkeypatch.setattr(lt.tempfile, "mkdtemp", lambda *a, **k: made.append(real(dir=tmp_path)) or made[-1])
    _refused(capsys, lt.main, [*argv, "--out", str(tmp_path / "out")])
    assert made == []
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), format="{message}")
    try:
        from dlrm import cli  # a module of the "dlrm" package logging

        cli.logger.info("still logged")
    finally:
        logger.remove(sink)
    assert messages == ["still logged"]


def test_stream_timeline_oversleep_percentiles_are_nearest_rank():
    """The probe's p50 / p99 oversleep by nearest rank (the ceil(q * n)-th smallest): of 100 samples of 1..100 ms the
    p99 is 99 ms, not the maximum, and the p50 is 50 ms (it read 100 and 51: one rank high)."""
    st = load_script("stream_timeline")
    steps = [float(i) for i in range(30)]  # steady part: t = 19 to 29
    probe = [[19.0 + i / 10, (i + 1) / 1e3] for i in range(100)]  # 100 samples in the steady part, 1..100 ms
    events = {"step": steps, "sync": [], "loader": [], "decode": [], "wait": [], "upload": [],
              "probe": probe[::-1] + [[1.0, 5.0]]}  # out of order, and one before the steady part
    n = st.numbers(events)
    assert n["oversleep_p99_ms"] == pytest.approx(99.0)
    assert n["oversleep_p50_ms"] == pytest.approx(50.0)
    one = st.numbers({**events, "probe": [[20.0, 0.007]]})
    assert one["oversleep_p50_ms"] == pytest.approx(7.0) and one["oversleep_p99_ms"] == pytest.approx(7.0)


def test_cublaslt_drelu_probe_loop_timing_is_the_median_of_an_even_window_count(monkeypatch):
    """timed()'s loop path (the capture failed) reports the median window as the graph path does: of two windows
    of 2 and 1.5 ms a call, 1.75 ms (it read 2 ms, the upper of the two middle windows)."""
    from tests.test_audit_benchmark_numbers import fake_event_class

    probe = load_script("cublaslt_drelu_probe")
    clock = [0.0]
    durations = [100.0, 1.0, 3.0, 1.0, 2.0, 3.0, 4.0]  # the warm-up call, then two windows of two calls

    def step():
        clock[0] += durations.pop(0)

    def no_graph(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(probe, "graph_replay_ms", no_graph)
    monkeypatch.setattr(probe.torch.cuda, "Event", fake_event_class(clock))
    monkeypatch.setattr(probe.torch.cuda, "synchronize", lambda *a: None)
    ms, how = probe.timed(step, argparse.Namespace(calls=2, windows=2, warmup=1))
    # windows: (1 + 3) / 2 = 2.0 and (1 + 2) / 2 = 1.5 ms a call -> median 1.75
    assert (ms, how) == (pytest.approx(1.75), "loop") and durations == [3.0, 4.0]


@pytest.mark.parametrize("flag, value", [("--batch-sizes", "x"), ("--buffer-rows", "100000,x"), ("--buffer-rows", "0")])
def test_user_path_bad_int_lists_refused_before_anything_runs(tmp_path, capsys, monkeypatch, flag, value):
    """A malformed --batch-sizes or --buffer-rows is one argparse line before the reference or any train.py run
    (a bad --buffer-rows was parsed after the first batch size's reference had run, then crashed)."""
    from tests.test_benchmark_scripts import REPO

    up = load_script("user_path")
    monkeypatch.setattr(up, "device_resident", lambda *a, **k: pytest.fail("ran before checking the options"))
    monkeypatch.setattr(up, "train_py", lambda *a, **k: pytest.fail("ran before checking the options"))
    args = ["--config", "configs/sample.json", "--data", str(REPO / "data" / "sample"), "--batch-sizes", "512",
            "--placements", "", "--out", str(tmp_path / "out")]
    err = _refused(capsys, up.main, [*args, flag, value])
    assert flag in err and repr(value) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, flag, value", [("gemm_layout_probe", "--top", "32,x,1"),
                                                 ("fp8_dense_probe", "--top", "32,,1"),
                                                 ("wgrad_tma_probe", "--stages", "3,four")])
def test_probes_bad_int_lists_are_one_line_errors(tmp_path, capsys, script, flag, value):
    """The probes' comma lists of widths / pipeline depths: a malformed one is one argparse line naming the option
    and its value, nothing written (it was a ValueError traceback)."""
    probe = load_script(script)
    err = _refused(capsys, probe.main, ["--out", str(tmp_path / "out"), flag, value])
    assert flag in err and repr(value) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["pooled_embedding", "pooled_update_sweep", "update_traffic_floor"])
def test_embedding_sweeps_missing_config_is_one_line_error(tmp_path, capsys, script):
    """A --config that does not exist: one argparse line naming the file (it was a ConfigError traceback)."""
    sweep = load_script(script)
    missing = tmp_path / "nope.json"
    err = _refused(capsys, sweep.main, ["--smoke", "--config", str(missing), "--out", str(tmp_path / "out")])
    assert str(missing) in err and "not found" in err
    assert not (tmp_path / "out").exists()
