"""Apply the enabled patterns to one captured graph, in order, and count what they did."""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, Pattern
from gemma4opt.compiler.regions import drop_dead_views


@dataclass
class PatternStats:
    """Counters for one pattern across every graph captured for a model."""

    name: str
    summary: str
    expected: int
    matched_per_graph: list[int] = field(default_factory=list)
    unfused: dict[str, None] = field(default_factory=dict)   # ordered set of "where: why"
    not_applicable_per_graph: list[int] = field(default_factory=list)     # sites left by design
    not_applicable: dict[str, None] = field(default_factory=dict)        # ordered set of their whys

    def forget_graphs(self) -> None:
        """Drop the per-graph counts (explain() recaptures every graph); the reasons stay."""
        self.matched_per_graph.clear()
        self.not_applicable_per_graph.clear()


class PassManager:
    def __init__(self, patterns: list[Pattern], ctx_factory, stats: dict[str, PatternStats]):
        self.patterns = patterns
        self.ctx_factory = ctx_factory
        self.stats = stats
        self.explain_dir: str | None = None
        self.explain_first_graph = 0    # graph index that explain() writes as graph00 (its files count from 0)
        self.op_counts: list[collections.Counter] = []   # gemma4opt ops in each rewritten graph

    def run(self, gm: fx.GraphModule, graph_index: int, paged: bool = True) -> fx.GraphModule:
        """paged=False: a graph with HF's attention (no paged cache): paged-only patterns skip it."""
        ctx: PassContext = self.ctx_factory(gm)
        self._dump(gm, graph_index, 0, "captured")
        drop_dead_views(gm.graph)       # so the patterns' user counts see only live uses
        for i, pattern in enumerate(self.patterns, start=1):
            if pattern.paged_only and not paged:
                continue
            result = pattern.apply(gm, ctx)
            try:        # e.g. a replacement placed before one of its inputs (see regions.place)
                gm.graph.lint()
            except RuntimeError as e:
                raise RuntimeError(f"gemma4opt: the graph is invalid after pattern {pattern.name!r}: {e}") from e
            gm.recompile()
            st = self.stats[pattern.name]
            st.matched_per_graph.append(result.matched)
            st.not_applicable_per_graph.append(len(result.not_applicable))
            for why in result.unfused:
                st.unfused[why] = None
            for why in result.not_applicable:
                st.not_applicable[why] = None
            self._dump(gm, graph_index, i, f"after_{pattern.name}")
        self.op_counts.append(collections.Counter(   # "gemma4opt.<op>", whether traced as packet or overload
            str(n.target).removesuffix(".default") for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("gemma4opt.")))
        return gm

    def _dump(self, gm: fx.GraphModule, graph_index: int, step: int, label: str) -> None:
        if not self.explain_dir:
            return
        index = graph_index - self.explain_first_graph
        path = os.path.join(self.explain_dir, f"graph{index:02d}_{step:02d}_{label}.py")
        with open(path, "w") as f:
            f.write(gm.print_readable(print_output=False))
