"""Sibling-call fusion: q/k/v and gate/up make one remote call forward and one backward, with
the unfused results (logits bitwise, greedy tokens, LoRA gradients), against a real executor,
eager and compiled."""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from symbiont.base_executor import runner
from symbiont.base_executor.catalog import UnitTable
from symbiont.base_executor.models import build_builtin
from symbiont import connect
from symbiont import virtualize as _virtualize
from symbiont.client.fusion import WASTE_LIMIT, FusionScope
from symbiont.proto import executor_pb2 as pb
from tests.models import assert_grads_close, enable_checkpointing, ids, lora_grads

LAYERS = 2  # of every tiny model
QKV, GATE_UP = "self_attn.{q_proj,k_proj,v_proj}", "mlp.{gate_proj,up_proj}"
MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def virtualize(model, executor, **kw):
    """Fusion alone: a whole-MLP call (tests/test_whole_mlp.py) would take gate/up's calls."""
    return _virtualize(model, executor, whole_mlp=False, **kw)


def calls_by_unit(observer) -> collections.Counter:
    return collections.Counter({u.unit: u.calls for u in observer.stats().units})


class CallCount:
    """Calls per unit that the executor served inside the `with` block."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        self.observer = connect(self.url)  # never attaches: stats only
        self.before = calls_by_unit(self.observer)
        return self

    def __exit__(self, *exc):
        self.calls = calls_by_unit(self.observer) - self.before
        self.observer.close()

    def of(self, suffix: str) -> int:
        return sum(n for unit, n in self.calls.items() if unit.endswith(suffix))

    def members(self) -> int:
        return sum(self.of(name) for name in MEMBERS)

    def total(self) -> int:
        return sum(self.calls.values())


def steps_side_by_side(url: str, ref, virt, x: torch.Tensor, steps: int = 2):
    """SGD steps of the unsplit `ref` and the virtualized `virt` on x, side by side: after each
    backward their adapter gradients agree; yields the CallCount of virt's forward and backward
    (before the optimizer steps)."""
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (ref, virt)]
    for _ in range(steps):
        for m, opt in zip((ref, virt), opts):
            opt.zero_grad()
            with CallCount(url) as count:
                m(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(ref), lora_grads(virt))
        yield count
        for opt in opts:
            opt.step()


def _lora(base, targets):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(base, config)


# ---- the executor's side: group units ----------------------------------------------------


def test_group_units_share_their_members_memory():
    for name, bias in [("tiny-llama", False), ("tiny-qwen2", True)]:
        table = UnitTable(build_builtin(name))
        groups = [u for u in table.units.values() if u.members and u.kind == "linear"]  # (MLP units: test_whole_mlp)
        assert sorted(g.id for g in groups) == sorted(f"model.layers.{i}.{g}" for i in range(LAYERS) for g in (QKV, GATE_UP))
        qkv = table.get(f"model.layers.0.{QKV}")
        assert list(qkv.info().members) == [f"model.layers.0.self_attn.{n}_proj" for n in "qkv"]
        assert (qkv.in_features, qkv.out_features) == (64, 64 + 32 + 32) and (qkv.bias is not None) == bias
        before = table.parameter_count()
        unit_params = {id(p): p for m in build_builtin(name).modules() if isinstance(m, (nn.Linear, nn.Embedding))
                       for p in m.parameters(recurse=False)}
        assert before == sum(p.numel() for p in unit_params.values())  # groups add nothing
        table.to(torch.device("meta"))  # a move keeps members as slices of the moved group tensor
        assert table.parameter_count() == before
        for g in groups:
            for m in g.members:
                assert m.weight._base is g.weight and m.weight.device.type == "meta"
                assert m.bias is None if g.bias is None else m.bias._base is g.bias
    for name in ("tiny-phi3", "tiny-gpt2"):  # they come fused (qkv_proj, gate_up_proj, c_attn)
        assert not any(u.members for u in UnitTable(build_builtin(name)).units.values() if u.kind == "linear")


def test_siblings_by_convention():
    def block(**widths):  # name -> (in, out, bias)
        return nn.ModuleDict({n: nn.Linear(i, o, bias=b) for n, (i, o, b) in widths.items()})

    model = nn.ModuleDict({
        "self_attn": block(q_proj=(8, 8, False), k_proj=(8, 4, False), v_proj=(8, 4, False), o_proj=(8, 8, False)),
        "encoder_attn": block(q_proj=(8, 8, True), k_proj=(6, 4, True), v_proj=(6, 4, True)),  # k/v read the encoder
        "mixed": block(q_proj=(8, 8, True), k_proj=(8, 8, False), v_proj=(8, 8, True)),
        "mlp": block(gate_proj=(8, 16, False), up_proj=(6, 16, False), fc1=(8, 8, False), fc2=(8, 8, False)),
    })
    table = UnitTable(model)
    groups = {u.id: [m.id for m in u.members] for u in table.units.values() if u.members and u.kind == "linear"}
    assert groups == {
        "self_attn.{q_proj,k_proj,v_proj}": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "encoder_attn.{k_proj,v_proj}": ["encoder_attn.k_proj", "encoder_attn.v_proj"],
    }
    x = torch.randn(5, 8)
    with torch.no_grad():  # the model's own modules now hold slices of the group's weights: same values
        want = torch.cat([model["self_attn"][n](x) for n in ("q_proj", "k_proj", "v_proj")], -1)
    group = table.get("self_attn.{q_proj,k_proj,v_proj}")
    # exact: members this narrow (4 columns) take another MKL kernel than their 16-wide group,
    # whose sums differ in the last bit; one GEMM per member is bitwise on any BLAS
    assert torch.equal(runner.run(group, pb.FORWARD, x, exact=True), want)
    torch.testing.assert_close(runner.run(group, pb.FORWARD, x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("exact", [False, True])
def test_group_forward_is_its_members_forward(exact):
    """exact: one GEMM per member, bitwise by construction. Otherwise one GEMM over the stacked
    weights: bitwise too for these widths (members of 32 to 128 columns) on the CPU's MKL, as
    for every member wider than 16 columns we measured (narrower ones can take another kernel;
    see test_siblings_by_convention); test_parity's bitwise logits rest on the same fact."""
    table = UnitTable(build_builtin("tiny-qwen2"))
    for gid in (f"model.layers.1.{QKV}", f"model.layers.1.{GATE_UP}"):
        group = table.get(gid)
        for tokens in (1, 2, 7, 17, 34, 100):
            x = torch.randn(tokens, group.in_features)
            for op in (pb.FORWARD, pb.FORWARD_NO_BIAS):
                want = torch.cat([runner.run(m, op, x) for m in group.members], -1)
                assert torch.equal(runner.run(group, op, x, exact), want), (gid, tokens, pb.Op.Name(op))
            g = torch.randn(tokens, group.out_features)
            want = sum(runner.run(m, pb.BACKWARD, g[:, a:b]) for m in group.members for a, b in [m.rows])
            torch.testing.assert_close(runner.run(group, pb.BACKWARD, g, exact), want, rtol=1e-5, atol=1e-6)


