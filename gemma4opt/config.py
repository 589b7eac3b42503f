"""Gemma4OptConfig: the one place where a user tunes what optimize() does."""
from __future__ import annotations

import dataclasses

from gemma4opt.paged.pool import CPU_KV_POOL_BYTES, kv_pool_dtype  # noqa: F401  (CPU_KV_POOL_BYTES: documented below)
from gemma4opt.patterns import DEFAULT_PATTERNS, PATTERN_NAMES

_CACHES = ("auto", "dynamic", "static")
_ATTENTION = ("auto", "hf", "paged")
_DECODE_KERNELS = ("triton", "flashinfer", "auto")
_QUANTIZATION = (None, "fp8")
_KV_CACHE_DTYPES = ("auto", "fp8")

# Defaults of the paged mode when the sizes are left unset (documented in the README).
DEFAULT_MAX_BATCH = 256          # page-table rows: sequences one generate call may hold
DEFAULT_MAX_GRAPH_BATCH = 64     # the largest decode-graph bucket; larger batches decode uncaptured
DEFAULT_KV_POOL_FRACTION = 0.5   # of the GPU memory free after the weights, for the KV pool


@dataclasses.dataclass(frozen=True)
class Gemma4OptConfig:
    """What optimize() does to a model. Every field can be left at its default.

    attention: "auto" (default) picks the fastest mode that runs this model here: "paged" on CUDA
        when FlashInfer imports and the model's dtype (float16/bfloat16) and head dims (64, 128,
        256, 512) are supported, else "hf"; on CPU "hf" (on CPU nothing is faster than eager, and
        "hf" keeps HF's numerics bit for bit). ``report()`` says which mode was chosen and why.
        "hf" keeps HF's attention over HF's cache. "paged" gives generate a paged KV cache
        (gemma4opt.paged) whose attention reads page tables built on the host; sliding layers
        free the pages their window left behind. CPU: reference attention. CUDA: FlashInfer
        (the ``[gpu]`` extra) and gemma4opt's Triton decode kernel; what they cannot run is
        refused when optimize() is called.
    patterns: names of the fusions to apply, in the order of ``gemma4opt.patterns.PATTERN_NAMES``;
        ``None`` means all of them but the opt-in ones (``gemma4opt.patterns.OPT_IN``, which holds none;
        ``patterns=PATTERN_NAMES`` names every one). An empty tuple captures the graph but rewrites nothing.
    inductor: lower the rewritten graph with Inductor. ``None`` = off: the graph runs as captured,
        calling the fused ops (Triton on CUDA, references on CPU, so CPU results equal HF's bit for
        bit), and CUDA decode steps replay it as gemma4opt's own CUDA graphs (runtime.decode_graphs):
        seconds to compile. ``True``: Inductor lowers the rest (with cuda_graphs, decode only, as
        cudagraph trees); measured on an H200, a 12-layer 31b took over 6 minutes to compile.
    cuda_graphs: replay decode steps as CUDA graphs: over HF's static cache (gemma4opt's runner,
        or Inductor's cudagraph trees with ``inductor=True``), or over the paged cache per batch
        bucket (gemma4opt's runner; see decode_buckets). ``None`` = on when on CUDA with a static
        or paged cache.
    cache: KV cache ``generate`` uses in the "hf" mode when the caller passes none. "auto" =
        "static" on CUDA (fixed shapes: one decode graph, no recompiles), "dynamic" on CPU.
    page_size: tokens per KV page of the paged cache.
    max_batch_size: sequences one paged generate call may hold (page-table rows). ``None`` =
        DEFAULT_MAX_BATCH (256).
    max_seq_len: tokens one sequence may hold (prompt + new tokens). ``None`` = the model's
        context length (``max_position_embeddings``); page tables are sized for it, pages are
        taken on demand. A generate that can never fit is refused before its first token.
    kv_pool_pages: KV pages per attention kind. ``None``: sized from memory (kv_pool_fraction).
    kv_pool_fraction: with kv_pool_pages unset, the KV pool (every layer, both kinds) takes this
        fraction of the GPU memory free when optimize() runs (after the weights), and never more
        than max_batch_size full-length sequences need. ``None`` = DEFAULT_KV_POOL_FRACTION (0.5)
        when max_batch_size and max_seq_len are unset too; when you set them, ``None`` means
        exactly max_batch_size full-length sequences, refused at optimize() if they do not fit in
        90 % of the free memory. On CPU the pool is capped at CPU_KV_POOL_BYTES (1 GiB). A
        generate that needs more pages than the pool holds raises PoolExhausted before anything
        is written.
    decode_buckets: with the paged cache and cuda_graphs, the batch sizes decode graphs are
        captured for; a batch of B replays the smallest bucket >= B, padded with rows of a dummy
        sequence whose page is reserved when the pool is created; a batch larger than every bucket
        decodes uncaptured (counted in the report). ``None`` = 1, 2, 4, 8, then steps of 8 up to
        min(max_batch_size, DEFAULT_MAX_GRAPH_BATCH = 64).
    deferred_stop: let HF generate read its stop flag one step late (transformers'
        DeferredStopCheck, which HF enables on "mps" only), so the host queues the next decode step
        while the GPU runs this one; the one extra step it may run is undone by HF. ``None`` = on
        when on CUDA; off on CPU (no device to overlap with). See runtime/stop_check.py.
    fast_replan: with the paged cache on CUDA, decode graphs' per-step FlashInfer plans skip
        FlashInfer's Python ``plan()`` and call its C++ planner directly, after checking once per
        wrapper that both leave the same data for the GPU (paged/backends/flashinfer_replan.py; off for
        that wrapper, and counted in the report, if not).
    direct_decode: with the paged cache and cuda_graphs, a generate call's decode steps, once one
        has replayed a captured graph, call that graph without passing through Dynamo's entry (its
        guards over every module and weight, and its gathering of the graph's inputs: most of the
        host's time per step on a deep model). Each step still checks what can differ between
        steps: the call's arguments, torch's global state, the step metadata's addresses and shapes;
        anything else goes through Dynamo. The model and its config must not be changed
        while a generate call runs (from a logits processor, stopping criterion or streamer):
        such a change is seen from the next generate call on. ``False``: every step enters Dynamo.
        See runtime/direct_decode.py.
    decode_kernel: with the paged cache on CUDA, the attention kernel of decode steps. "triton":
        gemma4opt's split-KV kernel (kernels/paged_decode.py), which reads a device copy of the page
        table and needs no per-step host plan; a geometry it does not support uses FlashInfer.
        "flashinfer": FlashInfer's decode, planned on the host before each step. "auto": Triton for
        kinds with head_dim <= 256 (sliding layers), FlashInfer for wider heads (the full layers'
        512). Prefill always runs FlashInfer.
    quantization: ``None`` (default) keeps the model's weights. "fp8" (vLLM's name) quantizes, once
        at optimize(), the linears of every attention block and dense MLP to e4m3 with one fp32
        scale per output channel, in place: the bf16 weights are dropped, not kept beside the fp8
        ones (so it cannot be undone: load the model again for bf16). Activations are quantized per
        token, inside the kernel that produces them (rms_norm, the residual tail, gelu_tanh_mul).
        Not quantized: the lm_head (unless ``quantize_lm_head``), the MoE router, and the
        per-layer-input (PLE) projections. ``report()`` lists it.
    quantize_lm_head: ``False`` (default). ``True`` (with quantization="fp8"): the lm_head in e4m3
        too, one scale per vocabulary row, the final-logit softcap as its GEMM's epilogue. Its weight
        is tied to the embedding table, which stays in bf16 for the token lookup, so this adds an
        fp8 copy (vocab x hidden bytes: 1.4 GB on the 31b) and halves the largest single read of a
        decode step. Off by default: transformers' own FP8 path keeps the lm_head in bf16, and its
        logits error is the bar (bench_fp8_quality.py measures both).
    kv_cache_dtype: "auto" (default): the paged KV pool in the model's dtype. "fp8": in e4m3 (half
        the bytes of bf16: a memory budget holds twice the tokens), with one fp32 scale per layer for
        k and one for v, 1.0 by default (Gemma-4 RMS-normalizes k and v per head, so they are O(1));
        k and v are quantized as they are appended and dequantized by the attention kernels. Needs
        attention="paged" (HF's cache holds the KV otherwise). ``report()`` shows the KV dtype and
        bytes per token and per sequence.
    tensor_parallel: ``False`` (default). ``True``: split the model over the ranks of the default
        torch.distributed process group, which must be initialized before optimize() (under
        ``torchrun --nproc-per-node N``): each rank keeps its share of the attention heads (KV heads
        too, replicated where there are fewer than ranks), of the MLP and of the MoE experts' width,
        and all-reduces each block's output; embeddings, norms and the lm_head are replicated. Every
        rank runs the same generate call (same inputs, same seed). It cannot be undone, and the
        model cannot be saved after it. See gemma4opt/tensor_parallel.py.
    """

    patterns: tuple[str, ...] | None = None
    inductor: bool | None = None
    cuda_graphs: bool | None = None
    cache: str = "auto"
    attention: str = "auto"
    page_size: int = 16
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    kv_pool_pages: int | None = None
    kv_pool_fraction: float | None = None
    decode_buckets: tuple[int, ...] | None = None
    deferred_stop: bool | None = None
    fast_replan: bool = True
    direct_decode: bool = True
    decode_kernel: str = "triton"
    quantization: str | None = None
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"
    tensor_parallel: bool = False

    def __post_init__(self):
        _check_fields(self)

    def enabled_patterns(self) -> tuple[str, ...]:
        if self.patterns is None:
            return DEFAULT_PATTERNS
        return tuple(p for p in PATTERN_NAMES if p in self.patterns)

    def resolve(self, device_type: str, dtype=None, text_config=None) -> "Gemma4OptConfig":
        """Fill the ``None``/"auto" fields for a device (and, for attention="auto", a model)."""
        on_cuda = device_type == "cuda"
        attention, why = self.attention, "set in Gemma4OptConfig"
        if attention == "auto":
            attention, why = choose_attention(device_type, dtype, text_config, self.kv_cache_dtype)
        paged = attention == "paged"
        if paged and self.cache == "static":
            raise ValueError("Gemma4OptConfig: cache='static' and attention='paged' exclude each other (the paged "
                             "cache is the KV cache); use cache='auto' with attention='paged', or attention='hf'")
        # The paged cache brings its own KV storage: HF's cache choice does not apply to it.
        cache = self.cache if self.cache != "auto" else ("static" if on_cuda and not paged else "dynamic")
        inductor = bool(self.inductor)
        graphs = (on_cuda and (cache == "static" or paged)) if self.cuda_graphs is None else self.cuda_graphs
        if graphs and paged and inductor:
            raise ValueError("Gemma4OptConfig: paged decode graphs are gemma4opt's own (runtime/decode_graphs.py); "
                             "use inductor=False with attention='paged' and cuda_graphs")
        if self.attention == "paged" and on_cuda:
            from gemma4opt.paged.backends.flashinfer import available

            reason = available()
            if reason is not None:
                raise ValueError(f"Gemma4OptConfig.attention='paged' on CUDA needs FlashInfer: {reason}")
        if self.kv_cache_dtype == "fp8" and not paged:
            raise ValueError("Gemma4OptConfig.kv_cache_dtype='fp8' is the paged KV pool's dtype: it needs "
                             f"attention='paged' (this model resolves to attention={attention!r}, where HF's "
                             f"cache holds the KV: {why})")
        if graphs and not on_cuda:
            raise ValueError("Gemma4OptConfig.cuda_graphs=True needs a CUDA model; this model is on " + device_type)
        max_batch = self.max_batch_size or DEFAULT_MAX_BATCH
        max_seq = self.max_seq_len or int(getattr(text_config, "max_position_embeddings", 0) or 0) or 8192
        if self.decode_buckets and max(self.decode_buckets) > max_batch:
            raise ValueError(f"Gemma4OptConfig.decode_buckets={self.decode_buckets}: a bucket is larger than "
                             f"max_batch_size={max_batch}")
        # An explicit max_batch_size is always a bucket; unset, graphs stop at DEFAULT_MAX_GRAPH_BATCH.
        top = max_batch if self.max_batch_size is not None else min(max_batch, DEFAULT_MAX_GRAPH_BATCH)
        if self.decode_buckets and self.max_batch_size is None:
            buckets = tuple(sorted(set(self.decode_buckets)))     # the caller's, as given
        else:
            given = self.decode_buckets or (1, 2, 4, 8, *range(16, top + 1, 8))
            buckets = tuple(sorted({b for b in given if b < top} | {top}))
        fraction = self.kv_pool_fraction
        if fraction is None and self.max_batch_size is None and self.max_seq_len is None:
            fraction = DEFAULT_KV_POOL_FRACTION
        deferred = on_cuda if self.deferred_stop is None else self.deferred_stop
        return dataclasses.replace(self, attention=attention, cache=cache, inductor=inductor, cuda_graphs=graphs,
                                   decode_buckets=buckets, deferred_stop=deferred, max_batch_size=max_batch,
                                   max_seq_len=max_seq, kv_pool_fraction=fraction)


