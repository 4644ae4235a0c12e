"""What a masked CPU call costs the tenant's host beside its arithmetic: NoiseMask.call with the
transport left out (the reply is ready), followed by the tenant's next work (a [tokens, 2048] by
[2048, 2048] GEMM on all its threads, as its attention or LoRA would be), against that work alone;
with small calls run on one thread (privacy.ONE_THREAD_MAX, the default) and without. On a many-core
GPU host a masked 1-token call cost ~170 us over plain gRPC (RESULTS.md, session 39) where its
arithmetic takes ~27 us on the 2-core VM: this says whether changing the thread count is that cost.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/mask_threads.py [--tokens 1,16,64] [--calls 2000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> int:
    from symbiont.client import privacy
    from symbiont.client.privacy import NoiseMask
    from symbiont.proto import executor_pb2 as pb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()

    class Unit:  # what NoiseMask reads of a unit's shim
        unit_id, _kind, _d_in, _d_out, _dtype, transport = "u", "linear", 2048, 2048, torch.bfloat16, None

    w = torch.randn(2048, 2048)
    mask, unit = NoiseMask(weights={"u.weight": w}), Unit()
    wb = w.bfloat16()
    one_thread = privacy.ONE_THREAD_MAX
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, bf16, hidden 2048, rank 16; median us over {a.calls} calls")
    for tokens in map(int, a.tokens.split(",")):
        x = torch.randn(1, tokens, 2048).bfloat16()
        y = (x.float() @ w.T).bfloat16()

        def send(v, take):
            return take(y)

        def work():
            return x @ wb.T

        def masked_then_work():
            mask.call(unit, x, pb.FORWARD, send)
            return work()

        def masked():
            return mask.call(unit, x, pb.FORWARD, send)

        def toggled_then_work():  # (what the one-thread masking does to the thread count, nothing else)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            torch.set_num_threads(threads)
            return work()

        row = {}
        for name, fn, limit in (("work alone", work, one_thread), ("masked (one thread), then work", masked_then_work, one_thread),
                                ("masked (all threads), then work", masked_then_work, 0),
                                ("masked alone (one thread)", masked, one_thread), ("masked alone (all threads)", masked, 0),
                                ("thread count changed, then work", toggled_then_work, one_thread)):
            privacy.ONE_THREAD_MAX = limit
            for _ in range(200):
                fn()
            ts = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            row[name] = statistics.median(ts) * 1e6
        privacy.ONE_THREAD_MAX = one_thread
        print(f"  {tokens:5d} tokens: " + "; ".join(f"{k} {v:.1f}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
