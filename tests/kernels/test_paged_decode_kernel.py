import pytest
import torch

from gemma4opt.paged.backends.reference import paged_attention_reference
from gemma4opt.kernels.paged_decode import decode_splits, paged_decode_triton, supported
from tests.kernels.conftest import DEVICE, DTYPES, close


def _batch(lens, ps, kvh, D, dtype, window, g, ring=None):
    """A pool with shuffled pages, a ring-ordered page table per row (what attention/pages.py keeps:
    logical page j in slot j % ring; slots the window no longer sees hold other rows' pages, as
    after a free and reuse) and the same pages as FlashInfer's page lists, for the reference."""
    ring = ring or max(-(-n // ps) for n in lens) + 1
    pages = len(lens) * ring + 3
    kv = torch.randn(pages, 2, ps, kvh, D, generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[:len(lens) * ring].view(len(lens), ring).to(torch.int32)
    indptr, indices, last, start = [0], [], [], []
    for b, n in enumerate(lens):
        first = max(n - window, 0) // ps if window else 0
        live = list(range(first, -(-n // ps)))
        assert len(live) <= ring, "a row sees more pages than its ring holds"
        indices += [int(table[b, j % ring]) for j in live]
        indptr.append(len(indices))
        last.append(n - live[-1] * ps)
        start.append(first * ps)
    as32 = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    return kv, table, (as32(indptr), as32(indices), as32(last), torch.tensor(start))


CASES = [  # lens, page size, heads, kv heads, D, window, splits, ring
    ([1], 4, 2, 1, 16, 0, 1, None),                  # one token, group 2 padded to 16 rows
    ([37, 5, 64], 4, 4, 2, 32, 0, 3, None),          # ragged, splits with nothing left for some rows
    ([33, 9], 16, 8, 2, 16, 8, 4, 2),                # window: the last 8 tokens only; the ring wraps
    ([50, 17, 8], 4, 6, 3, 64, 8, 1, 4),             # window past, below and at it; group 2; ring wraps
    ([200], 16, 8, 1, 32, 0, 7, None),               # group 8 (full layers' shape), odd split count
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(dtype, case):
    lens, ps, H, kvh, D, window, splits, ring = case
    g = torch.Generator().manual_seed(sum(lens) + D)
    kv, table, (indptr, indices, last, start) = _batch(lens, ps, kvh, D, dtype, window, g, ring)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    scale = 0.7
    want = paged_attention_reference(q.float(), kv.float(), indptr, indices, last, start,
                                     torch.arange(len(lens) + 1, dtype=torch.int32), torch.tensor(lens),
                                     window or None, scale)
    lens32 = torch.tensor(lens, dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (q, kv, table, lens32)]
    got = paged_decode_triton(*dev, window=window, scale=scale, num_sms=4, splits=splits)
    close(got.cpu(), want, dtype)


def test_table_rows_past_the_batch_are_not_read():
    # A decode graph's table has max_batch_size rows; a smaller bucket reads only its own.
    g = torch.Generator().manual_seed(3)
    kv, table, _ = _batch([21, 1], 4, 2, 16, torch.float32, 0, g)
    q = torch.randn(2, 2, 16, generator=g)
    lens = torch.tensor([21, 1], dtype=torch.int32)
    big = torch.cat([table, torch.full((5, table.shape[1]), 10**6, dtype=torch.int32)])
    a = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv, big, lens)), window=0, scale=1.0, num_sms=4, splits=2)
    b = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv, table, lens)), window=0, scale=1.0, num_sms=4, splits=2)
    assert torch.equal(a, b)


def test_split_count_depends_on_shapes_only():
    assert decode_splits(1, 16, 132) == 17
    assert decode_splits(1, 4, 132) == 64          # capped
    assert decode_splits(64, 16, 132) == 1


def test_unsupported_geometry_is_named():
    assert "multiple" in supported(6, 4, 64)
    assert "power of two" in supported(8, 2, 48)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_triton(torch.zeros(1, 2, 8), torch.zeros(1, 2, 4, 1, 8), torch.zeros(1, 2, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), 0, 1.0, 4)


MULTI = [  # lens after the step, new tokens per sequence, page size, heads, kv heads, D, window, splits
    ([9, 30], 3, 4, 4, 2, 16, 0, 2),          # ragged, no window
    ([21, 7], 4, 4, 2, 1, 32, 6, 3),          # window smaller than the step's span; group 2
    ([5], 5, 4, 8, 2, 16, 0, 1),              # the whole sequence is new
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MULTI)
def test_multi_token_rows_match_causal_reference(dtype, case):
    # A step of T new tokens per sequence as T query rows per table row: query t sees the past
    # and the new tokens up to t (and, for sliding layers, only the last ``window`` of those).
    lens, T, ps, H, kvh, D, window, splits = case
    g = torch.Generator().manual_seed(sum(lens) + T)
    # Pages from where the step's first query's window starts: _batch keeps what the last one sees.
    kv, table, (indptr, indices, last, start) = _batch(lens, ps, kvh, D, dtype, window and window + T - 1, g)
    q = torch.randn(len(lens) * T, H, D, generator=g).to(dtype)
    qo = torch.arange(0, len(lens) * T + 1, T, dtype=torch.int32)
    want = paged_attention_reference(q.float(), kv.float(), indptr, indices, last, start, qo, torch.tensor(lens),
                                     window or None, 0.5)
    rows = torch.tensor([n - T + t + 1 for n in lens for t in range(T)], dtype=torch.int32)
    got = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv, table, rows)), window=window, scale=0.5, num_sms=4,
                              splits=splits, tokens=T)
    close(got.cpu(), want, dtype)


