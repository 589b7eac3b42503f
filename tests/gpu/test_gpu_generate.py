"""On the GPU machine: the CUDA path (Triton kernels, Inductor, static cache + CUDA graphs) against HF eager."""
import pytest
import torch

import gemma4opt
from gemma4opt.presets import build_model
from tests.models import VARIANTS, WINDOW, prompt

pytestmark = pytest.mark.gpu


def _gen(model, ids, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)


@pytest.mark.parametrize("inductor", [True, False], ids=["inductor", "captured"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_variants_fp32_tokens_equal_eager(variant, inductor):
    model = build_model(variant, device="cuda")
    ids = prompt(2, WINDOW + 5).cuda()
    want = _gen(model, ids, 16)
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(inductor=inductor))
    assert torch.equal(_gen(model, ids, 16), want)
    assert torch.equal(_gen(model, ids, 16), want)      # the second call replays the first one's graphs
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), str(rep)
    assert rep.graphed_calls > 0, "decode did not run as CUDA graph replays"
    if not inductor:   # gemma4opt's runner: at most two warm-ups (Dynamo compiles decode twice), one capture
        assert rep.graph_captures == 1 and rep.graph_warmups <= 2, str(rep)
        assert rep.graphed_calls == 2 * 15 - rep.graph_warmups, str(rep)


@pytest.mark.parametrize("preset", ["31b", "e4b"])
def test_real_dims_bf16_error_no_worse_than_eager(preset):
    """bf16 rounds differently in fused kernels than op by op, and random weights amplify it;
    so both bf16 runs are measured against an fp32 run of the same weights."""
    import copy

    model = build_model(preset, layers=4 if preset == "31b" else 8, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(3, 1000, (1, 64)).cuda()
    with torch.no_grad():
        ref32 = copy.deepcopy(model).float()(ids).logits.float()
        eager = model(ids).logits.float()
        gemma4opt.optimize(model)
        fused = model(ids).logits.float()
    err_eager = (eager - ref32).abs().mean().item()
    err_fused = (fused - ref32).abs().mean().item()
    print(f"{preset}: mean |logit - fp32| eager bf16 {err_eager:.4f}, gemma4opt bf16 {err_fused:.4f}")
    assert err_fused <= 1.5 * err_eager + 1e-3


def test_graphed_generate_does_not_sync_in_gemma4opt_code():
    """A warmed-up generate (decode as graph replays, HF's stop check deferred) makes no
    synchronizing CUDA call from gemma4opt's code or from the compiled graph: torch's sync
    debug mode warns at the Python line that synchronized, and none of those lines is ours.

    (Calling forward directly in a loop needs generate's per-step inputs: a fixed-shape mask
    dict; without it HF derives positions from the cache's host token count, every step keys a
    new graph and runs eagerly, and the report names that input.)"""
    import warnings

    model = build_model("tiny", device="cuda")
    gemma4opt.optimize(model)
    ids = prompt(2, 12).cuda()
    _gen(model, ids, 24)                             # compile, warm up, capture
    before = gemma4opt.report(model, print_table=False).graphed_calls
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _gen(model, ids, 24)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    ours = [f"{w.filename}:{w.lineno}" for w in syncs
            if "gemma4opt" in w.filename or w.filename.startswith("<eval_with_key")]
    print(f"synchronizing calls in one generate of 24 tokens: {len(syncs)} in all, {len(ours)} from gemma4opt")
    assert not ours, ours
    assert gemma4opt.report(model, print_table=False).graphed_calls - before == 23


@pytest.mark.parametrize("attention", ["hf", "paged"])
def test_deferred_stop_check_equals_eager_when_eos_stops_early(attention):
    """With HF's stop check read one step late, an eos that ends every row early still gives
    eager's ids, length included (HF undoes the extra step; the paged cache crops it), and
    streams the same tokens."""
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.got = []

        def put(self, value):
            self.got.append(value.flatten().tolist())

        def end(self):
            pass

    if attention == "paged":
        pytest.importorskip("flashinfer")
        # FlashInfer needs 16-bit and its head dims; the 31b's (256/512) share the benchmark's JIT builds.
        model = build_model("31b", 6, dtype=torch.bfloat16, device="cuda")
        cfg = gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=1, max_seq_len=64)
    else:
        model, cfg = build_model("tiny", device="cuda"), None
    ids = prompt(1, 12).cuda()
    free = _gen(model, ids, 24)
    eos = int(free[0, 12 + 9])                       # a token eager emits at step 10
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=eos,
              pad_token_id=0)
    with torch.no_grad():
        want_stream = Collect()
        want = model.generate(ids, streamer=want_stream, **kw)
        gemma4opt.optimize(model, cfg)
        assert "deferred" in gemma4opt.report(model, print_table=False).stop_check
        for _ in range(2):
            got_stream = Collect()
            got = model.generate(ids, streamer=got_stream, **kw)
            assert torch.equal(got, want) and got.shape[1] < 12 + 24
            assert got_stream.got == want_stream.got
        assert torch.equal(_gen(model, ids, 24), free)   # and max_new_tokens still stops exactly


