"""Layer spans (`serve`, on by default; client/layer_span.py): a decoding tenant makes one call per
decoder layer, from its attention output to the next layer's q/k/v, and gets bitwise the unsplit
model's logits and greedy tokens, with LoRA on every attention projection too; a layer whose
span cannot stand for it (gradients recorded, a long prefill, a hook) makes its three calls, exact
as before; a span unit refuses every op but FORWARD with a typed error and the executor carries on."""
from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import torch

from symbiont import connect, virtualize
from symbiont.base_executor.models import build_builtin
from symbiont.client import layer_span
from symbiont.client.errors import InvalidCallError
from symbiont.proto import executor_pb2 as pb
from tests.conftest import running_executor
from tests.models import assert_grads_close, ids, lora_grads

LAYERS = 2  # of every tiny model


class Calls:
    """Calls per unit the executor served inside the `with` block."""

    def __init__(self, url: str):
        self.url = url

    def _now(self) -> collections.Counter:
        return collections.Counter({u.unit: u.calls for u in self.observer.stats().units})

    def __enter__(self):
        self.observer = connect(self.url)  # never attaches: stats only
        self.before = self._now()
        return self

    def __exit__(self, *exc):
        self.by_unit = self._now() - self.before
        self.observer.close()

    def spans(self) -> int:
        return sum(n for u, n in self.by_unit.items() if u.endswith(".span"))


def lora_everywhere(name: str):
    """LoRA on q, k, v and o (S3's adapters): o_proj's delta rides in the span's call."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return get_peft_model(build_builtin(name), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                                                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_one_call_a_layer_and_the_unsplit_logits_and_tokens(name):
    x = ids(2, 9)
    with running_executor(name, "--layer-spans") as ex:
        for make in (lambda: build_builtin(name), lambda: lora_everywhere(name)):
            ref, virt = make(), virtualize(make(), ex.url)
            with Calls(ex.url) as calls, torch.no_grad():
                got = virt(input_ids=x).logits
            assert torch.equal(got, ref(input_ids=x).logits)
            # the embedding, the first layer's q/k/v, a span a layer, the lm_head
            assert calls.spans() == LAYERS and sum(calls.by_unit.values()) == LAYERS + 3, calls.by_unit
            kw = dict(max_new_tokens=5, do_sample=False)
            with Calls(ex.url) as calls:
                assert torch.equal(virt.generate(input_ids=x, **kw), ref.generate(input_ids=x, **kw))
            assert calls.spans() == 5 * LAYERS, calls.by_unit


def test_training_makes_the_layers_calls_and_inference_after_it_is_exact():
    """With gradients recorded a layer makes its own calls (a span keeps nothing for backward):
    the adapter and norm gradients are the unsplit model's; a forward without them after the step
    uses the spans whose norms the step left as they were."""
    x = ids(2, 9)
    with running_executor("tiny-llama", "--layer-spans") as ex:
        ref, virt = lora_everywhere("tiny-llama"), virtualize(lora_everywhere("tiny-llama"), ex.url)
        for m in (ref, virt):  # (a norm a span would compute trains too: its gradient must come back)
            m.base_model.model.model.layers[1].input_layernorm.weight.requires_grad_(True)
        with Calls(ex.url) as calls:
            for m in (ref, virt):
                m(input_ids=x, labels=x).loss.backward()
        assert calls.spans() == 0 and calls.by_unit, calls.by_unit
        assert_grads_close(lora_grads(ref), lora_grads(virt))
        with torch.no_grad():  # (one step of both by the unsplit model's gradients: the same adapters)
            step = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            for m in (ref, virt):
                for n, p in m.named_parameters():
                    if n in step:
                        p.add_(step[n], alpha=-0.1)
            with Calls(ex.url) as calls:
                got = virt(input_ids=x).logits
            assert torch.equal(got, ref(input_ids=x).logits)
        assert calls.spans() == LAYERS  # (the step changed a norm span 0 computes: its call carries it)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_unsplit_gradients(reentrant):
    """Reentrant checkpointing runs each layer's first forward under no_grad: those forwards make
    one span call a layer, the recomputation under grad their own calls; the adapters' gradients
    are the unsplit model's either way."""
    from tests.models import enable_checkpointing

    x = ids(2, 9)
    with running_executor("tiny-llama", "--layer-spans") as ex:
        ref, virt = lora_everywhere("tiny-llama"), virtualize(lora_everywhere("tiny-llama"), ex.url)
        for m in (ref, virt):
            enable_checkpointing(m, reentrant)
        ref(input_ids=x, labels=x).loss.backward()
        with Calls(ex.url) as calls:
            virt(input_ids=x, labels=x).loss.backward()
        assert calls.spans() == (LAYERS if reentrant else 0), calls.by_unit
        assert_grads_close(lora_grads(ref), lora_grads(virt))


