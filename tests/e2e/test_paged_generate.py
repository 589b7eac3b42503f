"""attention="paged": generate on the paged KV cache == HF eager, pages freed and reused."""
import numpy as np
import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.paged.tables import PoolExhausted
from gemma4opt.report import format_bytes
from tests.models import VARIANTS, WINDOW, prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)


def _gen(model, ids, new=10, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, **kw)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tokens_equal_eager_below_at_past_window_with_left_padding(variant):
    model = tiny(variant)
    cases = []
    for length in (WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3):
        ids = prompt(2, length, seed=length)
        mask = torch.ones_like(ids)
        mask[1, : length // 3] = 0             # row 1 left-padded
        ids[1, : length // 3] = 0
        cases.append((ids, mask, _gen(model, ids, attention_mask=mask)))
    gemma4opt.optimize(model, PAGED)
    ctx = model._gemma4opt.context
    for ids, mask, want in cases:              # repeated generate calls reuse the pool
        assert torch.equal(_gen(model, ids, attention_mask=mask), want)
        assert all(s.pages_held() == 0 for s in ctx.seqs.values()), "pages not released after generate"
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows)
    L = model.config.num_hidden_layers
    # q/k/v prep + KV append fused in every layer that owns KV; KV-shared layers rotate q only.
    shared = model.config.num_kv_shared_layers or 0
    st = model._gemma4opt
    assert set(st.stats["paged_qkv"].matched_per_graph) == {L - shared}
    for ops in st.pass_manager.op_counts:
        assert ops["gemma4opt.qkv_norm_rope_append"] == L - shared and ops["gemma4opt.kv_append"] == 0, ops
        assert ops["gemma4opt.rms_norm_rope"] == shared, ops
    assert f"{L}/{L} layers call a paged attention op" in rep.attention


def test_sliding_pages_are_freed_during_long_generation():
    model = tiny("tiny")
    gemma4opt.optimize(model, PAGED)
    ctx = model._gemma4opt.context
    held = {}
    real_step = ctx.begin_step

    def spy(cache, *a):
        real_step(cache, *a)
        held.setdefault("sliding", []).append(ctx.seqs["sliding_attention"].pages_held())
        held.setdefault("full", []).append(ctx.seqs["full_attention"].pages_held())

    ctx.begin_step = spy
    _gen(model, prompt(1, 5), new=60)
    ps = PAGED.page_size
    # the window (8 tokens) never needs more than ceil(8 / 4) + 1 pages; full layers keep everything
    assert max(held["sliding"][5:]) <= -(-WINDOW // ps) + 1
    assert held["full"][-1] == -(-(5 + 59) // ps)
    # What the report and benchmarks call the KV a sequence held at the end of generate.
    page_bytes = {layer: t[0].numel() * t.element_size() for layer, t in ctx.kv.items()}
    want = sum(b * held["sliding" if ctx.layer_kind[layer] == "sliding_attention" else "full"][-1]
               for layer, b in page_bytes.items())
    assert ctx.last_kv_held == (want, 1)
    # In bytes by size (tests/test_report.py checks format_bytes): a tiny model's KiB, not "0.00 MiB".
    attention = gemma4opt.report(model, print_table=False).attention
    assert f"({format_bytes(want)} per sequence)" in attention and "0.0 MiB" not in attention


def test_pool_exhaustion_is_a_clear_error_and_pages_come_back():
    model = tiny("tiny")
    gemma4opt.optimize(model, Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, kv_pool_pages=6))
    with pytest.raises(PoolExhausted, match="kv_pool_pages"):
        _gen(model, prompt(2, 20), new=4)
    ctx = model._gemma4opt.context
    assert all(s.pool.free_pages == 6 for s in ctx.seqs.values())
    assert _gen(model, prompt(1, 6), new=3).shape == (1, 9)   # usable again


def test_caller_cache_and_beam_search_use_hf_path():
    from transformers import DynamicCache

    model = tiny("tiny")
    ids = prompt(1, 7)
    want = _gen(model, ids)
    gemma4opt.optimize(model, PAGED)
    assert torch.equal(_gen(model, ids, past_key_values=DynamicCache(config=model.config)), want)
    assert model._gemma4opt.context.owner is None


def test_paged_on_cuda_needs_flashinfer_and_then_graphs_decode(monkeypatch):
    from gemma4opt.paged.backends import flashinfer

    monkeypatch.setattr(flashinfer, "available", lambda: "flashinfer not importable (ImportError: x); pip install "
                                                          "'gemma4opt[gpu]'")
    with pytest.raises(ValueError, match=r"needs FlashInfer: .*gemma4opt\[gpu\]"):
        PAGED.resolve("cuda")
    monkeypatch.setattr(flashinfer, "available", lambda: None)
    cfg = PAGED.resolve("cuda")
    assert cfg.cuda_graphs and not cfg.inductor and cfg.deferred_stop


def test_paged_conflicts_are_named():
    import dataclasses

    with pytest.raises(ValueError, match="cache='static' and attention='paged'"):
        dataclasses.replace(PAGED, cache="static").resolve("cpu")
    with pytest.raises(ValueError, match="inductor=False with attention='paged'"):
        dataclasses.replace(PAGED, cuda_graphs=True, inductor=True).resolve("cpu")
    assert PAGED.resolve("cpu").cache == "dynamic"
    assert PAGED.resolve("cpu").decode_buckets == (1, 2, 4)      # max_batch_size 4 is the last bucket
    assert dataclasses.replace(PAGED, max_batch_size=40).resolve("cpu").decode_buckets == (1, 2, 4, 8, 16, 24, 32, 40)


def test_kv_producers_follow_hf_sharing():
    from gemma4opt.paged.pool import kv_producers

    model = tiny("tiny-ple-shared")
    cfg = model.config
    prod = kv_producers(cfg)
    attn = [layer.self_attn for layer in model.model.layers]
    for layer, owner in prod.items():
        if attn[layer].is_kv_shared_layer:       # HF: reads the KV its type's storing layer keeps
            assert attn[owner].store_full_length_kv and cfg.layer_types[owner] == cfg.layer_types[layer]
        else:
            assert owner == layer
    assert np.unique(list(prod.values())).size == cfg.num_hidden_layers - cfg.num_kv_shared_layers


def test_sampling_and_inductor_lowering_on_paged_cache():
    """Sampling draws the same tokens as HF for the same seed; the mutating kv_append op survives
    Inductor's functionalization (the lowering the GPU path uses)."""
    import dataclasses

    model = tiny("tiny-ple-shared")
    ids = prompt(2, WINDOW + 4)
    greedy = _gen(model, ids)
    torch.manual_seed(5)
    sampled = _gen(model, ids, do_sample=True, top_k=20)
    gemma4opt.optimize(model, dataclasses.replace(PAGED, inductor=True))
    assert torch.equal(_gen(model, ids), greedy)
    torch.manual_seed(5)
    assert torch.equal(_gen(model, ids, do_sample=True, top_k=20), sampled)


@pytest.mark.parametrize("attention", ["hf", "paged"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_sampling_draws_eagers_tokens_on_every_variant(variant, attention):
    """Sampled generate (top-k, temperature) with the same seed draws HF eager's tokens, on
    every tiny variant, over HF's cache and over the paged cache (prompt past the window)."""
    import dataclasses

    model = tiny(variant)
    ids = prompt(2, WINDOW + 4, seed=7)
    kw = dict(do_sample=True, top_k=20, temperature=1.5)
    greedy = _gen(model, ids)
    torch.manual_seed(5)
    want = _gen(model, ids, **kw)
    assert not torch.equal(want, greedy), "sampling drew the greedy tokens: the check below would test nothing"
    gemma4opt.optimize(model, dataclasses.replace(PAGED, attention=attention))
    torch.manual_seed(5)
    assert torch.equal(_gen(model, ids, **kw), want)
    assert gemma4opt.report(model, print_table=False).compiled_calls > 0


def test_conditional_generation_on_paged_cache():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma4opt.presets import TINY_PRESETS, randomize_

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=TINY_PRESETS["tiny-ple-shared"], vision_config=None, audio_config=None)
    model = randomize_(Gemma4ForConditionalGeneration(cfg).eval())
    ids = prompt(2, WINDOW + 5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    want = _gen(model, ids, attention_mask=mask)
    gemma4opt.optimize(model, PAGED)
    assert torch.equal(_gen(model, ids, attention_mask=mask), want)
    L = cfg.text_config.num_hidden_layers
    assert f"{L}/{L} layers call" in gemma4opt.report(model, print_table=False).attention
