"""One forward call of an optimized model on a PagedCache: begin the step on the host, then run
the compiled graph, or replay a CUDA graph of it for decode steps and steps of a few tokens."""
from __future__ import annotations

import contextlib

import torch

from gemma4opt.paged.attention_function import ATTN_NAME
from gemma4opt.paged.cache import PagedCache
from gemma4opt.step_inputs import cache_of, step_input


def paged_forward(state, args, kwargs, begin: bool):
    """The optimized forward of a call on a PagedCache. ``begin``: this forward begins the step
    (False where an outer forward, Gemma4ForConditionalGeneration's, began it)."""
    if begin and state.decode_forward is not None:
        out = paged_decode_step(state, args, kwargs)     # names the paged attention where Dynamo runs
        if out is not None:
            return out
    with paged_attention_on(state):
        if begin:
            begin_paged_step(state.context, args, kwargs)
        keep = keep_all_for_shared_layers(state, args, kwargs)
        state.compiled_calls += 1
        out = state.compiled_forward(*args, **kwargs)
        x = step_input(args, kwargs)
        cache_of(kwargs).advance(x.shape[1])
        return out if keep is None else cut_logits(out, *x.shape[:2], keep)


def is_paged(cache) -> bool:
    return isinstance(cache, PagedCache)


@contextlib.contextmanager
def paged_attention_on(state):
    """The model's (own) text config names gemma4opt's paged attention for the length of a call
    on a paged cache, and the model's own implementation otherwise: calls without a paged cache
    get HF's attention function and HF's masks (an unknown name would get no mask at all)."""
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
    out = decode_call(state, kwargs)
    cache.advance(1)
    if bucket > batch:
        out.logits = out.logits[:batch]
    return out


def decode_call(state, kwargs):
    """A graphed step: directly when a plan of this generate call holds (runtime/direct_decode.py),
    else through Dynamo's entry, with the config naming the paged attention (the traced code reads
    it). A direct step runs no model code, so it skips that flip: two config writes through HF's
    validating __setattr__, ~50 µs of a ~560 µs step on the CPU stand-in."""
    if state.direct is not None:
        return state.direct(kwargs)
    with paged_attention_on(state):
        return state.decode_forward(**kwargs)


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
    out = decode_call(state, kwargs)
    cache.advance(padded)                      # what HF's update counted: the padded step
    return cut_logits(out, batch, tokens, keep)


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
