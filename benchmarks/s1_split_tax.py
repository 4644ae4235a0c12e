"""S1 split tax: one tenant alone on the executor's GPU vs the same model unsplit in one process
(HF + PEFT), side by side in one run, bf16.

    python benchmarks/s1_split_tax.py --model llama-1b [--steps 10] [--out DIR]

Scenarios (BENCHMARKS.md): LoRA r=16 on q,v fine-tuning step at batch 2 x 512 tokens; greedy
decode at batch 1 (prompt 128, 128 new tokens); prefill of 2048 tokens. Each repetition times
the unsplit model and the tenant back to back, each repetition in another order; medians. The executor is a real
`base-executor serve` process on the same GPU (start CUDA MPS first). Where the time goes: the
executor's call counts give calls per step, and (symbiont - unsplit) / calls the cost per call;
besides the ratio of the medians, each repetition's own ratio (its models ran one after another)
is reported as median [quartiles], which drift between repetitions does not move;
`--profile SECONDS` samples both processes with py-spy per scenario; `--torch-profile` runs each
scenario once per model under torch.profiler; `--gpu-time` runs each scenario once per model with
the GPU's work recorded in both processes (the executor through benchmarks/profiled_serve.py):
the GPU's busy time for the tenant's kernels and for the executor's, and the rest of the wall
time, when the GPU did neither (waiting for a host), with the idle gaps by whose work came before
and after (both processes' kernels on one timeline; only models served by the first executor).
`--compare-whole-mlp` times a third model in the
same repetitions: the tenant with whole-MLP calls off (one call per fused Linear in the MLP);
`--compare-python-calls` one whose same-GPU calls make their steps from Python instead of in one
native call (the code before proto._stream_ops.Lane); `--compare-eager-executor` one served by a
second executor on the same GPU that replays no CUDA graphs (`--graph-tokens 0`, the code before
base_executor/graphs.py); `--compare-python-serve` one served by a second executor that serves
every call from Python (`--no-native-serve`, the code before proto._stream_ops.ServeLane);
`--compare-unfused-act` one whose MLP units run silu(gate) * up as torch's two kernels
(`--no-fused-act`, the code before base_executor/kernels/act_mul.py).

Prints a table last and writes s1_split_tax-MODEL.json to --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def spread(ratios: list[float]) -> str:
    """Median and quartiles of per-repetition ratios: "1.08 [1.05, 1.12]"."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{statistics.median(ratios):.3f} [{q[0]:.3f}, {q[2]:.3f}]"


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def main() -> int:
    from symbiont.base_executor.models import build_builtin
    from symbiont import connect, virtualize, wait_for_executor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per scenario (after 2 warm-ups)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-fuse", action="store_true", help="one remote call per unit (no sibling fusion)")
    p.add_argument("--compare-whole-mlp", action="store_true",
                   help="also time the tenant with whole-MLP calls off, side by side (key 'per-linear MLP')")
    p.add_argument("--compare-python-calls", action="store_true",
                   help="also time the tenant with native calls off, side by side (key 'python calls')")
    p.add_argument("--compare-eager-executor", action="store_true",
                   help="also time a tenant of a second executor that runs every call eagerly (--graph-tokens 0)")
    p.add_argument("--compare-python-serve", action="store_true",
                   help="also time a tenant of a second executor that serves every call from Python (--no-native-serve)")
    p.add_argument("--compare-unfused-act", action="store_true",
                   help="also time a tenant of a second executor whose MLP units do not fuse silu(gate) * up (--no-fused-act)")
    p.add_argument("--compare-layer-spans", action="store_true",
                   help="the first executor serves no layer spans (--no-layer-spans: three calls a decoder layer) "
                        "and a tenant of a second executor that does (one call a decoder layer while decoding) is timed too")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    p.add_argument("--wait-replies", action="store_true", help="same GPU: each call waits for its reply (the default returns before it)")
    p.add_argument("--serve-args", default="", help="extra arguments for base-executor serve")
    p.add_argument("--device", default="cuda:0", help="the executor's and the tenant's device (cpu: a smoke test)")
    p.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                   help="after timing each scenario, sample both processes with py-spy for this long (pip install py-spy)")
    p.add_argument("--torch-profile", action="store_true",
                   help="after timing each scenario, run it once per model under torch.profiler and print where the "
                   "tenant's host time goes (self CPU time per op, CUDA runtime calls included)")
    p.add_argument("--scenarios", default="prefill,decode,finetune", help="which scenarios to run, comma-separated")
    p.add_argument("--gpu-time", action="store_true",
                   help="after timing each scenario, run it once per model recording both processes' GPU work: "
                   "GPU busy for the tenant, for the executor, and idle")
    a = p.parse_args()
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    gpu_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    url = f"local://s1-{os.getpid()}"
    ex_gpu = out_dir / f"s1_gpu_time_executor-{a.model}.json"  # (--gpu-time) the executor's GPU work
    launch = [str(REPO / "benchmarks" / "profiled_serve.py"), str(ex_gpu)] if a.gpu_time else ["-m", "symbiont.base_executor.cli"]
    cmd = [sys.executable, *launch, "serve", "--model", a.model, "--listen", url, "--device", a.device,
           "--dtype", "bfloat16", *a.serve_args.split(), *(["--no-layer-spans"] if a.compare_layer_spans else [])]
    log = open(out_dir / f"s1_executor-{a.model}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log)
    procs = [proc]
    other_executor = ("eager executor", ["--graph-tokens", "0"]) if a.compare_eager_executor else \
        ("python-serving executor", ["--no-native-serve"]) if a.compare_python_serve else \
        ("unfused-act executor", ["--no-fused-act"]) if a.compare_unfused_act else \
        ("layer-spans executor", ["--layer-spans"]) if a.compare_layer_spans else None
    if other_executor:
        eager_url = url + "-other"
        eager_cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", a.model, "--listen", eager_url,
                     "--device", a.device, "--dtype", "bfloat16", *a.serve_args.split(), *other_executor[1]]
        procs.append(subprocess.Popen(eager_cmd, cwd=REPO, stdout=log, stderr=log))
    try:
        base = build_builtin(a.model, torch.bfloat16)
        base.config._attn_implementation = "sdpa"  # the virtualized copy inherits it
        base = base.to(dev)
        wait_for_executor(url, 900, proc)
        conn = connect(url)
        conn.transport.return_early = not a.wait_replies
        conns = {}  # model -> its connection, where not conn
        virt = virtualize(copy.deepcopy(base), conn, fuse=not a.no_fuse)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        models = {"unsplit": base, "symbiont": virt}
        if a.compare_whole_mlp:
            models["per-linear MLP"] = virtualize(copy.deepcopy(base), conn, fuse=not a.no_fuse, whole_mlp=False)
        if a.compare_python_calls:  # conn.transport.native_calls is off while this one runs
            models["python calls"] = virtualize(copy.deepcopy(base), conn, fuse=not a.no_fuse)
        if other_executor:
            name = other_executor[0]
            wait_for_executor(eager_url, 900, procs[1])
            conns[name] = connect(eager_url)
            conns[name].transport.return_early = not a.wait_replies
            models[name] = virtualize(copy.deepcopy(base), conns[name], fuse=not a.no_fuse)
        results: dict[str, dict[str, float]] = {}
        paired: dict[str, dict[str, list[float]]] = {}  # scenario -> model -> per-repetition ratios, sorted
        calls_of: dict[str, dict[str, float]] = {k: {} for k in models if k != "unsplit"}  # model -> scenario -> calls
        calls, calls_off = calls_of["symbiont"], calls_of.get("per-linear MLP", {})
        gpu_times: dict[str, dict] = {}  # --gpu-time
        alloc_retries: dict[str, dict] = {}

        def profile(name, run_symbiont):
            """py-spy samples the tenant and the executor while the symbiont side repeats `name`."""
            from s6_profile import top_frames

            stacks = {who: out_dir / f"s1_{a.model}_{name}_{who}.txt" for who in ("tenant", "executor")}
            spies = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "997", "--duration", str(a.profile),
                                       "--idle", "--nonblocking", "--format", "raw", "--output", str(stacks[who])],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for who, pid in (("tenant", os.getpid()), ("executor", proc.pid))]
            while any(sp.poll() is None for sp in spies):
                run_symbiont()
            for who, path in stacks.items():
                print(f"\n{name}, {who} (py-spy):\n" + top_frames(path, REPO), flush=True)

        def torch_profile(title, run):
            """One run under torch.profiler: the ops that take the most host time, and the GPU's."""
            from torch.profiler import ProfilerActivity, profile as tprofile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with tprofile(activities=acts) as prof:
                run()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48)
            print(f"\n{title} (torch.profiler, one run):\n{table}", flush=True)

        def executor_gpu(start: bool) -> dict | None:
            """Starts the executor's recording of its GPU work, or stops it and returns what it did."""
            ready = ex_gpu.with_suffix(".started") if start else ex_gpu
            ready.unlink(missing_ok=True)
            proc.send_signal(signal.SIGUSR1 if start else signal.SIGUSR2)
            deadline = time.monotonic() + 60
            while not ready.exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the executor did not answer the profiling signal")
                time.sleep(0.01)
            return None if start else json.loads(ex_gpu.read_text())

        def gpu_time(name, run):
            """One run per model with both processes' GPU work recorded."""
            from torch.profiler import ProfilerActivity, profile as tprofile

            from profiled_serve import gap_analysis, gpu_work, trace_origin_us

            rows = gpu_times[name] = {}
            for k, m in models.items():
                if k in conns:  # (served by the second executor, whose GPU work is not recorded)
                    continue
                if k != "unsplit":
                    executor_gpu(True)
                conn.transport.native_calls = k != "python calls"
                with tprofile(activities=[ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU]) as prof:
                    wall = timed(lambda: run(m)) * 1e3
                ex = executor_gpu(False) if k != "unsplit" else {"busy_ms": 0.0, "launches": 0, "top_ms": {}, "spans": []}
                me = gpu_work(prof.events(), spans=True, origin_us=trace_origin_us(prof))
                gaps = gap_analysis({"tenant": me.pop("spans"), "executor": ex.pop("spans")})
                rows[k] = {"wall_ms": wall, "tenant": me, "executor": ex, "gaps": gaps,
                           "idle_ms": wall - gaps["union_busy_ms"]}
                print(f"{name}, {k}: wall {wall:.2f} ms; GPU busy for the tenant {me['busy_ms']:.2f} ms "
                      f"({me['launches']} kernels and copies), for the executor {ex['busy_ms']:.2f} ms "
                      f"({ex['launches']}); neither {rows[k]['idle_ms']:.2f} ms", flush=True)
                for who, w in (("tenant", me), ("executor", ex)):
                    for kernel, ms in list(w["top_ms"].items())[:6]:
                        print(f"    {who:8s} {ms:8.2f} ms  {kernel}", flush=True)
                print(f"    both busy (union) {gaps['union_busy_ms']:.2f} ms; idle between work, by turn:", flush=True)
                for turn, g in list(gaps["gaps"].items())[:4]:
                    print(f"    {turn:22s} {g['count']:6d} gaps {g['ms']:8.2f} ms", flush=True)

        def scenario(name, run_one):
            if name not in a.scenarios.split(","):
                return
            times = {k: [] for k in models}
            retries = {k: 0 for k in models}  # the tenant's allocator freeing its cache to retry a cudaMalloc (a sync)
            names = list(models)
            for i in range(a.steps + 2):
                for k in names[i % len(names):] + names[:i % len(names)]:  # (each repetition in another order:
                    m = models[k]  # the model timed right after another pays or gains the same in turn)
                    c = conns.get(k, conn)
                    before = c.stats().calls if k != "unsplit" else 0
                    tried = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) if dev.type == "cuda" else 0
                    conn.transport.native_calls = k != "python calls"
                    t = timed(lambda: run_one(m))
                    if dev.type == "cuda":
                        retries[k] += torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - tried
                    if i >= 2:
                        times[k].append(t)
                        if k != "unsplit":
                            calls_of[k][name] = c.stats().calls - before
            results[name] = {k: statistics.median(v) for k, v in times.items()}
            # each repetition's ratio (the models of one repetition ran one after another): drift between repetitions cancels
            paired[name] = {k: sorted(a / b for a, b in zip(v, times["unsplit"])) for k, v in times.items() if k != "unsplit"}
            alloc_retries[name] = retries
            if any(retries.values()):
                print(f"{name}: the tenant's allocator retried after freeing its cache (synchronising) {retries}", flush=True)
            if a.profile:
                profile(name, lambda: run_one(models["symbiont"]))
            if a.gpu_time:
                gpu_time(name, run_one)
            if a.torch_profile:
                for k, m in models.items():
                    torch_profile(f"{name}, {k}", lambda: run_one(m))
            r = results[name]
            print(f"{name:10s} unsplit {r['unsplit'] * 1e3:9.2f} ms  symbiont {r['symbiont'] * 1e3:9.2f} ms  "
                  f"ratio {r['symbiont'] / r['unsplit']:.3f} (paired {spread(paired[name]['symbiont'])})  calls {calls[name]:.0f}", flush=True)
            for k in [k for k in r if k not in ("unsplit", "symbiont")]:
                print(f"{'':10s} {k} {r[k] * 1e3:9.2f} ms  ratio {r[k] / r['unsplit']:.3f}  calls {calls_of[k][name]:.0f}", flush=True)

        torch.manual_seed(0)
        vocab = base.config.vocab_size
        prompt = torch.randint(1, vocab, (1, 128), device=dev)
        long = torch.randint(1, vocab, (1, 2048), device=dev)
        gen_kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            scenario("prefill", lambda m: m(long, use_cache=False))
            scenario("decode", lambda m: m.generate(prompt, **gen_kw))
        if "decode" in results:
            results["decode"] = {k: v / a.new_tokens for k, v in results["decode"].items()}  # per token

        batch = torch.randint(1, vocab, (2, 512), device=dev)
        models = {k: lora(m) for k, m in models.items()}
        opts = {k: torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-4) for k, m in models.items()}
        for m in models.values():
            m.train()

        def step(m):
            k = next(k for k, model in models.items() if model is m)
            m(input_ids=batch, labels=batch).loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)

        scenario("finetune", step)
        s = conn.stats()
        graphs = {"calls": s.calls, "graph_replays": s.graph_replays, "graph_captures": s.graph_captures}
        print(f"executor: {s.graph_replays} of {s.calls} calls were graph replays ({s.graph_captures} captures)", flush=True)
        for c in [conn, *conns.values()]:
            c.close()
    finally:
        for p_ in procs:
            p_.send_signal(2)
        for p_ in procs:
            p_.wait(120)
    out = {
        "model": a.model, "gpu": gpu_name, "torch": torch.__version__, "fuse": not a.no_fuse,
        "wait_replies": a.wait_replies, "serve_args": a.serve_args,
        "seconds": results, "gpu_time": gpu_times, "tenant_alloc_retries": alloc_retries, "symbiont_calls": calls, "per_linear_mlp_calls": calls_off,
        "calls": calls_of, "executor_graphs": graphs,
        "ratio": {k: v["symbiont"] / v["unsplit"] for k, v in results.items()},
        "paired_ratios": paired,
        "overhead_per_call_us": {
            k: (v["symbiont"] - v["unsplit"]) * (a.new_tokens if k == "decode" else 1) / max(calls[k], 1) * 1e6
            for k, v in results.items()
        },
    }
    (out_dir / f"s1_split_tax-{a.model}.json").write_text(json.dumps(out, indent=2))
    goals = {"finetune": 1.15, "decode": 1.10, "prefill": 1.10}
    how = (" (no fusion)" if a.no_fuse else "") + (" (calls wait for replies)" if a.wait_replies else "") + (f" (serve {a.serve_args})" if a.serve_args else "")
    print(f"\nS1 split tax, {a.model} bf16, {gpu_name}{how}")
    print(f"{'scenario':10s} {'unsplit ms':>11s} {'symbiont ms':>12s} {'ratio':>7s} {'goal':>6s} {'calls':>7s} {'µs/call':>8s}"
          f"  paired ratio: median [quartiles]")
    for k in [k for k in ("finetune", "decode", "prefill") if k in results]:
        v = results[k]
        print(f"{k:10s} {v['unsplit'] * 1e3:11.2f} {v['symbiont'] * 1e3:12.2f} {out['ratio'][k]:7.3f} {goals[k]:6.2f} "
              f"{calls[k]:7.0f} {out['overhead_per_call_us'][k]:8.1f}  {spread(paired[k]['symbiont'])}")
    for other in [k for k in models if k not in ("unsplit", "symbiont")]:
        print({"per-linear MLP": "with whole-MLP calls off:", "python calls": "with native calls off:",
               "eager executor": "served by an executor without graphs:",
               "python-serving executor": "served by an executor without native lanes:",
               "unfused-act executor": "served by an executor without the fused MLP activation:",
               "layer-spans executor": "served by an executor with layer spans (one call a decoder layer while decoding):"}[other])
        for k in [k for k in ("finetune", "decode", "prefill") if k in results]:
            v = results[k]
            print(f"{k:10s} {v['unsplit'] * 1e3:11.2f} {v[other] * 1e3:12.2f} {v[other] / v['unsplit']:7.3f} "
                  f"{goals[k]:6.2f} {calls_of[other][k]:7.0f} {'':8s}  {spread(paired[k][other])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
