"""Paged KV on one optimized model: its attention function, its StepContext, and a generate that
brings a PagedCache; calls that need HF's cache keep HF's path."""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import torch

from gemma4opt.paged.attention_function import register
from gemma4opt.paged.backends import paged_unsupported
from gemma4opt.paged.cache import PagedCache
from gemma4opt.paged.forward import begin_paged_step, is_paged, paged_attention_on
from gemma4opt.paged.step import StepContext
from gemma4opt.step_inputs import MASK_GAP, cache_of, generation_config_of, mask_gap_rows


def check_paged_supported(device, dtype, text_config, kv_dtype=None) -> None:
    """Refuse, before the model changes, what FlashInfer cannot run (the CPU reference runs anything)."""
    if device.type != "cuda":
        return
    why = paged_unsupported(dtype, text_config, kv_dtype)
    if why is not None:
        raise ValueError(f"Gemma4OptConfig.attention='paged' on CUDA: {why}")


def install_paged(model, target, state, device, dtype, edits) -> None:
    """Paged attention for this instance: KV pool, attention function, and a generate that brings the cache."""
    register()
    ctx = StepContext(state.text_config, state.config, device, dtype, state.fixed, shard=state.shard)
    state.context = ctx
    owners = []
    for path, module in target.named_modules():
        if type(module).__name__ == "Gemma4TextAttention":
            _share_text_config(module, path, state.text_config, edits)
            edits.set(module, "_gemma4opt_ctx", ctx)
            if not getattr(module, "is_kv_shared_layer", False):
                owners.append(module.layer_idx)
    ctx.updating_layers = sorted(owners)     # the layers HF's attention calls cache.update on
    layout = kv_layout(state.text_config)    # what the pool and its page tables were built for
    cache_kw = "cache" if "cache" in inspect.signature(state.original_forward).parameters else "past_key_values"
    original_generate = model.generate

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        given = cache_of(kwargs)
        if given is not None:
            if is_paged(given):              # a PagedCache returned by an earlier call: continue it
                if given.context is not ctx:
                    raise ValueError("gemma4opt: this PagedCache belongs to another model (or to this model before "
                                     "it was optimized again); pass the cache its own model returned, or none")
                changed = layout_change(layout, state.text_config)
                if changed:
                    raise ValueError(f"gemma4opt: {changed}, so this PagedCache (made before) no longer fits the "
                                     "model; start a new generate call without it")
                check_generate_limits(ctx, model, args, kwargs, given)
                with generating(state):
                    return original_generate(*args, **kwargs)
            return original_generate(*args, **kwargs)      # the caller's cache: HF's path with it
        gen = generation_config_of(model, kwargs)
        if gen is None or hf_generate_reason(target, gen) is not None or state.hooks.reason() is not None:
            return original_generate(*args, **kwargs)      # beam search, static cache, attentions...: HF's path
        # HF reads the config at each call (its masks, its new cache), and keeps masked slots in both:
        # a call the pool's layout or its packed rows would answer differently runs HF's path.
        changed = layout_change(layout, state.text_config) or (
            MASK_GAP if mask_gap_rows(generate_mask(model, args, kwargs, gen)) else None)
        if changed:
            reason = f"{changed}: generate runs on HF's cache and attention"
            if not state.fallbacks[reason]:
                warnings.warn(f"gemma4opt: {reason}", stacklevel=2)
            state.fallbacks[reason] += 1
            return original_generate(*args, **kwargs)
        check_generate_limits(ctx, model, args, kwargs, None, gen)
        cache = PagedCache(ctx, state.text_config.num_hidden_layers)
        if getattr(gen, "is_assistant", False):
            # HF marks the caches it makes for an assistant, which it crops by whole drafts.
            cache.activate_past_recording()
        kwargs[cache_kw] = cache
        out = None
        try:
            with generating(state):
                out = original_generate(*args, **kwargs)
            return out
        finally:
            # A cache generate returns (return_dict_in_generate) stays with the caller, who may continue
            # it; it gives its pages back when released or dropped. Otherwise they go back now (also
            # when generate raises).
            if _returned_cache(out) is not cache:
                cache.release()

    edits.set(model, "generate", generate)
    if target is not model:
        # Gemma4ForConditionalGeneration: its own forward sees the 2-D mask and the cache and builds
        # the text model's mask mapping (image tokens included), so the step starts there.
        outer = model.forward

        @functools.wraps(outer)
        def forward(*args, **kwargs):
            if not is_paged(cache_of(kwargs)):
                return outer(*args, **kwargs)
            with paged_attention_on(state):
                begin_paged_step(ctx, args, kwargs, replace_mask=False)
                return outer(*args, **kwargs)

        edits.set(model, "forward", forward)


