"""`tune-atmm --model MODEL [--out PATH]`: profile ATMM tilings, keep the best per shape class.

For every (h_in, h_out) projection the model has (q/o, k/v, gate/up, down) and every
class of tokens × adapters × rank bucket, time each candidate tiling of tiling.py with
launches included (a call must be cheap to issue), pick the fastest, and save the table
for this GPU (VaLoRA Appendix A, with Triton tilings in place of CUTLASS ones). The one
config best over all classes is stored as `static_best`; a class keeps the static
config unless another one beats it by more than the noise margin.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from .tiling import DEFAULT_PATH, ShapeClass, TileConfig, TilingTable, candidate_configs, gpu_name

# Shapes of the named models (BENCHMARKS.md): hidden, MLP width, attention heads, KV heads.
MODELS = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                 "num_key_value_heads": 8},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                 "num_key_value_heads": 8},
}
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (1, 4, 16, 64)
RANKS = (16, 32, 64, 128)  # largest rank of a batch; profiled with rank_mix
NOISE = 1.05  # a class keeps the static config unless another is faster by more than 5%


def model_shapes(model: str) -> list[tuple[int, int]]:
    """(h_in, h_out) of the model's LoRA-able projections: q/o, k/v, gate/up, down."""
    if model in MODELS:
        cfg = MODELS[model]
    elif (Path(model) / "config.json").is_file():
        cfg = json.loads((Path(model) / "config.json").read_text())
    else:
        raise ValueError(f"unknown model {model!r}: use one of {sorted(MODELS)} or a save_pretrained "
                         f"directory with a config.json")
    hidden = cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model")
    if not hidden:
        raise ValueError(f"{model}: config.json has no hidden_size")
    inter = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    pairs = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, inter), (inter, hidden)]
    return list(dict.fromkeys(pairs))


