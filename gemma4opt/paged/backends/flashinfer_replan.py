"""Decode replans of FlashInfer's graph-mode wrappers without its Python ``plan()``.

Why: FlashInfer's ``plan()`` spends ~0.4 ms per call at batch 64 on an H200's host in Python
(argument handling, a builtin ``max()`` over a host tensor element by element, small copies)
around a C++ planner, and a decode step plans once per attention kind. Once a graph-mode wrapper
has had one full ``plan()`` (which picks its kernel module and fixes its buffers and sizes), a
decode step of the same bucket changes only page lists and lengths: this writes them into the
wrapper's fixed buffers and calls the same C++ planner with the arguments ``plan()`` passes
(FlashInfer 0.6, FA2 in CUDA-graph mode, read from its source).

Self-check, so another FlashInfer version costs speed, never correctness: the first plan of
each wrapper is FlashInfer's ``plan()``, then the fast one on the same step, and the two are
compared by what each left for the GPU (the plan info and the planner's host staging buffer, which the async copy
moves to the device). Unequal, or an error: the fast path is off for that wrapper (the reason is
counted) and the full ``plan()`` runs again, so its data is what the GPU copies last.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

# Where FlashInfer keeps what a replan touches; a wrapper without all of them never goes fast.
_ATTRS = ("_cached_module", "_plan_info", "_float_workspace_buffer", "_int_workspace_buffer",
          "_pin_memory_int_workspace_buffer", "_paged_kv_indptr_buf", "_paged_kv_indices_buf",
          "_paged_kv_last_page_len_buf", "_kv_lens_buffer", "_max_total_num_rows", "_backend")


class FastReplan:
    """Per wrapper: unchecked, fast, or off (with the reason)."""

    def __init__(self):
        self._mode: dict[int, str] = {}
        self.fast_plans = 0
        self.full_plans = 0
        self.off: collections.Counter = collections.Counter()

    def plan(self, wrapper, full_plan, geometry, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
             kv_indices: torch.Tensor, last: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Plan one decode step of ``wrapper`` (CUDA-graph mode, one query per row).

        ``full_plan()`` runs FlashInfer's ``plan()`` for this step; ``geometry`` is
        (num_qo_heads, num_kv_heads, head_dim, page_size, window_left); the tensors are the
        step's host int32 arrays (``plan()``'s own arguments), kv_indices on the device.
        """
        key = id(wrapper)
        mode = self._mode.get(key)
        if mode == "fast":
            self._replan(wrapper, geometry, qo_indptr, kv_indptr, kv_indices, last, kv_lens)
            self.fast_plans += 1
            return
        full_plan()
        self.full_plans += 1
        if mode is not None:
            return                       # off for this wrapper
        missing = [a for a in _ATTRS if not hasattr(wrapper, a)]
        if missing:
            reason = f"this FlashInfer's wrapper lacks {missing}"
        elif wrapper._backend != "fa2" or not getattr(wrapper, "is_cuda_graph_enabled", False):
            reason = f"backend {wrapper._backend!r} or not in CUDA-graph mode"
        else:
            reason = self._check(wrapper, geometry, qo_indptr, kv_indptr, kv_indices, last, kv_lens)
            if reason is not None:
                full_plan()              # the fast one ran: FlashInfer's data must be what the GPU copies last
                self.full_plans += 1
        self._mode[key] = "fast" if reason is None else "off"
        if reason is not None:
            self.off[reason] += 1

    def _check(self, wrapper, geometry, qo_indptr, kv_indptr, kv_indices, last, kv_lens) -> str | None:
        want_info, pinned = wrapper._plan_info, wrapper._pin_memory_int_workspace_buffer
        want_staged = pinned.clone()
        try:
            self._replan(wrapper, geometry, qo_indptr, kv_indptr, kv_indices, last, kv_lens)
        except Exception as e:          # an API this code does not know
            return f"replan failed ({type(e).__name__}: {e})"
        if _as_list(wrapper._plan_info) != _as_list(want_info):
            return "plan info differs from FlashInfer's plan()"
        if not torch.equal(pinned, want_staged):
            return "planner's staged data differs from FlashInfer's plan()"
        return None

    @staticmethod
    def _replan(wrapper, geometry, qo_indptr, kv_indptr, kv_indices, last, kv_lens) -> None:
        h, kvh, d, page_size, window_left = geometry
        batch = len(last)
        wrapper._paged_kv_indptr_buf.copy_(kv_indptr, non_blocking=True)
        wrapper._paged_kv_last_page_len_buf.copy_(last, non_blocking=True)
        wrapper._paged_kv_indices_buf[: len(kv_indices)].copy_(kv_indices, non_blocking=True)
        wrapper._kv_lens_buffer[:batch].copy_(kv_lens, non_blocking=True)
        wrapper._max_kv_len = int(np.max(kv_lens.numpy())) if batch else 0
        wrapper._seq_lens_kv = kv_lens
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            qo_indptr, kv_indptr, kv_lens, wrapper._max_total_num_rows or batch, batch, h, kvh, page_size,
            True, d, d, True, window_left,
            -1, False, 0, 0)            # FA2: fixed_split_size, disable_split_kv, num_colocated_ctas, uniform_q_len

    def summary(self) -> str:
        text = f"{self.fast_plans} fast, {self.full_plans} full"
        if self.off:
            text += "; fast path off: " + "; ".join(f"{r} ({n})" for r, n in self.off.items())
        return text


def _as_list(info):
    try:
        return [int(x) for x in info]
    except TypeError:
        return info
