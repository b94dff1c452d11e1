"""A profiled step replayed from a whole-step CUDA graph (the default fast path on a GPU) names no model range: its
kernels are launched by one cudaGraphLaunch outside them all. profile_step.md and TensorBoard's step breakdown said
only "data" and "other"; they now say why, and how to get the per-range breakdown."""

from __future__ import annotations

from dlrm.train.trace_summary import step_table, summarize_step


def _event(name, cat, ts, dur, **args):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": 1, "args": args}


def _trace(launch: str, ranges: tuple = ()) -> dict:
    events = [_event("ProfilerStep#4", "user_annotation", 0, 1000), _event("data", "user_annotation", 0, 200),
              _event(launch, "cuda_runtime", 300, 50, correlation=7),
              _event("_dot_interaction_fwd_kernel", "kernel", 400, 80, correlation=7)]
    events += [_event(name, "user_annotation", 250, 100) for name in ranges]
    return {"traceEvents": events}


def test_a_graph_replay_step_says_why_its_time_is_other():
    table = step_table(summarize_step(_trace("cudaGraphLaunch")))
    assert "| other |" in table and "| DenseArch |" not in table
    assert "CUDA graph replay (1 `cudaGraphLaunch`)" in table and "`train.cuda_graph` false" in table


def test_no_note_for_an_eager_step_or_a_graph_inside_named_ranges():
    assert "CUDA graph" not in step_table(summarize_step(_trace("cudaLaunchKernel")))
    # a graph launched inside a named range (a part graphed alone): the table names where its time went
    assert "CUDA graph" not in step_table(summarize_step(_trace("cudaGraphLaunch", ("OverArch",))))
