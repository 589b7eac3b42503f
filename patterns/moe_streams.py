"""A MoE layer's experts branch beside its dense MLP: two CUDA streams in the decode graphs.

Gemma-4's MoE layers (26b-a4b) run a dense MLP and a router + experts on the same residual and add
their post norms::

    h1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(residual)))     # the dense branch
    h2 = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(residual), *router(residual)))
    hidden = h1 + h2                                   # (gemma4opt.norm_add once fused)

The two branches share nothing until the sum, and at decode each is a few latency-bound kernels
that leave most SMs idle. After the other patterns (the experts one op, ``gemma4opt.moe_experts``
or its fp8 forms), this pass moves the experts' branch (every node only it needs: the router's
input, the router, the experts, their reshape or norm) ahead of the dense one and wraps it::

    token = branch_fork(*its inputs); ...experts' branch...; out = branch_back(token, out)
    ...dense branch...; out = branch_join(token, out); hidden = <sum>(h1, ..., out, ...)

(compiler/streams.py): while the decode graphs are captured the experts' branch goes on a side
stream, so each graph replay runs both branches at once; anywhere else the calls do nothing and the
branches run one after the other. Same ops on the same inputs, in the same order on each stream:
the same bits. One match per MoE layer. Not where the graph is handed to Inductor (its Python calls
would not lower) or with tensor_parallel (each branch's all-reduce would run on its own stream):
api.py leaves the pattern out there.
"""
from __future__ import annotations

import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_stack
from gemma4opt.compiler.streams import branch_back, branch_fork, branch_join

_EXPERTS = ("moe_experts", "moe_experts_fp8", "moe_experts_fp8_block")
_FREE = ("placeholder", "get_attr")


def _is_experts(n: fx.Node) -> bool:
    return n.op == "call_function" and str(n.target).startswith("gemma4opt.") and \
        str(n.target).split(".")[1] in _EXPERTS


def _inputs(n: fx.Node) -> list[fx.Node]:
    return [i for i in n.all_input_nodes if i.op not in _FREE]


def _ancestors(nodes) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        for i in _inputs(n):
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


def _join(experts: fx.Node):
    """The first node after the experts that also reads a value computed from what the experts'
    inputs came from (their sum with the dense branch; not a weight's cast), and which of its inputs
    carries the experts' output; else (None, None)."""
    down, todo = {experts}, [experts]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in down:
                down.add(u)
                todo.append(u)
    shared = _ancestors([experts])
    for n in experts.graph.nodes:       # in order: the first such node is the branches' meeting point
        if n in down and n is not experts:
            mine = [i for i in _inputs(n) if i in down]
            other = [i for i in _inputs(n) if i not in down and (i in shared or _ancestors([i]) & shared)]
            if other and len(mine) == 1:
                return n, mine[0]
    return None, None


def _branches(experts: fx.Node):
    """(join, experts' branch output, experts' branch nodes in order, dense branch nodes) or a reason."""
    join, b = _join(experts)
    if join is None:
        return "no node after the experts reads both branches"
    others = [i for i in _inputs(join) if i is not b]      # the dense branch's output(s), weights' casts
    anc_b, anc_a = _ancestors([b]) | {b}, _ancestors(others) | set(others)
    side, dense = anc_b - anc_a, anc_a - anc_b
    # Dead dependents of the branch (a router output nobody reads) go with it.
    grew = True
    while grew:
        grew = False
        for n in list(side):
            for u in n.users:
                if u not in side and not u.users and all(i in side for i in _inputs(u)):
                    side.add(u)
                    grew = True
    # A node whose value is read outside the branch and the sum (the residual's getitem) stays where
    # it is, and so does everything it needs.
    grew = True
    while grew:
        grew = False
        for n in list(side):
            if n in side and any(u not in side and u is not join for u in n.users):
                side -= {n} | _ancestors([n])
                grew = True
    if experts not in side:
        return "the experts' output is read outside their branch"
    if not dense:
        return "no dense branch beside the experts"
    order = {n: i for i, n in enumerate(experts.graph.nodes)}
    needed = {i for n in side for i in _inputs(n) if i not in side}
    # The branch goes before the first dense node its inputs allow: the dense nodes before it run
    # before the fork (the side stream waits for them), the rest beside the branch.
    ready = max((order[i] for i in needed), default=-1)
    later = [n for n in dense if order[n] > ready]
    if not later:
        return "the dense branch is done before the experts' inputs are"
    return join, b, sorted(side, key=order.get), min(later, key=order.get), needed


class MoeStreamsPattern(Pattern):
    name = "moe_streams"
    summary = "MoE experts branch || dense MLP: two CUDA streams in the decode graphs (same ops, same bits)"
    as_captured_only = True     # api.py: not with Inductor or tensor_parallel

    def expected(self, cfg, scope):
        return cfg.num_hidden_layers if cfg.enable_moe_block else 0

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for k, experts in enumerate([n for n in graph.nodes if _is_experts(n)]):
            paths = [p for p, _ in module_stack(experts) if p.split(".")[-1].isdigit()]
            where = paths[-1] if paths else f"MoE layer {k}"
            found = _branches(experts)
            if isinstance(found, str):
                res.site(where, found)
                continue
            join, b, side, at, needed = found
            for n in side:          # the experts' branch, in its own order, before the dense nodes at ``at``
                at.prepend(n)
            with graph.inserting_before(side[0]):
                token = graph.call_function(branch_fork, tuple(sorted(needed, key=lambda n: n.name)))
            with graph.inserting_after(side[-1]):
                back = graph.call_function(branch_back, (token, b))
            with graph.inserting_before(join):
                joined = graph.call_function(branch_join, (token, back))
            for n in (back, joined):
                n.meta.update({k: v for k, v in b.meta.items() if k in ("example_value", "val", "tensor_meta")})
            join.replace_input_with(b, joined)
            res.site(where, None)
        return res
