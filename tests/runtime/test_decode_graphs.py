"""GraphedDecode's bookkeeping (warm-up, one capture, replays copying per-step inputs, a new capture
when a fixed input moves), with CUDA graphs stood in by a recorder so it runs on a CPU. The real
capture runs in tests/gpu."""
import collections
import contextlib
import types

import pytest
import torch

from gemma4opt.presets import build_model
from gemma4opt.runtime import decode_graphs
from tests.models import VARIANTS, WINDOW, prompt


class _FakeGraph:
    """Capture records the callable and its inputs; replay runs it again on them."""

    captures = 0

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


class _FakeCapture:
    def __init__(self, graph, pool=None):
        self.graph = graph

    def __enter__(self):
        _FakeGraph.captures += 1
        return self

    def __exit__(self, *exc):
        return False


def _patch(monkeypatch):
    fake_cuda = types.SimpleNamespace(
        CUDAGraph=_FakeGraph, graph=_FakeCapture, Stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        current_stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        stream=lambda s: contextlib.nullcontext())
    monkeypatch.setattr(decode_graphs, "_cuda", fake_cuda)


def _step(w, kv, x, pos, n: int):
    kv.index_copy_(0, pos.reshape(1), (x @ w)[None])   # the in-place cache write of a decode step
    return kv.sum(0), n + 1   # n: a host-side token count (HF's cumulative_length_int)


