"""Paged decode as CUDA graphs over batch buckets, on a CPU: HF generate with batches between
buckets (padded with the dummy sequence), graphs stood in as in test_decode_graphs and
FlashInfer as in test_flashinfer_plumbing. Tokens must equal HF eager's."""
import dataclasses
import gc
import sys
import types

import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.runtime import decode_graphs
from tests.attention.test_flashinfer_plumbing import _StandInWrapper, use_cuda_backends
from tests.e2e.test_paged_generate import _gen
from tests.models import WINDOW, prompt, tiny
from tests.runtime.test_decode_graphs import _cpu_capture, _patch, _RecordingCapture

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)


def _optimize_with_stand_ins(monkeypatch, model, config=PAGED, flashinfer_kinds=()):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    _patch(monkeypatch)
    monkeypatch.setattr(decode_graphs._cuda, "graph", _RecordingCapture)
    monkeypatch.setattr(decode_graphs._cuda, "graph_pool_handle", lambda: None, raising=False)
    monkeypatch.setattr(decode_graphs.GraphedDecode, "_capture", _cpu_capture)
    resolve = Gemma4OptConfig.resolve
    monkeypatch.setattr(Gemma4OptConfig, "resolve", lambda self, device, *a: dataclasses.replace(
        resolve(self, device, *a), cuda_graphs=True))
    gemma4opt.optimize(model, config)
    ctx = use_cuda_backends(model, config, flashinfer_kinds)
    return ctx


def test_batches_between_buckets_replay_padded_graphs(monkeypatch):
    model = tiny("tiny-ple-shared")
    cases = []
    for batch in (1, 3, 4, 2):
        ids = prompt(batch, WINDOW + 2, seed=batch)
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1, :3] = 0
            ids[1, :3] = 0
        cases.append((ids, mask, _gen(model, ids, new=10, attention_mask=mask)))
    ctx = _optimize_with_stand_ins(monkeypatch, model)
    assert ctx.buckets == (1, 2, 4) and set(ctx.dummy_page) == {"sliding_attention", "full_attention"}
    for ids, mask, want in cases * 2:      # twice: the second round replays only
        assert torch.equal(_gen(model, ids, new=10, attention_mask=mask), want)
    st = model._gemma4opt
    rep = gemma4opt.report(model, print_table=False)
    assert not st.fallbacks, st.fallbacks
    assert st.graph_captures <= 2 * len(ctx.buckets), str(rep)     # per bucket (and per Dynamo recompile)
    decode_steps = 2 * 4 * 9
    assert st.graphed_calls >= decode_steps - st.graph_warmups - st.graph_captures, str(rep)
    assert all(s.pages_held() == 0 for s in ctx.seqs.values())
    # Every decode step ran the Triton backend on the page tables, none planned.
    assert all(kb.decode.name == "triton" and kb.decode.steps >= decode_steps for kb in ctx.backends.values())
    assert "decode triton (steps" in rep.attention


@pytest.mark.parametrize("kernel", ["triton", "flashinfer", "mixed"])
def test_full_pool_still_pads_and_bigger_batches_run_uncaptured(monkeypatch, kernel):
    model = tiny("tiny")
    # A pool just big enough for the 4 sequences below: padding must not need a free page.
    config = dataclasses.replace(PAGED, max_batch_size=4, decode_buckets=(2,), kv_pool_pages=4 * 6 + 1,
                                 decode_kernel="triton" if kernel == "mixed" else kernel)
    ids = prompt(3, 12)
    want = _gen(model, ids, new=8)
    want1 = _gen(model, ids[:1], new=8)
    # mixed: sliding layers on the Triton kernel, full layers on FlashInfer's planned decode.
    ctx = _optimize_with_stand_ins(monkeypatch, model, config,
                                   flashinfer_kinds=("full_attention",) if kernel == "mixed" else ())
    assert ctx.buckets == (2, 4)
    assert torch.equal(_gen(model, ids, new=8), want)          # bucket 4: one padding row
    assert torch.equal(_gen(model, ids[:1], new=8), want1)     # bucket 2: one padding row
    assert model._gemma4opt.graphed_calls > 0 and not model._gemma4opt.fallbacks
    triton = {k for k, kb in ctx.backends.items() if kb.decode.name == "triton" and kb.decode.steps > 0}
    assert triton == {"triton": set(ctx.backends), "flashinfer": set(), "mixed": {"sliding_attention"}}[kernel]


