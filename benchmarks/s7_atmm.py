"""S7: ATMM against a padded torch.bmm reference and a per-adapter matmul loop; the tuned
tiling table against the best single static tiling; whole-model merge/unmerge on llama-8b.

    python benchmarks/s7_atmm.py [--table PATH] [--out DIR] [--skip-merge]

Hidden 4096 (h_in = h_out), bf16. Timings are microseconds per call issued back to back
(launch cost included). Per class, ATMM with the table's tiling, ATMM with the table's
static tiling and the padded reference are timed interleaved (timing.interleaved_us:
round-robin windows, ROUNDS rounds); each ratio is the median of the per-round ratios.
Where the table chose the static tiling, the same tiling is timed twice: that ratio is
the measurement's noise. Writes s7_atmm.json and s7_atmm.png into --out (default
benchmarks/out) and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from symbiont.base_executor.kernels import triton_launch  # noqa: E402
from symbiont.base_executor.kernels.atmm import atmm, plan_segments  # noqa: E402
from symbiont.base_executor.kernels.atmm_ref import (  # noqa: E402
    atmm_loop, atmm_padded_bmm, prepare_loop, prepare_padded)
from symbiont.base_executor.kernels.lora_merge import merge_lora_, plan_merge, unmerge_lora_  # noqa: E402
from symbiont.base_executor.kernels.tiling import TileConfig, TilingTable, gpu_name  # noqa: E402
from symbiont.base_executor.kernels.timing import interleaved_us, paired_ratio, quantile, time_us  # noqa: E402
from symbiont.base_executor.kernels.tune_atmm import MODELS, synthetic_batch  # noqa: E402

HIDDEN = 4096
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (4, 16, 64)
RANK_MIXES = {"mixed 8-128": (8, 16, 32, 64, 128), "low 8-16": (8, 16), "high 64-128": (64, 128)}
ROUNDS = 21
WINDOW_MS = 1.5
# (block_m, block_n, warps, stages, group): each program holds A's whole-rank block (plan_merge's default first)
MERGE_TILES = [(64, 128, 4, 3, 4), (64, 256, 8, 3, 4), (32, 256, 4, 3, 4), (128, 256, 8, 3, 2)]


def rel_delta_err(out, ref, y0) -> float:
    d, r = out.float() - y0.float(), ref.float() - y0.float()
    return ((d - r).norm() / r.norm()).item()


def graph_us(fn, calls: int = 20, replays: int = 5) -> float | None:
    """GPU time per call: `calls` calls captured in a CUDA graph, replays timed with events."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e) * 1e3 / calls)
        return statistics.median(out)
    except Exception as e:  # report, do not stop the run
        print(f"graph capture failed: {type(e).__name__}: {e}")
        return None


