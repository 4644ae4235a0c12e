"""Whole-MLP calls: a gated MLP block none of whose Linears has an adapter is one call forward and
one backward (the executor recomputes it), with the per-Linear results: logits bitwise, greedy
tokens, LoRA gradients; a block whose Linear gets an adapter goes back to per-Linear calls."""
from __future__ import annotations

import pytest
import torch

from symbiont.base_executor import runner
from symbiont.base_executor.catalog import UnitTable
from symbiont.base_executor.models import build_builtin
from symbiont import virtualize
from symbiont.proto import executor_pb2 as pb
from tests.models import assert_grads_close, enable_checkpointing, ids, lora_grads, lora_model
from tests.test_fusion import GATE_UP, LAYERS, QKV, CallCount, _lora, steps_side_by_side

MLP = "mlp"  # the suffix of an MLP unit's id (model.layers.N.mlp)


# ---- the executor's side: MLP units ------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2", "tiny-phi3"])
def test_mlp_unit_is_the_block(name):
    """Gate and up as a group of two siblings, or as one Linear (Phi-3's gate_up_proj)."""
    model = build_builtin(name)
    table = UnitTable(model)
    units = [u for u in table.units.values() if u.kind == "mlp"]
    assert [u.id for u in units] == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    gate_up = "mlp.gate_up_proj" if name == "tiny-phi3" else GATE_UP
    assert [m.id for m in units[0].members] == [f"model.layers.0.{gate_up}", "model.layers.0.mlp.down_proj"]
    before = table.parameter_count()
    block = model.model.layers[1].mlp
    unit = table.get("model.layers.1.mlp")
    for tokens in (1, 5, 33):
        x = torch.randn(tokens, 64, requires_grad=True)
        y = block(x)
        assert torch.equal(runner.run(unit, pb.FORWARD, x.detach(), exact=True), y)
        grad_y = torch.randn_like(y)
        (want,) = torch.autograd.grad(y, x, grad_y)
        got = runner.run(unit, pb.BACKWARD, torch.cat([x.detach(), grad_y], -1))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    table.to(torch.device("meta"))
    assert table.parameter_count() == before  # an MLP unit holds no weights of its own


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_mlp_backward_runs_the_ops_autograd_runs(name):
    """The MLP unit's backward calls the activation's backward op itself (found by a probe at
    load), bitwise what the recompute through autograd gives; an activation with no known
    backward op goes through autograd, with the block's gradient."""
    table = UnitTable(build_builtin(name).to(torch.bfloat16))
    unit = table.get("model.layers.0.mlp")
    assert unit.act_backward is not None
    xg = torch.randn(9, 128, dtype=torch.bfloat16)
    direct = runner.run(unit, pb.BACKWARD, xg)
    unit.act_backward = None
    assert torch.equal(runner.run(unit, pb.BACKWARD, xg), direct)
    unit.act = lambda h: h * torch.tanh(h)  # nothing in runner._ACT_BACKWARDS
    assert runner.act_backward_of(unit.act, torch.bfloat16) is None
    x, grad_y = xg.float().split(64, dim=-1)
    x.requires_grad_()
    pair, down = unit.members
    gate, up = torch.nn.functional.linear(x, pair.weight.float()).split(pair.members[0].out_features, dim=-1)
    (want,) = torch.autograd.grad(torch.nn.functional.linear(unit.act(gate) * up, down.weight.float()), x, grad_y)
    torch.testing.assert_close(runner.run(unit, pb.BACKWARD, xg).float(), want, rtol=2e-2, atol=2e-2)


def test_no_mlp_unit_for_other_blocks():
    assert not [u for u in UnitTable(build_builtin("tiny-gpt2")).units.values() if u.kind == "mlp"]  # not gated


def test_mlp_unit_checks_its_calls(executor):
    from symbiont import connect
    from symbiont.errors import InvalidCallError, ShapeMismatchError

    conn = connect(executor.url)
    try:
        conn.ensure_attached("cpu")
        t = conn.transport
        x = torch.randn(3, 64)
        with pytest.raises(ShapeMismatchError, match=r"\[x, grad_y\]"):  # backward takes x beside grad_y
            t.call("model.layers.0.mlp", pb.BACKWARD, x, (3, 64), torch.float32, pb.TRAINING)
        with pytest.raises(InvalidCallError, match="FORWARD and BACKWARD only"):
            t.call("model.layers.0.mlp", pb.FORWARD_NO_BIAS, x, (3, 64), torch.float32, pb.TRAINING)
        y = t.call("model.layers.0.mlp", pb.FORWARD, x, (3, 64), torch.float32, pb.TRAINING)
        with torch.no_grad():
            assert torch.equal(y, build_builtin("tiny-llama").model.layers[0].mlp(x))
    finally:
        conn.close()


