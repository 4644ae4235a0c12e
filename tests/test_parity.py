"""Parity: a virtualized model computes what the unsplit model computes — logits, greedy
tokens, LoRA gradients — for every architecture, against a real base-executor process."""
from __future__ import annotations

import contextlib

import pytest
import torch

from symbiont.base_executor.models import build_builtin
from symbiont import VirtLayer, connect, virtualize
from tests.models import ARCHS, assert_backward_matches, assert_grads_close, assert_sgd_steps_match, ids, lora_grads, lora_model


@pytest.mark.parametrize("name", ARCHS)
def test_logits_bitwise(executor_for, name):
    ex = executor_for(name)
    ref = build_builtin(name)
    virt = virtualize(build_builtin(name), ex.url)
    assert sum(isinstance(m, VirtLayer) for m in virt.modules()) >= 8
    x = ids(2, 17)
    with torch.no_grad():
        a, b = ref(x).logits, virt(x).logits
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_generate_identical(executor_for, name):
    ex = executor_for(name)
    ref = build_builtin(name)
    virt = virtualize(build_builtin(name), ex.url)
    prompt = ids(1, 6, seed=3)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    a = ref.generate(prompt, **kw)
    b = virt.generate(prompt, **kw)
    assert a.shape[1] == 6 + 12
    assert torch.equal(a, b)


@pytest.mark.parametrize("step_graphs", [True, "compiled"])
def test_step_graphs_leave_a_cpu_tenants_decoding_as_it_was(executor, step_graphs):
    """virtualize(step_graphs=True or "compiled") on a tenant whose tensors are on the CPU: its forward keeps the
    model's signature (generate reads it: logits_to_keep, the mask it builds), every step runs
    eagerly (no CUDA graph off a GPU), and greedy decoding with a static cache gives the unsplit
    model's tokens."""
    import inspect

    ref = build_builtin("tiny-llama")
    plain = build_builtin("tiny-llama")
    virt = virtualize(build_builtin("tiny-llama"), executor.url, step_graphs=step_graphs)
    steps = virt.forward
    assert inspect.signature(steps) == inspect.signature(plain.forward)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True)
    for prompt in (ids(1, 6, seed=3), ids(1, 9, seed=4)):
        assert torch.equal(virt.generate(prompt, **kw), ref.generate(prompt, **kw))
    assert steps.captures == 0 and steps.replays == 0 and not steps.failures


def test_a_compiled_prefill_gives_the_unsplit_models_tokens(executor):
    """StepGraphs.compiled_prefill (step_graphs="compiled"): a prefill into a static cache runs
    through the compiled forward (one compile a prompt length; the decoding steps of a CPU tenant
    stay eager), and greedy decoding gives the unsplit LoRA model's tokens; off, nothing compiles."""
    from torch._dynamo.utils import counters

    from symbiont.client.step_graphs import _graphs_compiled

    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True)
    for on in (False, True):
        torch._dynamo.reset()
        counters.clear()
        virt = virtualize(lora_model("tiny-llama"), executor.url, step_graphs="compiled")
        steps = virt.get_base_model().forward
        steps.compiled_prefill = on
        compiled = []
        for seed in (5, 6):  # (the second prompt of the same length compiles nothing more)
            prompt = ids(1, 7, seed=seed)
            assert torch.equal(virt.generate(prompt, **kw), lora_model("tiny-llama").generate(prompt, **kw))
            compiled.append(_graphs_compiled())
        assert compiled == ([1, 1] if on else [0, 0]), (on, compiled, dict(counters["graph_break"]))
        assert steps.replays == 0


def test_a_compiled_steps_run_before_its_capture_leaves_the_caches_length():
    """step_graphs="compiled" runs a step once before capturing it (client/step_graphs.py): the
    static cache's length (StaticLayer.cumulative_length, which every update advances) is what it
    was before, or the replays would write one position further on."""
    from transformers import LlamaConfig, StaticCache

    from symbiont.client.step_graphs import _cache_state_kept

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=128, vocab_size=256)
    cache = StaticCache(config=config, max_cache_len=8)
    kv = torch.randn(1, 2, 3, 16)
    for layer in range(2):
        cache.update(kv, kv, layer)
    lengths = [t.clone() for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor) and t.numel() == 1]
    assert lengths
    with _cache_state_kept(cache):
        cache.update(kv[:, :, :1], kv[:, :, :1], 0)
        assert cache.get_seq_length(0) == 4
    assert cache.get_seq_length(0) == 3 and torch.equal(cache.layers[0].keys[:, :, :3], kv)


