"""The floor under a same-GPU round trip: two processes, the csrc doorbells and one CUDA IPC
region, and nothing else of symbiont (no protobuf, no scheduler). Each mode adds one piece of
the real call path, so the table says what each piece costs.

    python benchmarks/probes/s6_pingpong.py [--tokens 1] [--iters 3000]

Modes (the tenant times each iteration to its result being usable):
  bells        ring the executor, wait for its ring back (no GPU work)
  events       tenant: copy-in, record input_ready, ring; executor: wait_event, mm(out=) into the
               region, record output_ready, ring; tenant: wait_event, clone, synchronise
  host-sync    the same without interprocess events: each side synchronises its stream instead
  events-nomm  `events` without the GEMM (ordering and copies only)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository root
sys.path.insert(0, str(REPO))

HIDDEN = 2048
MODES = ("bells", "events", "host-sync", "events-nomm")
SPIN_US = 50_000


def _wait(bell, seen: int) -> int:
    """Waits for `bell` to move past `seen` (10 s at most); returns the new sequence."""
    deadline = time.monotonic() + 10
    while (now := bell.wait(seen, SPIN_US, 100_000)) == seen:
        if time.monotonic() > deadline:
            raise TimeoutError("the other side stopped answering")
    return now


def _executor(conn, tokens: int, iters: int) -> None:
    from symbiont.proto import mailbox
    from symbiont.proto._doorbell import Doorbell
    from symbiont.proto.cuda_ipc import DeviceRegion

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    fd, mem = mailbox.create_region("s6-pingpong", 4096)
    req, rep = Doorbell(mem, 0), Doorbell(mem, 64)
    region = DeviceRegion.allocate(dev, 4 << 20)
    w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16)
    seen = req.seq()  # the tenant may ring again before we loop round: compare with the last seen
    conn.send((os.getpid(), fd, region.nbytes, *region.handles()))
    conn.recv()  # tenant mapped everything
    s = torch.cuda.current_stream(dev)
    x = region.view(0, (tokens, HIDDEN), torch.bfloat16)
    y = region.view(1 << 20, (tokens, HIDDEN), torch.bfloat16)
    wt = w.t()
    for mode in MODES:
        for _ in range(iters):
            seen = _wait(req, seen)
            if mode in ("events", "events-nomm"):
                s.wait_event(region.input_ready)
                if mode == "events":
                    torch.mm(x, wt, out=y)
                else:
                    y.copy_(x)
                region.output_ready.record(s)
            elif mode == "host-sync":
                torch.mm(x, wt, out=y)
                s.synchronize()
            rep.ring()
    conn.recv()
    region.free()


def _tenant(conn, tokens: int, iters: int) -> dict[str, float]:
    from symbiont.proto import mailbox
    from symbiont.proto._doorbell import Doorbell
    from symbiont.proto.cuda_ipc import OpenedRegion

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    pid, fd, nbytes, mem_h, in_h, out_h = conn.recv()
    mem = mailbox.open_region(pid, fd, 4096)
    req, rep = Doorbell(mem, 0), Doorbell(mem, 64)
    region = OpenedRegion.open(dev, nbytes, mem_h, in_h, out_h)
    seen = rep.seq()
    conn.send("ready")
    s = torch.cuda.current_stream(dev)
    src = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
    x = region.view(0, (tokens, HIDDEN), torch.bfloat16)
    y = region.view(1 << 20, (tokens, HIDDEN), torch.bfloat16)
    medians = {}
    for mode in MODES:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            if mode != "bells":
                x.copy_(src)
                if mode == "host-sync":
                    s.synchronize()
                else:
                    region.input_ready.record(s)
            req.ring(wake_always=True)
            seen = _wait(rep, seen)
            if mode != "bells":
                if mode != "host-sync":
                    s.wait_event(region.output_ready)
                y.clone()
                s.synchronize()
            times.append(time.perf_counter_ns() - t0)
        medians[mode] = statistics.median(times[iters // 10 :]) / 1e3
    conn.send("done")
    return medians


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_executor, args=(there, a.tokens, a.iters))
    proc.start()
    medians = _tenant(here, a.tokens, a.iters)
    proc.join(60)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "s6_pingpong.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "tokens": a.tokens, "median_us": medians}, indent=2))
    print(f"\ntwo-process ping-pong, {a.tokens} x {HIDDEN} bf16, median µs ({torch.cuda.get_device_name()})")
    for mode, us in medians.items():
        print(f"{mode:12s} {us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
