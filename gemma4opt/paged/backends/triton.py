"""The Triton decode backend: decode steps (and graphed steps of a few tokens per sequence) on
gemma4opt's split-KV kernel (kernels/paged_decode.py), reading the kind's device page table and
one length per query row. No host plan: a decode graph replays it as is.

``gemma4opt::paged_decode(q, kv, table, seq_lens, window, scale, kv_scale)``: q [B, T, H, D] holds T new
tokens of each of B sequences, run as B*T query rows; row r belongs to table row r // T and sees
the first ``seq_lens[r]`` tokens of its sequence, of which it is the last (so query t of a
sequence sees its past and its new tokens through t), and for sliding layers only the last
``window`` of them; an fp8 pool is read with the layer's ``kv_scale`` [k, v] (ops/kv_append.py).
CPU: ``paged_decode_reference`` (plain torch, the kernel's oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gemma4opt.ops.kv_append import KV_FP8, check_kv_scale, kv_dequantize
from gemma4opt.paged.backends.base import Backend, KindGeometry


def paged_decode_reference(q, kv, table, seq_lens, window: int, scale: float, tokens: int = 1,
                           kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, H, D] -> [rows, H, D]; the semantics of ``paged_decode_triton`` in plain torch
    (token p of table row b is in page ``table[b, (p // page_size) % ring]``)."""
    check_kv_scale(kv, kv_scale, "paged_decode")
    ks, vs = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    ps, kvh, ring = kv.shape[2], kv.shape[3], table.shape[1]
    out = torch.empty_like(q)
    for r, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(max(n - window, 0) if window > 0 else 0, n, device=q.device)
        pages = table[r // tokens, (pos // ps) % ring].long()
        keys, vals = kv[pages, 0, pos % ps], kv[pages, 1, pos % ps]          # [n, kv_heads, D]
        rep = q.shape[1] // kvh
        keys = kv_dequantize(keys, ks, q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)    # [heads, n, D]
        vals = kv_dequantize(vals, vs, q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
        out[r] = F.scaled_dot_product_attention(q[r][:, None], keys, vals, scale=scale)[:, 0]
    return out


@torch.library.custom_op("gemma4opt::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor, window: int,
                 scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    B, T = q.shape[:2]
    flat = q.reshape(B * T, *q.shape[2:])
    return paged_decode_reference(flat, kv, table, seq_lens, window, scale, tokens=T, kv_scale=kv_scale).reshape(q.shape)


@paged_decode.register_fake
def _(q, kv, table, seq_lens, window, scale, kv_scale=None):
    return torch.empty_like(q)


@paged_decode.register_kernel("cuda")
def _(q, kv, table, seq_lens, window, scale, kv_scale=None):
    from gemma4opt.kernels.paged_decode import paged_decode_triton

    check_kv_scale(kv, kv_scale, "paged_decode")
    B, T = q.shape[:2]
    flat = q.reshape(B * T, *q.shape[2:]).contiguous()
    return paged_decode_triton(flat, kv, table, seq_lens, window=max(window, 0), scale=scale,
                               num_sms=_sms(q.device), tokens=T, kv_scale=kv_scale).reshape(q.shape)


_SMS: dict[int, int] = {}


def _sms(device) -> int:
    """Multiprocessors of a CUDA device (asked once per device: the query costs µs)."""
    got = _SMS.get(device.index)
    if got is None:
        got = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return got


class TritonDecodeBackend(Backend):
    name = "triton"
    op_name = "paged_decode"
    reads_table = True

    def __init__(self, geometry: KindGeometry):
        super().__init__(geometry)
        self.steps = 0

    @classmethod
    def refuses(cls, geometry: KindGeometry) -> str | None:
        from gemma4opt.kernels.paged_decode import supported

        if geometry.kv_dtype not in (geometry.dtype, KV_FP8):
            return (f"KV pool in {geometry.kv_dtype}, queries in {geometry.dtype}: the kernel reads the queries' dtype "
                    "or fp8 (e4m3)")
        return supported(geometry.heads, geometry.kv_heads, geometry.head_dim)

    def prepare(self, host, dev, pad_to) -> None:
        self.steps += 1

    def attend(self, q, kv, meta, token_index, new_lens, window, scale, kv_scale=None, layer=-1):
        return torch.ops.gemma4opt.paged_decode(q, kv, meta["table"], meta["seq_lens"], window, scale, kv_scale)

    def stats(self):
        return {"steps": self.steps}
