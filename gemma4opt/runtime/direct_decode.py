"""Decode steps that call their CUDA graph without entering Dynamo, within one generate call.

Why: every call of a torch.compile'd forward first runs Dynamo's entry: its guards over everything
the trace read (every module's hooks, attributes and types, the config, each weight: 12,443 checks
on a 42-layer model) and its code gathering the graph's inputs (over a thousand weights, each
through a chain of module lookups), then the code rebuilding the output. On a deep model at
batch 1 that is most of the host's time per step, and the host, not the GPU, then sets the pace
(docs/architecture.md, "The host's floor").

How: the decode steps of a generate call enter Dynamo as every call does until one of them
replays a captured graph without compiling anything. From that step a ``Plan`` is learned: the
call's keywords (which are tensors, which constants, which the same object), the graph's inputs
that are not the model's weights and where Dynamo read them (``describe_inputs``: the sources of
the graph's placeholders, gathered by one compiled expression), and how the output object is
built from the graph's outputs. Each later step of the same generate call checks what can differ
between steps, gathers those inputs and replays the same graph:
- the keywords: the same names; tensors of the same type, dtype, device, shape; constants equal;
  the cache the same object;
- torch's global state (grad mode, autocast, deterministic algorithms...; Dynamo's own
  ``GlobalStateGuard``), the torch-function mode stack, the default device;
- the paged step's own state that the attention function reads (``StepContext.graph_signature``);
- every gathered input: tensors of the same type, dtype, device, shape and (fixed ones) strides,
  at the addresses the capture baked (GraphedDecode's key), ints the capture was keyed on. The
  call's own inputs are gathered every step; those reached through the model (the paged step's
  staged views and pools) again only when the StepContext's ``step_objects`` changed.
A failed check sends the step through Dynamo (all guards), which may learn a new plan. A plan
lives only while its generate call runs: the next call's first steps enter Dynamo again.

Not checked, by contract (Gemma4OptConfig.direct_decode's doc): the model itself (its modules,
weights, config) and module-level globals HF's code reads, which no step of a generate
changes; a logits processor, stopping criterion or streamer that changes them in the middle of a
generate call is seen from the next call on. (Module hooks are checked on every call, direct or
not: runtime/hook_watch.py.) ``verify`` (tests) checks each direct step against Dynamo's full
guards.

After the graph, Dynamo's code builds the output and applies the trace's side effects; a direct
step does the same when those are constants stored on attributes (HF's output capturing resets
its context variable so). A graph is not called directly otherwise (``describe_inputs``): host
values Dynamo's code stores back (HF's static cache counts tokens so; the paged cache counts them
outside the forward), other side effects, or inputs whose source is not known.
"""
from __future__ import annotations

import collections
import contextlib

import torch
import torch.utils._device

_CONSTANT_TYPES = (type(None), bool, int, float, str)


def describe_inputs(gm, graphed) -> tuple[list[str | None], str | None]:
    """(each placeholder's source expression or None, why steps cannot skip Dynamo or None).
    Runs inside the backend, while Dynamo's tracer is current (its side effects are read)."""
    sources = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        src = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(src, "name", None)
        name = name() if callable(name) else name
        sources.append(name if isinstance(name, str) else None)
    if graphed.not_graphed is not None:
        return sources, "the graph runs eagerly"
    if graphed.host is not None:
        return sources, "the graph returns host values that Dynamo's code stores after each step"
    graphed.stores, effects = _side_effects()
    if effects is not None:
        return sources, effects
    unknown = [i for i in _gathered(graphed, len(sources)) if sources[i] is None]
    if unknown:
        return sources, f"inputs {unknown[:4]} have no known source"
    return sources, None


