"""Each op of a masked small bf16 CPU call (client/privacy.NoiseMask._masked's float32 path), timed
alone: which of them makes the masking of a 16-token call cost ~200 us on the GPU host's 16 cores
where it costs ~70 on the 2-core VM (RESULTS.md, session 39). Each op's median over --calls, on one
thread (as the masking runs below privacy.ONE_THREAD_MAX); fresh outputs as the code makes them, and
into kept outputs (out=) beside them.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/mask_pieces.py [--tokens 16,64] [--calls 2000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def timed(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} CPUs (torch had {threads} threads; one here), bf16, hidden {a.hidden}, rank {a.rank}; "
          f"median us over {a.calls}", flush=True)
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(a.rank, a.hidden)
    for tokens in map(int, a.tokens.split(",")):
        x = torch.randn(tokens, a.hidden).bfloat16()
        y = torch.randn(tokens, a.hidden).bfloat16()
        xf, c = x.float(), torch.randn(tokens, a.rank)
        v = torch.addmm(xf, c, basis)
        outs = {"f32": torch.empty(tokens, a.hidden), "bf16": torch.empty(tokens, a.hidden, dtype=torch.bfloat16),
                "c": torch.empty(tokens, a.rank)}
        pieces = {
            "x.float()": lambda: x.float(),
            "x.float() into kept": lambda: outs["f32"].copy_(x),
            "vector_norm(x, dtype=f32)": lambda: torch.linalg.vector_norm(x, dtype=torch.float32),
            "randn(tokens, rank)": lambda: torch.randn(tokens, a.rank, generator=g),
            "randn into kept": lambda: torch.randn(tokens, a.rank, generator=g, out=outs["c"]),
            "c *= norm * s": lambda: c.mul_(torch.tensor(1.0) * 0.5),
            "addmm(xf, c, basis)": lambda: torch.addmm(xf, c, basis),
            "addmm into kept": lambda: torch.addmm(xf, c, basis, out=outs["f32"]),
            "v.to(bf16)": lambda: v.to(torch.bfloat16),
            "v.to(bf16) into kept": lambda: outs["bf16"].copy_(v),
            "addmm(x.float(), c, basis).to(bf16) (forward, as now)": lambda: torch.addmm(x.float(), c, basis).to(torch.bfloat16),
            "addmm(y.float(), c, effect, alpha=-1).to(bf16) (take, as now)":
                lambda: torch.addmm(y.float(), c, basis, alpha=-1).to(torch.bfloat16),
            "bf16 addmm(x, c16, basis16) (one GEMM in bf16)": lambda: torch.addmm(x, c.bfloat16(), basis.bfloat16()),
        }
        print(f"  {tokens} tokens:", flush=True)
        for name, fn in pieces.items():
            print(f"    {timed(fn, a.calls):8.1f}  {name}", flush=True)


if __name__ == "__main__":
    main()