def _share_text_config(module, path, text_config, edits) -> None:
    """An attention module reads its attention function's name from its own config, which the
    paged calls name gemma4opt's attention on: one holding another config object (swapped in from
    another model) is given the model's, when their values agree, and refused otherwise."""
    held = module.__dict__.get("config")
    if held is None or held is text_config:
        return
    ours, theirs = text_config.to_dict(), held.to_dict()
    diff = sorted(k for k in set(ours) | set(theirs)
                  if ours.get(k) != theirs.get(k) and not k.startswith("_attn_implementation"))
    if diff:
        raise ValueError(f"gemma4opt paged attention: {path} holds a config of its own that differs from the "
                         f"model's ({', '.join(diff[:3])}); give it the model's config, or optimize with "
                         "attention='hf'")
    edits.set(module, "config", text_config)


def generating(state):
    """The scope of one generate call on a PagedCache (runtime/direct_decode.py's plans live in it;
    api.py makes ``state.direct``)."""
    return state.direct.generating() if state.direct is not None else contextlib.nullcontext()


def _returned_cache(out):
    if out is None or isinstance(out, torch.Tensor):
        return None
    got = getattr(out, "cache", None)
    return got if got is not None else out.get("past_key_values") if hasattr(out, "get") else None


# The text config's entries the paged pool, its page tables and the KV sharing were built for.
_LAYOUT = ("sliding_window", "layer_types", "num_kv_shared_layers", "num_hidden_layers")


def kv_layout(text_config) -> dict:
    return {k: copy_value(getattr(text_config, k, None)) for k in _LAYOUT}


def copy_value(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def layout_change(layout: dict, text_config) -> str | None:
    """Which of those the model's config has changed since optimize() (a caller's edit), or None."""
    changed = [k for k, v in layout.items() if copy_value(getattr(text_config, k, None)) != v]
    if not changed:
        return None
    return "the model's config changed " + ", ".join(
        f"{k} ({layout[k]!r} -> {getattr(text_config, k, None)!r})" if k != "layer_types" else k for k in changed
    ) + " after optimize()"


# Generation settings whose forward calls need HF's unfused forward (api._FALLBACK_KWARGS).
_HF_OUTPUTS = ("output_attentions", "output_hidden_states", "output_router_logits")


def hf_generate_reason(target, gen) -> str | None:
    """Why a generate call runs on HF's own cache (and so HF's attention), or None for a PagedCache."""
    if (gen.num_beams or 1) > 1:
        return "beam search"
    if gen.cache_implementation is not None:
        return f"cache_implementation={gen.cache_implementation!r}"
    if gen.use_cache is False:
        return "use_cache=False"
    for name in _HF_OUTPUTS:
        if getattr(gen, name, False):
            return f"{name} requested"
    if target.training:
        return "training mode"
    return None


def generate_mask(model, args, kwargs, gen=None):
    """The 2-D attention mask a generate call will run with: the caller's, else the one HF infers
    from pad tokens in input_ids (its _prepare_attention_mask_for_generation: where the pad id is
    set, not an eos id, and in the ids), else None (every token real)."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return mask
    ids = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        return None
    gen = gen if gen is not None else generation_config_of(model, kwargs)
    pad = getattr(gen, "pad_token_id", None)
    eos = getattr(gen, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if pad is None or pad in eos:
        return None
    return ids != pad


def check_generate_limits(ctx, model, args, kwargs, cache, gen=None) -> None:
    """Refuse, before the first token, a call the paged tables cannot hold: more sequences than
    max_batch_size, or a prompt plus new tokens longer than max_seq_len."""
    if gen is None:
        gen = generation_config_of(model, kwargs)
        if gen is None:
            return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs")
    embeds = kwargs.get("inputs_embeds")
    prompt = ids if ids is not None else embeds
    if prompt is None or not isinstance(prompt, torch.Tensor) or prompt.dim() < 2:
        return
    batch, length = prompt.shape[0], prompt.shape[1]
    batch *= max(gen.num_return_sequences or 1, 1)
    if cache is None and batch > ctx.max_batch:
        raise ValueError(f"gemma4opt: a batch of {batch} sequences exceeds Gemma4OptConfig.max_batch_size="
                         f"{ctx.max_batch}; raise max_batch_size (optimize again) or split the batch")
    if gen.max_new_tokens is not None:
        total, how = length + gen.max_new_tokens, f"{length} prompt tokens + max_new_tokens={gen.max_new_tokens}"
    elif ids is None and embeds is not None:
        total, how = length + gen.max_length, f"{length} prompt embeddings + max_length={gen.max_length}"
    else:
        total, how = max(gen.max_length, length), f"max_length={gen.max_length}"
    if total > ctx.max_seq_len:
        raise ValueError(f"gemma4opt: {how} = {total} tokens exceeds Gemma4OptConfig.max_seq_len={ctx.max_seq_len}; "
                         "raise max_seq_len (optimize again) or generate fewer tokens")
