"""Small helpers shared by the Triton launchers."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# False under Triton's interpreter (CPU tests), whose limits the kernels work around where this is.
COMPILED = os.environ.get("TRITON_INTERPRET") != "1"

# Programmatic dependent launch (Hopper+): a kernel launched with it may be scheduled while the
# kernel before it is still finishing; it waits (griddepcontrol.wait) before touching memory, so
# results are unchanged and only the launch gap between back-to-back kernels is hidden. Decode
# steps are chains of ~1-3 us kernels where that gap is a large part of each kernel's time.
# GEMMA4OPT_PDL=0 turns it off (A/B runs); set_pdl() does the same in-process (benchmarks).
PDL_DEFAULT = os.environ.get("GEMMA4OPT_PDL", "1") != "0"
_PDL = {"on": PDL_DEFAULT}


def set_pdl(on: bool) -> None:
    _PDL["on"] = bool(on)


def zeroed_counters(cache: dict, device: torch.device, size: int) -> torch.Tensor | None:
    """A device's int32 counters for a kernel whose last program to finish resets the ones it counted
    on (so they are zero before every call and no memset is launched): made once per device, outside
    CUDA-graph capture (a buffer from a capture would belong to that graph's memory pool); None while
    a capture runs before the first call made them."""
    buf = cache.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = cache[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return COMPILED and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_flags(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that starts with ``pdl_prologue(PDL)``, for tensors on t's device."""
    if _PDL["on"] and t.is_cuda and _pdl_capable(t.device.index if t.device.index is not None
                                                  else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    # Before any store, and any load of what the previous kernel may write: its writes become
    # visible here, and it may still be reading what this kernel overwrites until then. Dependents
    # are let in at once: they too wait here, so it only overlaps their launch with this kernel, and
    # once a kernel is past this point every kernel before it has ended. Loads of what no kernel
    # of the step writes (weights, the step inputs copied in before its first kernel, KV of earlier
    # steps) may come first: the decode attention's page table and first tile of past tokens.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride on D (a copy only if the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def dense(*ts):
    """Each tensor (or None) as is when contiguous, else a contiguous copy. The kernels index their
    weight and scale vectors as packed; a parameter can be given other strides after optimize()
    (``p.data = ...``: Dynamo recompiles with it), which would otherwise read the wrong values."""
    out = tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in ts)
    return out[0] if len(out) == 1 else out


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