# ---- the tenant's side: fewer calls, same results ----------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma2"])
def test_four_calls_per_layer_same_logits(executor_for, name):
    ex = executor_for(name)
    ref = build_builtin(name)
    fused, unfused = virtualize(build_builtin(name), ex.url), virtualize(build_builtin(name), ex.url, fuse=False)
    x = ids(2, 17)
    with torch.no_grad():
        want = ref(x).logits
        with CallCount(ex.url) as on:
            got = fused(x).logits
        with CallCount(ex.url) as off:
            got_unfused = unfused(x).logits
    assert torch.equal(got, want) and torch.equal(got_unfused, want)
    assert on.total() == 4 * LAYERS + 2 and on.members() == 0, on.calls  # + embedding and lm_head
    assert on.of(QKV) == on.of(GATE_UP) == LAYERS
    assert off.total() == 7 * LAYERS + 2 and off.of("}") == 0, off.calls
    layer = fused.model.layers[0]
    assert layer.self_attn.v_proj.unwrap()["group"] == {"unit": f"model.layers.0.{QKV}", "columns": (96, 128), "fused": True}
    assert unfused.model.layers[0].self_attn.v_proj.unwrap()["group"] is None


@pytest.mark.parametrize("order", ["after_peft", "before_peft"])
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]])
def test_lora_gradients_one_backward_per_group(executor, targets, order):
    ref = _lora(build_builtin("tiny-llama"), targets)
    if order == "after_peft":
        virt = virtualize(_lora(build_builtin("tiny-llama"), targets), executor.url)
    else:
        virt = _lora(virtualize(build_builtin("tiny-llama"), executor.url), targets)
    for count in steps_side_by_side(executor.url, ref, virt, ids(2, 10, seed=5)):
        # forward and backward, one call each; layer 0's q/k/v read the embedding output, which
        # needs no gradient, and the embedding has no backward
        assert count.members() == 0 and count.of(GATE_UP) == 2 * LAYERS and count.of(QKV) == 2 * LAYERS - 1, count.calls
        assert count.total() == (4 * LAYERS + 2) + (4 * LAYERS - 1 + 1), count.calls


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(executor, reentrant):
    models = [_lora(build_builtin("tiny-llama"), ["q_proj", "k_proj", "up_proj"]),
              virtualize(_lora(build_builtin("tiny-llama"), ["q_proj", "k_proj", "up_proj"]), executor.url)]
    x = ids(2, 11, seed=8)
    for m in models:
        enable_checkpointing(m, reentrant)
    models[0](input_ids=x, labels=x).loss.backward()
    with CallCount(executor.url) as count:
        models[1](input_ids=x, labels=x).loss.backward()
    assert count.members() == 0 and count.of(QKV) > 0, count.calls  # the recomputed forward fuses too
    assert_grads_close(lora_grads(models[0]), lora_grads(models[1]))


