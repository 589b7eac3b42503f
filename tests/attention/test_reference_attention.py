"""Paged reference attention == dense causal (+ sliding window) attention over the same tokens."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gemma4opt.paged.tables import PagedSequences, PagePool
from gemma4opt.ops.kv_append import kv_append_reference
from gemma4opt.paged.backends.reference import paged_attention_reference


def _dense(q, k, v, q_pos, window):
    """HF-style: repeat KV heads, boolean causal/sliding mask over absolute positions, SDPA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    kp = torch.arange(k.shape[0])[None]
    mask = kp <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - kp) < window
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask[None, None], scale=1.0)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_prefill_then_decode_matches_dense(window, ps):
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    lens = [5, 13, 1]
    pool = PagePool(64, ps)
    seqs = PagedSequences(pool, max_batch=3, max_seq_len=64, window=window)
    kv = torch.zeros(64, 2, ps, Hkv, D)
    K = [torch.randn(40, Hkv, D) for _ in lens]
    V = [torch.randn(40, Hkv, D) for _ in lens]
    rows = np.arange(3)
    cur = [0, 0, 0]
    for step, new in enumerate([lens] + [[1, 1, 1]] * 9):
        meta = seqs.step(rows, np.array(new))
        tk = torch.cat([K[i][cur[i]:cur[i] + n] for i, n in enumerate(new)])
        tv = torch.cat([V[i][cur[i]:cur[i] + n] for i, n in enumerate(new)])
        kv_append_reference(kv, tk, tv, torch.from_numpy(meta.slot_mapping))
        q = torch.randn(sum(new), H, D)
        got = paged_attention_reference(q, kv, *(torch.from_numpy(a) for a in (
            meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, meta.kv_start, meta.qo_indptr, meta.seq_lens)),
            window=window, scale=1.0)
        off = 0
        for i, n in enumerate(new):
            L = cur[i] + n
            want = _dense(q[off:off + n], K[i][:L], V[i][:L], torch.arange(cur[i], L), window)
            torch.testing.assert_close(got[off:off + n], want, rtol=1e-5, atol=1e-5)
            off += n
            cur[i] = L
