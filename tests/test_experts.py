"""Mixture-of-experts blocks (transformers 5's 3-D expert weights) served one Linear unit per
expert (proto/experts.py, client/experts.py), through a real executor serving the saved checkpoint:
logits bitwise and LoRA gradients against the unsplit model with the eager experts implementation
(what the tenant runs); against transformers' default (grouped_mm: the same products in another
kernel) logits equal to rounding and the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from symbiont import connect, virtualize
from tests.conftest import running_executor
from tests.models import assert_backward_matches, assert_grads_close, ids, lora_grads

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                      decoder_sparse_step=1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


def _build(model_type: str, experts: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SMALL, **CONFIGS[model_type], experts_implementation=experts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_moe_experts_are_served_and_exact(model_type, tmp_path):
    from peft import LoraConfig, get_peft_model

    _build(model_type).save_pretrained(tmp_path)
    with running_executor(str(tmp_path)) as ex:
        conn = connect(ex.url)
        served = [u.id for u in conn.catalog().units if ".experts." in u.id]
        assert "model.layers.0.mlp.experts.gate_up_proj.3" in served and "model.layers.1.mlp.experts.down_proj.0" in served
        ref, virt = _build(model_type, "eager"), virtualize(_build(model_type), conn)
        experts = virt.model.layers[0].mlp.experts
        assert type(experts).__name__.startswith("Virt") and isinstance(experts, type(ref.model.layers[0].mlp.experts))
        assert type(experts.gate_up_proj).__name__ == "RemoteWeight"  # no expert weights on this side
        x = ids(2, 9)
        before = conn.stats()
        with torch.no_grad():
            assert torch.equal(ref(x).logits, virt(x).logits)
        per_unit = {u.unit: u.calls for u in conn.stats().units}
        assert sum(c for u, c in per_unit.items() if ".experts." in u) > sum(
            u.calls for u in before.units if ".experts." in u.unit), "no expert was called"
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1, :5], **kw), virt.generate(x[:1, :5], **kw))
        with torch.no_grad():  # a model built from the executor's skeleton alone: no expert weights anywhere here
            assert torch.equal(conn.model()(x).logits, virt(x).logits)
        default = _build(model_type)  # (grouped_mm)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, default(x).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(default.generate(x[:1, :5], **kw), virt.generate(x[:1, :5], **kw))

        def lora(m):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(2)
                return get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

        models = [lora(ref), lora(virt)]
        for m in models:
            m(input_ids=x, labels=x).loss.backward()
        assert_grads_close(lora_grads(models[0]), lora_grads(models[1]))
        conn.close()


def test_lora_on_the_served_expert_weights(tmp_path):
    """PEFT's all-linear LoRA on Mixtral also adapts the 3-D expert weights (ParamWrapper: W + delta):
    each expert's call plus x delta^T, equal to rounding to the unsplit x (W + delta)^T."""
    from peft import LoraConfig, get_peft_model

    _build("mixtral").save_pretrained(tmp_path)
    with running_executor(str(tmp_path)) as ex:
        def lora(m):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(2)
                return get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))

        ref, virt = lora(_build("mixtral", "eager")), lora(virtualize(_build("mixtral", "eager"), ex.url))
        assert any("experts" in n and "lora_A" in n for n, _ in virt.named_parameters())
        x = ids(2, 9)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        assert_backward_matches(ref, virt, x)


@pytest.mark.parametrize("method", ["lora", "loha"])
@pytest.mark.parametrize("order", ["peft-then-virtualize", "virtualize-then-peft"])
def test_moe_peft_methods_either_side_of_virtualize(tmp_path, method, order):
    """Mixtral with its experts served: LoRA (on attention and the router) and LoHa (on attention:
    PEFT's LoHa takes no router), made before or after virtualize, give the unsplit model's adapter
    gradients."""
    from peft import LoHaConfig, LoraConfig, get_peft_model

    def adapted(m):
        config = (LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate"], init_lora_weights=False) if method == "lora"
                  else LoHaConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(6)
            return get_peft_model(m, config)

    _build("mixtral").save_pretrained(tmp_path)
    with running_executor(str(tmp_path)) as ex:
        ref = adapted(_build("mixtral", "eager"))
        virt = virtualize(adapted(_build("mixtral")), ex.url) if order == "peft-then-virtualize" else adapted(virtualize(_build("mixtral"), ex.url))
        x = ids(2, 9)
        for m in (ref, virt):
            m(input_ids=x, labels=x).loss.backward()
        want = lora_grads(ref)
        assert method != "lora" or any(".gate." in n for n in want), "the router's adapter is trained"
        assert_grads_close(want, lora_grads(virt))
