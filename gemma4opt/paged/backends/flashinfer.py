"""The FlashInfer backend: paged prefill (and decode where the Triton backend refuses or is not
asked for), one wrapper per attention kind, planned once per step.

The step's page metadata exists on the host first (paged/tables.py), so ``plan`` gets host
int32 tensors for qo_indptr, kv_indptr and last_page_len (FlashInfer moves them to the CPU
otherwise: a device->host sync per plan) and the device copy of kv_indices from the step's one
staged copy. Every layer of that kind then runs on the same plan; KV-shared layers read their
producer's pages with it. Sliding and full layers need separate wrappers anyway: FlashInfer
bakes ``window_left`` into the plan. Head dims: 256 (prefill on FA3 on Hopper) and 512 (FA2; FA3 has no
512). ``window_left = window - 1`` matches HF's bound (a query sees itself and window-1 keys back).

``gemma4opt::paged_attention_flashinfer(q, kv, token_index, handle, layer)``: q [B, Tq, H, D]; the step's
real rows are ``token_index`` of q flattened (left padding is not planned; its rows come out
zero), or Tq = 1 where HF runs a KV-shared layer on the last token only. Custom ops take no Python
objects: ``handle`` names the backend in a weak table (an address book only: each backend's state
is its own, and a model's backends go with it). ``layer`` is the layer that owns ``kv``: an fp8
pool's scales are looked up by it.

An fp8 (e4m3) pool (kv_cache_dtype="fp8"): plans say ``kv_data_type=float8_e4m3fn`` and every
wrapper is FA2 (FlashInfer 0.6's FA3 reads fp8 KV only with fp8 queries; FA2 converts the pages
to the queries' dtype in shared memory), and ``run`` gets the layer's scales as
``k_scale``/``v_scale``: FlashInfer folds k's into the softmax scale and multiplies the output by
v's. It takes them as Python floats (a tensor k_scale would become the kernel's double sm_scale),
so they come from the StepContext's host copy (``bind_kv_scales``), not the device tensors the
other backends read; a decode graph keeps the floats it was captured with, which is why scales
are set before the first step (StepContext.set_kv_scales). FlashInfer's FA2 cannot load fp8
pages at head_dim 64 (prefill.cuh's produce_kv): refused.

FlashInfer's plan() stages its schedule in a pinned buffer per wrapper and copies it to the GPU
asynchronously; a plan() of the next step must not overwrite that buffer before the copy ran.
The host runs ahead of the GPU (HF's stop check is deferred, runtime/stop_check.py; decode
graphs are replayed without syncs), so each wrapper records an event after its plan and the next
plan of that wrapper waits on it if, and only if, the GPU has not reached it yet.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import numpy as np
import torch

from gemma4opt.ops.kv_append import KV_FP8
from gemma4opt.paged.backends.base import Backend, KindGeometry
from gemma4opt.progress import timed

_BACKENDS: "weakref.WeakValueDictionary[int, FlashInferBackend]" = weakref.WeakValueDictionary()
_handles = itertools.count()
# Kernel configurations planned once in this process: FlashInfer's JIT cache is per process too,
# so this only says when a first plan may take ~30 s (a progress note), never what runs.
_FIRST_PLANS: set[tuple] = set()
WORKSPACE_BYTES = 256 << 20     # FlashInfer's float scratch, at least (prefill's split-KV partials)


def device_capability(device) -> tuple[int, int]:
    """The compute capability of ``device``'s GPU; off CUDA (the CPU tests, FlashInfer stood in) a
    Hopper's, the GPU the CUDA path is measured on."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)
    return (9, 0)


HEAD_DIMS = (64, 128, 256, 512)   # the head dims FlashInfer 0.6's paged kernels are built for


