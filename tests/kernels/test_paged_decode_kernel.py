import pytest
import torch

from gemma4opt.attention.reference import paged_attention_reference
from gemma4opt.kernels.paged_decode import decode_splits, paged_decode_triton, supported
from tests.kernels.conftest import DEVICE, DTYPES, close


def _batch(lens, ps, kvh, D, dtype, window, g, dead_pages=None):
    """A pool with shuffled pages; sliding rows start at a page the window still sees."""
    dead_pages = dead_pages or [0] * len(lens)
    live = [-(-n // ps) - d for n, d in zip(lens, dead_pages)]
    pages = sum(live) + 3
    kv = torch.randn(pages, 2, ps, kvh, D, generator=g).to(dtype)
    perm = torch.randperm(pages, generator=g)[:sum(live)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(live).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([(n - 1) % ps + 1 for n in lens], dtype=torch.int32)
    start = torch.tensor([d * ps for d in dead_pages])
    return kv, indptr, perm, last, start


CASES = [  # lens, page size, heads, kv heads, D, window, splits
    ([1], 4, 2, 1, 16, 0, 1),                  # one token, MHA-like group 2 padded to 16 rows
    ([37, 5, 64], 4, 4, 2, 32, 0, 3),          # ragged, splits with nothing left for some rows
    ([33, 9], 16, 8, 2, 16, 8, 4),             # window: the last 8 tokens only
    ([50, 17, 8], 4, 6, 3, 64, 8, 1),          # window at, below and past it; group 2
    ([200], 16, 8, 1, 32, 0, 7),               # group 8 (full layers' shape), odd split count
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(dtype, case):
    lens, ps, H, kvh, D, window, splits = case
    g = torch.Generator().manual_seed(sum(lens) + D)
    # Sliding rows whose window has left whole pages behind hold only the live ones.
    dead = [max(n - window, 0) // ps if window else 0 for n in lens]
    kv, indptr, indices, last, start = _batch(lens, ps, kvh, D, dtype, window, g, dead)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    scale = 0.7
    want = paged_attention_reference(q.float(), kv.float(), indptr, indices, last, start,
                                     torch.arange(len(lens) + 1, dtype=torch.int32), torch.tensor(lens),
                                     window or None, scale)
    dev = [t.to(DEVICE) for t in (q, kv, indptr, indices, last)]
    got = paged_decode_triton(*dev, window=window, scale=scale, num_sms=4, splits=splits)
    close(got.cpu(), want, dtype)


def test_padding_rows_and_stale_indices_are_harmless():
    # Decode graphs pass kv_indices at a fixed capacity whose tail is stale: never read.
    g = torch.Generator().manual_seed(3)
    kv, indptr, indices, last, start = _batch([21, 1], 4, 2, 16, torch.float32, 0, g)
    q = torch.randn(2, 2, 16, generator=g)
    stale = torch.cat([indices, torch.full((50,), 10**6, dtype=torch.int32)])
    a = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv, indptr, stale, last)), window=0, scale=1.0,
                            num_sms=4, splits=2)
    b = paged_decode_triton(*(t.to(DEVICE) for t in (q, kv, indptr, indices, last)), window=0, scale=1.0,
                            num_sms=4, splits=2)
    assert torch.equal(a, b)


def test_split_count_depends_on_shapes_only():
    assert decode_splits(1, 16, 132) == 17
    assert decode_splits(1, 4, 132) == 64          # capped
    assert decode_splits(64, 16, 132) == 1


def test_unsupported_geometry_is_named():
    assert "multiple" in supported(6, 4, 64)
    assert "power of two" in supported(8, 2, 48)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_triton(torch.zeros(1, 2, 8), torch.zeros(1, 2, 4, 1, 8), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0, 1.0, 4)