def test_generate(executor):
    ref = build_builtin("tiny-llama")
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    prompt = ids(1, 6, seed=3)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with CallCount(executor.url) as count:
        got = virt.generate(prompt, **kw)
    assert torch.equal(got, ref.generate(prompt, **kw))
    assert count.members() == 0 and count.of(QKV) == 10 * LAYERS, count.calls


def test_inference_mode(executor):
    ref = build_builtin("tiny-llama")
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    x = ids(2, 9)
    with torch.inference_mode(), CallCount(executor.url) as count:
        got = virt(x).logits
    with torch.no_grad():
        assert torch.equal(got, ref(x).logits)
    assert count.members() == 0, count.calls


def test_members_called_with_other_inputs(executor):
    """A member called alone, or siblings fed different inputs: results are the unfused ones;
    a group whose members keep reading different inputs stops fusing."""
    ref = build_builtin("tiny-llama")
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    attn, attn_ref = virt.model.layers[0].self_attn, ref.model.layers[0].self_attn
    x = ids(1, 7)
    with torch.no_grad():
        z = torch.randn(3, 64)
        assert torch.equal(attn.k_proj(z), attn_ref.k_proj(z))  # alone: one group call, q and v kept
        with CallCount(executor.url) as count:
            assert torch.equal(virt(x).logits, ref(x).logits)  # the kept outputs were for z: not taken
        assert count.members() == 0 and attn.k_proj.unwrap()["group"]["fused"], count.calls

    # q reads one input, k and v another (as in cross-attention)
    for rounds in range(WASTE_LIMIT):
        a, b = torch.randn(2, 5, 64, requires_grad=True), torch.randn(2, 5, 64, requires_grad=True)
        a2, b2 = (t.detach().clone().requires_grad_() for t in (a, b))
        got = [attn.q_proj(a), attn.k_proj(b), attn.v_proj(b)]
        want = [attn_ref.q_proj(a2), attn_ref.k_proj(b2), attn_ref.v_proj(b2)]
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        sum((g * w.detach()).sum() for g, w in zip(got, want)).backward()
        sum((w * w.detach()).sum() for w in want).backward()
        torch.testing.assert_close(a.grad, a2.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-6)
    assert not attn.q_proj.unwrap()["group"]["fused"]
    with torch.no_grad(), CallCount(executor.url) as count:
        assert torch.equal(virt(x).logits, ref(x).logits)
    assert count.of("layers.0.self_attn.q_proj") == 1 and count.of(f"layers.0.{QKV}") == 0 and count.of(f"layers.1.{QKV}") == 1


