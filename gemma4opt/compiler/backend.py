"""The torch.compile backend: patterns on the Dynamo graph, then Inductor (CUDA) or as is (CPU)."""
from __future__ import annotations

import weakref

import torch.fx as fx

from gemma4opt.compiler.constants import hoist_tensor_literals
from gemma4opt.progress import timed


def make_backend(state, lower: bool, graphs: bool = False, paged: bool = True):
    """A Dynamo backend bound to one optimized model's state (see gemma4opt.api).

    lower: hand the rewritten graph to Inductor; otherwise run it as captured (gemma4opt ops +
    aten calls). graphs: replay it as CUDA graphs (decode steps): lowered, as Inductor's cudagraph
    trees; otherwise ``state.decode_graphs(gm, example_inputs)`` wraps the rewritten graph (the
    runtime's decode graphs, which api.py gives the state). paged=False: graphs of calls without a
    paged cache, which the paged-only patterns skip.

    Nothing Dynamo keeps holds the model: Dynamo keeps every backend it was given in a process-wide
    table until ``torch._dynamo.reset()``, and the compiled graphs it gets back in its frames'
    globals and guards for good; the state reaches the model (its original forward), and a graph
    holds what the passes gave it (merged and fp8 weights). So the backend holds the state weakly,
    the state owns each compiled graph (``state.compiled_graphs``), and Dynamo gets a call-through
    that holds the state weakly; an optimized model, weights and KV pool, is freed with it.
    """
    state_ref = weakref.ref(state)

    def gemma4opt_backend(gm: fx.GraphModule, example_inputs):
        state = state_ref()
        if state is None:
            raise RuntimeError("gemma4opt: the optimized model this forward was compiled for has been freed")
        index = state.graphs_compiled
        state.graphs_compiled += 1
        paged_graph = paged and state.context is not None
        kind = "decode (CUDA graphs)" if graphs else ("paged" if paged_graph else "forward")
        with timed(f"rewriting captured graph {index} ({kind}, {len(gm.graph.nodes)} nodes)"):
            state.pass_manager.run(gm, index, paged=paged)
        if not lower:       # Inductor folds these itself
            hoist_tensor_literals(gm)
        if graphs and not lower:
            # The rewritten graph as captured, replayed as CUDA graphs without Inductor's codegen:
            # the fused ops already cover the memory-bound work.
            compiled = state.decode_graphs(gm, example_inputs)
        elif not lower:
            compiled = gm.forward
        else:
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": graphs})
        state.compiled_graphs.append(compiled)
        return _call_through(state_ref, len(state.compiled_graphs) - 1)

    return gemma4opt_backend


def _call_through(state_ref, index: int):
    """What Dynamo calls for compiled graph ``index`` of the state: it, while the model lives."""
    def gemma4opt_graph(*args):
        state = state_ref()
        if state is None:
            raise RuntimeError("gemma4opt: the optimized model this graph was compiled for has been freed")
        return state.compiled_graphs[index](*args)

    return gemma4opt_graph