def test_small_linears_are_the_linears_to_float_rounding():
    """A compiled step traces the tenant's linears of few rows as products summed in float32
    (client/step_graphs.py _SmallLinears, only while dynamo traces): the linear's values to float
    rounding (float32; a bfloat16 result rounded once from float32, as the GEMM's), with and without
    a bias, positional or by keyword; a linear of more rows, or run eagerly, is F.linear's own."""
    import torch.nn.functional as F

    from symbiont.client.step_graphs import SMALL_ROWS, _SmallLinears

    def traced(*args, **kwargs):
        torch._dynamo.reset()
        with _SmallLinears():
            return torch.compile(lambda *a, **k: F.linear(*a, **k), backend="aot_eager", fullgraph=True)(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        w, b = torch.randn(24, 64, generator=g).to(dtype), torch.randn(24, generator=g).to(dtype)
        for x in (torch.randn(1, 1, 64, generator=g).to(dtype), torch.randn(3, 64, generator=g).to(dtype)):
            want = F.linear(x.float(), w.float(), b.float()).to(dtype)
            for got in (traced(x, w, b), traced(x, weight=w, bias=b), traced(input=x, weight=w, bias=b)):
                assert got.dtype == dtype and got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # (float64: the reduction's order tells it from F.linear's own GEMM)
    w64 = torch.randn(24, 64, generator=g, dtype=torch.float64)
    few, many = (torch.randn(n, 64, generator=g, dtype=torch.float64) for n in (SMALL_ROWS, SMALL_ROWS + 1))
    assert not torch.equal(traced(few, w64), F.linear(few, w64)) and torch.equal(traced(many, w64), F.linear(many, w64))
    with _SmallLinears():
        eager = F.linear(few, w64)
    assert torch.equal(eager, F.linear(few, w64))  # (run eagerly: F.linear's own)


def test_a_compiled_step_traces_its_lora_as_reductions_in_one_graph(executor):
    """What step_graphs="compiled" compiles, on the CPU (the capture itself needs a GPU): a
    virtualized LoRA model's forward at decoding steps, traced under _SmallLinears, is one graph
    for every step (no graph break, no second compile) with no F.linear left (its LoRA's A and B
    are reductions; its base layers are executor calls); traced without the mode it keeps them;
    greedy tokens are the unsplit model's."""
    import inspect

    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from symbiont.client.step_graphs import _SmallLinears

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.target is F.linear))
        return gm.forward

    for mode in (_SmallLinears, contextlib.nullcontext):
        torch._dynamo.reset()
        counters.clear()
        graphs.clear()
        virt = virtualize(lora_model("tiny-llama"), executor.url)
        root = virt.get_base_model()
        forward, compiled = root.forward, torch.compile(root.forward, backend=backend)

        def steps(*args, _forward=forward, _compiled=compiled, _mode=mode, **kwargs):
            if kwargs["input_ids"].shape[1] != 1:
                return _forward(*args, **kwargs)
            with _mode():
                return _compiled(*args, **kwargs)

        steps.__signature__ = inspect.signature(forward)
        root.forward = steps
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True)
        prompt = ids(1, 7, seed=5)
        assert torch.equal(virt.generate(prompt, **kw), lora_model("tiny-llama").generate(prompt, **kw))
        assert len(graphs) == 1 and not counters["graph_break"], (graphs, dict(counters["graph_break"]))
        assert (graphs[0] == 0) == (mode is _SmallLinears), graphs