def time_us(fn: Callable[[], object], *, target_ms: float = 2.0, repeats: int = 5) -> float:
    """Median microseconds per call of `fn` issued back to back (launch cost included)."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per = max((time.perf_counter() - t0) / 5, 1e-6)
    n = int(min(500, max(5, target_ms * 1e-3 / per)))
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def synthetic_batch(tokens: int, adapters: int, ranks: Sequence[int], h_in: int, h_out: int, dtype,
                    device="cuda"):
    """x, y, pool, plan for `tokens` rows split evenly over `adapters` adapters of `ranks` (cycled)."""
    import torch
    from .atmm import pack_lora_pool, plan_segments
    slot_ranks = [ranks[i % len(ranks)] for i in range(adapters)]
    ads = [(torch.randn(r, h_in, device=device, dtype=dtype) / h_in ** 0.5,
            torch.randn(h_out, r, device=device, dtype=dtype) / r ** 0.5, 1.0) for r in slot_ranks]
    pool = pack_lora_pool(ads)
    seg_lens = [tokens // adapters + (i < tokens % adapters) for i in range(adapters)]
    seg_slots = list(range(adapters))
    plan = plan_segments(seg_lens, seg_slots, slot_ranks, device)
    x = torch.randn(tokens, h_in, device=device, dtype=dtype)
    y = torch.randn(tokens, h_out, device=device, dtype=dtype)
    return x, y, pool, plan, seg_lens, seg_slots


def rank_mix(max_rank: int) -> tuple[int, ...]:
    """Ranks a class of largest rank `max_rank` is profiled with: halving down to 8 (128 -> 128..8)."""
    out = [max_rank]
    while out[-1] // 2 >= 8:
        out.append(out[-1] // 2)
    return tuple(out)


def compare_us(fns: dict, rounds: int = 3) -> dict:
    """Per key, median microseconds over `rounds` interleaved measurements (drift hits all alike)."""
    samples: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(time_us(fn, repeats=3))
    return {k: statistics.median(v) for k, v in samples.items()}


def tune(shapes: Sequence[tuple[int, int]], *, tokens=TOKENS, adapters=ADAPTERS, ranks=RANKS,
         candidates: Sequence[TileConfig] | None = None, log=print) -> tuple[TilingTable, dict]:
    """Profile every candidate on every class; returns the table and {class: {config: us}}.

    Pass 1 times every candidate once per class and picks the static config (best
    geometric mean over classes). Pass 2 re-times, interleaved, each class's three
    fastest and the static config, and keeps the static one unless beaten by > NOISE.
    """
    import torch
    from .atmm import atmm
    candidates = list(candidates or candidate_configs())
    classes = [(h_in, h_out, t, n, r) for h_in, h_out in shapes for t in tokens
               for n in sorted({min(a, t) for a in adapters}) for r in ranks]
    batch = lambda h_in, h_out, t, n, r: synthetic_batch(t, n, rank_mix(r), h_in, h_out, torch.bfloat16)[:4]  # noqa: E731
    times: dict[ShapeClass, dict[TileConfig, float]] = {}
    for h_in, h_out, t, n, r in classes:
        cls = ShapeClass.of(t, n, r, h_in, h_out)
        x, y, pool, plan = batch(h_in, h_out, t, n, r)
        row = {}
        for cfg in candidates:
            try:
                row[cfg] = time_us(lambda: atmm(x, y, pool, plan, config=cfg))
            except Exception as e:  # a tiling this GPU cannot launch: skip it
                log(f"  skip {cfg.short()} on {cls}: {type(e).__name__}: {str(e)[:120]}")
        if not row:
            log(f"  no candidate ran on {cls}: left to the nearest class")
            continue
        times[cls] = row
        best = min(row, key=row.get)
        log(f"{h_in}x{h_out} tokens={t} adapters={n} ranks<={r}: best {best.short()} {row[best]:.1f} us")
    # One static config: best geometric mean of (time / best time of the class) over all classes.
    common = [c for c in candidates if all(c in row for row in times.values())]
    def gmean_ratio(c: TileConfig) -> float:
        return math.exp(statistics.fmean(math.log(row[c] / min(row.values())) for row in times.values()))
    static = min(common, key=gmean_ratio) if common else None
    entries, timings = {}, {}
    for h_in, h_out, t, n, r in classes:
        cls = ShapeClass.of(t, n, r, h_in, h_out)
        if cls not in times:
            continue
        row = times[cls]
        finalists = sorted(row, key=row.get)[:3] + ([static] if static else [])
        x, y, pool, plan = batch(h_in, h_out, t, n, r)
        again = compare_us({c: (lambda c=c: atmm(x, y, pool, plan, config=c)) for c in finalists})
        best = min(again, key=again.get)
        chosen = static if static and again[static] <= NOISE * again[best] else best
        entries[cls] = chosen
        timings[cls] = {"us": round(again[chosen], 2), "best_us": round(again[best], 2),
                        **({"static_us": round(again[static], 2)} if static else {})}
    import triton
    meta = {"triton": triton.__version__, "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "candidates": len(candidates)}
    return TilingTable(gpu_name(), entries, static_best=static, meta=meta, timings=timings), times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tune-atmm", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help=f"{' or '.join(MODELS)}, or a save_pretrained directory")
    p.add_argument("--out", default=str(DEFAULT_PATH), help="table file (other GPUs' entries are kept)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts to profile")
    p.add_argument("--adapters", default=",".join(map(str, ADAPTERS)), help="adapter counts to profile")
    p.add_argument("--ranks", default=",".join(map(str, RANKS)), help="largest ranks to profile")
    p.add_argument("--shapes", default="", help="only these h_in x h_out pairs, e.g. 4096x4096,4096x1024")
    p.add_argument("--quick", action="store_true", help="fewer candidate tilings")
    args = p.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    try:
        shapes = model_shapes(args.model)
        if args.shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError as e:
        print(f"tune-atmm: {e}", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("tune-atmm: needs a CUDA GPU (timings on any other device mean nothing)", file=sys.stderr)
        return 2
    table, _ = tune(shapes, tokens=ints(args.tokens), adapters=ints(args.adapters), ranks=ints(args.ranks),
                    candidates=candidate_configs(quick=args.quick))
    table.meta["model"] = args.model
    table.save(args.out)
    static = table.static_best.short() if table.static_best else "none"
    print(f"tune-atmm: {len(table.entries)} shape classes for {table.gpu} -> {args.out} (static best {static})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
