"""Which transformers auto class builds a model type: the causal-LM one where transformers has it,
else the image-text-to-text one (vision-language models: LLaVA, Qwen2-VL, Idefics3, ...). The
executor loads a checkpoint with it, a tenant builds its model from the skeleton with it."""
from __future__ import annotations


def auto_model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    kind = getattr(config, "model_type", "")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