def test_fused_handovers_copy_and_write_their_words():
    """client/transports/graph_words.py's put and take in Triton's interpreter (no PTX: their
    fences run on a GPU only; tests/test_gpu.py decodes with them): put copies a call's input, odd
    word counts and more than one block of them, and writes its number to the word; take waits for
    its number, then copies the result; words() picks what they may copy."""
    from symbiont.client.transports import graph_words

    page = torch.zeros(8, dtype=torch.int32)
    for n in (1, 5, 4096, 9000):
        src, dst = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        graph_words.put(page, 3, n, dst, src)
        assert torch.equal(dst, src) and page[3] == n and page.count_nonzero() == 1
        back = torch.zeros(n, dtype=torch.int32)
        graph_words.take(page, 3, n, back, dst)
        assert torch.equal(back, src)
    half = torch.randn(6, 10).to(torch.bfloat16)
    assert torch.equal(graph_words.words(half).view(torch.bfloat16).view(6, 10), half)
    assert graph_words.words(half[:, :5]) is None and graph_words.words(torch.zeros(3, dtype=torch.bfloat16)) is None
    assert graph_words.words(torch.zeros(graph_words.MAX_FUSED_BYTES // 4 + 1, dtype=torch.int32)) is None


def test_a_compiled_training_steps_calls_are_training_calls(executor):
    """A compiled training step (torch.compile over a LoRA tenant: its forward runs with grad off and
    inputs that require none) still makes training calls, forward and backward, as the trace saw
    it (unit_call's `training`); a compiled forward under no_grad makes inference calls. The LoRA
    gradients are the unsplit model's."""
    from symbiont.proto import executor_pb2 as pb

    ref, virt = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), executor.url)
    compiled = torch.compile(virt, backend="aot_eager")
    x = ids(2, 9)

    def calls() -> dict:
        with connect(executor.url) as conn:
            return {c.latency: c.calls for c in conn.stats().classes}

    before = calls()
    compiled(input_ids=x, labels=x).loss.backward()
    ref(input_ids=x, labels=x).loss.backward()
    after = calls()
    assert after[pb.INFERENCE] == before[pb.INFERENCE] and after[pb.TRAINING] > before[pb.TRAINING], (before, after)
    for (n, a), (_, b) in zip(lora_grads(ref).items(), lora_grads(virt).items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)
    with torch.no_grad():
        compiled(input_ids=x)
    assert calls()[pb.INFERENCE] > after[pb.INFERENCE]


def test_step_graphs_takes_only_its_three_values(executor):
    with pytest.raises(ValueError, match="step_graphs must be False, True or 'compiled'"):
        virtualize(build_builtin("tiny-llama"), executor.url, step_graphs="yes")


@pytest.mark.parametrize("order", ["after_peft", "before_peft"])
@pytest.mark.parametrize("name", ARCHS)
def test_lora_gradients_match(executor_for, name, order):
    ex = executor_for(name)
    ref = lora_model(name)
    if order == "after_peft":
        virt = virtualize(lora_model(name), ex.url)
    else:
        virt = lora_model(name, base=virtualize(build_builtin(name), ex.url))
    assert_sgd_steps_match(ref, virt, ids(2, 10, seed=5))  # (the second step checks gradients after an update)


def test_training_after_a_first_pass_under_inference_mode(executor):
    """A tenant whose first calls run under torch.inference_mode() (its mailbox and the views of it
    made there) trains afterwards: the views are never inference tensors."""
    ref, virt = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), executor.url)
    x = ids(2, 9)
    with torch.inference_mode():
        got = virt(x).logits
    with torch.no_grad():
        assert torch.equal(got, ref(x).logits)
    assert_backward_matches(ref, virt, x)


@pytest.mark.parametrize("fuse", [True, False])
def test_a_deep_copy_is_a_model_of_its_own(executor, fuse):
    """copy.deepcopy of a virtualized LoRA model (a reference model, an EMA copy): it computes the
    same, its adapters train apart from the original's, and it goes on when the original is gone."""
    import copy
    import gc

    ref = lora_model("tiny-llama")
    virt = virtualize(lora_model("tiny-llama"), executor.url, fuse=fuse)
    twin = copy.deepcopy(virt)
    assert all(isinstance(p, torch.nn.Parameter) for p in twin.parameters())  # (placeholders too)
    x = ids(2, 9)
    with torch.no_grad():
        assert torch.equal(twin(x).logits, ref(x).logits) and torch.equal(virt(x).logits, ref(x).logits)
    twin(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is None for p in virt.parameters()) and all(g.abs().sum() > 0 for g in lora_grads(twin).values())
    del virt
    gc.collect()
    twin.zero_grad(set_to_none=True)
    assert_backward_matches(ref, twin, x)
    with torch.no_grad():  # (a copy of the copy: its shims know the copy as their whole model)
        assert torch.equal(copy.deepcopy(twin)(x).logits, twin(x).logits)


