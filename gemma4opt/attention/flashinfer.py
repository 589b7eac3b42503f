"""FlashInfer paged attention for CUDA: one wrapper per attention kind, planned once per step.

The step's page metadata exists on the host first (attention/pages.py), so ``plan`` gets host
int32 tensors for qo_indptr, kv_indptr and last_page_len (FlashInfer moves them to the CPU
otherwise: a device->host sync per plan) and the device copy of kv_indices from the step's one
staged copy. Every layer of that kind then runs on the same plan; KV-shared layers read their
producer's pages with it. Sliding and full layers need separate wrappers anyway: FlashInfer
bakes ``window_left`` into the plan. Head dims: 256 (prefill on FA3 on Hopper) and 512 (FA2; FA3 has no
512). ``window_left = window - 1`` matches HF's bound (a query sees itself and window-1 keys back).

Registered under an int key so the custom op (which takes no Python objects) can find its plan.

FlashInfer's plan() stages its schedule in a pinned buffer per wrapper and copies it to the GPU
asynchronously; a plan() of the next step must not overwrite that buffer before the copy ran.
The host runs ahead of the GPU (HF's stop check is deferred, runtime/stop_check.py; decode
graphs are replayed without syncs), so each wrapper records an event after its plan and the next
plan of that wrapper waits on it if, and only if, the GPU has not reached it yet.
"""
from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch

from gemma4opt.progress import timed

_PLANS: dict[int, "KindPlan"] = {}
_keys = itertools.count()
_FIRST_PLANS: set[tuple] = set()   # kernel configurations planned once in this process
WORKSPACE_BYTES = 256 << 20     # FlashInfer's float scratch, at least (prefill's split-KV partials)


def available() -> str | None:
    """None when FlashInfer can be imported, else the reason."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/JIT setup error raised at import
        return f"flashinfer not importable ({type(e).__name__}: {e}); pip install 'gemma4opt[gpu]'"
    return None


class KindPlan:
    """One attention kind's FlashInfer wrapper and the geometry it was built for."""

    def __init__(self, workspace, num_qo_heads, num_kv_heads, head_dim, page_size, window, dtype, scale=1.0,
                 last_token_layers=False, max_pages=0, fast_replan: bool = True, decode_kernel: str = "flashinfer",
                 num_sms: int = 132):
        import flashinfer

        from gemma4opt.attention.flashinfer_replan import FastReplan

        self.key = next(_keys)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size, self.window, self.dtype, self.scale = page_size, window, dtype, scale
        self.window_left = (window - 1) if window else -1     # HF's bound: the query and window-1 keys back
        self.workspace, self.max_pages = workspace, max_pages
        # Prefill: FA3 on Hopper where it exists (head_dim <= 256). Decode: FA2, whose planner
        # splits each sequence's KV across CTAs; FA3 runs one query row per CTA over the whole
        # sequence: measured on an H200 (benchmarks/bench_attention.py, head_dim 256, batch 32,
        # 4k context) 322 µs (39 % of copy bandwidth) against FA2's 142 µs (89 %).
        self.backend = "fa2" if head_dim > 256 else "auto"
        self._new = flashinfer.BatchPrefillWithPagedKVCacheWrapper

        def wrapper(backend=self.backend):
            return self._new(workspace, kv_layout="NHD", backend=backend)

        self.wrapper = wrapper()
        self.decode_wrapper = wrapper("fa2")
        # KV-shared layers at prefill: one query (the last token) per sequence over the same pages.
        self.last_wrapper = wrapper("fa2") if last_token_layers else None
        # Decode graphs: one wrapper per batch bucket, its index buffers at fixed addresses (the
        # graph reads them); plan() before each replay rewrites their contents.
        self.graph_wrappers: dict[int, object] = {}
        self.current = self.wrapper
        self._plan_copied: dict[int, torch.cuda.Event] = {}   # wrapper -> event after its plan's copy
        # Decode graphs' replans skip FlashInfer's Python plan() (self-checked; attention/flashinfer_replan.py).
        self.replan = FastReplan() if fast_replan else None
        # Decode steps on gemma4opt's Triton kernel instead (kernels/paged_decode.py): no plan at all.
        from gemma4opt.kernels.paged_decode import supported

        want = decode_kernel == "triton" or (decode_kernel == "auto" and head_dim <= 256)
        self.triton_unsupported = supported(num_qo_heads, num_kv_heads, head_dim) if want else None
        self.triton_decode = want and self.triton_unsupported is None
        self.num_sms = num_sms
        self.triton = False          # this step: the Triton kernel (set by use_triton, cleared by plan)
        self.triton_steps = 0
        self.decode = False
        self.planned = False
        _PLANS[self.key] = self

    def use_triton(self) -> None:
        """This step is a decode step: the Triton kernel reads the page table, nothing to plan."""
        self.triton = self.decode = self.planned = True
        self.triton_steps += 1

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
        self.triton = False
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

    def _plan(self, wrapper, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_lens, max_q,
              graph: bool = False) -> None:
        h, kvh, d = self.heads
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None and not copied.query():
            copied.synchronize()        # the GPU has not yet copied this wrapper's last plan out

        def full_plan():
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, h, kvh, d, self.page_size, causal=True,
                         window_left=self.window_left, sm_scale=self.scale, q_data_type=self.dtype,
                         kv_data_type=self.dtype, non_blocking=True, seq_lens=kv_lens, max_token_per_sequence=max_q)

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

    def release(self) -> None:
        _PLANS.pop(self.key, None)


