"""Two optimized models in one process keep their own op state (ops/state.py): the per-shape picks
their GEMM calls make, the picks their reports show, and the experts modules their MoE op finds.

On the CPU the ops run their reference and pick nothing, so the CPU kernel of gemma4opt.linear is
probed: each call, at run time inside the model's forward, also runs the CUDA kernel's pick
(``runs_triton``) with a stub timer. Model A's calls find Triton faster, model B's slower; shared
picks would hand B the shapes A timed first (the two share MLP shapes) and mix the two key sets."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import gemma4opt
from gemma4opt.api import get_state
from gemma4opt.ops import linear as linear_op
from gemma4opt.ops.state import DEFAULT, current
from gemma4opt.report import _decode_gemms
from tests.models import prompt, tiny

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def probe(monkeypatch):
    """Per call of gemma4opt.linear's CPU kernel: the active OpState and the shape's key, and the
    CUDA pick made through that state with ``timing["ms"]`` as the (Triton, cuBLAS) times."""
    calls, timing = [], {}

    def linear(x, weight):
        key = (x.numel() // x.shape[-1], *weight.shape, x.dtype, x.device.index)
        calls.append((current(), key, linear_op.runs_triton(x, weight)))
        return F.linear(x, weight)

    monkeypatch.setattr(linear_op, "F", SimpleNamespace(linear=linear))
    monkeypatch.setattr(linear_op, "_time_both", lambda x, weight: timing["ms"])
    return calls, timing


def _run(model, probe, ms):
    calls, timing = probe
    timing["ms"] = ms
    calls.clear()
    with torch.no_grad():
        model(prompt(1, 5))
    return list(calls)


def test_two_models_keep_their_own_picks_and_experts(probe):
    a, b = gemma4opt.optimize(tiny("tiny")), gemma4opt.optimize(tiny("tiny-moe"))
    sa, sb = get_state(a).op_state, get_state(b).op_state
    default_before = linear_op.picks(DEFAULT)

    a_calls = _run(a, probe, (1.0, 2.0))        # Triton faster on A
    b_calls = _run(b, probe, (3.0, 1.0))        # Triton slower on B
    a_keys, b_keys = {k for _, k, _ in a_calls}, {k for _, k, _ in b_calls}
    assert a_calls and b_calls and a_keys & b_keys, "the test needs shapes both models time"
    assert {id(s) for s, _, _ in a_calls} == {id(sa)} and {id(s) for s, _, _ in b_calls} == {id(sb)}
    assert all(picked for _, _, picked in a_calls) and not any(picked for _, _, picked in b_calls)
    assert linear_op.picks(sa) == dict.fromkeys(a_keys, True)
    assert linear_op.picks(sb) == dict.fromkeys(b_keys, False)

    assert all(picked for _, _, picked in _run(a, probe, (3.0, 1.0)))   # A keeps its picks, not re-timed
    assert linear_op.picks(DEFAULT) == default_before and current() is DEFAULT
    # Each report counts its own model's picks.
    assert _decode_gemms("cuda", sa).startswith(f"the skinny Triton GEMM on {len(a_keys)} of {len(a_keys)} shapes")
    assert _decode_gemms("cuda", sb).startswith(f"the skinny Triton GEMM on 0 of {len(b_keys)} shapes")

    # B's MoE layers registered their experts on B's state while its forward compiled them.
    b_experts = {id(layer.experts) for layer in b.model.layers}
    assert {id(m) for m in sb.experts.values()} == b_experts
    assert not sa.experts and not b_experts & {id(m) for m in DEFAULT.experts.values()}


def _greedy_steps(model, ids, new, cache):
    """A greedy loop of direct forward calls, one yield per call (so two loops can interleave). No
    grad around each call only: grad mode is the thread's, so a no_grad block held across a yield
    stayed in force for the caller, and for later tests, until the generator was collected."""
    tokens = ids
    with torch.no_grad():
        out = model(ids, past_key_values=cache, attention_mask=torch.ones_like(ids), use_cache=True)
    for i in range(new):
        nxt = out.logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, nxt], 1)
        yield tokens
        if i + 1 < new:
            with torch.no_grad():
                out = model(nxt, past_key_values=cache, attention_mask=torch.ones_like(tokens), use_cache=True)


def test_two_paged_models_interleaved_keep_their_own_backends_tables_and_pools(monkeypatch):
    """Two paged models of different sizes on the CUDA backends (FlashInfer stood in, decode on
    the Triton backend), their steps interleaved call by call: each model's plans, device tables
    and pool are its own, and each one's tokens equal its eager run."""
    import sys

    from transformers import DynamicCache

    from gemma4opt.paged.cache import PagedCache
    from tests.attention.test_flashinfer_plumbing import _StandInWrapper, use_cuda_backends
    from tests.e2e.test_paged_generate import PAGED

    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    models = [tiny("tiny"), tiny("tiny-ple-shared", seed=2)]
    ids = [prompt(2, 11, seed=1), prompt(1, 7, seed=2)]
    want = [list(_greedy_steps(m, i, 8, DynamicCache()))[-1] for m, i in zip(models, ids)]
    ctxs = []
    for m in models:
        gemma4opt.optimize(m, PAGED)
        ctxs.append(use_cuda_backends(m, PAGED))
    loops = [_greedy_steps(m, i, 8, PagedCache(c, m.config.num_hidden_layers)) for m, i, c in zip(models, ids, ctxs)]
    got = [None, None]
    for step in zip(*loops):                    # A's step, then B's, then A's...
        got = list(step)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    a, b = ctxs
    assert a.kv.keys() != b.kv.keys() or any(a.kv[k].shape != b.kv[k].shape for k in a.kv)    # different sizes
    for kind in a.backends:
        pa, pb = a.backends[kind].prefill, b.backends[kind].prefill
        assert pa is not pb and pa.handle != pb.handle and pa.workspace is not pb.workspace
        assert pa.plans == pb.plans == 1                                  # each planned its own prefill only
        assert a.backends[kind].decode.steps == b.backends[kind].decode.steps == 7
        assert a.tables[kind].data_ptr() != b.tables[kind].data_ptr()
    assert not (get_state(models[0]).fixed.ptrs() & get_state(models[1]).fixed.ptrs())
