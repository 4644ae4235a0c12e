"""S1 decode with torch.compile: greedy decode per token (batch 1, prompt 128, a static KV cache)
of the unsplit model and of the tenant, each eager and compiled, side by side in one run, bf16.

    python benchmarks/s1_compile.py --model llama-1b [--steps 5] [--new-tokens 64]

Variants, for both models: `eager` (generate's own compilation off); `compiled` (generate
compiles the forward itself, as it does for any static cache on a GPU, in mode "reduce-overhead":
CUDA graphs, which the tenant's unit calls stay out of: they do host work a replay would skip);
`compiled, no CUDA graphs` (mode "default", asked for with generate's compile_config). Each compiled variant is its own copy of the model
(generate keeps one compiled forward per model). The executor is a real `base-executor serve`
process on the same GPU (start CUDA MPS first). Calls per token are the executor's count.

Prints a table last and writes s1_compile-MODEL.json to --out.
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

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from s1_split_tax import timed  # noqa: E402

MODES = {"eager": None, "compiled": "reduce-overhead", "compiled, no CUDA graphs": "default"}


def main() -> int:
    from transformers import CompileConfig

    from symbiont.base_executor.models import build_builtin
    from symbiont import connect, virtualize, wait_for_executor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--steps", type=int, default=5, help="timed repetitions (after 2 warm-ups, which compile)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda:0", help="cpu: a smoke test (generate compiles on a GPU only)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    # one forward, compiled for several model objects and two shapes (prompt, one token)
    torch._dynamo.config.cache_size_limit = 64
    url = f"local://s1c-{os.getpid()}"
    cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", a.model, "--listen", url, "--device", str(dev),
           "--dtype", "bfloat16"]
    log = open(out_dir / f"s1_compile_executor-{a.model}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log)
    try:
        base = build_builtin(a.model, torch.bfloat16)
        base.config._attn_implementation = "sdpa"
        base = base.to(dev)
        wait_for_executor(url, 900, proc)
        conn = connect(url)
        runs = {}  # (model, variant) -> (model object, generate kwargs)
        for variant, mode in MODES.items():
            kw = dict(disable_compile=True) if mode is None else dict(compile_config=CompileConfig(mode=mode))
            runs[("unsplit", variant)] = (base if mode is None else copy.deepcopy(base), kw)
            runs[("symbiont", variant)] = (virtualize(copy.deepcopy(base), conn), kw)
        torch.manual_seed(0)
        prompt = torch.randint(1, base.config.vocab_size, (1, 128), device=dev)
        gen = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
        times = {k: [] for k in runs}
        calls = {}
        tokens = {}
        for i in range(a.steps + 2):
            for k, (m, kw) in runs.items():
                before = conn.stats().calls
                with torch.no_grad():
                    t = timed(lambda: tokens.__setitem__(k, m.generate(prompt, **gen, **kw)))
                if i >= 2:
                    times[k].append(t / a.new_tokens)
                    calls[k] = (conn.stats().calls - before) / a.new_tokens
                print(f"rep {i} {k[0]:8s} {k[1]:24s} {t / a.new_tokens * 1e3:8.2f} ms/token", flush=True)
        same = {f"{k[0]}, {k[1]}": bool(torch.equal(tokens[k], tokens[("unsplit", "eager")])) for k in runs}
        conn.close()
    finally:
        proc.send_signal(2)
        proc.wait(120)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {
        "model": a.model, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "new_tokens": a.new_tokens,
        "ms_per_token": {f"{m}, {v}": t for (m, v), t in ms.items()},
        "calls_per_token": {f"{m}, {v}": c for (m, v), c in calls.items() if m == "symbiont"},
        "same_tokens_as_unsplit_eager": same,
    }
    (out_dir / f"s1_compile-{a.model}.json").write_text(json.dumps(out, indent=2))
    print(f"\nS1 decode with torch.compile, {a.model} bf16, static cache, {out['gpu']}, ms per token (median of {a.steps})")
    print(f"{'variant':26s} {'unsplit':>9s} {'symbiont':>9s} {'ratio':>7s} {'calls/token':>12s} {'same tokens':>12s}")
    for v in MODES:
        u, s = ms[("unsplit", v)], ms[("symbiont", v)]
        print(f"{v:26s} {u:9.2f} {s:9.2f} {s / u:7.3f} {calls[('symbiont', v)]:12.1f} {str(same[f'symbiont, {v}']):>12s}")
    e = ms[("symbiont", "eager")]
    print(f"the tenant compiled against the tenant eager: {ms[('symbiont', 'compiled')] / e:.3f} "
          f"(no CUDA graphs: {ms[('symbiont', 'compiled, no CUDA graphs')] / e:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