def test_decode_graphs_check_addresses_in_cpp_and_recompile_on_a_restrided_weight():
    """On CUDA builds the fixed inputs' addresses are compared by torch's C++ check; Dynamo's
    guards on the model's tensors being dropped from the decode compile, a norm weight given other
    strides (same values) after a generate must still give the same tokens, through one recompile
    that the report lists."""
    from gemma4opt.runtime import decode_graphs

    assert decode_graphs._ptrs_equal is not None
    model = build_model("tiny", device="cuda")
    gemma4opt.optimize(model)
    ids = prompt(2, 12).cuda()
    want = _gen(model, ids, 12)
    norm = model.model.layers[0].input_layernorm.weight
    strided = torch.empty(2 * norm.numel(), dtype=norm.dtype, device=norm.device)[::2]
    strided.copy_(norm.detach())
    norm.data = strided
    assert torch.equal(_gen(model, ids, 12), want)
    assert model._gemma4opt.decode_forward.recompiles == 1
    assert "(compiled again): 1" in str(gemma4opt.report(model, print_table=False))


def test_direct_decode_steps_pass_dynamos_guards_on_cuda():
    """The paged mode with real CUDA graphs and FlashInfer (the demo preset in bf16: FlashInfer needs
    16-bit and head_dim >= 64): decode steps that skip Dynamo's entry (runtime/direct_decode.py)
    give the same tokens as every step through Dynamo, at batch 1 and a padded batch of 3, across
    the sliding window, each direct step checked against Dynamo's own guards (DirectDecode.verify)."""
    pytest.importorskip("flashinfer")
    import copy

    base = build_model("demo", dtype=torch.bfloat16, device="cuda")      # window 32
    window = base.config.sliding_window
    cfg = gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=4, max_seq_len=256)
    direct, through = copy.deepcopy(base), copy.deepcopy(base)
    gemma4opt.optimize(direct, cfg)
    gemma4opt.optimize(through, gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=4, max_seq_len=256,
                                                          direct_decode=False))
    d = direct._gemma4opt.direct
    d.verify = True
    for batch, length, new in ((1, window - 4, 48), (3, window + 5, 24)) * 2:
        ids = prompt(batch, length, seed=length).cuda()
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        with torch.no_grad():
            assert torch.equal(direct.generate(ids, **kw), through.generate(ids, **kw)), (batch, length)
    assert d.steps > (47 + 23), d.describe()       # most of the 140 decode steps
    assert not d.not_learned and through._gemma4opt.direct.steps == 0, d.describe()


@pytest.mark.parametrize("mode", ["hf", "paged"])
def test_weights_and_modules_replaced_after_optimize_on_cuda(mode):
    """Decode as CUDA graphs (hf: the tiny model in fp32 on a static cache; paged: the demo preset in
    bf16 with FlashInfer and direct decode steps): a merged projection's weight given new storage
    (runtime/weight_watch.py: copied into the merged weight in place, the graphs' addresses kept) and a
    replaced MLP (runtime/module_watch.py: optimized again) give what the same edits made before
    optimize() give."""
    import copy

    if mode == "paged":
        pytest.importorskip("flashinfer")
        base = build_model("demo", dtype=torch.bfloat16, device="cuda")
        cfg = gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=2, max_seq_len=128)
    else:
        base, cfg = build_model("tiny", device="cuda"), None
    other = build_model("demo" if mode == "paged" else "tiny", dtype=base.dtype, device="cuda", seed=5)
    ids = prompt(2, 12).cuda()

    def new_weight(m):
        lin = m.model.layers[1].self_attn.q_proj
        lin.weight.data = other.model.layers[1].self_attn.q_proj.weight.detach().clone()

    def new_mlp(m):
        m.model.layers[0].mlp = copy.deepcopy(other.model.layers[0].mlp)

    model = copy.deepcopy(base)
    gemma4opt.optimize(model, cfg)
    _gen(model, ids, 16)
    for edit in (new_weight, new_mlp):
        before = copy.deepcopy(base)
        new_weight(before)
        if edit is new_mlp:
            new_mlp(before)
        gemma4opt.optimize(before, cfg)
        edit(model)
        want = _gen(before, ids, 16)
        if edit is new_mlp:
            with pytest.warns(UserWarning, match="replaced after optimize"):
                got = _gen(model, ids, 16)
        else:
            got = _gen(model, ids, 16)
        assert torch.equal(got, want), edit.__name__
        assert torch.equal(_gen(model, ids, 16), want), edit.__name__      # replayed graphs
        del before
    rep = gemma4opt.report(model, print_table=False)
    assert rep.graphed_calls > 0 and all(r.complete for r in rep.rows), str(rep)