def test_warmup_captures_every_bucket_then_generate_only_replays(monkeypatch, capsys):
    model = tiny("tiny")
    ids = prompt(3, 12)
    wants = [(ids[:b], _gen(model, ids[:b], new=8)) for b in (1, 2, 3)]
    ctx = _optimize_with_stand_ins(monkeypatch, model)
    took = gemma4opt.warmup(model)
    assert sorted(took) == [1, 2, 4]
    assert "gemma4opt warm-up [######]" in capsys.readouterr().err
    st = model._gemma4opt
    captures, warmups, replays = st.graph_captures, st.graph_warmups, st.graphed_calls
    assert captures >= len(ctx.buckets)
    for batch_ids, want in wants:                                     # buckets 1, 2 and 4
        assert torch.equal(_gen(model, batch_ids, new=8), want)
    assert (st.graph_captures, st.graph_warmups) == (captures, warmups), "generate captured after warm-up"
    assert st.graphed_calls == replays + 3 * 7


@pytest.mark.parametrize("kernel", ["triton", "flashinfer", "mixed"])
def test_staged_metadata_is_read_in_place_not_copied_per_replay(monkeypatch, kernel):
    """The step's staged arrays sit at the same addresses every step of a layout, so the decode
    graphs bake them like the KV pool: the only per-step copies are HF's own inputs. The page
    lists FlashInfer's plan reads change length as pages come and go; they are staged after the
    graph's inputs, so those keep their addresses and no step is captured anew."""
    model = tiny("tiny")
    ids = prompt(3, 12)
    want = _gen(model, ids, new=8)
    runners = []
    graphed = decode_graphs.graphed_decode

    def recording(state, root, gm, example_inputs):
        runner = graphed(state, root, gm, example_inputs)
        runners.append((runner, list(example_inputs)))
        return runner

    monkeypatch.setattr(decode_graphs, "graphed_decode", recording)
    config = dataclasses.replace(PAGED, decode_kernel="triton" if kernel == "mixed" else kernel)
    ctx = _optimize_with_stand_ins(monkeypatch, model, config,
                                   flashinfer_kinds=("full_attention",) if kernel == "mixed" else ())
    assert torch.equal(_gen(model, ids, new=8), want)       # page size 4: pages come every 4 steps
    st = model._gemma4opt
    assert st.graphed_calls > 0 and not st.fallbacks
    moved = [k for k in st.graph_key_changes if k.startswith("address")]
    assert not moved, (moved, gemma4opt.report(model, print_table=False))     # no warm-up or capture anew
    staged = ctx.staging.host[0].untyped_storage().data_ptr()
    tables = ctx.table_dev.untyped_storage().data_ptr()
    for runner, inputs in runners:
        read = {inputs[i].untyped_storage().data_ptr() for i in runner.fixed}
        assert staged in read, "the graph reads the staged metadata"
        assert kernel == "flashinfer" or tables in read, "and the Triton kernel's page tables"
        for i in runner.moving:
            if inputs[i].numel():
                assert inputs[i].untyped_storage().data_ptr() not in (staged, tables), runner.gm.graph


