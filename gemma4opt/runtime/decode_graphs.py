"""Decode steps as CUDA graphs of the rewritten FX graph, without Inductor.

Dynamo hands the backend a graph whose inputs are the model's parameters and buffers (fixed
addresses), HF's static-cache tensors (fixed once marked static) and a few per-step tensors
(input ids, positions, masks). The first call for a new set of fixed addresses runs eagerly on a
side stream (cuBLAS handles, Triton autotuning), the next one captures, and every later call
copies the per-step tensors into the captured inputs and replays: one launch per step, nothing
read back on the host. Fixed inputs are checked by address on every call, so a new cache object
is captured anew instead of replaying over stale memory.

Why not Inductor's cudagraph trees: with parameters as graph inputs, Dynamo's plain
``cudagraphs`` backend copies every weight into the graph each step (only AOT-lifted inputs
count as static there) and functionalizes the in-place cache update into full-cache copies;
Inductor avoids both but compiles a real-size Gemma-4 for many minutes.
"""
from __future__ import annotations

import torch

WARMUP_CALLS = 1
MAX_GRAPHS = 16     # captures kept per graph (cache objects x shapes); the oldest is dropped past it


def _is_fixed(x, fixed_ptrs: set[int]) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    return (isinstance(x, torch.nn.Parameter) or hasattr(x, "_dynamo_static_input_type")
            or x.data_ptr() in fixed_ptrs)


class _Captured:
    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class GraphedDecode:
    """Callable replacing one Dynamo graph: warm-up, capture, then replays (see module doc)."""

    def __init__(self, gm, example_inputs, state, fixed_ptrs: set[int], pool=None):
        self.gm, self.state = gm, state
        self.fixed = [i for i, x in enumerate(example_inputs) if _is_fixed(x, fixed_ptrs)]
        fixed = set(self.fixed)
        self.moving = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and i not in fixed]
        self.others = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)]
        self.pool = pool
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: dict[tuple, int] = {}

    def _key(self, args) -> tuple:
        return (tuple(args[i].data_ptr() for i in self.fixed),
                # Not strides: generate slices its growing id/mask buffers, so strides change every
                # step; copy_ into the captured buffers handles any layout.
                tuple((args[i].shape, args[i].dtype) for i in self.moving),
                tuple(args[i] for i in self.others))

    def __call__(self, *args):
        key = self._key(args)
        cap = self.graphs.get(key)
        if cap is None:
            n = self.seen.get(key, 0)
            self.seen[key] = n + 1
            if n < WARMUP_CALLS:
                self.state.graph_warmups += 1
                return self._warmup(args)
            cap = self._capture(args)
            self.state.graph_captures += 1
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = cap
        for i in self.moving:
            cap.inputs[i].copy_(args[i], non_blocking=True)
        cap.graph.replay()
        self.state.graphed_calls += 1
        return cap.outputs

    def _warmup(self, args):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.gm(*args)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, args) -> _Captured:
        inputs = list(args)
        for i in self.moving:
            inputs[i] = args[i].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.gm(*inputs)
        return _Captured(graph, inputs, outputs)


def graphed_decode_backend(state, fixed_ptrs: set[int]):
    """A Dynamo-backend tail: wrap a rewritten decode graph in GraphedDecode (one pool per model)."""
    if getattr(state, "graph_pool", None) is None:
        state.graph_pool = torch.cuda.graph_pool_handle()

    def compile_graph(gm, example_inputs):
        return GraphedDecode(gm, example_inputs, state, fixed_ptrs, state.graph_pool)

    return compile_graph