def bench_atmm(table: TilingTable, log) -> list[dict]:
    static = table.static_best
    rows = []
    for mix, ranks in RANK_MIXES.items():
        for t in TOKENS:
            for n in sorted({min(a, t) for a in ADAPTERS}):
                x, y, pool, plan, seg_lens, seg_slots = synthetic_batch(t, n, ranks, HIDDEN, HIDDEN, torch.bfloat16)
                pb, lb = prepare_padded(pool, seg_lens, seg_slots), prepare_loop(pool, seg_lens, seg_slots)
                tuned = table.lookup(plan.num_active, plan.num_adapters, plan.max_rank, HIDDEN, HIDDEN)
                y0 = y.clone()
                err = rel_delta_err(atmm(x, y0.clone(), pool, plan, table=table),
                                    atmm_padded_bmm(x, y0.clone(), pb), y0)
                # Tuned and static through the same path (config=), so only the tiling differs.
                fns = {"tuned": lambda: atmm(x, y, pool, plan, config=tuned),
                       "padded": lambda: atmm_padded_bmm(x, y, pb)}
                if static is not None:
                    fns["static"] = lambda: atmm(x, y, pool, plan, config=static)
                samples = interleaved_us(fns, rounds=ROUNDS, window_ms=WINDOW_MS)
                med = {k: statistics.median(v) for k, v in samples.items()}
                row = {"ranks": mix, "tokens": t, "adapters": n, "max_rank": plan.max_rank,
                       "tuned_config": tuned.short(), "tuned_tiling": tuned.to_dict(), "static_config": static.short() if static else None,
                       "same_tiling": tuned == static, "rel_err_vs_padded": err,
                       "atmm_us": med["tuned"], "padded_us": med["padded"], "static_us": med.get("static"),
                       "vs_padded": paired_ratio(samples, "padded", "tuned"),
                       "vs_padded_q25": quantile([p / a for p, a in zip(samples["padded"], samples["tuned"])], 0.25),
                       "loop_us": time_us(lambda: atmm_loop(x, y, lb)),
                       "atmm_gpu_us": graph_us(fns["tuned"]), "padded_gpu_us": graph_us(fns["padded"]),
                       "samples": {k: [round(v, 2) for v in vs] for k, vs in samples.items()}}
                row["vs_loop"] = row["loop_us"] / row["atmm_us"]
                if static is not None:
                    row["tuned_vs_static"] = paired_ratio(samples, "static", "tuned")
                    row["static_gpu_us"] = row["atmm_gpu_us"] if row["same_tiling"] else graph_us(fns["static"])
                rows.append(row)
                log(f"{mix:12s} T={t:5d} n={n:2d}  atmm {row['atmm_us']:7.1f} (gpu {row['atmm_gpu_us'] or 0:6.1f})  "
                    f"padded {row['padded_us']:7.1f} (gpu {row['padded_gpu_us'] or 0:6.1f})  loop {row['loop_us']:7.1f}"
                    f"  x{row['vs_padded']:.2f}  tuned/static x{row.get('tuned_vs_static', 1.0):.3f}"
                    f"{' (same tiling)' if row['same_tiling'] else ''}  err {err:.1e} [{tuned.short()}]")
    return rows


def miss_probe(row: dict) -> dict:
    """Where ATMM missed 2x: the weight bytes each side streams, GPU times (graph replay) of
    ATMM and of each of its kernels, and a device-to-device copy of as many bytes."""
    from symbiont.base_executor.kernels.atmm_split import SplitLaunch
    x, y, pool, plan, seg_lens, seg_slots = synthetic_batch(row["tokens"], row["adapters"], RANK_MIXES[row["ranks"]],
                                                            HIDDEN, HIDDEN, torch.bfloat16)
    pb = prepare_padded(pool, seg_lens, seg_slots)
    cfg = TileConfig.from_dict(row["tuned_tiling"])
    run = lambda: atmm(x, y, pool, plan, config=cfg)  # noqa: E731
    run()
    ranks = [RANK_MIXES[row["ranks"]][i % len(RANK_MIXES[row["ranks"]])] for i in range(row["adapters"])]
    atmm_bytes = sum(ranks) * 2 * HIDDEN * 2                    # A and B rows, bf16
    padded_bytes = (pb.a_pad.numel() + pb.b_pad.numel()) * 2
    out = {"class": f"{row['ranks']} T={row['tokens']} n={row['adapters']}", "tiling": row["tuned_config"],
           "atmm_weight_MB": atmm_bytes / 1e6, "padded_weight_MB": padded_bytes / 1e6,
           "atmm_gpu_us": graph_us(run), "padded_gpu_us": graph_us(lambda: atmm_padded_bmm(x, y, pb))}
    launch = plan.launches[(HIDDEN, HIDDEN, cfg, None)]
    if isinstance(launch, SplitLaunch):
        for part, other in (("shrink", "expand"), ("expand", "shrink")):
            kept = getattr(launch, other)
            setattr(launch, other, lambda spec, args: None)
            try:
                out[f"{part}_gpu_us"] = graph_us(run)
            finally:
                setattr(launch, other, kept)
    src = torch.empty(atmm_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    out["copy_gpu_us"] = graph_us(lambda: dst.copy_(src))       # reads and writes atmm_bytes each
    out["copy_TBps"] = 2 * atmm_bytes / out["copy_gpu_us"] / 1e6
    out["atmm_read_TBps"] = atmm_bytes / out["atmm_gpu_us"] / 1e6
    out["padded_read_TBps"] = padded_bytes / out["padded_gpu_us"] / 1e6
    return out


def llama8b_layers(targets: list[str], rank: int):
    """Random bf16 weights of llama-8b's 32 layers for `targets`, and a rank-`rank` adapter on them."""
    m = MODELS["llama-8b"]
    h, inter, kv = m["hidden_size"], m["intermediate_size"], m["hidden_size"] // 4
    shape = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (inter, h), "up": (inter, h),
             "down": (h, inter)}
    weights, loras = [], []
    for _ in range(32):
        for name in targets:
            n_out, n_in = shape[name]
            weights.append(torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16))
            loras.append((torch.randn(rank, n_in, device="cuda", dtype=torch.bfloat16) * 0.01,
                          torch.randn(n_out, rank, device="cuda", dtype=torch.bfloat16) * 0.01, 2.0))
    return weights, loras


