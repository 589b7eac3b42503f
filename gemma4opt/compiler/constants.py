"""Hoist tensor literals built inside a captured graph (``torch.tensor([-1], device=...)``) into
graph constants made once at compile time.

Why: HF's sliding-window static cache builds an index tensor from a Python list on every
update. Each call is a host→device copy from pageable memory, which CUDA graph capture refuses
("Cannot copy between CPU and CUDA tensors during CUDA graph capture") and which costs a copy per
layer per step outside graphs too. A literal is the same value on every call, so one constant
with a fixed address serves every call and every replay.
"""
from __future__ import annotations

import torch
import torch.fx as fx

_FACTORIES = (torch.tensor, torch.as_tensor)


def _is_literal(a) -> bool:
    if isinstance(a, fx.Node):
        return False
    if isinstance(a, (list, tuple)):
        return all(_is_literal(x) for x in a)
    if isinstance(a, dict):
        return all(_is_literal(x) for x in a.values())
    return isinstance(a, (int, float, bool, complex, type(None), torch.dtype, torch.device, str))


def _mutated(node: fx.Node) -> bool:
    """True if any user may write into the tensor (in-place method or out=/setitem target)."""
    for u in node.users:
        name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and u.args and u.args[0] is node:
            return True
        if name == "setitem" and u.args and u.args[0] is node:
            return True
        if u.kwargs.get("out") is node:
            return True
    return False


def hoist_tensor_literals(gm: fx.GraphModule) -> int:
    """Replace every literal tensor factory call that nothing writes into; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _FACTORIES:
            continue
        if not (_is_literal(node.args) and _is_literal(node.kwargs)) or _mutated(node):
            continue
        value = node.target(*node.args, **node.kwargs)
        name = f"_gemma4opt_literal_{count}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, value)
        with gm.graph.inserting_before(node):
            const = gm.graph.get_attr(name)
        const.meta.update(node.meta)
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
