"""S2: K fine-tuning tenants on one executor against K independent HF + PEFT processes (one GPU, MPS).

    python benchmarks/s2_finetune.py --model llama-1b --ks 1,2,4,8,16 [--max-processes 8]
        [--policies opportunistic,lockstep,no-lockstep] [--seconds 20] [--py-spy K]

Each tenant fine-tunes its own LoRA (q, v; ranks cycling 8/16/32/64) on batches of 2 x 512 tokens
with AdamW. Tenants build their models with `connect(url).model(device=...)`. Per K: the processes
(as many as `--max-processes`), then the tenants on one executor per policy (started once, reused
for every K). Prints a table, writes JSON and a PNG into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import fleet

FLOPS_PER_TOKEN = {"llama-1b": 5.0e9, "llama-8b": 33e9}  # BENCHMARKS.md: frozen forward + input-gradient backward
PEAK_BF16 = 790e12


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--ks", default="1,2,4,8,16")
    p.add_argument("--max-processes", type=int, default=8, help="the most plain processes to run (they must fit)")
    p.add_argument("--policies", default="opportunistic")
    p.add_argument("--executors", default="", help='executors to compare, "NAME=FLAGS;NAME=FLAGS" (overrides --policies)')
    p.add_argument("--serve-args", default="", help="more flags for base-executor serve")
    p.add_argument("--tenant-flags", default="", help='tenant fleets to compare on each executor, "NAME=WORKER FLAGS;..." '
                   '(fleet_worker.py, e.g. "fused=;chunked=--lm-loss chunked")')
    p.add_argument("--process-flags", default="", help='process fleets to run beside one another, "NAME=WORKER FLAGS;..." '
                   '(fleet_worker.py, e.g. "eager=;compiled=--compile-train default"); default: one fleet, "processes"')
    p.add_argument("--rounds", type=int, default=1, help="with --tenant-flags: run them this many times, every other "
                   "round in reverse order")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cuda-waits", default="auto", choices=["auto", "spin", "yield", "blocking"],
                   help="how every process and tenant (not the executor) waits for its GPU (fleet_worker.py)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--py-spy", type=int, default=0, help="at this K, sample the executor with py-spy (pip install py-spy)")
    p.add_argument("--gpu-profile", default="", help="at these K (comma-separated), one more run of each side with every "
                   "process's GPU work and CPU time recorded (benchmarks/fleet_timeline.py)")
    p.add_argument("--out", default=str(fleet.REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in a.ks.split(",")]
    profile_ks = {int(k) for k in a.gpu_profile.split(",") if k}
    timelines = {}

    def profiled(workers, who, k, executor=None):
        stem = f"s2_{a.model}_{a.tag}_k{k}_{who.replace(' ', '-')}"
        names = [f"{'tenant' if executor else 'process'} {i}" for i in range(k)]
        s = fleet.run_profiled(workers, a.seconds, names, a.batch * a.seq, out, stem, f"S2 {a.model} K = {k}, {who}", executor)
        timelines[f"{who} k={k}"] = {key: v for key, v in s.items() if key != "results"}
    common = ["--role", "finetune", "--model", a.model, "--device", a.device, "--batch", str(a.batch), "--seq", str(a.seq),
              "--warmup", str(a.warmup), "--cuda-waits", a.cuda_waits]
    rows = []
    print(f"MPS {'on' if fleet.mps_running() else 'OFF'}", flush=True)
    for k, (pvariant, pextra) in ((k, v) for k in ks for v in fleet.tenant_variants(a.process_flags)):
        if k <= a.max_processes:
            pwho = "processes" + (f", {pvariant}" if pvariant else "")
            pworkers = [["--mode", "plain", "--index", str(i), *common, *pextra] for i in range(k)]
            res, base, peak = fleet.run_fleet(pworkers, a.seconds)
            rows.append({"k": k, "who": pwho, **fleet.finetune_figures(res), "gpu_used": peak - base})
            print(json.dumps(rows[-1]), flush=True)
            if k in profile_ks:
                profiled(pworkers, pwho, k)
    for policy, flags in fleet.executor_variants(a):
        ex_profile = out / f"s2_{a.model}_{a.tag}_{policy}_executor.profile.json" if profile_ks else None
        proc, url = fleet.start_executor(a.model, a.device, *flags, log_dir=out, profile_out=ex_profile)
        try:
            for k, (variant, extra) in ((k, v) for k in ks for v in fleet.tenant_variants(a.tenant_flags, a.rounds)):
                who = f"symbiont {policy}" + (f", {variant}" if variant else "")
                before = fleet.executor_stats(url)
                spy_path = out / f"s2_{a.model}_k{k}_{policy}_executor_pyspy.txt"
                spies = []
                on_go = (lambda _, __: spies.append(fleet.py_spy(proc.pid, a.seconds * 0.8, spy_path))) if a.py_spy == k else None
                workers = [["--mode", "symbiont", "--url", url, "--index", str(i), *common, *extra] for i in range(k)]
                res, base, peak = fleet.run_fleet(workers, a.seconds, on_go=on_go)
                after = fleet.executor_stats(url)
                for spy in spies:
                    fleet.wait_spy(spy, a.seconds)
                    from s6_profile import top_frames
                    print(top_frames(spy_path, fleet.REPO), flush=True)
                # the executor's memory is in `base` (started before the fleet): count it once
                rows.append({"k": k, "who": who, **fleet.finetune_figures(res),
                             "gpu_used": peak - base + int(before.get("gpu_reserved_bytes", 0)) + int(before.get("mailbox_bytes", 0)),
                             "gpu_used_total": peak, "batches": fleet.batch_share(before, after)})
                print(json.dumps(rows[-1]), flush=True)
                if k in profile_ks:
                    profiled(workers, who, k, (proc, ex_profile))
        finally:
            fleet.stop(proc)
    flops = FLOPS_PER_TOKEN.get(a.model)
    print(f"\nS2 {a.model}, {a.batch} x {a.seq} tokens per step, {a.seconds:.0f} s windows")
    print(f"{'K':>3} {'who':<34} {'tokens/s':>9} {'step p50':>9} {'p99':>7} {'GPU GB':>7} {'% peak':>7} {'calls/batch':>11}  executor's host")
    for r in rows:
        share = f"{100 * r['tokens_per_s'] * flops / PEAK_BF16:.1f}" if flops else "-"
        cpb = r.get("batches", {}).get("calls_per_batch")
        print(f"{r['k']:>3} {r['who']:<34} {r['tokens_per_s']:>9.0f} {r['step_p50_ms']:>8.1f} {r['step_p99_ms']:>7.1f} "
              f"{r['gpu_used'] / 1e9:>7.1f} {share:>7} {'' if cpb is None else f'{cpb:.2f}':>11}  "
              f"{fleet.host_figures(r.get('batches', {}))}")
    path = out / f"s2_{a.model}_{a.tag}.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows, "timelines": timelines}, indent=1))
    plot(rows, out / f"s2_{a.model}_{a.tag}.png", f"S2 fine-tuning, {a.model}")
    print(f"wrote {path}")
    return 0


def plot(rows, path, title, y="tokens_per_s", y2="step_p50_ms", labels=("aggregate tokens/s", "step time p50, ms")):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for who in dict.fromkeys(r["who"] for r in rows):
        pts = [r for r in rows if r["who"] == who]
        for ax, key in zip(axes, (y, y2)):
            ax.plot([r["k"] for r in pts], [r[key] for r in pts], marker="o", label=who)
    for ax, label in zip(axes, labels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tenants")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
