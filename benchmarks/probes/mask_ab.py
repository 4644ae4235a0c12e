"""NoiseMask.call of two checkouts side by side, in one process, interleaved in blocks of calls:
this tree's client/privacy.py against another tree's (`--old DIR`, e.g. a `git worktree` of an
earlier commit). The transport is left out (the reply is ready); bf16, hidden 2048, rank 16.

    git worktree add /tmp/old REV
    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/mask_ab.py --old /tmp/old [--tokens 1,16,64]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> int:
    from symbiont.client import privacy
    from symbiont.proto import executor_pb2 as pb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the other checkout's root")
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--calls", type=int, default=50, help="calls a block")
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("privacy_old", os.path.join(a.old, "client", "privacy.py"))
    old = importlib.util.module_from_spec(spec)
    sys.modules["privacy_old"] = old  # (its dataclasses look their module up)
    spec.loader.exec_module(old)

    class Unit:  # what NoiseMask reads of a unit's shim
        unit_id, _kind, _d_in, _d_out, _dtype, transport = "u", "linear", 2048, 2048, torch.bfloat16, None

    w = torch.randn(2048, 2048)
    masks = {"old": old.NoiseMask(weights={"u.weight": w}), "new": privacy.NoiseMask(weights={"u.weight": w})}
    print(f"{os.cpu_count()} CPUs; median us a call over {a.blocks} interleaved blocks of {a.calls}")
    for tokens in map(int, a.tokens.split(",")):
        x = torch.randn(1, tokens, 2048).bfloat16()
        y = (x.float() @ w.T).bfloat16()

        def send(v, take):
            return take(y)

        times = {k: [] for k in masks}
        for m in masks.values():
            for _ in range(a.calls):
                m.call(Unit, x, pb.FORWARD, send)
        for _ in range(a.blocks):
            for k, m in masks.items():
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    m.call(Unit, x, pb.FORWARD, send)
                times[k].append((time.perf_counter() - t0) / a.calls * 1e6)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{tokens:4d} tokens: old {o:8.1f}   this tree {n:8.1f}   ratio {n / o:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
