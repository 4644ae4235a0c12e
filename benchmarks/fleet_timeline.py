"""A GPU timeline of every process of a many-tenant fleet (S2, S3: `--gpu-profile N`), and the CPU
each spent, over one window of wall-clock time shared by all of them.

Each worker (fleet_worker.py `--profile PATH`) records its GPU's kernels and copies with
torch.profiler from its first step or token boundary after the window opens to the first after it
closes, and writes them with its CPU seconds and the steps or tokens it finished meanwhile. The
executor records through benchmarks/profiled_serve.py, told by signals (`ExecutorWindow`).
`summarise` then clips everything to the window all of them recorded and says:

- how busy the GPU was: the union of every process's work, and each process's own;
- how much kernel time each process put on it, per 1000 tokens, by kind of kernel (GEMM,
  attention, elementwise, copies, ...): the GPU work one token costs each side;
- the mean concurrency (kernel time over busy time: what MPS or the executor's streams overlapped);
- the same without the word waits: the one-thread kernels that spin until a mailbox word reaches a
  number (a step program's handovers, client/transports/graph_words.py, base_executor/kernels/
  gang_words.py) are kernels too, so with them the GPU reads busy while it waits;
- kernels launched per token, all processes together (the rate of small kernels under MPS may be
  what many decoding tenants share);
- each process's CPU use over the window.

`plot` draws a slice of the window, one row per process, kernels coloured by kind.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import resource
import signal
import threading
import time

KINDS = (  # (the first whose word the kernel's name holds)
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "splitkreduce", "cublas")),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("copy", ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy", "bfloat16_copy", "index_select", "gather")),
    ("optimizer", ("multi_tensor", "adam")),
    ("softmax/loss", ("softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("reduce", ("reduce_kernel", "norm")),
    ("triton", ("triton",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill")),
)


WORD_WAITS = ("wait",)  # kernels that spin on a mailbox word (their whole names)


def kind_of(name: str) -> str:
    low = name.lower()
    if low in WORD_WAITS:
        return "word wait"
    for kind, words in KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


class WindowProfiler:
    """A worker's side: `tick(units)` at every step or token boundary; it starts torch.profiler at
    the first tick at or after `t0` (wall clock), counts the units finished after that, stops at
    the first tick at or after `t1` and writes `path`."""

    def __init__(self, path: str, t0: float, t1: float, sync=None):
        self.path, self.t0, self.t1, self.sync = pathlib.Path(path), t0, t1, sync
        self.prof, self.done, self.units = None, False, 0

    def tick(self, units: int = 0) -> None:
        if self.done:
            return
        now = time.time()
        if self.prof is None:
            if now >= self.t0:
                import torch
                from torch.profiler import ProfilerActivity, profile

                self.cpu_only = not torch.cuda.is_available()  # (a smoke test: the CPU's ops stand in)
                self.prof = profile(activities=[ProfilerActivity.CPU if self.cpu_only else ProfilerActivity.CUDA])
                self.prof.start()
                self.wall0, self.cpu0 = now, _cpu_s()
            return
        self.units += units
        if now >= self.t1:
            if self.sync is not None:
                self.sync()
            cpu, wall = _cpu_s() - self.cpu0, time.time() - self.wall0
            self.prof.stop()
            from profiled_serve import gpu_work, trace_origin_us

            work = gpu_work(self.prof.events(), spans=True, origin_us=trace_origin_us(self.prof), cpu=self.cpu_only)
            work.update(units=self.units, wall_s=wall, cpu_s=cpu)
            self.path.write_text(json.dumps(work))
            self.prof, self.done = None, True


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ExecutorWindow:
    """The runner's side for the executor (started through profiled_serve.py writing `path`):
    signals it to record from a little before the window to a little after, and notes its CPU
    seconds over the same span."""

    def __init__(self, pid: int, path: pathlib.Path, t0: float, t1: float):
        self.pid, self.path = pid, pathlib.Path(path)
        self.cpu = {}
        self.thread = threading.Thread(target=self._run, args=(t0 - 0.3, t1 + 0.5), daemon=True)
        self.thread.start()

    def _run(self, t0, t1):
        time.sleep(max(0.0, t0 - time.time()))
        self.cpu["start"] = (time.time(), _proc_cpu_s(self.pid))
        os.kill(self.pid, signal.SIGUSR1)
        time.sleep(max(0.0, t1 - time.time()))
        self.cpu["stop"] = (time.time(), _proc_cpu_s(self.pid))
        os.kill(self.pid, signal.SIGUSR2)

    def result(self, timeout_s: float = 120) -> dict:
        self.thread.join()
        deadline = time.monotonic() + timeout_s
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the executor wrote no profile to {self.path}")
            time.sleep(0.05)
        work = json.loads(self.path.read_text())
        (w0, c0), (w1, c1) = self.cpu["start"], self.cpu["stop"]
        work.update(units=0, wall_s=w1 - w0, cpu_s=c1 - c0)
        return work


def _clip(spans, lo, hi):
    return [(max(s, lo), min(e, hi), n) for s, e, n in spans if e > lo and s < hi]


def _union_ms(spans) -> float:
    busy, reach = 0.0, None
    for s, e, _ in sorted(spans):
        if reach is None or s >= reach:
            busy, reach = busy + e - s, e
        elif e > reach:
            busy, reach = busy + e - reach, e
    return busy / 1e3


GAP_BANDS_US = (5, 20, 50, 100, 300, 1000)


def gap_bands(spans) -> dict:
    """The idle time between one process's consecutive kernels, by length: {"<5", "5-20", ...,
    ">=1000" µs: [count, ms]}. Short gaps are the GPU's own pace or the host's launch rate; at
    a same-GPU tenant, its calls' round trips show as a band of their own."""
    edges = (0, *GAP_BANDS_US, float("inf"))
    names = [f"{lo:g}-{hi:g}" if hi != float("inf") else f">={lo:g}" for lo, hi in zip(edges, edges[1:])]
    out = {n: [0, 0.0] for n in names}
    ordered = sorted(spans)
    for (_, end, _), (start, _, _) in zip(ordered, ordered[1:]):
        gap = start - end
        if gap <= 0:
            continue
        for n, lo, hi in zip(names, edges, edges[1:]):
            if lo <= gap < hi:
                out[n][0] += 1
                out[n][1] += gap / 1e3
                break
    return out


