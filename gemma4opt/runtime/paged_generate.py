"""Paged KV for one optimized model: install its attention and a generate that brings a PagedCache,
and prepare each forward's page metadata on the host before the compiled graph runs."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from gemma4opt.attention.cache import PagedCache
from gemma4opt.runtime.step_inputs import cache_of, generation_config_of, step_input

FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)


def paged_unsupported(dtype, text_config) -> str | None:
    """Why FlashInfer cannot run this model's paged attention on CUDA, or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return (f"FlashInfer supports float16 and bfloat16 and this model is {dtype}: cast it "
                "(model.to(torch.bfloat16)) or use attention='hf'")
    dims = sorted({lc.head_dim for lc in getattr(text_config, "per_layer_config", None) or ()})
    bad = [d for d in dims if d not in FLASHINFER_HEAD_DIMS]
    if bad:
        return (f"head_dim {bad} is not one FlashInfer's paged kernels are built for {list(FLASHINFER_HEAD_DIMS)}; "
                "use attention='hf' for this model")
    return None


def check_paged_supported(device, dtype, text_config) -> None:
    """Refuse, before the model changes, what FlashInfer cannot run (the CPU reference runs anything)."""
    if device.type != "cuda":
        return
    why = paged_unsupported(dtype, text_config)
    if why is not None:
        raise ValueError(f"Gemma4OptConfig.attention='paged' on CUDA: {why}")


def install_paged(model, target, state, device, dtype, edits) -> None:
    """Paged attention for this instance: KV pool, attention function, and a generate that brings the cache."""
    from gemma4opt.attention import interface
    from gemma4opt.runtime.context import StepContext

    interface.register()
    ctx = StepContext(state.text_config, state.config, device, dtype)
    state.context = ctx
    for module in target.modules():
        if type(module).__name__ == "Gemma4TextAttention":
            edits.set(module, "_gemma4opt_ctx", ctx)
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
                check_generate_limits(ctx, model, args, kwargs, given)
            return original_generate(*args, **kwargs)      # the caller's cache: HF's path with it
        gen = generation_config_of(model, kwargs)
        if gen is None or hf_generate_reason(target, gen) is not None:
            return original_generate(*args, **kwargs)      # beam search, static cache, attentions...: HF's path
        check_generate_limits(ctx, model, args, kwargs, None, gen)
        cache = PagedCache(ctx, state.text_config.num_hidden_layers)
        if getattr(gen, "is_assistant", False):
            # HF marks the caches it makes for an assistant, which it crops by whole drafts.
            cache.activate_past_recording()
        kwargs[cache_kw] = cache
        out = None
        try:
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


def _returned_cache(out):
    if out is None or isinstance(out, torch.Tensor):
        return None
    got = getattr(out, "cache", None)
    return got if got is not None else out.get("past_key_values") if hasattr(out, "get") else None


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


def is_paged(cache) -> bool:
    return isinstance(cache, PagedCache)


@contextlib.contextmanager
def paged_attention_on(state):
    """The model's (own) text config names gemma4opt's paged attention for the length of a call
    on a paged cache, and the model's own implementation otherwise: calls without a paged cache
    get HF's attention function and HF's masks (an unknown name would get no mask at all)."""
    from gemma4opt.attention.interface import ATTN_NAME

    cfg = state.text_config
    before = cfg._attn_implementation
    cfg._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = before


def begin_paged_step(ctx, args, kwargs, replace_mask: bool = True) -> None:
    cache = cache_of(kwargs)
    ctx.active = isinstance(cache, PagedCache)
    if not ctx.active:
        return
    ids = step_input(args, kwargs)
    ctx.begin_step(cache, ids.shape[0], ids.shape[1], kwargs.get("attention_mask"))
    if replace_mask:
        kwargs["attention_mask"] = _no_masks()


def _no_masks() -> dict:
    """Masks are not needed: attention reads page tables. A dict tells Gemma-4 they are prepared."""
    return {"full_attention": None, "sliding_attention": None}


_BATCH_INPUTS = ("input_ids", "position_ids", "inputs_embeds")


