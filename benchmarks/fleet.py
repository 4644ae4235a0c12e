"""What the many-tenant runners (S2-S5) share: start an executor, start a fleet of tenant processes
(benchmarks/fleet_worker.py), release them together, collect their results, sample the GPU's
memory while they run, and turn their timestamps into throughput and latency figures.

Each fleet is timed over one window: every worker warms up, says ready, and is told `go` with a
common start; it works until the window ends. Aggregate throughput is the sum of each worker's own
rate (its tokens over its own elapsed time from the start), so no worker's tail counts alone.
"""
from __future__ import annotations

import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import threading
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WORKER = str(REPO / "benchmarks" / "fleet_worker.py")


def executor_variants(a) -> list[tuple[str, list[str]]]:
    """The executors a runner compares: `--executors "NAME=FLAGS;NAME=FLAGS"` (each started with those
    serve flags), else one per `--policies` entry with `--serve-args`."""
    if getattr(a, "executors", ""):
        out = []
        for item in a.executors.split(";"):
            name, _, flags = item.partition("=")
            out.append((name.strip(), flags.split()))
        return out
    return [(p, ["--policy", p, *a.serve_args.split()]) for p in a.policies.split(",")]


def alternating(items: list, rounds: int) -> list:
    """`items` `rounds` times, every other time in reverse order (a fleet run first on a fresh
    executor has run slow)."""
    return [x for r in range(rounds) for x in (items if r % 2 == 0 else items[::-1])]


def tenant_variants(spec: str, rounds: int = 1) -> list[tuple[str, list[str]]]:
    """The tenant fleets a runner runs on each executor: `--tenant-flags "NAME=WORKER FLAGS;..."`
    (fleet_worker.py's flags), alternating over `rounds`; [("", [])] without a spec."""
    variants = [(n.strip(), f.split()) for n, _, f in (item.partition("=") for item in spec.split(";"))] if spec else [("", [])]
    return alternating(variants, rounds)


