"""The passes do not depend on the captured graph's node order.

Dynamo's order changes with the call: e.g. a ``logits_to_keep`` that changed between calls
becomes a graph input whose ``neg`` is recorded late, after the layers it slices. Replacements
must go after all their inputs and before their first user, whatever the order.

(a) one model, one process, calls whose graphs differ (logits_to_keep, cache kind, mask);
(b) the same captured graphs, re-sorted into other valid orders before the passes run.
"""
import copy
import heapq
import operator

import pytest
import torch
import torch.fx as fx

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)
MODES = {"default": None, "paged": PAGED}
NEW = 4


def _gen(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kw)


def _assert_complete(model):
    rep = gemma4opt.report(model, print_table=False)
    assert rep.fallbacks == {}
    for r in rep.rows:
        assert r.complete, f"{r.pattern}: matched {r.matched_per_graph}, expected {r.expected}: {r.unfused}"
    return {r.pattern: set(r.matched_per_graph) for r in rep.rows}


# --- (a) graphs whose order differs because the calls differ -------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_logits_to_keep_changing_between_generate_calls(mode):
    """The issue: the second generate's logits_to_keep (0 after the default) is a graph input,
    its ``neg`` recorded after the KV-shared layers' slices of the residual stream."""
    model = tiny("tiny-ple-shared")
    eager = copy.deepcopy(model)
    ids = prompt(1, 9)
    gemma4opt.optimize(model, MODES[mode])
    for kw in (dict(), dict(logits_to_keep=0)):
        assert torch.equal(_gen(model, ids, **kw), _gen(eager, ids, **kw)), kw
    _assert_complete(model)


@pytest.mark.parametrize("mode", MODES)
def test_cache_kinds_masks_and_logits_to_keep_in_one_process(mode):
    model = tiny("tiny-ple-shared")
    eager = copy.deepcopy(model)
    ids = prompt(1, 9)
    mask = torch.ones_like(ids)
    gemma4opt.optimize(model, MODES[mode])
    if mode == "default":
        calls = [dict(logits_to_keep=0, attention_mask=mask), dict(cache_implementation="static"),
                 dict(cache_implementation="static", attention_mask=mask, logits_to_keep=0)]
    else:
        calls = [dict(attention_mask=mask), dict(attention_mask=mask, logits_to_keep=0), dict(logits_to_keep=2)]
    for kw in calls:
        assert torch.equal(_gen(model, ids, **kw), _gen(eager, ids, **kw)), kw
    _assert_complete(model)


# --- (b) the same graphs in other valid topological orders ------------------------------------------

_IN_PLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def _fixed(node: fx.Node) -> bool:
    """Nodes that keep their place: graph inputs/outputs and anything that may have side effects
    (in-place ops, mutating custom ops, global-state calls). Pure nodes move only between two of
    them, so no read crosses a write."""
    if node.op in ("placeholder", "output", "call_module"):
        return True
    if node.op == "get_attr":
        return False
    target = node.target
    if node.op == "call_method":
        return target.endswith("_") and not target.endswith("__")
    if target in _IN_PLACE_OPERATORS or "out" in node.kwargs:
        return True
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, o)._schema.is_mutable for o in target.overloads())
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") or (name.startswith("_") and getattr(target, "__module__", None) not in ("_operator", "operator"))


def reorder(graph: fx.Graph, how: str) -> int:
    """Re-sort ``graph`` into another valid order; returns how many nodes changed place.

    "early": every pure node as early as its inputs allow (ties: the one recorded last first);
    "late": every pure node as late as its users allow (ties: the one recorded first last).
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    segments, run = [], []
    for n in nodes:
        if _fixed(n):
            segments.append(run)
            run = []
        else:
            run.append(n)
    segments.append(run)
    new_order = []
    for seg in filter(None, segments):
        inside = set(seg)
        if how == "early":
            deps = {n: {a for a in n.all_input_nodes if a in inside} for n in seg}
            nexts = {n: [u for u in n.users if u in inside] for n in seg}
            key = lambda n: -index[n]   # noqa: E731
        else:
            deps = {n: {u for u in n.users if u in inside} for n in seg}
            nexts = {n: [a for a in n.all_input_nodes if a in inside] for n in seg}
            key = lambda n: index[n]    # noqa: E731
        ready = [(key(n), index[n], n) for n in seg if not deps[n]]
        heapq.heapify(ready)
        out = []
        while ready:
            *_, n = heapq.heappop(ready)
            out.append(n)
            for m in nexts[n]:
                deps[m].discard(n)
                if not deps[m]:
                    heapq.heappush(ready, (key(m), index[m], m))
        assert len(out) == len(seg)
        new_order.append((seg, out if how == "early" else out[::-1]))
    moved = 0
    for seg, out in new_order:
        anchor = seg[0].prev
        for n in out:
            anchor.append(n)
            anchor = n
        moved += sum(a is not b for a, b in zip(seg, out))
    graph.lint()
    return moved


def _optimized(variant, mode, how, moved):
    model = tiny(variant)
    gemma4opt.optimize(model, MODES[mode])
    pm = model._gemma4opt.pass_manager
    run = pm.run

    def run_reordered(gm, index, **kw):
        if how is not None:
            moved.append(reorder(gm.graph, how))
            gm.recompile()
        return run(gm, index, **kw)

    pm.run = run_reordered
    return model


@pytest.mark.parametrize("how", ["early", "late"])
@pytest.mark.parametrize("variant,mode", [("tiny-ple-shared", "default"), ("tiny-ple-shared", "paged"),
                                          ("tiny-moe", "default")])
def test_passes_on_reordered_graphs(variant, mode, how):
    """Each captured graph re-sorted (``reorder``) before the passes: the graph lints, every
    pattern matches as often as it should (as on Dynamo's order), and the outputs are the same:
    bitwise against the passes on Dynamo's order (direct forward calls; the paged cache exists
    only inside generate, so there greedy tokens against HF's)."""
    eager = tiny(variant)
    ids = prompt(2, 9)
    kws = [dict(logits_to_keep=1), dict(logits_to_keep=0)]   # the second one: logits_to_keep an input
    moved = []
    model = _optimized(variant, mode, how, moved)
    if mode == "default":
        ref = _optimized(variant, mode, None, [])
        with torch.no_grad():
            for kw in kws:
                assert torch.equal(model(ids, **kw).logits, ref(ids, **kw).logits), kw
        assert _assert_complete(ref) == _assert_complete(model)
        kws = kws[:1]
    for kw in kws:
        assert torch.equal(_gen(model, ids, **kw), _gen(eager, ids, **kw)), kw
    _assert_complete(model)
    assert moved and all(moved), f"the re-sort moved nothing in some graph: {moved}"
