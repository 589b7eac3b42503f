"""The Pattern base class and what a pass reports back."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass
class PassContext:
    """What a pattern may read while rewriting one captured graph."""

    root: torch.nn.Module          # the module whose forward was compiled
    text_config: object            # Gemma4TextConfig
    scope: str                     # "causal_lm" (forward incl. lm_head) or "text_model"
    gm: fx.GraphModule | None = None
    max_seq_len: int | None = None  # the paged mode's bound on positions (Gemma4OptConfig.max_seq_len); else None

    def add_constant(self, name: str, tensor: torch.Tensor) -> fx.Node:
        """A get_attr node for a tensor owned by gemma4opt (e.g. merged weights)."""
        safe = "_g4o_" + name.replace(".", "_")
        if not hasattr(self.gm, safe):
            self.gm.register_buffer(safe, tensor, persistent=False)
            sources = getattr(self.gm, "_param_name_to_source", None)
            if sources is not None:
                # AOTAutograd maps every lifted buffer of a Dynamo graph to a source; a constant
                # source also makes it a static input (no copy into CUDA-graph memory per replay).
                from torch._dynamo.source import ConstantSource

                sources[safe] = ConstantSource(safe)
        first = next(iter(self.gm.graph.nodes))
        with self.gm.graph.inserting_before(first):
            node = self.gm.graph.get_attr(safe)
        node.meta["example_value"] = tensor
        return node


# A FineGrainedFP8 checkpoint's projections run gemma4opt::fp8_block_linear, which quantizes its input
# per group itself: the fusions that take a gemma4opt.linear do not apply to them, by design.
BLOCK_FP8_OP = "fp8_block_linear.default"
BLOCK_FP8_WHY = ("a FineGrainedFP8 checkpoint's projection, run by gemma4opt.fp8_block_linear (which quantizes its "
                 "own input): this pattern takes the model's plain linears")


@dataclass
class PassResult:
    matched: int = 0
    unfused: list[str] = field(default_factory=list)   # "where: why" for each block left as is
    # why, once per site the fusion does not apply to by design (its expected count leaves them out)
    not_applicable: list[str] = field(default_factory=list)

    def site(self, where: str, why: str | None) -> None:
        """One site tried: matched where ``why`` is None, else listed as unfused, with why."""
        if why:
            self.unfused.append(f"{where}: {why}")
        else:
            self.matched += 1


class Pattern:
    """One fusion. Subclasses set ``name``/``summary`` and implement ``expected`` and ``apply``.

    The module docstring of each pattern file spells out the unfused and fused sequences.
    """

    name: str = ""
    summary: str = ""
    paged_only: bool = False      # matches ops that exist only with attention="paged"
    quantized_only: bool = False  # matches ops that exist only with quantization="fp8"
    as_captured_only: bool = False  # only where the graph runs as captured, on one stream's collectives

    def __init__(self, quantization: str | None = None, quantize_lm_head: bool = False):
        self.quantization = quantization      # Gemma4OptConfig.quantization: what the graph's linears are
        self.quantize_lm_head = quantize_lm_head      # and whether the lm_head is one of them

    def expected(self, text_config, scope: str) -> int:
        """Matches a fully fused graph has, as a formula of the config (per captured graph)."""
        raise NotImplementedError

    def prepare(self, root: torch.nn.Module, text_config) -> None:
        """One-time model edits at optimize() (e.g. merging weights). Default: none."""

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError
