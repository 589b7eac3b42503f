"""Which optimized model a gemma4opt op call runs for: that model's per-shape picks and experts modules.

A custom op takes tensors and numbers, not the model that calls it. So each optimized model owns
an ``OpState`` (``model._gemma4opt.op_state``), its forward makes it the active one for the length
of the call (``active``), and the ops read the active one (``current``). Two optimized models in
one process then time and keep their own picks (neither runs, nor reports, a shape picked for the
other's weights) and each finds only its own experts modules. A context variable, not a global,
so a model called inside another's call (an assistant during generate) restores the outer one's.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch

from gemma4opt.ops.pick import ShapePicks

# The ops that pick per shape (ops/pick.py) and the margin their Triton kernel must beat the path
# it replaces by: 0.98, at least 2 % faster (ties go to the path the model had).
MARGINS = {"linear": 0.98, "linear_softcap": 0.98, "moe_experts": 0.98, "fp8_linear": 0.98, "gate_up_gelu": 0.98,
           "gelu_linear": 0.98, "norm_linear": 0.98, "norm_fp8_linear": 0.98, "quant_fp8_linear": 0.98,
           "fp8_mlp": 0.98}


class OpState:
    """One optimized model's op state: a ShapePicks per op that picks per shape (``shapes[op]``),
    and the experts modules its ``gemma4opt.moe_experts`` calls find by key (``experts``; weak
    references: the model owns both the modules and this state, a freed model's keys find nothing)."""

    def __init__(self):
        self.shapes = {op: ShapePicks(margin) for op, margin in MARGINS.items()}
        self.experts: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()


# The state of op calls made outside every optimized model's forward: ops called directly (tests,
# benchmarks, a graph run by hand). The only process-level OpState: such calls belong to no model,
# and they still need a shape's pick kept across calls (timed once, not on every call).
DEFAULT = OpState()
_ACTIVE: contextvars.ContextVar[OpState] = contextvars.ContextVar("gemma4opt_op_state", default=DEFAULT)


def current() -> OpState:
    """The OpState of the optimized model whose call is running, else ``DEFAULT``."""
    return _ACTIVE.get()


@contextlib.contextmanager
def active(state: OpState) -> Iterator[OpState]:
    """Make ``state`` the one the ops read until the block ends (then the previous one again)."""
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)


def picks_for(op: str, state: OpState | None = None) -> ShapePicks:
    """``op``'s per-shape picks in ``state``, by default in the active one."""
    return (state if state is not None else current()).shapes[op]


def picks_api(op: str):
    """An op module's ``picks(state=None)`` (the shapes timed so far in ``state``, default the active
    one, and whether each runs the Triton kernel) and ``failures(state=None)`` (the shapes whose Triton
    kernel raised when timed, with why): what report() and the tests read."""
    def picks(state: OpState | None = None) -> dict[tuple, bool]:
        return picks_for(op, state).picks()

    def failures(state: OpState | None = None) -> dict[tuple, str]:
        return picks_for(op, state).failures()

    return picks, failures