def test_a_layer_a_span_cannot_stand_for_makes_its_own_calls():
    """A hook on a layer's post-attention norm (it must run), and a prefill longer than
    SPAN_MAX_TOKENS: those layers call q/k/v, o_proj and the MLP as before, and stay exact."""
    name = "tiny-llama"
    with running_executor(name, "--layer-spans") as ex:
        ref, virt = build_builtin(name), virtualize(build_builtin(name), ex.url)
        seen = []
        virt.model.layers[1].post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        x = ids(1, 7)
        with Calls(ex.url) as calls, torch.no_grad():
            got = virt(input_ids=x).logits
        assert torch.equal(got, ref(input_ids=x).logits) and seen == [(1, 7, 64)]
        assert calls.by_unit["model.layers.0.span"] == 1 and "model.layers.1.span" not in calls.by_unit, calls.by_unit
        assert calls.by_unit["model.layers.1.mlp"] == 1 and calls.by_unit["model.layers.1.self_attn.o_proj"] == 1

        virt = virtualize(build_builtin(name), ex.url)
        x = ids(1, layer_span.SPAN_MAX_TOKENS + 1)
        with Calls(ex.url) as calls, torch.no_grad():
            got = virt(input_ids=x).logits
        assert torch.equal(got, ref(input_ids=x).logits)
        assert calls.spans() == 0, calls.by_unit


