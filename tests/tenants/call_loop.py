"""A tenant that does nothing but calls, until it is killed.

    python tests/tenants/call_loop.py URL

Attaches to the executor at URL, prints `attached <tenant id> <mailbox data bytes>`, then loops
FORWARD and BACKWARD calls on an MLP unit of tiny-llama (big enough that the executor spends
real time on each) and prints `calls N` after every call, so the test knows it is mid-loop
when it sends SIGKILL.
"""
from __future__ import annotations

import sys

import torch

from symbiont import connect
from symbiont.proto import executor_pb2 as pb

UNIT = "model.layers.1.mlp.up_proj"  # tiny-llama: 64 -> 128


def main(url: str) -> None:
    conn = connect(url, name="call-loop")
    conn.ensure_attached()
    t = conn.transport
    print(f"attached {t.tenant_id} {t._box.data_bytes}", flush=True)
    x = torch.randn(4096, 64)
    g = torch.randn(4096, 128)
    n = 0
    while True:
        t.call(UNIT, pb.FORWARD, x, (4096, 128), torch.float32, pb.TRAINING)
        t.call(UNIT, pb.BACKWARD, g, (4096, 64), torch.float32, pb.TRAINING)
        n += 2
        print(f"calls {n}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
