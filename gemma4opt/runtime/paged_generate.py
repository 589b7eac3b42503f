"""Paged KV for one optimized model: install its attention and a generate that brings a PagedCache,
and prepare each forward's page metadata on the host before the compiled graph runs."""
from __future__ import annotations

import functools
import inspect


def install_paged(model, target, state, device, dtype) -> None:
    """Paged attention for this instance: KV pool, attention function, and a generate that brings the cache."""
    from gemma4opt.attention import interface
    from gemma4opt.attention.cache import PagedCache
    from gemma4opt.runtime.context import StepContext

    interface.register()
    ctx = StepContext(state.text_config, state.config, device, dtype)
    state.context = ctx
    for module in target.modules():
        if type(module).__name__ == "Gemma4TextAttention":
            module._gemma4opt_ctx = ctx
    state.text_config._attn_implementation = interface.ATTN_NAME
    cache_kw = "cache" if "cache" in inspect.signature(state.original_forward).parameters else "past_key_values"
    original_generate = model.generate

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        beams = kwargs.get("num_beams") or getattr(kwargs.get("generation_config"), "num_beams", 1) or 1
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or beams > 1:
            return original_generate(*args, **kwargs)      # the caller's cache / beam search: HF's path
        cache = PagedCache(ctx, state.text_config.num_hidden_layers)
        kwargs["past_key_values" if cache_kw == "past_key_values" else "cache"] = cache
        try:
            return original_generate(*args, **kwargs)
        finally:
            cache.release()                                 # pages go back even when generate raises

    model.generate = generate
    if target is not model:
        # Gemma4ForConditionalGeneration: its own forward sees the 2-D mask and the cache and builds
        # the text model's mask mapping (image tokens included), so the step starts there.
        outer = model.forward

        @functools.wraps(outer)
        def forward(*args, **kwargs):
            begin_paged_step(ctx, args, kwargs, replace_mask=False)
            return outer(*args, **kwargs)

        model.forward = forward


def begin_paged_step(ctx, args, kwargs, replace_mask: bool = True) -> None:
    from gemma4opt.attention.cache import PagedCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    ctx.active = isinstance(cache, PagedCache)
    if not ctx.active:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"]
    ctx.begin_step(cache, ids.shape[0], ids.shape[1], kwargs.get("attention_mask"))
    if replace_mask:
        # Masks are not needed: attention reads page tables. A dict tells Gemma-4 they are prepared.
        kwargs["attention_mask"] = {"full_attention": None, "sliding_attention": None}
