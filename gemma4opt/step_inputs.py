"""Where a call's cache, batch input and generation config are, as HF generate and direct callers pass them."""
from __future__ import annotations

import warnings

import torch


def cache_of(kwargs):
    """The KV cache (transformers >= 5.20 calls it ``cache``, earlier ``past_key_values``)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def step_input(args, kwargs):
    """input_ids (keyword or first positional) or inputs_embeds: [batch, tokens, ...]; None if neither."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if ids is not None else kwargs.get("inputs_embeds")


def one_token_step(args, kwargs) -> bool:
    """A decode step: one new token per sequence (prefill, chunks and drafts take the other path)."""
    ids = step_input(args, kwargs)
    return ids is not None and ids.dim() >= 2 and ids.shape[1] == 1


def generation_config_of(model, kwargs):
    """HF's generation config for this call (model defaults merged with the call's), or None when
    HF refuses the arguments (generate itself then raises its own error)."""
    rest = {k: v for k, v in kwargs.items() if k != "generation_config"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen, _ = model._prepare_generation_config(kwargs.get("generation_config"), **rest)
    except Exception:      # noqa: BLE001
        return None
    return gen


MASK_GAP = "an attention_mask with a 0 after a 1 in a row (right padding or a gap between tokens; paged takes left padding)"


def mask_gap_rows(mask) -> list[int]:
    """The rows of a 2-D attention mask that are not left padding: a 0 after the row's first 1 (right
    padding, or a gap between its tokens). The paged cache keeps a row's real tokens back to back and
    drops the masked ones, where HF keeps every slot, masked or not, in its cache and its sliding
    window: such a row's tokens would differ from HF's. Read on the host (one copy of the mask); a
    PagedCache's step refuses such a mask (paged/step.py), a new generate call runs HF's path."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return []
    m = mask.detach().to("cpu") != 0
    after_one = m.to(torch.int32).cummax(1).values.bool() & ~m
    return after_one.any(1).nonzero().flatten().tolist()
