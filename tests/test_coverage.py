"""The coverage walk (benchmarks/coverage.py) on a sample CI can afford: each type built from its
shrunk default config, saved, served by a real executor, loaded and virtualized by a tenant, and
checked against the unsplit model (logits, greedy tokens, all-linear LoRA gradients; a
vision-language type also with an image through its vision tower). The full walk over every
causal-LM and image-text-to-text type is the script; its numbers are in RESULTS.md."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import REPO

# (loaded by path under its own name: `coverage` is also the name of a popular package)
_spec = importlib.util.spec_from_file_location("symbiont_coverage_walk", os.path.join(REPO, "benchmarks", "coverage.py"))
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)


@pytest.mark.parametrize("model_type", [
    "opt",      # a learned positional Embedding with a forward of its own (offset ids)
    "gpt2",     # transformers' Conv1D
    "olmoe",    # 3-D expert weights served one Linear unit per expert
])
def test_causal_lm_types_are_exact(model_type):
    r = coverage.check(model_type, "causal-lm")
    assert r["stage"] == "exact" and not r["why"], r


@pytest.mark.parametrize("model_type", [
    "mistral3",     # a Pixtral vision tower: its patch convolution served as a Linear over patches
    "deepseek_vl",  # SigLIP with an attention-pooling head (MultiheadAttention keeps its out_proj)
    "qwen2_vl",     # flattened patches through a served Conv3d, their grid, multimodal rotary positions
])
def test_vision_language_types_are_exact_with_an_image(model_type):
    r = coverage.check(model_type, "image-text-to-text")
    assert r["stage"] == "exact" and r["images"] == "exact", r