# ---- the tenant's side -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma2", "tiny-phi3"])
def test_three_calls_per_layer_same_logits(executor_for, name):
    ex = executor_for(name, "--no-layer-spans")  # (with layer spans a layer makes one call: test_layer_span.py)
    ref = build_builtin(name)
    virt = virtualize(build_builtin(name), ex.url)
    x = ids(2, 17)
    with torch.no_grad():
        want = ref(x).logits
        with CallCount(ex.url) as count:
            got = virt(x).logits
    assert torch.equal(got, want)
    assert count.total() == 3 * LAYERS + 2 and count.of(MLP) == LAYERS and count.of(GATE_UP) + count.of("gate_up_proj") == 0, count.calls
    block = virt.model.layers[0].mlp
    assert type(block).__name__.startswith("Virt") and isinstance(block, type(ref.model.layers[0].mlp))


def test_lora_on_attention_one_backward_per_block(executor):
    ref, virt = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), executor.url)  # q_proj, v_proj
    for count in steps_side_by_side(executor.url, ref, virt, ids(2, 10, seed=5)):
        # forward: qkv, o, mlp per layer + embedding and lm_head; backward: the same but the
        # embedding's and layer 0's qkv (its input, the embedding output, needs no gradient)
        assert count.of(MLP) == 2 * LAYERS and count.of(GATE_UP) == 0 and count.of("down_proj") == 0, count.calls
        assert count.total() == (3 * LAYERS + 2) + (3 * LAYERS - 1 + 1), count.calls


def test_phi3_fused_gate_up_block_trains_as_one_call(executor_for):
    """Phi-3's block (one gate_up_proj Linear) with LoRA on attention: one MLP call forward and one
    backward per layer, the unsplit model's adapter gradients; an adapter on gate_up_proj brings
    its per-Linear calls back."""
    ex = executor_for("tiny-phi3")
    ref, virt = lora_model("tiny-phi3"), virtualize(lora_model("tiny-phi3"), ex.url)  # qkv_proj
    for count in steps_side_by_side(ex.url, ref, virt, ids(2, 10, seed=5)):
        assert count.of(MLP) == 2 * LAYERS and count.of("gate_up_proj") == 0 and count.of("down_proj") == 0, count.calls
    targets = ["gate_up_proj"]
    ref, virt = _lora(build_builtin("tiny-phi3"), targets), virtualize(_lora(build_builtin("tiny-phi3"), targets), ex.url)
    for count in steps_side_by_side(ex.url, ref, virt, ids(2, 10, seed=6)):
        # (nothing before layer 0's block needs a gradient: its gate_up_proj has no BACKWARD)
        assert count.of(MLP) == 0 and count.of("gate_up_proj") == 2 * LAYERS - 1 and count.of("down_proj") == 2 * LAYERS, count.calls


@pytest.mark.parametrize("order", ["after_peft", "before_peft"])
def test_block_with_an_adapter_calls_per_linear(executor, order):
    targets = ["q_proj", "v_proj", "up_proj"]
    ref = _lora(build_builtin("tiny-llama"), targets)
    if order == "after_peft":
        virt = virtualize(_lora(build_builtin("tiny-llama"), targets), executor.url)
    else:
        virt = _lora(virtualize(build_builtin("tiny-llama"), executor.url), targets)
    x = ids(2, 10, seed=6)
    ref(input_ids=x, labels=x).loss.backward()
    with CallCount(executor.url) as count:
        virt(input_ids=x, labels=x).loss.backward()
    assert_grads_close(lora_grads(ref), lora_grads(virt))
    assert count.of(MLP) == 0 and count.of(GATE_UP) == 2 * LAYERS, count.calls  # up_proj has an adapter


def test_adapter_added_later_and_disabled(executor):
    """A block turns to per-Linear calls the moment PEFT wraps one of its Linears, and computes
    the same with the adapter disabled."""
    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), executor.url)
    x = ids(1, 7)
    with torch.no_grad():
        assert torch.equal(virt(x).logits, ref(x).logits)
    ref, virt = _lora(ref, ["down_proj"]), _lora(virt, ["down_proj"])
    with torch.no_grad(), CallCount(executor.url) as count:
        assert torch.equal(virt(x).logits, ref(x).logits)
        with virt.disable_adapter(), ref.disable_adapter():
            assert torch.equal(virt(x).logits, ref(x).logits)
    assert count.of(MLP) == 0 and count.of("down_proj") == 2 * LAYERS, count.calls


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(unit_calls_executor, reentrant):
    executor = unit_calls_executor  # (reentrant checkpointing's first forward is under no_grad: spans there)
    models = [lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), executor.url)]
    x = ids(2, 11, seed=8)
    for m in models:
        enable_checkpointing(m, reentrant)
    models[0](input_ids=x, labels=x).loss.backward()
    with CallCount(executor.url) as count:
        models[1](input_ids=x, labels=x).loss.backward()
    assert count.of(MLP) > 2 * LAYERS and count.of(GATE_UP) == 0, count.calls  # the recomputed forward too
    assert_grads_close(lora_grads(models[0]), lora_grads(models[1]))