def test_compiled_model_fuses(executor):
    """While torch.compile traces, siblings fed the same tensor share one group call in the graph
    (forward and backward), with no graph break, the unfused model's logits and LoRA gradients;
    nothing traced is kept on the group once the graph has run."""
    torch._dynamo.utils.counters.clear()
    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), executor.url)
    x = ids(1, 7)
    compiled = torch.compile(virt, backend="aot_eager")
    for _ in range(2):  # (the second run is the compiled code's, not the trace's)
        with torch.no_grad(), CallCount(executor.url) as count:
            assert torch.equal(compiled(x).logits, ref(x).logits)
        assert count.members() == 0 and count.of(QKV) == LAYERS and count.of(GATE_UP) == LAYERS, count.calls
    assert not torch._dynamo.utils.counters["graph_break"]
    assert all(m.self_attn.q_proj._group._traced_kept is None and not m.self_attn.q_proj._group._scope_open for m in virt.model.layers)
    ref_l, virt_l = _lora(build_builtin("tiny-llama"), ["q_proj", "v_proj"]), virtualize(_lora(build_builtin("tiny-llama"), ["q_proj", "v_proj"]), executor.url)
    g = ids(2, 9, seed=4)
    ref_l(input_ids=g, labels=g).loss.backward()
    with CallCount(executor.url) as count:
        torch.compile(virt_l, backend="aot_eager")(input_ids=g, labels=g).loss.backward()
    assert count.members() == 0 and count.of(QKV) == 2 * LAYERS - 1, count.calls
    assert_grads_close(lora_grads(ref_l), lora_grads(virt_l))


