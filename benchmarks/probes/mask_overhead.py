"""What noise masking adds to one call, measured interleaved: plain and masked calls of S6's
2048x2048 `q_proj` alternate on one connection, so both see the same host and the same executor
(S6's rows come from separate executors one after another and move more than the difference).
Over `local://` and loopback gRPC (plaintext; TLS adds the same to both), executor on the CPU, or
on the GPU with --device cuda:0.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/mask_overhead.py [--device cuda:0] [--dtype bfloat16]
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
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", default="1,16,1024,4096")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alone", action="store_true", help="also time the masking alone: mask.call with a reply ready "
                   "at once, no transport (what the tenant's host adds, apart from the call)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on a GPU, else float32")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype) if a.dtype else torch.bfloat16 if a.device != "cpu" else torch.float32
    tmp = tempfile.mkdtemp()
    make_model(tmp)
    name, port = f"mask-{os.getpid()}", free_port()
    print(f"median us per call, {HIDDEN}x{HIDDEN}, rank {a.rank}, executor on {a.device}, tenant on the CPU")
    print(f"{'transport':10s}{'tokens':>8s}{'plain':>12s}{'masked':>12s}{'ratio':>8s}")
    with serving(tmp, f"local://{name}", a.device, "bfloat16" if dtype == torch.bfloat16 else "float32",
                 ["--listen", f"grpc://127.0.0.1:{port}", "--insecure"]):
        for url in (f"local://{name}", f"grpc://127.0.0.1:{port}"):
            conn = connect(url)
            conn.ensure_attached()
            t = conn.transport
            mask = NoiseMask(scale=1.0, rank=a.rank, effects="executor")
            ref = SimpleNamespace(unit_id=UNIT, _kind="linear", _d_in=HIDDEN, _d_out=HIDDEN, _dtype=dtype, transport=t)
            for n in (int(v) for v in a.tokens.split(",")):
                x = torch.randn(n, HIDDEN, dtype=dtype)

                def plain():
                    return t.call(UNIT, pb.FORWARD, x, (n, HIDDEN), dtype, pb.INFERENCE)

                def masked():
                    return mask.call(ref, x, pb.FORWARD, lambda v, tk: t.call(UNIT, pb.FORWARD, v, (n, HIDDEN), dtype, pb.INFERENCE, tk))

                times = {plain: [], masked: []}
                reps = 200 if n <= 16 or a.device != "cpu" else 30
                for _ in range(reps):
                    for f in (plain, masked):
                        t0 = time.perf_counter()
                        f()
                        times[f].append(time.perf_counter() - t0)
                mp, mm = (statistics.median(times[f]) * 1e6 for f in (plain, masked))
                print(f"{url.split(':')[0]:10s}{n:8d}{mp:12.0f}{mm:12.0f}{mm / mp:8.2f}", flush=True)
                if a.alone and url.startswith("local"):
                    y0 = plain()
                    alone = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        mask.call(ref, x, pb.FORWARD, lambda v, tk: tk(y0))
                        alone.append(time.perf_counter() - t0)
                    print(f"{'alone':10s}{n:8d}{'':12s}{statistics.median(alone) * 1e6:12.0f}", flush=True)
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
