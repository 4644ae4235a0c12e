"""Does a same-GPU handoff between two processes slow down while other processes' streams wait on
words? (GPU, MPS on; written in session 42, not yet run.)

A decoding tenant's token is ~19 handoffs on the GPU: its stream writes a word the executor's
stream waits for, and back (cuStreamWriteValue32 / cuStreamWaitValue32, csrc/stream_ops.cpp). At
16 tenants many streams wait on words at once. Going from 1 to 8 tenants made a tenant's token 1.5x
slower (20 to ~31 ms on an H200, benchmarks/RESULTS.md session 42), from 8 to 16 not at all,
while a process went from 26.4 ms alone to 28-37 ms at 16. If the GPU's front end serves waiting streams more slowly the more of them there are, this
shows it: processes A and B pass a word back and forth `--iters` times, queued ahead on both sides
and timed on the GPU (CUDA events around A's chain), while `--blocked` streams of other processes
wait on a word that is written only at the end.

    python3 benchmarks/probes/blocked_streams.py --blocked 0,16,64
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root

NBYTES = 4096
AB, BA, START, RELEASE = 0, 64, 128, 192  # the words' offsets in the shared region
BLOCKERS_PER_PROCESS = 8


def _open(handles, dev):
    from symbiont.proto.cuda_ipc import OpenedRegion

    return OpenedRegion.open(dev, NBYTES, *handles)


def _pong(handles, conn) -> None:
    """Process B: for each round (base, n, start) it is sent, queues n times [wait AB >= base + i;
    write BA = base + i] behind a wait for START >= start, and says it has queued them."""
    from symbiont.proto import _stream_ops as ops

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    region = _open(handles, dev)
    s = torch.cuda.Stream(dev)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        base, n, start = msg
        ops.wait_word(s.cuda_stream, region.ptr + START, start)
        for i in range(n):
            ops.wait_word(s.cuda_stream, region.ptr + AB, base + i)
            ops.write_word(s.cuda_stream, region.ptr + BA, base + i)
        conn.send("queued")
    torch.cuda.synchronize(dev)
    region.close()


def _blocker(handles, streams: int, conn) -> None:
    """A process whose `streams` streams each wait for RELEASE >= 1, then add to a tensor."""
    from symbiont.proto import _stream_ops as ops

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    region = _open(handles, dev)
    x = torch.zeros(1024, device=dev)
    x.add_(1)  # (its kernel loaded now: loading it later would synchronise this context, blocked streams included)
    torch.cuda.synchronize(dev)
    kept = []
    for _ in range(streams):
        s = torch.cuda.Stream(dev)
        ops.wait_word(s.cuda_stream, region.ptr + RELEASE, 1)
        with torch.cuda.stream(s):
            x.add_(1)
        kept.append(s)
    conn.send("blocked")
    conn.recv()  # (released)
    torch.cuda.synchronize(dev)
    region.close()


def main() -> None:
    from symbiont.proto import _stream_ops as ops
    from symbiont.proto.cuda_ipc import DeviceRegion

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocked", default="0,16,64", help="comma list: streams of other processes waiting meanwhile")
    p.add_argument("--iters", type=int, default=200, help="round trips a measurement (queued ahead behind a gate: "
                   "a stream holds about a thousand queued operations before its host blocks)")
    p.add_argument("--rounds", type=int, default=10, help="measurements for each --blocked value")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ctx = mp.get_context("spawn")
    region = DeviceRegion.allocate(dev, NBYTES)
    handles = region.handles()
    mine, theirs = ctx.Pipe()
    pong = ctx.Process(target=_pong, args=(handles, theirs))
    pong.start()
    s, writer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    base, start = 1, 0
    rows = []
    for blocked in (int(b) for b in a.blocked.split(",")):
        ops.write_word(writer.cuda_stream, region.ptr + RELEASE, 0)
        torch.cuda.synchronize(dev)
        blockers = []
        for k in range(0, blocked, BLOCKERS_PER_PROCESS):
            c_mine, c_theirs = ctx.Pipe()
            proc = ctx.Process(target=_blocker, args=(handles, min(BLOCKERS_PER_PROCESS, blocked - k), c_theirs))
            proc.start()
            blockers.append((proc, c_mine))
        for _, c in blockers:
            assert c.recv() == "blocked"
        per_handoff = []
        for _ in range(a.rounds):
            start += 1
            mine.send((base, a.iters, start))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ops.wait_word(s.cuda_stream, region.ptr + START, start)
            e0.record(s)
            for i in range(a.iters):
                ops.write_word(s.cuda_stream, region.ptr + AB, base + i)
                ops.wait_word(s.cuda_stream, region.ptr + BA, base + i)
            e1.record(s)
            assert mine.recv() == "queued"
            ops.write_word(writer.cuda_stream, region.ptr + START, start)  # both chains go
            torch.cuda.synchronize(dev)
            per_handoff.append(e0.elapsed_time(e1) * 1000 / (2 * a.iters))
            base += a.iters
        ops.write_word(writer.cuda_stream, region.ptr + RELEASE, 1)
        torch.cuda.synchronize(dev)
        for proc, c in blockers:
            c.send("go")
            proc.join(60)
        rows.append({"blocked_streams": blocked, "handoff_us_median": round(statistics.median(per_handoff), 2),
                     "handoff_us_all": [round(x, 2) for x in per_handoff]})
        print(json.dumps(rows[-1]), flush=True)
    mine.send(None)
    pong.join(60)
    region.free()


if __name__ == "__main__":
    main()
