"""StepContext: one optimized model's paged KV state and the metadata of the step being run.

Built once per model (the pool is reused by every generate call). Before each forward the host
builds the step's page metadata in numpy (paged/tables.py), stages it on the device in one copy
(paged/staging.py), picks each attention kind's backend for the step (paged/backends/) and lets it
prepare; the attention layers find all of it through ``module._gemma4opt_ctx`` (paged/
attention_function.py) instead of threading arguments through HF's model code.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from gemma4opt.fixed_tensors import FixedTensors
from gemma4opt.paged.backends import KINDS, KindBackends, choose, geometries
from gemma4opt.paged.backends.base import Backend, is_prefix
from gemma4opt.paged.pool import (allocate_kv, allocate_kv_scales, free_device_memory, kv_pool_dtype, kv_producers,
                                   pool_pages, token_bytes)
from gemma4opt.paged.staging import HostStaging
from gemma4opt.paged.tables import PagedSequences, PagePool, StepMeta
from gemma4opt.step_inputs import mask_gap_rows

# Tokens a recording cache keeps past the sliding window: the most HF may crop at once (an
# assisted draft is at most num_assistant_tokens, 20 by default, growing by 2 per accepted draft).
RECORD_MARGIN = 128


class StepContext:
    def __init__(self, text_config, opt_config, device, dtype, fixed: FixedTensors | None = None, shard=None):
        cfg, oc = text_config, opt_config
        self.shard = shard             # tensor parallel: this rank's heads (tensor_parallel.py), else None
        self.fixed = fixed if fixed is not None else FixedTensors()
        self.page_size = oc.page_size
        self.max_batch = oc.max_batch_size
        self.max_seq_len = oc.max_seq_len
        self.kv_dtype = kv_pool_dtype(oc.kv_cache_dtype, dtype)
        n_pages = pool_pages(cfg, oc, self.kv_dtype, free_device_memory(device), shard)
        windows = {"sliding_attention": cfg.sliding_window, "full_attention": None}
        self.seqs = {k: PagedSequences(PagePool(n_pages, oc.page_size, f"{k} KV pool"), self.max_batch,
                                       oc.max_seq_len, windows[k]) for k in KINDS}
        self.producer = kv_producers(cfg)
        self.updating_layers: list[int] | None = None   # the layers whose caches count tokens (install_paged)
        self._cfg = cfg
        self.layer_kind = list(cfg.layer_types)
        self.kv = allocate_kv(cfg, n_pages, oc.page_size, device, self.kv_dtype, shard)
        # An fp8 pool's scales, per layer that owns KV: [k, v] fp32 on the device (what kv_append,
        # the reference and the Triton kernel read), and the same values on the host (FlashInfer
        # takes them as floats). set_kv_scales changes both. Empty for a pool in the model's dtype.
        self.kv_scale = allocate_kv_scales(self.kv) if self.kv_dtype != dtype else {}
        self.kv_scale_host = {layer: (1.0, 1.0) for layer in self.kv_scale}
        self._stepped = False
        for t in (*self.kv.values(), *self.kv_scale.values()):
            self.fixed.add(t)                    # decode graphs bake the pool's (and scales') addresses
        # Decode graphs pad a batch to its bucket with rows of a dummy sequence: one page per kind,
        # taken now, while the pool is empty, so padding never needs a free page later.
        self.buckets = tuple(oc.decode_buckets or ()) if oc.cuda_graphs else ()
        self.dummy_page = {k: int(self.seqs[k].pool.alloc(1)[0]) for k in KINDS} if self.buckets else {}
        self.staging = HostStaging(device, self.fixed)
        self.device = torch.device(device)
        self.active = False
        self.last_kv_held = (0, 0)  # (bytes, sequences) when the last generate released its pages
        # Row allocator: every live PagedCache holds rows of the page tables (all kinds share the
        # numbering) from its first step until it is released or garbage-collected.
        self.row_free = np.ones(self.max_batch, dtype=bool)
        self.collected: list[np.ndarray] = []   # rows of caches garbage-collected, freed at the next page work
        self._owner = None          # weakref to the cache that took rows last (diagnostics)
        self.meta: dict[str, dict[str, torch.Tensor]] = {}
        self.route: dict[str, Backend] = {}     # this step's backend per kind
        self.token_index: torch.Tensor | None = None
        self.new_lens: torch.Tensor | None = None
        self._real_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        # A decode graph's token index is 0..tokens-1: made once per graph shape, at a fixed address
        # the graphs bake (no per-step copy into the captured inputs).
        self._arange_dev: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            self._arange(b)
        self.use_backends(choose(geometries(cfg, oc.page_size, device, dtype, self.kv_dtype, shard), self.device.type == "cuda",
                                 oc.decode_kernel, max_pages=n_pages + self.max_batch, max_batch=self.max_batch,
                                 fast_replan=oc.fast_replan))

    def use_backends(self, backends: dict[str, KindBackends]) -> None:
        """Each kind's prefill and decode backends (``backends.choose``; the CPU tests pass CUDA's,
        with FlashInfer stood in). Kinds whose decode backend reads the page table get a device
        mirror of it [max_batch, ring], at a fixed address (decode graphs bake it), kept current
        by the table writes each step queues."""
        self.backends = backends
        for kb in backends.values():
            for b in (kb.prefill, kb.decode):
                b.bind_kv_scales(self.kv_scale_host)
        self._routes: dict[tuple, dict[str, Backend]] = {}
        self._meta_cache: dict[tuple, tuple] = {}   # bound metadata named the old tables
        kinds = [k for k, b in backends.items() if b.decode.reads_table]
        # One tensor for every kind's table (one scatter a step brings them up to date); each kind
        # reads its [max_batch, ring] slice.
        ring = max((self.seqs[k].ring for k in kinds), default=0)
        self.table_dev = self.fixed.add(torch.zeros(len(kinds), self.max_batch, ring, dtype=torch.int32,
                                                    device=self.device))
        self.tables = {}
        for i, kind in enumerate(kinds):
            seqs = self.seqs[kind]
            seqs.track_updates = True
            seqs.mirror_base, seqs.mirror_stride = i * self.max_batch * ring, ring
            # A view at its own address: graphs read it in place.
            self.tables[kind] = self.fixed.add(self.table_dev[i, :, :seqs.ring])
            self.tables[kind].copy_(torch.from_numpy(seqs.table))
        for kind in KINDS:
            if kind not in self.tables:
                self.seqs[kind].track_updates = False

    def _arange(self, n: int) -> torch.Tensor:
        t = self._arange_dev.get(n)
        if t is None:
            t = self._arange_dev[n] = self.fixed.add(torch.arange(n, dtype=torch.int32, device=self.device))
        return t

    def token_bucket(self, cache, batch: int, tokens: int) -> tuple[int, int] | None:
        """(rows, tokens) of the graph a step of ``tokens`` > 1 new tokens per sequence runs in:
        powers of two from 2, as long as rows x tokens fits the largest decode bucket (its size
        bounds what a capture holds); None when it does not fit, a kind's decode backend does not
        read the page table (FlashInfer's multi-token plans are made per step, outside graphs) or
        the cache does not hold rows 0..batch-1 (the table is read by batch row)."""
        rows = self.bucket(batch)
        if rows is None or any(k not in self.tables for k in self.backends) or not is_prefix(cache.rows):
            return None
        padded = 1 << (tokens - 1).bit_length()
        if rows * padded > self.buckets[-1]:
            return None
        return rows, padded

    def begin_token_step(self, cache, batch: int, tokens: int, pad_rows: int, pad_tokens: int) -> None:
        """Host metadata for a graphed step of ``tokens`` new (real) tokens on each of the
        cache's ``batch`` sequences, padded to ``pad_rows`` x ``pad_tokens`` (``token_bucket``):
        one query row per token for the table backends; padding rows and tokens are one-token
        rows of the dummy sequence. The cache must hold rows 0..batch-1."""
        self.free_collected()
        lens_slots = {}
        for kind in KINDS:
            lens, slots = self.seqs[kind].table_tokens(cache.rows, tokens)
            if kind in self.tables:
                grid_lens = np.ones((pad_rows, pad_tokens), dtype=lens.dtype)
                grid_slots = np.full((pad_rows, pad_tokens), self.dummy_page[kind] * self.page_size, dtype=slots.dtype)
                grid_lens[:batch, :tokens], grid_slots[:batch, :tokens] = lens, slots
                lens_slots[kind] = grid_lens.reshape(-1), grid_slots.reshape(-1)
        self.active = True
        self._stage_step({}, lens_slots, None, None, pad_rows * pad_tokens)

    def graph_signature(self) -> tuple:
        """What paged_attention_forward reads from this context besides tensors, compared by
        identity (runtime/direct_decode.py: a decode step skipping Dynamo checks it is unchanged)."""
        return (self.active, self.producer, self.kv_scale, self.new_lens is None, *self.route.values())

    def step_objects(self) -> tuple:
        """The objects through which the attention function reaches this step's tensors (the
        bound metadata, a layout's cached dict; the token index; the new lengths). Rebound only when
        the step's layout changes: while they are the same objects, so are the tensors they hold
        (runtime/direct_decode.py then does not gather those again)."""
        return self.meta, self.token_index, self.new_lens, self.kv      # (kv_scale: in graph_signature)

    def bucket(self, batch: int) -> int | None:
        """The smallest decode-graph bucket that holds ``batch`` rows (None: larger than all)."""
        return next((b for b in self.buckets if b >= batch), None)

    def begin_step(self, cache, batch: int, tokens: int, attention_mask, pad_to: int | None = None) -> None:
        """Host-side metadata for this forward. Reads the 2-D attention mask at prefill only.

        ``pad_to``: a graphed decode step of ``pad_to`` rows, the last ones padding (dummy
        sequence). The graph then gets only fixed-shape tensors: a table backend's device page
        table (fixed address) and lengths; a page-list backend's op reads nothing that changes
        length (FlashInfer's plan holds the page lists).
        """
        self.free_collected()
        first = cache.rows is None
        if first:
            cache.rows = self.acquire_rows(batch)
            self._owner = _weak(cache)
            if getattr(cache, "record_past", False):
                self.record_past(cache.rows)
        elif len(cache.rows) != batch:
            raise ValueError(f"gemma4opt: this PagedCache holds {len(cache.rows)} sequences and the step has {batch}; "
                             "continue a cache with the batch it was made with")
        decode = tokens == 1 and not first
        real = None
        if not decode and attention_mask is not None and attention_mask.dim() == 2:
            # Prefill, a continued cache's new tokens, a draft to verify: the mask's last ``tokens``
            # columns say which of the step's tokens are real (left padding is not). Read on the host.
            host_mask = attention_mask.detach().to("cpu")
            gaps = mask_gap_rows(host_mask)
            if gaps:
                raise ValueError(f"gemma4opt paged step: attention_mask rows {gaps[:8]} hold a 0 after a 1 (right "
                                 "padding or a gap between tokens); the paged cache keeps left padding only, where "
                                 "HF keeps the masked slots: pad on the left, or call without a PagedCache")
            real = host_mask[:, -tokens:].to(torch.bool).numpy()
        if real is None:       # every token real: decode steps (cached per batch size)
            new, token_index = self._all_real(batch, tokens)
        else:
            new = real.sum(1)
            token_index = np.flatnonzero(real.reshape(-1))
        # Kinds whose decode backend reads the table: lengths and slots only, no page lists. It
        # reads table row b for batch row b: only a cache holding rows 0..B-1 runs it.
        table = self.tables if decode and is_prefix(cache.rows) else ()
        host = {kind: self.seqs[kind].step(cache.rows, new, decode) for kind in KINDS if kind not in table}
        lens_slots = {kind: self.seqs[kind].table_step(cache.rows) for kind in table}
        if pad_to is not None:
            if not decode:
                raise ValueError("gemma4opt: only decode steps are padded to a graph bucket")
            host = {kind: self._padded(kind, m, pad_to - batch) for kind, m in host.items()}
            lens_slots = {kind: self._padded_lens(kind, *ls, pad_to - batch) for kind, ls in lens_slots.items()}
            new, token_index = self._all_real(pad_to, 1)
        self._stage_step(host, lens_slots, new, token_index, pad_to, decode)

    def _stage_step(self, host, lens_slots, new, token_index, pad_to, decode: bool = True) -> None:
        """Pick each kind's backend, stage the step's arrays (one copy), bring the device page
        tables up to date, bind the backends' metadata and let them prepare (FlashInfer plans)."""
        self._stepped = True
        graph = pad_to is not None
        self.route = self._route(tuple(lens_slots), decode)
        host = {kind: m for kind, m in host.items() if kind in self.route}    # kinds the model has
        # What a decode graph reads comes first: one entry per row, so every step of a bucket cuts
        # them at the same offsets and the graph reads them in place. Page lists, whose length
        # changes as pages come and go, and the table writes follow.
        arrays = {}
        for kind, (lens, slots) in lens_slots.items():
            arrays["seq_lens"] = lens           # one page size, one token per step: equal for every kind
            arrays[f"{kind}.slot_mapping"] = slots
        for kind, m in host.items():
            arrays[f"{kind}.slot_mapping"] = m.slot_mapping
        arrays.update((f"{kind}.{f}", getattr(m, f)) for kind, m in host.items()
                      for f in self.route[kind].device_fields)
        updates = self._take_updates()
        if updates is not None:
            arrays["upd_idx"], arrays["upd_ids"] = updates
        if not graph:                 # a decode graph's rows are 0..pad_to-1: a cached device arange
            arrays["token_index"] = token_index
        reads_new = any(self.route[kind].needs_new_lens for kind in host)
        if reads_new:
            arrays["new_lens"] = new
        dev = self.staging.stage(arrays)          # one host->device copy for the whole step
        if updates is not None:                   # the device tables catch up with the host's writes
            self.table_dev.view(-1).index_put_((dev["upd_idx"],), dev["upd_ids"])
        self.meta = self._bound_meta(dev, tuple(host), tuple(lens_slots))
        self.token_index = dev["token_index"] if not graph else self._arange(pad_to)
        self.new_lens = dev["new_lens"] if reads_new else None
        for kind, backend in self.route.items():     # once per step per kind
            backend.prepare(host.get(kind), dev, pad_to)

    def _route(self, table_kinds: tuple, decode: bool) -> dict[str, Backend]:
        """Each kind's backend for a step (cached: a handful of step kinds). Kinds stepped through
        the table run their decode backend; other decode steps run it unless it reads the table
        (rows that are not 0..B-1), then, like prefill, the prefill backend."""
        key = (table_kinds, decode)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = {
                kind: kb.decode if kind in table_kinds or (decode and not kb.decode.reads_table) else kb.prefill
                for kind, kb in self.backends.items()}
        return route

    def _take_updates(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Every kind's queued device-table writes, as one (flat index, page id) pair or None."""
        updates = [u for u in (self.seqs[kind].take_updates() for kind in self.tables) if u is not None]
        if not updates:
            return None
        idx, ids = (np.concatenate(x) for x in zip(*updates)) if len(updates) > 1 else updates[0]
        # Padded to a power of two by repeating the last write (the same value again: harmless), so
        # steps with table writes stage a handful of layouts, not a new one (new views) each time.
        pad = max(64, 1 << (len(idx) - 1).bit_length()) - len(idx)
        if pad:
            idx, ids = np.concatenate([idx, idx[-1:].repeat(pad)]), np.concatenate([ids, ids[-1:].repeat(pad)])
        return idx, ids

    def _bound_meta(self, dev, list_kinds, table_kinds) -> dict[str, dict[str, torch.Tensor]]:
        """Per kind, the tensors its backend's op reads (and kv_append's slots), from the staged
        views. Cached per layout: a layout's views are the same tensors every step (HostStaging),
        so decode steps rebuild nothing."""
        key = (id(dev), list_kinds, table_kinds, tuple(id(b) for b in self.route.values()))
        got = self._meta_cache.get(key)
        if got is not None and got[0] is dev:
            return got[1]
        meta = {kind: {f: dev[f"{kind}.{f}"] for f in ("slot_mapping", *self.route[kind].op_fields)}
                for kind in list_kinds}
        for kind in table_kinds:
            meta[kind] = {"table": self.tables[kind], "seq_lens": dev["seq_lens"],
                          "slot_mapping": dev[f"{kind}.slot_mapping"]}
        if len(self._meta_cache) > 64:
            self._meta_cache.clear()
        self._meta_cache[key] = (dev, meta)
        return meta

    def _all_real(self, batch: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(new tokens per row, flat token index) when every token is real; cached, read-only."""
        key = (batch, tokens)
        got = self._real_cache.get(key)
        if got is None:
            got = self._real_cache[key] = (np.full(batch, tokens, dtype=np.int64), np.arange(batch * tokens))
            for a in got:
                a.flags.writeable = False
        return got

    def _padded_lens(self, kind: str, lens: np.ndarray, slots: np.ndarray, n: int):
        """Triton-decode lengths and slots plus ``n`` padding rows: one token in the dummy page
        (the kernel reads table rows past the batch: stale but valid page ids, output unused)."""
        if n == 0:
            return lens, slots
        return (np.concatenate([lens, np.ones(n, dtype=lens.dtype)]),
                np.concatenate([slots, np.full(n, self.dummy_page[kind] * self.page_size, dtype=slots.dtype)]))

    def _padded(self, kind: str, m: StepMeta, n: int) -> StepMeta:
        """``m`` plus ``n`` decode rows of the dummy sequence: one token in the reserved page."""
        if n == 0:
            return m
        page, ps = self.dummy_page[kind], self.page_size
        ones32 = np.ones(n, dtype=np.int32)
        return StepMeta(
            kv_indptr=np.concatenate([m.kv_indptr, m.kv_indptr[-1] + np.cumsum(ones32)]).astype(np.int32),
            kv_indices=np.concatenate([m.kv_indices, np.full(n, page, dtype=np.int32)]),
            kv_last_page_len=np.concatenate([m.kv_last_page_len, ones32]),
            kv_start=np.concatenate([m.kv_start, np.zeros(n, dtype=m.kv_start.dtype)]),
            qo_indptr=np.arange(len(m.kv_last_page_len) + n + 1, dtype=np.int32),
            slot_mapping=np.concatenate([m.slot_mapping, np.full(n, page * ps, dtype=np.int64)]),
            seq_lens=np.concatenate([m.seq_lens, np.ones(n, dtype=m.seq_lens.dtype)]))

    def acquire_rows(self, batch: int) -> np.ndarray:
        """``batch`` free rows of the page tables (the lowest ones: one cache at a time gets 0..B-1)."""
        if batch > self.max_batch:
            raise ValueError(f"gemma4opt: batch {batch} exceeds Gemma4OptConfig.max_batch_size={self.max_batch}; "
                             "raise max_batch_size or split the batch")
        free = np.flatnonzero(self.row_free)
        if len(free) < batch:
            raise ValueError(f"gemma4opt: a batch of {batch} needs {batch} free rows of the paged KV tables and "
                             f"{len(free)} of Gemma4OptConfig.max_batch_size={self.max_batch} are free: PagedCaches "
                             "returned by earlier generate calls hold the others; release() them (or drop them) "
                             "or raise max_batch_size")
        rows = free[:batch].astype(np.int64)
        self.row_free[rows] = False
        return rows

    def release_rows(self, rows) -> None:
        """Give a cache's pages (every kind) and rows back (generate ended, release(), reset(), GC)."""
        rows = np.asarray(rows, dtype=np.int64)
        # What a generate held at its end: full layers every token, sliding layers only the
        # pages their window still sees (the report and benchmarks show it per sequence).
        self.last_kv_held = (self.kv_bytes_held(rows), len(rows))
        for kind in KINDS:
            self.seqs[kind].release(rows)
        self.row_free[rows] = True
        self.active = False

    def free_collected(self) -> None:
        """Free the rows of caches the garbage collector took since the last call."""
        active = self.active              # freeing rows says nothing about the step being begun
        while self.collected:
            self.release_rows(self.collected.pop())
        self.active = active

    def release(self, cache) -> None:
        if cache.rows is not None:
            rows, cache.rows = cache.rows, None
            self.release_rows(rows)

    def record_past(self, rows) -> None:
        """Sliding kinds keep RECORD_MARGIN tokens past the window for these rows, so HF can crop
        a rejected draft (assisted decoding) or an undone step (deferred stop check) off them."""
        for kind in KINDS:
            self.seqs[kind].margin[rows] = RECORD_MARGIN

    def crop(self, rows, n: int) -> None:
        """Drop the last ``n`` tokens of these rows in every kind (all kinds are checked first)."""
        for kind in KINDS:
            self.seqs[kind].crop_check(rows, n)
        for kind in KINDS:
            self.seqs[kind].crop(rows, n)

    def describe_backends(self) -> str:
        """Each kind's backends, what they did, and what was refused (the report's line)."""
        parts = []
        for kind, kb in self.backends.items():
            if kb.prefill is kb.decode:
                text = f"{kind.split('_')[0]}: {_described(kb.prefill)} for prefill and decode"
            else:
                text = f"{kind.split('_')[0]}: prefill {_described(kb.prefill)}, decode {_described(kb.decode)}"
            text += "".join(f", {name} refused: {why}" for name, why in kb.refused.items())
            parts.append(text)
        return "; ".join(parts)

    @property
    def owner(self):
        """The live PagedCache that took rows last, or None."""
        cache = self._owner() if self._owner is not None else None
        return cache if cache is not None and cache.rows is not None else None

    def set_kv_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Set the fp8 pool's scales of ``layer`` (one that owns KV), e.g. calibrated ones: stored
        values are x / scale. Only before the first step: what the pool holds was quantized with
        the old scales, and a FlashInfer decode graph keeps the floats it was captured with."""
        if not self.kv_scale:
            raise ValueError("gemma4opt: KV scales are the fp8 pool's (Gemma4OptConfig(kv_cache_dtype='fp8')); "
                             f"this pool is {self.kv_dtype}")
        if layer not in self.kv_scale:
            raise ValueError(f"gemma4opt: layer {layer} owns no KV (KV-shared layers read their producer's pages); "
                             f"layers with scales: {sorted(self.kv_scale)}")
        if self._stepped:
            raise RuntimeError("gemma4opt: set KV scales before the model's first paged step (the pool holds values "
                               "quantized with the old ones; decode graphs keep FlashInfer's)")
        for s in (k_scale, v_scale):
            if not (isinstance(s, (int, float)) and 0 < float(s) < float("inf")):
                raise ValueError(f"gemma4opt: a KV scale must be a positive finite number, got {s!r}")
        self.kv_scale[layer].copy_(torch.tensor([float(k_scale), float(v_scale)]))
        self.kv_scale_host[layer] = (float(k_scale), float(v_scale))

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the pool, over every layer that owns KV."""
        return sum(token_bytes(self._cfg, self.kv_dtype, self.shard).values())

    def kv_bytes_per_sequence(self, tokens: int) -> int:
        """Pool bytes a sequence of ``tokens`` tokens holds at its end: full layers keep every
        page, sliding layers the pages their window spans (as the tables free them; a cache that
        records its past for HF's crops keeps a little more)."""
        ps, out = self.page_size, 0
        for layer, b in token_bytes(self._cfg, self.kv_dtype, self.shard).items():
            window = self.seqs[self.layer_kind[layer]].window
            first = max(tokens - (window - 1), 0) // ps if window else 0    # the first page the window sees
            out += (-(-tokens // ps) - first) * ps * b
        return out

    def kv_bytes_held(self, rows=None) -> int:
        """KV bytes the live pages of the current sequences (or of ``rows``) occupy, over every owning layer."""
        return sum(t.numel() // t.shape[0] * t.element_size() * self.seqs[self.layer_kind[layer]].pages_held(rows)
                   for layer, t in self.kv.items())


def _described(backend: Backend) -> str:
    stats = ", ".join(f"{k} {v}" for k, v in backend.stats().items())
    return f"{backend.name} ({stats})" if stats else backend.name


def _weak(cache):
    try:
        return weakref.ref(cache)
    except TypeError:                 # a stand-in (tests): held strongly
        return lambda: cache
