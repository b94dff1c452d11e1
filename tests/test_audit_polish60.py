"""Small defects of a user journey (audit helper, polish60).

1. ``benchmarks/trace_timeline.py`` said "wrote step.png" but not the step.md it also wrote, and replaced both
   silently when they existed; so did every benchmark script's results files. Now each script refuses its existing
   outputs in one line before it measures anything (``--overwrite`` replaces them: the policy of the dataset tools),
   and ends with a ``wrote ...`` line naming every file it wrote; ``--append`` still merges as asked.
2. Log lines counted "1 steps/epoch, 1 steps", "1 days", "1 runs": the noun now follows its count
   (`dlrm.logging_setup.counted`).
3. ``train.py --compare`` logged its table with Markdown's escaped pipes (``max \\|loss - eager\\|``); the console
   now gets plain aligned columns, compare.md keeps the Markdown.
"""

from __future__ import annotations

import gzip
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from loguru import logger

import dlrm.train.compare as compare
from dlrm.config import load_config
from dlrm.logging_setup import counted
from dlrm.train.trainer import train
from tests.conftest import REPO, make_dataset
from tests.test_audit_fast_path_edges import FAKE_SUMMARY
from tests.test_benchmark_scripts import ev as _ev
from tests.test_benchmark_scripts import load_script

# benchmarks/kernels.py's --device cpu needs the interpreter, which a GPU machine's tests leave off (the GPU run
# found it): there the same checks go through the GPU
KERNELS_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"




def _run_with_trace(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    with gzip.open(run / "h.1.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [_ev("ProfilerStep#1", "user_annotation", 0, 100),
                                   _ev("backward", "user_annotation", 10, 30), _ev("gemm", "kernel", 20, 10)]}, f)
    return run


def _trace_timeline(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["trace_timeline.py", *argv])
    load_script("trace_timeline").main()


# ---- 1. outputs named, never replaced silently ---------------------------------------------------------------------


def test_trace_timeline_names_both_files_and_refuses_to_replace_them(tmp_path, monkeypatch, capsys):
    run, png, md = _run_with_trace(tmp_path), tmp_path / "step.png", tmp_path / "step.md"
    _trace_timeline(monkeypatch, str(run), "--out", str(png))
    assert capsys.readouterr().out.rstrip().splitlines()[-1].endswith(f"; wrote {png}, {md}")
    assert png.stat().st_size > 0 and md.read_text().startswith("# one training step")
    png.write_bytes(b"mine")
    md.unlink()  # either one there is refused: the PNG's own
    with pytest.raises(SystemExit) as e:
        _trace_timeline(monkeypatch, str(run), "--out", str(png))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{png} already exists" in err and "--overwrite" in err, err
    assert png.read_bytes() == b"mine" and not md.exists()  # nothing written, not even the other file
    md.write_text("notes")
    with pytest.raises(SystemExit):
        _trace_timeline(monkeypatch, str(run), "--out", str(png))
    assert "(and 1 more of its outputs)" in capsys.readouterr().err and md.read_text() == "notes"
    _trace_timeline(monkeypatch, str(run), "--out", str(png), "--overwrite")
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {png}, {md}")
    assert png.read_bytes()[:4] == b"\x89PNG" and md.read_text().startswith("# one training step")


def test_trace_timeline_refuses_an_out_whose_markdown_is_itself(tmp_path, monkeypatch, capsys):
    """--out step.md: the numbers' file (<out>.md) was the picture's own path, written over it."""
    with pytest.raises(SystemExit) as e:
        _trace_timeline(monkeypatch, str(_run_with_trace(tmp_path)), "--out", str(tmp_path / "step.md"))
    assert e.value.code == 2 and "not step.md" in capsys.readouterr().err and not (tmp_path / "step.md").exists()


def _argv(tmp_path: Path, out: Path, script: str) -> list[str]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "metadata.json").write_text("{}")  # (loader_training only checks that it is there)
    log = tmp_path / "train.log"
    log.write_text("")
    extra = {
        "autopick_report": [str(tmp_path), "--call", "c"],
        "kernels": ["--device", KERNELS_DEVICE, "--kernels", "interaction"],
        "loader_training": ["--data", str(data)],
        "loader_throughput": ["--name", "n"],
        "scaling": ["--profile", "--name", "n"],
        "sparse_layout_decode": ["--name", "n"],
        "step_clocks": ["--name", "n"], "step_ops": ["--name", "n"], "step_profile": ["--name", "n"],
        "stream_timeline": ["--data", str(data)],
        "train_log_windows": ["--logs", str(log)],
        "user_path": ["--data", str(data)],
    }
    return [*extra.get(script, []), "--out", str(out)]


