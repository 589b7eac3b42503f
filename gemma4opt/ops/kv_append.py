"""gemma4opt::kv_append — the paged KV cache's write, the same for every attention backend.

kv_append(kv, k, v, slot_mapping, token_index): write the step's real tokens (rows
``token_index`` of k/v flattened to [B*T, kv_heads, D]; left padding is skipped) into their slots
of the pool ``kv[num_pages, 2, page_size, kv_heads, D]`` (FlashInfer's NHD paged layout).
CPU: the reference below; CUDA: a Triton kernel (kernels/kv_append.py). The attention ops that
read the pool are the backends' (gemma4opt/paged/backends/).
"""
from __future__ import annotations

import torch


def kv_append_reference(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, kv_heads, D]) into their slots, in place."""
    ps = kv.shape[2]
    page, off = slot_mapping // ps, slot_mapping % ps
    kv[page, 0, off] = k.to(kv.dtype)
    kv[page, 1, off] = v.to(kv.dtype)


def kv_append_rows_reference(kv, k, v, slot_mapping, token_index) -> None:
    """The CPU path and the Triton kernel's oracle: gather the real rows, store them by slot."""
    flat_k = k.reshape(-1, k.shape[-2], k.shape[-1]).index_select(0, token_index)
    flat_v = v.reshape(-1, v.shape[-2], v.shape[-1]).index_select(0, token_index)
    kv_append_reference(kv, flat_k, flat_v, slot_mapping)


@torch.library.custom_op("gemma4opt::kv_append", mutates_args=("kv",))
def kv_append(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              token_index: torch.Tensor) -> None:
    kv_append_rows_reference(kv, k, v, slot_mapping, token_index)


@kv_append.register_fake
def _(kv, k, v, slot_mapping, token_index):
    return None


@kv_append.register_kernel("cuda")
def _(kv, k, v, slot_mapping, token_index):
    from gemma4opt.kernels.kv_append import kv_append_triton

    kv_append_triton(kv, k, v, slot_mapping, token_index)
