"""Do GPU programs spinning on words slow everyone else's work, and does it matter where the words
are? (GPU, MPS on; written in session 52, not yet run.)

Session 52 (benchmarks/RESULTS.md): 16 decoding tenants ran 1.36x faster when every word wait (a
tenant's wait for a call's result, a gang round's wait for its members' inputs) spun with one warp
instead of four. The words are page-locked host memory: every look is a read across PCIe. If those
reads crowd out what else crosses PCIe (the GPU's fetch of every process's launches, copies to and
from the host), fewer looks (a nap between them: `SPIN_NAP_NS`) or words in device memory (looks
that stay in the GPU's L2) would give more. This measures it: `--spinners` streams of other
processes (8 a process, as MPS clients) each spin on a word with one program of the kind's warps,
while this process times, on the GPU (CUDA events):

- chain: a CUDA graph of 200 one-element adds (each kernel's start-to-start on a busy GPU);
- gemv: a graph of 10 GEMVs, 1 x 2048 by 2048 x 8192, bf16, each its own weight (a decoding
  step's weight reads: 320 MiB, more than the L2 holds);
- copies: a 4 KiB host-to-device and device-to-host copy pair, 50 times;
- handoff: two streams pass a word of the kind back and forth `--iters` times with the kind's
  kernels (client/transports/graph_words.py wait and write), as a tenant's graph and a gang round
  do; queued interleaved behind a gate (whatever hardware queue the two streams share, no wait
  stands before the write it waits for).

Kinds: `host-w4` (the default before session 52), `host-w1` (the default since), `host-w1-napN`
(one warp, N ns between looks), `device-w1` (the words in device memory).

    python3 benchmarks/probes/polling_pressure.py --spinners 0,16,64 --kinds host-w4,host-w1,host-w1-nap500,host-w1-nap2000,device-w1
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root

PAGE = 4096
SPINNERS_PER_PROCESS = 8
START, AB, BA = 0, 32, 64  # the handoff's words (int32 indices, 128 bytes apart)


def parse_kind(kind: str) -> tuple[bool, int, int]:
    """(device words, warps, nap ns) of a kind name."""
    parts = kind.split("-")
    if (parts[0] not in ("host", "device") or len(parts) not in (2, 3) or not parts[1].startswith("w")
            or (len(parts) == 3 and not parts[2].startswith("nap"))):
        raise SystemExit(f"unknown kind {kind!r}: host-wN, host-wN-napNS or device-wN")
    nap = int(parts[2][3:]) if len(parts) == 3 else 0
    return parts[0] == "device", int(parts[1][1:]), nap


class Words:
    """A page of int32 words our GPU's kernels read and write: page-locked host memory mapped for
    the GPU (as a mailbox's words page), or device memory. `gpu` is the page as a CUDA tensor;
    `set(i, v)` stores a word from the host (a CPU store, or a copy on a stream of its own)."""

    def __init__(self, device: torch.device, on_device: bool):
        from symbiont.proto.cuda_ipc import as_tensor, map_host_words, unpin_host

        self.on_device = on_device
        if on_device:
            self.gpu = torch.zeros(PAGE // 4, dtype=torch.int32, device=device)
            self._side = torch.cuda.Stream(device)
        else:
            self._mem = mmap.mmap(-1, PAGE)
            self.host = torch.frombuffer(self._mem, dtype=torch.int32)
            self.host.zero_()
            self._unpin = lambda: unpin_host(device, self.host.data_ptr())
            self.gpu = as_tensor(map_host_words(device, self.host.data_ptr(), PAGE), PAGE, device).view(torch.int32)

    def set(self, i: int, value: int) -> None:
        if self.on_device:  # (a driver write on a stream of its own: no kernel module to load while streams spin)
            from symbiont.proto.cuda_ipc import stream_write

            stream_write(self._side.cuda_stream, self.gpu.data_ptr() + 4 * i, value)
            self._side.synchronize()
        else:
            self.host[i] = value

    def close(self) -> None:
        if not self.on_device:
            torch.cuda.synchronize()
            self._unpin()


def _wait(page, i, value, warps, nap):
    from symbiont.client.transports import graph_words

    graph_words._kernels()[1][(1,)](page, i, value, NAP=nap, num_warps=warps)


def _write(page, i, value):
    from symbiont.client.transports import graph_words

    graph_words._kernels()[0][(1,)](page, i, value)


def _spinner(kind: str, streams: int, conn) -> None:
    """A process whose `streams` streams each spin on a word of its own until told to stop."""
    on_device, warps, nap = parse_kind(kind)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    words = Words(dev, on_device)
    _wait(words.gpu, 0, 0, warps, nap)  # (compiled and loaded now: loading later synchronises the context)
    torch.cuda.synchronize(dev)
    kept = [torch.cuda.Stream(dev) for _ in range(streams)]
    for k, s in enumerate(kept):
        with torch.cuda.stream(s):
            _wait(words.gpu, 32 * (k + 1), 1, warps, nap)
    conn.send("spinning")
    conn.recv()
    for k in range(streams):
        words.set(32 * (k + 1), 1)
    torch.cuda.synchronize(dev)
    words.close()
    conn.send("stopped")


def _graph_time(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, n: int) -> float:
    """Microseconds a replay of `graph` takes on `stream`, over `n` (events around the replay)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        e0.record()
        graph.replay()
        e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1000 / n


def measure(dev: torch.device, kind: str, rounds: int, iters: int) -> dict:
    """This process's four timings (median of `rounds`) while the spinners spin."""
    on_device, warps, nap = parse_kind(kind)
    s = torch.cuda.Stream(dev)
    x = torch.zeros(1, device=dev)
    ws = [torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16) for _ in range(10)]
    v = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    chain, gemv = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):  # (warm: cuBLAS's handle and workspace made outside the capture)
        x.add_(1)
        torch.nn.functional.linear(v, ws[0])
    s.synchronize()
    with torch.cuda.graph(chain, stream=s):
        for _ in range(200):
            x.add_(1)
    with torch.cuda.graph(gemv, stream=s):
        for w in ws:
            torch.nn.functional.linear(v, w)
    out = {"chain_us": [], "gemv_us": [], "copies_us": [], "handoff_us": []}
    host = torch.zeros(1024, dtype=torch.int32).pin_memory()
    buf = torch.zeros(1024, dtype=torch.int32, device=dev)
    words = Words(dev, on_device)
    gate = Words(dev, False)  # (host: released by a CPU store once both chains are queued)
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    _wait(words.gpu, START, 0, warps, nap)
    _write(words.gpu, START, 0)
    torch.cuda.synchronize(dev)
    base = 1
    for r in range(rounds):
        out["chain_us"].append(_graph_time(chain, s, 200))
        out["gemv_us"].append(_graph_time(gemv, s, 10))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            e0.record()
            for _ in range(50):
                buf.copy_(host, non_blocking=True)
                host.copy_(buf, non_blocking=True)
            e1.record()
        e1.synchronize()
        out["copies_us"].append(e0.elapsed_time(e1) * 1000 / 50)
        h0, h1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for st in (a, b):
            with torch.cuda.stream(st):
                _wait(gate.gpu, START, r + 1, 1, 0)
        h0.record(a)
        for i in range(iters):  # (interleaved: a's write, b's wait and write, a's wait)
            with torch.cuda.stream(a):
                _write(words.gpu, AB, base + i)
            with torch.cuda.stream(b):
                _wait(words.gpu, AB, base + i, warps, nap)
                _write(words.gpu, BA, base + i)
            with torch.cuda.stream(a):
                _wait(words.gpu, BA, base + i, warps, nap)
        h1.record(a)
        gate.set(START, r + 1)
        torch.cuda.synchronize(dev)
        out["handoff_us"].append(h0.elapsed_time(h1) * 1000 / (2 * iters))
        base += iters
    words.close()
    gate.close()
    return {k: round(statistics.median(v), 2) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spinners", default="0,16,64", help="comma list: spinning streams of other processes meanwhile")
    p.add_argument("--kinds", default="host-w4,host-w1,host-w1-nap500,host-w1-nap2000,device-w1",
                   help="comma list of word kinds (the module's docstring)")
    p.add_argument("--rounds", type=int, default=5, help="measurements of each timing a configuration")
    p.add_argument("--iters", type=int, default=100, help="round trips of a handoff measurement (4 launches each, "
                   "queued behind a gate: a stream holds about a thousand before its host blocks)")
    p.add_argument("--out", default="", help="a JSON file for the rows")
    a = p.parse_args()
    for kind in a.kinds.split(","):
        parse_kind(kind)
    if not torch.cuda.is_available():
        raise SystemExit("polling_pressure.py measures a GPU: none here")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ctx = mp.get_context("spawn")
    rows = []
    for kind in a.kinds.split(","):
        for n in (int(x) for x in a.spinners.split(",")):
            procs = []
            for k in range(0, n, SPINNERS_PER_PROCESS):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_spinner, args=(kind, min(SPINNERS_PER_PROCESS, n - k), theirs))
                proc.start()
                theirs.close()  # (a spinner that dies: our end sees EOF)
                procs.append((proc, mine))
            try:
                for proc, c in procs:
                    _expect(proc, c, "spinning", 120)
                row = {"kind": kind, "spinners": n, **measure(dev, kind, a.rounds, a.iters)}
            finally:
                for proc, c in procs:
                    if proc.is_alive():
                        c.send("stop")
                for proc, c in procs:
                    if proc.is_alive():
                        _expect(proc, c, "stopped", 60)
                    proc.join(10)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:  # (row by row: a later configuration that hangs leaves these)
                pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{'kind':<18} {'spinners':>8} {'chain us':>9} {'gemv us':>8} {'copies us':>10} {'handoff us':>11}")
    for r in rows:
        print(f"{r['kind']:<18} {r['spinners']:>8} {r['chain_us']:>9.2f} {r['gemv_us']:>8.2f} {r['copies_us']:>10.2f} "
              f"{r['handoff_us']:>11.2f}")


def _expect(proc, conn, what: str, timeout_s: float) -> None:
    """Waits for a spinner's `what`; raises if it dies or does not say it in time."""
    if not conn.poll(timeout_s):
        raise RuntimeError(f"spinner {proc.pid} did not say {what!r} in {timeout_s} s (alive: {proc.is_alive()})")
    try:
        said = conn.recv()
    except EOFError:
        raise RuntimeError(f"spinner {proc.pid} died before {what!r} (exit {proc.exitcode})") from None
    if said != what:
        raise RuntimeError(f"spinner {proc.pid} said {said!r}, not {what!r}")


if __name__ == "__main__":
    main()
