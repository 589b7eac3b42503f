"""optimize(): check the model, prepare patterns, install the compiled forward on this instance."""
from __future__ import annotations

import builtins
import collections
import dataclasses
import functools
import itertools
import threading
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

import gemma4opt.ops  # noqa: F401  (registers torch.ops.gemma4opt.*)
from gemma4opt.compiler.backend import make_backend
from gemma4opt.compiler.pass_manager import PassManager, PatternStats
from gemma4opt.compiler.pattern import PassContext
from gemma4opt.config import Gemma4OptConfig, choose_attention
from gemma4opt.copying import PICKLED, install_copying
from gemma4opt.edits import InstanceEdits, own_configs
from gemma4opt.fixed_tensors import FixedTensors
from gemma4opt.ops.fp8_checkpoint import adopt_fp8_modules
from gemma4opt.ops.fp8_weights import (foreign_projections, fp8_linears, fp8_lm_head, quantize_linears,
                                        quantize_lm_head)
from gemma4opt.ops.state import OpState, active
from gemma4opt.paged.forward import is_paged, paged_attention_on, paged_forward
from gemma4opt.paged.install import check_paged_supported, install_paged
from gemma4opt.paged.pool import kv_pool_dtype
from gemma4opt.paged.step import StepContext
from gemma4opt.patterns import build_patterns
from gemma4opt.patterns.merged_projections import MERGED_ATTR
from gemma4opt.runtime import decode_graphs
from gemma4opt.runtime.direct_decode import DirectDecode
from gemma4opt.runtime.hook_watch import HookWatch
from gemma4opt.runtime.module_watch import ModuleTreeWatch
from gemma4opt.runtime.weight_watch import MergedWeightWatch, TiedHeadWatch
from gemma4opt.runtime.static_cache import install_static_cache_reuse
from gemma4opt.runtime.stop_check import install_deferred_stop_check
from gemma4opt.step_inputs import cache_of, one_token_step, step_input
from gemma4opt.tensor_parallel import Shard, plan_shard, shard_model, sharded

SUPPORTED_CLASSES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# "meta": capture and rewrite full-size configs without their memory, to read the report.
SUPPORTED_DEVICES = ("cpu", "cuda", "meta")
# Per-call features the captured graph does not cover: these calls run HF's own forward.
_FALLBACK_KWARGS = ("output_attentions", "output_hidden_states", "output_router_logits", "labels",
                    "return_shared_kv_states")


_entry_ids = itertools.count()
# Graphs per optimized model: prefill + decode (+ sliding-cache strides) per cache kind, with
# and without an attention mask. Dynamo's default (8) is too tight for that; raise, never lower.
_RECOMPILE_LIMIT = 32


def _raise_recompile_limit() -> None:
    """Dynamo's config values are per thread (context variables): a call from a thread that has not
    seen the raised limit (a server's worker) would stop at 8 graphs with a hard error (fullgraph),
    so every call raises it where it runs (a read, ~2 µs, once set)."""
    dyn = torch._dynamo.config
    if dyn.recompile_limit < _RECOMPILE_LIMIT:
        dyn.recompile_limit = _RECOMPILE_LIMIT