def test_compiled_members_called_with_other_inputs(executor):
    """Traced, siblings fed different inputs get the unfused results too; members called outside
    their parent's forward call per unit, and nothing is kept from one run to the next (the
    input changed in place between runs)."""
    ref = build_builtin("tiny-llama")
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    attn, attn_ref = virt.model.layers[0].self_attn, ref.model.layers[0].self_attn

    def three(m, a, b):
        return m.q_proj(a), m.k_proj(b), m.v_proj(b), m.k_proj(a)

    a, b = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    compiled = torch.compile(three, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            with CallCount(executor.url) as count:
                got = compiled(attn, a, b)
            for g, w in zip(got, three(attn_ref, a, b)):
                assert torch.equal(g, w)
            assert count.of(QKV) == 0 and count.members() == 4, count.calls
            assert attn.q_proj._group._traced_kept is None
            a.mul_(2)

    class Calls(nn.Module):  # the same calls inside a parent's forward, where the group fuses
        def forward(self, a, b):
            return three(attn, a, b)

    scoped = type("ScopedCalls", (FusionScope, Calls), {})()
    scoped._fusion_groups = (attn.q_proj._group,)
    compiled = torch.compile(scoped, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            with CallCount(executor.url) as count:
                got = compiled(a, b)
            for g, w in zip(got, three(attn_ref, a, b)):
                assert torch.equal(g, w)
            assert count.of(QKV) == 3 and count.members() == 0, count.calls  # a, b, a again
            assert attn.q_proj._group._traced_kept is None
            a.mul_(2)


def test_attention_outputs_through_a_fusion_scope(executor):
    """The attention module made a FusionScope is still what transformers looks for: its
    attention weights are recorded (output_attentions) as the unsplit model's."""
    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), executor.url)
    assert isinstance(virt.model.layers[0].self_attn, FusionScope)
    for m in (ref, virt):
        m.config._attn_implementation = "eager"
    x = ids(1, 7)
    with torch.no_grad():
        want, got = ref(x, output_attentions=True).attentions, virt(x, output_attentions=True).attentions
    assert len(got) == len(want) == LAYERS
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_outputs_are_separate_tensors(executor):
    """Each member gets its own contiguous tensor, as from its own call: an in-place change of
    one (PEFT's mixed-adapter batches add into the base output) leaves its siblings and their
    gradients alone."""
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    ref = build_builtin("tiny-llama")
    x = torch.randn(1, 1, 64, requires_grad=True)  # one row: slices of the group output would be contiguous views
    x2 = x.detach().clone().requires_grad_()
    ys = []
    for mlp, inp in ((virt.model.layers[0].mlp, x), (ref.model.layers[0].mlp, x2)):
        gate, up = mlp.gate_proj(inp), mlp.up_proj(inp)
        gate += 1
        ys.append((gate * up).sum())
    assert torch.equal(ys[0], ys[1])
    ys[0].backward()
    ys[1].backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        q, k = virt.model.layers[0].self_attn.q_proj(x), virt.model.layers[0].self_attn.k_proj(x)
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() and q.is_contiguous() and k.is_contiguous()


def test_siblings_called_in_two_threads_by_turns_fuse_each_threads_own_calls(executor):
    """Two threads calling q, k, v of one attention by turns (a, b, a, b, ...) with inputs of their
    own: each thread's siblings take the outputs of its own group call (2 calls in all), and each
    result is its input's. (With one record for all threads, thread b's call replaced thread a's
    kept outputs: a's next sibling called again, or, in a race, took b's.)"""
    from concurrent.futures import ThreadPoolExecutor

    ref = build_builtin("tiny-llama").model.layers[0].self_attn
    attn = virtualize(build_builtin("tiny-llama"), executor.url).model.layers[0].self_attn
    inputs = {"a": torch.randn(2, 64), "b": torch.randn(3, 64)}
    pools = {who: ThreadPoolExecutor(1) for who in inputs}
    try:
        with torch.no_grad(), CallCount(executor.url) as count:
            for name in ("q_proj", "k_proj", "v_proj"):
                for who, x in inputs.items():
                    got = pools[who].submit(lambda: getattr(attn, name)(x)).result()
                    assert torch.equal(got, getattr(ref, name)(x)), (who, name)
    finally:
        for pool in pools.values():
            pool.shutdown()
    assert count.of(QKV) == 2 and count.members() == 0, count.calls


def test_threads_sharing_one_model(executor):
    """Threads calling one virtualized model at once (a server's workers): each gets its own
    results, fused groups keep each thread's outputs apart (they were shared: a sibling could take
    another thread's output, or find it gone), and generate agrees with the single-threaded run."""
    import threading

    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    xs = [ids(1, 5 + i, seed=i) for i in range(6)]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = [virt(x).logits for x in xs]
    tokens = [virt.generate(x, **kw) for x in xs]
    failures = []

    def work(i):
        try:
            for n in range(80):
                with torch.no_grad():
                    if not torch.equal(virt(xs[i]).logits, want[i]):
                        failures.append((i, n, "logits"))
            if not torch.equal(virt.generate(xs[i], **kw), tokens[i]):
                failures.append((i, "generate"))
        except Exception as e:  # (a KeyError from a sibling whose kept output another thread took)
            failures.append((i, repr(e)))

    import sys

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (threads switch often: races show)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[:5]
