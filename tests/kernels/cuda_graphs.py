"""CUDA-graph capture for the kernel tests that check a captured op replays like an eager call."""

from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], object], warmup: int = 1) -> torch.cuda.CUDAGraph:
    """`fn` called `warmup` times on a side stream (Triton compiles and the caching allocator grows there: neither
    may happen inside a capture), then captured once; the graph is returned without a replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