@dataclass
class OptimizationState:
    """Everything gemma4opt knows about one optimized model; lives at ``model._gemma4opt``. Every
    mutable piece of an optimized model's state is here (or reached from here), so two models in
    one process share none of it."""

    config: Gemma4OptConfig                      # resolved for the model's device and dtype
    model_class: str
    scope: str                                   # "causal_lm", or "text_model" (the text decoder of a VLM)
    text_config: object                          # the model's own copy of its text config
    user_config: Gemma4OptConfig | None = None   # as passed to optimize() (re-resolved after .to())
    mode_reason: str = ""                        # which attention mode runs, and why (report)
    disabled_reason: str | None = None           # set: the config was not recognized, HF's path runs
    edits: InstanceEdits | None = None           # what optimize() changed on the instance, to take back
    hf_attn: str | None = None                   # the model's own attention implementation (non-paged calls)
    # Compilation: patterns' counts per pattern name, and the compiled entry points.
    stats: dict[str, PatternStats] = field(default_factory=dict)
    pass_manager: PassManager | None = None
    original_forward: Callable | None = None
    compiled_forward: Callable | None = None     # any call: prefill, or decode on a dynamic cache
    hf_forward: Callable | None = None           # paged mode: calls without a paged cache (HF attention)
    decode_forward: Callable | None = None       # decode steps as CUDA graphs (static or paged cache)
    decode_graphs: Callable | None = field(default=None, repr=False)   # makes a decode graph's runner (backend)
    compiled_graphs: list = field(default_factory=list, repr=False)     # what the backend compiled (compiler/backend.py)
    hooks: HookWatch | None = None               # module hooks changed after optimize(): HF's forward runs
    weights: MergedWeightWatch | None = None     # merged weights' views given new storage: copied back
    modules: ModuleTreeWatch | None = None       # submodules replaced after optimize(): optimized again
    head: TiedHeadWatch | None = None            # fp8 lm_head copy of a tied table: quantized again on edits
    gen_written: dict = field(default_factory=dict)   # generation-config fields optimize() set: (before, set)
    generating: int = 0                          # generate calls under way (nested: an assistant's)
    # One generate or forward call at a time, per model: the paged step context, the decode graphs'
    # static inputs and Dynamo's compiled entries are one per model, and calls from two threads
    # interleaved on them gave wrong tokens or failed (HF's own model takes such calls).
    calls: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    direct: DirectDecode | None = None           # paged decode steps that skip Dynamo's entry (runtime/direct_decode.py)
    last_decode_call: tuple | None = None        # (graph, inputs, outputs) of the last replay, for ``direct``
    # Runtime.
    context: StepContext | None = None           # the paged KV pool and step (attention="paged")
    fixed: FixedTensors = field(default_factory=FixedTensors)   # addresses decode graphs may bake
    op_state: OpState = field(default_factory=OpState)          # per-shape picks, experts modules (ops/state.py)
    static_cache: tuple | None = None            # (key, cache) reused by generate (runtime/static_cache.py)
    graph_pool: object = None                    # CUDA graph memory pool shared by this model's decode graphs
    last_replayed: object = None                 # the decode CUDA graph replayed last (benchmarks time it alone)
    stop_check: str = "per step (HF)"            # how generate checks for the end (runtime/stop_check.py)
    quantized: dict[str, int] = field(default_factory=dict)   # quantization="fp8": Fp8Linear swaps (report)
    checkpoint_fp8: dict[str, int] = field(default_factory=dict)   # transformers FP8Linear adopted / kept (report)
    shard: Shard | None = None                   # tensor_parallel: this rank's share (tensor_parallel.py)
    # Counters (report).
    graphs_compiled: int = 0
    compiled_calls: int = 0
    graphed_calls: int = 0
    graph_warmups: int = 0                       # decode calls run eagerly before a capture (runtime/decode_graphs.py)
    graph_captures: int = 0
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    graph_key_changes: collections.Counter = field(default_factory=collections.Counter)  # why steps missed graphs


def _check_model(model) -> torch.nn.Module:
    cls = type(model).__name__
    if cls not in SUPPORTED_CLASSES or not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"gemma4opt.optimize: got a {type(model).__module__}.{cls}; supported: "
            f"transformers {' and '.join(SUPPORTED_CLASSES)} (Gemma-4 text generation models)"
        )
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("gemma4opt.optimize: the model has no parameters")
    if getattr(model, "_tp_size", None) not in (None, 1):
        raise ValueError(f"gemma4opt.optimize: this model was split by transformers' tensor parallel (tp_plan, "
                         f"tp_size={model._tp_size}); gemma4opt splits the model itself: load it without tp_plan "
                         "and pass Gemma4OptConfig(tensor_parallel=True) under torchrun")
    if param.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"gemma4opt.optimize: model dtype {param.dtype} is not supported; supported: "
                        f"{[str(d) for d in SUPPORTED_DTYPES]}")
    if param.device.type not in SUPPORTED_DEVICES:
        raise ValueError(f"gemma4opt.optimize: model on device {param.device}; supported: {list(SUPPORTED_DEVICES)}")
    if cls == "Gemma4ForCausalLM":
        return model
    return model.model.language_model


def _unrecognized_config(text_config) -> str | None:
    """A reason when the text config has something the passes were not written for."""
    if getattr(text_config, "model_type", None) != "gemma4_text":
        return f"text config model_type {getattr(text_config, 'model_type', None)!r} is not 'gemma4_text'"
    for attr in ("layer_types", "per_layer_config", "num_kv_shared_layers", "hidden_size_per_layer_input"):
        if not hasattr(text_config, attr):
            return f"text config has no {attr!r} (transformers version not recognized)"
    return None


