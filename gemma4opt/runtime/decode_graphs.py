"""Decode steps as CUDA graphs of the rewritten FX graph, without Inductor.

Dynamo hands the backend a graph whose inputs are the model's parameters and buffers (fixed
addresses), HF's static-cache tensors (fixed once marked static) and a few per-step tensors
(input ids, positions, masks). The first call for a new set of fixed addresses runs eagerly (cuBLAS
handles, Triton autotuning), the next one captures, and every later call
copies the per-step tensors into the captured inputs and replays: one launch per step, nothing
read back on the host. Fixed inputs are checked by address on every call, so a new cache object
is captured anew instead of replaying over stale memory.

Checks over the model's tensors run on every step, and a full-depth e4b hands the graph over a
thousand of them: Dynamo's guard on each one's metadata, and this module's read of each address.
The addresses are compared in C++ (cudagraph trees' own check) against the last call's, and the
decode compile drops Dynamo's tensor guards on the model's own parameters and buffers
(``model_guards_dropped``): a model tensor at a new address has its dtype, device, shape, strides
and type compared here with the traced ones, and a difference compiles the decode forward anew
(``ModelTensorsChanged``, ``RecompileOnModelChange``), as the dropped guard would have. (Measured:
the host's work per step of a 42-layer tiny model on a CPU 1.36 -> 1.23 ms under torch 2.13, no
change under 2.11; the e4b's on the H200 2.578 -> 2.574 ms: docs/architecture.md, "The host's
floor".) Within a generate call, paged decode steps then skip Dynamo's entry altogether
(runtime/direct_decode.py): ``replay_if_captured`` is their way in, and ``describe_inputs`` (at
compile) records where Dynamo reads each input and whether the trace's side effects allow it.

Why not Inductor's cudagraph trees: with parameters as graph inputs, Dynamo's plain
``cudagraphs`` backend copies every weight into the graph each step (only AOT-lifted inputs
count as static there) and functionalizes the in-place cache update into full-cache copies;
Inductor avoids both but compiles a real-size Gemma-4 for many minutes.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from gemma4opt.progress import timed
from gemma4opt.runtime import direct_decode

_cuda = torch.cuda      # one name for the CUDA calls below (the CPU tests stand them in)
WARMUP_CALLS = 1
# Captures kept per graph (cache objects x shapes: batch buckets, and for steps of several tokens
# per sequence, token buckets too); the oldest is dropped past it.
MAX_GRAPHS = 32


# Cudagraph trees' check that the inputs at some indices sit at given addresses (CUDA builds only).
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class ModelTensorsChanged(RuntimeError):
    """A model parameter or buffer reached a decode graph with another dtype, device, shape or
    strides than it was traced with: the graph must be compiled again (see the module doc)."""


def _model_ptrs(root: torch.nn.Module) -> set[int]:
    return {t.data_ptr() for t in (*root.parameters(), *root.buffers())}


def model_guards_dropped(root: torch.nn.Module):
    """Dynamo's ``guard_filter_fn`` for the decode compile: every guard kept but the tensor guards
    on ``root``'s own parameters and buffers, which GraphedDecode checks instead (module doc)."""
    def keep(entries):
        own = _model_ptrs(root)
        return [not (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.Tensor)
                     and e.value.data_ptr() in own) for e in entries]
    return keep


def _meta(x) -> tuple | None:
    if not isinstance(x, torch.Tensor):
        return None
    return x.dtype, x.device, x.shape, x.stride(), type(x)


def _is_fixed(x, fixed_ptrs: set[int]) -> bool:
    # Not Dynamo's own static marking: it also marks every tensor reached through a module
    # attribute, such as the paged step's metadata, whose buffers change every step.
    return isinstance(x, torch.Tensor) and x.numel() > 0 and (
        isinstance(x, torch.nn.Parameter) or x.data_ptr() in fixed_ptrs)


def _is_tensor_node(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("example_value"), torch.Tensor)