def time_events_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def bench_merge(log) -> list[dict]:
    rows = []
    for label, targets in (("q,k,v,o", ["q", "k", "v", "o"]), ("all linear", ["q", "k", "v", "o", "gate", "up", "down"])):
        weights, loras = llama8b_layers(targets, 64)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        floor_ms = 2 * nbytes / 3.0e12 * 1e3  # read + write every weight once at ~3.0 TB/s (H100)
        for bm, bn, warps, stages, group in MERGE_TILES:
            plan = plan_merge(weights, loras, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, group=group)
            br = plan.block_r
            m = time_events_ms(lambda: merge_lora_(plan))
            u = time_events_ms(lambda: unmerge_lora_(plan))
            rows.append({"targets": label, "layers": len(weights), "weight_GB": nbytes / 1e9, "floor_ms": floor_ms,
                         "tile": f"{bm}x{bn}x{br}w{warps}p{stages}", "merge_ms": m, "unmerge_ms": u})
            log(f"merge {label:10s} {bm}x{bn}x{br}w{warps}p{stages}: merge {m:.2f} ms, unmerge {u:.2f} ms "
                f"(floor {floor_ms:.2f} ms, {2 * nbytes / m / 1e6:.0f} GB/s)")
        def loop():  # dLoRA-style: one addmm per layer
            for w, (a, b, s) in zip(weights, loras):
                w.addmm_(b, a, alpha=s)
        rows.append({"targets": label, "layers": len(weights), "weight_GB": nbytes / 1e9, "floor_ms": floor_ms,
                     "tile": "torch addmm_ per layer", "merge_ms": time_events_ms(loop, reps=5), "unmerge_ms": None})
        log(f"merge {label:10s} per-layer addmm_: {rows[-1]['merge_ms']:.2f} ms")
        del weights, loras
        torch.cuda.empty_cache()
    return rows


