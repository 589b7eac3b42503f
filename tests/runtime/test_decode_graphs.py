"""GraphedDecode's bookkeeping (warm-up, one capture, replays copying per-step inputs, a new capture
when a fixed input moves), with CUDA graphs stood in by a recorder so it runs on a CPU. The real
capture runs in tests/gpu."""
import contextlib
import types

import torch

from gemma4opt.runtime import decode_graphs


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
    monkeypatch.setattr(decode_graphs.torch, "cuda", fake_cuda, raising=False)


def test_warmup_capture_replay_and_recapture(monkeypatch):
    _FakeGraph.captures = 0
    weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    cache = torch.zeros(3, 4)
    calls = []

    class GM:
        def __call__(self, w, kv, x, pos):
            calls.append(x.clone())
            kv[pos] = x @ w          # the in-place cache write a decode step does
            return (kv.sum(0),)

    gm = GM()
    state = types.SimpleNamespace(graphed_calls=0, graph_warmups=0, graph_captures=0)
    _patch(monkeypatch)
    runner = decode_graphs.GraphedDecode(gm, [weight, cache, torch.zeros(4), torch.tensor(0)], state,
                                         fixed_ptrs={cache.data_ptr()})
    assert runner.fixed == [0, 1] and runner.moving == [2, 3]

    orig_capture = runner._capture

    def capture(args):   # the fake graph replays by calling gm on the captured inputs
        cap = orig_capture(args)
        cap.graph.fn = lambda: cap.outputs[0].copy_(gm(*cap.inputs)[0])
        return cap

    runner._capture = capture
    xs = [torch.randn(4) for _ in range(3)]
    runner(weight, cache, xs[0], torch.tensor(0))          # warm-up: eager
    assert _FakeGraph.captures == 0 and state.graphed_calls == 0
    out = runner(weight, cache, xs[1], torch.tensor(1))    # capture + first replay
    assert _FakeGraph.captures == 1 and state.graphed_calls == 1
    strided = torch.zeros(4, 2)
    strided[:, 0] = xs[2]                                    # same shape, another stride: still a replay
    out = runner(weight, cache, strided[:, 0], torch.tensor(2))
    assert _FakeGraph.captures == 1 and state.graphed_calls == 2
    want = torch.stack([x @ weight for x in xs])
    torch.testing.assert_close(cache, want)
    torch.testing.assert_close(out[0], want.sum(0))

    other = torch.zeros(3, 4)                                # a new cache object: warm-up, then capture anew
    runner(weight, other, xs[0], torch.tensor(0))
    runner(weight, other, xs[1], torch.tensor(1))
    assert _FakeGraph.captures == 2
    torch.testing.assert_close(other[:2], want[:2])
