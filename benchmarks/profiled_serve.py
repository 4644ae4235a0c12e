"""`base-executor` with its GPU work recorded by torch.profiler between two signals, for the
benchmarks' GPU-time accounting (s1_split_tax.py --gpu-time):

    python benchmarks/profiled_serve.py OUT serve --model ... (base-executor's own arguments)

SIGUSR1 starts recording (OUT.started appears once it has); SIGUSR2 stops and writes OUT (json:
gpu_work(events)' totals). The executor serves as usual otherwise.
"""
from __future__ import annotations

import collections
import json
import pathlib
import signal
import sys
import threading

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def trace_origin_us(prof) -> float:
    """When a stopped torch.profiler `prof` started, in µs of the wall clock: its events' times
    count from there, so two processes' events share a timeline only once it is added."""
    return prof.profiler.kineto_results.trace_start_ns() / 1e3


def gpu_work(events, spans: bool = False, origin_us: float = 0.0, cpu: bool = False) -> dict:
    """What a profiler's events say the GPU did: busy ms (the union of its kernels' and copies'
    intervals), how many there were, and the 30 names with the most time; with `spans`, also
    every interval as [start µs, end µs, name] from `origin_us` (trace_origin_us: for
    gap_analysis across processes), and under "streams" each one's CUDA stream, where the
    profiler says. `cpu`: count the CPU's ops instead (a smoke test on a machine
    without CUDA; nested ops overlap)."""
    from torch.autograd import DeviceType

    found, by_name = [], collections.Counter()
    for e in events:
        if e.device_type == (DeviceType.CPU if cpu else DeviceType.CUDA):
            found.append((e.time_range.start, e.time_range.end, e.name[:60], getattr(e, "device_resource_id", None)))
            by_name[e.name[:80]] += e.time_range.elapsed_us()  # (cut before counting: names cut alike add up)
    busy_ms = gap_analysis({"gpu": [f[:3] for f in found]})["union_busy_ms"]
    work = {"busy_ms": busy_ms, "launches": len(found), "top_ms": {k: v / 1e3 for k, v in by_name.most_common(30)}}
    if spans:  # (and each one's stream, in the same order: benchmarks/probes/round_anatomy.py)
        found.sort(key=lambda f: f[:3])
        work["spans"] = [(origin_us + a, origin_us + b, name) for a, b, name, _ in found]
        work["streams"] = [stream for *_, stream in found]
    return work


def gap_analysis(parts: dict[str, list]) -> dict:
    """Where a GPU shared by several processes idled: `parts` maps who -> spans (gpu_work's).
    Returns the union busy ms, and the idle gaps between consecutive work by (who ran last ->
    who ran next): their count and ms, and the kernel pairs around the most idle time."""
    merged = sorted((s, e, who, name) for who, spans in parts.items() for s, e, name in spans)
    busy, reach, last = 0.0, None, None
    by_turn, by_pair = collections.defaultdict(lambda: [0, 0.0]), collections.Counter()
    for s, e, who, name in merged:
        if reach is None or s >= reach:
            if reach is not None and s > reach:
                turn = f"{last[0]} -> {who}"
                by_turn[turn][0] += 1
                by_turn[turn][1] += (s - reach) / 1e3
                by_pair[f"{turn}: {last[1][:40]} -> {name[:40]}"] += (s - reach) / 1e3
            busy += e - s
            reach, last = e, (who, name)
        elif e > reach:
            busy += e - reach
            reach, last = e, (who, name)
    return {
        "union_busy_ms": busy / 1e3,
        "gaps": {k: {"count": n, "ms": ms} for k, (n, ms) in sorted(by_turn.items(), key=lambda kv: -kv[1][1])},
        "top_gap_pairs_ms": dict(by_pair.most_common(12)),
    }


def main() -> int:
    signals = {signal.SIGUSR1, signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # (first: every thread started after this blocks them too)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from symbiont.base_executor import cli

    out = pathlib.Path(sys.argv[1])
    state = {}

    def start():
        # (on a machine without CUDA, a smoke test: the CPU's ops are recorded and counted)
        state["prof"] = prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
        prof.start()
        out.with_suffix(".started").touch()

    def stop():
        prof = state.pop("prof")
        prof.stop()
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(gpu_work(prof.events(), spans=True, origin_us=trace_origin_us(prof),
                                           cpu=not torch.cuda.is_available())))
        tmp.rename(out)  # (whole, for the benchmark waiting for it)

    def take_signals():
        # A thread of its own takes the two signals as they come. Handlers would run in the main
        # thread only when it next runs Python: the data loop may sleep in a native wait for
        # seconds while the native lanes serve every call, and then both signals were handled at
        # once, the second inside the first.
        while True:
            sig = signal.sigwait(signals)
            start() if sig == signal.SIGUSR1 else stop()

    threading.Thread(target=take_signals, daemon=True).start()
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