def test_multi_token_rows_must_fill_whole_steps():
    with pytest.raises(ValueError, match="whole number"):
        paged_decode_triton(torch.zeros(3, 2, 16), torch.zeros(1, 2, 4, 1, 16), torch.zeros(2, 2, dtype=torch.int32),
                            torch.ones(3, dtype=torch.int32), 0, 1.0, 4, tokens=2)


@pytest.mark.parametrize("case", CASES)
def test_table_reference_matches_the_page_list_reference(case):
    """The Triton backend's CPU op (``paged_decode_reference``, reading the ring table) computes what
    the reference backend computes from page lists."""
    from gemma4opt.paged.backends.triton import paged_decode_reference

    lens, ps, H, kvh, D, window, _, ring = case
    g = torch.Generator().manual_seed(sum(lens) + D + 1)
    kv, table, (indptr, indices, last, start) = _batch(lens, ps, kvh, D, torch.float32, window, g, ring)
    q = torch.randn(len(lens), H, D, generator=g)
    want = paged_attention_reference(q, kv, indptr, indices, last, start, torch.arange(len(lens) + 1, dtype=torch.int32),
                                     torch.tensor(lens), window or None, 0.7)
    got = paged_decode_reference(q, kv, table, torch.tensor(lens, dtype=torch.int32), window, 0.7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _fp8_pool(kv, scales):
    """kv quantized as kv_append stores it: k with scales[0], v with scales[1]."""
    from gemma4opt.ops.kv_append import kv_quantize

    s = torch.tensor(scales, dtype=torch.float32)
    return torch.stack([kv_quantize(kv[:, 0], s[0]), kv_quantize(kv[:, 1], s[1])], 1), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("cfg", [dict(f16=False), dict(f16=True), dict(f16=True, v_wide=False)],
                         ids=["dtype-dots", "f16-dots", "f16-dots-v-staged-fp8"])
def test_fp8_pool_matches_reference(dtype, case, scales, cfg):
    """An fp8 pool, dequantized with the layer's scales: the kernel (scales folded into the softmax
    scale and the output) against both references (which multiply the values). f16: bf16 queries'
    dots in fp16 (other dtypes ignore it); v_wide=False: the v tile staged in fp8, as before the
    kernel converted it first (the two must agree: only where the conversion runs differs)."""
    from gemma4opt.paged.backends.triton import paged_decode_reference

    lens, ps, H, kvh, D, window, splits, ring = case
    g = torch.Generator().manual_seed(sum(lens) + D + 5)
    kv, table, (indptr, indices, last, start) = _batch(lens, ps, kvh, D, torch.float32, window, g, ring)
    kv8, kv_scale = _fp8_pool(kv * 2, scales)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    lens32 = torch.tensor(lens, dtype=torch.int32)
    want = paged_attention_reference(q.float(), kv8, indptr, indices, last, start,
                                     torch.arange(len(lens) + 1, dtype=torch.int32), torch.tensor(lens),
                                     window or None, 0.7, kv_scale)
    table_ref = paged_decode_reference(q.float(), kv8, table, lens32, window, 0.7, kv_scale=kv_scale)
    torch.testing.assert_close(table_ref, want, rtol=1e-5, atol=1e-5)
    got = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv8, table, lens32)), window=window, scale=0.7, num_sms=4,
                              splits=splits, kv_scale=kv_scale.to(DEVICE), config=cfg)
    close(got.cpu(), want, dtype)


@pytest.mark.parametrize("case", MULTI[:2])
def test_fp8_pool_multi_token_rows(case):
    lens, T, ps, H, kvh, D, window, splits = case
    g = torch.Generator().manual_seed(sum(lens) + T + 9)
    kv, table, (indptr, indices, last, start) = _batch(lens, ps, kvh, D, torch.float32, window and window + T - 1, g)
    kv8, kv_scale = _fp8_pool(kv, (0.5, 0.25))
    q = torch.randn(len(lens) * T, H, D, generator=g).to(torch.bfloat16)
    qo = torch.arange(0, len(lens) * T + 1, T, dtype=torch.int32)
    want = paged_attention_reference(q.float(), kv8, indptr, indices, last, start, qo, torch.tensor(lens),
                                     window or None, 0.5, kv_scale)
    rows = torch.tensor([n - T + t + 1 for n in lens for t in range(T)], dtype=torch.int32)
    got = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv8, table, rows)), window=window, scale=0.5, num_sms=4,
                              splits=splits, tokens=T, kv_scale=kv_scale.to(DEVICE))
    close(got.cpu(), want, torch.bfloat16)


def test_fp8_pool_needs_scales():
    with pytest.raises(ValueError, match="needs kv_scale"):
        paged_decode_triton(torch.zeros(1, 2, 16), torch.zeros(1, 2, 4, 1, 16).to(torch.float8_e4m3fn),
                            torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0, 1.0, 4)