def start_executor(model: str, device: str, *flags: str, log_dir: pathlib.Path,
                   profile_out: pathlib.Path | None = None) -> tuple[subprocess.Popen, str]:
    """A `base-executor serve` on a fresh local:// name; with `profile_out`, under
    benchmarks/profiled_serve.py (its GPU work recorded between two signals: run_profiled)."""
    from symbiont import wait_for_executor

    url = f"local://fleet-{uuid.uuid4().hex[:8]}"
    log = open(log_dir / f"executor_{url.split('//')[1]}.log", "wb")
    launch = [str(REPO / "benchmarks" / "profiled_serve.py"), str(profile_out)] if profile_out else ["-m", "symbiont.base_executor.cli"]
    cmd = [sys.executable, *launch, "serve", "--model", model, "--listen", url,
           "--device", device, "--dtype", "bfloat16", *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    wait_for_executor(url, 600, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


class GpuMemory:
    """Samples the GPUs' used memory (nvidia-smi, every `period` s) while a fleet runs: the maximum
    of GPU 0 (`peak`) and of each GPU (`peaks`)."""

    def __init__(self, period: float = 0.5):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append([int(line) * 2**20 for line in out.split()])
            except Exception:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return self.peaks[0] if self.samples else 0

    @property
    def peaks(self) -> list[int]:
        return [max(col) for col in zip(*self.samples)]


def free_port() -> int:
    """A TCP port free on this host now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lines(procs: list[subprocess.Popen]) -> queue.Queue:
    """Every worker's stdout lines as they come, as (its number, line), then (its number, None)."""
    q = queue.Queue()

    def pump(i, f):
        for line in f:
            q.put((i, line))
        q.put((i, None))

    for i, p in enumerate(procs):
        threading.Thread(target=pump, args=(i, p.stdout), name=f"worker-{i}-stdout", daemon=True).start()
    return q


def _next_line(lines: queue.Queue, deadline: float, waiting_for: str):
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise RuntimeError(f"{waiting_for} within the fleet's timeout") from None


def run_fleet(workers: list[list[str]], seconds: float, timeout_s: float = 900, on_go=None, per_gpu: bool = False):
    """Starts one process per argument list (fleet_worker.py's; one with `--tenants N` gives N
    results), waits for every `ready`, says `go`
    to all with one start time (then calls `on_go(start, pids)`: a profiler of the steady state), and returns
    (their results, GPU 0's used memory before they started, its peak while they worked); with
    per_gpu, those two for every GPU (lists)."""
    wants = [int(w[w.index("--tenants") + 1]) if "--tenants" in w else 1 for w in workers]  # (result lines a worker gives)
    base = GpuMemory()
    with base:
        time.sleep(0.6)
    procs = [subprocess.Popen([sys.executable, WORKER, *w, "--seconds", str(seconds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO) for w in workers]
    try:
        lines = _lines(procs)
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(procs)))
        while pending:  # (any worker's line as it comes: one stuck in its warm-up does not hide another that died)
            i, line = _next_line(lines, deadline, f"{len(pending)} of {len(procs)} workers not ready")
            if line is None:
                raise RuntimeError(f"worker {i} ended before it was ready (exit code {procs[i].wait()})")
            if line.strip() == "ready":
                pending.discard(i)
        with GpuMemory() as mem:
            start = time.time() + 0.2
            for p in procs:
                p.stdin.write(f"go {start!r}\n")
                p.stdin.flush()
            if on_go is not None:
                on_go(start, [p.pid for p in procs])
            got, ended = [[] for _ in procs], [False] * len(procs)
            deadline = time.monotonic() + timeout_s
            while any(len(g) < want and not end for g, want, end in zip(got, wants, ended)):
                i, line = _next_line(lines, deadline, "results")
                if line is None:
                    ended[i] = True
                elif line.startswith("result "):
                    got[i].append(json.loads(line[len("result "):]))
            for p in procs:
                p.wait(timeout_s)
        results = [r for g in got for r in g]  # (in the workers' order)
        if len(results) != sum(wants):
            raise RuntimeError(f"{sum(wants) - len(results)} of {sum(wants)} results missing (a worker failed)")
        return (results, base.peaks, mem.peaks) if per_gpu else (results, base.peak, mem.peak)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def run_profiled(workers: list[list[str]], seconds: float, names: list[str], tokens_per_unit: int, out: pathlib.Path,
                 stem: str, title: str, executor: tuple[subprocess.Popen, pathlib.Path] | None = None,
                 window: tuple[float, float] = (0.4, 0.6)) -> dict:
    """Runs a fleet once more with every process's GPU work and CPU time recorded over the middle
    of its window (benchmarks/fleet_timeline.py): each worker's, and the executor's when given as
    (its process, the profile file it was started with). Prints the summary, writes it (JSON), the
    raw spans (JSON, gzip) and a timeline slice (PNG) as out/STEM_*, and returns the summary."""
    import gzip
    import re

    import fleet_timeline

    stem = re.sub(r"[^A-Za-z0-9_.=+-]+", "-", stem)  # (a name the device's file return takes: no commas, no spaces)
    paths = [out / f"{stem}_{i}.profile.json" for i in range(len(workers))]
    for path in paths:
        path.unlink(missing_ok=True)
    marked = [[*w, "--profile", str(path), "--profile-window", f"{window[0]},{window[1]}"] for w, path in zip(workers, paths)]
    spans = {}

    def on_go(start, _pids):
        if executor is not None:
            executor[1].unlink(missing_ok=True)
            spans["executor"] = fleet_timeline.ExecutorWindow(executor[0].pid, executor[1], start + window[0] * seconds,
                                                             start + window[1] * seconds)

    results, _, _ = run_fleet(marked, seconds, on_go=on_go)
    parts = {name: json.loads(path.read_text()) for name, path in zip(names, paths)}
    if executor is not None:
        parts["executor"] = spans["executor"].result()
    with gzip.open(out / f"{stem}_spans.json.gz", "wt") as f:
        json.dump(parts, f)
    summary = fleet_timeline.summarise(parts, tokens_per_unit)
    print(fleet_timeline.report(title, summary), flush=True)
    (out / f"{stem}_timeline.json").write_text(json.dumps(summary, indent=1))
    fleet_timeline.plot(parts, summary, out / f"{stem}_timeline.png", title)
    for path in paths:
        path.unlink(missing_ok=True)
    summary["results"] = results
    return summary


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def finetune_figures(results: list[dict]) -> dict:
    """Aggregate tokens/s (each worker's own rate, summed) and step times p50/p99."""
    rates, steps = [], []
    for r in results:
        ends = r["ends"]
        rates.append(len(ends) * r["tokens_per_step"] / (ends[-1] - r["start"]))
        steps += [b - a for a, b in zip([r["start"], *ends[:-1]], ends)]
    return {"tokens_per_s": sum(rates), "step_p50_ms": 1e3 * pct(steps, 0.5), "step_p99_ms": 1e3 * pct(steps, 0.99),
            "steps": len(steps)}


def infer_figures(results: list[dict]) -> dict:
    """Aggregate generated tokens/s and inter-token latency p50/p99 over every tenant's tokens (the
    first token, which ends the prefill, is left out of the latencies), and the worst tenant's own
    p99 (S3's latency goal is each tenant's)."""
    rates, gaps, worst = [], [], 0.0
    for r in results:
        runs = r["runs"]
        tokens = sum(len(run) - 1 for run in runs) * r["rows"]
        rates.append(tokens / (runs[-1][-1] - r["start"]))
        mine = [b - a for run in runs for a, b in zip(run[1:-1], run[2:])]
        gaps += mine
        worst = max(worst, pct(mine, 0.99) if mine else 0.0)
    out = {"tokens_per_s": sum(rates), "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99),
           "itl_p99_worst_ms": 1e3 * worst, "runs": sum(len(r["runs"]) for r in results)}
    graphed = [r["step_graphs"] for r in results if "step_graphs" in r]  # (fleet_worker --step-graphs)
    if graphed:
        out["step_graphs"] = {"captures": sum(g["captures"] for g in graphed), "replays": sum(g["replays"] for g in graphed),
                              "failures": sorted({f for g in graphed for f in g["failures"]})[:3]}
    return out


def executor_stats(url: str) -> dict:
    """The executor's counters now (symbiont.base_executor's StatsReply as a dict)."""
    from google.protobuf.json_format import MessageToDict

    from symbiont import connect

    with connect(url) as conn:
        return MessageToDict(conn.stats(), preserving_proto_field_name=True)


def batch_share(before: dict, after: dict) -> dict:
    """Calls per batch over a window, from two stats snapshots."""
    d = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in ("calls", "batches", "tokens", "native_calls", "graph_replays")}
    d["calls_per_batch"] = d["calls"] / d["batches"] if d["batches"] else float("nan")
    cls_before = {c.get("latency", "TRAINING"): c for c in before.get("classes", [])}
    for c in after.get("classes", []):
        name = c.get("latency", "TRAINING")
        b = cls_before.get(name, {})
        hist = [int(x) - int(y) for x, y in zip(c.get("batch_calls", []), b.get("batch_calls", [0] * 99))]
        d[f"{name.lower()}_batch_calls"] = hist
        d[f"{name.lower()}_wait_p50_us"] = c.get("wait_p50_us")
        d[f"{name.lower()}_wait_p99_us"] = c.get("wait_p99_us")
    # how the data loop took the window's calls (base_executor/transports/call_paths.py), and the
    # share of the window's time it was at work
    paths_before = before.get("call_paths", {})
    d["call_paths"] = {k: int(v) - int(paths_before.get(k, 0)) for k, v in after.get("call_paths", {}).items()}
    up = float(after.get("uptime_s", 0.0)) - float(before.get("uptime_s", 0.0))
    d["loop_busy_share"] = (float(after.get("loop_busy_s", 0.0)) - float(before.get("loop_busy_s", 0.0))) / up if up > 0 else None
    return d


def host_figures(batches: dict) -> str:
    """A window's native-lane share of the calls, the late share of those and the data loop's share of
    time at work (batch_share), as "native 96%, late 12%, loop 40%"; "" when not known."""
    from symbiont.base_executor.transports.call_paths import LATE, NATIVE

    paths = batches.get("call_paths") or {}
    late = paths.get(LATE, 0)
    taken = sum(v for k, v in paths.items() if k != LATE)
    native = paths.get(NATIVE, 0)
    busy = batches.get("loop_busy_share")
    if not taken or busy is None:
        return ""
    return f"native {native / taken:.0%}, late {late / max(native, 1):.0%}, loop {busy:.0%}"


def py_spy(pid: int, seconds: float, path: pathlib.Path, native: bool = False) -> subprocess.Popen:
    """Samples process `pid` with py-spy (idle frames included; with `native`, C/C++ frames too,
    which py-spy reads only with the process paused at each sample) into `path` (collapsed stacks)."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "250", "--duration", str(max(1, int(seconds))),
                             "--idle", *(["--native"] if native else ["--nonblocking"]), "--format", "raw", "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_spy(spy: subprocess.Popen, seconds: float) -> None:
    """Waits for a py_spy() sampler, killed after `seconds` more than its duration (a sampler of
    the executor once never returned; what it wrote stays)."""
    try:
        spy.wait(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def mps_running() -> bool:
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))
