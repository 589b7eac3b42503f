"""On the GPU machine: the FlashInfer paged-attention path against the reference and HF eager.

Needs flashinfer (the [gpu] extra).
"""
import dataclasses

import numpy as np
import pytest
import torch

import gemma4opt
from gemma4opt.paged.tables import PagedSequences, PagePool
from gemma4opt.ops.kv_append import kv_append_reference
from gemma4opt.paged.backends.reference import paged_attention_reference

pytestmark = pytest.mark.gpu


def _geometry(heads, kv_heads, head_dim, page_size, window, dtype):
    from gemma4opt.paged.backends.base import KindGeometry

    return KindGeometry("sliding_attention" if window else "full_attention", heads, kv_heads, head_dim, page_size,
                        window, dtype, dtype, device="cuda")


@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(256, 32, 16, 24), (512, 32, 4, None), (64, 4, 1, 7)])
def test_flashinfer_matches_reference_prefill_left_padding_and_decode(head_dim, heads, kv_heads, window):
    pytest.importorskip("flashinfer")
    from gemma4opt.paged.backends.flashinfer import FlashInferBackend

    torch.manual_seed(0)
    ps, dtype, dev = 16, torch.bfloat16, "cuda"
    pool = PagePool(256, ps)
    seqs = PagedSequences(pool, max_batch=3, max_seq_len=512, window=window)
    kv = torch.zeros(256, 2, ps, kv_heads, head_dim, device=dev, dtype=dtype)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    plan = FlashInferBackend(_geometry(heads, kv_heads, head_dim, ps, window, dtype), ws)
    rows = np.arange(3)
    for new in [[37, 5, 70]] + [[1, 1, 1]] * 40:
        meta = seqs.step(rows, np.array(new))
        n = sum(new)
        k = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
        v = torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype)
        kv_append_reference(kv, k, v, torch.from_numpy(meta.slot_mapping).to(dev))
        q = torch.randn(n, heads, head_dim, device=dev, dtype=dtype) / head_dim ** 0.5
        t = {f: torch.from_numpy(np.ascontiguousarray(getattr(meta, f))).to(dev) for f in
             ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_start", "qo_indptr", "seq_lens")}
        plan.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_last_page_len, t["kv_indices"].int())
        got = plan.run(q, kv)
        want = paged_attention_reference(q.float(), kv.float(), t["kv_indptr"], t["kv_indices"].long(),
                                         t["kv_last_page_len"], t["kv_start"], t["qo_indptr"], t["seq_lens"], window,
                                         1.0)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(256, 32, 16, 24), (512, 32, 4, None)])
def test_fast_replan_equals_flashinfer_plan_in_graph_mode(head_dim, heads, kv_heads, window):
    """Decode-graph replans without FlashInfer's Python plan() (paged/backends/flashinfer_replan.py):
    over decode steps whose lengths cross pages and the window, a padded bucket, the same
    attention output bit for bit as FlashInfer's plan(), the self-check passed, and the fast path
    ran every step after the first."""
    pytest.importorskip("flashinfer")
    from gemma4opt.paged.backends.flashinfer import FlashInferBackend

    torch.manual_seed(0)
    ps, dtype, dev, bucket = 16, torch.bfloat16, "cuda", 4
    pool = PagePool(256, ps)
    seqs = PagedSequences(pool, max_batch=3, max_seq_len=512, window=window)
    kv = torch.randn(256, 2, ps, kv_heads, head_dim, device=dev, dtype=dtype)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    geometry = _geometry(heads, kv_heads, head_dim, ps, window, dtype)
    fast = FlashInferBackend(geometry, ws, max_pages=260)
    full = FlashInferBackend(geometry, torch.empty_like(ws), max_pages=260, fast_replan=False)
    rows = np.arange(3)
    seqs.step(rows, np.array([37, 5, 70]))
    for step in range(60):
        meta = seqs.step(rows, np.ones(3, dtype=np.int64), decode=True)
        pad = 1                                            # one padding row: a one-token sequence in page 255
        kv_indptr = np.concatenate([meta.kv_indptr, [meta.kv_indptr[-1] + 1]]).astype(np.int32)
        last = np.concatenate([meta.kv_last_page_len, [1]]).astype(np.int32)
        indices = torch.from_numpy(np.concatenate([meta.kv_indices, [255]]).astype(np.int32)).to(dev)
        q = torch.randn(3 + pad, heads, head_dim, device=dev, dtype=dtype)
        outs = []
        for p in (full, fast):
            p.plan(np.arange(bucket + 1), kv_indptr, last, indices, bucket=bucket)
            outs.append(p.run(q, kv))
        assert torch.equal(outs[0], outs[1]), step
    r = fast.replan
    print(f"head_dim {head_dim}: {r.summary()}")
    assert not r.off and r.fast_plans == 59