def _placement_reason(model: torch.nn.Module) -> str | None:
    """A reason when the model's weights do not all sit on one device. accelerate's dispatch (a
    device_map over several devices, or offloading to CPU or disk) hooks modules to move weights and
    activations at each call; the fused graph would bypass those hooks (under Dynamo they fail), and
    one KV pool, merged weights and CUDA graphs need one device."""
    hooked = [name or "the model" for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    if hooked:
        where = f"hooks on {len(hooked)} modules, e.g. {hooked[0]!r}"
        return (f"its modules are dispatched by accelerate ({where}: a device_map over several devices or with "
                "offloading); gemma4opt fuses a model whose weights all sit on one device: load it with one "
                "device (device_map='cuda'), or split it over GPUs with Gemma4OptConfig(tensor_parallel=True) "
                "under torchrun")
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        return (f"its parameters sit on several devices ({', '.join(devices)}); gemma4opt fuses a model whose "
                "weights all sit on one device: move it to one (model.to('cuda'))")
    return None


def _leave_hf(model, state: OptimizationState, reason: str, edits: InstanceEdits) -> None:
    """The model stays HF's, with the reason in its report."""
    state.disabled_reason = reason
    warnings.warn(f"gemma4opt: {reason}; the model runs HF's unfused path", stacklevel=4)
    edits.set(model, "_gemma4opt", state)
    install_copying(model, edits, _optimize_again, _unpickled)


def _fallback_reason(module: torch.nn.Module, kwargs: dict) -> str | None:
    if module.training:
        return "training mode"
    for k in _FALLBACK_KWARGS:
        v = kwargs.get(k)
        if v is not None and v is not False:      # a tensor (labels) has no truth value
            return f"{k} requested"
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        return "autograd enabled (run under torch.no_grad()/inference_mode, as generate does)"
    return None


def optimize(model, config: Gemma4OptConfig | None = None):
    """Rewrite this Gemma-4 model instance to run fused gemma4opt ops; returns the same model.

    Only this instance changes (its forward and generate, and its own copies of its configs);
    HF classes, modules and registries are untouched. All-or-nothing: when it raises, the model
    is as it was. Called again on an optimized model: ``config=None`` or the same config returns
    it as is; another config re-optimizes it (with a warning saying so).
    """
    target = _check_model(model)
    if config is not None and not isinstance(config, Gemma4OptConfig):
        raise TypeError(f"gemma4opt.optimize: config must be a Gemma4OptConfig, got {type(config).__name__}")
    old = getattr(model, "_gemma4opt", None)
    if old is not None:
        if config is None or config == old.user_config:
            return model
        _check_not_unquantizing(model, target, config)      # before the revert: a refusal leaves the model as it was
        _check_not_unsharding(target, config)
        warnings.warn(f"gemma4opt.optimize: this model was optimized with {old.user_config}; re-optimizing it "
                      f"with {config} (graphs are compiled again and the KV pool is rebuilt)", stacklevel=2)
        _revert(model)
    edits = InstanceEdits()
    try:
        _install(model, target, config or Gemma4OptConfig(), edits)
    except BaseException:
        edits.revert()
        raise
    return model


def _check_not_unquantizing(model, target, config: Gemma4OptConfig) -> None:
    if config.quantization is None and fp8_linears(target):
        raise ValueError("gemma4opt.optimize: this model's linears were quantized to fp8 by an earlier "
                         "optimize(..., Gemma4OptConfig(quantization='fp8')) and its bf16 weights are gone; "
                         "keep quantization='fp8', or load the model again for bf16")
    if not config.quantize_lm_head and fp8_lm_head(model):
        raise ValueError("gemma4opt.optimize: this model's lm_head was quantized to fp8 by an earlier "
                         "optimize(..., Gemma4OptConfig(quantization='fp8', quantize_lm_head=True)); keep "
                         "quantize_lm_head=True, or load the model again for a bf16 lm_head")


def _check_not_unsharding(target, config: Gemma4OptConfig) -> None:
    if not config.tensor_parallel and sharded(target) is not None:
        raise ValueError("gemma4opt.optimize: this model was split across ranks by an earlier optimize(..., "
                         "Gemma4OptConfig(tensor_parallel=True)) and holds this rank's weights only; keep "
                         "tensor_parallel=True, or load the model again")


def _revert(model) -> None:
    state = model._gemma4opt
    state.edits.revert()
    state.context = None      # the KV pool goes with the state


def _install(model, target, user_config: Gemma4OptConfig, edits: InstanceEdits, configs=None) -> None:
    """``configs``: when optimizing again (_reoptimize), the model's config copies as they were and
    the generation-config fields the last install set (their values before), to start from."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    own_configs(model, edits, configs)   # first: everything below writes to the model's own copies
    text_config = model.config.get_text_config()
    placement = _placement_reason(model)
    if placement is not None:        # before the mode is chosen: that reads one device for the whole model
        state = OptimizationState(user_config, type(model).__name__,
                                  "causal_lm" if target is model else "text_model", text_config)
        state.user_config, state.mode_reason, state.edits = user_config, "not optimized", edits
        _leave_hf(model, state, placement, edits)
        return
    if user_config.attention == "auto":
        attention, mode_reason = choose_attention(device.type, dtype, text_config, user_config.kv_cache_dtype)
        cfg = dataclasses.replace(user_config, attention=attention).resolve(device.type, dtype, text_config)
    else:
        cfg = user_config.resolve(device.type, dtype, text_config)
        mode_reason = f"attention={cfg.attention!r} (set in Gemma4OptConfig)"
    if cfg.attention == "paged":
        check_paged_supported(device, dtype, text_config, kv_pool_dtype(cfg.kv_cache_dtype, dtype))
    _check_not_unquantizing(model, target, cfg)
    _check_not_unsharding(target, cfg)
    if cfg.tensor_parallel and sharded(target) is None and foreign_projections(target):
        raise ValueError("gemma4opt tensor_parallel splits plain nn.Linear projections only; this model has "
                         f"{', '.join(foreign_projections(target)[:2])}, ...: a quantized checkpoint's modules, "
                         "whose packed weights and scales gemma4opt cannot split (load it unquantized, or "
                         "optimize without tensor_parallel)")
    shard = sharded(target) or (plan_shard(text_config) if cfg.tensor_parallel else None)
    scope = "causal_lm" if target is model else "text_model"
    state = OptimizationState(cfg, type(model).__name__, scope, text_config)
    state.user_config, state.mode_reason, state.edits = user_config, mode_reason, edits
    state.shard = shard
    state.hf_attn = text_config._attn_implementation

    reason = _unrecognized_config(text_config)
    if reason is not None:
        _leave_hf(model, state, reason, edits)
        return

    _raise_recompile_limit()
    patterns = build_patterns(cfg.quantization, cfg.quantize_lm_head)
    paged = cfg.attention == "paged"
    # as_captured_only: Python calls in the graph, which Inductor would not lower, and a side stream,
    # which tensor_parallel's all-reduces must not run on (patterns/moe_streams.py).
    enabled = [patterns[n] for n in cfg.enabled_patterns()
               if (paged or not patterns[n].paged_only) and (cfg.quantization or not patterns[n].quantized_only)
               and not (patterns[n].as_captured_only and (cfg.inductor or shard is not None))]
    for p in enabled:
        state.stats[p.name] = PatternStats(p.name, p.summary, p.expected(text_config, scope))

    def ctx_factory(gm):
        return PassContext(root=target, text_config=text_config, scope=scope, gm=gm,
                           max_seq_len=cfg.max_seq_len if paged else None)

    state.pass_manager = PassManager(enabled, ctx_factory, state.stats)
    state.original_forward = target.forward
    # With decode graphs, prefill runs the rewritten graph as captured: its shape changes with
    # every prompt length, an Inductor compile per shape costs minutes on real models, and a
    # compute-bound prefill gains little from it (its GEMMs and fused kernels run either way).
    lower_prefill = cfg.inductor and not cfg.cuda_graphs
    state.compiled_forward = torch.compile(_own_code_entry(target.forward),
                                           backend=make_backend(state, lower_prefill), fullgraph=True)
    if paged:
        # Calls without a paged cache (a direct forward, the caller's own cache, beam search) run
        # HF's attention with HF's masks, compiled apart so the paged-only patterns skip them.
        state.hf_forward = torch.compile(_own_code_entry(target.forward),
                                         backend=make_backend(state, lower_prefill, paged=False), fullgraph=True)
    if cfg.cuda_graphs:
        def graphs(gm, example_inputs):      # gemma4opt's decode graphs of the rewritten graph
            return decode_graphs.graphed_decode(state, target, gm, example_inputs)

        state.decode_graphs = graphs        # the state's own: Dynamo never holds it (compiler/backend.py)
        # gemma4opt's own decode graphs check the model's tensors per step more cheaply than Dynamo's
        # guards over each of them (runtime/decode_graphs.py's doc): those guards are dropped there.
        def compile_decode(forward=target.forward):      # HF's forward (later, target.forward is ours)
            options = None if cfg.inductor else {"guard_filter_fn": decode_graphs.model_guards_dropped(target)}
            return torch.compile(_own_code_entry(forward), backend=make_backend(state, cfg.inductor, graphs=True),
                                 fullgraph=True, options=options)      # (torch.compile pops from options)

        state.decode_forward = decode_graphs.RecompileOnModelChange(compile_decode)
    if paged:
        install_paged(model, target, state, device, dtype, edits)   # allocates the pool: may fail
        if state.decode_forward is not None:
            ctx = state.context
            state.direct = DirectDecode(state, cfg.direct_decode, ctx.graph_signature, ctx.step_objects,
                                        entering=functools.partial(paged_attention_on, state))

    gen = getattr(model, "generation_config", None)
    if gen is not None:
        state.gen_written["disable_compile"] = (gen.disable_compile, True)
        gen.disable_compile = True      # our forward is already compiled; HF must not wrap it again
        if cfg.cache == "static" and not paged and gen.cache_implementation is None:
            state.gen_written["cache_implementation"] = (None, "static")
            gen.cache_implementation = "static"
    if gen is not None:
        edits.set(model, "save_pretrained", _make_save(model, state))
    if cfg.cuda_graphs:
        install_static_cache_reuse(model, state, edits)
    if cfg.deferred_stop:
        state.stop_check = install_deferred_stop_check(model, edits)
    _install_generate_checks(model, state, edits)
    # Last, once nothing else can fail: fp8 weights and weight merges cannot be undone without a
    # second copy. The merge (merged_projections) merges the fp8 weights and scales as it would bf16.
    # The split comes first: the fp8 scales are those of this rank's rows.
    if shard is not None:
        if sharded(target) is None:
            shard_model(target, text_config, shard)
        edits.set(model, "save_pretrained", _refuse_save_sharded)
    # A FineGrainedFP8 checkpoint's projections: gemma4opt's block-scaled GEMM as their forward.
    state.checkpoint_fp8 = adopt_fp8_modules(model, edits)
    if cfg.quantization == "fp8":
        state.quantized = quantize_linears(target, drop_attrs=(MERGED_ATTR,))
        if cfg.quantize_lm_head:
            state.quantized.update(quantize_lm_head(model))
        edits.set(model, "save_pretrained", _refuse_save)
    for p in enabled:
        p.prepare(target, text_config)
    edits.set(target, "forward", _make_forward(model, target, state))
    edits.set(model, "_apply", _make_apply(model))
    edits.set(model, "_gemma4opt", state)
    state.hooks = HookWatch(target)       # last: the module tree as it runs (fp8 linears swapped in)
    state.weights = MergedWeightWatch(target)
    state.modules = ModuleTreeWatch(target)
    state.head = TiedHeadWatch(model)
    install_copying(model, edits, _optimize_again, _unpickled)     # last: after every other edit


def _make_save(model, state):
    """HF's save_pretrained, with the generation config as the caller has it: the fields optimize()
    set there for this instance's generate (disable_compile) are not written to the checkpoint, where
    they would turn HF's compile off for whoever loads it."""
    hf_save = model.save_pretrained

    @functools.wraps(hf_save)
    def save_pretrained(*args, **kwargs):
        gen, written = model.generation_config, {}
        for name, (before, ours) in state.gen_written.items():
            if getattr(gen, name, None) == ours:     # else the caller set it since: theirs, saved
                written[name] = ours
                setattr(gen, name, before)
        try:
            return hf_save(*args, **kwargs)
        finally:
            for name, ours in written.items():
                setattr(gen, name, ours)

    return save_pretrained


def _refuse_save_sharded(*args, **kwargs):
    raise NotImplementedError(
        "gemma4opt: a model optimized with tensor_parallel=True holds this rank's share of the weights only; "
        "save the model before optimize()")


def _refuse_save(*args, **kwargs):
    raise NotImplementedError(
        "gemma4opt: a model optimized with quantization='fp8' holds gemma4opt's fp8 weights (e4m3, one scale "
        "per output channel), which no transformers checkpoint format describes; save the model before "
        "optimize(), or optimize it without quantization")


def _make_apply(model):
    """``.to()``, ``.cuda()``, ``.half()``... on the optimized model: HF's move, then the same
    optimize() again for the new device and dtype (merged weights merged again, as views; a new
    KV pool; graphs compiled anew). A call that changes nothing keeps everything."""
    def _apply(fn, *args, **kwargs):
        before = _placement(model)
        out = type(model)._apply(model, fn, *args, **kwargs)
        if _placement(model) != before:     # else nothing moved: graphs, pool and merged weights stand
            _reoptimize(model, "after the move", "for this device and dtype", stacklevel=4)
        return out

    return _apply


def _optimize_again(model, config, gen_written: dict) -> None:
    """A deep copy or an unpickled model (copying.py): optimize() with ``config`` from its own config
    copies as they are (the fields the original's optimize() set on the generation config,
    ``gen_written``, put back where still its own)."""
    configs = (model.config, getattr(model, "generation_config", None), gen_written)
    _install_or_leave_hf(model, config, configs, "as a copy", "again", stacklevel=5)


def _unpickled(model, pickled: dict) -> None:
    """A pickled optimized model's state setter (copying.py): HF's state, then optimize() with its config."""
    config, gen_written = pickled.pop(PICKLED)
    model.__setstate__(pickled)
    _optimize_again(model, config, gen_written)


def _reoptimize(model, when: str, hint: str, stacklevel: int) -> None:
    """The same optimize() again, for the model as it is now: its configs as the caller left
    them (edits made to the model's copies since optimize() stay; the fields optimize() set on
    the generation config are set anew), its modules, device and dtype."""
    state = model._gemma4opt
    configs = (model.config, getattr(model, "generation_config", None), dict(state.gen_written))
    _revert(model)
    _install_or_leave_hf(model, state.user_config, configs, when, hint, stacklevel + 1)


def _install_or_leave_hf(model, config, configs, when: str, hint: str, stacklevel: int) -> None:
    """_install from ``configs``; a failure leaves HF's model, with its config copies, and says so."""
    edits = InstanceEdits()
    try:
        _install(model, _check_model(model), config, edits, configs)
    except BaseException as e:
        edits.revert()
        own_configs(model, InstanceEdits(), configs)     # HF's from now on: the caller's edits stay
        warnings.warn(f"gemma4opt: {when} the model could not be optimized again ({e}); it runs HF's own forward "
                      f"now: call gemma4opt.optimize(model, config) {hint}", stacklevel=stacklevel)


def _watch_edits(model, state) -> bool:
    """Before a generate call, or a forward outside one: submodules replaced since optimize()
    re-optimize the model (True: call its new entry point); merged weights given new storage
    are copied back (runtime/weight_watch.py)."""
    replaced = state.modules.replaced()
    if replaced:
        warnings.warn(f"gemma4opt: {', '.join(replaced[:3])}{', ...' if len(replaced) > 3 else ''} replaced after "
                      "optimize(): the model is optimized again for its new modules (graphs compiled anew)",
                      stacklevel=4)
        _reoptimize(model, "with its new modules", "again", stacklevel=5)
        return True
    state.weights.check()
    state.head.check()
    return False


def _placement(model):
    p = next(model.parameters())
    return p.device, p.dtype


def _install_generate_checks(model, state, edits: InstanceEdits) -> None:
    """Checks that apply to every generate call of the optimized model, before HF starts."""
    original = model.generate
    warned = []

    @functools.wraps(original)
    def generate(*args, **kwargs):
        gen = kwargs.get("generation_config")
        asked = kwargs.get("compile_config") is not None or getattr(gen, "compile_config", None) is not None
        if asked and not warned:
            warned.append(True)
            warnings.warn("gemma4opt: compile_config is ignored: the optimized model's forward is already compiled "
                          "by gemma4opt, so HF's generate-time torch.compile is off for it (disable_compile)",
                          stacklevel=2)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] == 0:
            _no_tokens(ids)
        with state.calls:
            if _watch_edits(model, state):
                return model.generate(*args, **kwargs)    # optimized again: its new generate
            state.generating += 1           # its forward calls skip the checks (runtime/weight_watch.py)
            try:
                return original(*args, **kwargs)
            finally:
                state.generating -= 1

    edits.set(model, "generate", generate)


