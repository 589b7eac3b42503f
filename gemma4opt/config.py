"""Gemma4OptConfig: the one place where a user tunes what optimize() does."""
from __future__ import annotations

import dataclasses

from gemma4opt.patterns import PATTERN_NAMES

_CACHES = ("auto", "dynamic", "static")
_ATTENTION = ("hf", "paged")
_DECODE_KERNELS = ("triton", "flashinfer", "auto")


@dataclasses.dataclass(frozen=True)
class Gemma4OptConfig:
    """What optimize() does to a model.

    patterns: names of the fusions to apply, in the order of ``gemma4opt.patterns.PATTERN_NAMES``;
        ``None`` means all of them. An empty tuple captures the graph but rewrites nothing.
    inductor: lower the rewritten graph with Inductor. ``None`` = off: the graph runs as captured,
        calling the fused ops (Triton on CUDA, references on CPU, so CPU results equal HF's bit for
        bit), and CUDA decode steps replay it as gemma4opt's own CUDA graphs (runtime.decode_graphs):
        seconds to compile. ``True``: Inductor lowers the rest (with cuda_graphs, decode only, as
        cudagraph trees); measured on an H200, a 12-layer 31b took over 6 minutes to compile.
    cuda_graphs: replay decode steps as CUDA graphs: over HF's static cache (gemma4opt's runner,
        or Inductor's cudagraph trees with ``inductor=True``), or over the paged cache per batch
        bucket (gemma4opt's runner; see decode_buckets). ``None`` = on when on CUDA with a static
        or paged cache.
    cache: KV cache ``generate`` uses when the caller passes none. "auto" = "static" on CUDA
        (fixed shapes: one decode graph, no recompiles), "dynamic" on CPU.
    attention: "hf" keeps HF's attention over HF's cache. "paged" gives generate a paged KV cache
        (gemma4opt.attention) whose attention reads page tables built on the host; sliding layers
        free the pages their window left behind. CPU: reference attention. CUDA: FlashInfer
        (attention/flashinfer.py; the ``[gpu]`` extra), fp16/bf16 models with head_dim 64, 128,
        256 or 512; anything else is refused when optimize() is called.
    page_size, max_batch_size, max_seq_len, kv_pool_pages: the paged cache's shape; kv_pool_pages
        (per attention kind) defaults to max_batch_size full-length sequences.
    kv_pool_fraction: with kv_pool_pages unset, cap the pools (every layer, both kinds) at this
        fraction of the GPU memory free when optimize() runs: fewer pages than max_batch_size
        full-length sequences if that is all that fits (a generate that outgrows them raises
        PoolExhausted naming these settings, before anything is overwritten). ``None``: no cap,
        but a pool that cannot fit in 90 % of the free memory is refused at optimize() with the
        sizes, instead of failing in CUDA's allocator.
    deferred_stop: let HF generate read its stop flag one step late (transformers'
        DeferredStopCheck, which HF enables on "mps" only), so the host queues the next decode step
        while the GPU runs this one; the one extra step it may run is undone by HF. ``None`` = on
        when on CUDA; off on CPU (no device to overlap with). See runtime/stop_check.py.
    fast_replan: with the paged cache on CUDA, decode graphs' per-step FlashInfer plans skip
        FlashInfer's Python ``plan()`` and call its C++ planner directly, after checking once per
        wrapper that both leave the same data for the GPU (attention/flashinfer_replan.py; off for
        that wrapper, and counted in the report, if not).
    decode_kernel: with the paged cache on CUDA, the attention kernel of decode steps. "triton":
        gemma4opt's split-KV kernel (kernels/paged_decode.py), which reads a device copy of the page
        table and needs no per-step host plan; a geometry it does not support uses FlashInfer.
        "flashinfer": FlashInfer's decode, planned on the host before each step. "auto": Triton for
        kinds with head_dim <= 256 (sliding layers), FlashInfer for wider heads (the full layers'
        512). Prefill always runs FlashInfer.
    decode_buckets: with the paged cache and cuda_graphs, the batch sizes decode graphs are
        captured for; a batch of B replays the smallest bucket >= B, padded with rows of a dummy
        sequence whose page is reserved when the pool is created. ``None`` = 1, 2, 4, 8, then
        steps of 8 up to max_batch_size (which is always a bucket).
    """

    patterns: tuple[str, ...] | None = None
    inductor: bool | None = None
    cuda_graphs: bool | None = None
    cache: str = "auto"
    attention: str = "hf"
    page_size: int = 16
    max_batch_size: int = 8
    max_seq_len: int = 2048
    kv_pool_pages: int | None = None
    kv_pool_fraction: float | None = None
    decode_buckets: tuple[int, ...] | None = None
    deferred_stop: bool | None = None
    fast_replan: bool = True
    decode_kernel: str = "triton"

    def __post_init__(self):
        if self.patterns is not None:
            unknown = [p for p in self.patterns if p not in PATTERN_NAMES]
            if unknown:
                raise ValueError(
                    f"Gemma4OptConfig.patterns: unknown pattern(s) {unknown}; supported: {list(PATTERN_NAMES)}"
                )
        if self.cache not in _CACHES:
            raise ValueError(f"Gemma4OptConfig.cache={self.cache!r}; supported: {list(_CACHES)}")
        if self.attention not in _ATTENTION:
            raise ValueError(f"Gemma4OptConfig.attention={self.attention!r}; supported: {list(_ATTENTION)}")
        if self.decode_kernel not in _DECODE_KERNELS:
            raise ValueError(f"Gemma4OptConfig.decode_kernel={self.decode_kernel!r}; supported: {list(_DECODE_KERNELS)}")
        if self.decode_buckets is not None and (not self.decode_buckets or min(self.decode_buckets) <= 0):
            raise ValueError(f"Gemma4OptConfig.decode_buckets={self.decode_buckets!r}: positive batch sizes")
        if self.kv_pool_fraction is not None and not 0 < self.kv_pool_fraction <= 1:
            raise ValueError(f"Gemma4OptConfig.kv_pool_fraction={self.kv_pool_fraction!r}: a fraction in (0, 1]")
        for name in ("page_size", "max_batch_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Gemma4OptConfig.{name} must be positive, got {getattr(self, name)}")

    def enabled_patterns(self) -> tuple[str, ...]:
        if self.patterns is None:
            return PATTERN_NAMES
        return tuple(p for p in PATTERN_NAMES if p in self.patterns)

    def resolve(self, device_type: str) -> "Gemma4OptConfig":
        """Fill the ``None``/"auto" fields for a device."""
        on_cuda = device_type == "cuda"
        paged = self.attention == "paged"
        if paged and self.cache == "static":
            raise ValueError("Gemma4OptConfig: cache='static' and attention='paged' exclude each other (the paged "
                             "cache is the KV cache); use cache='auto' with attention='paged'")
        # The paged cache brings its own KV storage: HF's cache choice does not apply to it.
        cache = self.cache if self.cache != "auto" else ("static" if on_cuda and not paged else "dynamic")
        inductor = bool(self.inductor)
        graphs = (on_cuda and (cache == "static" or paged)) if self.cuda_graphs is None else self.cuda_graphs
        if graphs and paged and inductor:
            raise ValueError("Gemma4OptConfig: paged decode graphs are gemma4opt's own (runtime/decode_graphs.py); "
                             "use inductor=False with attention='paged' and cuda_graphs")
        if self.attention == "paged" and on_cuda:
            from gemma4opt.attention.flashinfer import available

            reason = available()
            if reason is not None:
                raise ValueError(f"Gemma4OptConfig.attention='paged' on CUDA needs FlashInfer: {reason}")
        if graphs and not on_cuda:
            raise ValueError("Gemma4OptConfig.cuda_graphs=True needs a CUDA model; this model is on " + device_type)
        buckets = self.decode_buckets or (1, 2, 4, 8, *range(16, self.max_batch_size + 1, 8))
        buckets = tuple(sorted({b for b in buckets if b < self.max_batch_size} | {self.max_batch_size}))
        deferred = on_cuda if self.deferred_stop is None else self.deferred_stop
        return dataclasses.replace(self, cache=cache, inductor=inductor, cuda_graphs=graphs, decode_buckets=buckets,
                                   deferred_stop=deferred)
