"""report(model): what each pattern matched against what it should have, from counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from gemma4opt.api import get_state
from gemma4opt.ops import rope_cos_sin
from gemma4opt.ops.fp8_checkpoint import HF_FP8_EXPERTS, HF_FP8_LINEAR, adopted
from gemma4opt.ops.moe_experts_fp8_block import MAX_PAIRS
from gemma4opt.ops.fp8_weights import foreign_projections, fp8_experts, fp8_linears, fp8_lm_head
from gemma4opt.ops.state import OpState
from gemma4opt.patterns.paged_qkv import ATTENTION_OPS


@dataclass
class PatternRow:
    pattern: str
    summary: str
    matched: int | None          # per captured graph (all graphs agree) or None before the first call
    matched_per_graph: list[int]
    expected: int                # the config's formula: every site a fully fused graph has
    unfused: list[str]
    not_applicable_per_graph: list[int] = field(default_factory=list)   # sites the fusion leaves by design
    not_applicable: list[str] = field(default_factory=list)             # and why

    def expected_per_graph(self) -> list[int]:
        """What each captured graph should match: the formula less its sites left by design."""
        na = self.not_applicable_per_graph or [0] * len(self.matched_per_graph)
        return [self.expected - n for n in na]

    @property
    def complete(self) -> bool:
        return bool(self.matched_per_graph) and self.matched_per_graph == self.expected_per_graph()


@dataclass
class Report:
    model_class: str
    scope: str
    disabled_reason: str | None
    graphs_compiled: int
    compiled_calls: int
    graphed_calls: int
    fallbacks: dict[str, int]
    rows: list[PatternRow] = field(default_factory=list)
    attention: str = "hf"
    graph_captures: int = 0     # decode CUDA graphs captured by gemma4opt's runner, and the eager
    graph_warmups: int = 0      # steps that preceded them (a new graph or a new cache)
    stop_check: str = "per step (HF)"
    graph_key_changes: dict[str, int] = field(default_factory=dict)
    decode_gemms: str = ""      # gemma4opt.linear's picks so far (this model's)
    decode_experts: str = ""    # gemma4opt.moe_experts' picks so far (this model's)
    mode: str = ""              # which attention mode runs, and why (attention="auto" says)
    cuda_graphs: bool = True    # decode as CUDA graphs (off on CPU: no graph counts to show)
    kv_cache: str = ""          # the paged pool's dtype and bytes per token / per sequence ("" in "hf" mode)
    weights: str = ""           # quantization="fp8": what is fp8, its bytes, and what is not
    tensor_parallel: str = ""   # tensor_parallel=True: this rank's share
    direct_steps: int = 0       # decode steps that skipped Dynamo's entry (runtime/direct_decode.py)
    direct: str = ""            # those, the steps that entered Dynamo, and why a plan missed or was not learned
    weights_restored: list[str] = field(default_factory=list)   # merged weights given new storage, copied back
    kernel_checks: list[str] = field(default_factory=list)      # fused ops whose kernel failed its bit check

    def row(self, pattern: str) -> PatternRow:
        return next(r for r in self.rows if r.pattern == pattern)

    def __str__(self) -> str:
        lines = [f"gemma4opt report: {self.model_class} (compiled scope: {self.scope})"]
        if self.disabled_reason:
            lines.append(f"  NOT OPTIMIZED: {self.disabled_reason} -> every call runs HF's unfused path")
        graphs = (f" (as CUDA graph replays: {self.graphed_calls}; captures {self.graph_captures}, "
                  f"warm-up steps {self.graph_warmups})" if self.cuda_graphs else " (no CUDA graphs)")
        lines.append(f"  graphs compiled: {self.graphs_compiled}   compiled calls: {self.compiled_calls}{graphs}")
        if self.direct:
            lines.append(f"  {self.direct}")
        if self.graph_key_changes:
            lines.append("  decode steps that missed a captured graph, by input: " + ", ".join(
                f"{k}: {v}" for k, v in sorted(self.graph_key_changes.items(), key=lambda kv: -kv[1])))
        if self.mode:
            lines.append(f"  mode: {self.mode}")
        lines.append(f"  attention: {self.attention}")
        if self.kv_cache:
            lines.append(f"  KV cache: {self.kv_cache}")
        lines.append(f"  generate stop check: {self.stop_check}")
        if self.weights:
            lines.append(f"  weights: {self.weights}")
        if self.tensor_parallel:
            lines.append(f"  tensor parallel: {self.tensor_parallel}")
        if self.decode_gemms:
            lines.append(f"  decode GEMMs (gemma4opt.linear): {self.decode_gemms}")
        if self.decode_experts:
            lines.append(f"  decode MoE experts (gemma4opt.moe_experts): {self.decode_experts}")
        if self.weights_restored:
            lines.append(f"  weights given new storage after optimize(), copied into the merged weights: "
                         f"{len(self.weights_restored)} ({', '.join(self.weights_restored[:3])}"
                         f"{', ...' if len(self.weights_restored) > 3 else ''})")
        for line in self.kernel_checks:
            lines.append(f"  {line}")
        if self.fallbacks:
            lines.append("  fallbacks (calls): " + ", ".join(f"{k}: {v}" for k, v in self.fallbacks.items()))
        if self.rows:
            w = max(len(r.pattern) for r in self.rows)
            lines.append(f"  {'pattern':<{w}}  {'matched':>9}  {'expected':>8}  status")
            for r in self.rows:
                got = _per_graph(r.matched_per_graph, "-")
                status = "ok" if r.complete else ("not run yet" if not r.matched_per_graph else "INCOMPLETE")
                lines.append(f"  {r.pattern:<{w}}  {got:>9}  {_per_graph(r.expected_per_graph(), r.expected):>8}  "
                             f"{status}")
                for why in r.unfused:
                    lines.append(f"  {'':<{w}}    unfused: {why}")
                if any(r.not_applicable_per_graph):
                    lines.append(f"  {'':<{w}}    not applicable at {_per_graph(r.not_applicable_per_graph, 0)} of its "
                                 f"{r.expected} sites: " + "; ".join(r.not_applicable))
        return "\n".join(lines)


def _per_graph(counts: list[int], default: int | str) -> str:
    """One count where every captured graph agrees, else each graph's, in graph order (as "matched")."""
    if not counts:
        return str(default)
    return str(counts[0]) if all(c == counts[0] for c in counts) else "/".join(map(str, counts))


