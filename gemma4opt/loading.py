"""Load a local Gemma-4 checkpoint with the right HF class (text-only or multimodal)."""
from __future__ import annotations

import torch


def load_local(path: str, dtype=torch.bfloat16, device="cuda"):
    """Gemma4ForCausalLM for a 'gemma4_text' checkpoint, Gemma4ForConditionalGeneration for 'gemma4'."""
    from transformers import AutoConfig, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    config = AutoConfig.from_pretrained(path)
    classes = {"gemma4_text": Gemma4ForCausalLM, "gemma4": Gemma4ForConditionalGeneration}
    if config.model_type not in classes:
        raise ValueError(f"{path}: model_type {config.model_type!r} is not a Gemma-4 model; supported: {list(classes)}")
    return classes[config.model_type].from_pretrained(path, dtype=dtype, device_map=device).eval()