def _host_slice(gm) -> tuple[fx.GraphModule | None, list[int], set[int]]:
    """The non-tensor outputs and the placeholders only they depend on.

    HF's static cache counts tokens in a Python int (``cumulative_length_int``): Dynamo passes it
    in and returns it + new tokens, and writes that back to the attribute after the call. A CUDA
    graph would replay the value of capture time, so that arithmetic runs on the host every call
    (a few Python adds), and such ints do not force a new capture. Returns (host graph or None,
    positions of host outputs, indices of placeholders used by host outputs only).
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outs = next(n for n in nodes if n.op == "output").args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    host_pos = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and not _is_tensor_node(o)]
    needed, stack = set(), [outs[i] for i in host_pos]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        # Only nodes known to compute Python values run on the host (nodes without a traced
        # value, e.g. inserted by a pass, count as device work).
        if n.op != "placeholder" and ("example_value" not in n.meta or _is_tensor_node(n)):
            raise ValueError(f"non-tensor output depends on device work {n.format_node()}")
        stack.extend(a for a in n.all_input_nodes)
    host_only = set()          # ints only host arithmetic reads, or nothing at all
    for i, p in enumerate(placeholders):
        if _is_tensor_node(p):
            continue
        users, stack, seen = [], list(p.users), set()
        while stack:
            u = stack.pop()
            if u in seen or u.op == "output":
                continue
            seen.add(u)
            users.append(u)
            stack.extend(u.users)
        if all(u in needed for u in users):
            host_only.add(i)
    if not host_pos:
        return None, [], host_only
    g, env = fx.Graph(), {}
    for n in nodes:
        if n in needed or n.op == "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[outs[i]] for i in host_pos))
    return fx.GraphModule(torch.nn.Module(), g), host_pos, host_only


class _Captured:
    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class GraphedDecode:
    """Callable replacing one Dynamo graph: warm-up, capture, then replays (see module doc)."""

    def __init__(self, gm, example_inputs, state, fixed_ptrs: set[int], pool=None, model_ptrs: frozenset = frozenset()):
        self.gm, self.state = gm, state
        self.fixed = [i for i, x in enumerate(example_inputs) if _is_fixed(x, fixed_ptrs)]
        self._last_fixed: tuple | None = None       # the fixed inputs' addresses at the last call
        self._last_ptrs: list | None = None         # the same over every input index, for _ptrs_equal
        # The model's tensors whose Dynamo guards the decode compile drops: their traced metadata.
        self.model_meta = {i: _meta(example_inputs[i]) for i in self.fixed
                           if isinstance(example_inputs[i], torch.nn.Parameter)
                           or example_inputs[i].data_ptr() in model_ptrs}
        fixed = set(self.fixed)
        self.moving = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and i not in fixed]
        try:
            self.host, self.host_pos, host_only = _host_slice(gm)
            self.not_graphed = None
        except ValueError as e:
            # A host value computed from device data cannot come out of a replay: run this graph
            # eagerly (still the rewritten graph with fused ops), and say so in the report.
            self.host, self.host_pos, host_only = None, [], set()
            self.not_graphed = f"decode steps run eagerly, not as CUDA graphs ({e})"
            warnings.warn(f"gemma4opt: {self.not_graphed}", stacklevel=2)
        # Non-tensor inputs the captured kernels read (shapes, sizes) key the capture; those only
        # host arithmetic reads do not.
        self.others = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)
                       and i not in host_only]
        self.pool = pool
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: dict[tuple, int] = {}
        self.last_key: tuple | None = None
        # For runtime/direct_decode.py: where Dynamo reads each input (a Python expression over the
        # entry's locals L and globals G), and why its steps cannot skip Dynamo (None: they can).
        self.sources: list[str | None] = [None] * len(example_inputs)
        self.not_direct: str | None = "built outside a Dynamo compile"
        self.stores: list[tuple] = []           # (object, attribute, constant) Dynamo's code sets after the graph

    def _fixed_key(self, args) -> tuple:
        """The fixed inputs' addresses: one C++ pass comparing them with the last call's, a new
        tuple only when one moved (then the model's tensors are checked against their traces)."""
        last = self._last_fixed
        if last is not None and _ptrs_equal is not None and _ptrs_equal(list(args), self._last_ptrs, self.fixed):
            return last
        key = tuple(args[i].data_ptr() for i in self.fixed)
        if key == last:
            return last
        for i, meta in self.model_meta.items():
            if _meta(args[i]) != meta:
                self.state.graph_key_changes[f"model tensor {i} of other dtype, shape or strides (compiled again)"] += 1
                raise ModelTensorsChanged(
                    f"gemma4opt: decode input {i}, a model parameter or buffer traced as {meta[0]} {tuple(meta[2])} "
                    f"on {meta[1]}, is now {_describe(args[i])}")
        ptrs = [None] * len(args)
        for i, p in zip(self.fixed, key):
            ptrs[i] = p
        self._last_fixed, self._last_ptrs = key, ptrs
        return key

    def _key(self, args) -> tuple:
        return (self._fixed_key(args),
                # Not strides: generate slices its growing id/mask buffers, so strides change every
                # step; copy_ into the captured buffers handles any layout.
                tuple((args[i].shape, args[i].dtype) for i in self.moving),
                tuple(args[i] for i in self.others))

    def __call__(self, *args):
        if self.not_graphed is not None:
            self._fixed_key(args)       # the model tensors' check, as Dynamo's dropped guards did
            self.state.fallbacks[self.not_graphed] += 1
            return self.gm(*args)
        key = self._key(args)
        cap = self.graphs.get(key)
        if cap is None and self.last_key is not None:
            self._note_key_change(self.last_key, key)
        self.last_key = key
        if cap is None:
            n = self.seen.get(key, 0)
            if len(self.seen) > 4 * MAX_GRAPHS:
                self.seen.clear()         # keys seen once and never again (old caches)
            self.seen[key] = n + 1
            if n < WARMUP_CALLS:
                self.state.graph_warmups += 1
                return self._warmup(args)
            with timed(f"capturing decode CUDA graph {self.state.graph_captures} (batch {_batch(args)})"):
                cap = self._capture(args)
            self.state.graph_captures += 1
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = cap
        outputs = self._replay(cap, args)
        if getattr(self.state, "direct", None) is not None:     # what direct_decode learns from (and clears)
            self.state.last_decode_call = (self, args, outputs)
        return outputs

    def replay_if_captured(self, args):
        """The outputs of a replay when a graph is captured for ``args``, else None (nothing run).
        runtime/direct_decode.py's path: warm-ups and captures stay with Dynamo's."""
        if self.not_graphed is not None:
            return None
        try:
            key = self._key(args)
        except ModelTensorsChanged:          # Dynamo's path compiles anew (RecompileOnModelChange)
            return None
        cap = self.graphs.get(key)
        return None if cap is None else self._replay(cap, args)

    def _replay(self, cap: _Captured, args):
        for i in self.moving:
            cap.inputs[i].copy_(args[i], non_blocking=True)
        cap.graph.replay()
        self.state.graphed_calls += 1
        self.state.last_replayed = cap.graph
        if self.host is None:
            return cap.outputs
        outputs = list(cap.outputs)
        for pos, value in zip(self.host_pos, self.host(*args)):
            outputs[pos] = value
        return tuple(outputs)

    def _note_key_change(self, old: tuple, new: tuple) -> None:
        """Count which input made a step miss the captured graphs (the report lists them): a
        fixed input at a new address (a new cache), a moving input of a new shape, or a new int."""
        what = ("address of fixed input", "shape of input", "value of int input")
        for kind, idx, a, b in zip(what, (self.fixed, self.moving, self.others), old, new):
            for i, x, y in zip(idx, a, b):
                if x != y:
                    self.state.graph_key_changes[f"{kind} {i}"] += 1

    def _warmup(self, args):
        # On the current stream: its outputs (logits) are read by generate right after, so no
        # cross-stream lifetimes; the capture itself runs on torch.cuda.graph's own stream.
        return self.gm(*args)

    def _capture(self, args) -> _Captured:
        inputs = list(args)
        for i in self.moving:
            inputs[i] = args[i].clone()
        graph = _cuda.CUDAGraph()
        with _cuda.graph(graph, pool=self.pool):
            outputs = self.gm(*inputs)
        # Keep only the per-step buffers: holding the fixed inputs would keep every old cache
        # alive. A capture is replayed only when the fixed inputs sit at the same addresses again.
        return _Captured(graph, {i: inputs[i] for i in self.moving}, outputs)


def _describe(x) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{x.dtype} {tuple(x.shape)} on {x.device} (strides {x.stride()})"


class RecompileOnModelChange:
    """The decode forward: Dynamo's compiled function, made anew (a new code object, so a new
    compile) when a decode graph finds a model tensor changed in a way its dropped guards would
    have caught (``ModelTensorsChanged``)."""

    def __init__(self, make):
        self.make = make
        self.fn = make()
        self.recompiles = 0

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except ModelTensorsChanged:
            self.fn = self.make()
            self.recompiles += 1
            return self.fn(*args, **kwargs)

    def _entry(self):
        return self.fn._torchdynamo_orig_callable      # api._own_code_entry's function

    def entry_code(self):
        """The code object Dynamo keeps this forward's compiled entries under."""
        return self._entry().__code__

    def frame_locals(self) -> dict:
        """What Dynamo's sources name ``L['fn']`` (HF's forward) and ``G`` (the entry's globals)."""
        entry = self._entry()
        fn = entry.__closure__[entry.__code__.co_freevars.index("fn")].cell_contents
        return {"fn": fn, "__globals__": entry.__globals__}


def _batch(args) -> int | str:
    """The batch a decode graph is captured for (its token input's shape), for progress notes."""
    ids = next((a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.long and a.dim() == 2), None)
    if ids is None:
        return "?"
    return ids.shape[0] if ids.shape[1] == 1 else f"{ids.shape[0]} x {ids.shape[1]} tokens"


def graphed_decode(state, root: torch.nn.Module, gm, example_inputs) -> GraphedDecode:
    """The backend's tail for a rewritten decode graph (one graph memory pool per model)."""
    if state.graph_pool is None:
        state.graph_pool = _cuda.graph_pool_handle()
    # Addresses a graph may bake: the model's parameters and buffers, and the tensors its state lists
    # as fixed (``gemma4opt.fixed_tensors.FixedTensors``: HF's static cache once allocated, the paged
    # KV pool and tables, the staged step metadata).
    own = frozenset(_model_ptrs(root))
    graphed = GraphedDecode(gm, example_inputs, state, own | state.fixed.ptrs(), state.graph_pool, model_ptrs=own)
    graphed.sources, graphed.not_direct = direct_decode.describe_inputs(gm, graphed)
    return graphed