def _side_effects() -> tuple[list[tuple], str | None]:
    """The trace being compiled's mutations of objects that existed before the call, which
    Dynamo's code applies after the graph: ([(object, attribute, value)] when they are all
    constants stored on attributes, None), or ([], why a direct step could not replay them).
    (Objects the trace made, such as the output, are not side effects: the Plan builds those.)"""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables import ConstantVariable, TensorVariable
        from torch._dynamo.variables.base import AttributeMutationNew

        effects = InstructionTranslator.current_tx().output.side_effects
        stores, other = [], []
        for v in effects.id_to_variable.values():
            if not effects.is_modified(v) or isinstance(v.mutation_type, AttributeMutationNew):
                continue
            attrs = effects.store_attr_mutations.get(v, {})
            if isinstance(v, TensorVariable) and not attrs:
                continue              # a tensor written in the graph: part of the replay
            if type(v).__name__ != "UserDefinedObjectVariable" or not attrs or \
                    not all(isinstance(x, ConstantVariable) for x in attrs.values()):
                other.append(type(v).__name__)
                continue
            stores.extend((v.value, k, x.as_python_constant()) for k, x in attrs.items())
    except Exception as e:              # another Dynamo: do not guess
        return [], f"its side effects are not known here ({type(e).__name__}: {e})"
    if other:
        return [], f"the forward has side effects Dynamo applies after each step ({other[:3]})"
    return stores, None


def _gathered(graphed, n: int) -> list[int]:
    """The inputs a direct step gathers anew: all but the model's weights and buffers."""
    return [i for i in range(n) if i not in graphed.model_meta]


def _is_constant(v) -> bool:
    if isinstance(v, (dict, tuple, list)):
        items = v.items() if isinstance(v, dict) else enumerate(v)
        return all(_is_constant(k) and _is_constant(x) for k, x in items)
    return type(v) in _CONSTANT_TYPES


def _tensor_meta(t: torch.Tensor, strides: bool) -> tuple:
    return type(t), t.dtype, t.device, t.shape, t.requires_grad, t.stride() if strides else None


