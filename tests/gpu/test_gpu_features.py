"""On the GPU machine: HF generate features on the one-liner (attention="auto" -> paged on CUDA),
against HF eager on a copy taken before optimize, with decode running as CUDA-graph replays.

Needs flashinfer (the [gpu] extra). The 31b's real head dims (256 / 512) at a few layers, so a
machine that ran the speed suite has FlashInfer's kernels compiled already.
"""
import copy

import pytest
import torch

import gemma4opt
from gemma4opt.presets import build_model

pytestmark = pytest.mark.gpu


def _prompt(batch, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g).cuda()
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, : length // 3] = 0            # row 1 left-padded
        ids[1, : length // 3] = 0
    return ids, mask


def _greedy(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)


@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("flashinfer")
    model = build_model("31b", 6, dtype=torch.bfloat16, device="cuda")
    ref = copy.deepcopy(model)
    gemma4opt.optimize(model)
    assert gemma4opt.report(model, print_table=False).mode.startswith("auto on CUDA: paged")
    return model, ref


def test_continuing_from_a_returned_paged_cache_replays_graphs_and_equals_eager(pair):
    model, ref = pair
    vocab = model.config.vocab_size
    ids, mask = _prompt(2, 40, vocab)
    first = _greedy(model, ids, mask, 8, return_dict_in_generate=True)
    want_first = _greedy(ref, ids, mask, 8, return_dict_in_generate=True)
    assert torch.equal(first.sequences, want_first.sequences)
    user, _ = _prompt(2, 5, vocab, seed=1)
    more = torch.cat([first.sequences, user], 1)
    more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype, device="cuda")], 1)
    state = model._gemma4opt
    replays = state.graphed_calls
    got = _greedy(model, more, more_mask, 8, past_key_values=first.past_key_values)
    want = _greedy(ref, more, more_mask, 8, past_key_values=want_first.past_key_values)
    assert torch.equal(got, want)
    assert state.graphed_calls - replays >= 6, "the continued generate's decode steps did not replay CUDA graphs"


def test_assisted_decoding_with_an_optimized_assistant_replays_graphs_and_equals_eager(pair):
    model, ref = pair
    assistant = build_model("e2b", 4, dtype=torch.bfloat16, device="cuda", seed=1)
    ref_assistant = copy.deepcopy(assistant)
    gemma4opt.optimize(assistant)
    # A constant draft of 4 tokens: with random weights HF's heuristic schedule and its confidence
    # threshold cut the draft to one token, and the assistant then never runs a one-token decode
    # step to replay.
    for m in (assistant, ref_assistant):
        m.generation_config.num_assistant_tokens_schedule = "constant"
        m.generation_config.num_assistant_tokens = 4
        m.generation_config.assistant_confidence_threshold = 0.0     # else a low-confidence draft stops early
    ids, mask = _prompt(1, 24, model.config.vocab_size, seed=2)
    want = _greedy(ref, ids, mask, 16, assistant_model=ref_assistant)
    got = _greedy(model, ids, mask, 16, assistant_model=assistant)
    assert torch.equal(got, want)
    assert assistant._gemma4opt.graphed_calls > 0, "the assistant's drafting did not replay CUDA graphs"
    # The target verifies each 4-token draft as a 5-token step: a token-bucket graph, captured
    # in the first run, replayed in the second.
    replays = model._gemma4opt.graphed_calls
    assert torch.equal(_greedy(model, ids, mask, 16, assistant_model=assistant), want)
    assert model._gemma4opt.graphed_calls - replays >= 3, "the target's draft verification did not replay graphs"
    lookup = _greedy(model, ids, mask, 16, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, _greedy(ref, ids, mask, 16, prompt_lookup_num_tokens=3))


def test_a_deep_copy_runs_its_own_weights_in_its_own_graphs():
    """copy.deepcopy of the one-liner (paged, decode graphs): the copy is optimized again, with its own
    KV pool and graphs, and an in-place edit of its weights shows in its tokens only, as in a model
    edited the same way before optimize() (tests/e2e/test_dropin_copy.py on the CPU)."""
    pytest.importorskip("flashinfer")

    def edit_(m):
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.down_proj.weight.mul_(-3.0)
            m.model.norm.weight.neg_()      # the logits negated: a 2-layer random model's tokens change

    model = build_model("e2b", 2, dtype=torch.bfloat16, device="cuda")
    edited = copy.deepcopy(model)
    edit_(edited)
    gemma4opt.optimize(model)
    gemma4opt.optimize(edited)
    ids, mask = _prompt(2, 20, model.config.vocab_size)
    before = _greedy(model, ids, mask, 8)
    twin = copy.deepcopy(model)
    assert twin._gemma4opt.context is not model._gemma4opt.context
    assert torch.equal(_greedy(twin, ids, mask, 8), before)
    edit_(twin)
    assert torch.equal(_greedy(twin, ids, mask, 8), _greedy(edited, ids, mask, 8))
    assert not torch.equal(_greedy(twin, ids, mask, 8), before)
    assert torch.equal(_greedy(model, ids, mask, 8), before)
    assert twin._gemma4opt.graphed_calls > 0, "the copy's decode did not replay its own graphs"


def test_a_pickled_model_loads_optimized_on_the_gpu():
    """torch.save / torch.load of the one-liner on CUDA: the loaded model is optimized again with the
    same config, its own KV pool and graphs, and gives the saved model's tokens (on the CPU:
    tests/e2e/test_dropin_copy.py)."""
    import io

    pytest.importorskip("flashinfer")
    model = build_model("e2b", 2, dtype=torch.bfloat16, device="cuda")
    gemma4opt.optimize(model)
    ids, mask = _prompt(2, 20, model.config.vocab_size)
    before = _greedy(model, ids, mask, 8)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._gemma4opt is not model._gemma4opt and loaded._gemma4opt.context is not model._gemma4opt.context
    assert loaded._gemma4opt.config == model._gemma4opt.config
    assert next(loaded.parameters()).device.type == "cuda"
    assert torch.equal(_greedy(loaded, ids, mask, 8), before)
    assert loaded._gemma4opt.graphed_calls > 0, "the loaded model's decode did not replay its own graphs"
    assert torch.equal(_greedy(model, ids, mask, 8), before)