def _traced(example):
    """An FX graph of _step with Dynamo-style ``example_value`` metadata on every node."""
    gm = torch.fx.symbolic_trace(_step)

    class Annotate(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["example_value"] = out
            return out

    Annotate(gm).run(*[x.clone() if isinstance(x, torch.Tensor) else x for x in example])
    return gm


def test_warmup_capture_replay_and_recapture(monkeypatch):
    _FakeGraph.captures = 0
    weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    cache = torch.zeros(3, 4)
    gm = _traced([weight, cache, torch.zeros(4), torch.tensor(0), 0])
    state = types.SimpleNamespace(graphed_calls=0, graph_warmups=0, graph_captures=0,
                                  graph_key_changes=collections.Counter())
    _patch(monkeypatch)
    runner = decode_graphs.GraphedDecode(gm, [weight, cache, torch.zeros(4), torch.tensor(0), 0], state,
                                         fixed_ptrs={cache.data_ptr()})
    assert runner.fixed == [0, 1] and runner.moving == [2, 3]
    assert runner.others == [], "an int only host arithmetic reads must not key the capture"

    orig_capture = runner._capture

    def capture(args):   # the fake graph replays by calling gm on the captured inputs
        cap = orig_capture(args)
        cap.graph.fn = lambda: cap.outputs[0].copy_(gm(*[cap.inputs.get(i, a) for i, a in enumerate(args)])[0])
        return cap

    runner._capture = capture
    xs = [torch.randn(4) for _ in range(3)]
    runner(weight, cache, xs[0], torch.tensor(0), 10)         # warm-up: eager
    assert _FakeGraph.captures == 0 and state.graphed_calls == 0
    out = runner(weight, cache, xs[1], torch.tensor(1), 11)   # capture + first replay
    assert _FakeGraph.captures == 1 and state.graphed_calls == 1 and out[1] == 12
    strided = torch.zeros(4, 2)
    strided[:, 0] = xs[2]                                     # same shape, another stride: still a replay
    out = runner(weight, cache, strided[:, 0], torch.tensor(2), 12)
    assert _FakeGraph.captures == 1 and state.graphed_calls == 2
    assert state.last_replayed is next(iter(runner.graphs.values())).graph, "benchmarks time this graph alone"
    assert out[1] == 13, "host outputs are computed per call, not replayed from capture time"
    want = torch.stack([x @ weight for x in xs])
    torch.testing.assert_close(cache, want)
    torch.testing.assert_close(out[0], want.sum(0))

    other = torch.zeros(3, 4)                                 # a new cache object: warm-up, then capture anew
    runner(weight, other, xs[0], torch.tensor(0), 0)
    runner(weight, other, xs[1], torch.tensor(1), 1)
    assert _FakeGraph.captures == 2
    torch.testing.assert_close(other[:2], want[:2])
    assert state.graph_key_changes == {"address of fixed input 1": 1}   # the new cache, once


def test_int_read_by_kernels_keys_the_capture():
    def f(x, n: int):
        return (x[:n] * 2,)

    gm = torch.fx.symbolic_trace(f)
    for node, v in zip(gm.graph.nodes, [torch.zeros(4), 2]):
        node.meta["example_value"] = v
    for node in gm.graph.nodes:
        if node.op == "call_function" or node.op == "call_method":
            node.meta["example_value"] = torch.zeros(2)
    state = types.SimpleNamespace(graphed_calls=0, graph_warmups=0, graph_captures=0,
                                  graph_key_changes=collections.Counter())
    runner = decode_graphs.GraphedDecode(gm, [torch.zeros(4), 2], state, fixed_ptrs=set())
    assert runner.others == [1]


class _RecordingCapture:
    """torch.cuda.graph stand-in: nothing runs at capture (as on a GPU); replay runs the graph."""

    def __init__(self, graph, pool=None):
        self.graph = graph

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu_capture(self, args):
    inputs = list(args)
    for i in self.moving:
        inputs[i] = args[i].clone()
    outputs = []
    graph = _FakeGraph()

    def replay():
        got = self.gm(*inputs)
        if not outputs:
            outputs.extend(got)          # the captured outputs: the same tensors every replay
        else:
            for o, g in zip(outputs, got):
                if isinstance(o, torch.Tensor):
                    o.copy_(g)

    graph.fn = replay
    return decode_graphs._Captured(graph, inputs, outputs)


def _optimize_with_cpu_graphs(monkeypatch, model):
    """optimize() with HF's static cache and gemma4opt's decode graphs, CUDA graphs stood in."""
    import dataclasses

    import gemma4opt
    from gemma4opt.config import Gemma4OptConfig

    _patch(monkeypatch)
    monkeypatch.setattr(decode_graphs._cuda, "graph", _RecordingCapture)
    monkeypatch.setattr(decode_graphs._cuda, "graph_pool_handle", lambda: None, raising=False)
    monkeypatch.setattr(decode_graphs.GraphedDecode, "_capture", _cpu_capture)
    monkeypatch.setattr(Gemma4OptConfig, "resolve", lambda self, device, *a: dataclasses.replace(
        self, attention="hf", cache="static", inductor=False, cuda_graphs=True))
    gemma4opt.optimize(model)


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_through_graphed_decode_on_cpu(monkeypatch, variant):
    """HF generate on a static cache with decode steps going through GraphedDecode (CUDA graphs
    stood in by replaying the graph on the captured inputs): every decode step after the first
    two replays, and the tokens equal HF eager's."""
    model = build_model(variant)
    ids = prompt(2, WINDOW + 3)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              cache_implementation="static")
    _optimize_with_cpu_graphs(monkeypatch, model)
    with torch.no_grad():
        for _ in range(2):          # a second generate reuses the cache object and its capture
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            assert torch.equal(got, want)
    st = model._gemma4opt
    # Dynamo compiles decode twice (first with the token count as a constant, then as a symbol):
    # one warm-up for each, one capture for the second; the second generate reuses cache and capture.
    assert (st.graph_warmups, st.graph_captures) == (2, 1), (st.graph_warmups, st.graph_captures)
    assert st.graphed_calls == 2 * 11 - 2      # every decode call but the two warm-ups replays


def test_host_value_from_device_data_runs_eagerly_and_is_reported():
    import collections

    def f(x):
        return x * 2, x.sum().item()       # an int out of device data: a replay could not produce it

    gm = torch.fx.symbolic_trace(f)
    for node in gm.graph.nodes:
        node.meta["example_value"] = torch.zeros(3) if node.op != "call_method" or node.target != "item" else 0.0
    state = types.SimpleNamespace(graphed_calls=0, graph_warmups=0, graph_captures=0,
                                  fallbacks=collections.Counter())
    with pytest.warns(UserWarning, match="not as CUDA graphs"):
        runner = decode_graphs.GraphedDecode(gm, [torch.ones(3)], state, fixed_ptrs=set())
    out = runner(torch.ones(3))
    assert out[1] == 3.0 and state.graphed_calls == 0
    assert sum(state.fallbacks.values()) == 1


def _runner_over_a_weight(monkeypatch, weight, cache):
    gm = _traced([weight, cache, torch.zeros(4), torch.tensor(0), 0])
    state = types.SimpleNamespace(graphed_calls=0, graph_warmups=0, graph_captures=0,
                                  graph_key_changes=collections.Counter())
    _patch(monkeypatch)
    monkeypatch.setattr(decode_graphs.GraphedDecode, "_capture", _cpu_capture)
    return decode_graphs.GraphedDecode(gm, [weight, cache, torch.zeros(4), torch.tensor(0), 0], state,
                                       fixed_ptrs={cache.data_ptr()}, model_ptrs=frozenset({weight.data_ptr()}))