class Plan:
    """How to run one decode step directly (module doc), learned from a step Dynamo ran."""

    def __init__(self, graphed, args, outputs, kwargs, out, frame_locals, signature, step_objects=None):
        self.graphed, self.signature = graphed, signature
        self.keys = tuple(kwargs)
        self.tensors, self.constants, self.objects = [], [], []
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                self.tensors.append((k, _tensor_meta(v, False)))
            elif _is_constant(v):
                self.constants.append((k, type(v), v))
            else:
                self.objects.append((k, v))
        self.global_state = torch._C._dynamo.guards.GlobalStateGuard()
        self.modes = torch._C._len_torch_function_stack()
        self.device = torch.utils._device.CURRENT_DEVICE
        self.saved_hooks = _saved_tensors_hooks()
        self.args = list(args)
        self.globals, self.fn = frame_locals["__globals__"], frame_locals["fn"]
        fixed = set(graphed.fixed)
        # Two groups of inputs: the call's own (its keywords', gathered every step) and the rest
        # (the paged step's tensors reached through the model), gathered again only when the
        # StepContext's step objects are not those of the last step (``step_objects``).
        idx = _gathered(graphed, len(args))
        own = [i for i in idx if graphed.sources[i].startswith("L['kwargs']")]
        rest = [i for i in idx if not graphed.sources[i].startswith("L['kwargs']")]
        self.groups = [(g, _gatherer(graphed, g), [_meta_of(args[i], i in fixed) for i in g]) for g in (own, rest)]
        for g, gather, _ in self.groups:
            if any(a is not args[i] for a, i in zip(gather(_frame(self.fn, kwargs), self.globals), g)):
                raise ValueError("the sources do not give the graph's inputs")
        self.step_objects = step_objects
        self.last_objects = step_objects() if step_objects is not None else None
        # The output: a ModelOutput (an OrderedDict whose non-None fields are also its items) made
        # as a copy of the learned step's, its graph outputs and arguments swapped for this step's
        # (HF's dataclass __init__ costs ~16 µs a step; this ~1).
        self.out_type = type(out)
        self.attrs = [(k, self._where(v, outputs, kwargs)) for k, v in vars(out).items()]
        self.items = [(k, self._where(v, outputs, kwargs)) for k, v in out.items()]
        rebuilt = self._output(outputs, kwargs)
        if vars(rebuilt).keys() != vars(out).keys() or any(vars(rebuilt)[k] is not v for k, v in vars(out).items()) \
                or list(rebuilt.keys()) != list(out.keys()) or any(rebuilt[k] is not out[k] for k in out.keys()):
            raise ValueError("the output object is not rebuilt as Dynamo built it")
        self.missed = ""

    @staticmethod
    def _where(v, outputs, kwargs) -> tuple:
        if v is None or type(v) in _CONSTANT_TYPES:
            return "constant", v
        for j, o in enumerate(outputs):
            if o is v:
                return "output", j
        for name, x in kwargs.items():
            if x is v:
                return "keyword", name
        raise ValueError(f"an output field ({type(v).__name__}) is neither a graph output, an argument nor a constant")

    def _output(self, outputs, kwargs):
        def value(kind, w):
            return outputs[w] if kind == "output" else kwargs[w] if kind == "keyword" else w

        out = self.out_type.__new__(self.out_type)
        vars(out).update((k, value(*w)) for k, w in self.attrs)
        collections.OrderedDict.update(out, ((k, value(*w)) for k, w in self.items))
        return out

    def run(self, kwargs):
        """The step's output, or None (``missed`` says why) when a check fails."""
        why = self._check(kwargs)
        if why is None:
            why, objects = self._gather(kwargs)
        if why is None:
            outputs = self.graphed.replay_if_captured(self.args)
            if outputs is not None:
                self.last_objects = objects
                for obj, attr, value in self.graphed.stores:     # what Dynamo's code stores after the graph
                    setattr(obj, attr, value)
                return self._output(outputs, kwargs)
            why = "no graph captured for these inputs"
        self.missed = why
        return None

    def _gather(self, kwargs) -> tuple[str | None, tuple | None]:
        """Put this step's inputs into ``args``, each checked against the learned step's: (why not, or
        None; the step objects seen)."""
        args = self.args
        objects = self.step_objects() if self.step_objects is not None else None
        same = objects is not None and all(a is b for a, b in zip(objects, self.last_objects))
        for n, (idx, gather, metas) in enumerate(self.groups):
            if n == 1 and same:
                continue
            try:
                got = gather(_frame(self.fn, kwargs), self.globals)
            except (LookupError, AttributeError, TypeError) as e:
                return f"an input is no longer where it was ({type(e).__name__})", None
            for i, v, meta in zip(idx, got, metas):
                # args[i] holds an object already checked: the same object again is not re-checked
                # (the KV pools, a layout's staged views). Its metadata could change only by in-place
                # metadata ops (resize_, set_) that neither HF nor gemma4opt applies to these; a
                # fixed input's address is compared in GraphedDecode's key all the same.
                if v is args[i]:
                    continue
                if _meta_of(v, meta[-1] is not None) != meta:
                    return f"input {i} ({self.graphed.sources[i]}) changed", None
                args[i] = v
        return None, objects

    def _check(self, kwargs) -> str | None:
        if tuple(kwargs) != self.keys:
            return "other keywords"
        for k, meta in self.tensors:
            v = kwargs[k]
            if not isinstance(v, torch.Tensor) or _tensor_meta(v, False) != meta:
                return f"keyword {k} of another type, dtype, device or shape"
        for k, kind, want in self.constants:
            v = kwargs[k]
            if type(v) is not kind or v != want:
                return f"keyword {k} changed"
        for k, want in self.objects:
            if kwargs[k] is not want:
                return f"keyword {k} is another object"
        if not self.global_state.check() or torch._C._len_torch_function_stack() != self.modes \
                or torch.utils._device.CURRENT_DEVICE != self.device or _saved_tensors_hooks() != self.saved_hooks:
            return "torch's global state changed"
        if self.signature is not None and any(a is not b for a, b in zip(self.signature[0](), self.signature[1])):
            return "the paged step's state changed"
        return None


