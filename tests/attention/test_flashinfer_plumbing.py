"""The CUDA path's plumbing, on a CPU: gemma4opt's FlashInfer-side code (per-kind plans from host
arrays, last-token plans for KV-shared layers, query gather/scatter, window/scale checks) runs
HF generate against a stand-in for FlashInfer's paged prefill wrapper that computes with the
reference attention over the plan it was given, in FlashInfer's relative positions. Tokens must
equal HF eager's. The kernels themselves are checked on a GPU (tests/gpu/test_gpu_paged.py).
The Triton decode backend's op runs its plain-torch reference on a CPU (the kernel is checked
against it in tests/kernels/test_paged_decode_kernel.py)."""
import sys
import types

import pytest
import torch

import gemma4opt
from gemma4opt.paged.backends.reference import paged_attention_reference
from tests.e2e.test_paged_generate import PAGED, _gen
from tests.models import VARIANTS, WINDOW, prompt, tiny


class _StandInWrapper:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper, as gemma4opt calls it, on the reference."""

    plans = 0

    def __init__(self, workspace, kv_layout="NHD", backend="auto", use_cuda_graph=False, **buffers):
        assert kv_layout == "NHD"
        if use_cuda_graph:      # graph mode: the four index buffers at fixed addresses
            assert set(buffers) == {"qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                                    "paged_kv_last_page_len_buf"}
        self.graph_buffers = buffers
        self.backend = backend
        self.m = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, causal=True, window_left=-1, sm_scale=None, q_data_type=None, kv_data_type=None,
             non_blocking=True, seq_lens=None, max_token_per_sequence=None):
        for t in (qo_indptr, kv_indptr, kv_last_page_len, seq_lens):   # host arrays: plan never reads the device
            assert t.device.type == "cpu" and t.dtype == torch.int32
        # What FlashInfer would derive itself (flashinfer.page.get_seq_lens, max of qo lengths).
        live = kv_indptr[1:] - kv_indptr[:-1]
        assert torch.equal(seq_lens, (torch.clamp(live - 1, min=0) * page_size + kv_last_page_len).int())
        assert max_token_per_sequence == int((qo_indptr[1:] - qo_indptr[:-1]).max())
        assert causal
        if torch.equal(qo_indptr, torch.arange(len(qo_indptr), dtype=torch.int32)):
            assert self.backend == "fa2", "decode plans run on FA2 (split KV), not FA3"
        if kv_data_type == torch.float8_e4m3fn:
            assert self.backend == "fa2", "FlashInfer's FA3 reads fp8 KV only with fp8 queries"
        _StandInWrapper.plans += 1
        if self.graph_buffers:  # a graph replays one batch size and at most the buffers' pages
            assert len(qo_indptr) == len(self.graph_buffers["qo_indptr_buf"])
            assert len(kv_indices) <= len(self.graph_buffers["paged_kv_indices_buf"])
        self.m = dict(qo=qo_indptr.clone(), indptr=kv_indptr.clone(), indices=kv_indices.clone(),
                      last=kv_last_page_len.clone(), window_left=window_left, scale=sm_scale,
                      dims=(num_qo_heads, num_kv_heads, head_dim), ps=page_size, kv_dtype=kv_data_type,
                      q_dtype=q_data_type)

    def run(self, q, kv, k_scale=None, v_scale=None):
        m = self.m
        assert q.shape[0] == int(m["qo"][-1]) and tuple(q.shape[1:]) == (m["dims"][0], m["dims"][2])
        assert q.dtype == m["q_dtype"] and kv.dtype == m["kv_dtype"]      # FlashInfer checks them against the plan
        scale, fp8 = m["scale"], kv.dtype == torch.float8_e4m3fn
        if fp8:
            # FlashInfer's run(): floats (a tensor would become the kernel's double sm_scale), k's
            # folded into the softmax scale, v's multiplying the output; pages read unscaled.
            assert type(k_scale) is float and type(v_scale) is float
            scale *= k_scale
        else:
            assert k_scale is None and v_scale is None
        live = m["indptr"][1:] - m["indptr"][:-1]
        kv_len = torch.where(live > 0, (live - 1) * m["ps"] + m["last"], torch.zeros_like(live))
        window = m["window_left"] + 1 if m["window_left"] >= 0 else None
        # Relative positions: the first live token is position 0, queries are the last ones.
        out = paged_attention_reference(q, kv, m["indptr"], m["indices"].long(), m["last"], torch.zeros_like(live),
                                        m["qo"], kv_len, window, scale, torch.ones(2) if fp8 else None)
        return out * v_scale if fp8 else out


def use_cuda_backends(model, config=PAGED, flashinfer_kinds=()):
    """The backends optimize() picks on CUDA, installed on a CPU model (FlashInfer stood in by the
    caller); ``flashinfer_kinds`` decode on FlashInfer, as decode_kernel="auto" does for head_dim 512."""
    from gemma4opt.paged.backends import choose, geometries

    ctx = model._gemma4opt.context
    pages = ctx.seqs["full_attention"].pool.num_pages
    backends = choose(geometries(model.config.get_text_config(), config.page_size, "cpu", torch.float32, ctx.kv_dtype),
                      True,
                      config.decode_kernel, max_pages=pages + ctx.max_batch, max_batch=ctx.max_batch)
    for kind in flashinfer_kinds:
        backends[kind].decode = backends[kind].prefill
    ctx.use_backends(backends)
    return ctx


@pytest.mark.parametrize("variant", VARIANTS)
def test_flashinfer_path_tokens_equal_eager(monkeypatch, variant):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    model = tiny(variant)
    ids = prompt(2, WINDOW + 6)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    want = _gen(model, ids, new=12, attention_mask=mask)
    gemma4opt.optimize(model, PAGED)
    ctx = use_cuda_backends(model, PAGED, flashinfer_kinds=("sliding_attention", "full_attention"))
    _StandInWrapper.plans = 0
    got = _gen(model, ids, new=12, attention_mask=mask)
    assert torch.equal(got, want)
    shared = model.config.num_kv_shared_layers > 0
    # One plan per kind per step (+ the last-token plan of each kind at prefill with KV sharing).
    assert _StandInWrapper.plans == 2 * 12 + (2 if shared else 0)
    assert all(kb.prefill.plans == 12 and kb.prefill.decode_plans == 11 for kb in ctx.backends.values())


def test_a_wrappers_next_plan_waits_only_until_its_last_plan_was_copied(monkeypatch):
    """FlashInfer stages a plan in one pinned buffer per wrapper: with the host a step ahead,
    the next plan() of that wrapper must wait for the GPU to have copied the last one out, and
    must not wait when it has (no sync in steady decode)."""
    import numpy as np

    from gemma4opt.paged.backends import flashinfer as fi

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    waits, done = [], {"now": False}

    class Event:                   # a CUDA event whose completion the test decides
        def record(self):
            pass

        def query(self):
            return done["now"]

        def synchronize(self):
            waits.append(1)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    workspace = types.SimpleNamespace(is_cuda=True, device=torch.device("cpu"))   # as on a GPU
    geometry = fi.KindGeometry("full_attention", 4, 2, 8, 4, None, torch.float32, torch.float32)
    plan = fi.FlashInferBackend(geometry, workspace)
    kv = torch.zeros(3, dtype=torch.int32)

    def step():
        plan.plan(np.arange(3), np.array([0, 1, 3]), np.array([2, 4]), kv)

    step()
    assert waits == []             # nothing planned before
    step()
    assert waits == [1]            # the last plan's copy had not run: wait for it
    done["now"] = True
    step()
    assert waits == [1]            # it had: no wait


def test_workspace_covers_flashinfers_split_kv_scratch_of_the_largest_bucket():
    from gemma4opt.paged.backends.flashinfer import WORKSPACE_BYTES, workspace_bytes

    kinds = [(32, 16, 256), (32, 4, 512)]                  # the 31b's sliding and full layers
    assert workspace_bytes(kinds, 8, 132) == WORKSPACE_BYTES
    # Measured on an H200: FlashInfer asked for 401,604,608 bytes of partial outputs alone at
    # 512 rows (and failed in a 256 MB workspace); the full layers need ~767 tiles of 16 x 512.
    big = workspace_bytes(kinds, 512, 132)
    assert big >= 32 * 767 * 16 * 513 * 4 > 401_604_608
    assert workspace_bytes(kinds, 1024, 132) > big


@pytest.mark.parametrize("variant", ["tiny-ple-shared", "tiny-moe"])
def test_triton_decode_without_graphs_plans_prefill_only(monkeypatch, variant):
    """decode_kernel="triton" (the default) off graphs: FlashInfer plans the prefill, decode steps
    run the Triton backend on the mirrored page tables; tokens equal eager."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    model = tiny(variant)
    ids = prompt(2, WINDOW + 6)
    want = _gen(model, ids, new=12)
    gemma4opt.optimize(model, PAGED)
    ctx = use_cuda_backends(model, PAGED)
    _StandInWrapper.plans = 0
    got = _gen(model, ids, new=12)
    assert torch.equal(got, want)
    shared = model.config.num_kv_shared_layers > 0
    assert _StandInWrapper.plans == 2 + (2 if shared else 0)            # the prefill's, nothing per decode step
    assert all(kb.decode.name == "triton" and kb.decode.steps == 11 for kb in ctx.backends.values())
    for kind, table in ctx.tables.items():                               # the mirror equals the host's table
        assert torch.equal(table, torch.from_numpy(ctx.seqs[kind].table))