@pytest.mark.parametrize("saved", ["lm_head", "mlp"])
def test_modules_to_save_after_virtualize_is_refused_clearly(executor, saved):
    """PEFT's modules_to_save copies a module to train the copy: after virtualize a copy of a served
    module, or of one holding served modules, would hold no weights (its gradients silently None),
    so copying part of a virtualized model without the whole raises, naming the order that works
    (get_peft_model first: test_other_peft_methods_after_get_peft_model)."""
    import peft

    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=[saved])
    with pytest.raises(RuntimeError, match="get_peft_model before virtualize"):
        peft.get_peft_model(virt, config)


def test_skeleton_model_matches(executor_for):
    """connect().model() builds the tenant's model from the executor alone."""
    ex = executor_for("tiny-llama")
    with connect(ex.url) as conn:
        virt = conn.model(attn_implementation="eager")
        ref = build_builtin("tiny-llama")
        x = ids(2, 9)
        with torch.no_grad():
            assert torch.equal(ref(x).logits, virt(x).logits)
        assert all(p.device.type != "meta" for p in virt.parameters())
        assert conn.tokenizer() is None  # random built-ins ship no tokenizer


def test_placeholder_weight_refuses_reads(executor):
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    w = virt.model.layers[0].mlp.up_proj.weight
    assert w.shape == (128, 64) and w.dtype == torch.float32 and isinstance(w, torch.nn.Parameter)
    with pytest.raises(RuntimeError, match="served by the base executor"):
        w.sum()
    with pytest.raises(RuntimeError, match="served by the base executor"):
        torch.save(virt.state_dict(), "/dev/null")


def test_shim_is_instance_of_replaced_class(executor_for):
    from transformers.pytorch_utils import Conv1D

    virt = virtualize(build_builtin("tiny-gpt2"), executor_for("tiny-gpt2").url)
    attn = virt.transformer.h[0].attn.c_attn
    assert isinstance(attn, Conv1D) and isinstance(attn, VirtLayer)
    assert attn.unwrap()["unit"] == "transformer.h.0.attn.c_attn"
    assert isinstance(virt.transformer.wte, torch.nn.Embedding)


def test_model_to_moves_placeholders_but_not_dtype(executor):
    virt = virtualize(build_builtin("tiny-llama"), executor.url)
    virt.to("cpu")
    virt.to(torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="served by the base executor"):
        virt.to(torch.float16)


def _seeded_peft(base, config):
    """get_peft_model(base, config) with adapter weights drawn from seed 1 (both sides alike)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(base, config)


def _peft(base, method: str):
    import peft

    qv = ["q_proj", "v_proj"]
    config = {
        "prompt": lambda: peft.PromptTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4),
        "prefix": lambda: peft.PrefixTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4),
        "lora+modules_to_save": lambda: peft.LoraConfig(r=4, target_modules=qv, modules_to_save=["lm_head"], init_lora_weights=False),
        "rslora": lambda: peft.LoraConfig(r=4, use_rslora=True, target_modules=qv, init_lora_weights=False),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=qv, init_weights=False),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=qv, init_weights=False),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=qv, init_weights=False),
        # BOFT reads its base layer's `bias`: None for a Linear without one, on the shim too
        "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=qv, init_weights=False),
        "ia3": lambda: peft.IA3Config(target_modules=[*qv, "down_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=["q_proj"], init_weights=False),
        "adalora": lambda: peft.AdaLoraConfig(r=4, target_modules=qv, init_lora_weights=False, total_step=10),
        "fourierft": lambda: peft.FourierFTConfig(n_frequency=16, target_modules=qv, init_weights=False),
    }[method]()
    return _seeded_peft(base, config)


@pytest.mark.parametrize("method", ["prompt", "prefix", "lora+modules_to_save", "rslora", "loha", "lokr", "oft", "boft",
                                    "ia3", "vera", "adalora", "fourierft"])
def test_other_peft_methods_after_get_peft_model(executor, method):
    """PEFT methods that only call their base layers: logits bitwise and adapter gradients match."""
    ref = _peft(build_builtin("tiny-llama"), method)
    virt = virtualize(_peft(build_builtin("tiny-llama"), method), executor.url)
    assert any(isinstance(m, VirtLayer) for m in virt.modules())
    x = ids(2, 7, seed=9)
    assert_backward_matches(ref, virt, x)
    with torch.no_grad():
        assert torch.equal(ref(input_ids=x).logits, virt(input_ids=x).logits)


def _dora(base, dropout: float = 0.0):
    from peft import LoraConfig

    config = LoraConfig(r=4, use_dora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=dropout)
    return _seeded_peft(base, config)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("order", ["after_peft", "before_peft"])
def test_dora_gets_its_norms_from_the_executor(executor, order, dropout):
    """DoRA's column norms of W + s BA come from the executor (its rows' norms, and <W_j, (BA)_j>
    through FORWARD_NO_BIAS calls): magnitudes, adapter gradients and logits as the unsplit
    model's within float32 rounding (the norm is computed expanded, not bitwise); with the
    adapter's dropout too (the base output of the dropped-out input is a call)."""
    ref = _dora(build_builtin("tiny-llama"), dropout)
    if order == "after_peft":
        virt = virtualize(_dora(build_builtin("tiny-llama"), dropout), executor.url)
    else:
        virt = _dora(virtualize(build_builtin("tiny-llama"), executor.url), dropout)
    got = dict(virt.named_parameters())
    magnitudes = [(n, p) for n, p in ref.named_parameters() if "lora_magnitude_vector" in n]
    assert magnitudes
    for name, p in magnitudes:
        torch.testing.assert_close(got[name], p, rtol=1e-6, atol=1e-6, msg=name)
    x = ids(2, 7, seed=4)
    for m in (ref, virt):
        torch.manual_seed(5)  # (the same dropout masks on both)
        m(input_ids=x, labels=x).loss.backward()
    assert_grads_close(lora_grads(ref), lora_grads(virt))
    with torch.no_grad():
        torch.testing.assert_close(virt.eval()(input_ids=x).logits, ref.eval()(input_ids=x).logits, rtol=1e-5, atol=1e-6)