def _saved_tensors_hooks():
    """The innermost saved-tensors hooks, which Dynamo guards too (functions: compared by identity)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _gatherer(graphed, idx: list[int]):
    """One compiled expression returning the inputs at ``idx`` (Dynamo's source expressions over
    the entry's locals L and globals G), made once per graph and group."""
    made = graphed.__dict__.setdefault("_gatherers", {})
    fn = made.get(tuple(idx))
    if fn is None:
        fn = made[tuple(idx)] = eval(f"lambda L, G: ({''.join(graphed.sources[i] + ', ' for i in idx)})",  # noqa: S307
                                     {}, {})
    return fn


def _meta_of(v, strides: bool):
    if isinstance(v, torch.Tensor):
        return _tensor_meta(v, strides)
    return type(v), v if type(v) in _CONSTANT_TYPES else id(v), None


def _frame(fn, kwargs) -> dict:
    """The locals of the decode entry (api._own_code_entry) as Dynamo's sources name them."""
    return {"fn": fn, "args": (), "kwargs": kwargs}


class DirectDecode:
    """One model's decode calls: through Dynamo, or through a learned Plan (module doc)."""

    def __init__(self, state, enabled: bool, signature=None, step_objects=None, entering=None):
        self.state, self.enabled = state, enabled
        self.entering = entering or contextlib.nullcontext   # () -> the context Dynamo's calls run in
        self.signature = signature       # () -> the paged step's state the attention reads
        self.step_objects = step_objects  # () -> the paged step's tensor holders (Plan.groups)
        self.plan: Plan | None = None
        self.depth = 0                   # generate calls running on this model
        self.steps = 0                   # steps run directly (report)
        self.entered = 0                 # steps that entered Dynamo (report)
        self.misses: collections.Counter = collections.Counter()     # why a plan did not run a step
        self.not_learned: collections.Counter = collections.Counter()  # why no plan was learned
        self.verify = False              # tests: check each direct step against Dynamo's guards

    @contextlib.contextmanager
    def generating(self):
        """The scope of one generate call: plans are learned and used only inside it."""
        self.depth += 1
        self.plan = None
        try:
            yield
        finally:
            self.depth -= 1
            self.plan = None

    def __call__(self, kwargs):
        plan = self.plan
        if plan is not None:
            # (verify: which compiled entry Dynamo would run, judged before the step as Dynamo does)
            entry = None
            if self.verify:
                with self.entering():
                    entry = _entry_passing(self.state.decode_forward, kwargs)
            out = plan.run(kwargs)
            if out is not None:
                if self.verify and entry is not plan.entry:
                    raise AssertionError("gemma4opt: a direct decode step ran where Dynamo's guards of the entry "
                                         "it was learned on fail")
                self.steps += 1
                return out
            self.misses[plan.missed] += 1
            self.plan = None
        state = self.state
        compiled, state.last_decode_call = state.graphs_compiled, None
        self.entered += 1
        with self.entering():
            out = state.decode_forward(**kwargs)
        call, state.last_decode_call = state.last_decode_call, None
        if self.enabled and self.depth and call is not None and state.graphs_compiled == compiled:
            self.plan = self._learn(call, kwargs, out)
        return out

    def _learn(self, call, kwargs, out) -> Plan | None:
        graphed, args, outputs = call
        if graphed.not_direct is not None:
            self.not_learned[graphed.not_direct] += 1
            return None
        forward = self.state.decode_forward
        try:
            sig = None if self.signature is None else (self.signature, self.signature())
            plan = Plan(graphed, args, outputs, kwargs, out, forward.frame_locals(), sig, self.step_objects)
        except Exception as e:      # a plan that cannot be learned only costs the speed-up
            self.not_learned[f"{type(e).__name__}: {e}"] += 1
            return None
        if self.verify:
            with self.entering():
                plan.entry = _entry_passing(forward, kwargs)
        return plan

    def describe(self) -> str:
        """The report's line."""
        if not self.enabled:
            return "graphed decode steps: every one enters Dynamo (direct_decode=False)"
        line = f"graphed decode steps run directly (skipping Dynamo's entry): {self.steps}, through Dynamo: {self.entered}"
        for what, counts in (("plans missed", self.misses), ("no plan", self.not_learned)):
            if counts:
                line += f"; {what}: " + ", ".join(f"{k}: {v}" for k, v in counts.most_common(4))
        return line


def _entry_passing(forward, kwargs):
    """The first of Dynamo's cache entries for the decode entry whose guards pass on this call
    (the one Dynamo would run), or None."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    f_locals = _frame(forward.frame_locals()["fn"], kwargs)
    for entry in _debug_get_cache_entry_list(forward.entry_code()):
        if entry.guard_manager.check(f_locals):
            return entry
    return None