def test_hooks_and_wrapped_norms_turn_a_span_off_changed_norms_do_not_and_all_stay_exact():
    """Under torch.inference_mode (whose tensors keep no version counter): an in-place forward
    hook on a layer, an in-place pre-hook on an MLP block, one on o_proj, and a norm PEFT wraps to
    train it (modules_to_save, applied after virtualize): each layer concerned makes its own calls.
    Norms whose weights changed after virtualize (in place, through .data, by
    vector_to_parameters) and a model whose norms are not the served ones keep their spans: the
    calls carry the norms' weights as they are. The logits are the unsplit model's with the same
    change. transformers' output recorders (installed by one output_hidden_states=True) leave the
    spans on."""
    from peft import LoraConfig, get_peft_model

    name, x = "tiny-llama", ids(1, 6)

    def check(ref, virt, spans, **kw):
        with torch.inference_mode():
            want = ref(input_ids=x, **kw).logits
            with Calls(ex.url) as calls:
                got = virt(input_ids=x, **kw).logits
        assert torch.equal(got, want)
        assert calls.spans() == spans, calls.by_unit

    with running_executor(name, "--layer-spans") as ex:
        ref, virt = build_builtin(name), virtualize(build_builtin(name), ex.url)
        check(ref, virt, LAYERS, output_hidden_states=True)
        check(ref, virt, LAYERS)  # (the recorders stay, inert)
        v = torch.linspace(-1, 1, 64)
        for m in (ref, virt):
            m.model.layers[0].register_forward_hook(lambda mod, i, o: o.add_(v))
            m.model.layers[1].mlp.register_forward_pre_hook(lambda mod, a: a[0].mul_(2))
        check(ref, virt, 0)

        ref, virt = build_builtin(name), virtualize(build_builtin(name), ex.url)
        for m in (ref, virt):  # (under a span o_proj gives zeros: its hook would change only the delta)
            m.model.layers[1].self_attn.o_proj.register_forward_hook(lambda mod, i, o: o.mul_(0.5))
        check(ref, virt, 1)

        ref, virt = build_builtin(name), virtualize(build_builtin(name), ex.url)
        check(ref, virt, LAYERS)
        with torch.no_grad():
            for m in (ref, virt):
                m.model.layers[1].input_layernorm.weight.mul_(1.5)  # (span 0 computes it)
        check(ref, virt, LAYERS)
        for m in (ref, virt):  # (no version counter moves: a check of versions would miss these)
            m.model.layers[0].post_attention_layernorm.weight.data.mul_(2)
        check(ref, virt, LAYERS)
        for m in (ref, virt):
            norms = [m.model.layers[i].post_attention_layernorm.weight for i in range(LAYERS)]
            torch.nn.utils.vector_to_parameters(torch.linspace(0.5, 1.5, 64 * LAYERS), norms)
        check(ref, virt, LAYERS)

        changed = build_builtin(name)
        with torch.no_grad():
            changed.model.layers[0].post_attention_layernorm.weight.add_(0.25)
        ref, virt = copy.deepcopy(changed), virtualize(changed, ex.url)
        check(ref, virt, LAYERS)

        ref, virt = build_builtin(name), virtualize(build_builtin(name), ex.url)
        for m in (ref, virt):  # (a forward set on an instance, as kernel libraries patch norms: the layer's own calls)
            norm = m.model.layers[0].post_attention_layernorm
            norm.forward = lambda x, norm=norm: type(norm).forward(norm, x) * 1.25
        check(ref, virt, 1)

        config = lambda: LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],  # noqa: E731
                                    modules_to_save=["post_attention_layernorm"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            ref = get_peft_model(build_builtin(name), config())
            torch.manual_seed(5)
            virt = get_peft_model(virtualize(build_builtin(name), ex.url), config())
        check(ref, virt, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_delta_rides_bit_for_bit(dtype):
    """A span's float32 delta goes as columns of the served dtype and comes back with every bit,
    through the copies a call makes (the input's cat, a copy into a mailbox, the executor's split):
    subnormals, signed zeros, infinities and NaNs with payloads too."""
    from symbiont.proto.layer_span import delta_bits, delta_of, delta_width

    hidden = 64
    d = torch.randn(3, hidden, dtype=torch.float32)
    raw = d.view(torch.int32)
    raw[0, :6] = torch.tensor([1, -2**31, 0x7F800000, 0x7FC00001, 0x7F800001, 0x00000001 | 2**31 - 2**23], dtype=torch.int32)
    raw[1, :hidden] = torch.randint(-2**31, 2**31 - 1, (hidden,), dtype=torch.int32)  # (any bit pattern)
    bits = delta_bits(d, dtype)
    assert bits.dtype == dtype and bits.shape == (3, delta_width(hidden, dtype))
    others = torch.randn(3, 5, dtype=torch.float32).to(dtype)
    x = torch.cat([others, bits, others], dim=-1)
    box = torch.empty_like(x).copy_(x)
    _, carried, _ = box.split([5, bits.shape[1], 5], dim=-1)
    assert torch.equal(delta_of(carried).view(torch.int32), raw)
    for width in (5, 6):  # (one row at an odd place, as an odd hidden width leaves it)
        one = torch.cat([torch.zeros(1, width, dtype=dtype), bits[:1]], dim=-1)[:, width:]
        assert one.storage_offset() == width
        assert torch.equal(delta_of(one).view(torch.int32), raw[:1])


def test_bfloat16_with_a_float32_lora_on_o_proj_is_bitwise():
    """PEFT keeps a bfloat16 model's LoRA weights in float32 and adds their delta to o_proj's output
    before rounding once: the span carries the delta in float32 (its bits in bfloat16 columns) and does the
    same, so the logits and greedy tokens are the unsplit model's bit for bit."""
    from peft import LoraConfig, get_peft_model

    name = "tiny-llama"

    def make():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            model = build_builtin(name, torch.bfloat16)
            with torch.no_grad():  # (norms of the tenant's own, carried by the calls in bfloat16)
                for layer in model.model.layers:
                    for n in (layer.input_layernorm, layer.post_attention_layernorm):
                        n.weight.copy_(1 + 0.5 * torch.randn(n.weight.shape))
            return get_peft_model(model, LoraConfig(
                r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    with running_executor(name, "--layer-spans", "--dtype", "bfloat16") as ex:
        ref, virt = make(), virtualize(make(), ex.url)
        assert ref.base_model.model.model.layers[0].self_attn.o_proj.lora_A["default"].weight.dtype == torch.float32
        x = ids(2, 9)
        with torch.no_grad(), Calls(ex.url) as calls:
            got = virt(input_ids=x).logits
        assert calls.spans() == LAYERS
        with torch.no_grad():
            assert torch.equal(got, ref(input_ids=x).logits)
        kw = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(virt.generate(input_ids=x, **kw), ref.generate(input_ids=x, **kw))


def test_a_span_unit_takes_forward_only_and_the_executor_carries_on():
    with running_executor("tiny-llama", "--layer-spans") as ex:
        conn = connect(ex.url)
        conn.ensure_attached()
        span = next(u for u in conn.catalog().units if u.kind == "span")
        t = conn.transport
        for op, width in ((pb.BACKWARD, span.out_features), (pb.FORWARD_NO_BIAS, span.in_features)):
            with pytest.raises(InvalidCallError, match="FORWARD only"):
                t.call(span.id, op, torch.zeros(2, width), (2, span.in_features if op == pb.BACKWARD else span.out_features),
                       torch.float32, pb.INFERENCE)
        with pytest.raises(InvalidCallError, match="last dimension"):
            t.call(span.id, pb.FORWARD, torch.zeros(2, span.in_features + 1), (2, span.out_features), torch.float32, pb.INFERENCE)
        ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), conn)
        with torch.no_grad():
            assert torch.equal(virt(input_ids=ids(1, 5)).logits, ref(input_ids=ids(1, 5)).logits)
        conn.close()


def test_a_compiled_model_makes_one_call_a_layer_too():
    """torch.compile traces the span's hand-overs (no graph break): a compiled forward makes one
    call a layer and gives the unsplit logits bitwise (aot_eager: the tenant's ops as eager), with
    LoRA on q, k, v and o too; a compiled forward recording gradients makes the layers' own calls
    and gives the unsplit adapter gradients."""
    torch._dynamo.utils.counters.clear()
    with running_executor("tiny-llama", "--layer-spans") as ex:
        for make in (lambda: build_builtin("tiny-llama"), lambda: lora_everywhere("tiny-llama")):
            ref, virt = make(), virtualize(make(), ex.url)
            compiled = torch.compile(virt, backend="aot_eager")
            x = ids(1, 7)
            for _ in range(2):
                with torch.no_grad(), Calls(ex.url) as calls:
                    assert torch.equal(compiled(x).logits, ref(x).logits)
                assert calls.spans() == LAYERS and sum(calls.by_unit.values()) == LAYERS + 3, calls.by_unit
            with torch.no_grad(), Calls(ex.url) as calls:  # (eager again: spans)
                assert torch.equal(virt(x).logits, ref(x).logits)
            assert calls.spans() == LAYERS
        with Calls(ex.url) as calls:
            compiled(input_ids=x, labels=x).loss.backward()
        ref(input_ids=x, labels=x).loss.backward()
        assert calls.spans() == 0 and calls.by_unit
        assert_grads_close(lora_grads(ref), lora_grads(virt))
        assert not torch._dynamo.utils.counters["graph_break"]


def test_threads_sharing_a_model_each_get_their_own_spans():
    """Two threads decode with one virtualized model at once: what a span's parts hand each other
    is the calling thread's, so each gets the unsplit logits."""
    import threading

    with running_executor("tiny-llama", "--layer-spans") as ex:
        ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), ex.url)
        xs = [ids(1, 6, seed=s) for s in (1, 2)]
        with torch.no_grad():
            want = [ref(input_ids=x).logits for x in xs]
        bad, go = [], threading.Barrier(2)

        def work(i):
            go.wait()
            try:
                with torch.no_grad():
                    for _ in range(20):
                        if not torch.equal(virt(input_ids=xs[i]).logits, want[i]):
                            bad.append(i)
            except Exception as e:
                bad.append(repr(e))

        with Calls(ex.url) as calls:
            threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert not bad and calls.spans() == 2 * 20 * LAYERS, (bad, calls.by_unit)


