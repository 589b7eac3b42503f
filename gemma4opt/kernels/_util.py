"""Small helpers shared by the Triton launchers."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Programmatic dependent launch (Hopper+): a kernel launched with it may be scheduled while the
# kernel before it is still finishing; it waits (griddepcontrol.wait) before touching memory, so
# results are unchanged and only the launch gap between back-to-back kernels is hidden. Decode
# steps are chains of ~1-3 us kernels where that gap is a large part of each kernel's time.
# GEMMA4OPT_PDL=0 turns it off (A/B runs); set_pdl() does the same in-process (benchmarks).
PDL_DEFAULT = os.environ.get("GEMMA4OPT_PDL", "1") != "0"
_PDL = {"on": PDL_DEFAULT}


def set_pdl(on: bool) -> None:
    _PDL["on"] = bool(on)


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_flags(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that starts with ``pdl_prologue(PDL)``, for tensors on t's device."""
    if _PDL["on"] and t.is_cuda and _pdl_capable(t.device.index if t.device.index is not None
                                                  else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    # Before any load or store: the previous kernel's writes become visible here, and it may still
    # be reading what this kernel overwrites until then. Dependents are let in at once: they too
    # wait here, so it only overlaps their launch with this kernel.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Split-K GEMM tiles (kernels/skinny_linear.py, kernels/fp8_linear.py) summing their fp32 partials
# in the kernel, the tile's last split to finish (an atomic count per N tile), instead of a second
# launch: off unless turned on (GEMMA4OPT_SPLIT_FOLD=1, use_split_fold) until measured end to end.
SPLIT_FOLD_DEFAULT = os.environ.get("GEMMA4OPT_SPLIT_FOLD") == "1"
_FOLD = {"on": SPLIT_FOLD_DEFAULT}
# One int32 count per N tile: 65536 covers a 262144-row lm_head in tiles of 4 rows.
MAX_TILES = 65536
_COUNTS: dict = {}


def use_split_fold(on: bool) -> None:
    """Split-K tiles sum their partials in the kernel, or in a second launch (benchmarks). The
    autotuners key on it, so tiles tuned one way are not reused the other."""
    _FOLD["on"] = bool(on)


def split_fold_counts(t: torch.Tensor, n_tiles: int) -> torch.Tensor | None:
    """The zeroed counts of t's device when folding is on and n_tiles fit, else None. Made outside
    CUDA-graph capture only (a buffer from a capture would belong to that graph's pool); every
    folding launch leaves them zero."""
    if not _FOLD["on"] or n_tiles > MAX_TILES:
        return None
    buf = _COUNTS.get(t.device)
    if buf is None and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = _COUNTS[t.device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=t.device)
    return buf


@triton.jit
def last_split(CNT, SPLIT_K: tl.constexpr):
    """Whether this program is the last of its N tile's SPLIT_K splits to have stored its partial
    (as kernels/moe_router_decode.py's tail: every thread's store is issued before the count goes up,
    the barrier; the atomic's release / acquire makes all splits' partials visible to the last one).
    The last one must set CNT[tile] back to 0 when it is done."""
    tl.debug_barrier()
    done = tl.atomic_add(CNT + tl.program_id(0), 1, sem="acq_rel")
    return done == SPLIT_K - 1


@triton.jit
def sum_split_partials(P, total, mo, no, M, N, omask, SPLIT_K: tl.constexpr):
    """total + the partials P[s, mo, no] (contiguous [SPLIT_K, M, N]) added in split order, as the
    split-sum kernels add them (same bits); read past L1, which other SMs' stores did not go through."""
    for s in tl.static_range(SPLIT_K):
        total += tl.load(P + (s * M + mo).to(tl.int64) * N + no, mask=omask, other=0.0, cache_modifier=".cg")
    return total


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride on D (a copy only if the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


_ROWS = {"decode_warps": None}


def set_decode_row_warps(warps: int | None) -> None:
    """Warps of every row kernel's program at decode (fewer than 128 rows), or None for
    row_launch's rule (benchmarks: bench_kernels.py --sweep rows, bench_generate's -rowsN systems)."""
    _ROWS["decode_warps"] = warps


def row_launch(d: int, rows: int | None = None) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program per row of length d. With few rows (decode: fewer than
    a GPU's SMs) each program is latency-bound: more warps put more of the row's loads in flight."""
    block = triton.next_power_of_2(max(d, 1))
    if rows is not None and rows < 128:
        return block, _ROWS["decode_warps"] or max(4, min(32, block // 256))
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16
