"""Compile a small module with chosen patterns; return the output, the rewritten graph and counters."""
import collections

import torch

from gemma4opt.compiler.pass_manager import PassManager, PatternStats
from gemma4opt.compiler.pattern import PassContext
from gemma4opt.compiler.regions import op_name
from gemma4opt.patterns import build_patterns


class Compiled:
    def __init__(self, module, names, text_config=None, scope="causal_lm", max_seq_len=None):
        all_patterns = build_patterns()
        self.patterns = [all_patterns[n] for n in names]
        for p in self.patterns:
            p.prepare(module, text_config)
        self.stats = {p.name: PatternStats(p.name, p.summary, 0) for p in self.patterns}
        self.graphs = []

        def ctx(gm):
            return PassContext(root=module, text_config=text_config, scope=scope, gm=gm, max_seq_len=max_seq_len)

        pm = PassManager(self.patterns, ctx, self.stats)

        def backend(gm, example_inputs):
            pm.run(gm, len(self.graphs))
            self.graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        self.fn = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            return self.fn(*args, **kwargs)

    def matched(self, name):
        return self.stats[name].matched_per_graph[-1]

    def unfused(self, name):
        return list(self.stats[name].unfused)

    def ops(self):
        """Counter of op names in the last rewritten graph."""
        return collections.Counter(op_name(n) for n in self.graphs[-1].graph.nodes if n.op.startswith("call"))

    def gemma4opt_ops(self):
        return collections.Counter(str(n.target).split(".")[1] for n in self.graphs[-1].graph.nodes
                                   if n.op == "call_function" and str(n.target).startswith("gemma4opt."))
