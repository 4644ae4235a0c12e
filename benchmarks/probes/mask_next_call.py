"""Does the tenant's masking work slow the call after it? Plain 16-token gRPC calls of S6's 2048x2048
`q_proj`, each right after one piece of the masking's work (or nothing), the pieces interleaved call
by call so that all see the same host and executor (session 35 timed them in separate loops, one
after another, and found the calls after the masking ~200 us slower); also each piece's own time
there, between calls. Executor on the CPU.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/mask_next_call.py [--tokens 16] [--rounds 600]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from s6_transport import HIDDEN, UNIT, free_port, make_model, serving  # noqa: E402


def main() -> int:
    from symbiont import connect
    from symbiont.client.privacy import NoiseMask
    from symbiont.proto import executor_pb2 as pb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=600)
    a = p.parse_args()
    dtype, n = torch.bfloat16, a.tokens
    tmp = tempfile.mkdtemp()
    make_model(tmp)
    port = free_port()
    with serving(tmp, f"local://masknext-{os.getpid()}", "cpu", "bfloat16", ["--listen", f"grpc://127.0.0.1:{port}", "--insecure"]):
        conn = connect(f"grpc://127.0.0.1:{port}")
        conn.ensure_attached()
        t = conn.transport
        x = torch.randn(n, HIDDEN, dtype=dtype)
        mask = NoiseMask(scale=1.0, rank=16, effects="executor")
        ref = SimpleNamespace(unit_id=UNIT, _kind="linear", _d_in=HIDDEN, _d_out=HIDDEN, _dtype=dtype, transport=t)
        y0 = t.call(UNIT, pb.FORWARD, x, (n, HIDDEN), dtype, pb.INFERENCE).clone()
        mask.call(ref, x, pb.FORWARD, lambda v, tk: tk(y0))
        g, u, xf = mask._generator(x.device), mask._unit(ref, x.device), x.float()
        before = {  # what runs before each timed plain call
            "nothing": lambda: None,
            "the whole masking (reply ready)": lambda: mask.call(ref, x, pb.FORWARD, lambda v, tk: tk(y0)),
            "randn, its generator": lambda: torch.randn(n, 16, generator=g),
            "vector_norm in float32": lambda: torch.linalg.vector_norm(x, dtype=torch.float32),
            "x.float()": lambda: x.float(),
            "addmm in float32": lambda: torch.addmm(xf, torch.randn(n, 16), u.n),
            "addmm, then to bf16": lambda: torch.addmm(xf, torch.randn(n, 16), u.n).to(dtype),
            "the reply's correction": lambda: torch.addmm(y0.float(), torch.randn(n, 16), u.e, alpha=-1).to(dtype),
        }
        times = {k: [] for k in before}
        itself = {k: [] for k in before}  # (each piece's own time, between gRPC calls as in use)
        for _ in range(a.rounds):
            for k, work in before.items():
                t0 = time.perf_counter()
                work()
                t1 = time.perf_counter()
                t.call(UNIT, pb.FORWARD, x, (n, HIDDEN), dtype, pb.INFERENCE)
                itself[k].append(t1 - t0)
                times[k].append(time.perf_counter() - t1)
        print(f"plain {n}-token gRPC call, median / p25 us, after (and the median of what ran before it, itself):")
        for k, v in times.items():
            v.sort()
            print(f"  {k:34s} {statistics.median(v) * 1e6:7.0f} {v[len(v) // 4] * 1e6:7.0f}   ({statistics.median(itself[k]) * 1e6:.0f})")
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
