"""Vision-language models (issue 22): a LLaVA-style model (CLIP vision tower, projector, Llama)
built from a tiny config, saved and served by a real executor. The vision tower's and the
projector's Linears are served like the language model's, and its patch convolution (as a Linear
over patches, proto/patches.py); what stays with the tenant is its norms and attention. Against the
unsplit model with images: logits (within 1e-5: the patch GEMM), greedy `generate`, LoRA and LoHa
gradients on the language and the vision side, the adapter made before or after virtualize; and a
tenant's model built from the executor's skeleton alone."""
from __future__ import annotations

import pytest
import torch

from symbiont import connect, virtualize
from symbiont.client.shim import VirtLayer
from tests.conftest import REPO, running_executor
from tests.models import assert_grads_close, lora_grads

IMAGE_TOKEN, PATCHES = 250, 16  # a 32 x 32 image in 8 x 8 patches


def llava_config():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                              patch_size=8, projection_dim=32)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-1)


def inputs(batch: int = 2, text: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.ones(batch, 1, dtype=torch.long), torch.full((batch, PATCHES), IMAGE_TOKEN),
                     torch.randint(3, 240, (batch, text), generator=g)], 1)
    return ids, torch.randn(batch, 3, 32, 32, generator=g)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    d = tmp_path_factory.mktemp("llava")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(llava_config()).save_pretrained(d)
    load = lambda: AutoModelForImageTextToText.from_pretrained(d).float().eval()  # noqa: E731
    with running_executor(str(d)) as ex:
        yield ex, load


def test_llava_with_images_is_exact(llava):
    ex, load = llava
    ref, virt = load(), virtualize(load(), ex.url)
    served = {n for n, m in virt.named_modules() if isinstance(m, VirtLayer)}
    assert any(n.startswith("model.vision_tower.") and n.endswith("q_proj") for n in served), "the vision tower's Linears are served"
    assert any(n.startswith("model.multi_modal_projector.") for n in served), "the projector is served"
    assert "model.vision_tower.embeddings.patch_embedding" in served, "the patch convolution is served (as a Linear over patches)"
    ids, pixels = inputs()
    with torch.no_grad():  # (the patch convolution's sums are a GEMM's at the executor: equal to float rounding)
        torch.testing.assert_close(virt(input_ids=ids, pixel_values=pixels).logits, ref(input_ids=ids, pixel_values=pixels).logits,
                                   rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(virt.generate(input_ids=ids[:1], pixel_values=pixels[:1], **kw),
                       ref.generate(input_ids=ids[:1], pixel_values=pixels[:1], **kw))


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], r".*vision_tower.*(q_proj|v_proj|fc1)", r".*multi_modal_projector\.linear_\d"],
                         ids=["language-and-vision-attention", "vision-only", "projector"])
def test_llava_lora_gradients(llava, targets):
    from peft import LoraConfig, get_peft_model

    ex, load = llava

    def adapted(model):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            return get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))

    ref, virt = adapted(load()), virtualize(adapted(load()), ex.url)
    ids, pixels = inputs(seed=1)
    for m in (ref, virt):
        m(input_ids=ids, pixel_values=pixels, labels=ids).loss.backward()
    want = lora_grads(ref)
    assert any("vision_tower" in n for n in want) and any("language_model" in n for n in want) if isinstance(targets, list) \
        else want and all(("vision_tower" in n or "projector" in n) for n in want)
    assert_grads_close(want, lora_grads(virt))


def test_a_vlm_tenant_built_from_the_skeleton(llava):
    ex, load = llava
    ref = load()
    with connect(ex.url) as conn:
        virt = conn.model(device="cpu")
        assert type(virt).__name__ == "LlavaForConditionalGeneration"
        ids, pixels = inputs(batch=1, seed=2)
        with torch.no_grad():
            torch.testing.assert_close(virt(input_ids=ids, pixel_values=pixels).logits,
                                       ref(input_ids=ids, pixel_values=pixels).logits, rtol=1e-5, atol=1e-5)


