"""kv_cache_dtype="fp8": the paged pool in e4m3 with per-layer k/v scales, against an independent
reference: HF eager over HF's own cache, k and v rounded through e4m3 at the same scales as they
are stored (a cache subclass on the reference's own generate call: nothing of HF is patched)."""
import dataclasses

import pytest
import torch
from transformers import DynamicCache

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import VARIANTS, WINDOW, prompt, tiny

FP8 = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4, kv_cache_dtype="fp8")


def e4m3_round(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through an e4m3 store at ``scale`` and back: clamp(x / s, +-448) to e4m3, times s."""
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)     # a tensor divisor: IEEE division
    return (torch.clamp(x.float() / s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


class RoundingCache(DynamicCache):
    """HF's dynamic cache whose layers store (and hand to attention) k and v rounded through
    e4m3: what an fp8 KV pool holds. KV-shared layers read what their producer's update returned."""

    def __init__(self, scales: dict[int, tuple[float, float]] | None = None, **kw):
        super().__init__(**kw)
        self.scales = scales or {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        ks, vs = self.scales.get(layer_idx, (1.0, 1.0))
        return super().update(e4m3_round(key_states, ks), e4m3_round(value_states, vs), layer_idx, *args, **kwargs)


def gen(model, ids, new=10, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, **kw)


def fp8_reference(model, ids, scales=None, **kw):
    # past_key_values: the name every transformers 5.x takes (later ones call it cache, and still
    # accept this one).
    return gen(model, ids, past_key_values=RoundingCache(scales, config=model.config), **kw)


def _cases():
    out = []
    for length in (WINDOW - 1, WINDOW + 1, 2 * WINDOW + 3):
        ids = prompt(2, length, seed=length)
        mask = torch.ones_like(ids)
        mask[1, : length // 3] = 0             # row 1 left-padded
        ids[1, : length // 3] = 0
        out.append((ids, mask))
    return out


@pytest.mark.parametrize("variant,fused", [(v, True) for v in VARIANTS]
                         + [("tiny-k-eq-v", False), ("tiny-ple-shared", False)])
def test_greedy_tokens_equal_eager_with_e4m3_rounded_kv(variant, fused):
    """Below, past and well past the window, with left padding; fused (qkv_norm_rope_append) and
    unfused (kv_append) appends. The rounding changes the tokens (so the check tests the fp8 path)."""
    model = tiny(variant)
    cases = [(ids, mask, fp8_reference(model, ids, attention_mask=mask), gen(model, ids, attention_mask=mask))
             for ids, mask in _cases()]
    assert any(not torch.equal(want, plain) for _, _, want, plain in cases), "e4m3 rounding changed no token"
    gemma4opt.optimize(model, FP8 if fused else dataclasses.replace(FP8, patterns=()))
    ctx = model._gemma4opt.context
    assert ctx.kv_dtype == torch.float8_e4m3fn
    assert all(t.dtype == torch.float8_e4m3fn for t in ctx.kv.values()) and set(ctx.kv_scale) == set(ctx.kv)
    for ids, mask, want, _ in cases:
        assert torch.equal(gen(model, ids, attention_mask=mask), want)
    counts = model._gemma4opt.pass_manager.op_counts[-1]
    L, shared = model.config.num_hidden_layers, model.config.num_kv_shared_layers or 0
    if fused:
        assert counts["gemma4opt.qkv_norm_rope_append"] == L - shared and counts["gemma4opt.kv_append"] == 0
    else:
        assert counts["gemma4opt.kv_append"] == L - shared


def test_set_scales_clamp_and_still_equal_the_reference():
    """Scales set per layer (powers of two, so the rounding is exact in both paths): k's small
    enough that stored values clamp at 448, v's another; tokens equal the reference's at them."""
    model = tiny("tiny-ple-shared")
    ids = prompt(2, 2 * WINDOW + 3, seed=3)
    gemma4opt.optimize(model, FP8)
    ctx = model._gemma4opt.context
    scales = {layer: (2.0 ** -7, 2.0 ** -(1 + layer % 2)) for layer in ctx.kv}
    for layer, (ks, vs) in scales.items():
        ctx.set_kv_scales(layer, ks, vs)
    want = fp8_reference(model, ids, scales)
    assert not torch.equal(want, fp8_reference(model, ids))
    out = model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert any((t[:, 0].float().abs() == 448).any() for t in ctx.kv.values()), "no k value clamped"
    assert "set per layer" in gemma4opt.report(model, print_table=False).kv_cache
    out.past_key_values.release()


def test_set_kv_scales_refusals():
    model = tiny("tiny-ple-shared")
    gemma4opt.optimize(model, FP8)
    ctx = model._gemma4opt.context
    shared = next(layer for layer, owner in ctx.producer.items() if layer != owner)
    with pytest.raises(ValueError, match="owns no KV"):
        ctx.set_kv_scales(shared, 1.0, 1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            ctx.set_kv_scales(0, bad, 1.0)
    gen(model, prompt(1, 5), new=2)
    with pytest.raises(RuntimeError, match="before the model's first paged step"):
        ctx.set_kv_scales(0, 0.5, 0.5)
    plain = tiny("tiny")
    gemma4opt.optimize(plain, dataclasses.replace(FP8, kv_cache_dtype="auto"))
    assert plain._gemma4opt.context.kv_scale == {}
    with pytest.raises(ValueError, match="fp8 pool"):
        plain._gemma4opt.context.set_kv_scales(0, 1.0, 1.0)


def test_report_and_pool_bytes_halve_against_bf16():
    """A bf16 model: the fp8 pool's bytes per token and per sequence are half of the bf16 pool's,
    and a memory budget holds twice the pages."""
    from gemma4opt.paged.pool import pool_pages

    reports, ctxs = {}, {}
    for kv in ("auto", "fp8"):
        model = tiny("tiny-ple-shared", dtype=torch.bfloat16)
        gemma4opt.optimize(model, dataclasses.replace(FP8, kv_cache_dtype=kv))
        ctxs[kv] = ctx = model._gemma4opt.context
        reports[kv] = gemma4opt.report(model, print_table=False)
        assert ctx.kv_bytes_per_token() == sum(t[0, :, 0].numel() * t.element_size() for t in ctx.kv.values())
    a, f = ctxs["auto"], ctxs["fp8"]
    assert f.kv_bytes_per_token() * 2 == a.kv_bytes_per_token()
    assert f.kv_bytes_per_sequence(96) * 2 == a.kv_bytes_per_sequence(96)
    assert reports["auto"].kv_cache.startswith("bfloat16, ")
    assert reports["fp8"].kv_cache.startswith("float8_e4m3fn (one fp32 scale per layer for k and one for v: all 1)")
    assert "KV cache: float8_e4m3fn" in str(reports["fp8"])
    cfg = tiny("tiny-ple-shared").config
    budget = dataclasses.replace(FP8, kv_pool_fraction=1.0).resolve("cpu", torch.bfloat16, cfg)
    page = 4 * a.kv_bytes_per_token()
    assert pool_pages(cfg, budget, torch.float8_e4m3fn, 20 * page) == 2 * pool_pages(cfg, budget, torch.bfloat16,
                                                                                  20 * page) == 40


@pytest.mark.parametrize("variant", ["tiny-k-eq-v", "tiny-ple-shared"])
def test_with_fp8_weights_too(variant):
    """quantization="fp8" and kv_cache_dtype="fp8" together: tokens equal the fp8-weight reference
    path (the same Fp8Linear swap on an unoptimized copy) over the e4m3-rounding cache."""
    import copy

    from gemma4opt.ops.fp8_weights import quantize_linears

    model = tiny(variant)
    ref = copy.deepcopy(model)
    quantize_linears(ref)
    ids = prompt(2, 2 * WINDOW + 3, seed=4)
    want = fp8_reference(ref, ids, attention_mask=torch.ones_like(ids))
    gemma4opt.optimize(model, dataclasses.replace(FP8, quantization="fp8"))
    assert torch.equal(gen(model, ids, attention_mask=torch.ones_like(ids)), want)
    rep = gemma4opt.report(model, print_table=False)
    assert rep.weights and rep.kv_cache.startswith("float8_e4m3fn") and all(r.complete for r in rep.rows)