def launch_probe() -> dict:
    """Issue cost of one call: a torch op; ATMM at 1 token through Triton's JIT and through the
    cached runners; and atmm()'s own Python with the kernel launches left out."""
    a = torch.randn(16, device="cuda")
    x, y, pool, plan, _, _ = synthetic_batch(1, 1, [16], HIDDEN, HIDDEN, torch.bfloat16)
    fused = TileConfig(mode="fused", block_m=16, block_k=128, block_n=64, split=16)
    split = TileConfig(mode="split", block_m=16, block_k=128, block_n=128, split=4)
    out = {"torch_add_us": time_us(lambda: torch.add(a, a))}
    for fast in (False, True):
        triton_launch.CompiledKernels.enabled = fast
        tag = "fast" if fast else "jit"
        out[f"atmm_fused_T1_{tag}_us"] = time_us(lambda: atmm(x, y, pool, plan, config=fused))
        out[f"atmm_split_T1_{tag}_us"] = time_us(lambda: atmm(x, y, pool, plan, config=split))
    out["fast_path_enabled"] = triton_launch.CompiledKernels.enabled
    call = triton_launch.GridLaunch.__call__
    try:
        triton_launch.GridLaunch.__call__ = lambda self, spec, args: None
        out["atmm_python_only_us"] = time_us(lambda: atmm(x, y, pool, plan, config=fused))
    finally:
        triton_launch.GridLaunch.__call__ = call
    for t, n in ((64, 64), (8192, 64)):  # host cost of a plan: once per batch, shared by every layer
        lens, slots = [t // n] * n, list(range(n))
        out[f"plan_T{t}_n{n}_us"] = time_us(lambda: plan_segments(lens, slots, [64] * n, "cuda"))
    return out


def plot(rows, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(RANK_MIXES), figsize=(5 * len(RANK_MIXES), 4), sharey=True)
    for ax, mix in zip(axes, RANK_MIXES):
        for n in ADAPTERS:
            pts = sorted((r["tokens"], r["vs_padded"]) for r in rows
                         if r["ranks"] == mix and r["adapters"] == min(n, r["tokens"]))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{n} adapters")
        ax.axhline(2.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"ranks {mix}")
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("speed-up over padded torch.bmm")
    axes[0].legend()
    fig.suptitle(f"S7 ATMM, hidden {HIDDEN}, bf16, {gpu_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(rows: list[dict], gm) -> str:
    """The goal lines: (a) ATMM >= 2x padded per class; (b) tuned never slower than static."""
    vp = [r["vs_padded"] for r in rows]
    lines = [f"(a) >= 2x padded: {sum(v >= 2 for v in vp)} of {len(vp)} classes; geomean {gm(vp):.2f}x, "
             f"min {min(vp):.2f}x; GPU-only (graph) geomean "
             f"{gm([r['padded_gpu_us'] / r['atmm_gpu_us'] for r in rows if r['atmm_gpu_us'] and r['padded_gpu_us']]):.2f}x"]
    if all("tuned_vs_static" in r for r in rows):
        same = [r["tuned_vs_static"] for r in rows if r["same_tiling"]]
        diff = [r["tuned_vs_static"] for r in rows if not r["same_tiling"]]
        if same:
            lines.append(f"(b) noise: static timed against itself on the {len(same)} classes that keep it: "
                         f"{min(same):.3f} .. {max(same):.3f} (median {statistics.median(same):.3f})")
        if diff:
            lines.append(f"(b) {len(diff)} classes with another tiling: {sum(v >= 1.0 for v in diff)} >= 1.00, "
                         f"{sum(v >= 0.97 for v in diff)} >= 0.97; min {min(diff):.3f}, geomean {gm(diff):.3f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=None, help="tiling table from tune-atmm (default: the user cache)")
    p.add_argument("--out", default=str(Path(__file__).parent / "out"))
    p.add_argument("--skip-merge", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = TilingTable.load(args.table)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu_name(), "torch": torch.__version__,
              "table": args.table, "table_entries": len(table.entries),
              "static_best": table.static_best.short() if table.static_best else None,
              "launch": launch_probe()}
    log(f"launch probe: {result['launch']}")
    rows = bench_atmm(table, log)
    result["atmm"] = rows
    result["misses"] = [miss_probe(r) for r in rows if r["vs_padded"] < 2.0]
    for m in result["misses"]:
        log(f"miss {m}")
    if not args.skip_merge:
        result["merge"] = bench_merge(log)
    result["seconds"] = time.time() - t0
    (out / "s7_atmm.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "s7_atmm.png")

    gm = lambda v: math.exp(statistics.fmean(math.log(x) for x in v))  # noqa: E731
    print(f"\nS7 ATMM on {result['gpu']} (hidden {HIDDEN}, bf16), us per call, launch included, "
          f"static tiling {result['static_best']}")
    print(f"{'ranks':12s} {'T':>5s} {'n':>3s} {'atmm':>7s} {'padded':>7s} {'loop':>7s} {'x pad':>6s} "
          f"{'x loop':>6s} {'x stat':>6s} {'gpu atmm':>8s} {'gpu pad':>8s} tiling")
    f = lambda v: f"{v:8.1f}" if v is not None else "       -"  # noqa: E731
    for r in rows:
        print(f"{r['ranks']:12s} {r['tokens']:5d} {r['adapters']:3d} {r['atmm_us']:7.1f} {r['padded_us']:7.1f} "
              f"{r['loop_us']:7.1f} {r['vs_padded']:6.2f} {r['vs_loop']:6.2f} {r.get('tuned_vs_static', 1):6.3f} "
              f"{f(r['atmm_gpu_us'])} {f(r['padded_gpu_us'])} {'=' if r['same_tiling'] else r['tuned_config']}")
    print(summary(rows, gm))
    for r in result.get("merge", []):
        u = f"{r['unmerge_ms']:.2f}" if r["unmerge_ms"] is not None else "-"
        print(f"merge {r['targets']:10s} {r['tile']:22s} merge {r['merge_ms']:.2f} ms unmerge {u} ms "
              f"(floor {r['floor_ms']:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
