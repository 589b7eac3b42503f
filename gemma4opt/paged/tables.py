"""Host-side KV page bookkeeping for one attention kind, vectorized over the batch (numpy only).

Each sequence holds its pages in a ring of ``ring`` slots: full-attention kinds get a ring as long
as the longest sequence, sliding kinds one just long enough for the window plus the step's
tokens, and pages that no query can see any more are returned to the pool every step. Page
metadata for a step (indptr, indices, last_page_len, slot mapping) comes out of a handful of
numpy calls whatever the batch size: no Python loop over requests, nothing read from a GPU.
Decode steps of the Triton kernel (``table_step``) need no page lists, only lengths and slots:
their page work runs once per ``page_size`` steps (a page ahead; sliding frees up to that late);
so do its steps of a few tokens per sequence (``table_tokens``: one query row per token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gemma4opt.paged.page_lists import edit_page_lists, ranks


class PoolExhausted(RuntimeError):
    """Raised before any page is handed out or any KV written."""


class PagePool:
    """A free list of page ids [0, num_pages)."""

    def __init__(self, num_pages: int, page_size: int, what: str = "KV pool"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"{what}: num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages, self.page_size, self.what = num_pages, page_size, what
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)   # a stack: pop from the end
        self._top = num_pages

    @property
    def free_pages(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray:
        if n > self._top:
            raise PoolExhausted(
                f"{self.what}: need {n} more KV pages of {self.page_size} tokens, {self._top} of {self.num_pages} "
                f"free. Raise Gemma4OptConfig.kv_pool_pages (or kv_pool_fraction), or lower max_batch_size / "
                f"max_seq_len; nothing was overwritten.")
        self._top -= n
        return self._free[self._top:self._top + n][::-1].copy()

    def free(self, ids: np.ndarray) -> None:
        n = len(ids)
        if n:
            self._free[self._top:self._top + n] = ids
            self._top += n


@dataclass
class StepMeta:
    """Page metadata of one step for a batch (host arrays; int32 except positions)."""

    kv_indptr: np.ndarray        # [B+1] live pages per sequence, prefix-summed
    kv_indices: np.ndarray       # [sum live pages] page ids, each sequence's in order
    kv_last_page_len: np.ndarray  # [B] tokens in each sequence's last page
    kv_start: np.ndarray         # [B] absolute position of each sequence's first live token
    qo_indptr: np.ndarray        # [B+1] new tokens per sequence, prefix-summed
    slot_mapping: np.ndarray     # [sum new tokens] page_id * page_size + offset, where each new token goes
    seq_lens: np.ndarray         # [B] tokens per sequence after this step


class PagedSequences:
    """Page tables of up to ``max_batch`` sequences for one attention kind."""

    def __init__(self, pool: PagePool, max_batch: int, max_seq_len: int, window: int | None = None,
                 max_step_tokens: int | None = None):
        ps = pool.page_size
        self.pool, self.window = pool, window
        full_ring = -(-max_seq_len // ps) + 1
        if window is None:
            self.ring = full_ring
        else:
            step = max_step_tokens if max_step_tokens is not None else max_seq_len
            self.ring = min(full_ring, -(-(window + step) // ps) + 2)
        self.table = np.zeros((max_batch, self.ring), dtype=np.int32)
        self.seq_len = np.zeros(max_batch, dtype=np.int64)      # tokens written
        self.first = np.zeros(max_batch, dtype=np.int64)        # first live logical page
        self.count = np.zeros(max_batch, dtype=np.int64)        # logical pages allocated so far (live + freed)
        self.active = np.zeros(max_batch, dtype=bool)
        # Tokens kept past the window per row (sliding kinds): a cache recording its past (HF's
        # activate_past_recording: assisted decoding, the deferred stop check) may crop that many
        # tokens off and still have every page its new end's window sees.
        self.margin = np.zeros(max_batch, dtype=np.int64)
        self.max_seq_len = max_seq_len
        self._cached = None   # (rows, kv_indptr, kv_indices, kv_start) while no page was added or freed
        self._fast = None     # (rows object, decode steps left without page changes, last StepMeta)
        # With track_updates, every table write is also queued as (flat index, page id) for a
        # device mirror of the table (take_updates); the Triton decode kernel reads that mirror.
        # The mirror may be a slice of a bigger tensor: index = base + row * stride + slot.
        self.track_updates = False
        self.mirror_base, self.mirror_stride = 0, self.ring
        self._updates: list[tuple[np.ndarray, np.ndarray]] = []
        self._table_fast = None   # table_step's (rows object, steps left, seq_lens, slots)

    def pages_held(self, rows=None) -> int:
        """Pages the active sequences (or those of ``rows``) hold."""
        if rows is None:
            return int((self.count - self.first)[self.active].sum())
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[self.active[rows]]
        return int((self.count[rows] - self.first[rows]).sum())

    def crop_check(self, rows, n: int) -> np.ndarray:
        """Raise when ``crop(rows, n)`` cannot be done; the active ones of ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[self.active[rows]]
        if n <= 0 or not len(rows):
            return rows
        ps = self.pool.page_size
        new_len = self.seq_len[rows] - n
        if (new_len < 0).any():
            raise ValueError(f"cannot drop {n} tokens: a sequence holds only {int(self.seq_len[rows].min())}")
        if self.window is not None:
            needed = np.maximum(new_len - (self.window - 1), 0) // ps     # first page the next query sees
            if (self.first[rows] > needed).any():
                raise ValueError(f"cannot drop {n} tokens: the sliding window of what is left reaches back into "
                                 "pages already freed (crop at most the tokens of the last step)")
        return rows

    def crop(self, rows, n: int) -> None:
        """Drop the last ``n`` tokens of each of ``rows`` (a rejected draft, an undone step): their
        lengths move back and the pages past the new ends go back to the pool, so the next step
        writes where the dropped tokens were. Refused (nothing changed) when a row holds fewer
        than ``n`` tokens, or when a sliding kind already freed pages the new end's window sees."""
        rows = self.crop_check(rows, n)
        if n <= 0 or not len(rows):
            return
        ps = self.pool.page_size
        new_len = self.seq_len[rows] - n
        first = self.first[rows]
        keep = np.maximum(-(-new_len // ps), first)
        count = self.count[rows]
        if (count > keep).any():
            self._release(rows, keep, count - keep)
        self.count[rows] = np.minimum(count, keep)
        self.seq_len[rows] = new_len
        self._cached = self._fast = self._table_fast = None

    def step(self, rows: np.ndarray, new_tokens: np.ndarray, decode: bool = False) -> StepMeta:
        """Append ``new_tokens[i]`` tokens to sequence ``rows[i]``; free what no query can see; return metadata.

        ``decode``: one token per sequence, and ``rows`` is the same array object as the last
        step's. Then, while no sequence crosses a page boundary or drops a page out of its
        window (15 of 16 steps at page size 16), the last step's metadata is advanced in place
        (slot, last_page_len and seq_lens + 1): a handful of numpy calls, whatever the batch.
        The returned arrays are valid until the next step (callers copy them: staging, plan).
        """
        fast = self._fast
        if decode and fast is not None and fast[0] is rows and fast[1] > 0:
            self._fast = (rows, fast[1] - 1, fast[2])
            m = fast[2]
            self.seq_len[rows] += 1
            m.kv_last_page_len += 1
            m.slot_mapping += 1
            m.seq_lens += 1
            return m
        rows_in = rows
        rows = np.asarray(rows, dtype=np.int64)
        meta = self._decode_step(rows) if decode else None
        if meta is not None:
            self._fast = (rows_in, self._fast_steps(rows, meta.seq_lens), meta)
            return meta
        new = np.asarray(new_tokens, dtype=np.int64)
        old_len = self.seq_len[rows]
        new_len = old_len + new
        drop, grow_ids = self._append(rows, old_len, new_len)
        meta = self._meta(rows, old_len, new, new_len, drop, grow_ids)
        self._fast = self._table_fast = None
        if decode:
            self._fast = (rows_in, self._fast_steps(rows, new_len), meta)
        return meta

    def _decode_step(self, rows) -> StepMeta | None:
        """One token per sequence: each list gains or drops at most one page, so boolean masks do
        what counts and repeats do in the general path (half the numpy calls). None when a
        sequence would drop several pages (the first decode step after a long prefill)."""
        ps, ring = self.pool.page_size, self.ring
        old = self.seq_len[rows]
        if int(old.max()) >= self.max_seq_len:
            self._too_long(rows, old + 1)
        first = self.first[rows]
        drop = None
        if self.window is not None:
            dead = np.maximum(old - (self.window - 1) - self.margin[rows], 0) // ps
            if int((dead - first).max()) > 1:
                return None
            drop = dead > first
            if drop.any():
                gone = rows[drop]
                self.pool.free(self.table[gone, first[drop] % ring])
                self.first[gone] += 1
            else:
                drop = None
        off = old % ps                                  # where this step's token goes in its page
        grow, ids = off == 0, None
        if grow.any():
            new_rows = rows[grow]
            count = self.count[new_rows]
            self._check_ring(count + 1 - self.first[new_rows])
            ids = self.pool.alloc(len(new_rows))
            self._set_pages(new_rows, count % ring, ids)
            self.count[new_rows] = count + 1
        else:
            grow = None
        new_len = old + 1
        self.seq_len[rows] = new_len
        _, kv_indptr, kv_indices, kv_start = self._page_lists(rows, drop, grow, ids)
        slots = self.table[rows, (old // ps) % ring].astype(np.int64) * ps + off
        return StepMeta(kv_indptr, kv_indices, (off + 1).astype(np.int32), kv_start,
                        np.arange(len(rows) + 1, dtype=np.int32), slots, new_len)

    def _drop_out_of_window(self, rows, old) -> np.ndarray | None:
        """Free the pages no query from position ``old`` on can see (every token below
        old - window + 1); the pages freed per row, or None (none, or not a sliding kind)."""
        if self.window is None:
            return None
        first = self.first[rows]
        drop = np.maximum(np.maximum(old - (self.window - 1) - self.margin[rows], 0) // self.pool.page_size - first, 0)
        if not drop.any():
            return None
        self._release(rows, first, drop)
        self.first[rows] = first + drop
        return drop

    def _grow_to(self, rows, want) -> tuple[np.ndarray, np.ndarray] | None:
        """Allocate until each row holds ``want`` logical pages (pages a row already took ahead
        are kept); (pages added per row, their ids in row order), or None when none was needed."""
        count = self.count[rows]
        grow = np.maximum(want - count, 0)
        n = int(grow.sum())
        if not n:
            return None
        self._check_ring(np.maximum(want, count) - self.first[rows])
        ids = self.pool.alloc(n)
        self._set_pages(*self._ring_slots(rows, count, grow), ids)
        self.count[rows] = np.maximum(count, want)
        return grow, ids

    def _set_pages(self, rows, cols, ids) -> None:
        self.table[rows, cols] = ids
        if self.track_updates:
            self._updates.append((rows * self.mirror_stride + cols + self.mirror_base, ids))

    def take_updates(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat indices into the mirror, page ids) of every table write since the last call, in
        order (a later write to a slot wins); None when there was none."""
        ups, self._updates = self._updates, []
        if len(ups) <= 1:
            return ups[0] if ups else None
        return np.concatenate([u[0] for u in ups]), np.concatenate([u[1] for u in ups])

    def table_step(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A decode step (one token per sequence) for the Triton kernel, which reads the page table
        and the lengths, not page lists: returns (seq_lens after the step, slot of each new token),
        valid until the next step.

        The page work is done for up to ``page_size`` steps at once (``_table_plan``): each row gets
        its next page one page ahead of need, and sliding pages are freed at those steps only, so
        a row may hold one dead page for at most ``page_size`` steps. The steps in between return
        precomputed rows of lengths and slots: no numpy work, no table writes to mirror.
        """
        plan = self._table_fast
        if plan is not None and plan[0] is rows and plan[1] < plan[2]:
            _, j, n, lens, slots = plan
            self._table_fast = (rows, j + 1, n, lens, slots)
            self.seq_len[rows] = lens[j]
            return lens[j], slots[j]
        return self._table_plan(rows)

    def table_tokens(self, rows_in, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """A step of ``tokens`` new tokens per sequence for the Triton kernel run as one query row
        per token (a draft to verify, a short continuation, in a CUDA graph): returns (lengths
        [rows, tokens], what query t sees: the past and new tokens through t; slots [rows, tokens]).
        Pages below the first new token's window are freed, pages for every new token taken."""
        self._cached = self._fast = self._table_fast = None
        rows = np.asarray(rows_in, dtype=np.int64)
        ps = self.pool.page_size
        old = self.seq_len[rows]
        self._append(rows, old, old + tokens)
        pos = old[:, None] + np.arange(tokens)[None, :]
        slots = self.table[rows[:, None], (pos // ps) % self.ring].astype(np.int64) * ps + pos % ps
        return pos + 1, slots

    def _append(self, rows, old_len, new_len):
        """Lengths from ``old_len`` to ``new_len``: refused past max_seq_len, pages no query from
        old_len on sees freed, pages through new_len taken; (pages dropped, pages grown)."""
        if (new_len > self.max_seq_len).any():
            self._too_long(rows, new_len)
        drop = self._drop_out_of_window(rows, old_len)
        grow_ids = self._grow_to(rows, -(-new_len // self.pool.page_size))
        self.seq_len[rows] = new_len
        self.active[rows] = True
        return drop, grow_ids

    def _table_plan(self, rows_in) -> tuple[np.ndarray, np.ndarray]:
        self._cached = self._fast = None          # the page lists, if a later step wants them, are regathered
        rows = np.asarray(rows_in, dtype=np.int64)
        ps, ring = self.pool.page_size, self.ring
        old = self.seq_len[rows]
        top = int(old.max())
        if top >= self.max_seq_len:
            self._too_long(rows, old + 1)
        self._drop_out_of_window(rows, old)
        # Pages through the one after this step's token's, never past max_seq_len's last one.
        self._grow_to(rows, np.minimum(old // ps + 2, -(-self.max_seq_len // ps)))
        count = self.count[rows]
        # Steps the allocated pages cover for every row, at most page_size (the dead-page lag).
        n = int(min((count * ps - old).min(), ps, self.max_seq_len - top))
        lens = old[None, :] + np.arange(1, n + 1)[:, None]     # [n, rows]: lengths after each step
        # Each row's n tokens lie in its current page and (past its end) the next: two gathers of
        # [rows], not one of [n, rows] (the plan step's largest cost at big batches).
        page = old // ps
        here = self.table[rows, page % ring].astype(np.int64) * ps
        then = self.table[rows, (page + 1) % ring].astype(np.int64) * ps - ps
        at = lens - 1 - page * ps                             # offset from the current page's start
        slots = np.where(at < ps, here, then) + at
        self.seq_len[rows] = lens[0]
        self._table_fast = (rows_in, 1, n, lens, slots)
        return lens[0], slots[0]

    def _too_long(self, rows, new_len):
        i = int(np.argmax(new_len > self.max_seq_len))
        raise ValueError(f"sequence {int(rows[i])} would hold {int(new_len[i])} tokens; "
                         f"Gemma4OptConfig.max_seq_len is {self.max_seq_len}")

    def _check_ring(self, live_after):
        if (live_after > self.ring).any():
            raise ValueError(f"a sequence needs {int(live_after.max())} live pages, ring holds {self.ring}: raise "
                             f"max_step_tokens (prefill chunk) for this sliding kind")

    def _fast_steps(self, rows, length) -> int:
        """Decode steps after this one that need no page added or freed, for every sequence."""
        ps = self.pool.page_size
        room = (-length) % ps                                   # tokens until a new page is needed
        steps = int(room.min())
        if steps == 0:          # some sequence fills its page now: the usual case in big, ragged batches
            return 0
        steps = min(steps, int(self.max_seq_len - length.max()))
        if self.window is not None:
            # The step with old length L + j frees a page once L + j - window + 1 reaches (first + 1) * ps.
            steps = min(steps, int(((self.first[rows] + 1) * ps + self.window - 1 + self.margin[rows] - length).min()))
        return max(steps, 0)

    def _page_lists(self, rows, drop, grow, ids):
        """(rows, kv_indptr, kv_indices, kv_start): edited from the last step's when the rows are
        the same (pages only came and went at the ends of lists), else gathered from the table."""
        ps, ring = self.pool.page_size, self.ring
        cached = self._cached
        if cached is not None and np.array_equal(cached[0], rows):
            if drop is not None or grow is not None:
                cached = self._cached = edit_page_lists(cached, drop, grow, ids, ps)
            return cached
        # Live pages from the lengths, not the allocation count: table_step takes a page ahead.
        first = self.first[rows]
        live = -(-self.seq_len[rows] // self.pool.page_size) - first
        kv_indptr = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(live, out=kv_indptr[1:])
        j = np.arange(int(live.max()) if len(rows) else 0)
        grid = self.table[rows[:, None], (first[:, None] + j[None, :]) % ring]
        kv_indices = grid[j[None, :] < live[:, None]]
        self._cached = (rows.copy(), kv_indptr, kv_indices, first * ps)
        return self._cached

    def _meta(self, rows, old_len, new, new_len, drop, grow_ids) -> StepMeta:
        ps, ring = self.pool.page_size, self.ring
        grow, ids = grow_ids if grow_ids is not None else (None, None)
        _, kv_indptr, kv_indices, kv_start = self._page_lists(rows, drop, grow, ids)
        if len(new) and (new == 1).all():                 # decode: one token per sequence
            qo_indptr = np.arange(len(rows) + 1, dtype=np.int32)
            tok_rows, pos = rows, old_len
        else:
            qo_indptr = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum(new, out=qo_indptr[1:])
            tok_rows = rows[np.repeat(np.arange(len(rows)), new)]
            pos = np.repeat(old_len, new) + ranks(new)
        slots = self.table[tok_rows, (pos // ps) % ring].astype(np.int64) * ps + pos % ps
        return StepMeta(kv_indptr, kv_indices, ((new_len - 1) % ps + 1).astype(np.int32), kv_start, qo_indptr,
                        slots, new_len)

    def _ring_slots(self, rows, start, n) -> tuple[np.ndarray, np.ndarray]:
        """(table rows, ring columns) of ``n[i]`` consecutive logical pages of ``rows[i]`` from
        ``start[i]``, in row order."""
        if n.max(initial=0) == 1:       # decode: at most one page a row, no repeats needed
            sel = n > 0
            return rows[sel], start[sel] % self.ring
        seq_of = np.repeat(np.arange(len(rows)), n)
        return rows[seq_of], (np.repeat(start, n) + ranks(n)) % self.ring

    def _release(self, rows, start, n) -> None:
        self.pool.free(self.table[self._ring_slots(rows, start, n)])

    def release(self, rows) -> None:
        """Return every page of these sequences to the pool (generate finished or raised)."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[self.active[rows]]
        self._release(rows, self.first[rows], self.count[rows] - self.first[rows])
        self._cached = self._fast = self._table_fast = None
        self.seq_len[rows] = self.first[rows] = self.count[rows] = self.margin[rows] = 0
        self.active[rows] = False
