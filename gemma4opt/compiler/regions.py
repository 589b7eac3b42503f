"""Find module regions in a Dynamo FX graph and rewrite them.

Dynamo records, for every node, the stack of modules whose forward produced it
(``node.meta["nn_module_stack"]``). A *region* is the set of compute nodes whose innermost
module is one module instance. Patterns find their block by module type, then confirm it by
structure: nothing relies on node names, node order or concrete shapes.
"""
from __future__ import annotations

import collections
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def op_name(node: fx.Node) -> str:
    """A version-stable name for a node's operation: 'add', 'pow', 'float', 'linear', ..."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        target = node.target
        if target in (operator.truediv, torch.div):
            return "div"
        name = getattr(target, "__name__", str(target))
        return name.lstrip("_") if name.startswith("__") else name
    return node.op


def _clean_path(path: str) -> str:
    # "L['self'].model._modules['layers']['0']" and "L['self'].model.layers.0" -> "model.layers.0"
    path = re.sub(r"^L\['(self|fn)'\](\.__self__)?\.?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _type_name(t) -> str:
    if isinstance(t, type):
        return t.__name__
    return str(t).rsplit(".", 1)[-1].strip("'>")


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """[(path, type_name), ...] outermost first; path relative to the compiled root."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(_clean_path(p), _type_name(t)) for p, t in stack.values()]


def innermost(node: fx.Node) -> tuple[str, str] | None:
    stack = module_stack(node)
    return stack[-1] if stack else None


def module_name(node: fx.Node) -> str:
    """The innermost module's own name ("q_proj", "down_proj", ...), "" outside any module."""
    inner = innermost(node)
    return inner[0].rsplit(".", 1)[-1] if inner else ""


def is_compute(node: fx.Node) -> bool:
    if node.op not in _COMPUTE_OPS:
        return False
    # Dynamo's symbolic-size bookkeeping is not part of any block's math.
    return not (node.op == "call_function" and getattr(node.target, "__module__", "") == "torch.fx.experimental.sym_node") and op_name(node) not in ("sym_size", "size", "_log_api_usage_once")


@dataclass
class Region:
    path: str
    type_name: str
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def node_set(self) -> set[fx.Node]:
        return set(self.nodes)

    def outputs(self) -> list[fx.Node]:
        inside = self.node_set
        return [n for n in self.nodes if any(u not in inside for u in n.users)]

    def op_counts(self) -> collections.Counter:
        return collections.Counter(op_name(n) for n in self.nodes)

    def by_op(self, name: str) -> list[fx.Node]:
        return [n for n in self.nodes if op_name(n) == name]


def regions_of_type(graph: fx.Graph, type_name: str, subtree: bool = False) -> list[Region]:
    """Regions of every module instance of ``type_name``, in graph order.

    subtree=False: nodes whose innermost module is the instance.
    subtree=True: nodes anywhere below the instance (its child modules included).
    """
    found: dict[str, Region] = {}
    for node in graph.nodes:
        if not is_compute(node):
            continue
        stack = module_stack(node)
        entries = stack if subtree else stack[-1:]
        for path, tname in entries:
            if tname == type_name:
                found.setdefault(path, Region(path, tname)).nodes.append(node)
                break
    return list(found.values())


_PURE_METHODS = frozenset(("to", "transpose", "contiguous", "view", "reshape", "unsqueeze", "squeeze", "permute"))


def drop_dead_views(graph: fx.Graph) -> int:
    """Erase layout/device method calls whose result nobody uses; returns how many.

    Dynamo keeps them, and a matcher that counts users would take them for a second use: e.g.
    transformers 5.17's KV-shared layers call ``key_states.to(device)`` on their producer's K/V
    and, with the paged cache, never use it. These methods have no side effects.
    """
    dead = 0
    for node in list(reversed(graph.nodes)):    # users first, so chains of dead views go in one pass
        if node.op == "call_method" and node.target in _PURE_METHODS and not node.users:
            graph.erase_node(node)
            dead += 1
    return dead