def test_spans_are_served_by_default_and_not_with_no_layer_spans():
    with running_executor("tiny-llama") as ex, connect(ex.url) as conn:
        assert len([u for u in conn.catalog().units if u.kind == "span"]) == LAYERS
    with running_executor("tiny-llama", "--no-layer-spans") as ex, connect(ex.url) as conn:
        assert not [u for u in conn.catalog().units if u.kind == "span"]


def test_a_model_built_from_the_skeleton_serves_spans():
    """connect(url).model() makes one call a layer too; so does a model virtualized on the meta
    device whose norms are loaded after (the calls carry the norms' weights as they are then)."""
    x = ids(1, 7)
    with running_executor("tiny-llama", "--layer-spans") as ex, connect(ex.url) as conn:
        ref = build_builtin("tiny-llama")
        virt = conn.model(attn_implementation="eager")
        with Calls(ex.url) as calls, torch.no_grad():
            got = virt(input_ids=x).logits
        assert calls.spans() == LAYERS, calls.by_unit
        assert torch.equal(got, ref(input_ids=x).logits)
        with torch.device("meta"):
            empty = build_builtin("tiny-llama")
        empty.config._attn_implementation = "eager"
        virtualize(empty, ex.url)
        from safetensors.torch import load

        empty.load_state_dict(load(conn.skeleton().weights), strict=False, assign=True)
        empty.model.rotary_emb.inv_freq = ref.model.rotary_emb.inv_freq.clone()  # (a buffer made on meta)
        empty.model.rotary_emb.original_inv_freq = ref.model.rotary_emb.original_inv_freq.clone()
        with Calls(ex.url) as calls, torch.no_grad():
            assert torch.equal(empty(input_ids=x).logits, got)
        assert calls.spans() == LAYERS, calls.by_unit


