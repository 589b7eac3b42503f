"""The torch.compile backend: patterns on the Dynamo graph, then Inductor (CUDA) or as is (CPU)."""
from __future__ import annotations

import torch.fx as fx

from gemma4opt.compiler.constants import hoist_tensor_literals
from gemma4opt.progress import timed


def make_backend(state, lower: bool, graphs=None, paged: bool = True):
    """A Dynamo backend bound to one optimized model's state (see gemma4opt.api).

    lower: hand the rewritten graph to Inductor; otherwise run it as captured (gemma4opt ops +
    aten calls). graphs: replay it as CUDA graphs (decode steps): lowered, as Inductor's cudagraph
    trees; otherwise ``graphs(gm, example_inputs)`` wraps the rewritten graph (the caller's
    runtime/decode_graphs.py). paged=False: graphs of calls without a paged cache, which the
    paged-only patterns skip.
    """

    def gemma4opt_backend(gm: fx.GraphModule, example_inputs):
        index = state.graphs_compiled
        state.graphs_compiled += 1
        paged_graph = paged and state.context is not None
        kind = "decode (CUDA graphs)" if graphs is not None else ("paged" if paged_graph else "forward")
        with timed(f"rewriting captured graph {index} ({kind}, {len(gm.graph.nodes)} nodes)"):
            state.pass_manager.run(gm, index, paged=paged)
        if not lower:       # Inductor folds these itself
            hoist_tensor_literals(gm)
        if graphs is not None and not lower:
            # The rewritten graph as captured, replayed as CUDA graphs without Inductor's codegen:
            # the fused ops already cover the memory-bound work.
            return graphs(gm, example_inputs)
        if not lower:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        patches = {"triton.cudagraphs": graphs is not None}
        return compile_fx(gm, example_inputs, config_patches=patches)

    return gemma4opt_backend
