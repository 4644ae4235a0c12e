"""CPU split tax, side by side in one run: one LoRA fine-tuning pass (forward + backward) and one
greedy decode step of the unsplit HF + PEFT model, against the same model virtualized through a
real `base-executor` process, with the executor's OpenMP threads waiting passively (the default)
and spinning (OMP_WAIT_POLICY=ACTIVE); with --grpc also a tenant of the same executor over
loopback gRPC (plaintext, and mutual TLS), the S1 split tax of a remote tenant beside a local one.

    python benchmarks/cpu_split.py                       # smollm2-135m if installed, else tiny-llama
    python benchmarks/cpu_split.py --model tiny-llama --steps 20

Prints a table last and writes benchmarks/out/cpu_split.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def start_executor(model: str, url: str, omp_policy: str, extra=()) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": omp_policy}
    cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", model, "--listen", url, *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from symbiont import wait_for_executor

    wait_for_executor(url, 300, proc)
    return proc


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))


def time_model(model, x: torch.Tensor, steps: int) -> dict:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    train, decode = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        if i >= 2:
            train.append(time.perf_counter() - t0)
    with torch.no_grad():
        out = model(input_ids=x[:1], use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps + 2):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if i >= 2:
                decode.append(time.perf_counter() - t0)
    return {"train_pass_s": statistics.median(train), "decode_step_s": statistics.median(decode)}


def main() -> int:
    from symbiont.base_executor.models import default_model, load_model
    from symbiont import virtualize

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=default_model())
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--grpc", action="store_true", help="also tenants over loopback gRPC, plaintext and mutual TLS")
    p.add_argument("--unit-calls", action="store_true", help="also a tenant of an executor serving without layer "
                   "spans (serve --no-layer-spans: three calls a decoder layer), beside the default's, in every round")
    p.add_argument("--rounds", type=int, default=1, help="every row this many times, each round in another order")
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    x = torch.randint(1, 200, (1, a.tokens), generator=torch.Generator().manual_seed(0))

    ways = {"unsplit HF + PEFT": None, **{f"symbiont, executor OMP {p}": (p, ()) for p in ("PASSIVE", "ACTIVE")}}
    if a.unit_calls:
        ways["symbiont, no layer spans (OMP PASSIVE)"] = ("PASSIVE", ("--no-layer-spans",))
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    for r in range(a.rounds):  # (each round in another order: a fixed order favours some)
        names = list(ways)
        for name in names[r % len(names):] + names[:r % len(names)]:
            if ways[name] is None:
                runs[name].append(time_model(lora(load_model(a.model).model), x, a.steps))
                continue
            policy, extra = ways[name]
            url = f"local://bench-cpu-{os.getpid()}-{len(runs[name])}-{abs(hash(name)) % 10**6}"
            proc = start_executor(a.model, url, policy, extra)
            try:
                runs[name].append(time_model(lora(virtualize(load_model(a.model).model, url)), x, a.steps))
            finally:
                proc.terminate()
                proc.wait(60)
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    if a.grpc:
        import socket
        import tempfile

        from symbiont import connect
        from symbiont.base_executor import certs

        with tempfile.TemporaryDirectory() as tls:
            certs.main(tls, ["127.0.0.1"], ["bench"], 1)
            for mode, flags, kw in (("plaintext", ["--insecure"], {}), ("mutual TLS", ["--tls-dir", tls], {"tls_dir": tls, "tenant": "bench"})):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                url = f"local://bench-cpu-{os.getpid()}-grpc"
                proc = start_executor(a.model, url, "PASSIVE", ["--listen", f"grpc://127.0.0.1:{port}", *flags])
                try:
                    model = lora(virtualize(load_model(a.model).model, connect(f"grpc://127.0.0.1:{port}", **kw)))
                    rows[f"symbiont over gRPC, {mode}"] = time_model(model, x, a.steps)
                finally:
                    proc.terminate()
                    proc.wait(60)

    base = rows["unsplit HF + PEFT"]
    out = {"model": a.model, "tokens": a.tokens, "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows}
    path = REPO / "benchmarks" / "out" / "cpu_split.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\n{a.model}, 1 x {a.tokens} tokens, {os.cpu_count()} CPUs, medians of {a.steps}"
          + (f", then the median of {a.rounds} rounds" if a.rounds > 1 else ""))
    print(f"{'':34s} {'train pass':>11s} {'ratio':>6s} {'decode step':>12s} {'ratio':>6s}")
    for name, r in rows.items():
        print(f"{name:34s} {r['train_pass_s'] * 1e3:9.0f}ms {r['train_pass_s'] / base['train_pass_s']:6.2f} "
              f"{r['decode_step_s'] * 1e3:10.1f}ms {r['decode_step_s'] / base['decode_step_s']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
