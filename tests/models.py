"""Shared helpers for tests: tiny models, prompts, and a counting compile."""
import torch

from gemma4opt.presets import TINY_PRESETS, build_model

VARIANTS = sorted(TINY_PRESETS)
WINDOW = TINY_PRESETS["tiny"]["sliding_window"]


def tiny(name="tiny", dtype=torch.float32, seed=0):
    return build_model(name, dtype=dtype, seed=seed)


def prompt(batch, length, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def greedy(model, ids, new=8):
    """Greedy generate of ``new`` tokens over an all-ones attention mask."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
