"""Host-clock timing of GPU calls, launch cost included, made robust to drift and stalls.

`time_us` times one call: the median of a few windows of calls issued back to back.
`interleaved_us` times several calls against each other: in each of many rounds every
call gets one window, in an order rotated from round to round, so slow drift, clock
changes and host stalls hit all of them alike. Compare two calls by `paired_ratio`,
the median over rounds of their per-round time ratio.

`sync` defaults to torch.cuda.synchronize; tests pass a no-op.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Mapping


def _cuda_sync() -> None:
    import torch
    torch.cuda.synchronize()


def calls_per_window(fn: Callable[[], object], window_ms: float, sync=None, *, most: int = 500) -> int:
    """How many back-to-back calls of `fn` fill about `window_ms` (after a warm-up; at least 3)."""
    sync = sync or _cuda_sync
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    sync()
    per = max((time.perf_counter() - t0) / 5, 1e-7)
    return int(min(most, max(3, window_ms * 1e-3 / per)))


def _window_us(fn: Callable[[], object], n: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def time_us(fn: Callable[[], object], *, target_ms: float = 2.0, repeats: int = 5, sync=None) -> float:
    """Median microseconds per call of `fn` issued back to back (launch cost included)."""
    sync = sync or _cuda_sync
    n = calls_per_window(fn, target_ms, sync)
    return statistics.median(_window_us(fn, n, sync) for _ in range(repeats))


def interleaved_us(fns: Mapping[Hashable, Callable[[], object]], *, rounds: int = 15, window_ms: float = 1.0,
                   sync=None) -> dict[Hashable, list[float]]:
    """Per key, one microseconds-per-call sample per round; all keys timed in every round."""
    sync = sync or _cuda_sync
    keys = list(fns)
    n = {k: calls_per_window(fns[k], window_ms, sync) for k in keys}
    samples: dict[Hashable, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for i in range(len(keys)):
            k = keys[(r + i) % len(keys)]
            samples[k].append(_window_us(fns[k], n[k], sync))
    return samples


def paired_ratio(samples: Mapping[Hashable, list[float]], num: Hashable, den: Hashable) -> float:
    """Median over rounds of samples[num] / samples[den]: > 1 when `den` is faster."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation), e.g. q=0.25 for the lower quartile."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