# script -> one file (or folder) of its outputs already there
TAKEN = {
    "autopick_report": "autopick.md", "checkpoint_load": "checkpoint_load.md", "checkpoint_write": "checkpoint_write.md", "copy_bandwidth": "copy_bandwidth.md", "cross_bwd_passes": "cross_bwd_passes.csv",
    "cross_layer": "cross_layer.png", "cross_tma_probe": "cross_tma_probe.csv", "cross_ws_head_probe":
    "cross_ws_head_probe.md", "cross_ws_probe": "cross_ws_probe.md", "cublaslt_drelu_probe": "cublaslt_drelu_probe.csv",
    "fp8_dense_probe": "fp8_dense_probe_kernels.md", "gemm_layout_probe": "gemm_layout_probe.png",
    "gluon_mutants": "mutants.csv", "host_step_costs": "host_step_costs.csv", "kernels": "interaction_dot.png",
    "loader_throughput": "n.csv",
    "loader_training": "loader_training_b65536.md", "mask_bias_launches": "mask_bias_launches.md", "mlp": "mlp.csv",
    "mlperf_dcnv2": "mlperf_dcnv2.png", "omp_wait_policy": "omp_wait_policy.csv",
    "onehot_embedding_sweep": "onehot_embedding_sweep.md",
    "pooled_embedding": "pooled_embedding.md", "pooled_update_sweep": "pooled_update_sweep_run.csv",
    "scaling": "n_profile_1gpu.md", "sparse_layout_decode": "n.png", "step_clocks": "n.csv", "step_ops": "n.md",
    "step_profile": "n.png", "stream_overlap": "stream_overlap.csv", "stream_timeline": "stream_timeline.md",
    "train_log_windows": "train_log_windows.csv", "train_throughput": "train_throughput_kaggle.md",
    "update_traffic_floor": "update_traffic_floor.png", "user_path": "user_path_logs", "wgrad": "wgrad.md",
    "wgrad_tma_probe": "wgrad_tma_probe.md",
}


def test_every_script_that_writes_results_is_in_the_table():
    """A new script with --out joins the policy (and this test)."""
    writers = {p.stem for p in (REPO / "benchmarks").glob("*.py") if '"--out"' in p.read_text()}
    assert writers - {"trace_timeline"} == set(TAKEN)


@pytest.mark.parametrize("script", sorted(TAKEN))
def test_a_script_refuses_its_existing_outputs_before_it_measures(tmp_path, monkeypatch, capsys, script):
    out = tmp_path / "out"
    out.mkdir()
    taken = out / TAKEN[script]
    if script == "kernels":  # the interaction family's plot: its first variant's name
        taken = out / f"{load_script('kernels').select_specs('interaction', False)[0].name}.png"
    if taken.suffix:
        taken.write_text("mine")
    else:
        taken.mkdir()
    argv = _argv(tmp_path, out, script)
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])

    def measuring(*_):  # the refusal comes at once; a script still running after seconds is measuring
        raise AssertionError(f"{script} went on past its existing {taken.name}")

    previous = signal.signal(signal.SIGALRM, measuring)
    signal.alarm(30)
    try:
        with pytest.raises(SystemExit) as e:
            module.main() if script == "gluon_mutants" else module.main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{taken} already exists" in err and "pass --overwrite" in err, err
    assert err.strip().splitlines()[-1].count("already exists") == 1  # one line: argparse's usage, then it
    assert sorted(p.name for p in out.iterdir()) == [taken.name]  # nothing else written
    assert taken.is_dir() or taken.read_text() == "mine"