TOP_KERNELS, TOP_NAME = 12, 90  # a worker's kernels by name in the summary: how many, and their names cut to


def summarise(parts: dict[str, dict], tokens_per_unit: int) -> dict:
    """`parts`: who -> a profile (WindowProfiler's or ExecutorWindow's); workers' names start with
    "tenant" or "process", the executor's is "executor". Everything is clipped to the span every
    worker recorded."""
    workers = {k: v for k, v in parts.items() if k != "executor" and v["spans"]}
    if not workers:
        raise RuntimeError("no worker recorded any work")
    lo = max(v["spans"][0][0] for v in workers.values())
    hi = min(max(e for _, e, _ in v["spans"]) for v in workers.values())
    window_ms = (hi - lo) / 1e3
    # each worker's tokens in the window: its units at its own rate over what it recorded
    tokens = sum(v["units"] * tokens_per_unit * window_ms / (1e3 * v["wall_s"]) for v in workers.values())
    rows, every = {}, []
    for who, v in parts.items():
        spans = _clip(v["spans"], lo, hi)
        every += spans
        by_kind, by_name, launches = collections.Counter(), collections.Counter(), collections.Counter()
        for s, e, n in spans:
            by_kind[kind_of(n)] += (e - s) / 1e3
            by_name[n[:TOP_NAME]] += (e - s) / 1e3
            launches[n[:TOP_NAME]] += 1
        kernel_ms = sum(by_kind.values())
        rows[who] = {
            "busy_ms": _union_ms(spans), "kernel_ms": kernel_ms, "launches": len(spans),
            "kernel_ms_per_1k_tokens": 1e3 * kernel_ms / tokens if tokens else float("nan"),
            "by_kind_ms_per_1k_tokens": {k: 1e3 * ms / tokens for k, ms in by_kind.most_common()} if tokens else {},
            "cpu_share": v["cpu_s"] / v["wall_s"] if v.get("wall_s") else float("nan"),
            "tokens_per_s": v["units"] * tokens_per_unit / v["wall_s"] if v.get("wall_s") and v["units"] else 0.0,
            "gaps_us": gap_bands(spans),
            # (its kernels by name, the most time first: launches a token, µs a launch)
            "top_kernels": [(n, launches[n] / tokens if tokens else float("nan"), 1e3 * ms / launches[n])
                            for n, ms in by_name.most_common(TOP_KERNELS)],
        }
    busy = _union_ms(every)
    working = _union_ms([sp for sp in every if kind_of(sp[2]) != "word wait"])
    waits = sum(e - s for s, e, n in every if kind_of(n) == "word wait") / 1e3
    total_kernel = sum(r["kernel_ms"] for r in rows.values())
    kinds = collections.Counter()
    for r in rows.values():
        kinds.update(r["by_kind_ms_per_1k_tokens"])
    return {
        "window_ms": window_ms, "tokens_in_window": tokens, "gpu_busy_share": busy / window_ms,
        "mean_concurrency": total_kernel / busy if busy else float("nan"),
        "gpu_working_share": working / window_ms,  # (the word waits left out)
        "launches_per_token": len(every) / tokens if tokens else float("nan"),
        "working_concurrency": (total_kernel - waits) / working if working else float("nan"),
        "kernel_ms_per_1k_tokens": 1e3 * total_kernel / tokens if tokens else float("nan"),
        "by_kind_ms_per_1k_tokens": dict(kinds.most_common()), "processes": rows, "window_us": [lo, hi],
    }