def test_dora_on_a_unit_with_a_bias_is_refused_by_name(executor_for):
    """Qwen2's q/k/v have biases, whose values DoRA would need: a typed error naming the unit."""
    from symbiont.errors import ModelMismatchError

    virt = virtualize(build_builtin("tiny-qwen2"), executor_for("tiny-qwen2").url)
    with pytest.raises(ModelMismatchError, match=r"DoRA on 'model\.layers\.0\.self_attn\.q_proj', which has a bias"):
        _dora(virt)


def _tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OPTForCausalLM(config).eval()


def test_modules_with_a_forward_of_their_own(tmp_path):
    """OPT's learned positional embedding is an nn.Embedding subclass whose forward adds an offset
    to the positions: its own forward runs in the tenant and its F.embedding becomes the call.
    Logits bitwise, greedy tokens identical, LoRA gradients as the unsplit model's."""
    from peft import LoraConfig

    from tests.conftest import running_executor

    _tiny_opt().save_pretrained(tmp_path)
    with running_executor(str(tmp_path)) as ex:
        ref, virt = _tiny_opt(), virtualize(_tiny_opt(), ex.url)
        assert type(virt.model.decoder.embed_positions).__name__ == "VirtOPTLearnedPositionalEmbedding"
        x = ids(2, 9)
        with torch.no_grad():
            assert torch.equal(ref(x).logits, virt(x).logits)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=1)
        assert torch.equal(ref.generate(x[:1, :5], **kw), virt.generate(x[:1, :5], **kw))
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        models = [_seeded_peft(m, config) for m in (ref, virt)]
        for m in models:
            m(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(models[0]), lora_grads(models[1]))


class _ClampedLinear(torch.nn.Linear):
    """A Linear with a forward of its own: it clamps its input, then F.linear of its weight."""

    def forward(self, x):
        return torch.nn.functional.linear(x.clamp(-0.5, 0.5), self.weight, self.bias) * 2


class _MatmulLinear(torch.nn.Linear):
    """A Linear whose forward is x @ W^T (Falcon's): the matmul becomes the call."""

    def forward(self, x):
        return x @ self.weight.T


