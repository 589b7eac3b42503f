"""On the GPU machine: the Triton split-KV decode kernel at the real models' geometries, against
the reference, with lengths below, at and past the sliding window, across batch sizes whose
split counts differ (1 row: many splits; 64 rows: one)."""
import numpy as np
import pytest
import torch

from gemma4opt.paged.tables import PagedSequences, PagePool
from gemma4opt.ops.kv_append import kv_append_reference
from gemma4opt.paged.backends.reference import paged_attention_reference
from gemma4opt.kernels.paged_decode import decode_splits, paged_decode_triton

pytestmark = pytest.mark.gpu


def _page_lists(seqs, lens, window, ps):
    """The reference's page lists of what the kernel should see: each row's visible pages, in order."""
    indptr, indices, last, start = [0], [], [], []
    for r, n in enumerate(lens):
        first = max(int(n) - window, 0) // ps if window else 0
        pages = [int(seqs.table[r, j % seqs.ring]) for j in range(first, -(-int(n) // ps))]
        indices += pages
        indptr.append(len(indices))
        last.append(int(n) - (first + len(pages) - 1) * ps)
        start.append(first * ps)
    return dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, kv_start=start,
                qo_indptr=list(range(len(lens) + 1)), seq_lens=[int(n) for n in lens])


@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(256, 32, 16, 1024), (512, 32, 4, None),
                                                             (256, 8, 2, 512), (512, 16, 2, None)])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_decode_kernel_matches_reference_at_real_dims(head_dim, heads, kv_heads, window, batch):
    torch.manual_seed(batch)
    ps, dtype, dev = 16, torch.bfloat16, "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_len = 1400
    pool = PagePool(batch * (max_len // ps + 2), ps)
    seqs = PagedSequences(pool, max_batch=batch, max_seq_len=max_len, window=window, max_step_tokens=max_len)
    kv = torch.zeros(pool.num_pages, 2, ps, kv_heads, head_dim, device=dev, dtype=dtype)
    rows = np.arange(batch)
    g = np.random.default_rng(batch)
    lens = g.integers(1, 1300, batch)
    lens[0] = 1300 if batch > 1 else 1030          # past the window of 1024 (or 512)
    meta = seqs.step(rows, lens)
    n = int(lens.sum())
    kv_append_reference(kv, torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype),
                        torch.randn(n, kv_heads, head_dim, device=dev, dtype=dtype),
                        torch.from_numpy(meta.slot_mapping).to(dev))
    for step in range(3):                          # decode steps: each appends one token, then attends
        new_lens, slots = seqs.table_step(rows)
        kv_append_reference(kv, torch.randn(batch, kv_heads, head_dim, device=dev, dtype=dtype),
                            torch.randn(batch, kv_heads, head_dim, device=dev, dtype=dtype),
                            torch.from_numpy(slots).to(dev))
        t = {k: torch.tensor(v).to(dev) for k, v in _page_lists(seqs, new_lens, window, ps).items()}
        q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
        table = torch.from_numpy(seqs.table).to(dev)
        got = paged_decode_triton(q, kv, table, torch.from_numpy(new_lens.astype(np.int32)).to(dev), window or 0, 1.0,
                                  sms)
        want = paged_attention_reference(q.float(), kv.float(), t["kv_indptr"], t["kv_indices"].long(),
                                         t["kv_last_page_len"], t["kv_start"], t["qo_indptr"], t["seq_lens"], window,
                                         1.0)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    print(f"D={head_dim} G={heads // kv_heads} batch {batch}: {decode_splits(batch, kv_heads, sms)} splits ok")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("window", [0, 64])
def test_step_tokens_appended_by_the_previous_kernel_are_read_after_its_end(tokens, window, fp8):
    # In a CUDA graph with programmatic dependent launch the decode kernel starts while kv_append, the kernel
    # before it, still runs. Every replay appends new values at the same slots: a new token read before its
    # wait would hold the previous replay's values. (On an H100 a kernel reading them before the wait
    # still passed: the test shows the values right, not the ordering proved.)
    from gemma4opt.kernels import _util
    from gemma4opt.kernels.kv_append import kv_append_triton

    torch.manual_seed(tokens + window)
    ps, kvh, heads, D, dev, dt = 16, 2, 8, 256, "cuda", torch.bfloat16
    lens = [37, 130, 16 + tokens]                  # after the step; a new token opening a page
    B, ring = len(lens), max(-(-n // ps) for n in lens)
    table = torch.randperm(B * ring, device=dev).view(B, ring).to(torch.int32)
    kv = torch.randn(B * ring, 2, ps, kvh, D, device=dev, dtype=dt)
    scales = torch.tensor([0.5, 2.0], device=dev) if fp8 else None
    if fp8:
        kv = kv.to(torch.float8_e4m3fn)
    pos = torch.tensor([n - tokens + t for n in lens for t in range(tokens)], device=dev)
    slots = (table.repeat_interleave(tokens, 0).gather(1, (pos // ps)[:, None].int())[:, 0] * ps + pos % ps).int()
    rows = torch.tensor([n - tokens + t + 1 for n in lens for t in range(tokens)], device=dev, dtype=torch.int32)
    k_new, v_new = (torch.empty(B, tokens, kvh, D, device=dev, dtype=dt) for _ in range(2))
    q = torch.empty(B * tokens, heads, D, device=dev, dtype=dt)
    index = torch.arange(B * tokens, device=dev, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def step():
        kv_append_triton(kv, k_new, v_new, slots, index, scales)
        return paged_decode_triton(q, kv, table, rows, window, 1.0, sms, tokens=tokens, kv_scale=scales)

    assert _util.pdl_flags(q).get("PDL"), "needs a GPU with programmatic dependent launch (sm_90+)"
    for t in (k_new, v_new, q):
        t.normal_()
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(10):
        for t in (k_new, v_new, q):
            t.normal_()
        graph.replay()
        want = paged_decode_triton(q, kv, table, rows, window, 1.0, sms, tokens=tokens, kv_scale=scales)
        assert torch.equal(out, want)
