"""S3: N inference tenants on one executor against N independent HF + PEFT processes, and against one
process generating for all N with PEFT mixed-adapter batching (one GPU, MPS).

    python benchmarks/s3_inference.py --model llama-1b --ns 1,4,16,32,64 [--max-processes 16]
        [--policies opportunistic,lockstep,no-lockstep] [--seconds 20]

Each tenant has its own LoRA (q, k, v, o; ranks cycling 8/16/32/64) and generates greedily, batch 1,
`--new-tokens` after a `--prompt`-token prompt, again and again. Figures: aggregate generated
tokens/s, inter-token latency p50/p99 (every token after the first). Tenants build their models
with `connect(url).model(device=...)`.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import fleet
from s2_finetune import plot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--ns", default="1,4,16")
    p.add_argument("--max-processes", type=int, default=16)
    p.add_argument("--mixed", default="", help="N values at which to run the one-process mixed-adapter baseline (default: --ns; none: never)")
    p.add_argument("--policies", default="opportunistic")
    p.add_argument("--executors", default="", help='executors to compare, "NAME=FLAGS;NAME=FLAGS" (overrides --policies)')
    p.add_argument("--serve-args", default="")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cuda-waits", default="auto", choices=["auto", "spin", "yield", "blocking"],
                   help="how every process and tenant (not the executor) waits for its GPU (fleet_worker.py)")
    p.add_argument("--compile", default="", choices=["", "default", "reduce-overhead"],
                   help="every process and tenant generates with a static KV cache and a compiled forward (fleet_worker.py)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tenant-flags", default="", help='tenant fleets to compare on each executor, "NAME=WORKER FLAGS;..." '
                   '(fleet_worker.py, e.g. "drop=;keep=--keep-full-masks")')
    p.add_argument("--process-flags", default="", help='process fleets to run beside one another, "NAME=WORKER FLAGS;..." '
                   '(fleet_worker.py, e.g. "eager=;compiled=--compile default": processes as users run them and compiled); '
                   'default: one fleet, "processes"')
    p.add_argument("--rounds", type=int, default=1, help="with --tenant-flags: run them this many times, every other "
                   "round in reverse order")
    p.add_argument("--tenant-waits", default="", help="comma list of --cuda-waits values: the tenants once per value "
                   "(the processes keep --cuda-waits)")
    p.add_argument("--tenants-per-process", type=int, default=1, help="symbiont tenants in one process each this many "
                   "(threads, each its own connection and adapter; fleet_worker --tenants): N beyond MPS's 48 clients a GPU")
    p.add_argument("--py-spy-native", action="store_true", help="with --py-spy: tenant 0 and process 0 sampled with "
                   "their native frames too (CUDA's driver, torch's C++), and their main threads' native leaves printed")
    p.add_argument("--py-spy", type=int, default=0, help="at this N, sample the executor, tenant 0 and process 0 with py-spy (pip install py-spy)")
    p.add_argument("--hosted", action="store_true", help="also run the tenants with their adapters hosted by the executor (issue 21)")
    p.add_argument("--gpu-profile", default="", help="at these N (comma-separated), one more run of each side with every "
                   "process's GPU work and CPU time recorded (benchmarks/fleet_timeline.py)")
    p.add_argument("--out", default=str(fleet.REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    if a.tenant_waits and not set(a.tenant_waits.split(",")) <= {"auto", "spin", "yield", "blocking"}:
        p.error(f"--tenant-waits {a.tenant_waits}: each of auto, spin, yield, blocking")
    if a.py_spy_native and not a.py_spy:
        p.error("--py-spy-native samples the N of --py-spy: give that too")
    if a.tenants_per_process < 1 or any(int(n) % a.tenants_per_process for n in a.ns.split(",")):
        p.error(f"--tenants-per-process {a.tenants_per_process}: each N of --ns a multiple of it")
    if a.tenants_per_process > 1 and (a.gpu_profile or a.py_spy):
        p.error("--tenants-per-process > 1 takes no --gpu-profile or --py-spy (their tallies are a process's, one tenant each)")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = [int(n) for n in a.ns.split(",")]
    profile_ns = {int(n) for n in a.gpu_profile.split(",") if n}
    timelines = {}

    def profiled(workers, who, n, executor=None):
        stem = f"s3_{a.model}_{a.tag}_n{n}_{who.replace(' ', '-')}"
        names = [f"{'tenant' if executor else 'process'} {i}" for i in range(n)]
        s = fleet.run_profiled(workers, a.seconds, names, 1, out, stem, f"S3 {a.model} N = {n}, {who}", executor)
        timelines[f"{who} n={n}"] = {key: v for key, v in s.items() if key != "results"}
    mixed = [] if a.mixed == "none" else [int(n) for n in a.mixed.split(",")] if a.mixed else ns
    common = ["--model", a.model, "--device", a.device, "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens),
              "--warmup", str(a.warmup), "--targets", "q_proj,k_proj,v_proj,o_proj", "--cuda-waits", a.cuda_waits,
              *(["--compile", a.compile] if a.compile else [])]
    rows = []
    print(f"MPS {'on' if fleet.mps_running() else 'OFF'}", flush=True)
    pvariants = fleet.tenant_variants(a.process_flags)
    for n, (pvariant, pextra) in ((n, v) for n in ns for v in pvariants):
        pwho = "processes" + (f", {pvariant}" if pvariant else "")
        if n <= a.max_processes:
            spy_path, spies = out / f"s3_{a.model}_{a.tag}_n{n}_process0_pyspy.txt", []
            on_go = (lambda _, pids: spies.append(fleet.py_spy(pids[0], a.seconds * 0.8, spy_path, a.py_spy_native))) if a.py_spy == n else None
            pworkers = [["--mode", "plain", "--role", "infer", "--index", str(i), *common, *pextra] for i in range(n)]
            res, base, peak = fleet.run_fleet(pworkers, a.seconds, on_go=on_go)
            for spy in spies:
                fleet.wait_spy(spy, a.seconds)
                from s6_profile import top_frames, waits

                print("process 0:\n" + top_frames(spy_path, fleet.REPO) + "\nprocess 0, its main thread:\n" + waits(spy_path), flush=True)
                if a.py_spy_native:
                    from s6_profile import native_leaves

                    print("process 0, its main thread's innermost frames:\n" + native_leaves(spy_path), flush=True)
            rows.append({"k": n, "who": pwho, **fleet.infer_figures(res), "gpu_used": peak - base})
            print(json.dumps(rows[-1]), flush=True)
            if n in profile_ns:
                profiled(pworkers, pwho, n)
        if n in mixed and pvariant == pvariants[0][0]:  # (once an N)
            res, base, peak = fleet.run_fleet([["--mode", "plain", "--role", "infer-mixed", "--adapters", str(n), *common]], a.seconds)
            rows.append({"k": n, "who": "one process, mixed adapters", **fleet.infer_figures(res), "gpu_used": peak - base})
            print(json.dumps(rows[-1]), flush=True)
    def row(n, who, res, base, peak, before, after):
        # (the executor's memory is in `base`, started before the fleet: counted once)
        rows.append({"k": n, "who": who, **fleet.infer_figures(res),
                     "gpu_used": peak - base + int(before.get("gpu_reserved_bytes", 0)) + int(before.get("mailbox_bytes", 0)),
                     "batches": fleet.batch_share(before, after)})
        print(json.dumps(rows[-1]), flush=True)

    for policy, flags in fleet.executor_variants(a):
        ex_profile = out / f"s3_{a.model}_{a.tag}_{policy}_executor.profile.json" if profile_ns else None
        proc, url = fleet.start_executor(a.model, a.device, *flags, log_dir=out, profile_out=ex_profile)
        try:
            variants = fleet.tenant_variants(a.tenant_flags, a.rounds)
            for n, wait_mode, (variant, extra) in ((n, w, v) for n in ns for w in (a.tenant_waits or a.cuda_waits).split(",") for v in variants):
                before = fleet.executor_stats(url)
                mine = [*common[:common.index("--cuda-waits")], "--cuda-waits", wait_mode, *common[common.index("--cuda-waits") + 2:], *extra]
                who = f"symbiont {policy}" + (f", waits {wait_mode}" if a.tenant_waits else "") + (f", {variant}" if variant else "")
                per = a.tenants_per_process
                workers = [["--mode", "symbiont", "--role", "infer", "--url", url, "--index", str(i), *mine]
                           + (["--tenants", str(per)] if per > 1 else []) for i in range(0, n, per)]
                who += f", {per} a process" if per > 1 else ""
                spy_paths = [out / f"s3_{a.model}_{a.tag}_n{n}_{policy}{'-' + wait_mode if a.tenant_waits else ''}{'-' + variant if variant else ''}_{side}_pyspy.txt"
                             for side in ("executor", "tenant0")]
                spies = []

                def on_go(_, pids):
                    for pid, path, native in zip((proc.pid, pids[0]), spy_paths, (False, a.py_spy_native)):
                        spies.append(fleet.py_spy(pid, a.seconds * 0.8, path, native))

                res, base, peak = fleet.run_fleet(workers, a.seconds, on_go=on_go if a.py_spy == n else None)
                after = fleet.executor_stats(url)
                for spy in spies:
                    fleet.wait_spy(spy, a.seconds)
                if spies:
                    from s6_profile import top_frames, waits

                    print("executor, its data loop:\n" + top_frames(spy_paths[0], fleet.REPO, within="_data_loop"), flush=True)
                    print("tenant 0:\n" + top_frames(spy_paths[1], fleet.REPO), flush=True)
                    print("tenant 0, its main thread:\n" + waits(spy_paths[1]), flush=True)
                    if a.py_spy_native:
                        from s6_profile import native_leaves

                        print("tenant 0, its main thread's innermost frames:\n" + native_leaves(spy_paths[1]), flush=True)
                row(n, who, res, base, peak, before, after)
                if a.hosted:  # the same tenants with their adapters hosted by the executor
                    before = fleet.executor_stats(url)
                    res, base, peak = fleet.run_fleet([[*w, "--hosted"] for w in workers], a.seconds)
                    row(n, f"{who}, hosted adapters", res, base, peak, before, fleet.executor_stats(url))
                if n in profile_ns:
                    profiled(workers, who, n, (proc, ex_profile))
        finally:
            fleet.stop(proc)
    print(f"\nS3 {a.model}, prompt {a.prompt}, {a.new_tokens} new tokens, batch 1 per tenant, {a.seconds:.0f} s windows"
          + (f", every forward compiled (mode {a.compile}, static KV cache)" if a.compile else ""))
    # A tenant generates one token after another, so N of them give at most N x what one gives
    # alone: "of N x 1" is how near a row comes to that (its who's N = 1 row of this run).
    solo = {r["who"]: r["tokens_per_s"] for r in rows if r["k"] == 1}
    print(f"{'N':>3} {'who':<28} {'tokens/s':>9} {'of N x 1':>8} {'ITL p50':>8} {'p99':>7} {'worst':>7} {'GPU GB':>7} {'calls/batch':>11}  executor's host")
    for r in rows:
        cpb = r.get("batches", {}).get("calls_per_batch")
        near = f"{r['tokens_per_s'] / (r['k'] * solo[r['who']]):.2f}" if solo.get(r["who"]) else ""
        print(f"{r['k']:>3} {r['who']:<28} {r['tokens_per_s']:>9.1f} {near:>8} {r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>7.2f} {r.get('itl_p99_worst_ms', 0):>7.2f} "
              f"{r['gpu_used'] / 1e9:>7.1f} {'' if cpb is None else f'{cpb:.2f}':>11}  {fleet.host_figures(r.get('batches', {}))}")
    lone = {r["who"]: r for r in rows if r["k"] == 1}
    for r in rows:  # (S3's latency goal: each tenant's p99 ITL within 2x its lone one)
        one = lone.get(r["who"])
        if r["k"] > 1 and one is not None and one["itl_p99_ms"] > 0:
            print(f"N = {r['k']}, {r['who']}: p99 ITL {r['itl_p99_ms']:.2f} ms, {r['itl_p99_ms'] / one['itl_p99_ms']:.2f}x "
                  f"the lone p99 ({one['itl_p99_ms']:.2f}); the worst tenant's {r.get('itl_p99_worst_ms', 0) / one['itl_p99_ms']:.2f}x")
    for who, one in solo.items():
        if who != "processes" and solo.get("processes"):
            for r in rows:
                if r["who"] == "processes" and r["k"] > 1:
                    print(f"N = {r['k']}: {who} can give at most {r['k']} x {one:.1f} = {r['k'] * one:.1f} tokens/s, "
                          f"{r['k'] * one / r['tokens_per_s']:.2f}x the processes")
    path = out / f"s3_{a.model}_{a.tag}.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows, "timelines": timelines}, indent=1))
    plot(rows, out / f"s3_{a.model}_{a.tag}.png", f"S3 inference, {a.model}", y2="itl_p99_ms",
         labels=("aggregate tokens/s", "inter-token latency p99, ms"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