class _ReadingLinear(torch.nn.Linear):
    """A Linear whose forward computes with its weight's values: nothing symbiont can call."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * 2)


def _with_own_linear(cls):
    model = build_builtin("tiny-llama")
    old = model.model.layers[0].mlp.down_proj
    new = cls(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    model.model.layers[0].mlp.down_proj = new
    return model


@pytest.mark.parametrize("cls", [_ClampedLinear, _MatmulLinear])
def test_a_linear_subclass_runs_its_own_forward_around_the_call(executor, cls):
    """Its block then runs its own forward (no whole-MLP call); logits bitwise, LoRA gradients."""
    ref = lora_model("tiny-llama", base=_with_own_linear(cls))
    virt = virtualize(lora_model("tiny-llama", base=_with_own_linear(cls)), executor.url)
    x = ids(2, 7, seed=3)
    with torch.no_grad():
        assert torch.equal(ref(x).logits, virt(x).logits)
    assert_backward_matches(ref, virt, x)


class _IndexedEmbedding(torch.nn.Embedding):
    """An Embedding whose forward indexes its weight (Whisper's positions: weight[a:b], weight[ids])."""

    def forward(self, ids):
        return self.weight[ids] + self.weight[2 : 2 + ids.shape[-1]]


def _with_indexed_embedding():
    model = build_builtin("tiny-llama")
    old = model.model.embed_tokens
    new = _IndexedEmbedding(old.num_embeddings, old.embedding_dim)
    new.weight = old.weight
    model.model.embed_tokens = new
    return model


def test_an_embedding_that_indexes_its_weight(executor_for, tmp_path):
    """weight[ids] and weight[a:b] in an Embedding's own forward are lookups by the executor."""
    from tests.conftest import running_executor

    _with_indexed_embedding().save_pretrained(tmp_path)
    with running_executor(str(tmp_path)) as ex:
        ref, virt = _with_indexed_embedding(), virtualize(_with_indexed_embedding(), ex.url)
        assert type(virt.model.embed_tokens).__name__ == "Virt_IndexedEmbedding"
        x = ids(2, 9)
        with torch.no_grad():
            assert torch.equal(ref(x).logits, virt(x).logits)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1, :5], **kw), virt.generate(x[:1, :5], **kw))


def test_a_peft_method_that_reads_the_frozen_weight_is_refused_by_name(executor):
    """HRA multiplies the frozen weight by its reflections: the error names the method and the unit."""
    import peft

    virt = _seeded_peft(virtualize(build_builtin("tiny-llama"), executor.url),
                        peft.HRAConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(RuntimeError, match=r"'model\.layers\.0\.self_attn\.q_proj' is served .* PEFT's HRA \(HRALinear\) computes with "
                       r"the frozen weight's values"):
        virt(ids(1, 5))


def test_a_forward_that_reads_the_weight_says_which_unit(executor):
    virt = virtualize(_with_own_linear(_ReadingLinear), executor.url)
    with pytest.raises(RuntimeError, match=r"'model\.layers\.0\.mlp\.down_proj' is served by the base executor"):
        virt(ids(2, 7))


def test_long_error_message_is_a_typed_error_not_a_detach(executor):
    """A status that echoes a long tenant-supplied unit id must still fit its ring slot."""
    from symbiont import UnknownUnitError
    from symbiont.proto import executor_pb2 as pb

    with connect(executor.url) as conn:
        conn.ensure_attached()
        with pytest.raises(UnknownUnitError):
            conn.transport.call("x" * 400, pb.FORWARD, torch.randn(1, 64), (1, 64), torch.float32, pb.TRAINING)
        virt = virtualize(build_builtin("tiny-llama"), conn)  # the same tenant is still attached and served
        with torch.no_grad():
            assert torch.equal(virt(ids(1, 5)).logits, build_builtin("tiny-llama")(ids(1, 5)).logits)


def test_calls_bigger_than_split_bytes_go_in_chunks_of_rows():
    """A call that needs more mailbox than the tenant has and more than `split_bytes` is made as
    calls of as many rows as fit, its results put together in one output: the same logits and
    adapter gradients as the unsplit model, and the mailbox never grows (without splitting, it
    grows to the whole call)."""
    from tests.conftest import running_executor

    x = ids(2, 600, seed=4)  # logits of 1200 tokens x 256 x 4 bytes: more than the 1 MiB mailbox
    ref = lora_model("tiny-llama")
    ref(input_ids=x, labels=x).loss.backward()
    with torch.no_grad():
        want = ref(input_ids=x).logits
    with running_executor("tiny-llama", "--mailbox-mb", "1") as ex:
        for split in (256 << 10, 0):
            with connect(ex.url) as conn:
                conn.transport.split_bytes = split
                virt = virtualize(lora_model("tiny-llama"), conn)
                virt(input_ids=x, labels=x).loss.backward()
                assert_grads_close(lora_grads(ref), lora_grads(virt))
                with torch.no_grad():
                    got = virt(input_ids=x).logits
                assert torch.equal(want, got), f"split {split}: max |diff| {(want - got).abs().max().item():.3e}"
                grew = conn.transport._data_bytes > 1 << 20
                assert grew == (split == 0), (split, conn.transport._data_bytes)


@pytest.mark.parametrize("method", ["lora", "loha"])
@pytest.mark.parametrize("order", ["peft-then-virtualize", "virtualize-then-peft"])
def test_modules_with_a_forward_of_their_own_under_peft_either_side(tmp_path, method, order):
    """OPT (its positions an Embedding with a forward of its own) with LoRA or LoHa made before or
    after virtualize: the unsplit model's adapter gradients."""
    from peft import LoHaConfig, LoraConfig

    from tests.conftest import running_executor

    config = (LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False) if method == "lora"
              else LoHaConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False))
    _tiny_opt().save_pretrained(tmp_path)
    with running_executor(str(tmp_path)) as ex:
        ref = _seeded_peft(_tiny_opt(), config)
        virt = (virtualize(_seeded_peft(_tiny_opt(), config), ex.url) if order == "peft-then-virtualize"
                else _seeded_peft(virtualize(_tiny_opt(), ex.url), config))
        x = ids(2, 9)
        assert_backward_matches(ref, virt, x)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"])
