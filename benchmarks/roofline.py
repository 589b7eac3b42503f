"""Bytes a decode step must move (weights + KV) and the device's measured copy bandwidth."""
from __future__ import annotations

import re
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
    return sum(n for _, n in _weight_reads(model, batch))


def weight_bytes_per_layer(model, batch: int) -> dict[int, int]:
    """weight_bytes_per_step's bytes of each decoder layer (``...layers.<i>.`` in the name), by layer index."""
    out: dict[int, int] = {}
    for name, nbytes in _weight_reads(model, batch):
        i = layer_index(name)
        if i is not None:
            out[i] = out.get(i, 0) + nbytes
    return out


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to (``model.language_model.layers.3.mlp...`` -> 3), or None."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _weight_reads(model, batch: int):
    """(name, bytes one decode step reads of it) for every parameter and fp8 weight buffer."""
    cfg = model.config.get_text_config()
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
        yield name, nbytes


def _is_fp8_module(model, buffer_name: str) -> bool:
    from gemma4opt.ops.fp8_weights import Fp8Experts, Fp8Linear

    return "." in buffer_name and isinstance(model.get_submodule(buffer_name.rsplit(".", 1)[0]), (Fp8Linear, Fp8Experts))


def kv_bytes_per_step(model, batch: int, context: int, kv_elem: int | None = None) -> int:
    """K and V bytes the attention of one decode step reads (sliding layers see at most the window);
    ``kv_elem``: bytes per KV element (1 for an fp8 pool), else the model dtype's."""
    return sum(kv_bytes_per_layer(model, batch, context, kv_elem))


def kv_bytes_per_layer(model, batch: int, context: int, kv_elem: int | None = None) -> list[int]:
    """kv_bytes_per_step's bytes of each layer (KV-shared layers read their producer's KV again)."""
    cfg = model.config.get_text_config()
    elem = kv_elem or next(model.parameters()).element_size()
    out = []
    for i, kind in enumerate(cfg.layer_types):
        lc = cfg.per_layer_config[i]
        seen = min(context, cfg.sliding_window) if kind == "sliding_attention" else context
        out.append(2 * batch * lc.num_key_value_heads * lc.head_dim * seen * elem)
    return out
