"""S1 decode, where a token's time goes: the unsplit model and one tenant on the executor's GPU
(same-GPU calls in one native call, and the same tenant with each call's steps made from Python),
side by side, one token at a time with a KV cache, bf16.

    python benchmarks/probes/s1_decode_breakdown.py --model llama-1b [--tokens 32] [--reps 4] [--out DIR]

Per token: the wall time (forward, argmax, synchronise); the host time of the forward (the
tenant's includes confirming its calls at the end); of that, the time inside the transport's
calls and in confirm(); and how long the synchronise after the argmax waited for the GPUs.
The first repetition warms up; medians over the tokens of the others. The executor is a real
`base-executor serve` process on the same GPU (start CUDA MPS first).

Prints a table last and writes s1_decode_breakdown-MODEL.json to --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository root
sys.path.insert(0, str(REPO))

COLUMNS = ("token", "forward host", "in calls", "in confirm", "sync wait")


class CallClock:
    """Adds up the host time a transport spends in its calls and in confirm()."""

    def __init__(self, transport):
        self.calls = self.confirm = 0.0
        self.n = 0
        call, confirm = transport._call, transport._confirm

        def timed_call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.calls += time.perf_counter() - t
                self.n += 1

        def timed_confirm():
            t = time.perf_counter()
            try:
                confirm()
            finally:
                self.confirm += time.perf_counter() - t

        transport._call, transport._confirm = timed_call, timed_confirm

    def reset(self) -> None:
        self.calls = self.confirm = 0.0
        self.n = 0


def decode(model, prompt: torch.Tensor, tokens: int, clock: CallClock) -> list[dict]:
    """Greedy decode of `tokens` after `prompt`, one forward per token; a row of timings per token."""
    from transformers import DynamicCache

    rows = []
    with torch.no_grad():
        cache = DynamicCache()
        tok = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        for _ in range(tokens):
            clock.reset()
            t0 = time.perf_counter()
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits
            t1 = time.perf_counter()
            tok = logits[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            rows.append({"token": t3 - t0, "forward host": t1 - t0, "in calls": clock.calls, "in confirm": clock.confirm,
                         "sync wait": t3 - t2, "calls": clock.n})
    return rows


def main() -> int:
    from symbiont.base_executor.models import build_builtin
    from symbiont import connect, virtualize, wait_for_executor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per repetition (after a 128-token prompt)")
    p.add_argument("--reps", type=int, default=4, help="repetitions per model; the first warms up")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    url = f"local://s1d-{os.getpid()}"
    log = open(out_dir / f"s1_decode_breakdown_executor-{a.model}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", a.model, "--listen", url,
                             "--device", "cuda:0", "--dtype", "bfloat16"], cwd=REPO, stdout=log, stderr=log)
    try:
        base = build_builtin(a.model, torch.bfloat16)
        base.config._attn_implementation = "sdpa"
        base = base.cuda()
        wait_for_executor(url, 900, proc)
        conn = connect(url)
        virt = virtualize(copy.deepcopy(base), conn)
        clock = CallClock(conn.transport)
        torch.manual_seed(0)
        prompt = torch.randint(1, base.config.vocab_size, (1, 128), device="cuda")
        variants = {"unsplit": (base, None), "tenant, native calls": (virt, True), "tenant, Python calls": (virt, False)}
        rows: dict[str, list[dict]] = {k: [] for k in variants}
        for rep in range(a.reps):
            for name, (model, native) in variants.items():
                if native is not None:
                    conn.transport.native_calls = native
                got = decode(model, prompt, a.tokens, clock)
                if rep:
                    rows[name] += got
        conn.close()
    finally:
        proc.send_signal(2)
        proc.wait(120)
    medians = {k: {c: statistics.median(r[c] for r in v) * 1e3 for c in COLUMNS} | {"calls": v[-1]["calls"]} for k, v in rows.items()}
    gpu = torch.cuda.get_device_name()
    (out_dir / f"s1_decode_breakdown-{a.model}.json").write_text(json.dumps(
        {"model": a.model, "gpu": gpu, "torch": torch.__version__, "tokens": a.tokens, "reps": a.reps, "median_ms": medians}, indent=2))
    print(f"\nS1 decode per token, {a.model} bf16, {gpu}: medians over {(a.reps - 1) * a.tokens} tokens, ms")
    print(f"{'':22s}" + "".join(f"{c:>14s}" for c in COLUMNS) + f"{'calls':>8s}")
    for k, m in medians.items():
        print(f"{k:22s}" + "".join(f"{m[c]:14.2f}" for c in COLUMNS) + f"{m['calls']:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
