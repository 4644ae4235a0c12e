"""S4: a mixed fleet — 6 inference + 2 fine-tuning tenants — against 8 inference tenants, on one
executor (one GPU, MPS). Inference inter-token latency should stay within 1.15x of the
inference-only fleet's while the total throughput (generated + trained tokens) rises. With several
`--policies` it is also S5's mixed case (opportunistic against lockstep and no-lockstep).

    python benchmarks/s4_mixed.py --model llama-1b [--policies opportunistic,lockstep,no-lockstep] [--seconds 20]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import fleet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--inference", type=int, default=6)
    p.add_argument("--finetune", type=int, default=2)
    p.add_argument("--policies", default="opportunistic")
    p.add_argument("--executors", default="", help='executors to compare, "NAME=FLAGS;NAME=FLAGS" (overrides --policies)')
    p.add_argument("--serve-args", default="")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--train-mps-priority", default="", help="comma list: the mixed fleet once per value, its fine-tuning "
                   "tenants' CUDA_MPS_CLIENT_PRIORITY (1: below normal; '' the default)")
    p.add_argument("--train-mps-threads", default="", help="comma list: the mixed fleet once per value (and per "
                   "--train-mps-priority), its fine-tuning tenants' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE ('' the default)")
    p.add_argument("--rounds", type=int, default=1, help="run the fleets this many times, every other round in "
                   "reverse order (the first fleet on a fresh executor has run slow), and print each fleet's mean too")
    p.add_argument("--out", default=str(fleet.REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    infer = ["--role", "infer", "--model", a.model, "--device", a.device, "--warmup", "1", "--targets",
             "q_proj,k_proj,v_proj,o_proj"]
    train = ["--role", "finetune", "--model", a.model, "--device", a.device, "--warmup", "2"]
    total = a.inference + a.finetune
    rows = []
    for policy, flags in fleet.executor_variants(a):
        proc, url = fleet.start_executor(a.model, a.device, *flags, log_dir=out)
        try:
            fleets = [(f"{total} inference", [["--mode", "symbiont", "--url", url, "--index", str(i), *infer] for i in range(total)])]
            for priority in a.train_mps_priority.split(","):
                for threads in a.train_mps_threads.split(","):
                    label = ", ".join(x for x in (f"MPS {priority}" if priority else "", f"SMs {threads}%" if threads else "") if x)
                    fleets.append((f"{a.inference} inference + {a.finetune} fine-tuning" + (f" ({label})" if label else ""),
                                   [["--mode", "symbiont", "--url", url, "--index", str(i), *infer] for i in range(a.inference)]
                                   + [["--mode", "symbiont", "--url", url, "--index", str(i), *train, "--mps-priority", priority,
                                       "--mps-threads", threads] for i in range(a.finetune)]))
            for name, fleet_args in fleet.alternating(fleets, a.rounds):
                before = fleet.executor_stats(url)
                res, base, peak = fleet.run_fleet(fleet_args, a.seconds)
                after = fleet.executor_stats(url)
                inf = fleet.infer_figures([r for r in res if r["role"] == "infer"])
                ft = [r for r in res if r["role"] == "finetune"]
                rows.append({"policy": policy, "fleet": name, "generated_per_s": inf["tokens_per_s"],
                             "itl_p50_ms": inf["itl_p50_ms"], "itl_p99_ms": inf["itl_p99_ms"],
                             "trained_per_s": fleet.finetune_figures(ft)["tokens_per_s"] if ft else 0.0,
                             "batches": fleet.batch_share(before, after)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            fleet.stop(proc)
    print(f"\nS4 {a.model}: {total} inference tenants against {a.inference} inference + {a.finetune} fine-tuning, "
          f"{a.seconds:.0f} s windows")
    print(f"{'policy':<14} {'fleet':<40} {'gen tok/s':>9} {'ITL p50':>8} {'p99':>7} {'trained tok/s':>13} {'calls/batch':>11}")
    for r in rows:
        print(f"{r['policy']:<14} {r['fleet']:<40} {r['generated_per_s']:>9.1f} {r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>7.2f} "
              f"{r['trained_per_s']:>13.0f} {r['batches']['calls_per_batch']:>11.2f}")
    if a.rounds > 1:  # each fleet's mean over its rounds, and its ITL against the first fleet's (the decoding-only one)
        print(f"means over {a.rounds} rounds (every other in reverse order):")
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            names = list(dict.fromkeys(r["fleet"] for r in mine))
            mean = {n: {k: sum(r[k] for r in mine if r["fleet"] == n) / sum(r["fleet"] == n for r in mine)
                        for k in ("generated_per_s", "itl_p50_ms", "itl_p99_ms", "trained_per_s")} for n in names}
            for n in names:
                m = mean[n]
                print(f"{policy:<14} {n:<40} {m['generated_per_s']:>9.1f} {m['itl_p50_ms']:>8.2f} {m['itl_p99_ms']:>7.2f} "
                      f"{m['trained_per_s']:>13.0f}  ITL p50 {m['itl_p50_ms'] / mean[names[0]]['itl_p50_ms']:.2f}x the first")
    path = out / f"s4_{a.model}_{a.tag}.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