def test_generate_with_attention_masks_identical(executor_for, name):
    # a full mask (every position a token) and a left-padded batch: the same tokens and scores
    ex = executor_for(name)
    ref = build_builtin(name)
    virt = virtualize(build_builtin(name), ex.url)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    full = ids(2, 7, seed=4)
    padded = full.clone()
    mask = torch.ones_like(padded)
    padded[0, :3], mask[0, :3] = 0, 0
    for prompt, m in ((full, torch.ones_like(full)), (padded, mask)):
        a = ref.generate(prompt, attention_mask=m, **kw)
        b = virt.generate(prompt, attention_mask=m, **kw)
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def test_a_decoding_steps_full_mask_goes_as_none(executor):
    # a decoding step's full 2-D mask reaches the model's layers as None (its .all() made as the
    # forward starts, not after the embedding call), with logits bitwise the unsplit model's; a
    # prefill's, a padded step's, a packed one without a cache and eager attention's stay as given
    from transformers import DynamicCache

    ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), executor.url)
    virt.config._attn_implementation = ref.config._attn_implementation = "sdpa"  # (the built-ins' is eager)
    seen = []
    virt.model.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("attention_mask")), with_kwargs=True)
    x, nxt = ids(2, 5, seed=6), ids(2, 1, seed=7)
    padded = torch.ones(2, 6, dtype=torch.long)
    padded[0, 0] = 0
    with torch.no_grad():
        for step_mask in (torch.ones(2, 6, dtype=torch.long), padded):
            outs = []
            for m in (ref, virt):
                cache = DynamicCache(config=m.config)
                m(x, attention_mask=step_mask[:, :5], past_key_values=cache, use_cache=True)
                outs.append(m(nxt, attention_mask=step_mask, past_key_values=cache, use_cache=True).logits)
            assert torch.equal(*outs)
        assert seen[0] is not None and seen[1] is None and seen[2] is not None and seen[3] is not None
        packed = torch.tensor([[0, 1, 2, 0, 1]] * 2)  # (two sequences a row: transformers reads them from position_ids without a mask)
        a = ref(x, attention_mask=torch.ones_like(x), position_ids=packed, use_cache=False).logits
        assert torch.equal(a, virt(x, attention_mask=torch.ones_like(x), position_ids=packed, use_cache=False).logits)
        assert seen[-1] is not None
        virt.config._attn_implementation = ref.config._attn_implementation = "eager"
        for m in (ref, virt):
            cache = DynamicCache(config=m.config)
            m(x, attention_mask=torch.ones_like(x), past_key_values=cache, use_cache=True)
            outs.append(m(nxt, attention_mask=torch.ones(2, 6, dtype=torch.long), past_key_values=cache, use_cache=True).logits)
        assert torch.equal(outs[-2], outs[-1]) and seen[-1] is not None
