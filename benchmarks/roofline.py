"""Bytes a decode step must move (weights + KV) and the device's measured copy bandwidth."""
from __future__ import annotations

import time

import torch


def copy_bandwidth(device: str, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted)."""
    if device == "cpu":
        nbytes = min(nbytes, 1 << 28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def weight_bytes_per_step(model, batch: int) -> int:
    """Parameter bytes one decode step reads: embedding rows are gathered (the tied lm_head reads the
    whole table once), and an MoE layer reads only the experts its tokens picked (expected count)."""
    cfg = model.config.get_text_config()
    total = 0
    # quantization="fp8": the projections and experts are e4m3 buffers (and fp32 scales) of
    # Fp8Linear / Fp8Experts modules.
    fp8 = [(n, b) for n, b in model.named_buffers() if _is_fp8_module(model, n)]
    # quantize_lm_head=True: the lm_head streams its fp8 copy, the bf16 table only gives the tokens' rows.
    from gemma4opt.ops.fp8_weights import fp8_lm_head

    table = model.get_input_embeddings().weight if fp8_lm_head(model) else None
    for name, p in [*model.named_parameters(), *fp8]:
        nbytes = p.numel() * p.element_size()
        if "embed_tokens_per_layer" in name or p is table:
            nbytes = batch * p.shape[1] * p.element_size()
        elif name.removesuffix("_scale").endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k = cfg.num_experts, cfg.top_k_experts
            nbytes = int(nbytes * (1 - (1 - k / e) ** batch))
        total += nbytes
    return total


def _is_fp8_module(model, buffer_name: str) -> bool:
    from gemma4opt.ops.fp8_weights import Fp8Experts, Fp8Linear

    return "." in buffer_name and isinstance(model.get_submodule(buffer_name.rsplit(".", 1)[0]), (Fp8Linear, Fp8Experts))


def kv_bytes_per_step(model, batch: int, context: int, kv_elem: int | None = None) -> int:
    """K and V bytes the attention of one decode step reads (sliding layers see at most the window);
    ``kv_elem``: bytes per KV element (1 for an fp8 pool), else the model dtype's."""
    cfg = model.config.get_text_config()
    elem = kv_elem or next(model.parameters()).element_size()
    total = 0
    for i, kind in enumerate(cfg.layer_types):
        lc = cfg.per_layer_config[i]
        seen = min(context, cfg.sliding_window) if kind == "sliding_attention" else context
        reads = 2 * batch * lc.num_key_value_heads * lc.head_dim * seen * elem
        total += reads  # KV-shared layers read their producer's KV again
    return total