def available() -> str | None:
    """None when FlashInfer can be imported, else the reason."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/JIT setup error raised at import
        return f"flashinfer not importable ({type(e).__name__}: {e}); pip install 'gemma4opt[gpu]'"
    return None


class FlashInferBackend(Backend):
    """One attention kind's FlashInfer wrappers and the geometry they were built for."""

    name = "flashinfer"
    op_name = "paged_attention_flashinfer"
    device_fields = ("kv_indices",)       # plan() reads the page ids on the device; the op reads none

    def __init__(self, geometry: KindGeometry, workspace, max_pages: int = 0, fast_replan: bool = True):
        import flashinfer

        from gemma4opt.paged.backends.flashinfer_replan import FastReplan

        super().__init__(geometry)
        g = geometry
        self.handle = next(_handles)
        self.heads = (g.heads, g.kv_heads, g.head_dim)
        self.page_size, self.window, self.dtype, self.scale = g.page_size, g.window, g.dtype, g.scale
        self.window_left = (g.window - 1) if g.window else -1     # HF's bound: the query and window-1 keys back
        self.workspace, self.max_pages = workspace, max_pages
        # Prefill: FA3 on Hopper where it exists (head_dim <= 256). Decode: FA2, whose planner
        # splits each sequence's KV across CTAs; FA3 runs one query row per CTA over the whole
        # sequence: measured on an H200 (benchmarks/bench_attention.py, head_dim 256, batch 32,
        # 4k context) 322 µs (39 % of copy bandwidth) against FA2's 142 µs (89 %).
        # An fp8 pool: FA2 too (FA3 reads fp8 KV only with fp8 queries; "auto" would pick FA2 anyway).
        self.fp8 = g.kv_dtype == KV_FP8
        self.backend = "fa2" if g.head_dim > 256 or self.fp8 else "auto"
        self._new = flashinfer.BatchPrefillWithPagedKVCacheWrapper

        def wrapper(backend=self.backend):
            return self._new(workspace, kv_layout="NHD", backend=backend)

        self.wrapper = wrapper()
        self.decode_wrapper = wrapper("fa2")
        # KV-shared layers at prefill: one query (the last token) per sequence over the same pages.
        self.last_wrapper = wrapper("fa2") if g.last_token_layers else None
        # Decode graphs: one wrapper per batch bucket, its index buffers at fixed addresses (the
        # graph reads them); plan() before each replay rewrites their contents.
        self.graph_wrappers: dict[int, object] = {}
        self.current = self.wrapper
        self._plan_copied: dict[int, torch.cuda.Event] = {}   # wrapper -> event after its plan's copy
        # Decode graphs' replans skip FlashInfer's Python plan() (self-checked; flashinfer_replan.py).
        self.replan = FastReplan() if fast_replan else None
        self.decode = False
        self.planned = False
        self.plans = self.decode_plans = 0
        self.kv_scale_host: dict[int, tuple[float, float]] = {}
        _BACKENDS[self.handle] = self

    @classmethod
    def refuses(cls, geometry: KindGeometry) -> str | None:
        if geometry.dtype not in (torch.float16, torch.bfloat16):
            return (f"FlashInfer supports float16 and bfloat16 and this model is {geometry.dtype}: cast it "
                    "(model.to(torch.bfloat16)) or use attention='hf'")
        if geometry.head_dim not in HEAD_DIMS:
            return (f"head_dim {geometry.head_dim} is not one FlashInfer's paged kernels are built for "
                    f"{list(HEAD_DIMS)}; use attention='hf' for this model")
        if geometry.kv_dtype not in (geometry.dtype, KV_FP8):
            return f"a KV pool in {geometry.kv_dtype} with {geometry.dtype} queries (FlashInfer: the same, or fp8)"
        if geometry.kv_dtype == KV_FP8 and geometry.head_dim == 64:
            return ("an fp8 KV pool at head_dim 64: FlashInfer 0.6's FA2 kernels do not load fp8 pages of 64 "
                    "(prefill.cuh, produce_kv); use kv_cache_dtype='auto' for this model")
        return None

    @classmethod
    def leaves_to_reference(cls, geometry: KindGeometry) -> str | None:
        """Why FlashInfer cannot run this kind on this GPU where the reference backend can stand in
        for its prefill (and the Triton kernel for its decode), or None: fp8 pages above head_dim
        256 before sm100. FlashInfer 0.6 builds its FA2 kernels with one-byte KV over 256-wide heads
        for sm100+ only (jit/attention/modules.py, _fa2_head_dim_nvcc_flags): on an H200 the full
        layers of every Gemma-4 (head_dim 512) cannot prefill an fp8 pool on it."""
        if geometry.kv_dtype != KV_FP8 or geometry.head_dim <= 256:
            return None
        major, minor = device_capability(geometry.device)
        if major >= 10:
            return None
        return (f"an fp8 KV pool at head_dim {geometry.head_dim} on sm_{major}{minor}: FlashInfer 0.6 builds FA2 "
                "with one-byte KV above head_dim 256 for sm100+ only; prefill runs on the reference (gather + SDPA)")

    def prepare(self, host, dev, pad_to) -> None:
        self.plan(host.qo_indptr, host.kv_indptr, host.kv_last_page_len, dev[f"{self.geometry.kind}.kv_indices"],
                  bucket=pad_to)

    def attend(self, q, kv, meta, token_index, new_lens, window, scale, kv_scale=None, layer=-1):
        self.check_layer(window, scale)
        return torch.ops.gemma4opt.paged_attention_flashinfer(q, kv, token_index, self.handle, layer)

    def stats(self):
        out = {"plans": self.plans, "decode plans": self.decode_plans}
        if self.replan is not None and self.replan.fast_plans + self.replan.full_plans:
            out["graph replans"] = self.replan.summary()
        return out

    def _graph_wrapper(self, bucket: int):
        w = self.graph_wrappers.get(bucket)
        if w is None:
            dev = self.workspace.device

            def buf(n):
                return torch.empty(n, dtype=torch.int32, device=dev)

            w = self.graph_wrappers[bucket] = self._new(
                self.workspace, kv_layout="NHD", backend="fa2", use_cuda_graph=True,
                qo_indptr_buf=buf(bucket + 1), paged_kv_indptr_buf=buf(bucket + 1),
                paged_kv_indices_buf=buf(self.max_pages), paged_kv_last_page_len_buf=buf(bucket))
        return w

    def plan(self, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_last_page_len: np.ndarray,
             kv_indices: torch.Tensor, bucket: int | None = None) -> None:
        """Plan this step (``bucket``: a graphed decode step of that many rows, padding included)."""
        B = len(kv_last_page_len)
        kv_indptr = np.ascontiguousarray(kv_indptr, dtype=np.int32)
        # A copy: the decode fast path advances last_page_len in place next step (pages.py).
        last = np.array(kv_last_page_len, dtype=np.int32)
        qo_indptr = np.ascontiguousarray(qo_indptr, dtype=np.int32)
        self.decode = len(qo_indptr) == B + 1 and int(qo_indptr[-1]) == B
        # What FlashInfer's plan() would derive from the tensors element by element in Python
        # (a builtin max over a tensor, get_seq_lens): given from numpy instead.
        live = np.diff(kv_indptr)
        kv_lens = (np.maximum(live - 1, 0) * self.page_size + last).astype(np.int32)   # flashinfer.page.get_seq_lens
        max_q = 1 if self.decode else int(np.diff(qo_indptr).max(initial=1))
        kv_indptr_t, last_t, kv_lens_t = (torch.from_numpy(a) for a in (kv_indptr, last, kv_lens))
        if bucket is not None:
            self.current = self._graph_wrapper(bucket)
        else:
            self.current = self.decode_wrapper if self.decode else self.wrapper
        self._plan(self.current, torch.from_numpy(qo_indptr), kv_indptr_t, kv_indices, last_t, kv_lens_t, max_q,
                   graph=bucket is not None)
        if self.last_wrapper is not None and not self.decode:
            ones = torch.from_numpy(np.arange(B + 1, dtype=np.int32))
            self._plan(self.last_wrapper, ones, kv_indptr_t, kv_indices, last_t, kv_lens_t, 1)
        self.planned = True
        self.plans += 1
        self.decode_plans += self.decode

    def _plan(self, wrapper, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_lens, max_q,
              graph: bool = False) -> None:
        h, kvh, d = self.heads
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None and not copied.query():
            copied.synchronize()        # the GPU has not yet copied this wrapper's last plan out

        def full_plan():
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, h, kvh, d, self.page_size, causal=True,
                         window_left=self.window_left, sm_scale=self.scale, q_data_type=self.dtype,
                         kv_data_type=self.geometry.kv_dtype, non_blocking=True, seq_lens=kv_lens,
                         max_token_per_sequence=max_q)

        # FlashInfer JIT-compiles a kernel configuration on its first use (~30 s on a fresh machine).
        first = (h, kvh, d, getattr(wrapper, "_backend", None), graph) not in _FIRST_PLANS
        _FIRST_PLANS.add((h, kvh, d, getattr(wrapper, "_backend", None), graph))
        note = (timed(f"FlashInfer attention, {h} heads / {kvh} KV heads / head_dim {d}: first plan (JIT-compiles "
                      "kernels not yet cached)") if first else contextlib.nullcontext())
        with note:
            if graph and self.replan is not None:      # a decode graph's step: fixed buffers, one query per row
                self.replan.plan(wrapper, full_plan, (h, kvh, d, self.page_size, self.window_left), qo_indptr,
                                 kv_indptr, kv_indices, kv_last_page_len, kv_lens)
            else:
                full_plan()
        if self.workspace.is_cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._plan_copied[id(wrapper)] = ev

    def bind_kv_scales(self, host_scales: dict[int, tuple[float, float]]) -> None:
        self.kv_scale_host = host_scales

    def run(self, q: torch.Tensor, kv: torch.Tensor, last_only: bool = False, layer: int = -1) -> torch.Tensor:
        """This step's attention for ``q`` [rows, heads, D] on the plan made by ``prepare``
        (``layer``: the owner of ``kv``, whose scales an fp8 pool is read with)."""
        if not self.planned:
            raise RuntimeError("gemma4opt.paged_attention_flashinfer: no plan for this step (the paged cache's step "
                               "was not begun on this model)")
        scales = {}
        if self.fp8:
            host = self.kv_scale_host
            if layer not in host:
                raise RuntimeError(f"gemma4opt.paged_attention_flashinfer: no KV scales for layer {layer} of this fp8 "
                                   "pool (the backend was not given its StepContext's)")
            scales = dict(k_scale=host[layer][0], v_scale=host[layer][1])
        if last_only and not self.decode:
            if self.last_wrapper is None:
                raise RuntimeError("gemma4opt.paged_attention_flashinfer: a last-token query at prefill, but this "
                                   "model has no KV-shared layers to plan it for")
            return self.last_wrapper.run(q, kv, **scales)
        return self.current.run(q, kv, **scales)