def choose_attention(device_type: str, dtype, text_config, kv_cache_dtype: str = "auto") -> tuple[str, str]:
    """attention="auto": ("paged" or "hf", why), the fastest mode that runs this model here."""
    if device_type != "cuda":
        return "hf", (f"auto on {device_type}: HF attention (the paged mode's {device_type} path is a reference; "
                      "on a CPU the optimized model is not faster than eager)")
    from gemma4opt.paged.backends import paged_unsupported
    from gemma4opt.paged.backends.flashinfer import available

    why = available()
    if why is not None:
        return "hf", (f"auto on CUDA: HF attention, because the paged mode needs FlashInfer: {why} "
                      "(pip install 'gemma4opt[gpu]')")
    why = paged_unsupported(dtype, text_config, kv_pool_dtype(kv_cache_dtype, dtype))
    if why is not None:
        return "hf", f"auto on CUDA: HF attention, because {why}"
    return "paged", "auto on CUDA: paged KV cache (FlashInfer prefill, Triton decode, CUDA graphs)"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(c: Gemma4OptConfig) -> None:
    """Types and ranges of every field, each error naming the field and what it accepts."""
    def fail(name, want, exc=ValueError):
        raise exc(f"Gemma4OptConfig.{name}={getattr(c, name)!r}: {want}")

    if c.patterns is not None:
        if isinstance(c.patterns, str) or not isinstance(c.patterns, (tuple, list)):
            fail("patterns", f"a tuple of pattern names (e.g. ({c.patterns!r},)), or None for all; supported: "
                             f"{list(PATTERN_NAMES)}", TypeError)
        if not all(isinstance(p, str) for p in c.patterns):
            fail("patterns", "every entry must be a pattern name (str)", TypeError)
        unknown = [p for p in c.patterns if p not in PATTERN_NAMES]
        if unknown:
            raise ValueError(f"Gemma4OptConfig.patterns: unknown pattern(s) {unknown}; supported: {list(PATTERN_NAMES)}")
        object.__setattr__(c, "patterns", tuple(c.patterns))
    for name, choices in (("cache", _CACHES), ("attention", _ATTENTION), ("decode_kernel", _DECODE_KERNELS)):
        if getattr(c, name) not in choices:
            fail(name, f"supported: {list(choices)}", ValueError if isinstance(getattr(c, name), str) else TypeError)
    for name, choices in (("quantization", _QUANTIZATION), ("kv_cache_dtype", _KV_CACHE_DTYPES)):
        if getattr(c, name) not in choices:
            fail(name, f"supported: {list(choices)}",
                 ValueError if getattr(c, name) is None or isinstance(getattr(c, name), str) else TypeError)
    for name in ("inductor", "cuda_graphs", "deferred_stop"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), bool):
            fail(name, "True, False or None (automatic)", TypeError)
    for name in ("fast_replan", "direct_decode", "tensor_parallel", "quantize_lm_head"):
        if not isinstance(getattr(c, name), bool):
            fail(name, "True or False", TypeError)
    if c.quantize_lm_head and c.quantization != "fp8":
        fail("quantize_lm_head", f"needs quantization='fp8' (got quantization={c.quantization!r})")
    for name, low, optional in (("page_size", 1, False), ("max_batch_size", 1, True), ("max_seq_len", 1, True),
                                ("kv_pool_pages", 2, True)):
        v = getattr(c, name)
        if v is None and optional:
            continue
        if not _is_int(v):
            fail(name, "an int" + (" or None (automatic)" if optional else ""), TypeError)
        if v < low:
            fail(name, f"must be >= {low}" + (" (the padding page and at least one more)" if low == 2 else "")
                 + ("; None means automatic" if optional else ""))
    if c.kv_pool_fraction is not None:
        if isinstance(c.kv_pool_fraction, bool) or not isinstance(c.kv_pool_fraction, (int, float)):
            fail("kv_pool_fraction", "a fraction in (0, 1] or None", TypeError)
        if not 0 < c.kv_pool_fraction <= 1:
            fail("kv_pool_fraction", "a fraction in (0, 1]")
    if c.decode_buckets is not None:
        if isinstance(c.decode_buckets, (str, int)) or not isinstance(c.decode_buckets, (tuple, list)):
            fail("decode_buckets", "a tuple of batch sizes (e.g. (1, 2, 4, 8)) or None", TypeError)
        if not c.decode_buckets or not all(_is_int(b) and b > 0 for b in c.decode_buckets):
            fail("decode_buckets", "positive batch sizes (ints)")
        object.__setattr__(c, "decode_buckets", tuple(c.decode_buckets))
