"""Merged mode's switch (issue 21): how long `AdapterRegistry.merge` takes to make the merged copies of
a rank-R adapter on every projection of a model, against the memory-traffic floor (one read and one
write of those units' weights: what any merge must move, timed as a plain device copy of the same
bytes), and what unmerging costs (dropping the copies).

    python benchmarks/probes/merge_switch.py --model llama-8b --rank 64 [--device cuda:0] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--paths", default="kernel", help="comma list: how the merged copies are written, timed in turn in "
                   "one run: kernel (one launch of the merge kernel for every adapted row), addmm (one per copy)")
    p.add_argument("--tiles", default="", help="also time the merge kernel alone on the same rows for each tiling, "
                   "comma list of BMxBNxBR/WARPS/STAGES[/gG] (e.g. 64x128x64/4/3/g4, plan_merge's default: G row tiles of "
                   "BM x BN a program, under one A block of BR >= the rank), beside one addmm per row")
    p.add_argument("--profile", action="store_true", help="cProfile one more merge per path: the host's share of the switch")
    p.add_argument("--out", default="")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    from symbiont.base_executor.adapters import AdapterRegistry
    from symbiont.base_executor.catalog import UnitTable
    from symbiont.base_executor.models import BUILTINS
    from symbiont.proto import executor_pb2 as pb
    from symbiont.proto.codec import dtype_enum

    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    config = BUILTINS[a.model].config()
    with device:  # random weights made on the device: their values do not change the time
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    table = UnitTable(model)
    registry = AdapterRegistry(table, device)
    weights, g = [], torch.Generator().manual_seed(0)
    for uid, unit in table.units.items():
        if uid.rpartition(".")[2] in PROJECTIONS and unit.kind == "linear" and not unit.members:
            A = (torch.randn(a.rank, unit.in_features, generator=g) * 0.01).to(dtype)
            B = (torch.randn(unit.out_features, a.rank, generator=g) * 0.01).to(dtype)
            weights.append(pb.AdapterWeight(unit=uid, rank=a.rank, dtype=dtype_enum(dtype), scale=2.0,
                                            a=A.view(torch.uint8).numpy().tobytes(), b=B.view(torch.uint8).numpy().tobytes()))
    adapter = registry.host(0, pb.HostAdapterRequest(name="probe", weights=weights))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    nbytes = registry.merge(adapter.id).nbytes
    registry.unmerge()
    copies = []  # the floor first, its memory given back, so the merges below find their copies' block as an executor does
    src = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)  # one read, one write of as many bytes
    for _ in range(a.repeat + 1):
        sync()
        t0 = time.perf_counter()
        dst = src.clone()
        sync()
        copies.append(time.perf_counter() - t0)
        del dst
    del src
    if device.type == "cuda":
        torch.cuda.empty_cache()
    floor_ms = 1e3 * statistics.median(copies[1:])
    rows = []
    for path in a.paths.split(","):
        if path not in ("kernel", "addmm"):
            raise SystemExit(f"--paths: kernel or addmm, got {path!r}")
        registry.merge_kernel = path == "kernel"
        merges, unmerges = [], []
        for _ in range(a.repeat + 1):
            sync()
            t0 = time.perf_counter()
            merged = registry.merge(adapter.id)  # (synchronises a GPU before it returns)
            merges.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            registry.unmerge()
            del merged
            unmerges.append(time.perf_counter() - t0)
        merge_ms, unmerge_ms = (1e3 * statistics.median(x[1:]) for x in (merges, unmerges))
        if a.profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            registry.merge(adapter.id)
            profile.disable()
            registry.unmerge()
            print(f"one merge ({path}), where the host's time goes:")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
        rows.append({"model": a.model, "rank": a.rank, "device": str(device), "dtype": a.dtype, "path": path,
                     "adapted_units": len(weights), "copies_mb": nbytes / 2**20, "merge_ms": merge_ms, "unmerge_ms": unmerge_ms,
                     "floor_ms": floor_ms, "merge_over_floor": merge_ms / floor_ms})
        print(json.dumps(rows[-1]))
        print(f"{a.model} rank {a.rank}, {len(weights)} projections, {nbytes / 2**30:.2f} GiB of copies, {path}: merge "
              f"{merge_ms:.2f} ms, unmerge {unmerge_ms:.3f} ms; floor (a copy of as many bytes) {floor_ms:.2f} ms: "
              f"{merge_ms / floor_ms:.2f}x", flush=True)
    if a.tiles:
        rows += sweep(registry, adapter, a, device, dtype, nbytes, floor_ms)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows))
    return 0


def sweep(registry, adapter, a, device, dtype, nbytes: int, floor_ms: float) -> list[dict]:
    """The kernel alone (no allocation, no paging, the plan made beforehand) writing every adapted
    unit's merged copy, per tiling, and one addmm per unit the same way: where the switch's time goes."""
    from symbiont.base_executor.kernels.lora_merge import merge_lora_, plan_merge

    deltas = registry.on_device(adapter, count=False)
    units = [registry.table.get(uid) for uid in deltas]
    ws = [u.weight if u.kind == "linear" else u.weight.t() for u in units]
    outs = [torch.empty_like(w) for w in ws]
    loras = [(d.a.to(dtype).contiguous(), d.b.to(dtype), d.scale) for d in deltas.values()]

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(a.repeat):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    rows = []
    for spec in a.tiles.split(","):
        blocks, warps, stages, *group = spec.split("/")
        bm, bn, br = (int(v) for v in blocks.split("x"))
        t0 = time.perf_counter()
        plan = plan_merge(ws, loras, outs=outs, block_m=bm, block_n=bn, block_r=br, num_warps=int(warps), num_stages=int(stages),
                          **({"group": int(group[0].lstrip("g"))} if group else {}))
        plan_ms = 1e3 * (time.perf_counter() - t0)
        rows.append({"path": "kernel alone", "tiling": spec, "plan_ms": plan_ms, "kernel_ms": timed(lambda: merge_lora_(plan))})
    rows.append({"path": "addmm alone", "kernel_ms": timed(lambda: [torch.addmm(w, b, a_, alpha=s, out=o)
                                                                   for w, o, (a_, b, s) in zip(ws, outs, loras)])})
    for r in rows:
        r.update(floor_ms=floor_ms, over_floor=r["kernel_ms"] / floor_ms, gb_per_s=2 * nbytes / r["kernel_ms"] / 1e6)
        print(json.dumps(r), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