@torch.library.custom_op("gemma4opt::paged_attention_flashinfer", mutates_args=())
def paged_attention_flashinfer(q: torch.Tensor, kv: torch.Tensor, token_index: torch.Tensor,
                               handle: int, layer: int = -1) -> torch.Tensor:
    backend = _BACKENDS.get(handle)
    if backend is None:
        raise RuntimeError("gemma4opt.paged_attention_flashinfer: its backend is gone (the model was optimized "
                           "again or freed)")
    B, Tq = q.shape[:2]
    if Tq == 1:
        # Decode, or a KV-shared layer at prefill (HF runs those on the last token only): one
        # query per sequence, always a real token. Shapes alone tell which plan (no device read).
        flat = backend.run(q.reshape(B, *q.shape[2:]).contiguous(), kv, last_only=token_index.shape[0] != B,
                           layer=layer)
        return flat.reshape(q.shape)
    if token_index.shape[0] > B * Tq:
        raise ValueError(f"gemma4opt.paged_attention_flashinfer: {Tq} query rows per sequence but the step has more "
                         "tokens; queries must be the whole step or its last token (logits_to_keep=1)")
    flat = backend.run(q.reshape(B * Tq, *q.shape[2:]).index_select(0, token_index).contiguous(), kv, layer=layer)
    out = torch.zeros(B * Tq, *q.shape[2:], dtype=q.dtype, device=q.device)
    out.index_copy_(0, token_index.long(), flat.to(q.dtype))
    return out.reshape(q.shape)


