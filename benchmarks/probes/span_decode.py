"""Decode steps of one tenant with and without layer spans, interleaved step by step in one
process (two executors side by side: `serve` and `serve --layer-spans`), each round in another
order, against the unsplit model: a change measured by runs one after another moves less than the
2-core VM's runs do.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/span_decode.py [--model smollm2-135m] [--rounds 200]
        [--lora q_proj,v_proj] [--profile] [--device cuda:0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cpu_split import start_executor  # noqa: E402


def main() -> int:
    from peft import LoraConfig, get_peft_model

    from symbiont import virtualize
    from symbiont.base_executor.models import build_builtin, default_model, load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=default_model())
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--lora", default="q_proj,v_proj", help="LoRA targets ('' for none)")
    p.add_argument("--profile", action="store_true", help="cProfile the span tenant's steps: the top functions")
    p.add_argument("--device", default="cpu", help="the executors' and the tenants' device (a GPU serves bfloat16)")
    a = p.parse_args()
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    if not gpu:
        torch.set_num_threads(os.cpu_count())
    served = ("--device", a.device, "--dtype", "bfloat16") if gpu else ()

    def make(url=None):
        # (on a GPU the built-in's weights as the executor seeds them, in its dtype)
        m = build_builtin(a.model, torch.bfloat16).to(dev) if gpu else load_model(a.model).model
        if url:
            m = virtualize(m, url)
        if a.lora:
            torch.manual_seed(0)
            m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=a.lora.split(","), init_lora_weights=False))
        return m.eval()

    procs, models = [], {"unsplit": make()}
    try:
        for name, extra in (("calls", ("--no-layer-spans",)), ("spans", ("--layer-spans",))):
            url = f"local://span-decode-{os.getpid()}-{name}"
            procs.append(start_executor(a.model, url, "PASSIVE", (*served, *extra)))
            models[name] = make(url)
        x = torch.randint(1, 200, (1, a.prompt), generator=torch.Generator().manual_seed(0)).to(dev)
        state = {}
        with torch.no_grad():
            for name, m in models.items():
                out = m(input_ids=x, use_cache=True)
                state[name] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
            toks = {name: s[1].item() for name, s in state.items()}
            assert len(set(toks.values())) == 1, toks

            def step(name):
                past, tok = state[name]
                out = models[name](input_ids=tok, past_key_values=past, use_cache=True)
                state[name] = (out.past_key_values, out.logits[:, -1:].argmax(-1))

            times = {name: [] for name in models}
            names = list(models)
            profiler = None
            if a.profile:
                import cProfile

                profiler = cProfile.Profile()
            for r in range(a.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    if profiler is not None and name == "spans":
                        profiler.enable()
                    t0 = time.perf_counter()
                    step(name)
                    if gpu:
                        torch.cuda.synchronize(dev)
                    times[name].append(time.perf_counter() - t0)
                    if profiler is not None and name == "spans":
                        profiler.disable()
                if r % 50 == 49:  # (a fresh prompt now and then: the cache stays short)
                    for name, m in models.items():
                        out = m(input_ids=x, use_cache=True)
                        state[name] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
            same = len({state[n][1].item() for n in names}) == 1
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    paired = sorted(s / c for s, c in zip(times["spans"], times["calls"]))
    q = lambda f: paired[int(f * (len(paired) - 1))]  # noqa: E731
    print(f"{a.model}, decode step, LoRA on {a.lora or 'nothing'}, {a.rounds} rounds, {os.cpu_count()} CPUs, ms (median):")
    print(f"  unsplit {med['unsplit']:.2f}; per-unit calls {med['calls']:.2f} ({med['calls'] / med['unsplit']:.2f}x); "
          f"layer spans {med['spans']:.2f} ({med['spans'] / med['unsplit']:.2f}x); spans / calls {med['spans'] / med['calls']:.3f}, "
          f"paired {q(0.5):.3f} [{q(0.25):.3f}, {q(0.75):.3f}]; same last tokens: {same}")
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    return 0


if __name__ == "__main__":
    sys.exit(main())
