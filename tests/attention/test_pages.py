"""Host page tables: vectorized metadata against a per-sequence Python model, sliding frees, exhaustion."""
import numpy as np
import pytest

from gemma4opt.paged.tables import PagedSequences, PagePool, PoolExhausted


def _check(meta, seqs, rows, ps, window):
    """Every live page in order, last_page_len and slots agree with a simple per-sequence model."""
    for i, r in enumerate(rows):
        L = seqs.seq_len[r]
        first = seqs.first[r]
        pages = meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]]
        assert len(pages) == -(-L // ps) - first
        assert meta.kv_start[i] == first * ps
        assert meta.kv_last_page_len[i] == (L - 1) % ps + 1
        if window is not None:   # kept pages cover every token the step's first query can see
            assert first * ps <= max(L - (meta.qo_indptr[i + 1] - meta.qo_indptr[i]) - window + 1, 0)


@pytest.mark.parametrize("window", [None, 5, 8])
def test_random_steps_against_model(window):
    rng = np.random.default_rng(0)
    ps = 4
    pool = PagePool(200, ps)
    seqs = PagedSequences(pool, max_batch=6, max_seq_len=80, window=window)
    owner = {}   # page -> (row, logical) for pages currently held
    written = {}  # (row, pos) -> slot
    for step in range(12):
        rows = np.sort(rng.choice(6, size=rng.integers(1, 7), replace=False))
        new = rng.integers(1, 6, size=len(rows)) if step < 3 else np.ones(len(rows), dtype=int)
        before = {int(r): int(seqs.seq_len[r]) for r in rows}
        meta = seqs.step(rows, new)
        _check(meta, seqs, rows, ps, window)
        # slots: the new tokens land in distinct slots of pages this sequence holds
        tok = 0
        for i, r in enumerate(rows):
            pages = set(meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]].tolist())
            for p in range(before[int(r)], before[int(r)] + new[i]):
                slot = int(meta.slot_mapping[tok])
                assert slot // ps in pages and slot % ps == p % ps
                written[(int(r), p)] = slot
                tok += 1
        held = [set(meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]].tolist()) for i in range(len(rows))]
        for a in range(len(held)):
            for b in range(a + 1, len(held)):
                assert not held[a] & held[b], "two sequences share a page"
    assert pool.free_pages + seqs.pages_held() == 200
    seqs.release(np.arange(6))
    assert pool.free_pages == 200 and seqs.pages_held() == 0
    del owner, written