def report(title: str, s: dict) -> str:
    lines = [f"{title}: window {s['window_ms']:.1f} ms, {s['tokens_in_window']:.0f} tokens; GPU busy "
             f"{100 * s['gpu_busy_share']:.1f}% (union of all), mean concurrency {s['mean_concurrency']:.2f}; "
             f"kernel ms per 1k tokens {s['kernel_ms_per_1k_tokens']:.2f}; without the word waits: busy "
             f"{100 * s['gpu_working_share']:.1f}%, mean concurrency {s['working_concurrency']:.2f}; "
             f"{s['launches_per_token']:.0f} kernels a token",
             "    by kind, all processes: " + ", ".join(f"{k} {v:.2f}" for k, v in s["by_kind_ms_per_1k_tokens"].items())]
    for who, r in s["processes"].items():
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in list(r["by_kind_ms_per_1k_tokens"].items())[:5])
        lines.append(f"    {who:<12} busy {r['busy_ms']:8.1f} ms, kernels {r['kernel_ms']:8.1f} ms ({r['launches']}), "
                     f"{r['kernel_ms_per_1k_tokens']:6.2f} ms/1k tok [{kinds}], CPU {100 * r['cpu_share']:.0f}%")
        lines.append("                 idle between its kernels, µs: " + ", ".join(
            f"{band} {n} x = {ms:.1f} ms" for band, (n, ms) in r["gaps_us"].items() if n))
        if who in ("executor", "tenant 0", "process 0"):
            lines += [f"                 {per:7.1f} a token x {us:7.1f} µs  {name}" for name, per, us in r["top_kernels"]]
    return "\n".join(lines)


def plot(parts: dict[str, dict], s: dict, path: pathlib.Path, title: str, slice_ms: float = 40.0) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lo = (s["window_us"][0] + s["window_us"][1]) / 2 - slice_ms * 500
    hi = lo + slice_ms * 1e3
    colours = dict(zip([k for k, _ in KINDS] + ["other"], plt.get_cmap("tab10").colors))
    names = list(parts)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(names) + 1.5))
    for row, who in enumerate(names):
        spans = _clip(parts[who]["spans"], lo, hi)
        for kind in colours:
            bars = [((a - lo) / 1e3, (b - a) / 1e3) for a, b, n in spans if kind_of(n) == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colours[kind], label=kind)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), loc="upper right", fontsize=7, ncol=len(seen))
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("ms")
    ax.set_xlim(0, slice_ms)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