def test_the_vision_head_example_learns_its_task():
    """examples/vision_head.py end to end: its own executor, a head and a vision LoRA trained through
    it; the held-out accuracy is well above chance (25%)."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "examples/vision_head.py", "--steps", "150"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    accuracy = int(re.search(r"held-out accuracy of the head: (\d+)%", out.stdout).group(1))
    assert accuracy >= 60, out.stdout[-1500:]


@pytest.mark.parametrize("conv, shape", [
    (lambda: torch.nn.Conv2d(3, 8, 4, stride=4), (2, 3, 16, 18)),  # (18: the last two columns fall outside every patch)
    (lambda: torch.nn.Conv2d(3, 8, (2, 4), stride=(2, 4), bias=False, padding="valid"), (3, 8, 8)),  # unbatched
    (lambda: torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=False), (5, 3, 2, 4, 4)),  # Qwen2-VL's layout
    (lambda: torch.nn.Conv1d(2, 6, 3, stride=3), (4, 2, 12)),
])
def test_a_patch_convolution_is_a_linear_over_its_patches(conv, shape):
    """proto/patches.py, what the executor and a tenant compute for a patch embedding: the patches
    through the flattened weight equal the convolution, forward and input gradient."""
    from symbiont.proto import patches

    torch.manual_seed(0)
    m = conv()
    assert patches.is_patch_conv(m)
    x = torch.randn(shape, requires_grad=True)
    flat, grid = patches.to_patches(x, tuple(m.kernel_size))
    y = patches.from_patches(torch.nn.functional.linear(flat, patches.linear_weight(m.weight), m.bias), grid,
                             x.dim() == len(m.kernel_size) + 2)
    want = m(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    (gx,) = torch.autograd.grad(y, x, g)
    (wx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)
    for other in (torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(3, 8, 4, stride=2), torch.nn.Conv2d(4, 8, 2, stride=2, groups=2)):
        assert not patches.is_patch_conv(other)


@pytest.mark.parametrize("method", ["lora", "loha"])
@pytest.mark.parametrize("order", ["peft-then-virtualize", "virtualize-then-peft"])
def test_llava_peft_methods_either_side_of_virtualize(llava, method, order):
    """LoRA (on q/v of both towers and on the served patch convolution) and LoHa, made before or
    after virtualize: the adapter gradients of a loss on images equal the unsplit model's."""
    from peft import LoHaConfig, LoraConfig, get_peft_model

    ex, load = llava

    def adapted(model):
        config = (LoraConfig(r=4, target_modules=r".*(q_proj|v_proj|patch_embedding)", init_lora_weights=False) if method == "lora"
                  else LoHaConfig(r=4, target_modules=r".*(q_proj|v_proj)", init_weights=False))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            return get_peft_model(model, config)

    ref = adapted(load())
    virt = virtualize(adapted(load()), ex.url) if order == "peft-then-virtualize" else adapted(virtualize(load(), ex.url))
    ids, pixels = inputs(seed=4)
    for m in (ref, virt):
        m(input_ids=ids, pixel_values=pixels, labels=ids).loss.backward()
    want = lora_grads(ref)
    if method == "lora":
        assert any("patch_embedding" in n for n in want), "the served patch convolution's LoRA is trained"
    assert_grads_close(want, lora_grads(virt))


def test_a_multihead_attentions_out_proj_stays_with_the_tenant():
    """torch's MultiheadAttention passes its out_proj's weight to F.multi_head_attention_forward
    (SigLIP's attention-pooling head, in Cohere2-Vision and DeepSeek-VL): that Linear is no unit, so
    the tenant keeps it and the model runs; a Linear beside it is served."""
    from symbiont.base_executor.catalog import UnitTable

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.mlp = torch.nn.Linear(16, 16)

    table = UnitTable(Head())
    assert "mlp" in table.units and "attention.out_proj" not in table.units
