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


# Weight prefetch before the PDL wait: a GEMM's weights are not written by the kernels before it, so
# its programs, scheduled early by PDL while the previous kernel (a norm, the attention: a few us,
# few SMs) still runs, ask L2 for the first bytes of their weight rows before they wait. At decode a
# layer's GEMMs each start by waiting out HBM's latency with an empty pipeline; this fills it during
# the kernel before. The budget caps the bytes one GEMM asks for (spread evenly over its rows, so
# every program finds the same share waiting): well under L2 (50 MB on the H100 / H200), so
# prefetched lines are not evicted before they are read. GEMMA4OPT_PREFETCH_MB=0 turns it off.
PREFETCH_MB_DEFAULT = float(os.environ.get("GEMMA4OPT_PREFETCH_MB", "16"))
_PREFETCH = {"mb": PREFETCH_MB_DEFAULT}


def set_weight_prefetch(mb: float) -> None:
    """The bytes (MiB) a decode GEMM asks L2 for before its PDL wait; 0 turns it off (benchmarks)."""
    _PREFETCH["mb"] = float(mb)


def weight_prefetch(w: torch.Tensor, pdl: bool) -> int:
    """Bytes of each row of w [N, K] that a GEMM launched with ``pdl`` prefetches into L2 before its
    wait (a multiple of 16, as the bulk prefetch takes; 0 where rows are not 16-byte aligned)."""
    rows, row_bytes, stride_bytes = w.shape[0], w.shape[-1] * w.element_size(), w.stride(0) * w.element_size()
    if not pdl or _PREFETCH["mb"] <= 0 or not rows or w.data_ptr() % 16 or stride_bytes % 16:
        return 0
    return min(row_bytes, int(_PREFETCH["mb"] * 2**20) // rows) // 16 * 16


@triton.jit
def _bulk_prefetch_l2(ptr, nbytes):
    # One asynchronous bulk copy of nbytes (a multiple of 16) at ptr (16-byte aligned) into L2,
    # skipped where nbytes is 0; nothing is read into registers. The int32 result is a dummy that
    # inline asm must have; not pure, so it is kept.
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_pieces(row0, N, lo, hi, PF, ELEM: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row, offset in elements, bytes) of each lane's piece of prefetch_rows' request: the first
    PF bytes (rounded down to 16) of elements [lo, hi) of rows row0 .. row0 + BLOCK_N - 1, cut in
    pieces over 128 lanes (BLOCK_N if more) so that a program issues each byte once, not once per
    thread that holds a row. Rows >= N and pieces past the span get 0 bytes (their row clamped to N - 1)."""
    LANES: tl.constexpr = 128 if BLOCK_N < 128 else BLOCK_N
    i = tl.arange(0, LANES)
    r = i % BLOCK_N
    span = tl.minimum(PF, (hi - lo) * ELEM) // 16 * 16
    piece = tl.cdiv(tl.cdiv(span, LANES // BLOCK_N), 16) * 16
    off = (i // BLOCK_N) * piece
    size = tl.minimum(tl.maximum(span - off, 0), piece)
    size = tl.where(row0 + r < N, size, 0)
    return tl.minimum(row0 + r, N - 1).to(tl.int64), lo + off // ELEM, size


@triton.jit
def prefetch_rows(W, row0, N, swn, lo, hi, PF, BLOCK_N: tl.constexpr):
    """Ask L2 for the first PF bytes (a multiple of 16) of elements [lo, hi) of W's rows
    row0 .. row0 + BLOCK_N - 1 that are < N (row stride swn elements). Compiled GPU code only
    (inline PTX, sm_90+): call it under ``if PDL``."""
    ELEM: tl.constexpr = W.dtype.element_ty.primitive_bitwidth // 8
    row, off, size = prefetch_pieces(row0, N, lo, hi, PF, ELEM, BLOCK_N)
    _bulk_prefetch_l2(W + row * swn + off, size)


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