@paged_attention_flashinfer.register_fake
def _(q, kv, token_index, handle, layer=-1):
    return torch.empty_like(q)


def workspace_bytes(geometries, max_batch: int, num_sms: int) -> int:
    """Float scratch FlashInfer needs for decode graphs of up to ``max_batch`` rows.

    In CUDA-graph mode its planner always splits KV and sizes the partial outputs for a padded
    grid: max(2 CTAs per SM / kv heads, ceil(rows * group / tile) + rows - 1) query tiles of
    ``tile`` rows per q head, fp32 ``head_dim`` values plus one LSE each (FlashInfer 0.6's
    PrefillSplitQOKVIndptr / PrefillPlan). At 512 rows of the 31b's full layers that is ~0.8 GB;
    a fixed 256 MB overflowed there. Kinds run one after another and share the buffer.
    """
    need = 0
    for heads, kv_heads, head_dim in geometries:
        group = heads // kv_heads
        tile = 16 if group <= 16 else 64
        padded = max(2 * num_sms // kv_heads, -(-max_batch * group // tile) + max_batch - 1)
        need = max(need, heads * padded * tile * (head_dim + 1) * 4)
    return max(WORKSPACE_BYTES, need + (1 << 20))      # + alignment slack


def flashinfer_backends(geometries: dict[str, KindGeometry], max_pages: int, max_batch: int,
                        fast_replan: bool = True) -> dict[str, FlashInferBackend]:
    """One backend per attention kind, sharing one float workspace sized for decode graphs of up
    to ``max_batch`` rows."""
    dev = torch.device(next(iter(geometries.values())).device)
    # Off CUDA (the CPU tests, FlashInfer stood in): a small GPU, so the split grid stays small.
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    shapes = [(g.heads, g.kv_heads, g.head_dim) for g in geometries.values()]
    workspace = torch.empty(workspace_bytes(shapes, max_batch, sms), dtype=torch.uint8, device=dev)
    return {kind: FlashInferBackend(g, workspace, max_pages=max_pages, fast_replan=fast_replan)
            for kind, g in geometries.items()}
