"""Small helpers shared by the Triton launchers."""
from __future__ import annotations

import torch
import triton


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride on D (a copy only if the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def row_launch(d: int, rows: int | None = None) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program per row of length d. With few rows (decode: fewer than
    a GPU's SMs) each program is latency-bound: more warps put more of the row's loads in flight."""
    block = triton.next_power_of_2(max(d, 1))
    if rows is not None and rows < 128:
        return block, max(4, min(32, block // 256))
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16
