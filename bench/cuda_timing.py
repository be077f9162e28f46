"""Timing on the current CUDA stream for the PyTorch benchmarks: warm-up calls, then one CUDA-event
pair around each timed call; every time in ms (each benchmark takes its own statistic of them)."""

from __future__ import annotations

import torch


def time_calls(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return times
