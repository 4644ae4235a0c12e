"""Where a same-GPU round trip goes: the host cost of each operation on the call path, measured
alone, then a real call sampled on both sides by py-spy (the tenant, and a real
`base-executor serve` process) while calls run back to back.

    pip install py-spy; python benchmarks/s6_profile.py [--tokens 1] [--seconds 8] [--out DIR]

Prints the per-operation table and, per process, the frames with the most samples (own and
inclusive); writes s6_profile.json and py-spy's collapsed stacks to --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from s6_transport import HIDDEN, UNIT, make_model  # noqa: E402


def host_us(fn, n: int = 3000) -> float:
    """Median host time of fn() (no synchronisation: the CPU cost of issuing it)."""
    for _ in range(200):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def op_costs(tokens: int) -> dict[str, float]:
    from symbiont.proto import executor_pb2 as pb
    from symbiont.proto.cuda_ipc import DeviceRegion

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    bf = torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf)
    w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf)
    y = torch.empty(tokens, HIDDEN, device=dev, dtype=bf)
    region = DeviceRegion.allocate(dev, 1 << 20)
    s = torch.cuda.current_stream(dev)
    ev = region.input_ready
    req = pb.CallRequest(unit=UNIT, op=pb.FORWARD, dtype=3, shape=[tokens, HIDDEN], latency=pb.INFERENCE, call_id=7)
    raw = req.SerializeToString()
    costs = {
        "torch.add (16 elements)": host_us(lambda a=torch.ones(16, device=dev): torch.add(a, a)),
        "region.view (slice+view+view)": host_us(lambda: region.view(0, (tokens, HIDDEN), bf)),
        "copy_ into a view": host_us(lambda v=region.view(0, (tokens, HIDDEN), bf): v.copy_(x)),
        "clone": host_us(lambda: x.clone()),
        "F.linear": host_us(lambda: torch.nn.functional.linear(x, w)),
        "torch.mm(out=)": host_us(lambda: torch.mm(x, w.t(), out=y)),
        "torch.cuda.current_stream(dev)": host_us(lambda: torch.cuda.current_stream(dev)),
        "torch.cuda.current_stream()": host_us(lambda: torch.cuda.current_stream()),
        "event.record(stream)": host_us(lambda: ev.record(s)),
        "stream.wait_event(event)": host_us(lambda: s.wait_event(ev)),
        "CallRequest build+serialize": host_us(
            lambda: pb.CallRequest(unit=UNIT, op=1, dtype=3, shape=[tokens, HIDDEN], latency=2, call_id=7).SerializeToString()
        ),
        "CallRequest parse": host_us(lambda: pb.CallRequest.FromString(raw)),
        "time.monotonic": host_us(time.monotonic),
    }
    region.free()
    return costs


def profile_round_trip(model_dir: str, tokens: int, seconds: float, out: pathlib.Path) -> tuple[float, str, str]:
    """Times calls, then samples both processes with py-spy while calls keep running."""
    from symbiont import connect, wait_for_executor
    from symbiont.proto import executor_pb2 as pb

    url = f"local://s6prof-{os.getpid()}"
    cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", model_dir, "--listen", url, "--device", "cuda:0",
           "--dtype", "bfloat16", "--max-wait-us", "0", "--inference-wait-us", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_executor(url, 120, proc)
        conn = connect(url)
        conn.ensure_attached("cuda:0")
        t = conn.transport
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda:0")

        def one():
            t.call(UNIT, pb.FORWARD, x, (tokens, HIDDEN), torch.bfloat16, pb.INFERENCE)
            torch.cuda.synchronize()

        for _ in range(200):
            one()
        times = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            one()
            times.append(time.perf_counter_ns() - t0)
        median = statistics.median(times) / 1e3
        spies = [
            subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "997", "--duration", str(int(seconds)), "--idle",
                              "--nonblocking", "--format", "raw", "--output", str(out / f"{who}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for who, pid in (("tenant", os.getpid()), ("executor", proc.pid))
        ]
        calls = 0
        t_end = time.monotonic() + seconds + 3
        while time.monotonic() < t_end or any(s.poll() is None for s in spies):
            one()
            calls += 1
            if time.monotonic() > t_end + 60:  # a py-spy that never finishes (seen once on the executor)
                for s in spies:
                    s.kill()
                print("py-spy did not finish within 60 s of its duration: stopped", file=sys.stderr)
                break
        conn.close()
    finally:
        proc.send_signal(2)
        proc.wait(60)
    return median, top_frames(out / "tenant.txt"), top_frames(out / "executor.txt")


OUR_PACKAGES = ("base_executor", "client", "proto", "symbiont")


WAITS = (  # (a name, a piece of the innermost frame): where a decoding worker's main thread waits
    ("generate's stop check (a GPU sync each token)", "__call__ (transformers/generation/utils.py"),
    ("the attention mask's .all() (a GPU sync after the embedding call)", "_ignore_causal_mask_sdpa"),
    ("the attention mask's .all() (a GPU sync after the embedding call)", "fast_all"),
    ("the forward's confirm (the executor's replies)", "_sleep (client/transports/local.py"),
)


def _stacks(path: pathlib.Path, within: str = ""):
    """(frames, samples) of each stack in py-spy's collapsed stacks at `path`; with `within`, only
    the stacks holding a frame of that name (one thread's)."""
    for line in path.read_text(errors="replace").splitlines():  # (a sampler killed mid-write can leave broken bytes)
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        if frames and (not within or any(within in f for f in frames)):
            yield frames, int(count)


_PYTHON = re.compile(r"\(.*\.py:\d+\)$")  # a Python frame of py-spy's: "name (path.py:line)"


def native_leaves(path: pathlib.Path, thread: str = "fleet_worker", n: int = 15) -> str:
    """From a py-spy --native profile: the shares of a worker's main thread by its innermost frame
    where that is native code (CUDA's driver, torch's C++, the C library), and the share in Python."""
    def name(frames):
        leaf = frames[-1]
        if _PYTHON.search(leaf):
            return "(Python)"
        return ("unnamed " + leaf.partition(" ")[2]) if leaf.startswith("0x") else leaf[:110]  # (no symbol: its library)

    return _shares(path, thread, name, n)


def _shares(path: pathlib.Path, thread: str, name, n: int | None = None) -> str:
    """Shares of the samples of stacks through `thread`, by name(frames), most first."""
    if not path.exists():
        return "(no samples)"
    shares, total = collections.Counter(), 0
    for frames, c in _stacks(path, thread):
        total += c
        shares[name(frames)] += c
    if not total:
        return "(no samples of the main thread)"
    return "\n".join(f"{100 * c / total:6.1f}%  {label}" for label, c in shares.most_common(n))


def waits(path: pathlib.Path, thread: str = "fleet_worker") -> str:
    """The shares of a decoding worker's main thread (stacks through `thread`) spent at the waits
    of WAITS, from py-spy's collapsed stacks, and the rest (its own host work)."""
    def name(frames):
        leaf = next((f for f in reversed(frames) if _PYTHON.search(f)), frames[-1])  # (a native profile: the innermost Python frame)
        return next((n for n, piece in WAITS if piece in leaf), "its own work (Python, launches)")

    return _shares(path, thread, name)


def top_frames(path: pathlib.Path, repo: pathlib.Path = REPO, n: int = 25, within: str = "") -> str:
    """Share of samples per frame from py-spy's collapsed stacks: own (leaf) and inclusive; with
    `within`, only the stacks holding a frame of that name (one thread's loop)."""
    if not path.exists():
        return "(no samples: is py-spy installed and allowed to ptrace?)"
    own, incl, total = collections.Counter(), collections.Counter(), 0
    for frames, c in _stacks(path, within):
        total += c
        own[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    if not total:
        return f"(no samples{' in ' + within if within else ''})"
    lines = [f"{total} samples{' in ' + within if within else ''}; own time:"]
    lines += [f"{100 * c / total:6.1f}%  {f}" for f, c in own.most_common(n)]
    lines += ["inclusive, symbiont frames:"]
    ours = (str(repo),) + tuple(f"({d}/" for d in OUR_PACKAGES)  # (py-spy names files by path, or relative to sys.path)
    lines += [f"{100 * c / total:6.1f}%  {f}" for f, c in incl.most_common() if any(o in f for o in ours)][:n]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--seconds", type=float, default=8, help="how long py-spy samples each process")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    costs = op_costs(a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp)
        median, tenant, executor = profile_round_trip(tmp, a.tokens, a.seconds, out)
    (out / "s6_profile.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "tokens": a.tokens, "round_trip_us": median, "op_host_us": costs}, indent=2))
    print(f"\nhost cost per operation, µs ({torch.cuda.get_device_name()}, {a.tokens} x {HIDDEN} bf16)")
    for k, v in costs.items():
        print(f"{v:9.1f}  {k}")
    print(f"\nround trip (unprofiled median): {median:.1f} µs")
    print("\ntenant (py-spy):\n" + tenant)
    print("\nexecutor (py-spy):\n" + executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
