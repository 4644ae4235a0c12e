"""The masking of this tree against the masking of another commit, in one process: plain, masked
(this tree's NoiseMask) and masked (client/privacy.py as it was at REV) calls of S6's 2048x2048
`q_proj` over loopback gRPC alternate call by call, so all three see the same host and executor
(a masking change measured by two runs one after another moves less than the runs do), each round
in another order (a masked call right after another masked call ran 3-4% faster: in a fixed order
the second masking looked faster). Executor on the CPU; also prints each masking's largest
difference from the plain reply.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/mask_against.py --against REV [--dtype bfloat16] [--tokens 1,16,64]
        [--against-file PATH (a privacy.py, where the tree has no git history)] [--device cuda:0 (the executor's)]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from s6_transport import HIDDEN, REPO, UNIT, free_port, make_model, serving  # noqa: E402


def privacy_at(rev: str, file: str = ""):
    """client/privacy.py as it was at `rev` (or the file `file`), imported as a module of its own."""
    path = os.path.join(tempfile.mkdtemp(), "privacy_then.py")
    with open(path, "w") as f:
        if file:
            with open(file) as src:
                f.write(src.read())
        else:
            f.write(subprocess.run(["git", "show", f"{rev}:client/privacy.py"], cwd=REPO, check=True,
                                   capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("privacy_then", path)
    module = sys.modules["privacy_then"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    from symbiont import connect
    from symbiont.client.privacy import NoiseMask
    from symbiont.proto import executor_pb2 as pb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the commit whose client/privacy.py to compare with (a name for --against-file)")
    p.add_argument("--against-file", default="", help="that privacy.py as a file (a tree without git history: a GPU host's copy)")
    p.add_argument("--device", default="cpu", help="the executor's device (the tenant is on the CPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--rounds", type=int, default=400)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    then = privacy_at(a.against, a.against_file)
    tmp = tempfile.mkdtemp()
    make_model(tmp)
    port = free_port()
    print(f"median us per call over loopback gRPC, {HIDDEN}x{HIDDEN}, rank 16, {a.dtype}, executor on {a.device}; "
          f"masked now / masked at {a.against}")
    with serving(tmp, f"local://maskagainst-{os.getpid()}", a.device, a.dtype, ["--listen", f"grpc://127.0.0.1:{port}", "--insecure"]):
        conn = connect(f"grpc://127.0.0.1:{port}")
        conn.ensure_attached()
        t = conn.transport
        for n in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(n, HIDDEN, dtype=dtype)
            ref = SimpleNamespace(unit_id=UNIT, _kind="linear", _d_in=HIDDEN, _d_out=HIDDEN, _dtype=dtype, transport=t)

            def call(v, take=None):
                return t.call(UNIT, pb.FORWARD, v, (n, HIDDEN), dtype, pb.INFERENCE, take)

            masks = {"now": NoiseMask(scale=1.0, rank=16, effects="executor"),
                     "then": then.NoiseMask(scale=1.0, rank=16, effects="executor")}
            want = call(x).float()
            errors = {k: (m.call(ref, x, pb.FORWARD, call).float() - want).abs().max().item() for k, m in masks.items()}
            ways = {"plain": lambda: call(x), **{k: (lambda m: lambda: m.call(ref, x, pb.FORWARD, call))(m) for k, m in masks.items()}}
            times = {k: [] for k in ways}
            order = list(ways)
            for i in range(a.rounds):  # (each round in another order: a masked call right after another ran faster)
                for k in order[i % 3:] + order[:i % 3]:
                    f = ways[k]
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            print(f"{n:5d} tokens: plain {med['plain']:.0f}; now {med['now']:.0f} ({med['now'] / med['plain']:.2f}x, "
                  f"max error {errors['now']:.3g}); then {med['then']:.0f} ({med['then'] / med['plain']:.2f}x, "
                  f"max error {errors['then']:.3g})", flush=True)
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