def paged_decode_step(state, args, kwargs):
    """A paged step as a CUDA-graph replay, or None when it is not one.

    Decode (one new token per sequence): the batch of B rows is padded to the smallest bucket >= B
    (input rows of zeros; page metadata rows of the dummy sequence, see StepContext._padded), the
    bucket's graph runs, and the logits of the B real rows are returned. A batch larger than every
    bucket runs uncaptured (counted). A few new tokens per sequence on a cache already begun (a
    draft to verify, an assistant's next round): see ``_token_step``.
    """
    ctx = state.context
    cache = cache_of(kwargs)
    if not isinstance(cache, PagedCache) or cache.rows is None or not ctx.buckets:
        return None
    if args:                                   # generate passes keywords; a positional input_ids too
        kwargs = dict(kwargs, input_ids=args[0])
    x = step_input((), kwargs)
    if x is None or x.dim() < 2:
        return None
    batch, tokens = x.shape[:2]
    if tokens > 1:
        return _token_step(state, ctx, cache, kwargs, batch, tokens)
    bucket = ctx.bucket(batch)
    if bucket is None:
        state.fallbacks[f"paged decode batch > largest graph bucket {ctx.buckets[-1]} (run uncaptured)"] += 1
        return None
    ctx.active = True
    ctx.begin_step(cache, batch, 1, None, pad_to=bucket)
    kwargs["attention_mask"] = _no_masks()
    for name in _BATCH_INPUTS:
        t = kwargs.get(name)
        if t is not None and bucket > batch:
            padded = t.new_zeros((bucket, *t.shape[1:]))
            padded[:batch] = t
            kwargs[name] = padded
    state.compiled_calls += 1
    out = state.decode_forward(**kwargs)
    if bucket > batch:
        out.logits = out.logits[:batch]
    return out


def _token_step(state, ctx, cache, kwargs, batch: int, tokens: int):
    """A step of ``tokens`` new tokens per sequence on a begun cache, as a graph replay padded to
    (rows, tokens) buckets (StepContext.token_bucket): HF's assisted decoding verifies every draft
    this way and the assistant starts each round this way. Padding tokens are one-token rows of
    the dummy sequence; every token's logits are computed and the ones asked for returned. None
    (the step runs uncaptured) for left padding among the new tokens, a logits_to_keep that is
    not an int, or shapes past the buckets."""
    keep = kwargs.get("logits_to_keep", 0)
    mask = kwargs.get("attention_mask")
    if not isinstance(keep, int) or (mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2)):
        return None
    shape = ctx.token_bucket(cache, batch, tokens)
    if shape is None:
        return None
    if mask is not None and not bool(mask[:, -tokens:].all()):     # read on the host, as a prefill does
        return None
    rows, padded = shape
    ctx.begin_token_step(cache, batch, tokens, rows, padded)
    kwargs["attention_mask"] = _no_masks()
    for name, t in list(kwargs.items()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == tokens and t.shape[0] in (batch, 1):
            # ids, positions (per row, or one row for all), embeddings
            big = t.new_zeros((rows if t.shape[0] == batch else 1, padded, *t.shape[2:]))
            big[:t.shape[0], :tokens] = t
            kwargs[name] = big
        elif name == "cache_position" and isinstance(t, torch.Tensor) and t.shape == (tokens,):
            kwargs[name] = torch.cat([t, t[-1] + torch.arange(1, padded - tokens + 1, device=t.device, dtype=t.dtype)])
    kwargs["logits_to_keep"] = 0               # padding tokens come last: keep all, cut below
    state.compiled_calls += 1
    return cut_logits(state.decode_forward(**kwargs), batch, tokens, keep)


def keep_all_for_shared_layers(state, args, kwargs) -> int | None:
    """HF runs KV-shared layers on the last ``logits_to_keep`` tokens only; paged attention plans a
    step for all its tokens or its last one. A keep between those (assisted decoding's first
    verify: prompt and draft in one step) runs every token: returns the keep asked for (for
    ``cut_logits``), or None when nothing changed."""
    keep = kwargs.get("logits_to_keep")
    x = step_input(args, kwargs)
    if not getattr(state.text_config, "num_kv_shared_layers", 0) or not isinstance(keep, int) or x is None \
            or x.dim() < 2 or not 1 < keep < x.shape[1]:
        return None
    kwargs["logits_to_keep"] = 0
    return keep


def cut_logits(out, batch: int, tokens: int, keep: int):
    """The logits of a step run on every token (and perhaps padded) cut to its ``batch`` rows,
    ``tokens`` tokens and the last ``keep`` of those (0: all), as HF's logits_to_keep gives them."""
    logits = out.logits[:batch, :tokens]
    out.logits = logits[:, -keep:] if 0 < keep < tokens else logits
    return out
