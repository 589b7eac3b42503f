"""The KV pool of one optimized model: which layers own KV, how many pages fit, and the tensors.

Per attention kind (sliding / full) the pool holds pages of ``page_size`` tokens for every layer
that owns KV (KV-shared layers read their producer's pages and own none), sized from free GPU
memory or the config (``pool_pages``).

``kv_cache_dtype="fp8"`` stores the pages in float8_e4m3fn (1 byte an element: a memory budget
holds twice the pages of bf16), with one fp32 scale for k and one for v per layer that owns KV
(``allocate_kv_scales``; ops/kv_append.py states the quantization and why 1.0 is a sound default
for Gemma-4).
"""
from __future__ import annotations

import torch

from gemma4opt.ops.kv_append import KV_FP8
from gemma4opt.tensor_parallel import local_kv_heads

CPU_KV_POOL_BYTES = 1 << 30      # the CPU pool's cap (the CPU paged path is a reference, not a server)


def kv_producers(cfg) -> dict[int, int]:
    """layer -> the layer whose KV it reads (itself, or for KV-shared layers the last owner of its type)."""
    first_shared = cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)
    out = {}
    for i, kind in enumerate(cfg.layer_types):
        if i < first_shared:
            out[i] = i
        else:
            out[i] = max(j for j in range(first_shared) if cfg.layer_types[j] == kind)
    return out


def free_device_memory(device) -> int | None:
    """Bytes free on a CUDA device (None elsewhere: no cap, host memory is not sized here),
    counting what PyTorch's caching allocator holds but does not use: it gives that back to CUDA
    before an allocation fails (after an HF generate at batch 128 x 2048 tokens, 100+ GiB of it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def kv_pool_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for Gemma4OptConfig.kv_cache_dtype: "auto" the model's, "fp8" e4m3."""
    return KV_FP8 if kv_cache_dtype == "fp8" else dtype


def token_bytes(cfg, kv_dtype: torch.dtype, shard=None) -> dict[int, int]:
    """layer -> bytes of one token's K and V in the pool, for the layers that own KV (this rank's
    KV heads with a tensor-parallel ``shard``)."""
    return {layer: 2 * local_kv_heads(cfg, layer, shard) * cfg.per_layer_config[layer].head_dim
            * kv_dtype.itemsize for layer, owner in kv_producers(cfg).items() if layer == owner}


def pool_pages(cfg, oc, kv_dtype, free_bytes: int | None, shard=None) -> int:
    """Pages per attention kind: kv_pool_pages; else max_batch_size full-length sequences, capped at
    kv_pool_fraction of ``free_bytes`` (GPU) or at CPU_KV_POOL_BYTES (``free_bytes`` None: CPU);
    without a fraction, refused with the sizes when they cannot fit in 90 % of ``free_bytes``.
    ``kv_dtype`` is the pool's (its itemsize counts: fp8 pages take half of bf16's bytes)."""
    if oc.kv_pool_pages:
        return oc.kv_pool_pages
    pages = oc.max_batch_size * (-(-oc.max_seq_len // oc.page_size) + 1)
    page_bytes = oc.page_size * sum(token_bytes(cfg, kv_dtype, shard).values())      # one page, every layer
    if free_bytes is None:
        return max(2, min(pages, CPU_KV_POOL_BYTES // page_bytes))
    if oc.kv_pool_fraction is not None:
        fit = int(oc.kv_pool_fraction * free_bytes // page_bytes)
        if fit < 2:           # the padding row's page and at least one more
            raise ValueError(f"Gemma4OptConfig.kv_pool_fraction={oc.kv_pool_fraction}: {fit} KV pages of "
                             f"{page_bytes / 2**20:.1f} MiB fit in {free_bytes / 2**30:.1f} GiB free; raise it")
        return min(pages, fit)
    if pages * page_bytes > 0.9 * free_bytes:
        raise ValueError(
            f"gemma4opt: the paged KV pools for max_batch_size={oc.max_batch_size} sequences of max_seq_len="
            f"{oc.max_seq_len} tokens need {pages * page_bytes / 2**30:.1f} GiB ({pages} pages of "
            f"{page_bytes / 2**20:.1f} MiB over every layer), more than 90 % of the {free_bytes / 2**30:.1f} GiB "
            "free; lower max_batch_size or max_seq_len, or set kv_pool_fraction (e.g. 0.8) or kv_pool_pages")
    return pages


def allocate_kv(cfg, n_pages: int, page_size: int, device, dtype, shard=None) -> dict[int, torch.Tensor]:
    """layer -> its pages ``[n_pages, 2, page_size, kv_heads, head_dim]`` (FlashInfer's NHD layout), for
    the layers that own KV."""
    kv = {}
    for layer, owner in kv_producers(cfg).items():
        if layer == owner:
            lc = cfg.per_layer_config[layer]
            kv[layer] = torch.zeros(n_pages, 2, page_size, local_kv_heads(cfg, layer, shard), lc.head_dim, device=device,
                                    dtype=dtype)
    return kv


def allocate_kv_scales(kv: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """layer -> its fp8 pages' scales [k, v] (fp32, on the pool's device), 1.0 each: see the module doc."""
    return {layer: torch.ones(2, dtype=torch.float32, device=t.device) for layer, t in kv.items()}