def build_report(model) -> Report:
    state = get_state(model)
    rows = []
    for st in state.stats.values():
        per = list(st.matched_per_graph)
        matched = per[0] if per and all(m == per[0] for m in per) else None
        rows.append(PatternRow(st.name, st.summary, matched, per, st.expected, list(st.unfused),
                               list(st.not_applicable_per_graph), list(st.not_applicable)))
    attention = "hf (HF attention over HF's cache)"
    kv_cache = ""
    ctx = state.context
    if ctx is not None:
        ctx.free_collected()          # caches dropped since the last step: not held any more
        pools = ", ".join(f"{k.split('_')[0]}: {s.pool.num_pages} pages, {s.pages_held()} held"
                          for k, s in ctx.seqs.items())
        counts = state.pass_manager.op_counts
        calls = sum(n for op, n in counts[-1].items() if op.split(".")[-1] in ATTENTION_OPS) if counts else 0
        held, seqs = ctx.last_kv_held
        last = (f"; the last generate held {format_bytes(held)} at its end "
                f"({format_bytes(held / max(seqs, 1))} per sequence)") if seqs else ""
        attention = (f"paged (page size {ctx.page_size}; {pools}; {format_bytes(ctx.kv_bytes_held())} of KV "
                     f"held{last}; last graph: {calls}/{state.text_config.num_hidden_layers} layers call a paged "
                     f"attention op); backends: {ctx.describe_backends()}")
        kv_cache = _kv_cache_line(ctx)
    device = _device_type(model)
    moe, dense = state.stats.get("moe_experts"), state.stats.get("decode_linear")
    return Report(state.model_class, state.scope, state.disabled_reason, state.graphs_compiled,
                  state.compiled_calls, state.graphed_calls, dict(state.fallbacks), rows, attention,
                  state.graph_captures, state.graph_warmups, state.stop_check, dict(state.graph_key_changes),
                  _decode_gemms(device, state.op_state) if dense and dense.expected else "",
                  _decode_experts(device, state.op_state) if moe and moe.expected else "",
                  state.mode_reason, bool(state.config.cuda_graphs), kv_cache=kv_cache,
                  weights=_weights(model, state, device), tensor_parallel=_tensor_parallel(state),
                  direct_steps=state.direct.steps if state.direct is not None else 0,
                  direct=state.direct.describe() if state.direct is not None else "",
                  weights_restored=list(state.weights.restored) if state.weights is not None else [],
                  kernel_checks=rope_cos_sin.verdicts(model.buffers()))