@pytest.mark.parametrize("decode", ["flashinfer", "triton"])
def test_fp8_pool_on_the_flashinfer_path(monkeypatch, decode):
    """kv_cache_dtype="fp8" with the CUDA backends (FlashInfer stood in): plans name the fp8 pool
    and FA2, runs get the layer's scales as floats (set per layer), and the tokens equal HF eager
    over an e4m3-rounding cache at the same scales."""
    from tests.e2e.test_paged_fp8_kv import FP8, fp8_reference

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    model = tiny("tiny-ple-shared")
    ids = prompt(2, WINDOW + 6)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    gemma4opt.optimize(model, FP8)
    kinds = ("sliding_attention", "full_attention") if decode == "flashinfer" else ()
    ctx = use_cuda_backends(model, FP8, flashinfer_kinds=kinds)
    scales = {layer: (2.0 ** -(layer % 3), 2.0 ** (layer % 2)) for layer in ctx.kv}
    for layer, (ks, vs) in scales.items():
        ctx.set_kv_scales(layer, ks, vs)
    want = fp8_reference(model, ids, scales, new=12, attention_mask=mask)
    assert torch.equal(_gen(model, ids, new=12, attention_mask=mask), want)
    assert all(kb.prefill.fp8 and kb.prefill.backend == "fa2" for kb in ctx.backends.values())
    assert all(kb.decode.name == decode for kb in ctx.backends.values())