def uses_triton(plan_key: int) -> bool:
    """Whether this step runs the Triton kernel for this plan's kind (set by the step, host only)."""
    plan = _PLANS.get(plan_key)
    return plan is not None and plan.planned and plan.triton


def run_planned(plan_key: int, q: torch.Tensor, kv: torch.Tensor, window: int, scale: float,
                last_only: bool = False, pages: tuple | None = None, tokens: int = 1) -> torch.Tensor:
    """This step's attention for ``q`` [rows, heads, D]; ``pages`` = (page table, seq_lens) on the
    device, which the Triton decode kernel reads (StepContext.begin_step stages them); ``tokens``:
    query rows per sequence there (a graphed multi-token step, StepContext.begin_token_step)."""
    plan = _PLANS.get(plan_key)
    if plan is None or not plan.planned:
        raise RuntimeError(f"gemma4opt.paged_attention: no FlashInfer plan {plan_key} for this step (the paged "
                           "cache's step was not begun on this model)")
    if (window if window > 0 else None) != plan.window or scale != plan.scale:
        raise RuntimeError(f"gemma4opt.paged_attention: layer (window {window}, scale {scale}) does not match its "
                           f"kind's plan (window {plan.window}, scale {plan.scale})")
    if last_only and not plan.decode:
        if plan.last_wrapper is None:
            raise RuntimeError("gemma4opt.paged_attention: a last-token query at prefill, but this model has no "
                               "KV-shared layers to plan it for")
        return plan.last_wrapper.run(q, kv)
    if plan.triton:
        from gemma4opt.kernels.paged_decode import paged_decode_triton

        return paged_decode_triton(q, kv, *pages, window=max(window, 0), scale=scale, num_sms=plan.num_sms,
                                   tokens=tokens)
    return plan.current.run(q, kv)


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


def build_plans(text_config, page_size: int, device, dtype, max_pages: int = 0,
                fast_replan: bool = True, max_batch: int = 1, decode_kernel: str = "flashinfer") -> dict[str, KindPlan]:
    """One plan per attention kind present in the model, sharing one float workspace sized for
    decode graphs of up to ``max_batch`` rows."""
    kinds = {}
    for layer, kind in enumerate(text_config.layer_types):
        kinds.setdefault(kind, layer)
    geometries = [(text_config.num_attention_heads, text_config.per_layer_config[layer].num_key_value_heads,
                   text_config.per_layer_config[layer].head_dim) for layer in kinds.values()]
    dev = torch.device(device)
    # Off CUDA (the CPU tests, Triton interpreted): a small GPU, so the split grid stays small.
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    workspace = torch.empty(workspace_bytes(geometries, max_batch, sms), dtype=torch.uint8, device=device)
    plans = {}
    for kind, layer in kinds.items():
        lc = text_config.per_layer_config[layer]
        window = text_config.sliding_window if kind == "sliding_attention" else None
        plans[kind] = KindPlan(workspace, text_config.num_attention_heads, lc.num_key_value_heads, lc.head_dim,
                               page_size, window, dtype,
                               last_token_layers=bool(getattr(text_config, "num_kv_shared_layers", 0)),
                               max_pages=max_pages, fast_replan=fast_replan, decode_kernel=decode_kernel,
                               num_sms=sms)
    return plans