@pytest.mark.parametrize("c_check", [False, True])
def test_fixed_addresses_checked_against_the_last_call(monkeypatch, c_check):
    """The fixed inputs' key is reused while every address holds (through cudagraph trees' C++
    check where torch has it, stood in here with its contract: a list of inputs, a list of
    addresses over every input index, the indices to compare) and rebuilt when one moves."""
    seen = []

    def ptrs_equal(tensors, ptrs, indices):
        assert type(tensors) is list and type(ptrs) is list and len(ptrs) == len(tensors)
        seen.append(list(indices))
        return all(tensors[i].data_ptr() == ptrs[i] for i in indices)

    monkeypatch.setattr(decode_graphs, "_ptrs_equal", ptrs_equal if c_check else None)
    weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    cache = torch.zeros(3, 4)
    runner = _runner_over_a_weight(monkeypatch, weight, cache)
    for t in range(3):
        runner(weight, cache, torch.randn(4), torch.tensor(t), t)
    first = runner.last_key[0]
    assert first == (weight.data_ptr(), cache.data_ptr())
    runner(weight, cache, torch.randn(4), torch.tensor(0), 0)
    assert runner.last_key[0] is first, "an unchanged set of addresses is not rebuilt"
    assert seen == ([[0, 1]] * 3 if c_check else []), seen
    moved = torch.zeros(3, 4)
    runner(weight, moved, torch.randn(4), torch.tensor(0), 0)
    assert runner.last_key[0] == (weight.data_ptr(), moved.data_ptr())


def test_model_tensor_with_other_metadata_raises_model_tensors_changed(monkeypatch):
    """A model tensor at a new address with the traced dtype, shape and strides is captured anew
    (as a new cache is); with other strides or dtype the graph must be compiled again."""
    weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    cache = torch.zeros(3, 4)
    runner = _runner_over_a_weight(monkeypatch, weight, cache)
    for t in range(3):
        runner(weight, cache, torch.randn(4), torch.tensor(t), t)
    same_meta = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    for t in range(3):
        runner(same_meta, cache, torch.randn(4), torch.tensor(t), t)
    assert runner.state.graph_captures == 2
    transposed = torch.nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
    with pytest.raises(decode_graphs.ModelTensorsChanged, match=r"decode input 0.*strides \(1, 4\)"):
        runner(transposed, cache, torch.randn(4), torch.tensor(0), 0)
    with pytest.raises(decode_graphs.ModelTensorsChanged, match="float64"):
        runner(weight.double(), cache, torch.randn(4), torch.tensor(0), 0)


def test_guard_filter_drops_only_the_model_tensors_guards():
    model = torch.nn.Linear(3, 3)
    other = torch.zeros(3)
    keep = decode_graphs.model_guards_dropped(model)

    def entry(kind, value):
        return types.SimpleNamespace(guard_type=kind, value=value)

    got = keep([entry("TENSOR_MATCH", model.weight), entry("TENSOR_MATCH", model.bias), entry("TENSOR_MATCH", other),
                entry("ID_MATCH", model.weight), entry("GRAD_MODE", None), entry("TENSOR_MATCH", None)])
    assert got == [False, False, True, True, True, True]


def test_a_model_tensor_restrided_after_generate_recompiles_and_tokens_still_match(monkeypatch):
    """Dynamo's guards on the model's tensors are dropped from the decode compile: a norm weight
    given other strides (same values) must reach a new compile through GraphedDecode's check (one
    recompile counted, and listed in the report), and greedy tokens must still equal HF eager's."""
    import gemma4opt

    model = build_model("tiny")
    ids = prompt(1, 9)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              cache_implementation="static")
    _optimize_with_cpu_graphs(monkeypatch, model)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                          do_sample=False), want)
    forward = model._gemma4opt.decode_forward
    assert forward.recompiles == 0
    norm = model.model.layers[0].input_layernorm.weight
    strided = torch.empty(2 * norm.numel(), dtype=norm.dtype)[::2]
    strided.copy_(norm.detach())
    norm.data = strided
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert forward.recompiles == 1
    assert "(compiled again): 1" in str(gemma4opt.report(model, print_table=False))
