"""S9: hosted adapters. N decoding tenants, each with one LoRA adapter (q,v or `--targets`, ranks 8-128) drawn from
M registered with the executor, against the same tenants holding the same adapters privately, and
against N HF + PEFT processes (one GPU, MPS).

    python benchmarks/s9_hosted.py --model llama-1b --ns 16,64 --registered 100,2000 [--zipf 1.0]
        [--executors "pool=--adapter-pool-mb 1024;merge=--adapter-pool-mb 1024 --merge auto"]
    python benchmarks/s9_hosted.py --ns 16 --registered 100 --skews 0.2,0.4,0.6,0.8 \\
        --executors "unmerged=;orchestrator=--merge auto;merged=--merge auto --merge-share 0.01"

Adapters come from benchmarks/s9_adapters.py (adapter k: rank 8/16/32/64/128 by k, seeded weights);
the runner registers all M as the provider's (`provider.host_weights`) on every executor it starts.
Each tenant draws its adapter by Zipf popularity (`--zipf s`), or with `--skews P,...` the most
popular adapter goes to a share P of the tenants and the others get one each (VaLoRA Figure 19's
workload, for comparing merged modes). Hosted tenants name their adapter (`conn.model(...,
adapter="s9-k")`); private ones load its weights into PEFT; processes do the same unsplit. Generation
as S3: prompt 128, 64 new tokens, batch 1, greedy, again and again over a window.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import fleet
import s9_adapters
from s2_finetune import plot


def register(url: str, model: str, m: int, targets=s9_adapters.TARGETS) -> float:
    """Registers adapters s9-0 .. s9-(m-1) (LoRA on `targets`) as the provider's; seconds taken."""
    from symbiont.base_executor.models import BUILTINS
    from symbiont.base_executor.provider import host_weights

    config = BUILTINS[model].config()
    t0 = time.monotonic()
    for k in range(m):
        host_weights(url, f"s9-{k}", s9_adapters.as_proto(s9_adapters.adapter_weights(config, k, targets=targets)))
    return time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--ns", default="16")
    p.add_argument("--registered", default="100")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of the tenants' draws")
    p.add_argument("--skews", default="", help="instead of Zipf draws: shares of the tenants naming the top adapter")
    p.add_argument("--max-processes", type=int, default=16)
    p.add_argument("--tenants-per-process", type=int, default=1, help="symbiont tenants in one process each this many "
                   "(fleet_worker --tenants: MPS takes 48 processes a GPU, so N = 64 runs as 16 processes of 4)")
    p.add_argument("--targets", default=",".join(s9_adapters.TARGETS),
                   help=f"the adapters' projections, of {','.join(s9_adapters.ATTENTION)} (S3's: all four)")
    p.add_argument("--no-private", action="store_true", help="skip the tenants holding their adapters privately")
    p.add_argument("--executors", default="pool=--adapter-pool-mb 1024", help='"NAME=FLAGS;..." serve flags per executor')
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tenant-flags", default="", help='fleet_worker flags every symbiont tenant (hosted and private) gets, '
                   'e.g. --tenant-flags="--step-graphs --compiled-steps" (with =: the value starts with --; the processes run as users run them)')
    p.add_argument("--out", default=str(fleet.REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = [int(n) for n in a.ns.split(",")]
    workloads = [(f"top {float(s):.0%}", float(s)) for s in a.skews.split(",") if s] or [(f"zipf {a.zipf}", None)]
    targets = a.targets.split(",")
    s9_adapters.check_targets(targets)  # (before anything starts)
    common = ["--model", a.model, "--device", a.device, "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens),
              "--warmup", str(a.warmup), "--targets", a.targets]
    rows = []
    print(f"MPS {'on' if fleet.mps_running() else 'OFF'}", flush=True)

    def choices(n, m, skew):
        return s9_adapters.skewed_choice(n, m, skew) if skew is not None else s9_adapters.zipf_choice(n, m, a.zipf)

    def add(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    registered = [int(x) for x in a.registered.split(",")]
    variants = fleet.executor_variants(a)
    for m in registered:
        for n in ns:  # the processes and the private tenants do not depend on the executor's flags
            for load, skew in workloads:
                picks = choices(n, m, skew)
                if n <= a.max_processes and m == registered[0]:
                    res, base, peak = fleet.run_fleet([["--mode", "plain", "--role", "infer", "--index", str(i),
                                                        "--s9-adapter", str(k), *common] for i, k in enumerate(picks)], a.seconds)
                    add({"registered": m, "k": n, "load": load, "who": f"processes ({load})", **fleet.infer_figures(res),
                         "gpu_used": peak - base, "adapters_used": len(set(picks))})
        for name, flags in variants:
            proc, url = fleet.start_executor(a.model, a.device, *flags, log_dir=out)
            try:
                seconds = register(url, a.model, m, targets)
                print(f"registered {m} adapters in {seconds:.1f} s ({name})", flush=True)
                for n in ns:
                    for load, skew in workloads:
                        picks = choices(n, m, skew)
                        kinds = [("hosted", ["--shared"])] + ([] if a.no_private or name != variants[0][0]
                                                             else [("private", [])])
                        for kind, extra in kinds:
                            before = fleet.executor_stats(url)
                            per = a.tenants_per_process
                            res, base, peak = fleet.run_fleet(
                                [["--mode", "symbiont", "--role", "infer", "--url", url, "--index", str(i), *extra, *common,
                                  "--tenants", str(len(picks[i:i + per])), "--s9-adapters", ",".join(map(str, picks[i:i + per])),
                                  *a.tenant_flags.split()]
                                 for i in range(0, n, per)], a.seconds)
                            after = fleet.executor_stats(url)
                            d = {key: int(after.get(key, 0)) - int(before.get(key, 0))
                                 for key in ("adapter_hits", "adapter_misses", "adapter_evictions", "merge_switches", "merged_tokens",
                                             "adapter_calls")}
                            looked = d["adapter_hits"] + d["adapter_misses"]
                            add({"registered": m, "k": n, "load": load, "who": f"symbiont {name}, {kind} ({load})" + (f", {per} a process" if per > 1 else ""),
                                 **fleet.infer_figures(res), "gpu_used": peak - base, "adapters_used": len(set(picks)),
                                 "hit_rate": d["adapter_hits"] / looked if looked else None, **d,
                                 "merged_adapter": after.get("merged_adapter", ""),
                                 "adapter_resident_mb": int(after.get("adapter_resident_bytes", 0)) / 2**20,
                                 "batches": fleet.batch_share(before, after)})
            finally:
                fleet.stop(proc)
    print(f"\nS9 {a.model}, adapters on {a.targets}, prompt {a.prompt}, {a.new_tokens} new tokens, batch 1 per tenant, {a.seconds:.0f} s windows"
          + (f", tenants with {a.tenant_flags}" if a.tenant_flags else ""))
    print(f"{'M':>5} {'N':>3} {'who':<44} {'tokens/s':>9} {'ITL p50':>8} {'p99':>7} {'GPU GB':>7} {'hit rate':>8} "
          f"{'switches':>8} {'merged tokens':>13}")
    for r in rows:
        hit = r.get("hit_rate")
        print(f"{r['registered']:>5} {r['k']:>3} {r['who']:<44} {r['tokens_per_s']:>9.1f} {r['itl_p50_ms']:>8.2f} "
              f"{r['itl_p99_ms']:>7.2f} {r['gpu_used'] / 1e9:>7.1f} {'' if hit is None else f'{hit:.1%}':>8} "
              f"{r.get('merge_switches', ''):>8} {r.get('merged_tokens', ''):>13}")
    path = out / f"s9_{a.model}_{a.tag}.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    plot([dict(r, who=f"M={r['registered']} {r['who']}") for r in rows], out / f"s9_{a.model}_{a.tag}.png",
         f"S9 hosted adapters, {a.model}", y2="itl_p99_ms", labels=("aggregate tokens/s", "inter-token latency p99, ms"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