def test_flashinfer_refuses_fp8_pages_at_head_dim_64():
    from gemma4opt.paged.backends.base import KindGeometry
    from gemma4opt.paged.backends.flashinfer import FlashInferBackend

    def geometry(head_dim, kv_dtype):
        return KindGeometry("full_attention", 8, 2, head_dim, 16, None, torch.bfloat16, kv_dtype)

    assert FlashInferBackend.refuses(geometry(256, torch.float8_e4m3fn)) is None
    assert FlashInferBackend.refuses(geometry(512, torch.float8_e4m3fn)) is None
    assert FlashInferBackend.refuses(geometry(64, torch.bfloat16)) is None
    assert "fp8 KV pool at head_dim 64" in FlashInferBackend.refuses(geometry(64, torch.float8_e4m3fn))
    assert "float16" in FlashInferBackend.refuses(geometry(256, torch.float16))


def test_fp8_pages_above_head_dim_256_prefill_on_the_reference_before_sm100(monkeypatch):
    """FlashInfer 0.6 builds FA2 with one-byte KV above head_dim 256 for sm100+ only: on a Hopper
    the head_dim-512 kind of an fp8 pool prefills on the reference and decodes on the Triton kernel
    (whatever decode_kernel says), the report says why; bf16 pools and sm100 keep FlashInfer."""
    from gemma4opt.paged.backends import choose
    from gemma4opt.paged.backends import flashinfer as fi
    from gemma4opt.paged.backends.base import KindGeometry

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))

    def geoms(kv_dtype):
        return {"sliding_attention": KindGeometry("sliding_attention", 8, 4, 256, 16, 32, torch.bfloat16, kv_dtype),
                "full_attention": KindGeometry("full_attention", 8, 2, 512, 16, None, torch.bfloat16, kv_dtype)}

    for decode_kernel in ("triton", "flashinfer", "auto"):
        got = choose(geoms(torch.float8_e4m3fn), True, decode_kernel, max_pages=8, max_batch=2)
        full, sliding = got["full_attention"], got["sliding_attention"]
        assert (full.prefill.name, full.decode.name) == ("reference", "triton")
        assert "sm100+" in full.refused["flashinfer"] and "sm_90" in full.refused["flashinfer"]
        assert sliding.prefill.name == "flashinfer"
    got = choose(geoms(torch.bfloat16), True, "auto", max_pages=8, max_batch=2)
    assert got["full_attention"].prefill.name == got["full_attention"].decode.name == "flashinfer"
    monkeypatch.setattr(fi, "device_capability", lambda device: (10, 0))
    got = choose(geoms(torch.float8_e4m3fn), True, "auto", max_pages=8, max_batch=2)
    assert got["full_attention"].prefill.name == "flashinfer"