def test_the_executor_computes_norms_only_where_its_norm_is_the_modules_bitwise():
    """layer_span.norm (what the executor computes a span's norms with, the tenant's weights one row
    per token) is bitwise each known norm class's forward; a norm computing otherwise fails the
    probe, and a layer with such a norm gets no span."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from symbiont.base_executor.catalog import UnitTable
    from symbiont.proto import layer_span as proto_span

    for dtype in (torch.float32, torch.bfloat16):
        assert proto_span.norm_matches(LlamaRMSNorm(64, eps=1e-5), dtype)

    class Otherwise(LlamaRMSNorm):  # (its weight multiplied in float32: not the same rounding in bfloat16)
        def forward(self, x):
            h = x.float()
            return (self.weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)

    # (a known class's name and forward's name: only the probe tells its forward from the known one)
    Otherwise.__name__ = Otherwise.__qualname__ = "LlamaRMSNorm"
    Otherwise.forward.__qualname__ = "LlamaRMSNorm.forward"
    assert proto_span.own(Otherwise(64), proto_span.NORMS)
    assert not proto_span.norm_matches(Otherwise(64), torch.bfloat16)
    model = build_builtin("tiny-llama", torch.bfloat16)
    table = UnitTable(model)
    before = table.add_spans(model)
    model.model.layers[0].post_attention_layernorm.__class__ = Otherwise
    table = UnitTable(model)
    assert before == LAYERS and table.add_spans(model) == LAYERS - 1


def test_a_fused_span_is_the_eager_span_to_float_rounding():
    """runner.span_fused (a gang's round with `serve --gang-spans fused`; its kernels in Triton's
    interpreter here) computes what _span computes in float32: o bitwise (elementwise ops), the
    rest within float rounding (the norms' sums in another order), the last layer's span (no
    q/k/v) too; a batch whose delta bits do not fall on 4-byte boundaries is _span's, bitwise."""
    from symbiont.base_executor import runner
    from symbiont.base_executor.catalog import SPAN, UnitTable
    from symbiont.proto import executor_pb2 as pb
    from tests.models import span_batch

    for dtype in (torch.float32, torch.bfloat16):
        model = build_builtin("tiny-llama", dtype)
        table = UnitTable(model)
        assert table.add_spans(model) == LAYERS
        for unit in (u for u in table.units.values() if u.kind == SPAN):
            hidden = unit.members[0].out_features
            x = span_batch(unit, 5, dtype)
            want = runner.run(unit, pb.FORWARD, x)
            if dtype == torch.float32:
                got = runner.span_fused(unit, x, False, torch.empty_like(want))
                assert torch.equal(got[:, :hidden], want[:, :hidden]), unit.id
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            else:  # (Triton's interpreter rounds to bfloat16 otherwise than a GPU: tests/test_gpu.py has it)
                odd = torch.empty(x.numel() + 1, dtype=dtype)[1:].view(x.shape)  # (2 bytes off a 4-byte boundary)
                odd.copy_(x)
                assert torch.equal(runner.span_fused(unit, odd, False, torch.empty_like(want)), want), unit.id


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "v_proj"), ("o_proj",),
                                     ("o_proj", "up_proj")])
