"""ATMM, merge/unmerge and deLoRA kernels against their plain-PyTorch twins.

Without CUDA the Triton kernels run in Triton's interpreter on CPU tensors (small
shapes); with CUDA the same cases run compiled on the GPU, and the `gpu`-marked cases
add model-sized shapes. Inputs are random and fresh per case; every check compares the
LoRA delta row by row, and rows no adapter serves must come back bit for bit.
"""

import json
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from symbiont.base_executor.kernels import tiling  # noqa: E402
from symbiont.base_executor.kernels.atmm import atmm, pack_lora_pool, plan_segments  # noqa: E402
from symbiont.base_executor.kernels.atmm_ref import (  # noqa: E402
    atmm_loop, atmm_padded_bmm, atmm_ref, delora_ref, merge_ref, pool_adapter, prepare_loop, prepare_padded)
from symbiont.base_executor.kernels.lora_merge import (  # noqa: E402
    delora_, merge_lora_, plan_delora, plan_merge, unmerge_lora_)
from symbiont.base_executor.kernels.tiling import ShapeClass, TileConfig, TilingTable  # noqa: E402
from symbiont.base_executor.kernels.timing import interleaved_us, paired_ratio, quantile  # noqa: E402
from symbiont.base_executor.kernels.tune_atmm import choose_tiling, main as tune_main, model_shapes, rank_mixes  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
# Per-row delta error allowed: bf16 keeps 8 significant bits, fp16 11.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def make_adapters(ranks, h_in, h_out, dtype, device=DEV, gen=None):
    """Adapters whose delta has entries of order 1 for x ~ N(0, 1)."""
    out = []
    for i, r in enumerate(ranks):
        a = torch.randn(r, h_in, generator=gen) / h_in ** 0.5
        b = torch.randn(h_out, r, generator=gen) / r ** 0.5
        out.append((a.to(device, dtype), b.to(device, dtype), 0.5 + 0.25 * (i % 5)))
    return out


def make_pool(ranks, h_in, h_out, dtype, spare=5):
    ads = make_adapters(ranks, h_in, h_out, dtype)
    rows = sum(ranks) + spare
    return pack_lora_pool(ads, row_order=torch.randperm(rows), spare_rows=spare)  # scattered, like pages


def check_rows(out, y0, ref, seg_lens, seg_slots, dtype):
    """Each served row's delta matches the reference; unserved rows are untouched."""
    served = torch.tensor([s >= 0 for n, s in zip(seg_lens, seg_slots) for _ in range(n)], dtype=torch.bool)
    served = served.to(out.device)
    assert torch.equal(out[~served], y0[~served]), "rows without an adapter were written"
    if served.any():
        d_out = out[served].float() - y0[served].float()
        d_ref = ref[served].float() - y0[served].float()
        assert torch.isfinite(d_out).all()
        # the output's own rounding scales with |y|, not with the delta: allow it on top
        excess = (d_out - d_ref).norm(dim=1) - eps(dtype) * ref[served].float().norm(dim=1)
        err = excess / d_ref.norm(dim=1).clamp_min(1e-3)
        assert err.max().item() < TOL[dtype], f"worst row error {err.max().item():.3g}"


