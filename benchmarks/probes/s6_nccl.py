"""The floor of an NCCL data plane for a tenant on another GPU: a two-rank process group (one
per tenant, as the issue describes), the tenant sends x and receives y back, nothing else (no
GEMM, no protocol). Compare with S6's `peer-gpu` row (CUDA IPC + peer copy, a whole call).

    python benchmarks/probes/s6_nccl.py [--iters 2000]      # needs two GPUs
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = pathlib.Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository root
HIDDEN = 2048
TOKENS = (1, 16, 1024, 4096)


def _rank(rank: int, iters: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    peer = 1 - rank
    medians = {}
    for n in TOKENS:
        x = torch.randn(n, HIDDEN, device=dev, dtype=torch.bfloat16)
        times = []
        for i in range(iters + 100):
            t0 = time.perf_counter_ns()
            if rank == 1:  # the tenant
                dist.send(x, peer)
                dist.recv(x, peer)
                torch.cuda.synchronize()
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
            if i >= 100:
                times.append(time.perf_counter_ns() - t0)
        medians[n] = statistics.median(times) / 1e3
    if rank == 1:
        pathlib.Path(out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "median_us": medians}, indent=2))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return 1
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "s6_nccl.json"
    mp.spawn(_rank, args=(a.iters, 29500 + os.getpid() % 1000, str(path)), nprocs=2)
    medians = json.loads(path.read_text())["median_us"]
    print(f"\nNCCL send+recv round trip between two GPUs, x {HIDDEN} bf16, median µs")
    for n, us in medians.items():
        print(f"{n:>6s} tokens {us:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