def test_a_hosted_adapter_rides_in_the_span(targets):
    """A tenant naming a hosted LoRA: the executor adds it inside each span (at o_proj, and at the
    next layer's q/k/v), so a decoding layer still makes one call, and the logits and greedy tokens
    are bitwise those of the same tenant making per-unit calls (an executor without spans), and
    within float32 rounding of the private PEFT model. An adapter of the MLP leaves its layers
    their own calls."""
    from peft import LoraConfig, get_peft_model

    name, x = "tiny-llama", ids(2, 9)

    def private():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            return get_peft_model(build_builtin(name), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                  lora_dropout=0.0, target_modules=list(targets))).eval()

    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = {}
    for flag in ("--layer-spans", "--no-layer-spans"):
        with running_executor(name, flag) as ex, connect(ex.url) as conn:
            conn.host_adapter("mine", private())
            virt = virtualize(build_builtin(name), conn, adapter="mine")
            with Calls(ex.url) as calls, torch.no_grad():
                logits = virt(input_ids=x).logits
            with Calls(ex.url) as decode:
                tokens = virt.generate(input_ids=x, **kw)
            got[flag] = (logits, tokens, calls.spans(), decode.spans())
    (logits, tokens, spans, decode_spans), (unit_logits, unit_tokens, no_spans, _) = got.values()
    assert torch.equal(logits, unit_logits) and torch.equal(tokens, unit_tokens)
    assert no_spans == 0
    assert (spans, decode_spans) == ((0, 0) if "up_proj" in targets else (LAYERS, 5 * LAYERS))
    ref = private()
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(input_ids=x).logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(tokens, ref.generate(input_ids=x, **kw))


