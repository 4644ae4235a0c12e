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

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def gpu_work(events) -> dict:
    """What a profiler's events say the GPU did: busy ms (the union of its kernels' and copies'
    intervals), how many there were, and the 12 names with the most time."""
    from torch.autograd import DeviceType

    spans, by_name = [], collections.Counter()
    for e in events:
        if e.device_type == DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
            by_name[e.name] += e.time_range.elapsed_us()
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return {"busy_ms": busy / 1e3, "launches": len(spans), "top_ms": {k[:80]: v / 1e3 for k, v in by_name.most_common(12)}}


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from base_executor import cli

    out = pathlib.Path(sys.argv[1])
    state = {}

    def start(*_):
        # (on a machine without CUDA, a smoke test: the CPU's ops are recorded, none counted)
        state["prof"] = prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
        prof.start()
        out.with_suffix(".started").touch()

    def stop(*_):
        prof = state.pop("prof")
        prof.stop()
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(gpu_work(prof.events())))
        tmp.rename(out)  # (whole, for the benchmark waiting for it)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