def _own_code_entry(fn):
    """A wrapper with a code object of its own, and globals of its own.

    Dynamo keeps compiled graphs per code object; HF's forward decorators share one code object
    across every model, so two optimized models would evict each other's graphs (and
    ``fullgraph=True`` turns hitting the recompile limit into an error). And it stores each graph
    it compiles (``__compiled_fn_*``) in the globals of the frame it compiled: these, not a module's.
    """
    def entry(*args, **kwargs):
        return fn(*args, **kwargs)

    code = entry.__code__.replace(co_name=f"gemma4opt_forward_{next(_entry_ids)}")
    return types.FunctionType(code, {"__builtins__": builtins}, code.co_name, entry.__defaults__,
                              entry.__closure__)


def _make_forward(model, target, state: OptimizationState):
    original = state.original_forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        with state.calls, active(state.op_state):    # the ops read this model's picks and experts modules
            _raise_recompile_limit()
            return _dispatch(*args, **kwargs)

    def _dispatch(*args, **kwargs):
        ids = step_input(args, kwargs)
        if ids is not None and ids.dim() >= 2 and ids.shape[1] == 0:
            _no_tokens(ids)
        if not state.generating and _watch_edits(model, state):
            return target.forward(*args, **kwargs)    # optimized again: its new forward
        reason = _fallback_reason(target, kwargs) or state.hooks.reason()
        paged = state.context is not None and is_paged(cache_of(kwargs))
        if paged and reason is not None:
            raise NotImplementedError(
                f"gemma4opt: {reason} on a call with a PagedCache: paged attention does not produce what HF's "
                "fallback needs; pass a transformers cache (e.g. DynamicCache()) or none for such calls")
        if reason is not None:
            return _hf_fallback(state, original, reason, args, kwargs)
        if paged:                   # (Gemma4ForConditionalGeneration's outer forward began the step)
            return paged_forward(state, args, kwargs, begin=state.scope == "causal_lm")
        state.compiled_calls += 1
        if state.context is not None:
            # Paged mode, no paged cache: HF's attention with HF's masks, exactly as unoptimized.
            return state.hf_forward(*args, **kwargs)
        if state.decode_forward is not None and one_token_step(args, kwargs) and _static_cache_ready(state, kwargs):
            if state.config.inductor:
                state.graphed_calls += 1      # cudagraph trees; runtime.decode_graphs counts its own replays
            torch.compiler.cudagraph_mark_step_begin()   # last step's outputs were consumed by generate
            return state.decode_forward(*args, **kwargs)
        return state.compiled_forward(*args, **kwargs)

    return forward