def _tensor_parallel(state) -> str:
    s = state.shard
    if s is None:
        return ""
    from gemma4opt.tensor_parallel import local_heads

    cfg = state.text_config
    return (f"{s.describe()}: {local_heads(cfg, s)} of {cfg.num_attention_heads} attention heads, 1/{s.world} of "
            "the MLP and experts' width; an all-reduce after each attention, MLP and experts block; embeddings, "
            "norms and the lm_head replicated")


def _kv_cache_line(ctx) -> str:
    """The pool's dtype (with its scales when fp8), and what a token and a full-length sequence take."""
    name = str(ctx.kv_dtype).replace("torch.", "")
    if ctx.kv_scale:
        scales = sorted({s for pair in ctx.kv_scale_host.values() for s in pair})
        name += (f" (one fp32 scale per layer for k and one for v: "
                 f"{'all ' + format(scales[0], 'g') if len(scales) == 1 else 'set per layer'})")
    return (f"{name}, {format_bytes(ctx.kv_bytes_per_token())} per token over the {len(ctx.kv)} layers that own KV, "
            f"{format_bytes(ctx.kv_bytes_per_sequence(ctx.max_seq_len))} per sequence of max_seq_len="
            f"{ctx.max_seq_len} tokens (sliding layers keep their window's pages)")


def _weights(model, state, device: str) -> str:
    foreign = foreign_projections(model, adopted=False)
    # A quantized checkpoint's modules (transformers' FP8Linear, bitsandbytes, ...): said first.
    text = (f"{len(foreign)} projections are a quantized checkpoint's own modules ({foreign[0]}, ...): they run "
            "their own forward, unmerged (the fusions around them apply; merged_projections lists them)"
            if foreign else "")
    fp8 = _fp8_weights(model, state, device)
    return "; ".join(t for t in (_checkpoint_fp8(model, state), text, fp8) if t)


def _checkpoint_fp8(model, state) -> str:
    """A FineGrainedFP8 checkpoint's FP8Linear and FP8Experts modules: how many gemma4opt's kernels
    run, which they do not and why."""
    counts = state.checkpoint_fp8
    parts = []
    if counts.get(HF_FP8_LINEAR):
        blocks = sorted({tuple(int(b) for b in m.block_size) for m in model.modules() if adopted(m)})
        tiles = ", ".join(f"{n} x {k}" for n, k in blocks)
        parts.append(f"{counts[HF_FP8_LINEAR]} linears are transformers' FP8Linear (a FineGrainedFP8 checkpoint: "
                     f"e4m3 weights, one scale per {tiles} tile): run by gemma4opt's block-scaled fp8 GEMM "
                     f"(fp8_block_linear), each input quantized per token and {'/'.join(str(k) for _, k in blocks)}"
                     "-long group inside it; q/k/v and gate/up merged where their row blocks stack")
    if counts.get(HF_FP8_EXPERTS):
        parts.append(f"{counts[HF_FP8_EXPERTS]} MoE experts blocks are transformers' FP8Experts: run by "
                     "gemma4opt's moe_experts_fp8_block (decode: the block-scaled GEMM over (token, expert) pairs, "
                     f"up to {MAX_PAIRS} pairs; prefill: the GEMM per expert with tokens)")
    parts += [f"{v} {k.split(' kept, ')[0]} run their own forward: {k.split(' kept, ', 1)[1]}"
              for k, v in counts.items() if " kept, " in k]
    return "; ".join(parts)


