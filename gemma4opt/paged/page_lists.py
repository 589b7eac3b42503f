"""Vectorized edits of concatenated per-sequence page lists (numpy only; see pages.py)."""
from __future__ import annotations

import numpy as np


def edit_page_lists(cached, drop, grow, ids, ps):
    """The cached (rows, kv_indptr, kv_indices, kv_start) after dropping ``drop[i]`` pages from the
    front and appending ``grow[i]`` new pages (``ids``, in sequence order) to the back of each
    sequence's list, without regathering every live page. ``drop`` / ``grow``: counts, or boolean
    masks in decode steps (at most one page each)."""
    rows, indptr, indices, kv_start = cached
    if drop is not None:
        keep = np.ones(len(indices), dtype=bool)      # np.delete/np.insert cost ~15-25 µs of Python each
        keep[indptr[:-1][drop] if drop.dtype == bool else np.repeat(indptr[:-1], drop) + ranks(drop)] = False
        indices = indices[keep]
        indptr = indptr - _prefix(drop)
        kv_start = kv_start + drop * ps
    if grow is not None:
        ends = indptr[1:][grow] if grow.dtype == bool else np.repeat(indptr[1:], grow)
        at = ends + np.arange(len(ids))                # each list's end, in the grown array
        out = np.empty(len(indices) + len(ids), dtype=indices.dtype)
        old = np.ones(len(out), dtype=bool)
        old[at] = False
        out[at] = ids
        out[old] = indices
        indices = out
        indptr = indptr + _prefix(grow)
    return rows, indptr, indices, kv_start


def _prefix(counts) -> np.ndarray:
    """[0, c0, c0+c1, ...] as int32 (counts or a boolean mask)."""
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out


def ranks(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] for counts c, without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts
