"""Paged KV pool sizing: max_batch_size full-length sequences, capped by free GPU memory."""
import dataclasses

import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.paged.tables import PoolExhausted
from gemma4opt.paged import pool, step
from gemma4opt.paged.pool import pool_pages
from tests.models import prompt, tiny

CFG = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)


def _page_bytes(model):
    """One page of every layer that owns KV, counted from the pool optimize() built."""
    return sum(t[0].numel() * t.element_size() for t in model._gemma4opt.context.kv.values())


def test_default_is_max_batch_full_length_sequences_without_a_device_cap():
    cfg = tiny("tiny").config
    assert pool_pages(cfg, CFG, torch.float32, None) == 4 * (96 // 4 + 1)


def test_fraction_caps_the_pool_at_what_fits_in_free_memory(monkeypatch):
    model = tiny("tiny")
    gemma4opt.optimize(model, CFG)
    page = _page_bytes(model)
    cfg = model.config
    want = 4 * (96 // 4 + 1)
    frac = dataclasses.replace(CFG, kv_pool_fraction=0.5)
    assert pool_pages(cfg, frac, torch.float32, 10 * page) == 5           # 0.5 of 10 pages' bytes
    assert pool_pages(cfg, frac, torch.float32, 10 * want * page) == want  # never more than needed
    with pytest.raises(ValueError, match="kv_pool_fraction=0.5: 1 KV pages"):
        pool_pages(cfg, frac, torch.float32, 3 * page)
    fixed = dataclasses.replace(CFG, kv_pool_pages=7, kv_pool_fraction=0.5)
    assert pool_pages(cfg, fixed, torch.float32, page) == 7               # an explicit size wins


def test_a_pool_that_cannot_fit_is_refused_with_the_sizes():
    cfg = tiny("tiny").config
    with pytest.raises(ValueError, match=r"max_batch_size=4 .*max_seq_len=96.*kv_pool_fraction"):
        pool_pages(cfg, CFG, torch.float32, 1000)


def test_capped_pool_runs_generate_and_reports_exhaustion(monkeypatch):
    model = tiny("tiny")
    probe = tiny("tiny")
    gemma4opt.optimize(probe, CFG)
    page = _page_bytes(probe)
    monkeypatch.setattr(step, "free_device_memory", lambda device: 20 * page)
    gemma4opt.optimize(model, dataclasses.replace(CFG, kv_pool_fraction=0.5))
    ctx = model._gemma4opt.context
    assert ctx.seqs["full_attention"].pool.num_pages == 10
    with torch.no_grad():
        out = model.generate(prompt(1, 9), max_new_tokens=6, do_sample=False)     # 4 pages of 4 tokens
    assert out.shape[1] == 15
    with pytest.raises(PoolExhausted, match="kv_pool_fraction"), torch.no_grad():
        model.generate(prompt(2, 30), max_new_tokens=4, do_sample=False)          # 16 pages: too many


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_fraction_is_validated(bad):
    with pytest.raises(ValueError, match="kv_pool_fraction"):
        Gemma4OptConfig(kv_pool_fraction=bad)


def test_unset_sizes_take_the_model_context_and_half_the_free_memory():
    model = tiny("tiny")
    cfg = model.config
    auto = Gemma4OptConfig(attention="paged", page_size=4).resolve("cpu", torch.float32, cfg)
    assert auto.max_seq_len == cfg.max_position_embeddings and auto.max_batch_size == 256
    assert auto.kv_pool_fraction == 0.5 and auto.decode_buckets[-1] == 64
    probe = tiny("tiny")
    gemma4opt.optimize(probe, CFG)
    page = _page_bytes(probe)
    assert pool_pages(cfg, auto, torch.float32, 1000 * page) == 500                    # half of what is free
    need = 256 * (cfg.max_position_embeddings // 4 + 1)
    assert pool_pages(cfg, auto, torch.float32, 10 * need * page) == need             # never more than needed
    # CPU (no device to measure): capped at CPU_KV_POOL_BYTES.
    assert pool_pages(cfg, auto, torch.float32, None) == min(need, pool.CPU_KV_POOL_BYTES // page)
    # Explicit sizes keep their meaning: exactly max_batch_size full-length sequences.
    sized = Gemma4OptConfig(attention="paged", page_size=4, max_batch_size=2, max_seq_len=40).resolve("cpu")
    assert sized.kv_pool_fraction is None and pool_pages(cfg, sized, torch.float32, 1000 * page) == 2 * 11


def test_optimize_without_sizes_runs_paged_generate():
    model = tiny("tiny")
    ref = __import__("copy").deepcopy(model)
    gemma4opt.optimize(model, Gemma4OptConfig(attention="paged"))
    ids = prompt(2, 11)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                           ref.generate(ids, max_new_tokens=5, do_sample=False))
    assert "paged" in gemma4opt.report(model, print_table=False).attention