def _fp8_weights(model, state, device: str) -> str:
    if state.config.quantization != "fp8":
        return ""
    mods = fp8_linears(model)
    head = fp8_lm_head(model)
    experts = fp8_experts(model)
    n = sum(m.weight.numel() for m in mods) + sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    scales = sum(m.weight_scale.numel() for m in mods) + sum(
        m.gate_up_proj_scale.numel() + m.down_proj_scale.numel() for m in experts)
    dtype = next(model.parameters()).dtype
    skipped = "".join(f"; not quantized, {k.split(': ', 1)[1]}: {v}" for k, v in state.quantized.items()
                      if k.startswith("skipped"))
    gemm = _fp8_gemms(device, state.op_state)
    moe = (f" and {len(experts)} MoE experts blocks (weight-only: tokens stay in {_dtype_name(dtype)}; "
           "gemma4opt's decode kernels up to 1024 (token, expert) pairs, batched matmuls over the experts "
           "that have tokens above)") if experts else ""
    kept = ("the embedding table (the lm_head's fp8 copy beside it), " if head
            else "the lm_head (tied to the embedding table), ")
    return (f"fp8 e4m3, one fp32 scale per output channel: {len(mods)} linears (attention q/k/v/o, dense MLP "
            f"gate/up/down{', lm_head' if head else ''}){moe}, {format_bytes(n + 4 * scales)} "
            f"({format_bytes(n * dtype.itemsize)} in {_dtype_name(dtype)}){skipped}; GEMMs: {gemm}; inputs quantized "
            f"per token in the kernel that produces them (fp8_quant) or, at decode, in the fp8 GEMM that reads "
            f"them (quant_linear: o_proj's; the dense MLP's down after its gate/up GEMV); kept in "
            f"{_dtype_name(dtype)}: {kept}the MoE router, the per-layer-input (PLE) projections")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1: ``0 B``, ``512 B``,
    ``1.5 KiB``, ``12.3 MiB``, ``2.0 GiB`` (whole bytes below 1 KiB, one decimal above)."""
    if round(n) < 1024:
        return f"{round(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if round(n, 1) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _device_type(model) -> str:
    """The device type the model's parameters are on ("cuda", "cpu", "meta")."""
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _picks_line(op, op_state: OpState, kernel: str, other: str, unit: str, untimed: str) -> str:
    """One report line for an op that picks per shape (ops/pick.py), from a model's ``op_state``:
    how many shapes run the Triton ``kernel`` and how many ``other``, by the shape's first entry (``unit``)."""
    got = op.picks(op_state)
    if not got:
        return untimed
    text = (f"{kernel} on {sum(got.values())} of {len(got)} shapes timed ({unit} {sorted({k[0] for k in got})}), "
            f"{other} on the rest")
    failed = op.failures(op_state)
    if failed:
        text += f"; it failed on {len(failed)} shapes ({other} there): {next(iter(failed.values()))}"
    return text


def _reference_line(device: str, what: str, picks: str) -> str:
    """The picks line off CUDA: the ops run their plain-torch reference there, nothing is timed."""
    return f"reference ops ({device.upper()}): {what}; per-shape {picks} picks apply on CUDA only"