def test_kernels_append_merges_into_existing_files_as_asked(tmp_path, capsys):
    """--append is a request to update kernels.csv (and redraw its Markdown and plots): never refused; what it wrote
    is named."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kernels.md").write_text("the last run's")
    args = ["--device", KERNELS_DEVICE, "--kernels", "loss", "--batch-sizes", "8", "--cpu-reps", "1", "--out", str(out)]
    before = signal.getsignal(signal.SIGTERM)
    assert load_script("kernels").main([*args, "--append"]) == 0
    # the caller's SIGTERM handler is back (CI: the script's KeyboardInterrupt-raising one stayed in the test worker,
    # and a later test's own SIGTERM took the worker down)
    assert signal.getsignal(signal.SIGTERM) is before
    said = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert said.startswith(f"wrote {out / 'kernels.csv'}, {out / 'kernels.md'}, {out}/"), said
    assert said.endswith(".png") and (out / "kernels.md").read_text() != "the last run's"


def test_train_log_windows_names_every_file_it_wrote(tmp_path, capsys):
    log = tmp_path / "a.log"
    log.write_text("01:00:00 INFO    device cuda, 2,080 train rows, 1 step/epoch, 40 steps\n"
                   "train:  50%|#####     | 20/40 [00:01<00:01, 10.0step/s, loss=0.5, samples_s=2,000,000]\n"
                   "train: 100%|##########| 40/40 [00:02<00:00, 10.0step/s, loss=0.5, samples_s=2,500,000]\n"
                   "01:00:02 INFO    validation: AUC 0.8000, logloss 0.4000, accuracy 0.8000; 40 steps, "
                   "2,621,440 samples, 2,500,000 samples/s (waiting for data 12% of the time), 1.0s\n")
    tw = load_script("train_log_windows")
    assert tw.epoch_steps(log.read_text()) == 1  # "1 step/epoch", as train.py now says it
    assert tw.main(["--logs", str(log), "--out", str(tmp_path)]) == 0
    names = [tmp_path / f"train_log_windows.{ext}" for ext in ("csv", "md", "png")]
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "wrote " + ", ".join(map(str, names))
    assert "2,500,000" in names[1].read_text()  # the final line's rate, parsed


# ---- 2. a count's noun follows it ----------------------------------------------------------------------------------


def test_counted_says_one_step_and_many_steps():
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert counted(1234567, "sample", ",") == "1,234,567 samples" and counted(1, "sample", ",") == "1 sample"


def test_a_run_of_one_step_says_one_step(tmp_path):
    """A split of one batch trained one epoch: its start line said "1 steps/epoch, 1 steps" and its last line
    "; 1 steps, 8 samples"."""
    make_dataset(tmp_path / "ds", {"train": 8, "validation": 8})
    raw = {"data": {"path": str(tmp_path / "ds"), "batch_size": 8},
           "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
           "train": {"epochs": 1, "log_every": 1, "device": "cpu", "seed": 3, "baseline": False},
           "log": {"tb_dir": str(tmp_path / "tb"), "run_name": "one"}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="INFO")
    try:
        train(load_config(tmp_path / "c.json"))
    finally:
        logger.remove(sink)
    start = next(m for m in said if "train rows" in m)
    assert start.endswith("8 train rows, 1 step/epoch, 1 step"), start
    final = next(m for m in said if m.startswith("validation: AUC"))
    # (the summary before a logloss warning: that names keys such as train.min_steps, and counts '1 step' too)
    summary, _, warning = final.partition("; WARNING")
    assert "; 1 step, 8 samples" in summary and "steps" not in summary, final
    assert " 1 steps" not in warning, final


# ---- 3. the compare table on the console ---------------------------------------------------------------------------


def test_compare_logs_a_plain_aligned_table_and_keeps_the_markdown(tmp_path):
    cfg = load_config(REPO / "configs" / "sample.json", {"log.tb_dir": str(tmp_path / "tb"), "train.device": "cpu",
                                                          "log.run_name": "cmp"})

    def fake_train(vcfg, run_dir):
        run_dir.mkdir(parents=True)
        return {**FAKE_SUMMARY, "samples_per_sec": 123456.0, "train_losses": [(1, 0.5), (2, 0.25)]}

    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="INFO")
    try:
        compare.run_comparison(cfg, ["eager", "compiled"], fake_train)
    finally:
        logger.remove(sink)
    table = next(m for m in said if m.startswith("comparison (")).splitlines()[1:]
    assert "\\" not in "\n".join(table) and "max |loss - eager|" in table[0], table
    head, rule, *rows = table
    assert [r.split()[0] for r in rows] == ["eager", "compiled"] and set(rule) == {"-", " "}
    # every column starts where its title does: the rule's dashes span each title and cell
    starts = [i for i in range(len(rule)) if rule[i] == "-" and (i == 0 or rule[i - 1] == " ")]
    assert [head[i - 1] if i else " " for i in starts] == [" "] * len(starts)
    assert all(r[starts[-1]:].strip() == "ok" for r in rows), rows  # status, the last column, aligned
    assert "123,456" in rows[0]
    md = (tmp_path / "tb" / "cmp" / "compare.md").read_text()
    assert "| max \\|loss - eager\\| |" in md  # the Markdown keeps its escapes
