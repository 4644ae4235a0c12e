"""How many CUDA processes one GPU takes under MPS, by CUDA_DEVICE_MAX_CONNECTIONS (GPU, MPS on).

Starts --processes children at once; each makes its CUDA context (one tensor on the GPU), says
whether that worked, and holds the context until every child has answered. Under Volta-and-later
MPS every client owns its connections (work queues) in one pool the server shares, so a client that
asks for fewer of them may leave room for more clients (NVIDIA's MPS guide, CUDA_DEVICE_MAX_CONNECTIONS).
S3 and S9 at N = 64 failed to start past some 48 clients (RESULTS.md, session 35).

    python3 benchmarks/probes/mps_clients.py --processes 64 --connections default,4,2,1
"""
import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import sys, torch
try:
    x = torch.ones(1, device="cuda:0"); s = torch.cuda.Stream(); torch.cuda.synchronize()
    print("ok", flush=True)
except Exception as e:
    print("failed " + type(e).__name__ + ": " + str(e).splitlines()[0][:160], flush=True)
sys.stdin.readline()
"""


def trial(n: int, connections: str, timeout_s: float) -> dict:
    env = dict(os.environ)
    if connections != "default":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    else:
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) for _ in range(n)]
    answers = []
    for p in procs:
        line = p.stdout.readline().strip()
        answers.append(line or f"no answer (exit {p.poll()})")
    took = time.perf_counter() - t0
    for p in procs:
        try:
            p.stdin.write("\n")
            p.stdin.flush()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
    failures = sorted({a for a in answers if a != "ok"})
    return {"connections": connections, "processes": n, "started": answers.count("ok"), "seconds": round(took, 1),
            "failures": failures[:3]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--processes", type=int, default=64)
    p.add_argument("--connections", default="default,4,2,1")
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    for c in a.connections.split(","):
        print(json.dumps(trial(a.processes, c, a.timeout)), flush=True)


if __name__ == "__main__":
    main()