def _decode_gemms(device: str, op_state: OpState) -> str:
    """The report line for ``gemma4opt.linear`` (and ``linear_softcap``) on a model on ``device``
    whose picks are ``op_state``'s."""
    from gemma4opt.ops import linear

    from gemma4opt.ops import linear_softcap

    if device != "cuda":        # the ops' CPU/meta kernels: F.linear (then tanh * cap), never timed
        return _reference_line(device, "F.linear (lm_head: F.linear then the softcap in torch)", "GEMM")
    text = _picks_line(linear, op_state, "the skinny Triton GEMM", "cuBLAS", "rows",
                       "no shape of <= 32 rows timed yet (cuBLAS until one is)")
    from gemma4opt.ops import gate_up_gelu

    if gate_up_gelu.picks(op_state):
        text += "; MLP gate/up + gelu·mul at one row: " + _picks_line(
            gate_up_gelu, op_state, "the fused Triton GEMV", "the GEMM then the gelu·mul kernel", "rows", "")
    from gemma4opt.ops import gelu_linear

    if gelu_linear.picks(op_state):
        text += "; gelu·mul into the next GEMM (MLP down, PLE projection): " + _picks_line(
            gelu_linear, op_state, "the skinny GEMM making gelu·mul as it reads", "the gelu·mul kernel then the GEMM",
            "rows", "")
    from gemma4opt.ops import norm_linear

    if norm_linear.picks(op_state):
        text += "; residual tail into the next GEMM (q/k/v, per-layer-input gate): " + _picks_line(
            norm_linear, op_state, "the skinny GEMM making the tail as it reads", "the tail kernel then the GEMM",
            "rows", "")
    if linear_softcap.picks(op_state):
        text += "; lm_head + softcap: " + _picks_line(linear_softcap, op_state,
                                                       "the skinny GEMM with the softcap epilogue",
                                                       "cuBLAS + the softcap kernel", "rows", "")
    return text


def _fp8_gemms(device: str, op_state: OpState) -> str:
    from gemma4opt.ops import fp8_linear

    if device != "cuda":
        return _reference_line(device, "dequantize, multiply in fp32", "fp8 GEMM")
    from gemma4opt.ops import norm_fp8_linear

    text = "torch._scaled_mm above 32 rows; up to 32, " + _picks_line(
        fp8_linear, op_state, "the skinny fp8 Triton GEMM", "torch._scaled_mm", "rows",
        "no shape of <= 32 rows timed yet")
    if norm_fp8_linear.picks(op_state):
        text += "; residual tail + quantization into the next fp8 q/k/v: " + _picks_line(
            norm_fp8_linear, op_state,
            "the fp8 GEMM quantizing the tail as it reads", "add_rms_norm_quant then the GEMM", "rows", "")
    from gemma4opt.ops import quant_fp8_linear

    if quant_fp8_linear.picks(op_state):
        text += "; input quantization into the fp8 GEMM (o_proj): " + _picks_line(
            quant_fp8_linear, op_state, "the fp8 GEMM quantizing as it reads", "quantize_rows then the GEMM", "rows", "")
    from gemma4opt.ops import gelu_linear

    if gelu_linear.fp8_picks(op_state):
        text += "; fp8 dense MLP at one row: " + _picks_line(
            _Picks(gelu_linear.fp8_picks, gelu_linear.fp8_failures), op_state,
            "gate/up GEMV + gelu·mul, down GEMM quantizing as it reads (2 launches)",
            "gate/up GEMM, gelu·mul + quantize, down GEMM (4 launches)", "rows", "")
    return text


class _Picks:
    """An op's picks and failures under the names _picks_line reads (an op module with two picks)."""

    def __init__(self, picks, failures):
        self.picks, self.failures = picks, failures


def _decode_experts(device: str, op_state: OpState) -> str:
    """The report line for ``gemma4opt.moe_experts`` on a model on ``device`` whose picks are ``op_state``'s."""
    from gemma4opt.ops import moe_experts

    if device != "cuda":        # the op's non-CUDA kernel calls the model's own experts module
        return _reference_line(device, "HF's experts path", "decode-kernel")
    return _picks_line(moe_experts, op_state, "gemma4opt's decode kernels", "HF's experts path", "tokens",
                       "no decode shape timed yet (HF's experts path until one is)")


def report(model, print_table: bool = True) -> Report:
    """Per pattern: matches per captured graph, expected matches, and what stayed unfused and why."""
    rep = build_report(model)
    if print_table:
        print(rep)
    return rep