def _no_tokens(ids):
    raise ValueError(f"gemma4opt: the input has no tokens (shape {tuple(ids.shape)}); give at least one token "
                     "per sequence (a prompt, or a BOS token)")


def _hf_fallback(state, original, reason: str, args, kwargs):
    """HF's own forward for a feature the graph does not cover (warned once per reason, counted)."""
    if not state.fallbacks[reason]:
        warnings.warn(f"gemma4opt: {reason}: this call runs HF's unfused forward", stacklevel=4)
    state.fallbacks[reason] += 1
    return original(*args, **kwargs)


def _static_cache_ready(state, kwargs) -> bool:
    """True for a call on an HF static cache that prefill has already allocated.

    The cache allocates its tensors lazily inside the first (prefill) forward; when that runs
    under Dynamo, HF skips ``mark_static_address``. CUDA graphs need the cache at fixed
    addresses, so the first decode call marks them here, once per cache object.
    """
    cache = cache_of(kwargs)
    if getattr(cache, "_gemma4opt_static", False):
        return True                       # checked once per cache object, not every decode step
    if cache is None or not getattr(cache, "is_compileable", False):
        return False
    layers = getattr(cache, "layers", ())
    if not layers or not all(getattr(layer, "is_initialized", False) for layer in layers):
        return False
    for layer in layers:
        for attr in ("keys", "values", "cumulative_length"):
            t = getattr(layer, attr, None)
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t)    # for Inductor's cudagraph trees
                state.fixed.add(t)                       # for gemma4opt's decode graphs
    cache._gemma4opt_static = True
    return True


def get_state(model) -> OptimizationState:
    state = getattr(model, "_gemma4opt", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not optimized: call gemma4opt.optimize(model) first")
    return state