def test_generate_and_off_switch(unit_calls_executor):
    executor = unit_calls_executor
    ref = build_builtin("tiny-llama")
    prompt = ids(1, 6, seed=3)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = ref.generate(prompt, **kw)
    for whole in (True, False):
        virt = virtualize(build_builtin("tiny-llama"), executor.url, whole_mlp=whole)
        with CallCount(executor.url) as count:
            assert torch.equal(virt.generate(prompt, **kw), want)
        assert count.of(MLP) == (10 * LAYERS if whole else 0), count.calls
        assert count.of(GATE_UP) == (0 if whole else 10 * LAYERS) and count.of(QKV) == 10 * LAYERS, count.calls


def test_hooks_and_a_new_activation_call_per_linear(unit_calls_executor):
    """What the block's own forward would run and a whole call would skip: a hook on one of its
    Linears, or an activation other than the one the executor probed."""
    executor = unit_calls_executor
    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), executor.url)
    x = ids(1, 7)
    seen = []
    for m in (ref, virt):
        m.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape) or out * 0)
    with torch.no_grad(), CallCount(executor.url) as count:
        assert torch.equal(virt(x).logits, ref(x).logits)
    assert len(seen) == 2 and count.of(MLP) == LAYERS - 1 and count.of("0.mlp.down_proj") == 1, count.calls
    for m in (ref, virt):
        m.model.layers[1].mlp.act_fn = torch.nn.GELU()
    with torch.no_grad(), CallCount(executor.url) as count:
        assert torch.equal(virt(x).logits, ref(x).logits)
    assert count.of(MLP) == 0, count.calls


def test_compiled_block_is_one_call(executor):
    """While torch.compile traces, the whole call is the custom op: the compiled block makes one
    call forward and one backward (with the input again), with the eager whole call's results;
    with whole-MLP calls off it compiles to per-Linear calls (gate/up fused). Either way the calls
    are custom ops with fake implementations, so dynamo captures the block in one graph."""
    for whole in (True, False):
        virt = virtualize(build_builtin("tiny-llama"), executor.url, whole_mlp=whole)
        mlp = virt.model.layers[1].mlp
        x = torch.randn(3, 5, 64, requires_grad=True)
        compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
        with CallCount(executor.url) as count:
            y = compiled(x)
            (gx,) = torch.autograd.grad(y.square().sum(), x)
        if whole:
            assert count.of(MLP) == 2 and count.total() == 2, count.calls
        else:
            assert count.of(MLP) == 0 and count.of(GATE_UP) == 2 and count.of("down_proj") == 2, count.calls
        x2 = x.detach().clone().requires_grad_(True)
        y2 = mlp(x2)
        (gx2,) = torch.autograd.grad(y2.square().sum(), x2)
        assert torch.equal(y, y2)
        torch.testing.assert_close(gx, gx2, rtol=1e-6, atol=1e-7)


def test_compiled_model_with_whole_calls(unit_calls_executor):
    """A whole compiled model: the unsplit model's logits, and its LoRA gradients, with
    one call per MLP block per pass (an executor without layer spans, which a compiled forward
    uses too: tests/test_layer_span.py)."""
    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), unit_calls_executor.url)
    x = ids(1, 7)
    compiled = torch.compile(virt, backend="aot_eager")
    with torch.no_grad(), CallCount(unit_calls_executor.url) as count:
        torch.testing.assert_close(compiled(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
    assert count.of(MLP) == LAYERS, count.calls
    ref_l, virt_l = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), unit_calls_executor.url)
    ref_l(input_ids=ids(), labels=ids()).loss.backward()
    with CallCount(unit_calls_executor.url) as count:
        torch.compile(virt_l, backend="aot_eager")(input_ids=ids(), labels=ids()).loss.backward()
    assert count.of(MLP) == 2 * LAYERS, count.calls
    assert_grads_close(lora_grads(ref_l), lora_grads(virt_l))


def test_double_backward_through_a_whole_call_raises(executor):
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    x, w = torch.randn(1, 3, 64, requires_grad=True), torch.randn(1, 3, 64, requires_grad=True)
    y = (virt.model.layers[0].mlp(x) * w).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # (g depends on w: a second order exists)
    with pytest.raises(RuntimeError, match="differentiate twice"):  # not silently zero
        g.sum().backward()