def test_assisted_decoding_replays_the_assistants_decode_graphs(monkeypatch):
    """HF's assisted decoding with an optimized assistant (a constant 4-token draft): the
    assistant's cache is cropped between rounds, its drafting steps replay its decode graphs, and
    the tokens are HF eager's. (The target runs the "hf" mode here: the FlashInfer stand-in serves
    one model's plans at a time.)"""
    import copy

    target, assistant = tiny("tiny"), tiny("tiny", seed=3)
    ref, ref_assistant = copy.deepcopy(target), copy.deepcopy(assistant)
    ctx = _optimize_with_stand_ins(monkeypatch, assistant)
    gemma4opt.optimize(target, Gemma4OptConfig(attention="hf"))
    for m in (assistant, ref_assistant):
        m.generation_config.num_assistant_tokens_schedule = "constant"
        m.generation_config.num_assistant_tokens = 4
        m.generation_config.assistant_confidence_threshold = 0.0     # else a low-confidence draft stops early
    ids = prompt(1, WINDOW + 3)
    want = _gen(ref, ids, new=12, assistant_model=ref_assistant)
    got = _gen(target, ids, new=12, assistant_model=assistant)
    assert torch.equal(got, want)
    st = assistant._gemma4opt
    assert st.graphed_calls > 0 and st.graph_captures > 0
    gc.collect()        # HF's candidate generator held the assistant's (returned) cache in a cycle
    ctx.free_collected()
    assert all(s.pages_held() == 0 for s in ctx.seqs.values())


@pytest.mark.parametrize("variant", ["tiny", "tiny-ple-shared"])
def test_assisted_verify_steps_replay_token_graphs(monkeypatch, variant):
    """The target of assisted decoding verifies each draft (draft + 1 tokens per sequence) as a
    CUDA-graph replay padded to a token bucket (here 3 + 1 tokens -> bucket 4, and shorter drafts
    near the end -> 2): tokens equal HF eager's assisted run, and after the first round of each
    shape (warm-up, capture) every verify step replays."""
    import copy

    target, assistant = tiny(variant), tiny("tiny", seed=3)
    ref, ref_assistant = copy.deepcopy(target), copy.deepcopy(assistant)
    ctx = _optimize_with_stand_ins(monkeypatch, target, dataclasses.replace(PAGED, max_batch_size=8))
    for m in (assistant, ref_assistant):
        m.generation_config.num_assistant_tokens_schedule = "constant"
        m.generation_config.num_assistant_tokens = 3
        m.generation_config.assistant_confidence_threshold = 0.0
    ids = prompt(1, WINDOW + 3)
    want = _gen(ref, ids, new=14, assistant_model=ref_assistant)
    got = _gen(target, ids, new=14, assistant_model=assistant)
    again = _gen(target, ids, new=14, assistant_model=assistant)
    assert torch.equal(got, want) and torch.equal(again, want)
    st = target._gemma4opt
    rep = gemma4opt.report(target, print_table=False)
    assert not st.fallbacks, st.fallbacks
    verify = st.compiled_calls - 2      # every call but the two prefills
    assert st.graphed_calls >= verify - st.graph_warmups - st.graph_captures and st.graphed_calls > 0, str(rep)
    assert all(kb.decode.name == "triton" and kb.decode.steps > 0 for kb in ctx.backends.values())
    gc.collect()
    ctx.free_collected()
    assert all(s.pages_held() == 0 for s in ctx.seqs.values())


def test_continuing_a_returned_cache_with_a_few_tokens_replays_a_token_graph(monkeypatch):
    """A returned PagedCache continued with a few new tokens (the last answer token and a short
    reply): that step runs as a token-bucket graph, left padding among earlier tokens and all.
    Tokens equal HF eager continuing its DynamicCache."""
    model = tiny("tiny-ple-shared")
    ids = prompt(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    more = prompt(2, 2, seed=5)

    def run(m):
        with torch.no_grad():
            out = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
            seq = torch.cat([out.sequences, more], 1)
            cache = getattr(out, "cache", None) or out.past_key_values
            return m.generate(seq, attention_mask=torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1),
                              past_key_values=cache, max_new_tokens=5, do_sample=False)

    want = run(model)
    _optimize_with_stand_ins(monkeypatch, model, dataclasses.replace(PAGED, max_batch_size=8))
    for _ in range(3):                   # warm-up, capture, replay
        assert torch.equal(run(model), want)
    st = model._gemma4opt
    assert not st.fallbacks, st.fallbacks
    assert st.graphed_calls >= 3 * 2 * 4 - st.graph_warmups - st.graph_captures