def _gen(model, ids, mask, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def _gen_logits(model, ids, mask, new):
    """(tokens, logits of every generated step [B, new, vocab] in fp32)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1).float()


@pytest.mark.parametrize("preset,layers", [("e4b", 8), ("31b", 6)])
def test_paged_generate_equals_eager_below_at_past_window(preset, layers):
    """Tokens equal HF eager's over 128 new tokens, and the logits of every step are as close to
    an fp32 run of the same weights as HF eager's bf16 logits are (bf16 tolerance: fused kernels
    round differently op by op, so the yardstick is eager's own bf16 error)."""
    pytest.importorskip("flashinfer")
    import copy

    from gemma4opt.presets import build_model

    model = build_model(preset, layers, dtype=torch.bfloat16, device="cuda")
    ref32 = copy.deepcopy(model).float()
    window = model.config.sliding_window
    new = 128
    cases = []
    for length in (window // 2, window, window + 40):
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(3, 5000, (2, length), generator=g).cuda()
        mask = torch.ones_like(ids)
        mask[1, : length // 4] = 0
        want, eager_logits = _gen_logits(model, ids, mask, new)
        with torch.no_grad():   # row 0 (no padding) teacher-forced in fp32: the logits of each generated step
            fp32 = ref32(want[:1, :-1]).logits[:, -new:].float()
        cases.append((ids, mask, want, (eager_logits[:1] - fp32).abs().mean().item(), fp32))
    del ref32
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=2, max_seq_len=2048))
    for ids, mask, want, err_eager, fp32 in cases:
        got, logits = _gen_logits(model, ids, mask, new)
        same = (got == want).float().mean().item()
        err = (logits[:1] - fp32).abs().mean().item()
        print(f"{preset}: prompt {ids.shape[1]}: {same:.1%} of tokens equal eager; mean |logit - fp32| over "
              f"{new} steps: eager bf16 {err_eager:.4f}, gemma4opt bf16 {err:.4f}")
        assert torch.equal(got, want)
        assert err <= 1.5 * err_eager + 1e-3
    # Every fusion at its expected count on the GPU's transformers too (paged_qkv included).
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), [(r.pattern, r.unfused) for r in rep.rows if not r.complete]


def test_decode_steps_do_not_sync():
    pytest.importorskip("flashinfer")
    from gemma4opt.paged.cache import PagedCache
    from gemma4opt.presets import build_model

    model = build_model("demo", dtype=torch.bfloat16, device="cuda")    # FlashInfer: 16-bit, head_dim >= 64
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=4, max_seq_len=256))
    ctx = model._gemma4opt.context
    ids = torch.randint(3, 100, (4, 40), device="cuda")              # past the window
    cache = PagedCache(ctx, model.config.num_hidden_layers)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, attention_mask=torch.ones_like(ids))
        for _ in range(3):      # compile and warm up outside the check
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(8):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cache.release()


def test_bucket_graphs_with_a_full_pool_equal_the_unpadded_run():
    """Issue 5's check: every batch size between the buckets, lengths crossing the sliding window,
    the pool filled to capacity: zero uncaptured steps, tokens equal the ungraphed paged run."""
    pytest.importorskip("flashinfer")
    import copy

    from gemma4opt.presets import build_model

    base = build_model("demo", dtype=torch.bfloat16, device="cuda")   # head_dim 64/128, window 32
    window = base.config.sliding_window
    cfg = gemma4opt.Gemma4OptConfig(attention="paged", page_size=4, max_batch_size=6, max_seq_len=96,
                                    decode_buckets=(1, 2, 4), kv_pool_pages=6 * 24 + 1)
    graphed, plain = copy.deepcopy(base), copy.deepcopy(base)
    gemma4opt.optimize(graphed, cfg)
    gemma4opt.optimize(plain, dataclasses.replace(cfg, cuda_graphs=False))
    gemma4opt.warmup(graphed)
    for batch in range(1, 7):
        g = torch.Generator().manual_seed(batch)
        lens = torch.randint(window - 3, window + 20, (batch,), generator=g)
        ids = torch.randint(3, 100, (batch, int(lens.max())), generator=g).cuda()
        mask = (torch.arange(ids.shape[1])[None] >= (lens.max() - lens)[:, None]).long().cuda()
        ids = ids * mask
        new = 96 - ids.shape[1] if batch == 6 else 24          # batch 6 runs the pool to its last page
        want = _gen(plain, ids, mask, new)
        assert torch.equal(_gen(graphed, ids, mask, new), want), batch
    st = graphed._gemma4opt
    assert not st.fallbacks, st.fallbacks
    assert st.graphed_calls > 0


def test_float32_model_is_refused_with_the_dtypes_flashinfer_supports():
    from gemma4opt.presets import build_model

    model = build_model("tiny", device="cuda")
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(attention="paged"))
    assert getattr(model, "_gemma4opt", None) is None          # refused before anything changed