def test_a_merged_hosted_adapter_in_spans_gives_the_per_unit_calls_logits():
    """`--merge auto` merges the one busy hosted adapter: with it merged, a decoding forward's spans
    compute with the merged copies of o_proj and q/k/v, bitwise what the per-unit calls give on an
    executor without spans, merged the same way."""
    import time

    from peft import LoraConfig, get_peft_model

    name, x = "tiny-llama", ids(1, 7)

    def private():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(6)
            return get_peft_model(build_builtin(name), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                                                                  target_modules=["q_proj", "v_proj", "o_proj"])).eval()

    got = []
    for flag in ("--layer-spans", "--no-layer-spans"):
        with running_executor(name, flag, "--merge", "auto", "--merge-window-s", "0.3") as ex, connect(ex.url) as conn:
            conn.host_adapter("hot", private())
            virt = virtualize(build_builtin(name), conn, adapter="hot")
            deadline = time.monotonic() + 60
            with torch.no_grad():
                while conn.stats().merged_adapter != "hot":
                    assert time.monotonic() < deadline, f"never merged: {conn.stats()}"
                    virt(input_ids=x)
                with Calls(ex.url) as calls:
                    got.append(virt(input_ids=x).logits)
            assert calls.spans() == (LAYERS if flag == "--layer-spans" else 0), calls.by_unit
            assert conn.stats().merged_adapter == "hot"
    assert torch.equal(got[0], got[1])
    with torch.no_grad():
        torch.testing.assert_close(got[0], private()(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_a_compiled_model_with_graph_breaks_shared_by_threads_stays_exact():
    """An attention that breaks the compiled graph in every layer (here a registered attention
    function calling torch._dynamo.graph_break()): a span's hand-overs never cross from one graph
    to another (each is taken only by the trace that made it), so two threads sharing the compiled
    model, each with its own input, each get the unsplit logits; the layers then make their own
    calls where a hand-over would have crossed."""
    import threading

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa_graph_break", breaking)

    def make(name):
        model = lora_everywhere(name)
        model.base_model.model.config._attn_implementation = "sdpa_graph_break"
        return model

    name = "tiny-llama"
    with running_executor(name, "--layer-spans") as ex:
        ref, virt = make(name), virtualize(make(name), ex.url)
        compiled = torch.compile(virt, backend="aot_eager")
        inputs = [ids(1, 5 + i) for i in range(2)]
        with torch.no_grad():
            want = [ref(input_ids=x).logits for x in inputs]
            for x, w in zip(inputs, want):  # (one thread: traced, then run)
                assert torch.equal(compiled(input_ids=x).logits, w)
        failures = []
        first, together = threading.Lock(), threading.Barrier(2, timeout=120)

        def decode(i):
            try:
                with torch.no_grad():
                    for step in range(6):
                        # (a thread's first call may trace again, for its thread's state: one at a time, the other
                        # thread idle, as dynamo's restarts of a trace must see the state they saw; then at once)
                        with first if step == 0 else contextlib.nullcontext():
                            got = compiled(input_ids=inputs[i]).logits
                        if step == 0:
                            together.wait()
                        if not torch.equal(got, want[i]):
                            failures.append((i, (got - want[i]).abs().max().item()))
            except Exception as e:  # (reported below)
                failures.append((i, repr(e)))
                together.abort()

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures


def test_eager_threads_keep_their_spans_while_another_thread_compiles():
    """torch.compiler.is_compiling() is true in every thread while any thread compiles: threads
    decoding eagerly with one model meanwhile still take their own hand-overs (shim.tracing asks
    whether this thread traces) and get the unsplit logits, with no error."""
    import threading
    import time

    xs = [ids(1, 7 + i) for i in range(2)]
    with running_executor("tiny-llama", "--layer-spans") as ex:
        ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), ex.url)
        with torch.no_grad():
            want = [ref(input_ids=x).logits for x in xs]
        stop, failures, runs = threading.Event(), [], [0, 0]

        def decode(i):
            with torch.no_grad():
                while not stop.is_set():
                    try:
                        got = virt(input_ids=xs[i]).logits
                        if not torch.equal(got, want[i]):
                            failures.append((i, (got - want[i]).abs().max().item()))
                    except Exception as e:  # (reported below)
                        failures.append((i, repr(e)))
                    runs[i] += 1

        def slow_backend(gm, inputs):  # (keeps Dynamo's compile flag up a while)
            time.sleep(0.05)
            return gm

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        with Calls(ex.url) as calls:
            for k in range(30):
                torch.compile(lambda x, k=k: x.cos() * k, backend=slow_backend)(torch.randn(4))
        stop.set()
        for t in threads:
            t.join(60)
        assert not failures, failures[:5]
        assert min(runs) > 0 and calls.spans() > 0, (runs, calls.by_unit)


def test_the_functions_dynamo_takes_as_constants_carry_torchs_mark():
    """shim.constant_in_traces sets the mark torch.compiler.assume_constant_result sets (without
    importing torch._dynamo): if torch changes how it marks, this fails."""
    from symbiont.client import shim

    def probe():
        return 0

    assert vars(torch.compiler.assume_constant_result(probe)) == vars(shim.constant_in_traces(lambda: 0))
    assert getattr(shim.trace_serial, "_dynamo_marked_constant", False)
    # (a marked function may take no module: torch 2.11's Dynamo refuses a module as a constant's argument)
    assert not getattr(layer_span._hooked, "_dynamo_marked_constant", False)
