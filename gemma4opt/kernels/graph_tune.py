"""Tile choice for the skinny decode GEMMs, timed as a decode step runs them.

Triton's autotuner times each config one call at a time between L2 flushes (``do_bench``): the lone
kernel, its launch and ramp included, with nothing before or after it. A decode step runs the GEMMs
back to back in a CUDA graph, launched with programmatic dependent launch, each streaming its
weight from HBM. The two rank tiles differently: on an H200 the tiles Triton's autotuner picked
for the e4b's fp8 GEMMs at one row ran 8-21 % slower in a graph than the best of the same list
(gate/up 19.0 against 15.7 µs, lm_head 168 against 149; benchmarks/results/fp8_linear_sweeps_h200.jsonl),
and the 31b's bf16 o_proj at 32 rows 30.3 against 24.2 (sweeps_h200.jsonl).

``GraphTuner`` times every candidate tile the way the sweeps and ops/pick.py's per-shape picks
time a GEMM: calls back to back in one CUDA graph, each on its own copy of the weight, the copies
together twice the L2. One choice per key (the kernel's shape class), made on the key's first call
outside graph capture (decode graphs run a step eagerly before capturing it). Where a graph cannot
be captured (out of memory for the copies, a driver refusal) the caller's fallback runs: Triton's
autotuner as before.
"""
from __future__ import annotations

from typing import Callable

import torch


def weight_copies(nbytes: int, l2_bytes: int, most: int = 64) -> int:
    """How many copies of a weight of ``nbytes`` together hold twice the L2 (at least 1, at most ``most``)."""
    return max(1, min(most, -(-2 * l2_bytes // max(nbytes, 1))))


def graph_ms(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], calls: int, reps: int) -> float:
    """Median ms per call of ``fn(w)``, ``calls`` calls back to back in one CUDA graph, cycling
    through ``weights``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):           # first calls outside the capture (allocator, cuBLAS handles)
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def weight_set(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and enough copies of it to hold twice the L2 (every call then reads from HBM)."""
    copies = weight_copies(weight.numel() * weight.element_size(),
                           torch.cuda.get_device_properties(weight.device).L2_cache_size)
    return [weight] + [weight.clone() for _ in range(copies - 1)]


_ON = {"graph": True}


def use_graph_tuning(on: bool = True) -> None:
    """Tiles timed in a graph (default) or by Triton's autotuner (benchmarks: the tuning's share).
    Forgets the choices made so far; callers' autotuners keep theirs (clear them too)."""
    _ON["graph"] = bool(on)
    for tuner in GraphTuner.instances:
        tuner.best.clear()


def graph_tuning() -> bool:
    return _ON["graph"]


class GraphTuner:
    """One kernel's tile per key, the fastest of its candidates timed in a CUDA graph."""

    instances: list["GraphTuner"] = []

    def __init__(self, name: str):
        self.name = name
        self.best: dict[tuple, dict] = {}
        self.timings: dict[tuple, dict[str, float]] = {}
        GraphTuner.instances.append(self)

    def choose(self, key: tuple, candidates: list[dict], run: Callable[[dict, torch.Tensor], object],
               weight: torch.Tensor) -> dict | None:
        """The tile for ``key``: remembered, else each candidate timed as ``run(tile, w)`` over copies of
        ``weight``. None (the caller's own tuning runs) while a graph is being captured, when graph
        tuning is off, or when no candidate could be timed."""
        got = self.best.get(key)
        if got is not None or not _ON["graph"] or not candidates or not _timeable(weight):
            return got
        if torch.cuda.is_current_stream_capturing():
            return None
        try:
            weights = weight_set(weight)
        except torch.OutOfMemoryError:
            return None
        calls = max(8, len(weights))
        times = {}
        for tile in candidates:
            try:
                times[tile_name(tile)] = (graph_ms(lambda w: run(tile, w), weights, calls, 5), tile)
            except Exception:       # noqa: BLE001 - a tile this GPU refuses (resources) is not a candidate
                if weight.is_cuda:
                    torch.cuda.synchronize()
        del weights
        if not times:
            return None
        name, (_, tile) = min(times.items(), key=lambda kv: kv[1][0])
        self.timings[key] = {k: v[0] for k, v in times.items()}
        self.best[key] = tile
        return tile


def _timeable(weight: torch.Tensor) -> bool:
    return weight.is_cuda


def tile_name(tile: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(tile.items()))


def config_tiles(configs) -> list[dict]:
    """triton.Config objects as the ``config=`` dicts the skinny kernels' wrappers take."""
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]