def erase_region(graph: fx.Graph, nodes: list[fx.Node], keep_used: bool = False) -> None:
    """Erase nodes (all users must be inside ``nodes`` or already rewired; with ``keep_used``,
    nodes something outside still reads, such as size arithmetic other layers share, stay)."""
    for n in reversed(nodes):
        if n.users:
            if keep_used:
                continue
            raise RuntimeError(f"gemma4opt: cannot erase {n.format_node()}: still used by {list(n.users)}")
        graph.erase_node(n)


def replace_output(graph: fx.Graph, old: fx.Node, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args)`` at ``old`` (see ``place``), move old's users to it, keep old's meta."""
    with graph.inserting_before(old):
        new = graph.call_function(target, args, kwargs or {})
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    place([new])
    return new


def _inputs_first(nodes) -> list[fx.Node]:
    """``nodes`` ordered so that each comes after those of them it reads (their own dataflow)."""
    todo, done, out = set(nodes), set(), []

    def visit(n):
        if n in done:
            return
        done.add(n)
        for a in n.all_input_nodes:
            if a in todo:
                visit(a)
        out.append(n)

    for n in nodes:
        visit(n)
    return out


def _before_users(n: fx.Node) -> bool:
    return all(n < u for u in n.users)


def place(nodes) -> None:
    """Order replacement nodes after all of their inputs and before all of their users.

    Call it once a replacement is wired in (its users moved to it). A pattern inserts at an
    anchor of the block it replaces (e.g. the block's output), but Dynamo's node order is not
    fixed: the same graph may define an input of the replacement after that anchor (a slice
    bound computed late, e.g. ``-logits_to_keep`` once it is a graph input) or use one of the
    block's outputs before it (e.g. the router's top-k index read before its weights). Nodes
    compare by their position (``fx.Node.__lt__``), so this never relies on a particular order:

    1. each node that comes before one of its inputs moves right after its latest input;
    2. if a node still comes after one of its users, every node moves as early as its inputs
       allow (right after its latest input), the only placement that can satisfy every user;
    3. if that fails too, no valid place exists in this order: a clear error, not a graph that
       ``lint`` rejects later or, worse, one that reads a value before it is computed.

    Nodes already in a valid place stay where the pattern put them (so a mutating op such as
    the paged KV append keeps its program position unless the order forces a move).
    """
    nodes = _inputs_first(list(nodes))
    for n in nodes:
        latest = max(n.all_input_nodes, default=None)
        if latest is not None and not latest < n:
            latest.append(n)
    if all(_before_users(n) for n in nodes):
        return
    for n in nodes:
        latest = max(n.all_input_nodes, default=None)
        if latest is None:       # reads nothing (a constant): just before its first user
            if n.users:
                min(n.users).prepend(n)
        elif latest.next is not n:
            latest.append(n)
    for n in nodes:
        if not _before_users(n):
            latest = max(n.all_input_nodes)
            raise RuntimeError(f"gemma4opt: cannot place {n.format_node()}: its input {latest.name} comes after "
                               f"its first user {min(n.users).format_node()}")


def const_arg(node: fx.Node, index: int, kw: str | None = None):
    """A literal argument of a node, or None if it is a node / missing."""
    if index < len(node.args):
        v = node.args[index]
    elif kw is not None and kw in node.kwargs:
        v = node.kwargs[kw]
    else:
        return None
    return None if isinstance(v, fx.Node) else v


def scalar_operand(node: fx.Node):
    """For a binary op with one node and one literal operand: (node_operand, literal)."""
    a, b = node.args[0], node.args[1]
    if isinstance(a, fx.Node) and not isinstance(b, fx.Node):
        return a, b
    if isinstance(b, fx.Node) and not isinstance(a, fx.Node):
        return b, a
    return None, None


def resolve_module(root: torch.nn.Module, path: str) -> torch.nn.Module:
    mod = root
    for part in filter(None, path.split(".")):
        mod = getattr(mod, part) if not part.isdigit() else mod[int(part)]
    return mod
