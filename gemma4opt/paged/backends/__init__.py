"""Paged attention backends (base.py: the interface) and the one place they are chosen.

Per attention kind the model gets a prefill backend and a decode backend, once, when it is
optimized (``choose``):
- CPU: the reference for both (reference.py);
- CUDA: FlashInfer for prefill (flashinfer.py); for decode the Triton kernel (triton.py) when
  ``decode_kernel`` asks for it and it takes the geometry, else FlashInfer again. A kind
  FlashInfer cannot run on this GPU though the paged path can (``leaves_to_reference``: fp8
  pages at head_dim 512 before sm100) prefills on the reference and decodes on the Triton
  kernel. What was refused, and why, goes to the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gemma4opt.paged.backends.base import Backend, KindGeometry

KINDS = ("sliding_attention", "full_attention")


@dataclass
class KindBackends:
    prefill: Backend
    decode: Backend
    refused: dict[str, str] = field(default_factory=dict)     # backend name -> why it does not run this kind


def geometries(text_config, page_size: int, device, dtype, kv_dtype=None, shard=None) -> dict[str, KindGeometry]:
    """The geometry of each attention kind present in the model (from its first layer of that kind;
    this rank's heads with a tensor-parallel ``shard``)."""
    from gemma4opt.tensor_parallel import local_heads, local_kv_heads

    first = {}
    for layer, kind in enumerate(text_config.layer_types):
        first.setdefault(kind, layer)
    shared = bool(getattr(text_config, "num_kv_shared_layers", 0))
    out = {}
    for kind, layer in first.items():
        lc = text_config.per_layer_config[layer]
        out[kind] = KindGeometry(
            kind, local_heads(text_config, shard), local_kv_heads(text_config, layer, shard), lc.head_dim, page_size,
            text_config.sliding_window if kind == "sliding_attention" else None, dtype, kv_dtype or dtype,
            last_token_layers=shared, device=str(device))
    return out


def paged_unsupported(dtype, text_config, kv_dtype=None) -> str | None:
    """Why the CUDA paged path (FlashInfer prefill) cannot run this model (with a pool of
    ``kv_dtype``, default the model's), or None."""
    from gemma4opt.paged.backends.flashinfer import FlashInferBackend
    from gemma4opt.paged.backends.triton import TritonDecodeBackend

    for g in geometries(text_config, 1, "cuda", dtype, kv_dtype).values():
        why = FlashInferBackend.refuses(g)
        if why is not None:
            return why
        # Left to the reference at prefill, the kind decodes on the Triton kernel (the reference
        # reads page lists on the host: no decode graphs).
        left = FlashInferBackend.leaves_to_reference(g)
        if left and TritonDecodeBackend.refuses(g):
            return f"{left}, and the Triton decode kernel refuses it: {TritonDecodeBackend.refuses(g)}"
    return None


def choose(geoms: dict[str, KindGeometry], cuda: bool, decode_kernel: str, max_pages: int, max_batch: int,
           fast_replan: bool = True) -> dict[str, KindBackends]:
    """The backends of every kind. ``cuda`` False: the reference (CPU). ``decode_kernel``:
    "triton" (decode on the Triton kernel where it takes the geometry), "flashinfer", or "auto"
    (Triton for head dims up to 256)."""
    if not cuda:
        from gemma4opt.paged.backends.reference import ReferenceBackend

        out = {}
        for kind, g in geoms.items():
            ref = ReferenceBackend(g)
            out[kind] = KindBackends(ref, ref)
        return out
    from gemma4opt.paged.backends.flashinfer import FlashInferBackend, flashinfer_backends
    from gemma4opt.paged.backends.reference import ReferenceBackend
    from gemma4opt.paged.backends.triton import TritonDecodeBackend

    left = {kind: FlashInferBackend.leaves_to_reference(g) for kind, g in geoms.items()}
    flashinfer = {kind: g for kind, g in geoms.items() if not left[kind]}
    prefill = flashinfer_backends(flashinfer, max_pages, max_batch, fast_replan) if flashinfer else {}
    out = {}
    for kind, g in geoms.items():
        if left[kind]:
            ref = ReferenceBackend(g)
            out[kind] = KindBackends(ref, ref, {"flashinfer": left[kind]})
        else:
            out[kind] = KindBackends(prefill[kind], prefill[kind])
            if decode_kernel == "flashinfer":
                continue
            if decode_kernel == "auto" and g.head_dim > 256:
                out[kind].refused["triton"] = f"decode_kernel='auto' keeps head_dim {g.head_dim} on FlashInfer"
                continue
        why = TritonDecodeBackend.refuses(g)
        if why is None:
            out[kind].decode = TritonDecodeBackend(g)
        else:
            out[kind].refused["triton"] = why
    return out