# Layouts: (segment lengths, slots per segment, ranks of the pool's slots)
LAYOUTS = {
    "one_token_segments": ([1] * 24, [i % 6 for i in range(24)], [8, 16, 32, 64, 128, 24]),
    "long_segments": ([70, 1, 33], [1, 0, 2], [128, 8, 40]),
    "empty_segments": ([0, 5, 0, 0, 9, 0, 3], [0, 1, 2, -1, 0, 1, -1], [16, 8, 64]),
    "many_adapters": ([1 + i % 3 for i in range(64)], list(range(64)), [8 * (1 + i % 16) for i in range(64)]),
    "single_token": ([1], [0], [32]),
}
CONFIGS = {
    "split": TileConfig(mode="split", block_m=16, block_k=32, block_n=32, split=1),
    "split_k3": TileConfig(mode="split", block_m=32, block_k=64, block_n=64, split=3),
    "fused": TileConfig(mode="fused", block_m=16, block_k=64, block_n=32, split=1),
    "fused_n3": TileConfig(mode="fused", block_m=64, block_k=32, block_n=16, split=3),
    "fused_n64": TileConfig(mode="fused", block_m=16, block_k=32, block_n=32, split=64),  # > column blocks
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_atmm_matches_reference(layout, cfg, dtype):
    if layout == "many_adapters" and (dtype == torch.float16 or cfg in ("split", "fused", "fused_n64")) \
            and not HAS_CUDA:
        pytest.skip("slow in the interpreter; bf16 with split_k3 and fused_n3 cover this layout on CPU")
    seg_lens, seg_slots, ranks = LAYOUTS[layout]
    h_in, h_out = 96, 80  # block_k 64 leaves a partial K step, block_n never divides 80 evenly
    pool = make_pool(ranks, h_in, h_out, dtype)
    t = sum(seg_lens)
    x = torch.randn(t, h_in, device=DEV).to(dtype)
    y0 = torch.randn(t, h_out, device=DEV).to(dtype)
    plan = plan_segments(seg_lens, seg_slots, ranks, DEV)
    out = atmm(x, y0.clone(), pool, plan, config=CONFIGS[cfg])
    ref = atmm_ref(x, y0.clone(), pool, seg_lens, seg_slots)
    check_rows(out, y0, ref, seg_lens, seg_slots, dtype)


def test_atmm_default_table_many_tokens_and_column_slice():
    """1024 rows through the built-in tiling, writing into a column slice of a wider output."""
    dtype = torch.bfloat16
    seg_lens, seg_slots, ranks = [600, 0, 300, 124], [2, 0, -1, 1], [128, 8, 16]
    pool = make_pool(ranks, 64, 48, dtype)
    x = torch.randn(1024, 64, device=DEV).to(dtype)
    wide = torch.randn(1024, 112, device=DEV).to(dtype)
    before = wide.clone()
    y = wide[:, 32:80]  # row stride 112
    plan = plan_segments(seg_lens, seg_slots, ranks, DEV)
    atmm(x, y, pool, plan, table=TilingTable("test"))
    ref = atmm_ref(x, before[:, 32:80].clone(), pool, seg_lens, seg_slots)
    check_rows(wide[:, 32:80], before[:, 32:80], ref, seg_lens, seg_slots, dtype)
    assert torch.equal(wide[:, :32], before[:, :32]) and torch.equal(wide[:, 80:], before[:, 80:])


def test_one_plan_serves_every_layer():
    """A plan is built once per batch and reused by layers of other widths and pools."""
    dtype, ranks = torch.bfloat16, [16, 64, 8]
    seg_lens, seg_slots = [3, 9, 2, 6], [2, 0, -1, 1]
    plan = plan_segments(seg_lens, seg_slots, ranks, DEV)
    x = torch.randn(sum(seg_lens), 64, device=DEV).to(dtype)
    for h_out, cfg in ((48, "fused_n3"), (16, "split_k3"), (48, "fused_n3"), (16, "fused")):
        pool = make_pool(ranks, 64, h_out, dtype)
        y0 = torch.randn(sum(seg_lens), h_out, device=DEV).to(dtype)
        out = atmm(x, y0.clone(), pool, plan, config=CONFIGS[cfg])
        check_rows(out, y0, atmm_ref(x, y0.clone(), pool, seg_lens, seg_slots), seg_lens, seg_slots, dtype)
    assert len(plan.launches) == 3  # (64, 48, fused_n3) resolved once, reused with another pool


def test_atmm_negative_scale_and_no_adapter_batch():
    dtype = torch.float16
    pool = make_pool([16, 32], 48, 40, dtype)
    x = torch.randn(7, 48, device=DEV).to(dtype)
    y0 = torch.randn(7, 40, device=DEV).to(dtype)
    out = atmm(x, y0.clone(), pool, plan_segments([3, 4], [1, 0], [16, 32], DEV), scale_mult=-1.0)
    ref = atmm_ref(x, y0.clone(), pool, [3, 4], [1, 0], scale_mult=-1.0)
    check_rows(out, y0, ref, [3, 4], [1, 0], dtype)
    none = plan_segments([3, 4], [-1, -1], [16, 32], DEV)
    assert none.num_active == 0 and torch.equal(atmm(x, y0.clone(), pool, none), y0)


def test_plan_groups_rows_by_adapter():
    seg_lens, seg_slots = [2, 0, 40, 1, 3, 5], [1, 0, 0, -1, 1, 2]
    plan = plan_segments(seg_lens, seg_slots, [8, 128, 16], "cpu")
    assert (plan.num_tokens, plan.num_active, plan.num_adapters, plan.max_rank) == (51, 50, 3, 128)
    tok = plan.token_index.tolist()
    assert sorted(tok) == [r for r in range(51) if r != 42]
    row_slot = [s for n, s in zip(seg_lens, seg_slots) for _ in range(n)]
    for bm, tiles in plan.tiles.items():
        seen = []
        for slot, first, count in tiles.tolist():
            assert 1 <= count <= bm
            rows = tok[first:first + count]
            assert all(row_slot[r] == slot for r in rows)
            seen += rows
        assert sorted(seen) == sorted(tok)
    for bad in (([1, 2], [0]), ([1], [3]), ([-1], [0]), ([1], [-2])):
        with pytest.raises(ValueError):
            plan_segments(*bad, [8, 8, 8], "cpu")


def test_atmm_rejects_bad_inputs():
    pool = make_pool([8], 32, 16, torch.bfloat16)
    plan = plan_segments([4], [0], [8], DEV)
    x = torch.randn(4, 32, device=DEV).to(torch.bfloat16)
    y = torch.zeros(4, 16, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        atmm(x.float(), y, pool, plan)
    with pytest.raises(ValueError):
        atmm(x.t().contiguous().t(), y, pool, plan)
    with pytest.raises(ValueError):
        atmm(x[:3], y[:3], pool, plan)
    with pytest.raises(ValueError):
        atmm(x[:, :16], y, pool, plan)
    with pytest.raises(ValueError):
        tiling.block_r_for(129)


def test_baselines_match_reference():
    dtype = torch.bfloat16
    seg_lens, seg_slots, ranks = LAYOUTS["empty_segments"]
    pool = make_pool(ranks, 64, 48, dtype)
    x = torch.randn(sum(seg_lens), 64, device=DEV).to(dtype)
    y0 = torch.randn(sum(seg_lens), 48, device=DEV).to(dtype)
    ref = atmm_ref(x, y0.clone(), pool, seg_lens, seg_slots)
    padded = atmm_padded_bmm(x, y0.clone(), prepare_padded(pool, seg_lens, seg_slots))
    check_rows(padded, y0, ref, seg_lens, seg_slots, dtype)
    loop = atmm_loop(x, y0.clone(), prepare_loop(pool, seg_lens, seg_slots))
    check_rows(loop, y0, ref, seg_lens, seg_slots, dtype)


def merge_layers(shapes, rank, dtype, device=DEV):
    """Weights and adapters of a few layers; B alternates between PEFT and pool layout."""
    weights, loras = [], []
    for i, (n_out, n_in) in enumerate(shapes):
        weights.append(torch.randn(n_out, n_in, device=device).to(dtype))
        a, b, s = make_adapters([rank], n_in, n_out, dtype, device)[0]
        if i % 2:
            b = b.t().contiguous().t()  # [out, r] view of a [r, out] pool-style buffer
        loras.append((a, b, s * 4.0))   # deltas comparable to the weights
    return weights, loras


def eps(dtype):
    """Bound on one rounding to dtype, relative: half an ulp when rounding to nearest (GPU);
    a whole ulp for bf16 in Triton's interpreter, which truncates when narrowing to bf16."""
    if dtype == torch.bfloat16 and not HAS_CUDA:
        return torch.finfo(dtype).eps
    return torch.finfo(dtype).eps / 2


def merge_bound(ref, w0, a, b, s):
    """|merged - merge_ref| allowed: one rounding each, plus fp32 summation-order error of ΔW."""
    magnitude = w0.float().abs() + abs(s) * (b.float().abs() @ a.float().abs())
    return 2 * eps(ref.dtype) * ref.float().abs() + 1e-6 * magnitude


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=["bf16", "fp16", "fp32"])
def test_merge_then_unmerge_restores_weights(dtype):
    shapes = [(64, 96), (40, 96), (96, 40), (64, 128)]
    weights, loras = merge_layers(shapes, 24, dtype)
    originals = [w.clone() for w in weights]
    even = [(64, 128), (128, 64)]
    plan = plan_merge(weights, loras, block_m=32, block_n=32, group=1)
    assert not plan.even
    merge_lora_(plan)
    for w, w0, (a, b, s) in zip(weights, originals, loras):
        ref = merge_ref(w0.clone(), a, b, s)
        assert not torch.equal(w, w0)
        assert ((w.float() - ref.float()).abs() <= merge_bound(ref, w0, a, b, s)).all(), \
            "merged weight off by more than an ulp"
    unmerge_lora_(plan)
    for w, w0, (a, b, s) in zip(weights, originals, loras):
        delta = s * (b.float() @ a.float())
        bound = eps(dtype) * (2 * w0.float().abs() + delta.abs()) * 1.01 + 1e-6
        assert ((w.float() - w0.float()).abs() <= bound).all(), "unmerge did not restore the weights"
    ew, el = merge_layers(even, 8, torch.bfloat16)
    originals_even = [w.clone() for w in ew]
    eplan = plan_merge(ew, el, block_m=32, block_n=32, group=2)
    assert eplan.even and eplan.align == 8  # 16-byte rows: vectorised path
    refs = [merge_ref(w.clone(), a, b, s) for w, (a, b, s) in zip(ew, el)]
    merge_lora_(eplan)
    for w, ref, w0, (a, b, s) in zip(ew, refs, originals_even, el):
        assert ((w.float() - ref.float()).abs() <= merge_bound(ref, w0, a, b, s)).all()


@pytest.mark.parametrize("peft_b", [False, True], ids=["b-mixed", "b-peft"])
@pytest.mark.parametrize("rows", [1, 2], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=["bf16", "fp16", "fp32"])
def test_merge_into_copies_writes_them_and_leaves_the_weights(dtype, rows, peft_b):
    """outs=: each copy gets its weight plus the adapter's delta (as a merge in place would), the
    weights stay bit for bit, and copies may be row ranges of a bigger matrix (a fused group's);
    with group=2, one program writes two row tiles under one A block; B in PEFT's layout alone
    (contiguous along the rank) is loaded by rows."""
    shapes = [(64, 96), (40, 96), (96, 40)]
    weights, loras = merge_layers(shapes, 24, dtype)
    if peft_b:
        loras = [(a, b.contiguous(), s) for a, b, s in loras]
    originals = [w.clone() for w in weights]
    group = torch.full((64 + 40 + 8, 96), float("nan"), device=DEV, dtype=dtype)  # (rows 104.. stay untouched)
    outs = [group[:64], group[64:104], torch.empty(96, 40, device=DEV, dtype=dtype)]
    with pytest.raises(ValueError, match="block_r 16 must be a power of two >= 16 covering every rank"):
        plan_merge(weights, loras, outs=outs, block_m=32, block_n=32, block_r=16, group=rows)
    plan = plan_merge(weights, loras, outs=outs, block_m=32, block_n=32, group=rows)
    assert plan.block_r == 32
    assert plan.b_align == (8 // (dtype.itemsize // 2) if peft_b else 0)  # (24 elements a row: 16-byte multiples)
    merge_lora_(plan)
    for w, w0, o, (a, b, s) in zip(weights, originals, outs, loras):
        assert torch.equal(w, w0)
        ref = merge_ref(w0.clone(), a, b, s)
        assert ((o.float() - ref.float()).abs() <= merge_bound(ref, w0, a, b, s)).all(), "copy off by more than an ulp"
    assert torch.isnan(group[104:].float()).all()
    with pytest.raises(ValueError, match="output must be"):
        plan_merge(weights[:1], loras[:1], outs=[torch.empty(64, 95, device=DEV, dtype=dtype)])


def test_a_plan_into_an_arena_serves_any_arena_of_its_size():
    """arena=: the plan holds the copies' places in one block, not their addresses, so it writes
    the same copies into a new block at the next merge (the executor plans once per adapter); many
    matrices of several shapes (the launch finds each tile's matrix by a search), empty ones first,
    between and last."""
    shapes = [(0, 96), (64, 96), (40, 96), (96, 40), (0, 96), (0, 64), (32, 64), (64, 128), (8, 96), (96, 96), (16, 40), (0, 40)]
    weights, loras = merge_layers(shapes, 16, torch.bfloat16)
    refs = [merge_ref(w.clone(), a, b, s) for w, (a, b, s) in zip(weights, loras)]
    places, at = [], 128  # (the first copy not at the arena's start)
    for n_out, n_in in shapes:
        places.append(at)
        at += -(-(n_out * n_in) // 128) * 128
    views = lambda arena: [arena[p : p + n * k].view(n, k) for p, (n, k) in zip(places, shapes)]  # noqa: E731
    first = torch.full((at,), float("nan"), device=DEV, dtype=torch.bfloat16)
    plan = plan_merge(weights, loras, outs=views(first), arena=first, block_m=32, block_n=32, group=1)
    merge_lora_(plan, first)
    second = torch.full((at,), float("nan"), device=DEV, dtype=torch.bfloat16)
    merge_lora_(plan, second)
    for arena in (first, second):
        for o, ref, w, (a, b, s) in zip(views(arena), refs, weights, loras):
            assert ((o.float() - ref.float()).abs() <= merge_bound(ref, w, a, b, s)).all(), "copy off by more than an ulp"
    assert torch.isnan(first[:128].float()).all() and torch.isnan(second[:128].float()).all()
    with pytest.raises(ValueError, match="arena of"):
        merge_lora_(plan, torch.empty(at + 1, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="arena of"):
        merge_lora_(plan)
    with pytest.raises(ValueError, match="arena of"):  # (a strided view of as many elements)
        merge_lora_(plan, torch.empty(2 * at, device=DEV, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match="takes no arena"):
        merge_lora_(plan_merge(weights, loras, block_m=32, block_n=32, group=1), first)
    with pytest.raises(ValueError, match="lie in the arena"):
        plan_merge(weights[:1], loras[:1], outs=[torch.empty(64, 96, device=DEV, dtype=torch.bfloat16)], arena=first)


def test_merged_copies_by_the_kernel_equal_those_by_addmm():
    """The executor's merged mode (adapters._merged_unit): a fused q/k/v group with q and v adapted,
    its copy written by one kernel launch, is the addmm-made copy within an ulp, its k rows copied
    bit for bit, and the served weight untouched."""
    from symbiont.base_executor.adapters import Delta, _merged_unit, _merge_rows
    from symbiont.base_executor.catalog import Unit

    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(96 + 32 + 32, 64, device=DEV, generator=g) / 8).to(torch.bfloat16)
    served = w.clone()
    member = lambda name, a, b: Unit(f"l.{name}", "linear", w[a:b], None, 64, b - a, rows=(a, b))  # noqa: E731
    group = Unit("l.{q,k,v}", "linear", w, None, 64, 160, members=(member("q", 0, 96), member("k", 96, 128), member("v", 128, 160)))
    parts = [(a, b, Delta(torch.randn(8, 64, device=DEV, generator=g), torch.randn(b - a, 8, device=DEV, generator=g), 0.5))
             for a, b in ((0, 96), (128, 160))]
    adapted = []
    by_addmm = _merged_unit(group, parts, adapted)
    _merge_rows(adapted, kernel=False)
    adapted = []
    by_kernel = _merged_unit(group, parts, adapted)
    assert len(adapted) == 2
    _merge_rows(adapted, kernel=True)
    assert torch.equal(w, served)
    assert torch.equal(by_kernel.weight[96:128], served[96:128])
    for (a, b, d) in parts:  # each within its bound of the exact copy: the kernel rounds once, ATen may round scale B A first
        a16, b16 = d.a.to(torch.bfloat16), d.b.to(torch.bfloat16)
        ref = merge_ref(served[a:b].clone(), a16, b16, d.scale)
        bound = merge_bound(ref, served[a:b], a16, b16, d.scale)
        assert ((by_kernel.weight[a:b].float() - ref.float()).abs() <= bound).all(), "kernel's copy off by more than an ulp"
        product = eps(torch.bfloat16) * d.scale * (b16.float().abs() @ a16.float().abs())
        assert ((by_addmm.weight[a:b].float() - ref.float()).abs() <= bound + product).all()
    assert by_kernel.members[2].weight.data_ptr() == by_kernel.weight[128:].data_ptr()
    arena = torch.empty(64 + w.numel(), device=DEV, dtype=torch.bfloat16)  # a copy placed in an arena, not at its start
    adapted = []
    in_arena = _merged_unit(group, parts, adapted, arena[64:].view(w.shape))
    _merge_rows(adapted, kernel=True, arena=arena, plans={}, key=(1, parts, arena.numel()))
    assert torch.equal(in_arena.weight, by_kernel.weight)
    assert [m.weight.data_ptr() for m in in_arena.members] == [in_arena.weight[a].data_ptr() for a in (0, 96, 128)]


def test_merge_with_b_rows_of_unaligned_length():
    """B contiguous along a rank of 4 (8-byte rows in bf16): said contiguous, not 16-byte aligned."""
    weights, loras = merge_layers([(64, 96), (40, 96)], 4, torch.bfloat16)
    loras = [(a, b.contiguous(), s) for a, b, s in loras]
    originals = [w.clone() for w in weights]
    plan = plan_merge(weights, loras, block_m=32, block_n=32, group=2)
    assert plan.b_align == 1 and plan.block_r == 16
    merge_lora_(plan)
    for w, w0, (a, b, s) in zip(weights, originals, loras):
        ref = merge_ref(w0.clone(), a, b, s)
        assert ((w.float() - ref.float()).abs() <= merge_bound(ref, w0, a, b, s)).all()


def test_merge_rejects_mismatched_layers():
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError):
        plan_merge([w], [(torch.zeros(4, 8, device=DEV), torch.zeros(8, 4, device=DEV), 1.0)])
    with pytest.raises(TypeError):
        plan_merge([w], [(torch.zeros(4, 16, device=DEV, dtype=torch.float16), torch.zeros(8, 4, device=DEV), 1.0)])
    with pytest.raises(ValueError, match="ranks up to 128"):  # (the registry then writes the copies by addmm)
        plan_merge([w], [(torch.zeros(129, 16, device=DEV), torch.zeros(8, 129, device=DEV), 1.0)])
    with pytest.raises(ValueError, match="power of two"):
        plan_merge([w], [(torch.zeros(4, 16, device=DEV), torch.zeros(8, 4, device=DEV), 1.0)], block_r=24)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_delora_equals_unmerged_reference(dtype):
    """Adapter 1 merged into W; rows of other adapters and base rows still get W_base + their own."""
    h_in, h_out, ranks = 64, 48, [16, 64, 8, 128]
    pool = make_pool(ranks, h_in, h_out, dtype)
    w_base = (torch.randn(h_out, h_in, device=DEV) / h_in ** 0.5).to(dtype)
    w = w_base.clone()
    a, b, s = pool_adapter(pool, 1)
    merge_lora_(plan_merge([w], [(a.contiguous(), b, s)]))
    seg_lens, seg_slots = [5, 3, 0, 7, 2, 4], [1, 0, 2, -1, 3, 1]
    x = torch.randn(sum(seg_lens), h_in, device=DEV).to(dtype)
    y = (x.float() @ w.float().t()).to(dtype)  # the executor's merged GEMM
    delora_(x, y, pool, plan_delora(seg_lens, seg_slots, ranks, 1, DEV))
    ref = delora_ref(x, w_base, pool, seg_lens, seg_slots)
    err = (y.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1)
    assert err.max().item() < 2 * TOL[dtype]
    # without the deLoRA branches the other rows would be off by adapter 1's delta
    plain = (x.float() @ w.float().t()).to(dtype)
    assert ((plain.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1))[5:8].min() > 10 * TOL[dtype]


# ---- tiling table -----------------------------------------------------------------------

def test_tiling_table_roundtrip_nearest_and_fallbacks(tmp_path):
    a = TileConfig(mode="fused", block_m=16, block_k=128, block_n=64, split=16)
    b = TileConfig(mode="split", block_m=64, block_k=64, block_n=128, split=1, num_warps=8)
    small = ShapeClass.of(16, 4, 64, 4096, 4096)
    big = ShapeClass.of(8192, 4, 64, 4096, 4096)
    path = tmp_path / "t.json"
    TilingTable("GPU-A", {small: a, big: b}, static_best=b, timings={small: {"us": 9.0}}).save(path)
    TilingTable("GPU-B", {small: b}).save(path)  # a second GPU keeps the first's table
    t = TilingTable.load(path, "GPU-A")
    assert t.entries == {small: a, big: b} and t.static_best == b and t.timings[small] == {"us": 9.0}
    assert t.lookup(16, 4, 64, 4096, 4096) == a
    assert t.lookup(6000, 3, 50, 4096, 4096) == b       # nearest: same width, many tokens
    assert t.lookup(2, 1, 8, 2048, 512) == a            # nearest: few tokens
    assert TilingTable.load(path, "GPU-B").lookup(16, 4, 64, 4096, 4096) == b
    unknown = TilingTable.load(path, "GPU-C")           # no entry: built-in defaults
    assert unknown.entries == {} and unknown.lookup(1, 1, 8, 64, 64).mode == "fused"
    assert TilingTable.load(tmp_path / "missing.json", "GPU-A").entries == {}
    doc = json.loads(path.read_text())
    doc["version"] = tiling.VERSION + 1
    path.write_text(json.dumps(doc))
    assert TilingTable.load(path, "GPU-A").entries == {}  # other format version: ignored, not an error


def test_fit_config_keeps_shared_memory_in_budget():
    huge = TileConfig(mode="split", block_m=128, block_k=256, block_n=256, split=1, num_stages=6)
    fitted = tiling.fit_config(huge, 128)
    assert fitted != huge and fitted.num_stages >= 2
    assert 2 * fitted.num_stages * (128 * fitted.block_k + fitted.block_k * 128) <= tiling.SMEM_BUDGET
    for tokens in (1, 3, 64, 1000, 8192, 100000):
        for rank in (1, 8, 100, 128):
            cfg = TilingTable("none").lookup(tokens, min(tokens, 64), rank, 4096, 14336)
            assert cfg.mode in ("split", "fused")


def test_tune_atmm_model_shapes(tmp_path):
    assert model_shapes("llama-8b") == [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
    assert model_shapes("llama-1b") == [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2}))
    assert model_shapes(str(tmp_path)) == [(256, 256), (256, 64), (256, 688), (688, 256)]
    with pytest.raises(ValueError):
        model_shapes("no-such-model")
    if not HAS_CUDA:
        assert tune_main(["--model", "llama-1b", "--out", str(tmp_path / "x.json")]) == 2


def test_rank_mixes_cover_the_classes_benchmarked():
    assert rank_mixes(128) == [(128, 64, 32, 16, 8), (64, 128)]
    assert rank_mixes(64) == [(64, 32, 16, 8), (32, 64)]
    assert rank_mixes(16) == [(16, 8)]  # (8, 16) is the same mix
    assert rank_mixes(8) == [(8,)]


def test_choose_tiling_keeps_static_unless_a_clear_win_on_every_mix():
    static, fast, noisy = (TileConfig(mode="fused", block_m=bm, block_k=64, block_n=64) for bm in (16, 32, 64))
    rounds = 15
    steady = lambda us: [us] * rounds  # noqa: E731
    # fast: 10% faster than static on both mixes, every round
    mixes = [{static: steady(10.0), fast: steady(9.0), noisy: steady(10.0)},
             {static: steady(20.0), fast: steady(18.0), noisy: steady(20.0)}]
    assert choose_tiling(mixes, static) == (fast, pytest.approx(10 / 9))
    # wins on one mix, loses on the other: static stays
    mixes[1][fast] = steady(21.0)
    assert choose_tiling(mixes, static) == (static, 1.0)
    # median 6% faster but slower in half of the rounds minus one: not a clear win
    jumpy = [9.4] * 8 + [10.5] * 7
    assert choose_tiling([{static: steady(10.0), noisy: jumpy}], static) == (static, 1.0)
    # 3% faster every round: under the margin
    assert choose_tiling([{static: steady(10.0), fast: steady(9.7)}], static)[0] == static


def test_interleaved_timing_rotates_the_order():
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    samples = interleaved_us(fns, rounds=4, window_ms=0.001, sync=lambda: None)
    assert {k: len(v) for k, v in samples.items()} == {"a": 4, "b": 4, "c": 4}
    timed = calls[3 * 8:]  # after each call's warm-up (3) and calibration (5) calls
    firsts = [timed[i] for i in range(0, len(timed), len(timed) // 4)]
    assert firsts == ["a", "b", "c", "a"]
    assert paired_ratio({"a": [2.0, 4.0, 6.0], "b": [1.0, 1.0, 2.0]}, "a", "b") == 3.0
    assert quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.25) == 2.0


# ---- model-sized cases on a GPU -----------------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("tokens,adapters", [(1, 1), (64, 64), (1024, 16), (8192, 64)])
def test_gpu_atmm_model_shapes_all_candidates(tokens, adapters):
    dtype, h = torch.bfloat16, 4096
    ranks = [(8, 16, 32, 64, 128)[i % 5] for i in range(adapters)]
    pool = make_pool(ranks, h, h, dtype)
    per = max(1, tokens // adapters)
    seg_lens = [per] * (tokens // per)
    seg_lens[-1] += tokens - sum(seg_lens)
    seg_slots = [i % adapters for i in range(len(seg_lens))]
    x = torch.randn(tokens, h, device=DEV).to(dtype)
    y0 = torch.randn(tokens, h, device=DEV).to(dtype)
    plan = plan_segments(seg_lens, seg_slots, ranks, DEV)
    ref = atmm_ref(x, y0.clone(), pool, seg_lens, seg_slots)
    for cfg in tiling.candidate_configs(quick=True):
        out = atmm(x, y0.clone(), pool, plan, config=cfg)
        check_rows(out, y0, ref, seg_lens, seg_slots, dtype)


@gpu
@needs_cuda
def test_gpu_fast_launch_reuses_only_matching_specialisation():
    """Repeat launches skip Triton's binder; a misaligned output slice gets its own kernel."""
    from symbiont.base_executor.kernels import atmm_fused, triton_launch
    dtype, ranks = torch.bfloat16, [16, 128, 8]
    pool = make_pool(ranks, 256, 192, dtype)
    seg_lens, seg_slots = [5, 9, 2], [0, 1, 2]
    plan = plan_segments(seg_lens, seg_slots, ranks, DEV)
    cfg = TileConfig(mode="fused", block_m=16, block_k=64, block_n=64, split=2)
    before = len(atmm_fused._KERNELS.compiled)
    for offset in (0, 0, 1, 1, 0):  # a column offset of 1 element breaks 16-byte alignment
        x = torch.randn(16, 256, device=DEV).to(dtype)
        wide = torch.randn(16, 200, device=DEV).to(dtype)
        y0 = wide[:, offset:offset + 192].clone()
        atmm(x, wide[:, offset:offset + 192], pool, plan, config=cfg)
        ref = atmm_ref(x, y0.clone(), pool, seg_lens, seg_slots)
        check_rows(wide[:, offset:offset + 192], y0, ref, seg_lens, seg_slots, dtype)
    assert triton_launch.CompiledKernels.enabled
    assert len(atmm_fused._KERNELS.compiled) - before == 2
    (launch,) = plan.launches.values()
    assert len(launch.launch.runners) == 2  # one runner per specialisation, called directly


@gpu
@needs_cuda
def test_gpu_merge_llama_layer_shapes():
    shapes = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
    weights, loras = merge_layers(shapes, 64, torch.bfloat16)
    originals = [w.clone() for w in weights]
    plan = plan_merge(weights, loras)
    merge_lora_(plan)
    for w, w0, (a, b, s) in zip(weights, originals, loras):
        ref = merge_ref(w0.clone(), a, b, s)
        assert ((w.float() - ref.float()).abs() <= merge_bound(ref, w0, a, b, s)).all()
    unmerge_lora_(plan)
    for w, w0, (a, b, s) in zip(weights, originals, loras):
        delta = s * (b.float() @ a.float())
        assert ((w.float() - w0.float()).abs() <= eps(w.dtype) * (2 * w0.float().abs() + delta.abs()) * 1.01
                + 1e-6).all()


@gpu
@needs_cuda
def test_a_registry_merge_again_reuses_its_plan_and_writes_the_same_copies():
    """The executor's switch on a GPU: every projection of a small Llama adapted, the copies in one
    arena; the second merge launches the kept plan before describing the copies and writes them bit
    for bit as the first did, each within its bound of the exact copy; the served weights stay."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from symbiont.base_executor.adapters import AdapterRegistry
    from symbiont.base_executor.catalog import UnitTable
    from symbiont.proto import executor_pb2 as pb
    from symbiont.proto.codec import dtype_enum

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    table = UnitTable(model)
    registry = AdapterRegistry(table, torch.device("cuda"))
    weights, exact = [], {}
    for uid, unit in table.units.items():
        if uid.rpartition(".")[2].endswith("_proj") and unit.kind == "linear" and not unit.members:
            a = (torch.randn(16, unit.in_features) * 0.1).to(torch.bfloat16)
            b = (torch.randn(unit.out_features, 16) * 0.1).to(torch.bfloat16)
            exact[uid] = (unit.weight.clone(), a.cuda(), b.cuda())
            weights.append(pb.AdapterWeight(unit=uid, rank=16, dtype=dtype_enum(torch.bfloat16), scale=2.0,
                                            a=a.view(torch.uint8).numpy().tobytes(), b=b.view(torch.uint8).numpy().tobytes()))
    adapter = registry.host(0, pb.HostAdapterRequest(name="all", weights=weights))
    served = {uid: t.weight.clone() for uid, t in table.units.items() if t.weight is not None}
    first = {uid: u.weight.clone() for uid, u in registry.merge(adapter.id).units.items()}
    registry.unmerge()
    assert registry._merge_plans, "the first merge kept no plan"
    again = registry.merge(adapter.id).units
    for uid, w in first.items():
        assert torch.equal(again[uid].weight, w), uid
    for uid, (w0, a, b) in exact.items():
        ref = merge_ref(w0.clone(), a, b, 2.0)
        assert ((again[uid].weight.float() - ref.float()).abs() <= merge_bound(ref, w0, a, b, 2.0)).all(), uid
    for uid, w in served.items():
        assert torch.equal(table.get(uid).weight, w), uid
