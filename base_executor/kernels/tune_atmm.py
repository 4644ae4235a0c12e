"""`tune-atmm --model MODEL [--out PATH]`: profile ATMM tilings, keep the best per shape class.

For every (h_in, h_out) projection the model has (q/o, k/v, gate/up, down) and every
class of tokens × adapters × rank bucket, time the candidate tilings of tiling.py with
launches included (a call must be cheap to issue) and save the table for this GPU
(VaLoRA Appendix A, with Triton tilings in place of CUTLASS ones).

The table is never slower than the best single static tiling by construction:
1. every candidate is timed once per class; the few with the best geometric mean of
   (time / the class's best time) are re-timed interleaved on every class, and the best
   of those is the static tiling, stored in the table as `static_best`;
2. each class's three fastest candidates are re-timed interleaved against the static
   tiling (timing.interleaved_us: round-robin, many rounds) on every rank mix the class
   stands for, and a class takes another tiling only where it beats the static one on
   every mix by MARGIN (median of the per-round ratios) and in at least three rounds
   of four; otherwise the class keeps the static tiling.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from .tiling import DEFAULT_PATH, ShapeClass, TileConfig, TilingTable, candidate_configs, gpu_name
from .timing import interleaved_us, quantile, time_us

# Shapes of the named models (BENCHMARKS.md): hidden, MLP width, attention heads, KV heads.
MODELS = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                 "num_key_value_heads": 8},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                 "num_key_value_heads": 8},
}
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
ADAPTERS = (1, 4, 16, 64)
RANKS = (16, 32, 64, 128)  # largest rank of a batch; profiled with rank_mixes
MARGIN = 1.05       # a class leaves the static tiling only for one >= 5% faster on every rank mix ...
WIN_QUARTILE = 1.0  # ... and faster in at least 3 rounds of 4 (lower quartile of the per-round ratios)
ROUNDS = 15         # interleaved rounds per class and rank mix
STATIC_FINALISTS = 4


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


def rank_mixes(max_rank: int) -> list[tuple[int, ...]]:
    """Rank mixes that a class of largest rank `max_rank` stands for (adapter i gets mix[i % len]).

    The first, halving down to 8 (128 -> 128, 64, 32, 16, 8), is the one every candidate
    is timed on; a tiling that replaces the static one must also win on the second,
    the top two ranks (128 -> 64, 128).
    """
    halving = [max_rank]
    while halving[-1] // 2 >= 8:
        halving.append(halving[-1] // 2)
    top = [max_rank // 2, max_rank] if max_rank >= 16 else [max_rank]
    mixes = [tuple(halving), tuple(top)]
    return [m for i, m in enumerate(mixes) if set(m) not in [set(p) for p in mixes[:i]]]


def choose_tiling(per_mix: Sequence[dict], static: TileConfig, *, margin: float = MARGIN,
                  win_quartile: float = WIN_QUARTILE) -> tuple[TileConfig, float]:
    """The static tiling, unless a candidate beats it on every mix; returns (choice, its gain).

    per_mix: per rank mix, {tiling: [us per round]} from interleaved_us, `static` among
    the keys. The gain of a candidate is the smallest over mixes of the median of the
    per-round ratios static / candidate; it must be >= margin, and the lower quartile of
    those ratios > win_quartile on every mix. The largest qualifying gain wins.
    """
    best, best_gain = static, 1.0
    for c in per_mix[0]:
        if c == static or any(c not in m for m in per_mix):
            continue
        ratios = [[s / t for s, t in zip(m[static], m[c])] for m in per_mix]
        gain = min(statistics.median(r) for r in ratios)
        if gain >= margin and min(quantile(r, 0.25) for r in ratios) > win_quartile and gain > best_gain:
            best, best_gain = c, gain
    return best, best_gain


def _gmean(values) -> float:
    values = list(values)
    return math.exp(statistics.fmean(math.log(v) for v in values))


def tune(shapes: Sequence[tuple[int, int]], *, tokens=TOKENS, adapters=ADAPTERS, ranks=RANKS,
         candidates: Sequence[TileConfig] | None = None, rounds: int = ROUNDS,
         log=print) -> tuple[TilingTable, dict]:
    """Profile the candidates on every class (module docstring); returns the table and pass-1 times."""
    import torch
    from .atmm import atmm
    candidates = list(candidates or candidate_configs())
    classes = [(h_in, h_out, t, n, r) for h_in, h_out in shapes for t in tokens
               for n in sorted({min(a, t) for a in adapters}) for r in ranks]
    batches: dict = {}

    def batch(h_in, h_out, t, n, mix):  # x, y, pool, plan; the last class's batches kept
        key = (h_in, h_out, t, n, mix)
        if key not in batches:
            batches.clear()
            batches[key] = synthetic_batch(t, n, mix, h_in, h_out, torch.bfloat16)[:4]
        return batches[key]

    def runs(b, cfgs):
        x, y, pool, plan = b
        return {c: (lambda c=c: atmm(x, y, pool, plan, config=c)) for c in cfgs}

    # Pass 1: every candidate once per class, on the class's first rank mix.
    times: dict[ShapeClass, dict[TileConfig, float]] = {}
    for h_in, h_out, t, n, r in classes:
        cls = ShapeClass.of(t, n, r, h_in, h_out)
        row = {}
        for cfg, fn in runs(batch(h_in, h_out, t, n, rank_mixes(r)[0]), candidates).items():
            try:
                row[cfg] = time_us(fn, target_ms=1.0, repeats=3)
            except Exception as e:  # a tiling this GPU cannot launch: skip it
                log(f"  skip {cfg.short()} on {cls}: {type(e).__name__}: {str(e)[:120]}")
        if not row:
            log(f"  no candidate ran on {cls}: left to the nearest class")
            continue
        times[cls] = row
        best = min(row, key=row.get)
        log(f"pass 1 {h_in}x{h_out} tokens={t} adapters={n} ranks<={r}: best {best.short()} {row[best]:.1f} us")
    if not times:
        raise RuntimeError("no candidate tiling ran on any class")

    # The static tiling: best geometric mean of (time / class best), finalists re-timed interleaved.
    common = [c for c in candidates if all(c in row for row in times.values())]
    ranked = sorted(common, key=lambda c: _gmean(row[c] / min(row.values()) for row in times.values()))
    finalists = ranked[:STATIC_FINALISTS]
    static_rel: dict[TileConfig, list[float]] = {c: [] for c in finalists}
    for h_in, h_out, t, n, r in classes:
        if ShapeClass.of(t, n, r, h_in, h_out) not in times:
            continue
        samples = interleaved_us(runs(batch(h_in, h_out, t, n, rank_mixes(r)[0]), finalists), rounds=5)
        med = {c: statistics.median(v) for c, v in samples.items()}
        for c in finalists:
            static_rel[c].append(med[c] / min(med.values()))
    static = min(finalists, key=lambda c: _gmean(static_rel[c]))
    log(f"static tiling {static.short()}: geometric mean {_gmean(static_rel[static]):.3f}x the best finalist "
        f"per class (finalists: " + ", ".join(f"{c.short()} {_gmean(v):.3f}" for c, v in static_rel.items()) + ")")

    # Pass 2: per class, the three fastest against the static tiling, on every rank mix.
    entries, timings = {}, {}
    for h_in, h_out, t, n, r in classes:
        cls = ShapeClass.of(t, n, r, h_in, h_out)
        if cls not in times:
            continue
        row = times[cls]
        finalists = [c for c in sorted(row, key=row.get) if c != static][:3] + [static]
        per_mix = [interleaved_us(runs(batch(h_in, h_out, t, n, mix), finalists), rounds=rounds)
                   for mix in rank_mixes(r)]
        chosen, gain = choose_tiling(per_mix, static)
        entries[cls] = chosen
        med = {c: statistics.median(v) for c, v in per_mix[0].items()}
        timings[cls] = {"us": round(med[chosen], 2), "static_us": round(med[static], 2),
                        "gain_vs_static": round(gain, 3), "mixes": [list(m) for m in rank_mixes(r)]}
        log(f"pass 2 {h_in}x{h_out} tokens={t} adapters={n} ranks<={r}: {chosen.short()} {med[chosen]:.1f} us, "
            f"static {med[static]:.1f} us, gain {gain:.2f}")
    import triton
    meta = {"triton": triton.__version__, "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "candidates": len(candidates),
            "method": f"static = best of {STATIC_FINALISTS} finalists by geometric mean; a class leaves it only "
                      f"for a tiling with median per-round speed-up >= {MARGIN} and lower quartile > "
                      f"{WIN_QUARTILE} on every rank mix, {rounds} interleaved rounds"}
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
