"""S6 transport: the round trip of one call of 1, 16, 1024, 4096 tokens x hidden 2048 through
every placement this machine can run, against the GEMM alone, side by side in one run.

Placements: `cpu-executor` (tenant and executor on the CPU, shared memory), `host->gpu`
(tenant on the CPU, executor on the GPU, page-locked mailboxes), `same-gpu` (tenant on the
executor's GPU, CUDA IPC mailboxes; `same-gpu-python`: the same with each call's steps made from
Python instead of in one native call; `same-gpu-wait`: each call waits for its reply;
`same-gpu-python-serve`: the executor serves every call from Python, no native lane;
`same-gpu-eager`: no CUDA graphs either), `peer-gpu` (tenant on a second GPU: the executor's CUDA
IPC mailbox, peer copies on the tenant's streams, ordered by the mailbox's words; `peer-gpu-events`:
ordered on the executor's GPU by the mailbox's events instead, each call waiting for its reply;
needs two GPUs), `grpc` (tenant on the CPU, over gRPC on loopback, plaintext), `grpc-tls` (mutual
TLS), `grpc-tls-mask` (mutual TLS and noise masking, client/privacy.py; the executor on the GPU
when there is one), `grpc-gpu-stream` (tenant on a second GPU over gRPC, its tensors in the stream
through the host) and `grpc-nccl` (the same tenant, its tensors on its NCCL plane; run once more with
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for the bytes' way between two hosts). The executor is a real `base-executor serve` process; the unit is a 2048x2048
q_proj of a one-layer Llama saved to a temporary directory.

    python benchmarks/s6_transport.py [--label mps]      # run once with MPS on, once without

Prints a table last and writes benchmarks/out/s6_transport[-LABEL].json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOKENS = (1, 16, 1024, 4096)
HIDDEN = 2048
UNIT = "model.layers.0.self_attn.q_proj"


def make_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=1, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=1024)
    LlamaForCausalLM(config).save_pretrained(path)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, url: str, device: str, dtype: str, spin_us: int | None, extra=()) -> subprocess.Popen:
    from symbiont import wait_for_executor

    cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", model, "--listen", url, "--device", device,
           "--dtype", dtype, "--max-wait-us", "0", "--inference-wait-us", "0"] + (["--spin-us", str(spin_us)] if spin_us is not None else []) + list(extra)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_executor(url, 120, proc)
    return proc


@contextlib.contextmanager
def serving(model: str, url: str, device: str, dtype: str, extra=()):
    """An executor serving `model` at `url` (serve()) while the block runs, stopped after it."""
    proc = serve(model, url, device, dtype, None, extra)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(60)


def median_us(fn, sync, n: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    from symbiont import connect
    from symbiont.proto import executor_pb2 as pb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--spin-us", type=int, nargs="+", default=[None], help="spin before sleeping, both sides; one row per value (default: the defaults)")
    p.add_argument("--placements", nargs="+", default=None, help="subset of cpu-executor host->gpu same-gpu same-gpu-python same-gpu-wait "
                   "same-gpu-eager peer-gpu peer-gpu-events (same-gpu-wait: each call waits for its reply instead of returning before it; "
                   "same-gpu-python: the tenant's call steps in Python; same-gpu-eager: the executor replays no CUDA graphs; "
                   "same-gpu-python-serve: the executor serves every call from Python, no native lane)")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows: dict[str, dict[int, float]] = {}
    served: dict[str, dict[str, int]] = {}  # the executor's counts per placement
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp)
        w = torch.randn(HIDDEN, HIDDEN)
        placements = [("cpu-executor", "cpu", "float32", "cpu")]
        grpc_on = ("cuda:0", "bfloat16") if cuda else ("cpu", "float32")
        placements += [(name, *grpc_on, "cpu") for name in ("grpc", "grpc-tls", "grpc-tls-mask")]
        if torch.cuda.device_count() > 1:
            placements += [("peer-gpu", "cuda:0", "bfloat16", "cuda:1"), ("peer-gpu-events", "cuda:0", "bfloat16", "cuda:1"),
                           ("grpc-gpu-stream", "cuda:0", "bfloat16", "cuda:1"), ("grpc-nccl", "cuda:0", "bfloat16", "cuda:1")]
        if cuda:
            placements += [("host->gpu", "cuda:0", "bfloat16", "cpu"), ("same-gpu", "cuda:0", "bfloat16", "cuda:0"),
                           ("same-gpu-python", "cuda:0", "bfloat16", "cuda:0"), ("same-gpu-wait", "cuda:0", "bfloat16", "cuda:0"),
                           ("same-gpu-eager", "cuda:0", "bfloat16", "cuda:0"), ("same-gpu-python-serve", "cuda:0", "bfloat16", "cuda:0")]
            wg = w.to("cuda", torch.bfloat16)
            rows["GEMM alone (GPU, bf16)"] = {
                n: median_us(lambda x=torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16): torch.nn.functional.linear(x, wg), sync, a.calls)
                for n in TOKENS
            }
        rows["GEMM alone (CPU, fp32)"] = {
            n: median_us(lambda x=torch.randn(n, HIDDEN): torch.nn.functional.linear(x, w), lambda: None, min(a.calls, 50))
            for n in TOKENS
        }
        runs = [(f"{p[0]} spin {s}us" if len(a.spin_us) > 1 else p[0], s, *p[1:]) for p in placements for s in a.spin_us
                if a.placements is None or p[0] in a.placements]
        for name, spin, ex_device, dtype, tenant_device in runs:
            url = f"local://s6-{os.getpid()}-{len(rows)}"
            flags = {"same-gpu-eager": ["--graph-tokens", "0"], "same-gpu-python-serve": ["--no-native-serve"]}
            extra = next((f for k, f in flags.items() if name.startswith(k)), [])
            if name.startswith("grpc"):
                port = free_port()
                tls = name.startswith("grpc-tls")
                if tls and not os.path.exists(os.path.join(tmp, "certs", "ca.pem")):
                    from symbiont.base_executor import certs

                    os.makedirs(os.path.join(tmp, "certs"))
                    certs.main(os.path.join(tmp, "certs"), ["127.0.0.1"], ["s6"], 1)
                extra = ["--listen", f"grpc://127.0.0.1:{port}", *(["--tls-dir", os.path.join(tmp, "certs")] if tls else ["--insecure"])]
            proc = serve(tmp, url, ex_device, dtype, spin, extra)
            try:
                if name.startswith("grpc"):
                    conn = connect(f"grpc://127.0.0.1:{port}", plane="nccl" if name.startswith("grpc-nccl") else "stream",
                                   **({"tls_dir": os.path.join(tmp, "certs"), "tenant": "s6"} if tls else {}))
                else:
                    conn = connect(url, spin_us=spin)
                conn.transport.peer_streams = not name.startswith("peer-gpu-events")
                conn.ensure_attached(tenant_device)
                t = conn.transport
                t.return_early = not name.startswith("same-gpu-wait")
                t.native_calls = not name.startswith("same-gpu-python")
                tdtype = getattr(torch, dtype)
                call = lambda x, n: t.call(UNIT, pb.FORWARD, x, (n, HIDDEN), tdtype, pb.INFERENCE)  # noqa: E731
                if name.endswith("-mask"):
                    from types import SimpleNamespace

                    from symbiont.client.privacy import NoiseMask

                    mask = NoiseMask(scale=1.0, rank=16, effects="executor")
                    ref = SimpleNamespace(unit_id=UNIT, _kind="linear", _d_in=HIDDEN, _d_out=HIDDEN, _dtype=tdtype, transport=t)
                    call = lambda x, n: mask.call(ref, x, pb.FORWARD, lambda v, tk: t.call(UNIT, pb.FORWARD, v, (n, HIDDEN), tdtype, pb.INFERENCE, tk))  # noqa: E731
                row = {}
                for n in TOKENS:
                    x = torch.randn(n, HIDDEN, dtype=tdtype, device=tenant_device)
                    calls = a.calls if ex_device != "cpu" or n <= 16 else 20
                    tsync = (lambda d=tenant_device: torch.cuda.synchronize(d)) if tenant_device != "cpu" else (lambda: None)
                    row[n] = median_us(lambda: call(x, n), tsync, calls)
                rows[name] = row
                st = conn.stats()
                served[name] = {"calls": st.calls, "graph_replays": st.graph_replays, "native_calls": st.native_calls}
                conn.close()
            finally:
                proc.terminate()
                proc.wait(60)
    out = {"label": a.label, "hidden": HIDDEN, "gpu": torch.cuda.get_device_name() if cuda else None,
           "torch": torch.__version__, "median_us": rows, "executor": served}
    path = REPO / "benchmarks" / "out" / f"s6_transport{'-' + a.label if a.label else ''}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nS6 round trip, median us, hidden {HIDDEN} {('(' + a.label + ')') if a.label else ''}")
    print(f"{'placement':26s}" + "".join(f"{n:>10d}" for n in TOKENS))
    for name, row in rows.items():
        print(f"{name:26s}" + "".join(f"{row[n]:10.1f}" for n in TOKENS))
    for name, counts in served.items():
        print(f"{name}: executor served {counts['calls']} calls, {counts['graph_replays']} graph replays, "
              f"{counts['native_calls']} native")
    return 0


if __name__ == "__main__":
    sys.exit(main())
