"""Where a decoding token's time goes in a gang, from a fleet's GPU spans (`s3_inference.py
--gpu-profile N` writes them: out/..._spans.json.gz, with each kernel's stream since session 51).

    python benchmarks/probes/round_anatomy.py SPANS.json.gz [--tenants 2]

For a few tenants: their token's wall time, the time their own kernels ran, the time they waited
in their handovers (word waits: the executor's answer), kernels a token, and the kernels by
launches a token (names cut to 60 characters). For the executor: each stream's calls, split at its
word waits (a gang round's call: the wait until every taking-part tenant's word is in, then the
gather, the unit and the scatter; a round's wait for its runs and its first call's wait are one),
the wait and the work after it as percentiles, and what one call launches.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics

WAIT = "wait"


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def band(xs: list) -> str:
    if not xs:
        return "-"
    return (f"mean {statistics.fmean(xs):7.1f}  p50 {pct(xs, .5):7.1f}  p90 {pct(xs, .9):7.1f}  p99 {pct(xs, .99):7.1f}"
            f"  max {max(xs):7.1f} µs  (n {len(xs)})")


def tenant(name: str, part: dict, top: int) -> str:
    spans, units = part["spans"], max(1, part.get("units", 0))
    waits = [e - s for s, e, n in spans if n == WAIT]
    own = [e - s for s, e, n in spans if n != WAIT]
    counts = collections.Counter(n for _, _, n in spans)
    us = collections.Counter()
    for s, e, n in spans:
        us[n] += e - s
    wall = (spans[-1][1] - spans[0][0]) if spans else 0.0
    lines = [f"{name}: {units} tokens in {wall / 1e3:.1f} ms: {wall / units / 1e3:.2f} ms a token; "
             f"own kernels {sum(own) / units / 1e3:.2f} ms a token ({len(own) / units:.0f} launches), "
             f"handover waits {sum(waits) / units / 1e3:.2f} ms a token ({len(waits) / units:.1f})",
             f"  its handover waits: {band(waits)}",
             "  its kernels by launches a token (µs each, mean):"]
    for n, c in counts.most_common(top):
        lines.append(f"    {c / units:6.2f}  {us[n] / c:7.1f}  {n}")
    rest = sum(c for n, c in counts.items()) - sum(c for _, c in counts.most_common(top))
    lines.append(f"    {rest / units:6.2f}  (the rest)")
    return "\n".join(lines)


def executor(part: dict) -> str:
    spans, streams = part["spans"], part.get("streams")
    if not streams:
        return "executor: no streams recorded (a profile from before session 51)"
    by = collections.defaultdict(list)
    for span, st in zip(spans, streams):
        by[st].append(span)
    lines = ["executor, by stream:"]
    for st, ss in sorted(by.items(), key=lambda kv: -len(kv[1])):
        ss.sort()
        merged = []  # (a round's wait for its runs, then its first call's wait: one wait)
        for s, e, n in ss:
            if n == WAIT and merged and merged[-1][2] == WAIT:
                merged[-1] = (merged[-1][0], e, WAIT)
            else:
                merged.append((s, e, n))
        ss = merged
        at = [i for i, (_, _, n) in enumerate(ss) if n == WAIT] + [len(ss)]
        lines.append(f"  stream {st}: {len(ss)} kernels, {len(at) - 1} word waits, busy {sum(e - s for s, e, _ in ss) / 1e3:.1f} ms")
        if len(at) < 2:
            continue
        waits, works, gaps, shapes = [], [], [], collections.Counter()
        for i, j in zip(at, at[1:]):
            call = ss[i:j]
            waits.append(call[0][1] - call[0][0])
            works.append(call[-1][1] - call[0][1])  # (from the wait's end to the call's last kernel's)
            if j < len(ss):
                gaps.append(ss[j][0] - call[-1][1])
            shapes[tuple(n for _, _, n in call[1:])] += 1
        lines.append(f"    the wait for the round's tenants: {band(waits)}")
        lines.append(f"    the call's work after it:         {band(works)}")
        lines.append(f"    idle before the next wait:        {band(gaps)}")
        shape, c = shapes.most_common(1)[0]
        lines.append(f"    the commonest call ({c} of {len(waits)}): {len(shape)} kernels: " + ", ".join(shape))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spans")
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    with gzip.open(a.spans, "rt") as f:
        parts = json.load(f)
    names = [n for n in parts if n != "executor"][:a.tenants]
    for n in names:
        print(tenant(n, parts[n], a.top))
    if "executor" in parts:
        print(executor(parts["executor"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
