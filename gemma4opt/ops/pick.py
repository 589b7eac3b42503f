"""Per-shape picks between a gemma4opt Triton kernel and the path it replaces, timed once each.

Used where neither side wins everywhere (``gemma4opt.linear`` and ``gemma4opt.linear_softcap``
against cuBLAS, ``gemma4opt.moe_experts`` against HF's experts path): the first call of a shape times both, outside any CUDA graph
capture (decode graphs warm up eagerly first), after checking that the Triton result matches.
Each optimized model keeps its own picks (ops/state.py): the same shape may pick differently on
another model's weights, and the report shows the model's own.
"""
from __future__ import annotations

from typing import Callable

import torch


class ShapePicks:
    """One op's per-shape picks: shape key -> whether the Triton kernel runs, and the shapes whose
    Triton kernel failed (with why)."""

    def __init__(self, margin: float):
        self.margin = margin
        self.chosen: dict[tuple, bool] = {}
        self.failed: dict[tuple, str] = {}

    def pick(self, key: tuple, time_both: Callable[[], tuple[float, float]]) -> bool:
        """Whether shape ``key`` runs the Triton kernel: ``time_both()`` -> (Triton ms, other ms) is
        called once per key, never while a CUDA graph is being captured (the other path then, not
        remembered). Triton must be faster by ``margin`` (ties go to the path the model had). A
        Triton kernel that fails to compile, run or match leaves that shape on the other path, and
        ``failures()`` says why, rather than failing generate."""
        got = self.chosen.get(key)
        if got is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return False
            try:
                t_triton, t_other = time_both()
            except Exception as e:      # noqa: BLE001 - any kernel failure means: the other path
                self.failed[key] = f"{type(e).__name__}: {str(e)[:200]}"
                t_triton, t_other = float("inf"), 0.0
            got = self.chosen[key] = t_triton < self.margin * t_other
        return got

    def picks(self) -> dict[tuple, bool]:
        """The shapes timed so far and whether each runs the Triton kernel."""
        return dict(self.chosen)

    def failures(self) -> dict[tuple, str]:
        """Shapes whose Triton kernel raised when it was timed (they run the other path), with the error."""
        return dict(self.failed)


def check_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-2, what: str = "Triton kernel",
                other: str = "the path it replaces") -> None:
    """Raise unless ``got`` is ``want`` up to 16-bit rounding (relative error of the whole output)."""
    err = (got.float() - want.float()).norm()
    ref = want.float().norm()
    if not err <= rel * ref + 1e-6:         # NaN fails too
        raise ValueError(f"{what} differs from {other}: relative error {float(err / ref):.3g} > {rel}")


def bench_cold(fn) -> float:
    """Median ms of ``fn`` with L2 flushed before each call: decode streams its weights from HBM."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def _graph_ms(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], calls: int, reps: int) -> float:
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


def weight_copies(nbytes: int, l2_bytes: int, most: int = 64) -> int:
    """How many copies of a weight of ``nbytes`` together hold twice the L2 (at least 1, at most ``most``)."""
    return max(1, min(most, -(-2 * l2_bytes // max(nbytes, 1))))


def check_then_time(triton_fn: Callable[[torch.Tensor], object], other_fn: Callable[[torch.Tensor], object],
                    weight, what: str, other: str) -> tuple[float, float]:
    """A shape's first call: the Triton path's result checked against the other's on ``weight``
    (check_close), then both timed as decode runs them (time_in_graph)."""
    check_close(triton_fn(weight), other_fn(weight), what=what, other=other)
    return time_in_graph(triton_fn, other_fn, weight)


def time_in_graph(triton_fn: Callable[[torch.Tensor], object], other_fn: Callable[[torch.Tensor], object],
                  weight) -> tuple[float, float]:
    """(Triton ms, other ms) per call of ``fn(weight)``, each timed as a decode step runs it: calls
    back to back in a CUDA graph, so that launch gaps, a split-K GEMM's second kernel and
    programmatic dependent launch count as they do there, and each call on its own copy of the
    weight, the copies together twice the L2, so that every call streams its weight from HBM.
    ``weight`` may be a tuple of tensors (an MLP's two weights), copied together.
    Why not ``bench_cold``: one call at a time between L2 flushes, it measured the lone kernel, and
    its picks differed from one run to the next (the 26b-a4b's decode step was 1.4 % faster with
    every GEMM on Triton than with the shapes it gave cuBLAS, on an H200). Falls back to
    ``bench_cold`` where a graph cannot be captured."""
    parts = weight if isinstance(weight, tuple) else (weight,)
    copies = weight_copies(sum(w.numel() * w.element_size() for w in parts),
                           torch.cuda.get_device_properties(parts[0].device).L2_cache_size)
    calls = max(8, copies)

    def clone():
        return tuple(w.clone() for w in parts) if isinstance(weight, tuple) else weight.clone()

    try:
        weights = [weight] + [clone() for _ in range(copies - 1)]
        return _graph_ms(triton_fn, weights, calls, 10), _graph_ms(other_fn, weights, calls, 10)
    except (RuntimeError, torch.OutOfMemoryError):
        torch.cuda.synchronize()
        return bench_cold(lambda: triton_fn(weight)), bench_cold(lambda: other_fn(weight))