def test_sliding_kind_holds_bounded_pages_over_long_generation():
    ps, window = 16, 64
    pool = PagePool(64, ps)
    seqs = PagedSequences(pool, max_batch=2, max_seq_len=10_000, window=window, max_step_tokens=128)
    seqs.step(np.array([0, 1]), np.array([100, 30]))
    for _ in range(2000):
        seqs.step(np.array([0, 1]), np.array([1, 1]))
    per_seq = -(-(window + 1) // ps) + 1
    assert seqs.pages_held() <= 2 * per_seq
    assert seqs.seq_len[0] == 2100


def test_exhaustion_raises_before_anything_changes():
    pool = PagePool(3, 4)
    seqs = PagedSequences(pool, max_batch=2, max_seq_len=100)
    seqs.step(np.array([0]), np.array([8]))
    table_before = seqs.table.copy()
    with pytest.raises(PoolExhausted, match="kv_pool_pages.*nothing was overwritten"):
        seqs.step(np.array([1]), np.array([9]))
    assert pool.free_pages == 1 and (seqs.table == table_before).all() and seqs.seq_len[1] == 0


def test_max_seq_len_is_enforced():
    seqs = PagedSequences(PagePool(100, 4), max_batch=1, max_seq_len=10)
    with pytest.raises(ValueError, match="max_seq_len is 10"):
        seqs.step(np.array([0]), np.array([11]))


@pytest.mark.parametrize("window", [None, 7, 16, 33])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_decode_fast_path_and_list_edits_equal_full_rebuild(window, ps):
    """Advancing the last step's metadata in place (no page change) and editing the page lists
    (pages added / freed) give exactly what a full rebuild from the page table gives, across page
    boundaries, window frees, sequences of different lengths and a row set that changes."""
    fast = PagedSequences(PagePool(400, ps), max_batch=4, max_seq_len=300, window=window)
    slow = PagedSequences(PagePool(400, ps), max_batch=4, max_seq_len=300, window=window)
    rows = np.arange(3)
    for s in (fast, slow):
        s.step(rows, np.array([5, 17, 1]))
        s.step(np.array([3]), np.array([9]))
    ones = np.ones(3, dtype=np.int64)
    fast_steps = 0
    for step in range(120):
        if step == 60:
            rows = np.arange(3)                 # a new rows object: the fast path must rebuild
        left = fast._fast[1] if fast._fast is not None and fast._fast[0] is rows else 0
        a = fast.step(rows, ones, decode=True)
        slow._cached = None                     # the oracle regathers every live page
        b = slow.step(rows.copy(), ones)
        fast_steps += left > 0
        for f in ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_start", "qo_indptr", "slot_mapping", "seq_lens"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), (step, f)
        assert fast.pool.free_pages == slow.pool.free_pages
    if ps > 4:
        assert fast_steps > 20, "the fast path should serve steps where no page changes"


@pytest.mark.parametrize("window", [None, 6])
def test_table_steps_hold_what_the_kernel_reads_and_queue_every_table_write(window):
    """table_step (the Triton decode path) against step(): the same lengths; each slot is the
    token's page in the table; every token a query sees sits in a distinct page no one else holds
    or the pool has free; the queued writes replayed on a copy (the device mirror) give the
    table; dead sliding pages lag by at most one per row, and release returns everything."""
    ps, rows = 4, np.arange(5)
    a, b = (PagedSequences(PagePool(120, ps), max_batch=5, max_seq_len=70, window=window) for _ in range(2))
    b.track_updates = True
    mirror = b.table.copy()
    prompt = np.array([1, 9, 4, 16, 13])             # page boundaries crossed on different steps
    a.step(rows, prompt)
    b.step(rows, prompt)
    for step in range(50):
        m = a.step(rows, np.ones(5, dtype=np.int64), decode=True)
        lens, slots = b.table_step(rows)
        assert np.array_equal(lens, m.seq_lens), step
        assert np.array_equal(slots // ps, b.table[rows, ((lens - 1) // ps) % b.ring]), step
        assert np.array_equal(slots % ps, (lens - 1) % ps), step
        up = b.take_updates()
        if up is not None:
            mirror.reshape(-1)[up[0]] = up[1]
        assert np.array_equal(mirror, b.table), step
        seen = [p for r in rows for p in {int(mirror[r, (t // ps) % b.ring])
                                          for t in range(max(lens[r] - window, 0) if window else 0, lens[r])}]
        free = set(b.pool._free[:b.pool.free_pages].tolist())
        assert len(set(seen)) == len(seen) and not free & set(seen), step
        assert a.pool.free_pages - b.pool.free_pages <= 2 * len(rows), step   # one ahead + one dead, per row
    assert b.take_updates() is None
    b.release(rows)
    assert b.pool.free_pages == b.pool.num_pages


def test_table_steps_stop_at_max_seq_len():
    s = PagedSequences(PagePool(40, 4), max_batch=2, max_seq_len=11)
    rows = np.arange(2)
    s.step(rows, np.array([3, 7]))
    for _ in range(4):
        s.table_step(rows)
    with pytest.raises(ValueError, match="max_seq_len is 11"):
        s.table_step(rows)


def test_a_multi_token_step_after_table_steps_lists_only_the_pages_in_use():
    """table_step takes each row's next page ahead; a later step() (several tokens, e.g. appended
    by an assistant model) must neither list that page early nor allocate around it."""
    ps, rows = 4, np.arange(3)
    s = PagedSequences(PagePool(60, ps), max_batch=3, max_seq_len=60, window=None)
    s.step(rows, np.array([4, 6, 3]))
    for _ in range(5):
        s.table_step(rows)
    meta = s.step(rows, np.array([3, 1, 6]))
    _check(meta, s, rows, ps, None)
    assert np.array_equal(meta.seq_lens, [12, 12, 14])
    pages = [meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]] for i in rows]
    for i in rows:                       # each token's slot lies in its row's listed pages, in order
        pos = meta.seq_lens[i] - np.arange(3 if i == 0 else 1 if i == 1 else 6, 0, -1)
        slots = meta.slot_mapping[meta.qo_indptr[i]:meta.qo_indptr[i + 1]]
        assert np.array_equal(slots // ps, pages[i][pos // ps]) and np.array_equal(slots % ps, pos % ps)
    s.release(rows)
    assert s.pool.free_pages == s.pool.num_pages             # the page taken ahead is returned too


@pytest.mark.parametrize("window", [None, 6])
def test_table_tokens_mixed_with_decode_steps_and_crops(window):
    """Assisted decoding's pattern on the Triton path: verify steps of several tokens per row
    (table_tokens), rejected tokens cropped, decode steps between. Against step(): the same
    lengths, each slot the token's page in the table, every token any of the step's queries sees
    in a distinct live page, the mirror equal to the table, and everything back at release."""
    ps, rows = 4, np.arange(3)
    a, b = (PagedSequences(PagePool(200, ps), max_batch=3, max_seq_len=120, window=window) for _ in range(2))
    for s in (a, b):
        s.margin[rows] = 8 if window else 0        # a recording cache: crops stay inside the kept pages
    b.track_updates = True
    mirror = b.table.copy()
    prompt = np.array([3, 9, 14])
    a.step(rows, prompt)
    b.step(rows, prompt)
    rng = np.random.default_rng(0)
    for step in range(40):
        if step % 3 == 0:
            m = a.step(rows, np.ones(3, dtype=np.int64), decode=True)
            lens, slots = b.table_step(rows)
            lens, slots, T = lens[:, None], slots[:, None], 1
        else:
            T = int(rng.integers(2, 6))
            m = a.step(rows, np.full(3, T))
            lens, slots = b.table_tokens(rows, T)
        assert np.array_equal(lens[:, -1], m.seq_lens), step
        assert np.array_equal(lens, m.seq_lens[:, None] - T + 1 + np.arange(T)), step
        assert np.array_equal(slots // ps, b.table[rows[:, None], ((lens - 1) // ps) % b.ring]), step
        assert np.array_equal(slots % ps, (lens - 1) % ps), step
        up = b.take_updates()
        if up is not None:
            mirror.reshape(-1)[up[0]] = up[1]
        assert np.array_equal(mirror, b.table), step
        lo = lens[:, 0] - (window or 10**6)
        seen = [p for r in rows for p in {int(mirror[r, (t // ps) % b.ring]) for t in range(max(lo[r], 0), lens[r, -1])}]
        free = set(b.pool._free[:b.pool.free_pages].tolist())
        assert len(set(seen)) == len(seen) and not free & set(seen), step
        if T > 1 and step % 2:                     # some of the draft rejected
            n = int(rng.integers(1, T))
            a.crop(rows, n)
            b.crop(rows, n)
    b.release(rows)
    assert b.pool.free_pages == b.pool.num_pages
