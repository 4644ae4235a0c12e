"""Which transformers auto class builds a model: the image-text-to-text one for a vision-language
model (LLaVA, Qwen2-VL, Idefics3, ...), the causal-LM one otherwise. A type in both mappings
(Gemma 3, Mllama, ...) is a vision-language model when its checkpoint says so (`architectures`
names no *ForCausalLM class). The executor loads a checkpoint with it, a tenant builds its model
from the skeleton with it."""
from __future__ import annotations


def auto_model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    kind = getattr(config, "model_type", "")
    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForCausalLM
    arch = (getattr(config, "architectures", None) or [""])[0]
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (arch and not arch.endswith("ForCausalLM")):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
