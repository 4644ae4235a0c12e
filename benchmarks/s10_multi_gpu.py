"""S10: K fine-tuning tenants on one executor over several GPUs (layer placement) against K
independent HF + PEFT processes spread over the same GPUs (MPS on), and against FSDP.

    python benchmarks/s10_multi_gpu.py --model llama-8b --gpus 2 --ks 1,4,8,12 [--max-processes 6] [--seconds 20]
        [--executors "layers=;tensor=--placement tensor"] [--fsdp-jobs 1,2] [--py-spy K]

Tenant i (and process i) sits on GPU i mod --gpus. The executor is `base-executor serve --devices
cuda:0,...,cuda:G-1`: with layer placement (the default) each rank holds its share of the layers,
so one copy of the model is spread over the GPUs, and a tenant calls the rank on its own GPU
through same-GPU mailboxes and the others as peers; with `--placement tensor` (an --executors
variant) every rank holds a slice of every unit and tenants call rank 0. The work per tenant is S2's (LoRA on q, v; ranks 8/16/32/64 cycling; 2 x 512 tokens per
step; AdamW). Memory per GPU is nvidia-smi's peak minus what the GPU held before anything started.

FSDP (Symbiosis 4.2.2's comparison): J jobs at once, each training one adapter with the model
`fully_shard`ed over all the GPUs, one rank per GPU, each rank stepping on its own batch
(fleet_worker.py --mode fsdp). "Adapters in the same time" is the ratio of aggregate trained tokens/s
at equal tokens per adapter: K tenants against the FSDP row with the most tokens/s (the goal: 4x).
Prints a table, writes JSON into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import fleet

FLOPS_PER_TOKEN = {"llama-1b": 5.0e9, "llama-8b": 33e9, "llama-70b": 2.9e11}


def per_gpu(peaks: list[int], gpus: int) -> list[int]:
    """nvidia-smi's figures of the first `gpus` GPUs (zeros where it has none: no GPU)."""
    return (list(peaks) + [0] * gpus)[:gpus]


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux), oldest first: a sharded executor's ranks 1.. of rank 0."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return sorted(int(v) for v in f.read().split())
    except OSError:
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--ks", default="1,4,8,12")
    p.add_argument("--max-processes", type=int, default=6, help="the most plain processes to run (each holds a whole model)")
    p.add_argument("--executor-model", default="", help="the built-in the executors serve (default --model; "
                   "llama-8b-lazy: llama-8b's shape drawn per rank, loads in seconds)")
    p.add_argument("--serve-args", default="", help="more flags for base-executor serve")
    p.add_argument("--executors", default="", help='executors to compare, "NAME=FLAGS;NAME=FLAGS" (default: one with --serve-args)')
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--checkpointing", action="store_true", help="every job (process, FSDP rank, tenant) with "
                   "gradient checkpointing: activations of one layer at a time, so more tenants fit")
    p.add_argument("--fsdp-batches", default="", help="FSDP rows at each of these batch sizes per rank (comma list; "
                   "default --batch): the baseline at its best batch")
    p.add_argument("--fsdp-jobs", default="1", help="FSDP baseline rows: jobs run at once, comma list ('' for none)")
    p.add_argument("--py-spy", type=int, default=0, help="at this K, sample every rank of the executor and tenant 0 with "
                   "py-spy (pip install py-spy) and print where their time goes")
    p.add_argument("--cpu", action="store_true", help="every rank, tenant and process on the CPU (float32): the runner's "
                   "smoke test with a small model (tests/test_benchmark_baselines.py), no figures")
    p.add_argument("--out", default=str(fleet.REPO / "benchmarks" / "out"))
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in a.ks.split(",")]
    devices = ["cpu"] * a.gpus if a.cpu else [f"cuda:{g}" for g in range(a.gpus)]
    with fleet.GpuMemory() as idle:
        time.sleep(1.0)
    idle = per_gpu(idle.peaks, a.gpus)

    def common(i: int, device: str = "", batch: int = 0) -> list[str]:
        return ["--role", "finetune", "--model", a.model, "--device", device or devices[i % a.gpus], "--batch", str(batch or a.batch),
                "--seq", str(a.seq), "--warmup", str(a.warmup), "--index", str(i)] + (["--checkpointing"] if a.checkpointing else []) + \
            (["--dtype", "float32"] if a.cpu else [])

    def row(k: int, who: str, res, peaks, **more) -> dict:
        used = [p - i for p, i in zip(per_gpu(peaks, a.gpus), idle)]
        r = {"k": k, "who": who, **fleet.finetune_figures(res), "gpu_used_per_gpu": used, **more}
        print(json.dumps(r), flush=True)
        return r

    rows = []
    path = out / f"s10_{a.model}_x{a.gpus}_{a.tag}.json"

    def save():
        path.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))

    print(f"MPS {'on' if fleet.mps_running() else 'OFF'}; {a.gpus} GPUs", flush=True)
    for k in ks:
        if k <= a.max_processes:
            res, _, peaks = fleet.run_fleet([["--mode", "plain", *common(i)] for i in range(k)], a.seconds, per_gpu=True)
            rows.append(row(k, "processes", res, peaks))
            save()
    for j, batch in [(int(v), int(b)) for v in a.fsdp_jobs.split(",") if v for b in (a.fsdp_batches or str(a.batch)).split(",")]:
        ports = [fleet.free_port() for _ in range(j)]  # (one rendezvous per job, its ranks one per GPU)
        workers = [["--mode", "fsdp", *common(job, devices[r], batch), "--fsdp-rank", str(r),
                    "--fsdp-world", str(a.gpus), "--fsdp-port", str(ports[job])]
                   for job in range(j) for r in range(a.gpus)]
        who = f"fsdp x{a.gpus}" + (f" batch {batch}" if batch != a.batch else "")
        try:
            res, _, peaks = fleet.run_fleet(workers, a.seconds, per_gpu=True)
        except RuntimeError as e:
            rows.append({"k": j, "who": who, "failed": str(e)})
            print(json.dumps(rows[-1]), flush=True)
            save()
            continue
        rows.append(row(j, who, res, peaks))
        save()
    variants = fleet.executor_variants(argparse.Namespace(executors=a.executors, policies="opportunistic", serve_args=a.serve_args))
    for name, flags in variants:
        t0 = time.monotonic()
        proc, url = fleet.start_executor(a.executor_model or a.model, devices[0], "--devices", ",".join(devices), *flags,
                                         *(["--dtype", "float32"] if a.cpu else []), log_dir=out)
        print(f"executor {name} over {a.gpus} GPUs ready in {time.monotonic() - t0:.0f} s", flush=True)
        try:
            tensor = "--placement" in flags and flags[flags.index("--placement") + 1:][:1] == ["tensor"]
            for k in ks:
                who = f"symbiont {name} x{a.gpus}"
                # (under layer placement each rank serves its own name too; under tensor placement rank 0 alone)
                rank_urls = [url] + ([] if tensor else [f"{url}.r{r}" for r in range(1, a.gpus)])
                before = [fleet.executor_stats(u) for u in rank_urls]
                spies, spy_paths = [], []

                def on_go(_, pids, k=k):
                    ranks = [proc.pid] + children(proc.pid)  # (rank 0 starts the others)
                    for who, pid in [*((f"rank{r}", pid) for r, pid in enumerate(ranks)), ("tenant0", pids[0])]:
                        spy_path = out / f"s10_{a.model}_x{a.gpus}_{a.tag}_k{k}_{who}_pyspy.txt"
                        try:
                            spies.append(fleet.py_spy(pid, a.seconds * 0.8, spy_path))
                        except FileNotFoundError:  # (the row still runs)
                            print("py-spy is not installed: no profile", flush=True)
                            return
                        spy_paths.append((who, spy_path))

                try:
                    res, _, peaks = fleet.run_fleet([["--mode", "symbiont", "--url", url, *common(i)] for i in range(k)],
                                                    a.seconds, per_gpu=True, on_go=on_go if a.py_spy == k else None)
                except RuntimeError as e:  # (say so, and go on with the next K: the executor log says why)
                    rows.append({"k": k, "who": who, "failed": str(e)})
                    print(json.dumps(rows[-1]), flush=True)
                    save()
                    break
                after = [fleet.executor_stats(u) for u in rank_urls]
                for spy in spies:
                    fleet.wait_spy(spy, a.seconds)
                for spy_who, spy_path in spy_paths:
                    from s6_profile import top_frames

                    within = "_data_loop" if spy_who.startswith("rank") else ""
                    print(f"{spy_who} (py-spy):\n" + top_frames(spy_path, fleet.REPO, within=within), flush=True)
                per_rank = [fleet.batch_share(b, e) for b, e in zip(before, after)]
                rows.append(row(k, who, res, peaks, batches=per_rank[0], batches_per_rank=per_rank))
                save()
        finally:
            fleet.stop(proc)
    flops = FLOPS_PER_TOKEN.get(a.model)
    print(f"\nS10 {a.model} on {a.gpus} GPUs, {a.batch} x {a.seq} tokens per step, {a.seconds:.0f} s windows")
    print(f"{'K':>3} {'who':<22} {'tokens/s':>9} {'step p50':>9} {'GB per GPU':>16} {'TFLOP/s':>8} {'calls a batch':>14} {'wait p50 us per rank*':>22}")
    for r in rows:
        if "failed" in r:
            print(f"{r['k']:>3} {r['who']:<22} failed: {r['failed']}")
            continue
        gbs = "/".join(f"{u / 1e9:.1f}" for u in r["gpu_used_per_gpu"])
        tf = f"{r['tokens_per_s'] * flops / 1e12:.0f}" if flops else "-"
        ranks = r.get("batches_per_rank") or []  # (the ranks' counters over the row: tenants' rows only)
        calls, batches = sum(b["calls"] for b in ranks), sum(b["batches"] for b in ranks)
        per_batch = f"{calls / batches:.2f}" if batches else "-"
        waits = [b["training_wait_p50_us"] for b in ranks if b.get("training_wait_p50_us") is not None]
        wait = "/".join(f"{w:.0f}" for w in waits) or "-"
        print(f"{r['k']:>3} {r['who']:<22} {r['tokens_per_s']:>9.0f} {r['step_p50_ms']:>8.1f} {gbs:>16} {tf:>8} "
              f"{per_batch:>14} {wait:>22}")
    fsdp = max((r["tokens_per_s"] for r in rows if r["who"].startswith("fsdp") and "failed" not in r), default=0.0)
    if fsdp:
        print(f"\nadapters trained in the same time, against FSDP's best ({fsdp:.0f} tokens/s; goal 4x):")
        for r in rows:
            if r["who"].startswith("symbiont") and "failed" not in r:
                print(f"{r['k']:>3} {r['who']:<22} {r['tokens_per_s'] / fsdp:.2f}x")
    print("* each rank's training wait p50 over its last 4096 queued calls at the row's end")
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
